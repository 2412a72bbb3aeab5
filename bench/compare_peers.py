#!/usr/bin/env python3
"""Side-by-side MoE forward: ktcy against a straightforward numpy float32 MoE, PyTorch CPU (bf16
and fp32) and kt-kernel (BF16, INT8 with the classes its installed build has; RAWINT4, GPTQ_INT4,
MXFP4 and FP8 on the codes ktcy packed) when installed, interleaved in one run on the same weights,
every call with a freshly drawn routing, printed as time ratios to ktcy.  Not part of CI; see
bench/README.md for installing the peers.

    python bench/compare_peers.py [--shape qwen3-30b] [--tokens 1,32,512] [--formats BF16,INT8]
    KTCY_ISA=avx2 python bench/compare_peers.py --kt-variant avx2   # both libraries' AVX2 code
    python bench/compare_peers.py --shape 512,256,8,2 --check       # every contender's error, no timing
"""
import argparse
import os
import time

import numpy as np

import ktcy
from ktcy.bench import draw_routing, parse_shape


def numpy_moe(gate, up, down):
    """The textbook float32 MoE: gather each expert's rows, three matmuls, weighted scatter-add."""
    def forward(x, ids, w):
        y = np.zeros_like(x)
        for e in np.unique(ids):
            rows, slots = np.nonzero(ids == e)
            xe = x[rows]
            g = xe @ gate[e].T
            h = (g / (1 + np.exp(-g))) * (xe @ up[e].T)
            np.add.at(y, rows, w[rows, slots][:, None] * (h @ down[e].T))
        return y
    return forward


def torch_moe(gate, up, down, dtype):
    import torch
    g, u, d = (torch.from_numpy(a).to(dtype) for a in (gate, up, down))

    def forward(x, ids, w):
        with torch.inference_mode():
            xt = torch.from_numpy(x).to(dtype)
            idt, wt = torch.from_numpy(ids), torch.from_numpy(w).to(dtype)
            y = torch.zeros_like(xt)
            for e in torch.unique(idt).tolist():
                rows, slots = torch.nonzero(idt == e, as_tuple=True)
                xe = xt[rows]
                h = torch.nn.functional.silu(xe @ g[e].T) * (xe @ u[e].T)
                y.index_add_(0, rows, wt[rows, slots][:, None] * (h @ d[e].T))
            return y.float().numpy()
    return forward


def kt_moe_class(module, fmt):
    """The kt-kernel MoE class for fmt in the variant installed here: its AMX build has
    AMXBF16_MOE / AMXInt8_MOE, its AVX2 build AVX2BF16_MOE and the like; AMX classes only where
    ktcy finds AMX usable.  None when the build has no class for fmt."""
    amx = "amx" in ktcy.available_isas()
    names = sorted((n for n in dir(module) if n.upper().endswith("_MOE") and fmt in n.upper()),
                   key=lambda n: (not n.upper().startswith("AMX"), n))
    for name in names:
        if name.upper().startswith("AMX") and not amx:
            continue
        return getattr(module, name)
    return None


# kt-kernel's classes for weights quantized beforehand, best first, as its wrapper (utils/amx.py)
# picks them (INT4: RAWINT4, compressed-tensors' layout; GPTQ_INT4: symmetric GPTQ's; FP8: 128x128
# block scales, DeepSeek-V3's weight_scale_inv; FP8_PERCHANNEL: one scale per output row).  The
# first one its build has and this CPU runs is driven.  Its "AMX" KGroup and FP8 classes are
# AVX-512 code outside its amx build, and in 0.7.2 the KGroup ones take group 32 only (group 128
# crashed or gave wrong numbers).  The AVXVNNI256 classes need the CPU flag avx_vnni (VEX VNNI: Zen 5,
# Alder Lake and later, not every AVX2 CPU).
KT_QUANT_CLASSES = {"INT4": ("AMXInt4_KGroup_MOE", "AVXVNNI256RawInt4_MOE", "AVX2RawInt4_MOE"),
                    "GPTQ_INT4": ("AVXVNNI256GPTQInt4Packed_MOE", "AVXVNNI256GPTQInt4_MOE", "AVX2GPTQInt4_MOE"),
                    "MXFP4": ("AMXFP4_KGroup_MOE", "AVX2MXFP4_MOE"),
                    "FP8": ("AMXFP8_MOE", "AVX2FP8_MOE"),
                    "FP8_PERCHANNEL": ("AMXFP8PerChannel_MOE",)}
