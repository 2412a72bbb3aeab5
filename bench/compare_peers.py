#!/usr/bin/env python3
"""Side-by-side MoE forward: ktcy against a straightforward numpy float32 MoE, PyTorch CPU (bf16
and fp32) and kt-kernel (BF16, INT8 with the classes its installed build has; RAWINT4 and MXFP4 on
the codes ktcy packed) when installed, interleaved in one run on the same weights, every call with
a freshly drawn routing, printed as time ratios to ktcy.  Not part of CI; see bench/README.md for
installing the peers.

    python bench/compare_peers.py [--shape qwen3-30b] [--tokens 1,32,512] [--formats BF16,INT8]
"""
import argparse
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


# kt-kernel's classes for weights quantized beforehand, best first (INT4: RAWINT4, compressed-
# tensors' layout; GPTQ_INT4: symmetric GPTQ's).  Its "AMX" KGroup classes are AVX-512 code, and
# in 0.7.2 they take group 32 only (group 128 crashed or gave wrong numbers).
KT_QUANT_CLASSES = {"INT4": ("AMXInt4_KGroup_MOE", "AVXVNNI256RawInt4_MOE", "AVX2RawInt4_MOE"),
                    "GPTQ_INT4": ("AVXVNNI256GPTQInt4Packed_MOE", "AVXVNNI256GPTQInt4_MOE", "AVX2GPTQInt4_MOE"),
                    "MXFP4": ("AMXFP4_KGroup_MOE", "AVX2MXFP4_MOE")}
KT_INT4_GROUP = 32  # MXFP4's blocks are 32 wide too


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
    scales [K/group, N]."""
    n, k = packed.shape
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
        import kt_kernel  # noqa: F401  (loads the kt_kernel_ext build that fits this CPU)
        import kt_kernel_ext
        import torch
        config = kt_kernel_ext.WorkerPoolConfig()
        config.subpool_count, config.subpool_numa_map, config.subpool_thread_count = 1, [0], [threads]
        self.pool = kt_kernel_ext.CPUInfer(config)
        self.classes = {fmt: cls for fmt in ("BF16", "INT8")
                        if (cls := kt_moe_class(kt_kernel_ext.moe, fmt)) is not None}
        for fmt, names in KT_QUANT_CLASSES.items():
            found = [getattr(kt_kernel_ext.moe, n) for n in names if hasattr(kt_kernel_ext.moe, n)]
            if found:
                self.classes[fmt] = found[0]
        self.float_weights = (gate, up, down)
        self.weights = [torch.from_numpy(a).to(torch.bfloat16).contiguous() for a in (gate, up, down)]
        self.gpu_mask = torch.zeros(gate.shape[0], dtype=torch.bool)
        self.max_tokens = -(-max_tokens // 32) * 32  # its buffers come in 32-row steps
        self.keep = []

    def layer(self, fmt, top_k):
        import tempfile

        import torch
        from kt_kernel_ext.moe import MOEConfig
        g, u, d = self.weights
        E, I, H = g.shape
        cfg = MOEConfig(E, top_k, H, I, self.gpu_mask.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len, cfg.save, cfg.load = 0, self.pool.backend_, self.max_tokens, False, False
        cfg.gate_proj, cfg.up_proj, cfg.down_proj, cfg.path = g.data_ptr(), u.data_ptr(), d.data_ptr(), tempfile.mkdtemp()
        if fmt in KT_QUANT_CLASSES:
            arrays = self.quantized_arrays(fmt)
            cfg.quant_config.bits, cfg.quant_config.zero_point, cfg.quant_config.group_size = 4, False, KT_INT4_GROUP
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (arrays[p][0].ctypes.data for p in ("gate", "up", "down"))
            cfg.gate_scale, cfg.up_scale, cfg.down_scale = (arrays[p][1].ctypes.data for p in ("gate", "up", "down"))
            self.keep.append(arrays)
        moe = self.classes[fmt](cfg)
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
        """{projection: (codes [E, N, K/2], scales [E, N, K/group])} from ktcy's packing of the
        float weights (INT4 at kt-kernel's group 32), so both libraries run the same codes."""
        packing = ("MXFP4", {}) if fmt == "MXFP4" else ("INT4", {"group_size": KT_INT4_GROUP})
        arrays = {}
        for name, w in zip(("gate", "up", "down"), self.float_weights):
            parts = [kt_quantized(ktcy.kernels.pack(w[e], packing[0], **packing[1]), gptq=fmt == "GPTQ_INT4")
                     for e in range(w.shape[0])]
            arrays[name] = tuple(np.ascontiguousarray(np.stack(a)) for a in zip(*parts))
        return arrays


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
    args = ap.parse_args()
    H, I, E, k, note = parse_shape(args.shape)
    rng = np.random.default_rng(0)
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.02 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.02
    contenders = {"numpy fp32": numpy_moe(gate, up, down)}
    try:
        import torch
        torch.set_num_threads(ktcy.get_num_threads())
        contenders["torch fp32"] = torch_moe(gate, up, down, torch.float32)
        contenders["torch bf16"] = torch_moe(gate, up, down, torch.bfloat16)
        torch_note = f"torch {torch.__version__}"
    except ImportError:
        torch_note = "torch not installed"
    kt_note = "kt-kernel not installed: skipped"
    try:
        import kt_kernel  # noqa: F401
    except ImportError:
        pass
    else:
        threads = args.kt_threads or ktcy.get_num_threads()
        peer = KtKernelPeer(gate, up, down, threads, max(int(t) for t in args.tokens.split(",")))
        for fmt, cls in peer.classes.items():
            contenders[f"kt-kernel {fmt}"] = peer.layer(fmt, k)
        missing = [f for f in ("BF16", "INT8") if f not in peer.classes]
        kt_note = (f"kt-kernel with {threads} worker threads ({', '.join(c.__name__ for c in peer.classes.values())})"
                   + (f"; its build has no {'/'.join(missing)} class: skipped" if missing else ""))
    for fmt in args.formats.split(","):  # INT4 at kt-kernel's group, so both run the same codes
        quant = ktcy.QuantConfig(fmt, group_size=KT_INT4_GROUP) if fmt == "INT4" else ktcy.QuantConfig(fmt)
        layer = ktcy.MoE.from_weights(ktcy.MoeConfig(E, k, H, I, quant), gate, up, down)
        contenders[f"ktcy {layer.format}"] = layer.forward
    print(f"{note}; {ktcy.get_num_threads()} threads; {torch_note}; {kt_note}; ktcy kernels: "
          + ", ".join(sorted({ktcy.kernel_table()[f]['variant'] for f in ktcy.FORMATS})))
    for T in (int(t) for t in args.tokens.split(",")):
        n = 4 if T >= 128 else 12
        results = {name: [] for name in contenders}
        for _ in range(args.rounds):  # interleave, so drifting machine load hits everyone alike
            for name, fn in contenders.items():
                time.sleep(0.05)  # let the previous contender's threads go idle
                results[name].append(median_time(fn, fresh_calls(rng, n, T, H, E, k)))
        med = {name: float(np.median(v)) for name, v in results.items()}
        print(f"\nT={T}")
        for name, t in sorted(med.items(), key=lambda kv: kv[1]):
            ratios = "  ".join(f"{t / med[f]:6.2f}x {f.split()[1]}" for f in med if f.startswith("ktcy"))
            print(f"  {name:22s} {t * 1e3:9.2f} ms   time / ktcy: {ratios}")


if __name__ == "__main__":
    main()
