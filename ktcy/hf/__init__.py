"""ktcy.hf: Hugging Face transformers causal LMs whose MoE experts run on ktcy's kernels.

Needs the optional extra `hf` (torch, transformers >= 5): ``pip install ktcy[hf]``.

Contract (used from outside the repo): ``ktcy.hf.from_pretrained(path, rules=None, backend=None,
experts_path=None, **hf_kwargs)`` returning a transformers model with
``inject_expert_backend(layer_regex, backend)``.
"""
from ktcy.hf._deps import require_torch_transformers

require_torch_transformers()

from ktcy.hf.architectures import SUPPORTED, UnsupportedArchitectureError  # noqa: E402
from ktcy.hf.experts_module import KtcyExperts  # noqa: E402
from ktcy.hf.loader import from_pretrained  # noqa: E402

__all__ = ["from_pretrained", "KtcyExperts", "SUPPORTED", "UnsupportedArchitectureError"]
