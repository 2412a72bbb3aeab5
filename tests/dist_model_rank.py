"""One rank of tests/test_distributed_model.py, started by `ktcy launch --nproc 2`: a whole
MoEModel and a ktcy.hf model expert-parallel over the ranks, against the same models in one
process, each rank writing what it saw to <out>/rank<R>.npz."""
import sys

import numpy as np
import torch

import ktcy
import ktcy.hf
from ktcy.distributed import ExpertParallelMoE, init_process_group

moe_ckpt, hf_ckpt, out, gguf_model, gguf_converted = sys.argv[1:6]
init_process_group(timeout=60)
world = torch.distributed.group.WORLD
rank = torch.distributed.get_rank()
ktcy.set_num_threads(1)
torch.set_num_threads(1)

results = {}
for source, path in (("hf", moe_ckpt), ("gguf", gguf_model)):  # a checkpoint folder, a GGUF file
    hidden = ktcy.MoEModel.from_pretrained(path, layers=[]).checkpoint.arch.hidden_size
    h = np.random.default_rng(7).standard_normal((9, hidden)).astype(np.float32)
    for backend in ("INT8", "BF16") + ((None,) if source == "gguf" else ()):  # None: as stored (INT4 + INT8_GROUP)
        # as stored, also from the folder `ktcy convert` wrote (its layer files in both formats)
        for where, folder in [("", None)] + ([(":converted", gguf_converted)] if backend is None else []):
            single = ktcy.MoEModel.from_pretrained(path, backend=backend, experts_path=folder)
            shared = ktcy.MoEModel.from_pretrained(path, backend=backend, group=world, experts_path=folder)
            for name, block in shared.blocks.items():
                assert isinstance(block.experts, ExpertParallelMoE), type(block.experts)
                assert folder is None or block.experts_from.startswith(folder), block.experts_from
                key = f"{source}{where}:{backend}:{name}"
                results[f"{key}:parallel"] = block.forward(h)
                results[f"{key}:single"] = single.blocks[name].forward(h)
                results[f"{key}:local"] = np.array(block.experts.local_experts)

prompt = torch.tensor([[3, 4, 5, 6, 7, 8]])
single = ktcy.hf.from_pretrained(hf_ckpt, backend="INT8", dtype=torch.float32)
shared = ktcy.hf.from_pretrained(hf_ckpt, backend="INT8", dtype=torch.float32, group=world)
assert all(isinstance(m.moe, ExpertParallelMoE) for m in shared.ktcy_experts().values())
with torch.no_grad():
    results["hf:single"] = single(prompt).logits.numpy()
    results["hf:parallel"] = shared(prompt).logits.numpy()
np.savez(f"{out}/rank{rank}.npz", **results)
