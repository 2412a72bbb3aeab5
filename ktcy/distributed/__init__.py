"""Expert parallelism over torch.distributed (gloo): each rank holds and runs a share of a
layer's experts, an all_reduce gives every rank the whole output.  Needs the `hf` extra (torch);
`ktcy.distributed.launch` (one rank per NUMA node) and `ktcy.distributed.placement` do not, so
torch is imported only when ExpertParallelMoE or the process-group helpers are first used."""
from typing import TYPE_CHECKING

from ktcy.distributed.placement import Placement

if TYPE_CHECKING:  # what type checkers see; at run time the names load (and import torch) on first use
    from ktcy.distributed.comm import DistributedError as DistributedError
    from ktcy.distributed.comm import init_process_group as init_process_group
    from ktcy.distributed.expert_parallel import ExpertParallelMoE as ExpertParallelMoE

_LAZY = {"ExpertParallelMoE": "ktcy.distributed.expert_parallel",
         "DistributedError": "ktcy.distributed.comm",
         "init_process_group": "ktcy.distributed.comm"}

__all__ = ["DistributedError", "ExpertParallelMoE", "Placement", "init_process_group"]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ktcy.distributed' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
