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


def assert_same_greedy(ref, model, prompt, new_tokens):
    """Greedy generation by `model` equals stock's `ref`, checked deterministically: first that at
    every generated position model's logits differ from ref's by less than a third of ref's top-2
    gap (so model's argmax must be ref's), then the token sequences themselves."""
    with torch.no_grad():
        seq = ref.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    steps = slice(prompt.shape[1] - 1, -1)
    l_ref, l_model = logits(ref, seq)[steps], logits(model, seq)[steps]
    top2 = l_ref.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    deviation = float((l_model - l_ref).abs().max())
    assert margin > 3 * deviation, f"greedy margin {margin:.4f} too close to the deviation {deviation:.4f}"
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assert out.shape[1] == prompt.shape[1] + new_tokens
    assert torch.equal(out, seq)
