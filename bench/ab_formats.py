"""Formats side by side on one kernel variant: the same float weight packed in each format, one
projection called in alternation, round after round, so the host's drift falls on all alike.
Prints each format's median time and its median per-round ratio to the first.  Not part of CI.

    python bench/ab_formats.py --formats INT4_ZP,INT4_MIN --variant int4_avx2 --group 32 --rows 1,32,512
"""
import argparse
import sys
import time

import numpy as np

from ktcy import _native, kernels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="INT4_ZP,INT4_MIN", help="comma-separated; the first is the baseline")
    ap.add_argument("--variant", required=True, help="a kernel variant serving every format (ktcy._native.variants())")
    ap.add_argument("--group", type=int, default=64, help="group size of grouped formats")
    ap.add_argument("--rows", default="1,32,512", help="comma-separated row counts M")
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    serving = {v["name"]: v for v in _native.variants()}
    v = serving.get(args.variant)
    if v is None or not v["runnable"] or any(f not in v["formats"] for f in formats):
        print(f"ab_formats: variant {args.variant!r} does not run all of {formats} here", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    W = (rng.standard_normal((args.n, args.k)) * 0.02).astype(np.float32)
    packed = {f: kernels.pack(W, f, group_size=args.group) for f in formats}
    for m in (int(r) for r in args.rows.split(",")):
        X = rng.standard_normal((m, args.k)).astype(np.float32)
        calls = max(3, 2000 // m)
        times = {f: [] for f in formats}
        for _ in range(args.rounds):
            for f in formats:
                kernels.linear_variant(X, packed[f], args.variant)
                t0 = time.perf_counter()
                for _ in range(calls):
                    kernels.linear_variant(X, packed[f], args.variant)
                times[f].append((time.perf_counter() - t0) / calls)
        base = np.array(times[formats[0]])
        cells = [f"{f} {np.median(times[f]) * 1e3:.3f} ms ({np.median(np.array(times[f]) / base):.3f}x)"
                 for f in formats]
        print(f"{args.variant} group {args.group} M = {m}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
