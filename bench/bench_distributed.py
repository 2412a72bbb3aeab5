"""Expert parallelism on one machine: 2 ranks x 1 thread (ktcy launch --numa --nproc 2, gloo on
127.0.0.1) against 1 process x 2 threads, on one Qwen3-30B-A3B-shaped layer (H 2048, I 768,
128 experts, top 8), T = 1 and 512; and the gloo all_reduce on loopback alone (latency and
bandwidth per size), the figures docs/scaling.md builds on.

    python bench/bench_distributed.py [--formats INT8,INT4] [--tokens 1,512] [--json out.json]

Here nothing is gained by splitting (both ranks share one memory system) and everything is paid
(the all_reduce, the input check, waiting for the rank that got more of the token's experts), so
the ratio is the overhead a real two-socket or two-host run must beat with its extra bandwidth.
Calls run back to back, as in a decode loop, each with its own routing (the same on every
rank: one seed); figures are per call, the median of 3 loops.  As in `ktcy bench`, 16
distinct experts are packed and the others are copies in their own memory."""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

H, I, E, K = 2048, 768, 128, 8
DISTINCT = 16
# (reduce, check_inputs, spin_wait)
VARIANTS = (("slots", True, True), ("slots", False, True), ("sum", True, True), ("slots", True, False))
ALLREDUCE_BYTES = (4 << 10, 64 << 10, 512 << 10, 4 << 20, 32 << 20)


def reps_for(T):
    return 60 if T == 1 else 6


def build_layer(fmt, keep=None):
    """A full MoE object whose experts in `keep` (default all) have their own memory; the others
    share a distinct expert's bytes (never run: from_moe drops them)."""
    import ktcy
    from ktcy import kernels
    cfg = ktcy.MoeConfig(E, K, H, I, ktcy.QuantConfig(fmt))
    rng = np.random.default_rng(0)
    packed = {p: [] for p in ("gate", "up", "down")}
    for e in range(DISTINCT):
        for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            packed[p].append(kernels.pack((rng.standard_normal(shape) * 0.02).astype(np.float32), cfg.weight_format,
                                          group_size=cfg.quant_config.group_size))
    for e in range(DISTINCT, E):
        for ws in packed.values():
            base = ws[e % DISTINCT]
            ws.append(_copy(base) if keep is None or e in keep else base)
    return ktcy.MoE(cfg, packed["gate"], packed["up"], packed["down"])


def _copy(w):
    arrays = {k: getattr(w, k) for k in ("data", "scale", "colsum", "zero")}
    return dataclasses.replace(w, **{k: None if a is None else a.copy() for k, a in arrays.items()})


def routing(seed, T):
    rng = np.random.default_rng(seed)
    ids = np.argpartition(rng.random((T, E)), K - 1, axis=1)[:, :K].astype(np.int64)
    w = rng.random((T, K)).astype(np.float32)
    return rng.standard_normal((T, H)).astype(np.float32), ids, w / w.sum(axis=1, keepdims=True)


def expert_bytes(moe):
    return moe.gate[0].nbytes + moe.up[0].nbytes + moe.down[0].nbytes


def loop_seconds(call, args, rounds=3):
    """Seconds per call of back-to-back calls (as in a decode loop, no barrier between them),
    the median of `rounds` loops over the routings in args."""
    per_call = []
    for _ in range(rounds):
        t = time.perf_counter()
        for a in args:
            call(*a)
        per_call.append((time.perf_counter() - t) / len(args))
    return float(np.median(per_call))


def single(fmt, tokens):
    """1 process, the threads KTCY_NUM_THREADS gives (2 here)."""
    import ktcy
    moe = build_layer(fmt)
    rows = []
    for T in tokens:
        args = [routing(rep, T) for rep in range(reps_for(T))]
        moe.forward(*routing(10**6, T))
        seconds = loop_seconds(moe.forward, args)
        touched = np.mean([len(np.unique(ids)) for _, ids, _ in args]) * expert_bytes(moe)
        rows.append({"format": fmt, "T": T, "threads": ktcy.get_num_threads(), "step_ms": 1e3 * seconds,
                     "weight_gbs": touched / seconds / 1e9})
    return rows


