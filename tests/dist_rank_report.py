"""A rank started by `ktcy launch` in the tests: saves what it was given (binding, environment)
to <folder>/rank<RANK>.json; with --gloo it also joins the process group from that
environment and gathers every rank's number."""
import json
import os
import sys

from ktcy.distributed.numa import current_binding

folder = sys.argv[1]
report = current_binding()
report["env"] = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                 "MASTER_PORT", "KTCY_NUM_THREADS", "OMP_NUM_THREADS")}
if "--gloo" in sys.argv:
    import torch
    import torch.distributed as dist
    from ktcy.distributed import init_process_group
    init_process_group(timeout=20)
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, torch.tensor([dist.get_rank()]))
    report["gathered"] = [int(p) for p in parts]
    dist.destroy_process_group()
with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(report, f)
