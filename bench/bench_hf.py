"""Whole-model speed with ktcy.hf: a reduced-depth Qwen3-30B-A3B-shaped model (full widths:
H 2048, expert width 768, 128 experts, top 8, 32 query / 4 KV heads of 128; 2 layers by
default; random weights; no tokenizer), decode and prefill tokens/s, stock transformers
(BF16, on CPU) against the same model with its experts on ktcy (BF16, INT8, FP8, INT4), in one run.

    python bench/bench_hf.py [--layers 2] [--prefill 512] [--decode 16] [--formats BF16,INT8,FP8,INT4]

The vocabulary defaults to 4096, not Qwen3's 151936: a 48-layer model spreads its output head
over 48 layers, a 2-layer one would spend most of each decode step in it (--vocab 151936 to
see that).  Needs the hf extra and about 4 GB of memory and 4 GB of temporary disk (the model is
saved once so ktcy can map its experts from a real checkpoint)."""
import argparse
import gc
import os
import sys
import tempfile
import time
from collections import defaultdict

# torch and ktcy each run an OpenMP team; with the default (spinning) wait policy the idle team
# keeps the cores busy while the other one works, which halved both torch's and ktcy's speed on
# 2 cores.  It must be set before either OpenMP runtime starts, hence here, before the imports.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402

import ktcy  # noqa: E402
import ktcy.hf  # noqa: E402


def build_model(folder, layers, vocab, seed=0):
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_hidden_layers=layers,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return model.eval()


class PartTimer:
    """Wall time per part of the model (attention, router, experts, norms, head), from forward
    hooks; the remainder of a step is torch's glue (residual adds, rotary, cache updates)."""

    def __init__(self, model):
        self.seconds = defaultdict(float)
        self._start = {}
        for name, module in model.named_modules():
            part = self._part(name)
            if part:
                module.register_forward_pre_hook(lambda m, a, key=id(module): self._enter(key))
                module.register_forward_hook(lambda m, a, o, key=id(module), part=part: self._leave(key, part))

    @staticmethod
    def _part(name):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "self_attn":
            return "attention"
        if name.endswith("mlp.experts"):
            return "experts"
        if name.endswith("mlp.gate"):
            return "router"
        if leaf in ("input_layernorm", "post_attention_layernorm", "norm"):
            return "norms"
        if leaf == "lm_head":
            return "output head"
        return None

    def _enter(self, key):
        self._start[key] = time.perf_counter()

    def _leave(self, key, part):
        self.seconds[part] += time.perf_counter() - self._start.pop(key)

    def reset(self):
        self.seconds.clear()


def measure(model, prefill, decode, vocab):
    g = torch.Generator().manual_seed(1)
    timer = PartTimer(model)
    with torch.no_grad():
        model(torch.randint(0, vocab, (1, 16), generator=g))  # first-call set-up (arenas, kernels)
        ids = torch.randint(0, vocab, (1, prefill), generator=g)
        t = time.perf_counter()
        model(ids)
        prefill_s = time.perf_counter() - t
        out = model(torch.randint(0, vocab, (1, 32), generator=g), use_cache=True)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
        timer.reset()
        t = time.perf_counter()
        for _ in range(decode):
            out = model(tok, cache=cache, use_cache=True)
            cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t
    parts = {k: v / decode_s for k, v in timer.seconds.items()}
    return prefill / prefill_s, decode / decode_s, parts


def row(label, prefill_tps, decode_tps, parts, stock):
    share = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    rest = max(0.0, 1 - sum(parts.values()))
    speed = "" if stock is None else f"  ({prefill_tps / stock[0]:.2f}x / {decode_tps / stock[1]:.2f}x stock)"
    return (f"{label:<22} prefill {prefill_tps:8.1f} tok/s   decode {decode_tps:7.2f} tok/s{speed}\n"
            f"{'':<22} decode time: {share}, torch glue {100 * rest:.0f}%")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--formats", default="BF16,INT8,FP8,INT4")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-stock", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        ktcy.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, ktcy {ktcy.__version__}; "
          f"{torch.get_num_threads()} torch threads, {ktcy.get_num_threads()} ktcy threads; {args.layers} layers, "
          f"vocab {args.vocab}, prefill {args.prefill}, decode {args.decode} tokens; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ktcy-bench-hf-") as folder:
        stock_model = build_model(folder, args.layers, args.vocab)
        stock = None
        if not args.skip_stock:
            stock = measure(stock_model, args.prefill, args.decode, args.vocab)
            print(row("stock transformers BF16", *stock, None), flush=True)
        del stock_model
        gc.collect()
        for fmt in args.formats.split(","):
            model = ktcy.hf.from_pretrained(folder, backend=fmt, dtype=torch.bfloat16)
            kernel = next(iter(model.ktcy_experts().values())).kernel
            result = measure(model, args.prefill, args.decode, args.vocab)
            print(row(f"ktcy {fmt}", *result, stock), flush=True)
            print(f"{'':<22} {kernel}", flush=True)
            del model
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
