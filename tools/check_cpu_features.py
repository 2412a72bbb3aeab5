#!/usr/bin/env python3
"""Readiness report for the KTransformers-style backends on this machine: which backends run on
their ideal kernel, what is missing for the others, and what they fall back to.  It asks the
library (one probe, the same the kernels use).  Exit status 0 when at least AVX2 is usable,
1 otherwise."""
import argparse
import json
import os
import sys

from ktcy import report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="machine-readable output: features and backends")
    args = parser.parse_args(argv)
    info = report.info()
    feats = info["features"]
    backends = report.backend_readiness()
    ok = report.avx2_usable()
    if args.json:
        print(json.dumps({"cpu": info["cpu"], "features": feats, "backends": backends, "avx2_usable": ok}, indent=2))
        return 0 if ok else 1
    print(f"CPU: {info['cpu'] or 'unknown'}")
    print("Flags: " + "  ".join(f"{'✓' if feats[f] else '✗'} {f}" for f in report.ISA_FEATURES + report.OS_STATE))
    print()
    for backend, row in backends.items():
        state = "✅" if row["ideal"] else "⚠️ " if row["isa"] else "❌"
        where = f"will run on {row['isa']} ({row['variant']})" if row["isa"] else f"cannot run: {row['variant']}"
        missing = f"; missing for the ideal path: {', '.join(row['missing'])}" if row["missing"] else \
            "; the ideal path is not the one chosen (KTCY_ISA / CPUINFER_ENABLE_AMX)" if row["isa"] and not row["ideal"] \
            else ""
        print(f"{state} {backend:15s} -> {row['format']:15s} {where}{missing}")
    print()
    if backends["FP8"]["variant"] == "fp8_avx512_vbmi" and feats["avx512_vnni"]:
        print("✅ Full AVX-512 (F/BW/BF16/VNNI/VBMI): the FP8 fast path (VBMI decode + vdpbf16ps) runs here.")
    if not ok:
        print("❌ Not even AVX2+FMA is usable: only the portable C kernels will run (slowly).")
        return 1
    print("More detail (memory, NUMA, huge pages, why not a faster kernel): ktcy doctor")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader left (`check_cpu_features.py | head -3`): a quiet exit, as ktcy's
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
