"""ktcy's INT4_MIN (GGUF Q4_K experts kept as stored) beside kt-kernel's LLAMAFILE MoE (llama.cpp's
own Q4_K kernels) on the same Q4_K bytes: one MoE layer of Qwen3-30B-A3B's shape (H 2048, I 768,
top 8, E experts), a fresh routing per call, the two called in alternation round after round.
Prints the median times, their per-round ratio, and how far the outputs differ.  Not part of CI.

    python bench/compare_q4k_peer.py --experts 128 --rounds 5     (kt-kernel installed: bench/README.md)

The weights are random Q4_K blocks (random codes, 6-bit scales and mins, f16 d and dmin in
[5e-4, 1e-3]): speed does not depend on their values, but their rows have a large common mode,
so both libraries' int8 activations (ktcy per row, kt-kernel per 256 values) move the outputs by
tens of percent from float64 on them; ktcy's outputs equal a float64 computation with its int8
activations (tests/test_gguf.py holds the accuracy on decodable weights)."""
import argparse
import sys
import time

import numpy as np

import ktcy
from ktcy.gguf_checkpoint import stored_form

H, I, TOP_K = 2048, 768, 8


def q4_k_blocks(rng, rows, k):
    """[rows, k / 256 * 144] bytes of random Q4_K blocks with finite, positive f16 d and dmin."""
    b = rng.integers(0, 256, (rows * k // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        b[:, at:at + 2] = (rng.uniform(0.5, 1, (len(b), 1)) * 1e-3).astype(np.float16).view(np.uint8)
    return b.reshape(rows, k // 256 * 144)


def kt_kernel_layer(raw, E, threads, max_len):
    """kt-kernel's LLAMAFILE MOE over the raw Q4_K stacks, driven as its LlamafileMoEWrapper does."""
    import kt_kernel  # noqa: F401  (loads the kt_kernel_ext build that fits this CPU)
    import kt_kernel_ext
    import torch
    from kt_kernel_ext.kvcache import ggml_type
    from kt_kernel_ext.moe import MOE, MOEConfig
    pool_config = kt_kernel_ext.WorkerPoolConfig()
    pool_config.subpool_count, pool_config.subpool_numa_map, pool_config.subpool_thread_count = 1, [0], [threads]
    pool = kt_kernel_ext.CPUInfer(pool_config)
    mask = torch.zeros(E, dtype=torch.bool)
    config = MOEConfig(E, TOP_K, H, I, mask.data_ptr())
    config.layer_idx, config.pool = 0, pool.backend_
    config.m_block, config.group_min_len, config.max_len, config.group_max_len = 32, 10, max_len, max_len
    config.gate_proj, config.up_proj, config.down_proj = (raw[p].ctypes.data for p in ("gate", "up", "down"))
    config.gate_type = config.up_type = config.down_type = ggml_type.Q4_K
    config.hidden_type = ggml_type.BF16
    moe = MOE(config)
    expert_map = torch.arange(E, dtype=torch.int32)
    pool.submit(moe.load_weights_task(expert_map.data_ptr()))
    pool.sync()
    keep = (pool, mask, config, moe, expert_map)

    def forward(x, ids, w):
        T = x.shape[0]
        xt = torch.from_numpy(x).to(torch.bfloat16)
        idt, wt = torch.from_numpy(np.ascontiguousarray(ids, np.int64)), torch.from_numpy(w)
        out, bsz = torch.empty((T, H), dtype=torch.bfloat16), torch.full((1,), T, dtype=torch.int32)
        pool.submit(moe.forward_task(bsz.data_ptr(), TOP_K, idt.data_ptr(), wt.data_ptr(), xt.data_ptr(),
                                     out.data_ptr(), False))
        pool.sync()
        return out.float().numpy()
    forward.keep = keep  # the pool, config and module live as long as the function
    return forward


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", default="1,32,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        import kt_kernel  # noqa: F401
    except ImportError as e:
        print(f"compare_q4k_peer: kt-kernel is not installed here ({e}); bench/README.md says how", file=sys.stderr)
        return 2
    E, tokens = args.experts, [int(t) for t in args.tokens.split(",")]
    rng = np.random.default_rng(0)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    raw = {p: np.stack([q4_k_blocks(rng, *shapes[p]) for _ in range(E)]) for p in shapes}
    config = ktcy.MoeConfig(E, TOP_K, H, I, ktcy.QuantConfig("INT4_MIN", group_size=32), num_threads=args.threads)
    ours = ktcy.MoE.from_experts(config, lambda e: {p: stored_form("Q4_K", raw[p][e].reshape(-1), shapes[p])
                                                    for p in shapes})
    theirs = kt_kernel_layer(raw, E, args.threads, max(32, -(-max(tokens) // 32) * 32))
    print(f"{ours.kernel}; kt-kernel LLAMAFILE (Q4_K); {E} experts, {args.threads} threads", flush=True)
    for T in tokens:
        x = rng.standard_normal((T, H)).astype(np.float32)
        calls = max(3, 60 // T)
        routes = [(np.argsort(rng.random((T, E)), axis=1)[:, :TOP_K], rng.random((T, TOP_K)).astype(np.float32))
                  for _ in range(calls)]
        a, b = ours.forward(x, *routes[0]), theirs(x, *routes[0])
        times = {"ktcy": [], "kt": []}
        for _ in range(args.rounds):
            for name, fn in (("ktcy", ours.forward), ("kt", theirs)):
                t0 = time.perf_counter()
                for ids, wts in routes:
                    fn(x, ids, wts)
                times[name].append((time.perf_counter() - t0) / calls)
        ratio = np.median(np.array(times["kt"]) / np.array(times["ktcy"]))
        print(f"T = {T}: ktcy {np.median(times['ktcy']) * 1e3:.2f} ms, kt-kernel {np.median(times['kt']) * 1e3:.2f} ms, "
              f"kt-kernel / ktcy {ratio:.2f}x; outputs {np.linalg.norm(a - b) / np.linalg.norm(a):.3f} apart", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
