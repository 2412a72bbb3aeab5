"""`ktcy bench`: MoE forward timings on a model-shaped layer with random weights and routing,
set against the measured roofline (read bandwidth, per-ISA multiply-add peak)."""
import hashlib
import time

import numpy as np

from ktcy import _native, kernels, progress
from ktcy.config import MoeConfig, QuantConfig
from ktcy.expert_arena import ExpertArena
from ktcy.formats import FORMATS, canonical_format
from ktcy.moe import MoE
from ktcy.output_guard import publish
from ktcy.roofline import ReadProbe, llc_bytes, peak_for, roofline
from ktcy.threads import get_num_threads

# name -> (hidden, intermediate, experts, top_k, note).  DeepSeek-V3's 256 experts do not fit
# in 24 GiB as float32 sources; its real H, I and top-k with fewer experts keep per-token work
# and bytes per active expert exact.
SHAPES = {
    "qwen3-30b": (2048, 768, 128, 8, "Qwen3-30B-A3B layer"),
    "deepseek-v3": (7168, 2048, 32, 8, "DeepSeek-V3 layer with 32 of its 256 experts (real H, I, top-k)"),
    "mixtral": (4096, 14336, 8, 2, "Mixtral-8x7B layer"),
    # small experts, many of them: decode reads 10 narrow experts a token
    "qwen3-next": (2048, 512, 512, 10, "Qwen3-Next-80B-A3B layer"),
    "glm-4.5-air": (4096, 1408, 128, 8, "GLM-4.5-Air layer"),
    # GPT-OSS's shape with SiLU experts and no biases (its own block: MXFP4 / MXFP4_A8 rows)
    "gpt-oss-20b": (2880, 2880, 32, 4, "GPT-OSS-20B layer shape"),
}
DEFAULT_FORMATS = FORMATS  # every row of the format descriptor table
DISTINCT_EXPERTS = 16                  # quantized and packed; the other experts are copies
DEFAULT_TOKENS = (1, 32, 512)          # decode, the AMX switch-over, prefill: about a minute on 2 cores
FULL_TOKENS = (1, 4, 32, 128, 512)     # --full
LEGEND = ("median: per-call time over the calls shown in 'runs'; [p10-p90]: the 10th-90th percentile of those "
          "calls; weight GB/s: bytes of the experts each call touched / time; read GB/s: the median of streaming-read "
          "passes taken between those calls (what the memory gave in the same seconds), % read BW the ratio of the "
          "two; GFLOP/s: 2 x 3 x H x I x T x top-k / time. Every call draws a fresh routing.")


def parse_shape(text):
    """(H, I, E, top_k, note) of a named shape or of "H,I,E,k"."""
    if text in SHAPES:
        return SHAPES[text]
    try:
        h, i, e, k = (int(v) for v in str(text).split(","))
    except ValueError:
        raise ValueError(f"--shape takes one of {', '.join(SHAPES)} or H,I,E,k; got {text!r}") from None
    if min(h, i, e, k) < 1 or k > e:
        raise ValueError(f"--shape {text!r}: H, I, E and k must be positive with k <= E")
    return h, i, e, k, f"custom layer H={h} I={i} E={e} top-{k}"


def check_formats(formats):
    """Canonical format names, in order, without repeats; an unknown name is a ValueError."""
    out = []
    for name in formats:
        fmt = canonical_format(name)
        if fmt not in out:
            out.append(fmt)
    if not out:
        raise ValueError(f"--formats is empty; choose from {', '.join(FORMATS)}")
    return out


def check_isa(isa, formats):
    """Raise UnsupportedISAError / ValueError now, before minutes of weight generation."""
    for fmt in formats:
        _native.resolve(fmt, isa)


def check_shape(H, I, E, k, formats):
    """The layer configuration of every format, checked before the roofline is measured (INT8's
    K limit, say): ValueError naming the format."""
    for fmt in formats:
        try:
            MoeConfig(E, k, H, I, QuantConfig(fmt))
        except ValueError as e:
            raise ValueError(f"--formats {fmt} at --shape {H},{I},{E},{k}: {e}") from None


