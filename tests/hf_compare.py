"""Stock transformers as the reference of the ktcy.hf tests (imported after the tests' torch
importorskip): the float32 model, a prompt's logits, relative L2 error."""
import functools

import torch
import transformers


@functools.lru_cache(maxsize=None)
def stock(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits(model, ids, **inputs):
    with torch.no_grad():
        return model(ids, **inputs).logits[0].float()


def _over(inputs, seq):
    """An image-text prompt's per-token inputs extended over the generated tokens (text: ones in
    the attention mask, zeros in mm_token_type_ids)."""
    out = dict(inputs)
    for key, fill in (("attention_mask", 1), ("mm_token_type_ids", 0)):
        if key in out:
            t = out[key]
            out[key] = torch.cat([t, torch.full((t.shape[0], seq.shape[1] - t.shape[1]), fill, dtype=t.dtype)], 1)
    return out


def rel_l2(a, b):
    return float((a - b).norm() / b.norm())


def assert_same_greedy(ref, model, prompt, new_tokens, suppress=(), **inputs):
    """Greedy generation by `model` equals stock's `ref`, checked deterministically: first that at
    every generated position model's logits differ from ref's by less than a third of ref's top-2
    gap (so model's argmax must be ref's), then the token sequences themselves.  inputs: the
    prompt's other model inputs (an image-text model's image); suppress: token ids neither
    generates (an image-text model's image placeholders, which a forward pass would take for
    an image's)."""
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **inputs)
    if suppress:
        options["suppress_tokens"] = list(suppress)
    with torch.no_grad():
        seq = ref.generate(prompt, **options)
    steps = slice(prompt.shape[1] - 1, -1)
    l_ref, l_model = logits(ref, seq, **_over(inputs, seq))[steps], logits(model, seq, **_over(inputs, seq))[steps]
    top2 = l_ref.index_fill(1, torch.tensor(list(suppress), dtype=torch.long), -float("inf")).topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    deviation = float((l_model - l_ref).abs().max())
    assert margin > 3 * deviation, f"greedy margin {margin:.4f} too close to the deviation {deviation:.4f}"
    with torch.no_grad():
        out = model.generate(prompt, **options)
    assert out.shape[1] == prompt.shape[1] + new_tokens
    assert torch.equal(out, seq)