# With kt-kernel's avx2 build loaded (--kt-variant avx2, or an AVX2 host): its plain AVX2 class of
# each format runs too, beside the class above where that differs (INT4, GPTQ_INT4: the AVX-VNNI-256
# ones, which its wrapper prefers on CPUs with avx_vnni).
KT_AVX2_CLASSES = {"BF16": "AVX2BF16_MOE", "INT4": "AVX2RawInt4_MOE", "GPTQ_INT4": "AVX2GPTQInt4_MOE",
                   "MXFP4": "AVX2MXFP4_MOE", "FP8": "AVX2FP8_MOE"}
KT_VARIANTS = ("avx2", "avx512_base", "avx512_vnni", "avx512_vbmi", "avx512_bf16", "amx")
KT_INT4_GROUP = 32  # MXFP4's blocks are 32 wide too
# kt-kernel's pre-quantized formats: the ktcy format they are fed from (ktcy_pack) and kt-kernel's
# quant_config (bits, group_size; FP8_PERCHANNEL sets per_channel instead).
KT_PACKING = {"INT4": ("INT4", 4, KT_INT4_GROUP), "GPTQ_INT4": ("INT4", 4, KT_INT4_GROUP), "MXFP4": ("MXFP4", 4, 32),
              "FP8": ("FP8_BLOCK", 8, 128), "FP8_PERCHANNEL": ("FP8_PERCHANNEL", 8, 0)}
# The ktcy format each kt-kernel format is checked against (--check).
KTCY_TWIN = {"BF16": "BF16", "INT8": "INT8", "INT4": "INT4", "GPTQ_INT4": "INT4", "MXFP4": "MXFP4",
             "FP8": "FP8_BLOCK", "FP8_PERCHANNEL": "FP8_PERCHANNEL"}


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def kt_runs_here(name, flags):
    """Whether this CPU runs kt-kernel class name: AVX-VNNI-256 classes need avx_vnni."""
    return not name.startswith("AVXVNNI256") or bool(flags & {"avx_vnni", "avxvnni"})


def kt_class_choice(module, avx2_build):
    """[(format, class name)] to drive: BF16 / INT8 by kt_moe_class, the pre-quantized formats by
    KT_QUANT_CLASSES (the first one this build has and this CPU runs); with the avx2 build also
    each format's AVX2 class (KT_AVX2_CLASSES) where that is not the one chosen already."""
    flags = cpu_flags()
    chosen = [(fmt, cls.__name__) for fmt in ("BF16", "INT8") if (cls := kt_moe_class(module, fmt)) is not None]
    for fmt, names in KT_QUANT_CLASSES.items():
        found = [n for n in names if hasattr(module, n) and kt_runs_here(n, flags)]
        if found:
            chosen.append((fmt, found[0]))
    if avx2_build:
        for fmt, name in KT_AVX2_CLASSES.items():
            if hasattr(module, name) and (fmt, name) not in chosen:
                chosen.append((fmt, name))
    order = list(KTCY_TWIN)
    return sorted(chosen, key=lambda c: (order.index(c[0]), c[1] != KT_AVX2_CLASSES.get(c[0])))


