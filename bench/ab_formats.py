"""Formats side by side on one kernel variant: the same float weight packed in each format, one
projection called in alternation, round after round, so the host's drift falls on all alike.
Prints each format's median time and its median per-round ratio to the first.  With --moe E, a
whole MoE layer instead (Qwen3-30B-A3B's H 2048, I 768, top 8, E experts, a fresh routing per
call) on --isa.  Not part of CI.

    python bench/ab_formats.py --formats INT4_ZP,INT4_MIN --variant int4_avx2 --group 32 --rows 1,32,512
    python bench/ab_formats.py --formats INT4_ZP,INT4_MIN --moe 64 --isa avx2 --rows 1,32,512
    python bench/ab_formats.py --formats INT4_MIN,INT4_MIN/INT8_GROUP --moe 128 --group 32 --down-group 16

With --moe, "A/B" runs gate and up in A (group --group) and down in B (group --down-group), as a
GGUF Q4_K_M layer keeps them (INT4_MIN/INT8_GROUP).
"""
import argparse
import sys
import time

import numpy as np

import ktcy
from ktcy import _native, kernels


def _moe_rounds(formats, args):
    """{T: {format: [seconds per call, per round]}} of whole MoE layers called in alternation."""
    E, H, I, k = args.moe, 2048, 768, 8
    rng = np.random.default_rng(0)
    w = [(rng.standard_normal((E, n, kk)) * 0.02).astype(np.float32) for n, kk in ((I, H), (I, H), (H, I))]
    def config(spec):
        gate_up, _, down = spec.partition("/")
        down_quant = ktcy.QuantConfig(down, group_size=args.down_group or args.group) if down else None
        return ktcy.MoeConfig(E, k, H, I, ktcy.QuantConfig(gate_up, group_size=args.group), isa=args.isa,
                              down_quant_config=down_quant)

    layers = {f: ktcy.MoE.from_weights(config(f), *w) for f in formats}
    out = {}
    for T in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((T, H)).astype(np.float32)
        calls = max(3, 200 // T)
        routes = [(np.argsort(rng.random((T, E)), axis=1)[:, :k], rng.random((T, k)).astype(np.float32))
                  for _ in range(calls)]
        out[T] = {f: [] for f in formats}
        for _ in range(args.rounds):
            for f in formats:
                t0 = time.perf_counter()
                for ids, wts in routes:
                    layers[f].forward(x, ids, wts)
                out[T][f].append((time.perf_counter() - t0) / calls)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="INT4_ZP,INT4_MIN", help="comma-separated; the first is the baseline")
    ap.add_argument("--variant", help="a kernel variant serving every format (ktcy._native.variants())")
    ap.add_argument("--moe", type=int, default=0, help="E: time a whole MoE layer of E experts instead")
    ap.add_argument("--isa", default=None, help="with --moe: the ISA (default: this CPU's best)")
    ap.add_argument("--group", type=int, default=64, help="group size of grouped formats")
    ap.add_argument("--down-group", type=int, default=0, help="with --moe and A/B formats: B's group (default --group)")
    ap.add_argument("--rows", default="1,32,512", help="comma-separated row counts M")
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    if args.moe:
        for T, times in _moe_rounds(formats, args).items():
            base = np.array(times[formats[0]])
            cells = [f"{f} {np.median(times[f]) * 1e3:.3f} ms ({np.median(np.array(times[f]) / base):.3f}x)"
                     for f in formats]
            print(f"MoE {args.moe} experts on {args.isa or 'the best ISA'}, T = {T}: " + ", ".join(cells))
        return 0
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
