"""Stock transformers as the reference of the ktcy.hf tests (imported after the tests' torch
importorskip): the float32 model, a prompt's logits, relative L2 error."""
import functools

import torch
import transformers


@functools.lru_cache(maxsize=None)
def stock(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0].float()


def rel_l2(a, b):
    return float((a - b).norm() / b.norm())