def bf16_bits(a):
    """float32 -> bf16 bit patterns, rounded to nearest even (ktcy's group scales as kt-kernel
    takes them; MXFP4's powers of two are exact)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def kt_quantized(packed, gptq=False):
    """One ktcy packed weight as kt-kernel's pre-quantized classes read it: 4-bit codes two per
    byte, the even K element in the low nibble, [N, K/2]; bf16 scales [N, K/group].  RAWINT4
    (compressed-tensors' symmetric INT4) stores code + 8, as ktcy's INT4 does; MXFP4 its E2M1
    codes with each E8M0 exponent e as the bf16 bits e << 7 (2^(e - 127)).  gptq: GPTQ's own
    transposed layout instead, int32 [K/8, N] holding k = 8r + j in nibble j of row r, float32
    scales [K/group, N].  FP8: the E4M3 bytes row-major [N, K] (DeepSeek-V3's weight) with
    float32 scales that multiply: [ceil(N/128), ceil(K/128)] row-major for 128x128 blocks
    (its weight_scale_inv, ktcy's FP8_BLOCK scale grid as it is), [N] per channel."""
    n, k = packed.shape
    if packed.format == "FP8_BLOCK":
        return np.ascontiguousarray(packed.codes()), np.ascontiguousarray(packed.scale, np.float32)
    if packed.format == "FP8_PERCHANNEL":
        return np.ascontiguousarray(packed.codes()), np.ascontiguousarray(packed.scale.reshape(-1)[:n], np.float32)
    codes = packed.codes().astype(np.int16)
    if gptq:
        nibbles = (codes + 8).astype(np.uint32).T.reshape(k // 8, 8, n)
        words = sum(nibbles[:, j] << np.uint32(4 * j) for j in range(8))
        return np.ascontiguousarray(words.view(np.int32)), np.ascontiguousarray(packed.group_scales()[:, :n])
    if packed.format == "INT4":
        codes = codes + 8
        scales = bf16_bits(packed.group_scales()[:, :n].T)
    else:
        scales = packed.block_exponents().astype(np.uint16) << 7
    nibbles = codes.astype(np.uint8)
    return np.ascontiguousarray(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)), np.ascontiguousarray(scales)


class KtKernelPeer:
    """kt-kernel 0.7.2 driven through its extension the way its own wrapper does: one CPUInfer
    worker pool, MOEConfig with bf16 weight pointers (online quantization) or with the codes and
    scales of weights quantized beforehand, forward_task."""

    def __init__(self, gate, up, down, threads, max_tokens):
        import kt_kernel  # loads the kt_kernel_ext build that fits this CPU (or KT_KERNEL_CPU_VARIANT's)
        import kt_kernel_ext
        import torch
        config = kt_kernel_ext.WorkerPoolConfig()
        config.subpool_count, config.subpool_numa_map, config.subpool_thread_count = 1, [0], [threads]
        self.pool = kt_kernel_ext.CPUInfer(config)
        self.variant, self.library = kt_kernel.__cpu_variant__, os.path.basename(kt_kernel_ext.__file__)
        self.classes = [(fmt, getattr(kt_kernel_ext.moe, name))
                        for fmt, name in kt_class_choice(kt_kernel_ext.moe, self.variant == "avx2")]
        self.float_weights = (gate, up, down)
        self.weights = [torch.from_numpy(a).to(torch.bfloat16).contiguous() for a in (gate, up, down)]
        self.gpu_mask = torch.zeros(gate.shape[0], dtype=torch.bool)
        self.max_tokens = -(-max_tokens // 32) * 32  # its buffers come in 32-row steps
        self.keep = []

    def layer(self, fmt, cls, top_k):
        import tempfile

        import torch
        from kt_kernel_ext.moe import MOEConfig
        g, u, d = self.weights
        E, I, H = g.shape
        cfg = MOEConfig(E, top_k, H, I, self.gpu_mask.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len, cfg.save, cfg.load = 0, self.pool.backend_, self.max_tokens, False, False
        cfg.gate_proj, cfg.up_proj, cfg.down_proj, cfg.path = g.data_ptr(), u.data_ptr(), d.data_ptr(), tempfile.mkdtemp()
        if fmt in KT_PACKING:
            arrays = self.quantized_arrays(fmt)
            bits, group = KT_PACKING[fmt][1:]
            cfg.quant_config.bits, cfg.quant_config.zero_point, cfg.quant_config.group_size = bits, False, group
            cfg.quant_config.per_channel = fmt == "FP8_PERCHANNEL"
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (arrays[p][0].ctypes.data for p in ("gate", "up", "down"))
            cfg.gate_scale, cfg.up_scale, cfg.down_scale = (arrays[p][1].ctypes.data for p in ("gate", "up", "down"))
            self.keep.append(arrays)
        moe = cls(cfg)
        expert_map = torch.arange(E, dtype=torch.int64)
        self.pool.submit(moe.load_weights_task(expert_map.data_ptr()))
        self.pool.sync()
        self.keep.append((moe, cfg, expert_map))

        def forward(x, ids, w):
            T = x.shape[0]
            xt = torch.from_numpy(x).to(torch.bfloat16)
            idt, wt = torch.from_numpy(np.ascontiguousarray(ids, np.int64)), torch.from_numpy(w)
            out, bsz = torch.empty((T, H), dtype=torch.bfloat16), torch.full((1,), T, dtype=torch.int32)
            self.pool.submit(moe.forward_task(bsz.data_ptr(), top_k, idt.data_ptr(), wt.data_ptr(), xt.data_ptr(),
                                              out.data_ptr(), False))
            self.pool.sync()
            return out
        return forward

    def quantized_arrays(self, fmt):
        """{projection: (codes [E, ...], scales [E, ...])} from ktcy's packing of the float weights
        (INT4 at kt-kernel's group 32), so both libraries run the same codes (kt_quantized)."""
        arrays = {}
        for name, w in zip(("gate", "up", "down"), self.float_weights):
            parts = [kt_quantized(ktcy_pack(w[e], KT_PACKING[fmt][0]), gptq=fmt == "GPTQ_INT4")
                     for e in range(w.shape[0])]
            arrays[name] = tuple(np.ascontiguousarray(np.stack(a)) for a in zip(*parts))
        return arrays


def ktcy_pack(w, fmt):
    """ktcy's packing of one expert matrix, INT4 at kt-kernel's group (as the ktcy layers here)."""
    return ktcy.kernels.pack(w, fmt, group_size=KT_INT4_GROUP) if fmt == "INT4" else ktcy.kernels.pack(w, fmt)


def as_array(y):
    return y.float().numpy() if hasattr(y, "float") else np.asarray(y, np.float32)


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check(contenders, twins, weights, rng, tokens, E, k):
    """Every contender's output against the float32 MoE, against the float MoE over the very
    weights ktcy quantized (exact dequantization: what a correct kernel differs from by activation
    rounding only) and against ktcy's layer of the same format; relative Frobenius errors."""
    H, width = weights[0].shape[2], max(len(n) for n in contenders)
    dequantized = {}
    for T in tokens:
        x, ids, w = fresh_calls(rng, 1, T, H, E, k)[0]
        outs = {name: as_array(fn(x, ids, w)) for name, fn in contenders.items()}
        ref = outs["numpy fp32"]
        print(f"\nT={T}: relative error vs float32 / vs float over ktcy's quantized weights / vs ktcy same format")
        for name, y in outs.items():
            twin = twins.get(name)
            cols = [f"{rel_err(y, ref):8.4f}"]
            if twin is not None:
                if twin not in dequantized:
                    dequantized[twin] = numpy_moe(*(np.stack([ktcy_pack(a[e], twin).dequantize(np.float32)
                                                              for e in range(E)]) for a in weights))
                cols.append(f"{rel_err(y, dequantized[twin](x, ids, w)):8.4f}")
                cols.append(f"{rel_err(y, outs[f'ktcy {twin}']):8.4f}" if f"ktcy {twin}" in outs else "       -")
            print(f"  {name:{width}s} " + "  ".join(cols))


def cpu_seconds():
    """(wall, CPU seconds all processes spent busy, CPU seconds this process spent), to tell how
    much other processes took from a run (None where /proc/stat is not there)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    t = os.times()
    return time.perf_counter(), (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), t.user + t.system


def median_time(fn, calls):
    """Median seconds over calls[1:] (calls[0] warms up); every call carries its own routing."""
    fn(*calls[0])
    times = []
    for args in calls[1:]:
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def fresh_calls(rng, n, T, H, E, k):
    """n (x, ids, w) calls, each with a routing drawn afresh, so no call finds its experts in a
    cache that an earlier call (of any contender) filled."""
    return [(rng.standard_normal((T, H), np.float32), draw_routing(rng, T, E, k), rng.random((T, k), np.float32))
            for _ in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b")
    ap.add_argument("--tokens", default="1,32,512")
    ap.add_argument("--formats", default="BF16,INT8,FP8_PERCHANNEL,INT4,MXFP4")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median over all calls is kept")
    ap.add_argument("--kt-threads", type=int, default=None, help="kt-kernel worker threads (default: ktcy's)")
    ap.add_argument("--kt-variant", choices=KT_VARIANTS, default=None,
                    help="kt-kernel build to load (sets KT_KERNEL_CPU_VARIANT; default: the one its detection "
                         "picks for this CPU); avx2 also drives its AVX2 class of each format")
    ap.add_argument("--check", action="store_true",
                    help="print every contender's error on one call per token count instead of timing")
    args = ap.parse_args()
    if args.kt_variant:
        if args.kt_variant == "amx" and not {"amx_tile", "amx_bf16"} <= cpu_flags():
            ap.error("--kt-variant amx on a CPU without AMX: its tile classes would die of SIGILL")
        os.environ["KT_KERNEL_CPU_VARIANT"] = args.kt_variant
    H, I, E, k, note = parse_shape(args.shape)
    rng = np.random.default_rng(0)
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.02 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.02
    contenders = {"numpy fp32": numpy_moe(gate, up, down)}
    twins = {}
    try:
        import torch
        torch.set_num_threads(ktcy.get_num_threads())
        contenders["torch fp32"] = torch_moe(gate, up, down, torch.float32)
        contenders["torch bf16"] = torch_moe(gate, up, down, torch.bfloat16)
        twins["torch bf16"] = "BF16"
        torch_note = f"torch {torch.__version__}"
    except ImportError:
        torch_note = "torch not installed"
    kt_note = "kt-kernel not installed: skipped"
    try:
        import kt_kernel  # noqa: F401
    except ImportError:
        pass
    else:
        from kt_kernel._cpu_detect import detect_cpu_features
        forced = os.environ.pop("KT_KERNEL_CPU_VARIANT", None)
        own = detect_cpu_features()  # the build kt-kernel would load here by itself
        if forced is not None:
            os.environ["KT_KERNEL_CPU_VARIANT"] = forced
        threads = args.kt_threads or ktcy.get_num_threads()
        peer = KtKernelPeer(gate, up, down, threads, max(int(t) for t in args.tokens.split(",")))
        per_format = {}
        for fmt, cls in peer.classes:
            per_format[fmt] = per_format.get(fmt, 0) + 1
        for fmt, cls in peer.classes:  # a format with several classes names each
            name = f"kt-kernel {fmt}" + (f" {cls.__name__.removesuffix('_MOE')}" if per_format[fmt] > 1 else "")
            contenders[name] = peer.layer(fmt, cls, k)
            twins[name] = KTCY_TWIN[fmt]
        missing = [f for f in ("BF16", "INT8") if f not in per_format]
        kt_note = (f"kt-kernel {kt_kernel.__version__} build {peer.variant} ({peer.library}"
                   + (f", forced: on its own it loads {own} here" if peer.variant != own else ", its own choice here")
                   + f"), {threads} worker threads; classes: "
                   + ", ".join(f"{fmt} {cls.__name__}" for fmt, cls in peer.classes)
                   + (f"; its build has no {'/'.join(missing)} class: skipped" if missing else ""))
    for fmt in args.formats.split(","):  # INT4 at kt-kernel's group, so both run the same codes
        quant = ktcy.QuantConfig(fmt, group_size=KT_INT4_GROUP) if fmt == "INT4" else ktcy.QuantConfig(fmt)
        layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, quant), gate, up, down)
        contenders[f"ktcy {layer.format}"] = layer.forward
        twins[f"ktcy {layer.format}"] = layer.format
    kernels = sorted({ktcy.kernel_table()[f]['variant'] for f in ktcy.FORMATS})
    print(f"{note}; {ktcy.get_num_threads()} threads; {torch_note}; ktcy kernels: {', '.join(kernels)}"
          + (f" (KTCY_ISA={os.environ['KTCY_ISA']})" if os.environ.get("KTCY_ISA") else ""))
    print(kt_note)
    if args.kt_variant == "avx2":
        flags = cpu_flags()
        host = "AVX-512" if "avx512f" in flags else "AVX2"
        limited = all("avx2" in v for v in kernels)
        print("kt-kernel's AVX2 build against ktcy's kernels above"
              + ("" if limited else " (ktcy not limited to AVX2: set KTCY_ISA=avx2)") + f", on this {host} host"
              + (", not an AVX2-only one (its AVX-VNNI-256 classes need avx_vnni, which plain AVX2 CPUs lack)"
                 if host == "AVX-512" else ""))
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.check:
        check(contenders, twins, (gate, up, down), rng, tokens, E, k)
        return
    width = max(22, *(len(n) for n in contenders))
    for T in tokens:
        n = 4 if T >= 128 else 12
        results, start = {name: [] for name in contenders}, cpu_seconds()
        for _ in range(args.rounds):  # interleave, so drifting machine load hits everyone alike
            for name, fn in contenders.items():
                time.sleep(0.06)  # let the previous contender's threads go idle (kt-kernel's spin 50 ms)
                results[name].append(median_time(fn, fresh_calls(rng, n, T, H, E, k)))
        med = {name: float(np.median(v)) for name, v in results.items()}
        end = cpu_seconds()
        if start is None or end is None:
            others = ""
        else:
            busy = max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])
            others = f" (other processes kept {busy:.2f} CPUs busy meanwhile)"
        print(f"\nT={T}{others}")
        for name, t in sorted(med.items(), key=lambda kv: kv[1]):
            ratios = "  ".join(f"{t / med[f]:6.2f}x {f.split()[1]}" for f in med if f.startswith("ktcy"))
            print(f"  {name:{width}s} {t * 1e3:9.2f} ms   time / ktcy: {ratios}")


if __name__ == "__main__":
    main()
