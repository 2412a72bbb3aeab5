"""Two or more builds of ktcy's kernels side by side in one process: one projection, the builds'
compiled extensions loaded under their own names and called in alternation, round after round,
so that the host's drift (this one's read bandwidth moves by up to 2x within a minute) falls on
all of them alike.  Not part of CI.

    python bench/ab_gemm.py BUILD_A BUILD_B --format BF16 --rows 32 --n 768 --k 2048 --isa avx2
    python bench/ab_gemm.py BUILD_A BUILD_B --format FP8_PERCHANNEL --rows 8 --variant fp8_avx512f
    python bench/ab_gemm.py BUILD --format FP8_PERCHANNEL --rows 32 --isa avx2 --vary fp8_normal_panels=0,1

A BUILD is a directory holding ktcy/_native*.so (an in-place build, or a site-packages).  The
weights are packed by the ktcy this Python imports, so the builds must share the packed layout.
Prints each build's median time per call, the median of the per-round time ratios to the first
build, and whether every build gave the same bits.  --vary NAME=A,B,... runs each build once per
value of one of the CPU's tile choices (the keyword arguments of ktcy._native.gemm, registry.h)."""
import argparse
import glob
import importlib.machinery
import importlib.util
import os
import statistics
import sys
import time

import numpy as np


def load_native(build, index):
    found = glob.glob(os.path.join(build, "ktcy", "_native*.so"))
    if not found:
        sys.exit(f"error: no ktcy/_native*.so under {build}")
    name = f"ab_build{index}._native"  # the init function is named after the last part
    loader = importlib.machinery.ExtensionFileLoader(name, found[0])
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, found[0], loader=loader))
    loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--format", default="BF16")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--isa", default=None, help="the dispatcher's variant for this ISA (default: this CPU's best)")
    ap.add_argument("--variant", default=None, help="a kernel variant by name (ktcy._native.variants())")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--copies", type=int, default=8, help="distinct packed copies per call round (beyond the caches)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vary", default=None, metavar="NAME=A,B",
                    help="each build once per value of this tile choice (a gemm() keyword, e.g. plain_fetch_l2=0,1)")
    args = ap.parse_args()
    choice, values = None, [None]
    if args.vary:
        choice, _, listed = args.vary.partition("=")
        try:
            values = [int(v) for v in listed.split(",")]
        except ValueError:
            sys.exit(f"error: --vary wants NAME=INT,INT,... (got {args.vary!r})")

    import ktcy
    from ktcy import kernels
    ktcy.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.n, args.k), np.float32) * 0.02
    packed = [kernels.pack(w, args.format) for _ in range(args.copies)]
    x = rng.standard_normal((args.rows, args.k), np.float32)
    code = kernels._CODE[packed[0].format]
    jobs = []
    for i, build in enumerate(args.builds):
        native = load_native(build, i)
        native.set_num_threads(args.threads)
        variant = args.variant or native.resolve(packed[0].format, args.isa)[1]
        weights = [native.Weight(code, int(p.group_size or 0), args.n, args.k, p.data, p.scale, p.colsum, p.zero)
                   for p in packed]
        act = native.Activations(code, x, packed[0].k_pad, packed[0].group_size)
        for value in values:
            label = build if choice is None else f"{build} {choice}={value}"
            jobs.append((label, native, variant, weights, act, np.empty((args.rows, args.n), np.float32),
                         {} if choice is None else {choice: value}))
    times = [[] for _ in jobs]
    for r in range(args.rounds):
        for i in (range(len(jobs)) if r % 2 == 0 else reversed(range(len(jobs)))):
            _, native, variant, weights, act, out, choices = jobs[i]
            t = time.perf_counter()
            for weight in weights:
                native.gemm(packed[0].format, variant, act, weight, out, **choices)
            times[i].append((time.perf_counter() - t) / len(weights))
    same = all(np.array_equal(jobs[0][5].view(np.uint32), j[5].view(np.uint32)) for j in jobs[1:])
    print(f"{args.format} M={args.rows} N={args.n} K={args.k} {jobs[0][2]}, {args.rounds} rounds:")
    for job, t in zip(jobs, times):
        ratio = statistics.median(a / b for a, b in zip(t, times[0]))
        print(f"  {job[0]}: {statistics.median(t) * 1e3:.3f} ms, {ratio:.3f}x the first")
    print(f"  outputs: {'the same bits' if same else 'DIFFER'}")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, TypeError) as e:  # a format, shape or variant the builds refuse
        sys.exit(f"error: {e}")
