"""One rank of the 2-rank tests (started by dist_helpers.run_ranks with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set): runs a scenario and saves rank<r>.npz / rank<r>.json in the
folder for the test to compare with a single process."""
import json
import os
import signal
import sys
import time

import numpy as np

import ktcy
from ktcy.distributed import DistributedError, ExpertParallelMoE, Placement, init_process_group

from dist_helpers import CHECKPOINT, E, FORMATS, H, I, K, TOKENS, layer_weights, routing, skip_routing

GROUP_TIMEOUT = 4.0  # seconds: the failure scenarios must end within it


def correctness(rank, folder, ckpt, converted):
    arrays, report = {}, {"messages": {}}

    def expect_error(name, fn, kind):
        try:
            fn()
        except kind as e:
            report["messages"][name] = f"{type(e).__name__}: {e}"
        else:
            report["messages"][name] = "no error"

    gate, up, down = layer_weights()
    replicated = Placement.balanced([50, 40, 1, 1, 1, 1], 2, replicate=2)  # experts 0 and 1 on both ranks
    for fmt in FORMATS:
        cfg = ktcy.MoeConfig(E, K, H, I, ktcy.QuantConfig(fmt))
        ep = ExpertParallelMoE.from_weights(cfg, gate, up, down)
        report[f"{fmt}/local"] = list(ep.local_experts)
        report[f"{fmt}/nbytes"] = ep.nbytes
        for T in TOKENS:
            arrays[f"{fmt}/T{T}"] = ep.forward(*routing(T, seed=T))
        arrays[f"{fmt}/skips"] = ep.forward(*skip_routing(7, seed=3))
        arrays[f"{fmt}/rank0_only"] = ep.forward(*routing(5, seed=4, experts=[0, 1, 2]))  # rank 1 owns none of them
        rep = ExpertParallelMoE.from_weights(cfg, gate, up, down, placement=replicated)
        report[f"{fmt}/replicated_local"] = list(rep.local_experts)
        for T in (1, 7, 512):
            arrays[f"{fmt}/replicated_T{T}"] = rep.forward(*routing(T, seed=T))
        summed = ExpertParallelMoE.from_weights(cfg, gate, up, down, reduce="sum")
        arrays[f"{fmt}/sum_T512"] = summed.forward(*routing(512, seed=512))

    import torch
    cfg = ktcy.MoeConfig(E, K, H, I, ktcy.QuantConfig("INT8"))
    ep = ExpertParallelMoE.from_weights(cfg, gate, up, down)
    x, ids, w = routing(7, seed=7)
    y = ep.forward(torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(ids), torch.from_numpy(w))
    report["torch_dtype"] = str(y.dtype)
    arrays["torch_bf16"] = y.float().numpy()
    out = torch.empty((7, H), dtype=torch.float32)
    ep.forward(x, ids, w, out=out)
    arrays["torch_out"] = out.numpy()

    # ranks that disagree: every rank raises, and the group still works afterwards
    other = x.copy()
    other_ids = ids.copy()
    other_ids[0, 0] = (other_ids[0, 0] + 1) % E if rank == 1 else other_ids[0, 0]
    expect_error("T differs", lambda: ep.forward(x[:6] if rank == 1 else x, ids[:6] if rank == 1 else ids,
                                                 w[:6] if rank == 1 else w), ValueError)
    expect_error("ids differ", lambda: ep.forward(x, other_ids, w), ValueError)
    other[3, 5] += rank
    expect_error("x differs", lambda: ep.forward(other, ids, w), ValueError)
    bad = np.zeros((7, H + 1), np.float32) if rank == 1 else x
    expect_error("rank 1 rejects", lambda: ep.forward(bad, ids, w), ValueError)
    expect_error("placements differ", lambda: ExpertParallelMoE.from_weights(
        cfg, gate, up, down, placement=Placement.contiguous(E, 2) if rank == 0 else replicated), ValueError)
    if rank == 1:  # this rank's experts fail: it raises its error, its peer a DistributedError
        def broken(*_, **__):
            raise RuntimeError("experts failed on purpose")
        ep.local.forward_slots = broken
    expect_error("local failure", lambda: ep.forward(x, ids, w), (RuntimeError, DistributedError))
    if rank == 1:
        del ep.local.forward_slots
    arrays["after_errors"] = ep.forward(x, ids, w)

    # a converted folder, and a checkpoint block made expert-parallel with from_moe
    conv = ExpertParallelMoE.from_converted(converted, 1)
    report["converted_local"] = list(conv.local_experts)
    report["converted_isa"] = conv.isa
    arrays["converted"] = conv.forward(*routing(7, seed=11, **CHECKPOINT))
    packed_here = ExpertParallelMoE.from_checkpoint(ckpt, 1, method="INT8")
    arrays["from_checkpoint"] = packed_here.forward(*routing(7, seed=11, **CHECKPOINT))
    report["from_checkpoint_local"] = list(packed_here.local_experts)
    model = ktcy.MoEModel.from_pretrained(ckpt, backend="INT8", layers=[1])
    block = model.blocks["model.layers.1.mlp.experts"]
    block.experts = ExpertParallelMoE.from_moe(block.experts)  # how MoEModel would use a process group
    h = np.random.default_rng(12).standard_normal((9, CHECKPOINT["hidden"])).astype(np.float32)
    arrays["block"] = block.forward(h)
    report["block_describe"] = block.describe()  # MoEBlock's own views work on the expert-parallel layer
    return arrays, report


def killed(rank, folder):
    """Rank 1 dies (SIGKILL) between two forwards; rank 0 must raise within the timeout."""
    return _second_forward_after(rank, lambda: os.kill(os.getpid(), signal.SIGKILL))


def stalled(rank, folder):
    """Rank 1 stops answering (sleeps); rank 0 must raise within the timeout."""
    return _second_forward_after(rank, lambda: time.sleep(60))  # killed by the test once rank 0 is done


def _second_forward_after(rank, rank1_fault):
    """One forward on every rank, then rank 1's fault, then the forward that must raise."""
    cfg = ktcy.MoeConfig(E, K, H, I, ktcy.QuantConfig("INT8"))
    ep = ExpertParallelMoE.from_weights(cfg, *layer_weights())
    args = routing(7, seed=1)
    ep.forward(*args)
    if rank == 1:
        rank1_fault()
    start = time.monotonic()
    try:
        ep.forward(*args)
        message = "no error"
    except DistributedError as e:
        message = f"DistributedError: {e}"
    return {}, {"error": message, "seconds": time.monotonic() - start}


def main():
    scenario, folder = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    init_process_group(timeout=GROUP_TIMEOUT)
    arrays, report = {"correctness": lambda: correctness(rank, folder, *sys.argv[3:5]),
                      "killed": lambda: killed(rank, folder), "stalled": lambda: stalled(rank, folder)}[scenario]()
    np.savez(os.path.join(folder, f"rank{rank}.npz"), **arrays)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    # a gloo group whose peer died can abort at interpreter exit; the results are saved
    os._exit(0)


if __name__ == "__main__":
    main()
