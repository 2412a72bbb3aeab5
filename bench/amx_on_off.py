"""AMX against AVX-512 on one MoE layer, in one process, interleaved (not part of CI).

    python bench/amx_on_off.py --tokens 128,512,2048 --rounds 3 --formats BF16,INT8

Two engines share one packed Qwen3-30B-A3B-shaped layer (128 experts, top 8, H 2048, I 768):
one runs AMX for experts with at least ktcy.moe.AMX_MIN_ROWS[format] rows (what ships), the
other the AVX-512 kernel for every expert (CPUINFER_ENABLE_AMX=OFF's choice).  Median ms of
3 calls per round, fresh routing per call.  Needs a CPU with AMX."""
import argparse
import time

import numpy as np

import ktcy
from ktcy import _native
from ktcy.moe import AMX_MIN_ROWS

E, TOP_K, H, I = 128, 8, 2048, 768


def engine(layer, min_rows):
    c = layer.config
    return _native.MoEEngine(layer.format, [w.native() for w in layer.gate], [w.native() for w in layer.up],
                             [w.native() for w in layer.down], layer.variant, layer.decode_variant, min_rows,
                             layer.bias, c.activation, c.swiglu_alpha, c.swiglu_limit)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,512,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default=",".join(AMX_MIN_ROWS))
    args = ap.parse_args()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in AMX_MIN_ROWS]
    if unknown:
        ap.error(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(AMX_MIN_ROWS)}")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens: {args.tokens!r} is not a comma-separated list of integers")
    if min(tokens) < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds must be at least 1")
    if "amx" not in ktcy.available_isas():
        raise SystemExit("amx_on_off: this CPU (or its OS, or CPUINFER_ENABLE_AMX) does not allow AMX")
    for fmt in formats:
        rng = np.random.default_rng(0)
        weights = [rng.standard_normal(s, np.float32) * 0.02 for s in ((E, I, H), (E, I, H), (E, H, I))]
        layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, TOP_K, H, I, ktcy.QuantConfig(fmt)), *weights)
        del weights
        engines = {"amx": engine(layer, AMX_MIN_ROWS[fmt]), "avx512": engine(layer, 1 << 40)}
        for T in tokens:
            x = rng.standard_normal((T, H), np.float32)
            w = rng.random((T, TOP_K), np.float32)
            ids = [np.argsort(rng.random((T, E)), axis=1)[:, :TOP_K] for _ in range(4)]
            times = {name: [] for name in engines}
            for _ in range(args.rounds):
                for name, eng in engines.items():
                    layer._engine = eng
                    layer.forward(x, ids[3], w)  # warm
                    for i in range(3):
                        t0 = time.perf_counter()
                        layer.forward(x, ids[i], w)
                        times[name].append(time.perf_counter() - t0)
            amx, avx = (float(np.median(times[n])) * 1e3 for n in ("amx", "avx512"))
            print(f"{fmt:15s} T={T:5d}  amx {amx:8.2f} ms  avx512 {avx:8.2f} ms  amx/avx512 {amx / avx:.2f}", flush=True)


if __name__ == "__main__":
    main()