def memory_needed(H, I, E, k=1, max_tokens=1):
    """Bytes the bench holds at its peak: the float32 sources of the distinct experts, the largest
    packed layer (BF16) and one being built beside it, and per call the activations, the routing
    draw and the engine's per-row scratch (a generous estimate), and the side-by-side read probe."""
    weights = 3 * H * I * (4 * min(E, DISTINCT_EXPERTS) + 2 * 2 * E)
    per_token = 2 * H * 4 + E * 8 + k * (2 * I + H) * 8
    return weights + max_tokens * per_token + ReadProbe.buffer_bytes(get_num_threads())


def available_memory():
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(H, I, E, k=1, max_tokens=1):
    need, have = memory_needed(H, I, E, k, max_tokens), available_memory()
    if have is not None and need > have:
        raise ValueError(f"this run (H={H}, I={I}, E={E}, top-{k}, up to T={max_tokens}) needs about "
                         f"{need / 2**30:.1f} GiB; {have / 2**30:.1f} GiB is available")


def draw_routing(rng, T, E, k):
    """k distinct experts per token, uniformly at random."""
    return np.argpartition(rng.random((T, E)), k - 1, axis=1)[:, :k]


def time_forward(layer, x, draw, weights, min_seconds=0.4, min_reps=5, max_reps=50, between=None):
    """(per-call seconds, routings used).  Each call, the warm-up included, gets a routing that
    draw() makes fresh, so the experts a call touches come from memory, not from a cache that a
    previous call filled; drawing is outside the timed region, and so is between(), called
    before every timed call (the bench takes a read-bandwidth pass there)."""
    used = [draw()]
    layer.forward(x, used[0], weights)  # warm-up: arena, page faults
    times = []
    start = time.perf_counter()
    while len(times) < max_reps:
        ids = draw()
        used.append(ids)
        if between is not None:
            between()
        t = time.perf_counter()
        layer.forward(x, ids, weights)
        times.append(time.perf_counter() - t)
        if len(times) >= min_reps and time.perf_counter() - start > min_seconds:
            break
    return np.array(times), used


def distinct_routings(routes):
    return len({hashlib.sha1(np.ascontiguousarray(r).tobytes()).digest() for r in routes})


def build_layer(config, sources, say_progress):
    """An E-expert layer from len(sources["gate"]) distinct random experts: those are quantized and
    packed, the rest are copies of them in their own slots of the layer's buffer.  Timing does
    not depend on the values, and every expert's bytes still come from DRAM; packing all of them
    (INT4's scale search is slow) would cost most of a run."""
    fmt, group = config.weight_format, config.quant_config.group_size
    distinct = len(sources["gate"])
    packed = {name: [] for name in ("gate", "up", "down")}
    for e in range(distinct):
        for name, ws in packed.items():
            ws.append(kernels.pack(sources[name][e], fmt, group_size=group))
        say_progress(e + 1, config.num_experts)
    # every expert in its own slot of one buffer, as MoE.from_weights lays a layer out
    arena = ExpertArena({name: ws[0] for name, ws in packed.items()}, config.num_experts)
    placed = {name: [] for name in packed}
    for e in range(config.num_experts):
        for name, ws in placed.items():
            ws.append(arena.place(e, name, packed[name][e % distinct]))
        if e >= distinct:
            say_progress(e + 1, config.num_experts)
    return MoE(config, placed["gate"], placed["up"], placed["down"])


