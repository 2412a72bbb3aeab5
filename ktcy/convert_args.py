"""The converter's command line (`ktcy convert`, tools/convert_cpu_weights.py): flags, the
kt-kernel spellings (--quant-method, --cpuinfer-threads, --resume-layer, -i/-o), and errors as
one line on stderr with a non-zero exit (--debug shows the traceback)."""
import argparse
import logging
import os
import sys

from ktcy.formats import GROUP_SIZES, canonical_format, group_sizes, grouped_names, has_groups
from ktcy.interrupts import termination_as_interrupt
from ktcy.safetensors_io import strict_json

INPUT_TYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}
QUANT_CONFIG_KEYS = ("method", "per_channel", "group_size")
# kt-kernel's --quant-method values; ktcy has one layout per format, so its moe_* variants map
# onto the same formats.
KT_QUANT_METHODS = {"int4": "INT4", "int8": "INT8", "moe_int4": "INT4", "moe_int8": "INT8"}
# kt-kernel converter flags that mean nothing here: accepted so its command lines run unchanged.
IGNORED_FLAGS = {
    "threadpool_count": "--threadpool-count: ktcy uses one OpenMP pool (size it with --threads)",
    "gpu": "--gpu: ktcy converts on the CPU",
    "no_merge_safetensor": "--no-merge-safetensor: ktcy always writes one file per layer, nothing is merged",
    "fp8_expert_batch": "--fp8-expert-batch: FP8 experts are dequantized one at a time on the CPU",
}
EXAMPLES = """examples:
  %(prog)s --input Qwen3-30B-A3B --output qwen-int8 --method AMXINT8
  %(prog)s --input-path DeepSeek-V3 --input-type fp8 --output ds-int4 --quant-method int4 --cpuinfer-threads 60
  %(prog)s --input-bf16-hf-path model-bf16 --output-fp8-hf-path model-fp8 \\
      --quant-config '{"method": "FP8", "per_channel": true}'
"""