def rank_main(fmt, tokens):
    import torch
    import torch.distributed as dist
    from ktcy.distributed import ExpertParallelMoE, Placement, init_process_group
    from ktcy.distributed.comm import Group
    init_process_group(timeout=120)
    group = Group()
    placement = Placement.contiguous(E, group.world_size)
    full = build_layer(fmt, keep=set(placement.local_experts(group.rank)))
    rows = []
    for reduce, check, spin in VARIANTS:
        group = Group(spin_wait=spin)
        ep = ExpertParallelMoE.from_moe(full, group=group, reduce=reduce, check_inputs=check)
        for T in tokens:
            args = [routing(rep, T) for rep in range(reps_for(T))]
            ep.forward(*routing(10**6, T))
            dist.barrier()
            step = loop_seconds(ep.forward, args)
            routed = [(x, placement.route(ids, group.rank), w) for x, ids, w in args]
            local = loop_seconds(ep.local.forward_slots if reduce == "slots" else ep.local.forward, routed)
            computed = np.mean([len(np.unique(r[r >= 0])) for _, r, _ in routed])
            buffer = np.zeros(T * K * H + 1 if reduce == "slots" else T * H + 1, np.float32)
            dist.barrier()
            reduce_s = loop_seconds(lambda: group.all_reduce_sum(buffer, "bench"), [()] * len(args))
            dist.barrier()
            check_s = loop_seconds(lambda: group.gather_ints([0] * 8, "bench"), [()] * len(args))
            mine = torch.tensor([step, local, reduce_s, check_s, computed], dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(group.world_size)]
            dist.all_gather(every, mine)
            per_rank = torch.stack(every).numpy()
            rows.append({"format": fmt, "T": T, "reduce": reduce, "check_inputs": check, "spin_wait": spin,
                         "step_ms": 1e3 * per_rank[:, 0].max(), "local_ms": (1e3 * per_rank[:, 1]).tolist(),
                         "all_reduce_ms": 1e3 * per_rank[:, 2].max(), "check_ms": 1e3 * per_rank[:, 3].max(),
                         "experts_per_rank": per_rank[:, 4].tolist(), "all_reduce_bytes": int(buffer.nbytes)})
    loopback = []
    group = Group()  # polling, as ExpertParallelMoE's default
    for nbytes in ALLREDUCE_BYTES:
        buffer = np.zeros(nbytes // 4, np.float32)
        dist.barrier()
        seconds = loop_seconds(lambda: group.all_reduce_sum(buffer, "bench"), [()] * (30 if nbytes <= 1 << 20 else 8))
        loopback.append({"bytes": nbytes, "ms": 1e3 * seconds})
    if group.rank == 0:
        with open(os.environ["KTCY_BENCH_OUT"], "w") as f:
            json.dump({"rows": rows, "loopback": loopback}, f)
    dist.destroy_process_group()


# ---- the paper model of docs/scaling.md ------------------------------------------------------

# (name, format, INT4 group, MoE layers, routed experts, top-k, hidden, expert intermediate)
MODELS = (("DeepSeek-V3 FP8", "FP8_BLOCK", 0, 58, 256, 8, 7168, 2048),
          ("DeepSeek-V3 INT4", "INT4", 64, 58, 256, 8, 7168, 2048),
          ("Kimi-K2 INT4", "INT4", 32, 60, 384, 8, 7168, 2048))
NETWORKS = (("25 GbE", 25e9 / 8), ("100 GbE", 100e9 / 8))


def packed_expert_bytes(fmt, group, H, I):
    """Bytes of one packed expert (gate + up + down) in ktcy's layout, from the format table."""
    from ktcy import _native
    from ktcy.formats import FORMATS
    total = 0
    for N, K in ((I, H), (I, H), (H, I)):
        shapes = _native.packed_shapes(FORMATS.index(fmt), N, K, group)
        for part, size in (("data", 1), ("scale", 4), ("colsum", 4), ("zero", 1)):
            if shapes[part]:
                total += size * int(np.prod(shapes[part]))
    return total


def busiest_host_experts(E, k, hosts, samples=20000, seed=0):
    """Expected experts of one token on the busiest host (contiguous placement, uniform routing):
    the host that waits for nobody sets the layer's time."""
    rng = np.random.default_rng(seed)
    ids = np.argpartition(rng.random((samples, E)), k - 1, axis=1)[:, :k]
    owner = ids * hosts // E
    return float(np.mean([np.bincount(row, minlength=hosts).max() for row in owner]))


def scaling(host_gbs, step_latency_s):
    """Tables for 1, 2, 4, 8 hosts: expert bytes per host, all_reduce bytes per layer per token,
    and batch-1 decode tokens/s from host bandwidth and network (experts and all_reduce only)."""
    print(f"host: {host_gbs:.0f} GB/s of expert reads; all_reduce: 2(N-1) ring steps of {1e6 * step_latency_s:.0f} us "
          f"+ 2(N-1)/N x bytes / link bandwidth")
    for name, fmt, group, layers, E, k, H, I in MODELS:
        eb = packed_expert_bytes(fmt, group, H, I)
        print(f"\n{name}: {eb / 1e6:.1f} MB per expert, {layers * E * eb / 1e9:.0f} GB of experts; all_reduce per layer per "
              f"token {k * H * 4 / 1024:.0f} KiB (slots, exact) or {H * 4 / 1024:.0f} KiB (sum)")
        print(f"{'hosts':>5} {'GB/host':>8} {'busiest':>7} {'expert ms':>9} " + " ".join(
            f"{net + ' ' + mode:>16}" for net, _ in NETWORKS for mode in ("slots", "sum")) + f" {'100 GbE a2a':>16}")
        for N in (1, 2, 4, 8):
            per_host = layers * -(-E // N) * eb
            busiest = busiest_host_experts(E, k, N) if N > 1 else k
            expert_s = layers * busiest * eb / (host_gbs * 1e9)
            cells = []
            for _, link in NETWORKS:
                for nbytes in (k * H * 4, H * 4):
                    net_s = 0 if N == 1 else layers * (2 * (N - 1) * step_latency_s + 2 * (N - 1) / N * nbytes / link)
                    cells.append(f"{1 / (expert_s + net_s):>10.1f} tok/s")
            # all-to-all: the token's bf16 row to each host holding its experts and one bf16 partial
            # sum back from each: two direct exchanges per layer, whatever N
            remote = N * (1 - (1 - 1 / N) ** k) * (N - 1) / N if N > 1 else 0
            a2a_s = 0 if N == 1 else layers * (2 * step_latency_s + 2 * remote * H * 2 / NETWORKS[1][1])
            cells.append(f"{1 / (expert_s + a2a_s):>10.1f} tok/s")
            print(f"{N:>5} {per_host / 1e9:>8.0f} {busiest:>7.2f} {1e3 * expert_s:>9.1f} " + " ".join(f"{c:>16}" for c in cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scaling", action="store_true", help="print the paper model of docs/scaling.md and exit")
    parser.add_argument("--host-gbs", type=float, default=250.0, help="--scaling: expert-read GB/s per host")
    parser.add_argument("--step-us", type=float, default=100.0, help="--scaling: latency of one all_reduce ring step")
    parser.add_argument("--formats", default="INT8")
    parser.add_argument("--tokens", default="1,512")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--role", choices=("single", "rank"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scaling:
        scaling(args.host_gbs, args.step_us * 1e-6)
        return
    formats, tokens = args.formats.split(","), [int(t) for t in args.tokens.split(",")]
    if args.role == "single":
        json.dump([r for fmt in formats for r in single(fmt, tokens)], sys.stdout)
        return
    if args.role == "rank":
        for fmt in formats:
            os.environ["KTCY_BENCH_OUT"] = os.environ["KTCY_BENCH_DIR"] + f"/{fmt}.json"
            rank_main(fmt, tokens)
        return
    from ktcy.distributed import launch
    me = [sys.executable, os.path.abspath(__file__), "--formats", args.formats, "--tokens", args.tokens]
    base = subprocess.run(me + ["--role", "single"], env=dict(os.environ, KTCY_NUM_THREADS="2"), check=True,
                          stdout=subprocess.PIPE, text=True)
    single_rows = json.loads(base.stdout)
    with tempfile.TemporaryDirectory() as folder:
        os.environ["KTCY_BENCH_DIR"] = folder
        launch_args = argparse.ArgumentParser()
        launch.add_arguments(launch_args)
        code = launch.run(launch_args.parse_args(["--numa", "--nproc", "2", "--"] + me + ["--role", "rank"]))
        if code:
            sys.exit(f"the ranks failed (status {code})")
        ranked = {fmt: json.load(open(os.path.join(folder, f"{fmt}.json"))) for fmt in formats}
    report = {"single": single_rows, "expert_parallel": {f: r["rows"] for f, r in ranked.items()},
              "loopback_all_reduce": ranked[formats[0]]["loopback"]}
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def print_report(report):
    print(f"layer H {H}, I {I}, {E} experts, top {K}; 1 process x 2 threads vs 2 ranks x 1 thread (gloo, loopback)")
    print(f"{'format':6} {'T':>4} {'1x2 ms':>8} {'reduce':>6} {'check':>5} {'spin':>5} {'2x1 ms':>8} {'ratio':>6} "
          f"{'allred ms':>9} {'share':>6} {'check ms':>8} {'local ms (rank 0, 1)':>22} {'experts/rank':>13}")
    base = {(r["format"], r["T"]): r for r in report["single"]}
    for fmt, rows in report["expert_parallel"].items():
        for r in rows:
            b = base[(fmt, r["T"])]
            print(f"{fmt:6} {r['T']:>4} {b['step_ms']:>8.3f} {r['reduce']:>6} {str(r['check_inputs']):>5} "
                  f"{str(r['spin_wait']):>5} "
                  f"{r['step_ms']:>8.3f} {r['step_ms'] / b['step_ms']:>6.2f} {r['all_reduce_ms']:>9.3f} "
                  f"{r['all_reduce_ms'] / r['step_ms']:>6.1%} {r['check_ms']:>8.3f} "
                  f"{', '.join(f'{v:.3f}' for v in r['local_ms']):>22} "
                  f"{', '.join(f'{v:.1f}' for v in r['experts_per_rank']):>13}")
    print("single process decode (T=1) weight GB/s: " + ", ".join(
        f"{r['format']} {r['weight_gbs']:.1f}" for r in report["single"] if r["T"] == 1))
    print("gloo all_reduce on loopback, 2 ranks: " + ", ".join(
        f"{r['bytes'] // 1024} KiB {r['ms']:.3f} ms" for r in report["loopback_all_reduce"]))


if __name__ == "__main__":
    main()
