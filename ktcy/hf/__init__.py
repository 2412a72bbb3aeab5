"""ktcy.hf: Hugging Face transformers causal LMs (and image-text models that have none) whose MoE
experts run on ktcy's kernels.

Needs the optional extra `hf` (torch, transformers >= 5): ``pip install ktcy[hf]``.  Importing
ktcy.hf works without it (so `ktcy --help` can list `generate`); using any of its names raises
ImportError naming the extra.

Contract (used from outside the repo): ``ktcy.hf.from_pretrained(path, rules=None, backend=None,
experts_path=None, gguf_path=None, **hf_kwargs)`` returning a transformers model with
``inject_expert_backend(layer_regex, backend)``.
"""
import importlib
from typing import TYPE_CHECKING

from ktcy.hf._deps import require_torch_transformers

if TYPE_CHECKING:  # what type checkers see (re-exported, "as" each); at run time the names load on first use
    from ktcy.hf.architectures import SUPPORTED as SUPPORTED
    from ktcy.hf.architectures import UnsupportedArchitectureError as UnsupportedArchitectureError
    from ktcy.hf.experts_module import KtcyExperts as KtcyExperts
    from ktcy.hf.loader import from_pretrained as from_pretrained

_PUBLIC = {"from_pretrained": "ktcy.hf.loader", "KtcyExperts": "ktcy.hf.experts_module",
           "SUPPORTED": "ktcy.hf.architectures", "UnsupportedArchitectureError": "ktcy.hf.architectures"}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ktcy.hf' has no attribute {name!r}")
    require_torch_transformers()
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
