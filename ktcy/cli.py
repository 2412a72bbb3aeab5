"""The `ktcy` command line: info (and, as they land, bench and convert)."""
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


def build_parser():
    parser = argparse.ArgumentParser(prog="ktcy", description="MoE expert kernels for x86 CPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="CPU features, chosen kernels, build switches")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