def run(shape="qwen3-30b", formats=DEFAULT_FORMATS, tokens=DEFAULT_TOKENS, isa=None, seed=0, say=None):
    """Benchmark rows (dicts) for every format x token count on one layer shape.
    say(text): one line per step (packing done, ...)."""
    H, I, E, k, note = parse_shape(shape)
    formats = check_formats(formats)
    if not tokens or any(int(t) < 1 for t in tokens):
        raise ValueError(f"token counts must be positive, got {list(tokens)}")
    check_isa(isa, formats)
    check_memory(H, I, E, k, max(tokens))
    roof = roofline()
    probe = ReadProbe()
    say = say or (lambda text: None)
    rng = np.random.default_rng(seed)
    distinct = min(E, DISTINCT_EXPERTS)
    sources = {name: [rng.standard_normal(shape, np.float32) * 0.02 for _ in range(distinct)]
               for name, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
    for fmt in formats:
        cfg = MoeConfig(E, k, H, I, QuantConfig(fmt), isa=isa)
        t0 = time.perf_counter()
        with progress.reporter(f"packing {fmt}", E, "expert") as bar:
            layer = build_layer(cfg, sources, bar.update)
        say(f"packed {fmt} in {time.perf_counter() - t0:.1f} s ({layer.nbytes / 2**30:.2f} GiB): {layer.kernel}")
        per_expert = layer.nbytes / E
        for T in tokens:
            x = rng.standard_normal((T, H), np.float32)
            w = rng.random((T, k), np.float32)
            passes = []
            times, used = time_forward(layer, x, lambda: draw_routing(rng, T, E, k), w,
                                       between=lambda: passes.append(probe.pass_gbs()))
            med = float(np.median(times))
            read_bw = float(np.median(passes))
            active = float(np.mean([len(np.unique(r)) for r in used[1:]]))
            gbs = active * per_expert / med / 1e9
            gflops = 2 * 3 * H * I * T * k / med / 1e9
            used_isa = layer.isa if (layer.decode_isa == layer.isa or T * k / E >= 32) else layer.decode_isa
            peak = peak_for(layer.format, used_isa, roof)
            yield {
                "format": layer.format, "isa": used_isa, "kernel": layer.kernel, "tokens": T,
                "median_ms": med * 1e3, "p10_ms": float(np.percentile(times, 10)) * 1e3,
                "p90_ms": float(np.percentile(times, 90)) * 1e3, "runs": len(times),
                "distinct_routings": distinct_routings(used), "routings": len(used),
                "active_experts": active, "bytes_per_call": active * per_expert,
                "layer_bytes": layer.nbytes, "tokens_per_s": T / med, "weight_gbs": gbs,
                "read_bw_gbs": read_bw, "bandwidth_pct": 100 * gbs / read_bw,
                "bandwidth_pct_of_startup_probe": 100 * gbs / roof["read_bandwidth_gbs"],
                "gflops": gflops, "peak": peak["name"] if peak else None,
                "peak_value": peak["value"] if peak else None,
                "peak_pct": 100 * gflops / peak["value"] if peak else None,
                "peak_reliable": peak["reliable"] if peak else None,
            }
        del layer


HEADER = (f"{'format':15s} {'ISA':8s} {'T':>4s} {'median ms':>10s} {'[p10-p90] ms':>17s} {'tokens/s':>10s} "
          f"{'weight GB/s':>11s} {'read GB/s':>9s} {'% read BW':>9s} {'GFLOP/s':>8s}  % of peak")


def format_row(r):
    peak = (f"{r['peak_pct']:5.1f}% of {r['peak']}" + ("" if r["peak_reliable"] else " (threads x 1-thread figure)")
            if r["peak"] else "  -   (no peak for this ISA)")
    spread = f"[{r['p10_ms']:.2f}-{r['p90_ms']:.2f}]"
    return (f"{r['format']:15s} {r['isa']:8s} {r['tokens']:4d} {r['median_ms']:10.2f} {spread:>17s} "
            f"{r['tokens_per_s']:10.1f} {r['weight_gbs']:11.1f} {r['read_bw_gbs']:9.1f} {r['bandwidth_pct']:8.1f}% "
            f"{r['gflops']:8.1f}  {peak}")


def format_roofline(roof):
    lines = [f"Roofline ({roof['threads']} threads): read bandwidth {roof['read_bandwidth_gbs']:.1f} GB/s "
             f"(best 16 MiB-per-thread pass over {roof.get('probe_mib', 512)} MiB at start-up; the rows' % read BW "
             f"is against passes taken between their calls)"]
    for name, p in roof["peaks"].items():
        flag = "" if p.get("reliable", True) else (
            f"  UNRELIABLE: {roof['threads']} threads gave {p['value'] / p['single_thread']:.2f}x the one-thread "
            f"figure (cores shared or busy)")
        lines.append(f"  {name:12s} {p['instruction']:32s} {p['value']:9.1f} {p['unit']}"
                     f"  (1 thread: {p.get('single_thread', p['value']):.1f}){flag}")
    return "\n".join(lines)


def over_bandwidth_note(rows):
    """A closing note for rows that read weights faster than the read passes taken beside them,
    or None."""
    over = [r for r in rows if r["bandwidth_pct"] > 100]
    if not over:
        return None
    llc = llc_bytes()
    cached = [r for r in over if llc and r["layer_bytes"] < 4 * llc]
    note = f"{len(over)} row(s) read weights faster than the read passes taken beside them"
    if cached:
        note += (f": the layer ({cached[0]['layer_bytes'] / 2**20:.0f} MiB) is small enough that the "
                 f"{llc / 2**20:.0f} MiB last-level cache holds part of it across calls")
    else:
        note += ": the probe is one streaming pattern (four streams per thread), the kernels' another"
    return note + ". Read those as 'at the memory limit'."


DECODE_MAX_TOKENS = 32  # token counts the summary calls decode (bound by reading the weights)


def summary(rows):
    """The closing lines: how close decode (the smallest T, if at most DECODE_MAX_TOKENS) gets
    to the bandwidth, prefill (the largest T, if above it) to the peak, and the fastest format
    for each."""
    if not rows:
        return []
    lines, best_lines = [], []
    small, large = min(r["tokens"] for r in rows), max(r["tokens"] for r in rows)
    if small <= DECODE_MAX_TOKENS:
        decode = [r for r in rows if r["tokens"] == small]
        best = min(decode, key=lambda r: r["median_ms"])
        top_bw = max(decode, key=lambda r: r["bandwidth_pct"])
        lines.append(f"Decode (T={small}) reads weights at up to {top_bw['bandwidth_pct']:.0f}% of the read "
                     f"bandwidth measured beside it ({top_bw['format']}, {top_bw['weight_gbs']:.1f} of "
                     f"{top_bw['read_bw_gbs']:.1f} GB/s).")
        best_lines.append(f"{best['format']} ({best['median_ms']:.2f} ms per layer call"
                          + (f", {best['tokens_per_s']:.0f} tokens/s)" if large > DECODE_MAX_TOKENS else ")"))
    if large > DECODE_MAX_TOKENS:
        prefill = [r for r in rows if r["tokens"] == large]
        with_peak = [r for r in prefill if r["peak_pct"] is not None]
        if with_peak:
            top = max(with_peak, key=lambda r: r["peak_pct"])
            lines.append(f"Prefill (T={large}) reaches up to {top['peak_pct']:.0f}% of the multiply-add peak "
                         f"({top['format']}: {top['gflops']:.0f} GFLOP/s against {top['peak']}).")
        fast = min(prefill, key=lambda r: r["median_ms"])
        best_lines.append(f"{fast['format']} ({fast['tokens_per_s']:.0f} tokens/s)")
    if len(best_lines) == 2:
        lines.append(f"Best format for decode here: {best_lines[0]}; for prefill: {best_lines[1]}.")
    else:
        kind = "decode" if small <= DECODE_MAX_TOKENS else "prefill"
        lines.append(f"Best format for {kind} here: {best_lines[0]}.")
    return lines


def save_plot(rows, path, title):
    """Median time vs T per format (log-log) with each format's roofline bound, as a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'ktcy[plot]' (or pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, fmt in enumerate(dict.fromkeys(r["format"] for r in rows)):
        mine = sorted((r for r in rows if r["format"] == fmt), key=lambda r: r["tokens"])
        color = f"C{i}"
        T = [r["tokens"] for r in mine]
        ax.plot(T, [r["median_ms"] for r in mine], "o-", color=color, label=f"{fmt} ({mine[0]['isa']})")
        bound = []
        for r in mine:
            flops = r["gflops"] * r["median_ms"] * 1e6  # GFLOP/s x ms -> FLOP
            compute = flops / (r["peak_value"] * 1e9) if r["peak_value"] else 0.0
            bound.append(max(r["bytes_per_call"] / (r["read_bw_gbs"] * 1e9), compute) * 1e3)
        ax.plot(T, bound, "--", color=color, alpha=0.6, label=f"{fmt} roofline bound")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["tokens"] for r in rows}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("tokens per call (T)")
    ax.set_ylabel("time per layer call (ms)")
    ax.set_title(title + "\nsolid: measured median; dashed: roofline bound max(bytes / read BW, FLOP / peak)",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:  # under a temporary name, renamed when complete: never half a PNG
        publish(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
