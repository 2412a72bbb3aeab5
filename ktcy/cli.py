"""The `ktcy` command line: info, doctor, bench, run-block, convert.

Every command takes -v/--verbose, -q/--quiet and --debug.  An ordinary user error (a bad flag
value, a missing file, an ISA this CPU lacks) is one line on stderr and exit status 1 (2 for
usage errors); --debug shows the traceback instead."""
import argparse
import json
import os
import sys
import zipfile

from ktcy import _native, log, report
from ktcy.formats import FORMATS
from ktcy.interrupts import termination_as_interrupt
from ktcy.output_guard import publish
from ktcy.distributed import launch
from ktcy.hf import generate_cli
from ktcy.version import __version__

EXIT_ERROR, EXIT_USAGE = 1, 2
_GLOBAL_FLAGS = {"-v": "verbose", "--verbose": "verbose", "-q": "quiet", "--quiet": "quiet", "--debug": "debug"}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (the usage itself is one `--help` away)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" where a default says something (not for switches or unset values)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _mark(flag):
    return "\u2713" if flag else "\u2717"


def thread_count(text):
    """--threads: 1 .. the CPUs this process may run on."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    limit = _native.usable_cpus()
    if not 1 <= n <= limit:
        raise argparse.ArgumentTypeError(f"must be between 1 and {limit} (the CPUs this process may use), got {n}")
    return n


def _few_rows(rows):
    """A few-row path's reach for `ktcy info`: "calls of up to 4 rows", or that it has none."""
    return f"calls of up to {rows} row{'s' if rows > 1 else ''}" if rows else "none, bf16 throughout"


def cmd_info(args):
    data = report.info()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"ktcy {data['version']}  |  CPU: {data['cpu'] or 'unknown'}  |  threads: {data['threads']}")
    feats = data["features"]
    print("\nInstruction sets (cpuid):")
    print("  " + "  ".join(f"{_mark(feats[f])} {f}" for f in report.ISA_FEATURES))
    print("OS state (xgetbv, Linux AMX permission):")
    print("  " + "  ".join(f"{_mark(feats[f])} {f}" for f in report.OS_STATE))
    pol = data["policy"]
    print(f"\nPolicy: forced ISA = {pol['forced_isa'] or 'none'}, AMX "
          f"{'enabled' if pol['amx_enabled'] else 'disabled (CPUINFER_ENABLE_AMX=OFF)'}")
    print(f"Available ISAs: {', '.join(data['available_isas'])}")
    print("Kernel per format:")
    for fmt, row in data["kernels"].items():
        if "error" in row:
            print(f"  {fmt:15s} unavailable: {row['error']}")
        else:
            print(f"  {fmt:15s} {row['isa']:8s} {row['variant']:18s} ({row['reason']})")
    rows = data["tiles"]["one_panel_rows"]
    print("Few-row tiles: " + (f"one panel per tile up to {rows} rows (AMD; AVX2 INT8 one-row calls two)" if rows else
                                "AVX-512 INT4 four panels, AVX2 integer one-row calls two (not AMD)"))
    vendor = " (AMD)" if data["tiles"]["amd"] else " (not AMD)"
    e2m1 = data["tiles"]["e2m1_panel_rows"]
    print("AVX-512 MXFP4, MXFP4_A8 few-row tiles: " + (f"one panel up to {e2m1} rows (MXFP4: 1; Zen 4)" if e2m1 else
                                                       "four panels (not a Zen 4)"))
    f32, i16 = data["tiles"]["f32_rows"], data["tiles"]["i16_rows"]
    print(f"AVX-512 FP8 float path: calls of up to {f32} row{'s' if f32 > 1 else ''}" + vendor)
    print("AVX-512 FP8 decode streams prefetch into " + ("L2 (Zen 4)" if data["tiles"]["fp8_fetch_l2"] else "L1 (not a Zen 4)"))
    i16_why = (" (AMD without AVX-512 BF16)" if i16 else " (AMD with AVX-512 BF16)") if data["tiles"]["amd"] else vendor
    print("AVX-512 MXFP4 16-bit integer path: " + _few_rows(i16) + i16_why)
    print("AVX2 MXFP4 16-bit integer path: " + _few_rows(data["tiles"]["avx2_i16_rows"]) + " (every CPU)")
    print("AVX2 INT8 prefill tiles: " + ("3 rows x 2 panels (AMD with AVX-512)" if data["tiles"]["wide_tiles"]
                                         else "4 rows x 1 panel (not AMD with AVX-512)"))
    print("AVX2 FP8 prefill panels: " + ("decoded times 2^8, subnormal codes as normal floats" if data["tiles"]["fp8_normal_panels"]
                                         else "subnormal codes as subnormal floats") + vendor)
    print("AVX2 BF16, INT8 decode streams prefetch into " + ("L2 (not an AMD core without AVX-512)" if data["tiles"]["plain_fetch_l2"]
                                                             else "L1 (AMD without AVX-512)"))
    if data["tiles"]["overridden"]:
        print("Set by KTCY_TILES (the reasons in brackets are this CPU's): " + ", ".join(data["tiles"]["overridden"]))
    b = data["build"]
    print("\nBuilt with: " + ", ".join(f"{k}={'ON' if b[k] else 'OFF'}" for k in ("amx", "avx512_bf16", "avx512_vbmi")))
    print("More (memory, NUMA, huge pages, why not a faster kernel): ktcy doctor")
    return 0


