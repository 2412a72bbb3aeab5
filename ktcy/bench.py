"""`ktcy bench`: MoE forward timings on a model-shaped layer with random weights and routing,
set against the measured roofline (read bandwidth, per-ISA multiply-add peak)."""
import time

import numpy as np

from ktcy.config import MoeConfig, QuantConfig
from ktcy.moe import MoE
from ktcy.roofline import peak_for, roofline

# name -> (hidden, intermediate, experts, top_k, note).  DeepSeek-V3's 256 experts do not fit
# in 24 GiB as float32 sources; its real H, I and top-k with fewer experts keep per-token work
# and bytes per active expert exact.
SHAPES = {
    "qwen3-30b": (2048, 768, 128, 8, "Qwen3-30B-A3B layer"),
    "deepseek-v3": (7168, 2048, 32, 8, "DeepSeek-V3 layer with 32 of its 256 experts (real H, I, top-k)"),
    "mixtral": (4096, 14336, 8, 2, "Mixtral-8x7B layer"),
}
DEFAULT_FORMATS = ("BF16", "INT8", "INT4", "FP8_PERCHANNEL", "FP8_BLOCK")
DEFAULT_TOKENS = (1, 4, 32, 128, 512)


def parse_shape(text):
    if text in SHAPES:
        return SHAPES[text]
    try:
        h, i, e, k = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--shape takes one of {', '.join(SHAPES)} or H,I,E,k; got {text!r}") from None
    return h, i, e, k, f"custom layer H={h} I={i} E={e} top-{k}"


def time_forward(layer, x, routes, weights, min_seconds=0.4, max_reps=50):
    """Per-call seconds over fresh routings (so weights are not served from cache twice)."""
    layer.forward(x, routes[0], weights)  # warm-up: arena, page faults
    times = []
    start = time.perf_counter()
    for rep in range(max_reps):
        ids = routes[1 + rep % (len(routes) - 1)]
        t = time.perf_counter()
        layer.forward(x, ids, weights)
        times.append(time.perf_counter() - t)
        if len(times) >= 5 and time.perf_counter() - start > min_seconds:
            break
    return np.array(times)


def run(shape="qwen3-30b", formats=DEFAULT_FORMATS, tokens=DEFAULT_TOKENS, isa=None, seed=0, progress=None):
    """Benchmark rows (dicts) for every format x token count on one layer shape."""
    H, I, E, k, note = parse_shape(shape)
    roof = roofline()
    rng = np.random.default_rng(seed)
    say = progress or (lambda text, transient=False: None)
    say(f"generating float32 weights for {note} (H {H}, I {I}, {E} experts, top {k})")
    gate = (rng.standard_normal((E, I, H), np.float32) * 0.02)
    up = (rng.standard_normal((E, I, H), np.float32) * 0.02)
    down = (rng.standard_normal((E, H, I), np.float32) * 0.02)
    rows = []
    for fmt in formats:
        cfg = MoeConfig(E, k, H, I, QuantConfig(fmt), isa=isa)
        t0 = time.perf_counter()
        layer = MoE.from_weights(cfg, gate, up, down,
                                 progress=lambda done, total: say(f"packing {fmt}: expert {done}/{total}", True))
        say(f"packed {fmt} in {time.perf_counter() - t0:.1f} s ({layer.nbytes / 2**30:.2f} GiB): {layer.kernel}")
        per_expert = layer.nbytes / E
        for T in tokens:
            x = rng.standard_normal((T, H), np.float32)
            routes = [np.argsort(rng.random((T, E)), axis=1)[:, :k] for _ in range(9)]
            w = rng.random((T, k), np.float32)
            times = time_forward(layer, x, routes, w)
            med = float(np.median(times))
            active = float(np.mean([len(np.unique(r)) for r in routes[1:]]))
            gbs = active * per_expert / med / 1e9
            gflops = 2 * 3 * H * I * T * k / med / 1e9
            used_isa = layer.isa if (layer.decode_isa == layer.isa or T * k / E >= 32) else layer.decode_isa
            peak = peak_for(fmt, used_isa, roof)
            rows.append({
                "format": layer.format, "isa": layer.isa, "kernel": layer.kernel, "tokens": T,
                "median_ms": med * 1e3, "p10_ms": float(np.percentile(times, 10)) * 1e3,
                "p90_ms": float(np.percentile(times, 90)) * 1e3, "runs": len(times),
                "tokens_per_s": T / med, "weight_gbs": gbs,
                "bandwidth_pct": 100 * gbs / roof["read_bandwidth_gbs"],
                "gflops": gflops, "peak": peak["name"] if peak else None,
                "peak_pct": 100 * gflops / peak["value"] if peak else None,
            })
            yield rows[-1]
        del layer


def format_row(r):
    peak = f"{r['peak_pct']:5.1f}% of {r['peak']}" if r["peak"] else "  (no peak for this ISA)"
    return (f"{r['format']:15s} {r['isa']:8s} T={r['tokens']:<4d} {r['median_ms']:9.2f} ms "
            f"[{r['p10_ms']:.2f}-{r['p90_ms']:.2f}]  {r['tokens_per_s']:9.1f} tok/s  "
            f"{r['weight_gbs']:6.1f} GB/s ({r['bandwidth_pct']:5.1f}% of read BW)  "
            f"{r['gflops']:7.1f} GFLOP/s ({peak})")


def format_roofline(roof):
    lines = [f"Roofline ({roof['threads']} threads): read bandwidth {roof['read_bandwidth_gbs']:.1f} GB/s"]
    for name, p in roof["peaks"].items():
        lines.append(f"  {name:12s} {p['instruction']:16s} {p['value']:9.1f} {p['unit']}")
    return "\n".join(lines)
