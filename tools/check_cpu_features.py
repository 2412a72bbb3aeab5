#!/usr/bin/env python3
"""Readiness report for the KTransformers-style backends on this machine: which backends run on
their ideal kernel, what is missing for the others, and what they fall back to.  It asks the
library (one probe, the same the kernels use).  Exit status 0 when at least AVX2 is usable,
1 otherwise."""
import argparse
import json
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
        state = "✅" if row["ideal"] else "⚠️ "
        where = f"will run on {row['isa']} ({row['variant']})" if row["isa"] else f"cannot run: {row['variant']}"
        missing = f"; missing for the ideal path: {', '.join(row['missing'])}" if row["missing"] else ""
        print(f"{state} {backend:15s} -> {row['format']:15s} {where}{missing}")
    print()
    if all(feats[f] for f in ("avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx512_vbmi", "os_avx512")):
        print("✅ Full AVX-512 (F/BW/BF16/VNNI/VBMI): the FP8 fast path (VBMI decode + vdpbf16ps) runs here.")
    if not ok:
        print("❌ Not even AVX2+FMA is usable: only the portable C kernels will run (slowly).")
        return 1
    print("More detail (memory, NUMA, huge pages, why not a faster kernel): ktcy doctor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