def cmd_doctor(args):
    from ktcy import doctor
    data = doctor.collect()
    print(json.dumps(data, indent=2) if args.json else doctor.format_text(data))
    return 0


def cmd_bench(args):
    from ktcy import bench, roofline
    from ktcy.threads import get_num_threads, set_num_threads
    if args.threads:
        set_num_threads(args.threads)
    try:
        formats = bench.check_formats(f.strip() for f in args.formats.split(",") if f.strip())
    except ValueError as e:
        raise ValueError(f"--formats: {e}") from None
    if args.tokens is None:
        tokens = bench.FULL_TOKENS if args.full else bench.DEFAULT_TOKENS
    else:
        try:
            tokens = [int(t) for t in args.tokens.split(",")]
        except ValueError:
            raise ValueError(f"--tokens takes comma-separated integers, got {args.tokens!r}") from None
        if not tokens or any(t < 1 for t in tokens):
            raise ValueError(f"--tokens must be positive integers, got {args.tokens!r}")
    H, I, E, k, note = bench.parse_shape(args.shape)
    bench.check_isa(args.isa, formats)
    bench.check_memory(H, I, E, k, max(tokens))
    bench.check_shape(H, I, E, k, formats)
    if args.plot:  # fail on a missing matplotlib or a bad path before minutes of work
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'ktcy[plot]' (or pip install matplotlib)") from None
        _check_output_path(args.plot, "--plot", "PNG", b"\x89PNG\r\n\x1a\n")

    def say(text):  # one line per step, on stderr so stdout stays the report (or the JSON)
        if not log.quiet():
            print(text, file=sys.stderr, flush=True)

    say(f"measuring the roofline on {get_num_threads()} threads (a few seconds)")
    roof = roofline.roofline()
    if args.roofline:
        print(json.dumps(roof, indent=2) if args.json else bench.format_roofline(roof))
        return 0
    if not args.json:
        print(f"ktcy bench: {note}; {get_num_threads()} threads; T = {', '.join(map(str, tokens))}", flush=True)
        print(bench.format_roofline(roof))
        print(bench.LEGEND)
        print(bench.HEADER, flush=True)
    rows = []
    for row in bench.run(args.shape, formats, tokens, args.isa, say=say):
        rows.append(row)
        if not args.json:
            print(bench.format_row(row), flush=True)
    bw_note = bench.over_bandwidth_note(rows)
    closing = bench.summary(rows) + ([f"Note: {bw_note}"] if bw_note else [])
    if args.json:
        print(json.dumps({"shape": {"name": args.shape, "hidden": H, "intermediate": I, "experts": E, "top_k": k,
                                    "note": note}, "roofline": roof,
                          "rows": rows, "summary": closing}, indent=2))
    else:
        print("\n" + "\n".join(closing))
    if args.plot:
        bench.save_plot(rows, args.plot, f"ktcy bench: {note}, {get_num_threads()} threads")
        say(f"plot written to {args.plot}")
    return 0