class UsageError(ValueError):
    """Flags that do not go together or are missing: a malformed command line (exit status 2,
    as argparse's own errors)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog="convert_cpu_weights.py"):
    p = _Parser(prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                description="Converts a Hugging Face MoE checkpoint (BF16/F16/F32/FP8, released INT4/MXFP4) or a\n"
                            "GGUF model into packed ktcy expert layers, one file per layer, or a Hugging Face\n"
                            "checkpoint into a Hugging Face FP8 per-channel one.\n"
                            "The output folder is locked while a converter writes to it; nothing is ever\n"
                            "written into the input, nor over files another tool wrote (unless --overwrite).")
    io = p.add_argument_group("input and output")
    io.add_argument("--input", "--input-path", "-i", dest="input", metavar="DIR",
                    help="checkpoint folder (config.json + safetensors), or a GGUF model (a .gguf file, any part "
                         "of a split one)")
    io.add_argument("--output", "-o", metavar="DIR", help="output folder for the packed layers")
    io.add_argument("--input-type", choices=sorted(INPUT_TYPES),
                    help="expected dtype of the experts, checked (default: detected)")
    io.add_argument("--overwrite", action="store_true",
                    help="replace files in the output that another conversion or another tool wrote: every "
                         "layer file there converted differently goes, not only those of --layers "
                         "(never allowed for the input folder)")
    q = p.add_argument_group("quantization")
    q.add_argument("--method", help="target format: AMXINT8, AMXINT4, AMXBF16, INT8, INT8_GROUP, INT8_MIN, INT4, INT4_ZP, INT4_MIN, BF16, "
                                    "FP8 (128x128 blocks), FP8_PERCHANNEL, MXFP4, MXFP4_A8 (default: keep the "
                                    "checkpoint's precision)")
    q.add_argument("--quant-method", metavar="METHOD",
                   help="kt-kernel's spelling of --method: int8, int4, moe_int8, moe_int4, bf16, fp8, ...")
    q.add_argument("--quant-config", metavar="JSON",
                   help='JSON with "method" and optionally "per_channel" (true/false, FP8) and "group_size" '
                        '(INT4), e.g. \'{"method": "FP8", "per_channel": true}\'')
    q.add_argument("--group-size", type=int, metavar="N",
                   help=f"group size of the grouped formats: {', '.join(map(str, GROUP_SIZES))} (INT4 family from 32; "
                        "default: 64)")
    run = p.add_argument_group("what to convert and how")
    run.add_argument("--layers", help="MoE layers to convert, e.g. 0,3,5-7 (default: all)")
    run.add_argument("--resume", action="store_true",
                     help="keep layers already converted with the same format, group size and source; "
                          "refuse when the output holds anything else")
    run.add_argument("--resume-layer", type=int, metavar="N",
                     help="kt-kernel's resume: keep the layers below N as they are on disk and convert from N on")
    run.add_argument("--threads", "--cpuinfer-threads", dest="threads", type=int, metavar="N",
                     help="threads for quantizing (default: every CPU this process may use)")
    run.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    talk = run.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true", help="no progress output, only notes and errors")
    talk.add_argument("-v", "--verbose", action="count", default=0,
                      help="also show ktcy's log messages (logger 'ktcy'; -vv: debug messages too)")
    fp8 = p.add_argument_group("Hugging Face FP8 per-channel output (compressed-tensors float-quantized, channel)")
    fp8.add_argument("--input-bf16-hf-path", metavar="DIR", help="unquantized checkpoint to read")
    fp8.add_argument("--output-fp8-hf-path", metavar="DIR", help="folder of the FP8 per-channel checkpoint to write")
    kt = p.add_argument_group("kt-kernel flags accepted and ignored (with a note)")
    kt.add_argument("--threadpool-count", type=int, metavar="N", help="NUMA sub-pools (no effect)")
    kt.add_argument("--gpu", action="store_true", default=None, help="convert on a GPU (no effect)")
    kt.add_argument("--no-merge-safetensor", action="store_true", default=None, help="keep layer folders (no effect)")
    kt.add_argument("--fp8-expert-batch", type=int, metavar="N", help="experts dequantized at once (no effect)")
    return p


def parse_quant_config(text):
    """(format, group size or None) from --quant-config; unknown or repeated keys and non-boolean
    per_channel values are refused."""
    qc = strict_json(text, "--quant-config", "the value")  # a key given twice, or nesting too deep: refused
    if not isinstance(qc, dict):
        raise ValueError(f"--quant-config must be a JSON object like {{\"method\": \"INT8\"}}, got {type(qc).__name__}")
    unknown = sorted(set(qc) - set(QUANT_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--quant-config: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(QUANT_CONFIG_KEYS)}")
    method = qc.get("method")
    if not isinstance(method, str):
        raise ValueError(f"--quant-config needs \"method\" as a string, e.g. \"INT8\" (got {method!r})")
    per_channel = qc.get("per_channel")
    if "per_channel" in qc and not isinstance(per_channel, bool):
        raise ValueError(f"--quant-config: per_channel must be true or false (JSON booleans), got {per_channel!r}")
    fmt = canonical_format(_kt_method(method), per_channel)
    if per_channel is not None:
        consistent = {"FP8_PERCHANNEL": True, "FP8_BLOCK": False, "INT8": True}.get(fmt)
        if consistent is None or consistent != per_channel:
            raise ValueError(f"--quant-config: per_channel {str(per_channel).lower()} does not fit method {method!r} "
                             f"({fmt}); per_channel chooses between FP8 per-channel (true) and 128x128 blocks (false)")
    group = qc.get("group_size")
    if "group_size" in qc:
        if isinstance(group, bool) or not isinstance(group, int) or group not in GROUP_SIZES:
            raise ValueError(f"--quant-config: group_size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                             f"got {group!r}")
        if not has_groups(fmt):
            raise ValueError(f"--quant-config: group_size applies to {grouped_names()} only, method is {method!r} ({fmt})")
        if group not in group_sizes(fmt):
            raise ValueError(f"--quant-config: group_size {group}: {fmt} takes {', '.join(map(str, group_sizes(fmt)))}")
    return fmt, group


def _kt_method(name):
    key = name.strip().lower()
    if key == "awq":
        raise ValueError("--quant-method awq: AWQ is a checkpoint format, not a target; an AWQ checkpoint is read "
                         "as stored (INT4 with zero points) when no method is given")
    return KT_QUANT_METHODS.get(key, name)


def resolve_method(args):
    """(format or None, group size or None) from --method / --quant-method / --quant-config,
    which must agree where more than one is given."""
    for flag, value in (("--method", args.method), ("--quant-method", args.quant_method)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag} is empty; leave it out to keep the checkpoint's precision")
    given = []
    if args.method:
        given.append(("--method " + args.method, canonical_format(args.method)))
    if args.quant_method:
        given.append(("--quant-method " + args.quant_method, canonical_format(_kt_method(args.quant_method))))
    group = None
    if args.quant_config:
        fmt, group = parse_quant_config(args.quant_config)
        given.append(("--quant-config", fmt))
    for (name_a, a), (name_b, b) in zip(given, given[1:]):
        if a != b:
            raise UsageError(f"{name_a} ({a}) and {name_b} ({b}) disagree")
    if args.group_size is not None and group is not None and args.group_size != group:
        raise UsageError(f"--group-size {args.group_size} and --quant-config group_size {group} disagree")
    return (given[0][1] if given else None), (args.group_size if args.group_size is not None else group)


def apply_threads(n, note):
    if n is None:
        return
    if n < 1:
        raise ValueError(f"--threads must be at least 1, got {n}")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n > usable:
        note(f"--threads {n}: this process may use {usable} CPUs; using {usable}")
        n = usable
    from ktcy.threads import set_num_threads
    set_num_threads(n)


def _one_line(e):
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return " ".join(str(e).split()) or type(e).__name__


def run_cli(argv=None, prog="convert_cpu_weights.py"):
    args = build_parser(prog).parse_args(argv)
    try:
        with termination_as_interrupt():  # kill/timeout/docker stop leave no temporary files either
            return _run(args)
    except (ValueError, TypeError, OSError, MemoryError) as e:  # CheckpointError, ConvertError are ValueErrors
        if args.debug:
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{prog}: interrupted (files already complete stay; run again with --resume)", file=sys.stderr)
        return 130


def _run(args):
    for flag in ("input", "output", "input_bf16_hf_path", "output_fp8_hf_path"):
        if getattr(args, flag):
            setattr(args, flag, os.path.expanduser(getattr(args, flag)))
    from ktcy.convert import Progress, convert
    progress = Progress(quiet=args.quiet)
    if args.verbose:
        logging.basicConfig(format="%(name)s: %(levelname)s: %(message)s")
        logging.getLogger("ktcy").setLevel(logging.DEBUG if args.verbose >= 2 else logging.INFO)

    def note(text):
        print(f"note: {text}", file=sys.stderr)

    for flag, text in IGNORED_FLAGS.items():
        if getattr(args, flag) is not None:
            note(f"{text}; ignored")
    apply_threads(args.threads, note)
    method, group = resolve_method(args)
    if args.input_bf16_hf_path or args.output_fp8_hf_path:
        if not (args.input_bf16_hf_path and args.output_fp8_hf_path):
            raise UsageError("--input-bf16-hf-path and --output-fp8-hf-path go together")
        if args.input or args.output:
            raise UsageError("--input/--output and --input-bf16-hf-path/--output-fp8-hf-path are two different "
                             "conversions; give one pair")
        if method not in (None, "FP8_PERCHANNEL") or group is not None or args.resume_layer is not None:
            raise UsageError("--output-fp8-hf-path writes FP8 per-channel experts; it takes no other method, group "
                             "size or --resume-layer")
        from ktcy.hf_fp8 import convert_to_hf_fp8
        convert_to_hf_fp8(args.input_bf16_hf_path, args.output_fp8_hf_path, args.layers, args.resume, progress,
                          overwrite=args.overwrite, input_type=args.input_type)
        return 0
    if not args.input or not args.output:
        raise UsageError("--input and --output are required")
    convert(args.input, args.output, method, args.input_type, args.layers, args.resume, group, progress,
            overwrite=args.overwrite, resume_layer=args.resume_layer)
    return 0
