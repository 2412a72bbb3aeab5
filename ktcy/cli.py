"""The `ktcy` command line: info, bench, convert, run-block."""
import argparse
import json
import sys

from ktcy import report


def _mark(flag):
    return "\u2713" if flag else "\u2717"


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
    print(f"\nPolicy: forced ISA = {pol['forced_isa'] or 'none'}, AMX {'enabled' if pol['amx_enabled'] else 'disabled (CPUINFER_ENABLE_AMX=OFF)'}")
    print(f"Available ISAs: {', '.join(data['available_isas'])}")
    print("Kernel per format:")
    for fmt, row in data["kernels"].items():
        if "error" in row:
            print(f"  {fmt:15s} unavailable: {row['error']}")
        else:
            print(f"  {fmt:15s} {row['isa']:8s} {row['variant']:18s} ({row['reason']})")
    b = data["build"]
    print("\nBuilt with: " + ", ".join(f"{k}={'ON' if b[k] else 'OFF'}" for k in ("amx", "avx512_bf16", "avx512_vbmi")))
    return 0


def cmd_bench(args):
    from ktcy import bench, roofline
    from ktcy.threads import set_num_threads, get_num_threads
    if args.threads:
        set_num_threads(args.threads)
    roof = roofline.roofline()
    if args.roofline:
        print(json.dumps(roof, indent=2) if args.json else bench.format_roofline(roof))
        return 0
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        print(f"--tokens takes comma-separated integers, got {args.tokens!r}", file=sys.stderr)
        return 2
    if any(t < 1 for t in tokens):
        print("--tokens must be positive", file=sys.stderr)
        return 2
    H, I, E, k, note = bench.parse_shape(args.shape)
    live = sys.stderr if args.json else sys.stdout
    tty = live.isatty()

    def progress(text, transient=False):
        # On a terminal transient lines (per-expert packing) overwrite each other; elsewhere
        # only the lasting ones are written.
        if transient and not tty:
            return
        live.write(("\r" + text[:110].ljust(110) + ("" if transient else "\n")) if tty else text + "\n")
        live.flush()

    if not args.json:
        print(f"ktcy bench: {note}; {get_num_threads()} threads")
        print(bench.format_roofline(roof))
    rows = []
    for row in bench.run(args.shape, formats, tokens, args.isa, progress=progress):
        rows.append(row)
        if not args.json:
            print(bench.format_row(row))
    if args.json:
        print(json.dumps({"shape": {"name": args.shape, "hidden": H, "intermediate": I, "experts": E, "top_k": k,
                                    "note": note}, "roofline": roof, "rows": rows}, indent=2))
    return 0


def cmd_run_block(args):
    import os
    import numpy as np
    from ktcy.model import MoEModel
    from ktcy.safetensors_io import CheckpointError
    try:
        model = MoEModel.from_pretrained(args.path, rules=args.rules, backend=args.backend, layers=[args.layer])
        h = np.load(args.input)
        block = next(iter(model.blocks.values()))
        y = block.forward(h)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tmp = args.output + ".partial.npy"
    np.save(tmp, y)
    os.replace(tmp, args.output)
    print(f"{block.name}: {block.experts.kernel}; {h.shape[0]} tokens -> {args.output}")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="ktcy", description="MoE expert kernels for x86 CPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="CPU features, chosen kernels, build switches")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)
    b = sub.add_parser("bench", help="MoE forward speed against the measured roofline")
    b.add_argument("--shape", default="qwen3-30b", help="qwen3-30b | deepseek-v3 | mixtral | H,I,E,k")
    b.add_argument("--formats", default="BF16,INT8,INT4,FP8_PERCHANNEL,FP8_BLOCK",
                   help="comma-separated formats or backend names")
    b.add_argument("--tokens", default="1,4,32,128,512", help="comma-separated token counts T")
    b.add_argument("--isa", default=None, help="force one ISA (default: the dispatcher's choice)")
    b.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: all usable cores)")
    b.add_argument("--roofline", action="store_true", help="only measure and print the roofline")
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.set_defaults(func=cmd_bench)
    r = sub.add_parser("run-block", help="one MoE block of a checkpoint on hidden states from an .npy file")
    r.add_argument("path", help="Hugging Face checkpoint folder")
    r.add_argument("--layer", type=int, required=True, help="decoder layer of the MoE block")
    r.add_argument("--input", required=True, help=".npy of hidden states [T, H] (float32 or bfloat16)")
    r.add_argument("--output", required=True, help=".npy to write the block output [T, H] float32 to")
    r.add_argument("--backend", default=None, help="AMXINT8, AMXBF16, AMXINT4, INT8, INT4, BF16, FP8, ...")
    r.add_argument("--rules", default=None, help="optimize-rule YAML (KTransformers schema)")
    r.set_defaults(func=cmd_run_block)
    c = sub.add_parser("convert", help="Hugging Face MoE checkpoint -> packed ktcy layers", add_help=False)
    c.set_defaults(func=None)
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["convert"]:  # the converter owns its flags (shared with tools/convert_cpu_weights.py)
        from ktcy.convert import main as convert_main
        return convert_main(argv[1:], prog="ktcy convert")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