def _check_output_path(path, flag, kind, magic):
    """Refuse an output path that is no place for a new file of this kind.  An existing file is
    replaced only when it starts as one (an earlier result): never a file of another kind."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):  # the result replaces the path: never a device or FIFO
        raise ValueError(f"{flag} {path!r} exists and is not a regular file; give a file name")
    if os.path.isfile(path) and os.path.getsize(path) > 0:  # an empty one (mktemp, touch) is free to take
        try:
            with open(path, "rb") as f:
                head = f.read(len(magic))
        except OSError as e:
            raise ValueError(f"{flag} {path!r} exists and cannot be read ({e.strerror}); give another name") from None
        if head != magic:
            raise ValueError(f"{flag} {path!r} exists and is not a {kind} file; ktcy replaces only a {kind} file "
                             "there, give another name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path!r}: folder {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path!r}: folder {parent!r} is not writable")


def _load_hidden_states(path, hidden):
    import ml_dtypes
    import numpy as np
    try:
        h = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # .npz: a zip archive
        raise ValueError(f"--input {path!r} is not a readable .npy file ({e})") from None
    if isinstance(h, np.ndarray) and h.dtype == np.dtype("V2"):
        h = h.view(ml_dtypes.bfloat16)  # np.save writes ml_dtypes.bfloat16 as 2-byte void
    if isinstance(h, np.ndarray) and h.dtype.kind == "f" and not h.dtype.isnative:
        h = h.astype(h.dtype.newbyteorder("="))  # written on (or for) a big-endian machine: the same values
    if not isinstance(h, np.ndarray) or h.dtype not in (np.float32, np.float64, np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"--input {path!r} holds {getattr(h, 'dtype', type(h).__name__)}; "
                         "hidden states must be float32, float64 or bfloat16")
    if h.ndim != 2 or h.shape[1] != hidden or h.shape[0] < 1:
        raise ValueError(f"--input {path!r} has shape {h.shape}; this block needs [T, {hidden}] with T >= 1")
    if h.dtype == np.float64 and (np.abs(h[np.isfinite(h)]) > np.finfo(np.float32).max).any():
        raise ValueError(f"--input {path!r} holds values beyond float32's range; the block computes in float32")
    return h


def _refuse_output_over_inputs(args):
    """The result never replaces --input, nor lands in the checkpoint or --experts folder it reads."""
    out = os.path.realpath(args.output)
    if out == os.path.realpath(args.input):
        raise ValueError(f"--output {args.output!r} is the --input file; give another name")
    for flag, folder in (("the checkpoint", args.path), ("--experts", args.experts)):
        if folder and os.path.isdir(folder) and out.startswith(os.path.realpath(folder).rstrip(os.sep) + os.sep):
            raise ValueError(f"--output {args.output!r} lies inside {flag} folder {folder!r}, which ktcy never "
                             "writes into; give a path outside it")


def cmd_run_block(args):
    import numpy as np
    from ktcy.model import MoEModel
    if args.threads:
        from ktcy.threads import set_num_threads
        set_num_threads(args.threads)
    _check_output_path(args.output, "--output", ".npy", b"\x93NUMPY")
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input!r} is not a file")
    _refuse_output_over_inputs(args)
    model = MoEModel.from_pretrained(args.path, rules=args.rules, backend=args.backend, layers=[args.layer],
                                     experts_path=args.experts)
    if not model.blocks:
        raise ValueError(f"layer {args.layer} of {args.path!r} has no MoE block")
    block = next(iter(model.blocks.values()))
    h = _load_hidden_states(args.input, block.experts.config.hidden_size)
    y = block.forward(h)
    def save(tmp):
        with open(tmp, "xb") as f:
            np.save(f, y)
    publish(args.output, save)  # a unique temporary name, renamed when complete: never half a file
    origin = f"; experts from {block.experts_from}" if args.experts else ""
    print(f"{block.name}: {block.experts.kernel}{origin}; {h.shape[0]} tokens -> {args.output}")
    return 0


def _common(parser):
    # SUPPRESS: a flag given before the command is not overwritten by the command's default
    d = argparse.SUPPRESS
    parser.add_argument("-v", "--verbose", action="count", default=d, help="more messages (-v: info, -vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", default=d, help="errors only, no progress")
    parser.add_argument("--debug", action="store_true", default=d, help="show tracebacks of errors")


def build_parser():
    parser = _Parser(prog="ktcy", description="MoE expert kernels for x86 CPUs: inspect the machine, benchmark, "
                     "convert checkpoints, run a block.", formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"ktcy {__version__}")
    _common(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name, help_text, description):
        p = sub.add_parser(name, help=help_text, description=description, formatter_class=_Formatter)
        _common(p)
        return p

    p = command("info", "CPU features, chosen kernels, build switches",
                "The CPU features (cpuid/xgetbv), the kernel chosen per weight format and why, the build switches.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)
    d = command("doctor", "everything that decides speed on this machine",
                "Versions, memory, NUMA nodes, huge pages, frequency governor, SMT, AMX permission, the kernel per "
                "format and why not a faster one, and a verdict per KTransformers backend.")
    d.add_argument("--json", action="store_true", help="machine-readable output (every field)")
    d.set_defaults(func=cmd_doctor)
    b = command("bench", "MoE forward speed against the measured roofline",
                "Time one model-shaped MoE layer (random weights, a fresh random routing every call) in each weight "
                "format and token count, against this machine's measured read bandwidth and multiply-add peaks. "
                "The default run takes about a minute on 2 cores.")
    b.add_argument("--shape", default="qwen3-30b", help="qwen3-30b | deepseek-v3 | mixtral | qwen3-next | glm-4.5-air | gpt-oss-20b | H,I,E,k")
    b.add_argument("--formats", default=",".join(FORMATS),
                   help=f"comma-separated formats or backend names (default: all: {', '.join(FORMATS)})")
    b.add_argument("--tokens", default=None, help="comma-separated token counts T (default: 1,32,512; "
                   "with --full: 1,4,32,128,512)")
    b.add_argument("--full", action="store_true", help="every token count")
    b.add_argument("--isa", default=None, help="force one ISA: amx, avx512, avx2, ref, amx_emu "
                   "(default: the dispatcher's choice)")
    b.add_argument("--threads", type=thread_count, default=None, help="OpenMP threads (default: all usable CPUs)")
    b.add_argument("--roofline", action="store_true", help="only measure and print the roofline")
    b.add_argument("--plot", metavar="PNG", default=None, help="also save time vs T per format against the "
                   "roofline (needs matplotlib: the 'plot' extra)")
    b.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    b.set_defaults(func=cmd_bench)
    r = command("run-block", "one MoE block of a checkpoint on hidden states from an .npy file",
                "Load one decoder layer's MoE block (router, experts, shared experts) from a Hugging Face "
                "checkpoint or a GGUF model (its routed experts optionally from a converted folder, --experts) and "
                "run it on hidden states [T, H] read from an .npy file.")
    r.add_argument("path", help="Hugging Face checkpoint folder, or a GGUF model (.gguf file)")
    r.add_argument("--layer", type=int, required=True, help="decoder layer of the MoE block")
    r.add_argument("--input", required=True, help=".npy of hidden states [T, H] (float32, float64 or bfloat16)")
    r.add_argument("--output", required=True, help=".npy to write the block output [T, H] float32 to")
    r.add_argument("--backend", default=None, help="AMXINT8, AMXBF16, AMXINT4, INT8, INT4, BF16, FP8, ...")
    r.add_argument("--rules", default=None, help="optimize-rule YAML (KTransformers schema)")
    r.add_argument("--experts", metavar="FOLDER", default=None,
                   help="routed experts from this folder written by `ktcy convert` from the checkpoint (router and "
                   "shared experts still from the checkpoint); a --backend in another format packs from the "
                   "checkpoint instead")
    r.add_argument("--threads", type=thread_count, default=None, help="OpenMP threads (default: all usable CPUs)")
    r.set_defaults(func=cmd_run_block)
    # commands whose flags and run() live in their own modules (they import torch only when run)
    for name, module, help_text, description in (
            ("generate", generate_cli, "text from a whole MoE model with ktcy's experts (needs the hf extra)",
             "Load a Hugging Face causal LM with transformers (CPU), its MoE experts replaced by ktcy's kernels, "
             "and generate: prints the text as it comes, then prefill and decode tokens/s and the share of time "
             "in ktcy's experts. Needs `pip install ktcy[hf]`."),
            ("launch", launch, "start ranks as torchrun does, one per NUMA node with --numa",
             "Start the ranks of an expert-parallel run on this machine with torchrun's environment (RANK, "
             "WORLD_SIZE, MASTER_ADDR, ...); with --numa one rank per NUMA node, its threads bound to the node's "
             "CPUs and its memory to the node. Example: ktcy launch --numa -- ktcy generate --model PATH ...")):
        p = command(name, help_text, description)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    c = sub.add_parser("convert", help="Hugging Face MoE checkpoint -> packed ktcy layers (ktcy convert --help)",
                       add_help=False)
    c.set_defaults(func=None)
    return parser


def _flags(args):
    return {"verbose": getattr(args, "verbose", 0) or 0, "quiet": getattr(args, "quiet", False),
            "debug": getattr(args, "debug", False)}


def _set_verbosity(verbose=0, quiet=False, **_):
    log.set_verbosity(log.ERROR if quiet else log.DEBUG if verbose >= 2 else log.INFO if verbose else log.WARNING)


def _split_global_flags(argv):
    """-v/-q/--debug anywhere in a `convert` command line (the converter parses the rest)."""
    flags, rest = {"verbose": 0, "quiet": False, "debug": False}, []
    for a in argv:
        name = _GLOBAL_FLAGS.get(a) or ("verbose" if a.startswith("-v") and set(a[1:]) == {"v"} else None)
        if name == "verbose":
            flags["verbose"] += a.count("v") if not a.startswith("--") else 1
        elif name:
            flags[name] = True
        else:
            rest.append(a)
    return flags, rest


def _user_errors():
    from ktcy.errors import TileError, UnsupportedISAError
    errors = (ValueError, TypeError, OSError, MemoryError, UnsupportedISAError, TileError)
    comm = sys.modules.get("ktcy.distributed.comm")  # loaded only by a run that used torch.distributed
    return errors + (comm.DistributedError,) if comm is not None else errors


def _guarded(fn, debug):
    """Run a command; user errors become one line on stderr (tracebacks with --debug)."""
    try:
        with termination_as_interrupt():  # SIGTERM/SIGHUP clean up as Ctrl-C does (no half files left)
            rc = fn()
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # stdout's reader left (`ktcy info --json | head -1`): quiet exit, as other Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("ktcy: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        if debug:
            raise
        text = str(e).strip().replace("\n", " ") or type(e).__name__
        print(f"ktcy: error: {text}", file=sys.stderr)
        return EXIT_ERROR


def main(argv=None):
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if first is not None and argv[first] == "convert":
        # the converter owns its flags, -q/-v/--debug included (before or after the word convert)
        rest = argv[:first] + argv[first + 1:]
        flags, _ = _split_global_flags(rest)
        from ktcy.convert import main as convert_main
        return _guarded(lambda: convert_main(rest, prog="ktcy convert"), flags["debug"])
    if from_command_line and first is not None and argv[first] == "generate" \
            and os.environ.get("OMP_WAIT_POLICY") is None:
        # torch and ktcy each keep an OpenMP team; with the default policy the idle one spins on the
        # cores the other needs (decode measured 4x slower).  libgomp reads the policy when it loads,
        # which happened on `import ktcy`: start again with it set (an explicit setting is kept).
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, "-m", "ktcy"] + argv)
    args = build_parser().parse_args(argv)
    flags = _flags(args)
    _set_verbosity(**flags)
    return _guarded(lambda: args.func(args), flags["debug"])


if __name__ == "__main__":
    sys.exit(main())
