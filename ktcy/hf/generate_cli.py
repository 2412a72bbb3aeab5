"""`ktcy generate`: text from a whole MoE model with its experts on ktcy, through transformers'
own generate().  Prints the text as it is produced, then prefill and decode speed and the share
of the time spent in ktcy's experts.

This module imports only argparse-level code at import time; torch and transformers are loaded
when the command runs, so `ktcy --help` works without the hf extra."""
import argparse
import os
import sys
import time

EXIT_ERROR = 1


def _token_ids(text):
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated token ids such as 1,2,3, got {text[:40]!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"must be one or more non-negative token ids, got {text[:40]!r}")
    return ids


def _positive(text):
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_arguments(parser):
    """The flags of `ktcy generate` on an argparse parser."""
    from ktcy.cli import thread_count
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder (or a hub id in the local "
                        "cache): attention, embeddings, routers; also the experts unless --experts is given")
    parser.add_argument("--experts", default=None, help="folder written by `ktcy convert` for this model: the routed "
                        "experts are mapped from it")
    parser.add_argument("--gguf", default=None, help="every weight from this GGUF model (Qwen2/3-MoE, Mixtral, OLMoE, GLM-4.5, dots.llm1, ERNIE-4.5, MiniMax-M2, "
                        "GPT-OSS, DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash, Qwen3-Next); "
                        "--model then needs only config.json and the tokenizer")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--backend", default=None, help="experts format: AMXINT8, AMXBF16, AMXINT4, INT8, INT4, "
                       "INT4_ZP, INT4_MIN, BF16, FP8, MXFP4, ... (default: as stored)")
    which.add_argument("--rules", default=None, help="optimize-rule YAML choosing the backend per experts module")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", default=None, help="text (needs the model's tokenizer)")
    prompt.add_argument("--input-ids", type=_token_ids, default=None, help="comma-separated token ids, for "
                        "checkpoints without a tokenizer")
    parser.add_argument("--max-new-tokens", type=_positive, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--threads", type=thread_count, default=None, help="threads for ktcy and torch "
                        "(default: all usable CPUs)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="dtype of the torch part (default: the checkpoint's)")


class _Printer:
    """A transformers streamer: prints new tokens as they arrive (text with a tokenizer, ids
    without) and records when each arrives.  generate() hands it the prompt first."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out = tokenizer, out
        self.times, self.ids, self._printed = [], [], ""
        self._prompt_seen = False

    def put(self, value):
        ids = value.reshape(-1).tolist()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.ids.extend(ids)
        if self.tokenizer is None:
            self.out.write(" ".join(str(i) for i in ids) + " ")
        else:
            # a character split over tokens (byte-level BPE: CJK, emoji) decodes to U+FFFD until
            # its last byte arrives: hold the text back from there, printed text cannot be taken back
            self._write(self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd"))
        self.out.flush()

    def _write(self, text):
        if len(text) > len(self._printed):
            self.out.write(text[len(self._printed):])
            self._printed = text

    def end(self):
        if self.tokenizer is not None:  # what is left held back, an incomplete character included
            self._write(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        self.out.write("\n")
        self.out.flush()


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer(path, required):
    """The checkpoint's tokenizer, or None without one (transformers would otherwise build an
    empty tokenizer from config.json alone, which decodes every id to nothing)."""
    from transformers import AutoTokenizer
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        if required:
            raise ValueError(f"--prompt needs the model's tokenizer, and {path} holds none; pass --input-ids 1,2,3 "
                             "instead")
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        if required:
            raise ValueError(f"--prompt needs the model's tokenizer, which {path} does not hold ({str(e)[:120]}); "
                             "pass --input-ids 1,2,3 instead") from None
        return None


def run(args, out=None):
    """Runs `ktcy generate`; returns the exit status.  User errors raise ValueError / CheckpointError
    (one line at the CLI); a missing hf extra is reported here as one line."""
    out = out or sys.stdout
    try:
        from ktcy.hf._deps import require_torch_transformers
        torch, _ = require_torch_transformers()
        import ktcy.hf
    except ImportError as e:
        print(f"ktcy: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    from ktcy.paths import resolve_model_path
    from ktcy.threads import set_num_threads
    if args.threads:
        set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    kwargs = {} if args.dtype is None else {"dtype": getattr(torch, args.dtype)}
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        # started as ranks (torchrun, ktcy launch): experts expert-parallel, rank 0 prints
        from ktcy.distributed import init_process_group
        init_process_group()
        kwargs["group"] = torch.distributed.group.WORLD
        if torch.distributed.get_rank() != 0:
            out = open(os.devnull, "w")
    model = ktcy.hf.from_pretrained(args.model, rules=args.rules, backend=args.backend, experts_path=args.experts,
                                    gguf_path=args.gguf, **kwargs)
    tokenizer = _tokenizer(resolve_model_path(args.model), required=args.prompt is not None)
    if args.prompt is not None:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise ValueError("--prompt gives no tokens")
    else:
        vocab = model.config.get_text_config().vocab_size  # an image-text config holds it in its text part
        bad = [i for i in args.input_ids if i >= vocab]
        if bad:
            raise ValueError(f"--input-ids holds {bad[0]}, outside the model's vocabulary [0, {vocab})")
        ids = torch.tensor([args.input_ids], dtype=torch.long)
    experts = list(model.ktcy_experts().values())
    for m in experts:
        m.seconds, m.calls = 0.0, 0
    printer = _Printer(tokenizer, out)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                       do_sample=False, streamer=printer, pad_token_id=_pad_id(model))
    total = time.perf_counter() - start
    print(_summary(ids.shape[1], printer.times, start, total, sum(m.seconds for m in experts), experts), file=out)
    return 0


def _pad_id(model):
    cfg = model.generation_config
    if cfg.pad_token_id is not None:
        return cfg.pad_token_id
    eos = cfg.eos_token_id
    return (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0


def _summary(prompt_len, times, start, total, experts_seconds, experts):
    lines = []
    if times:
        prefill = times[0] - start
        lines.append(f"prefill: {prompt_len} tokens in {prefill:.3f} s = {prompt_len / prefill:.1f} tokens/s")
        if len(times) > 1:
            decode = times[-1] - times[0]
            lines.append(f"decode: {len(times) - 1} tokens in {decode:.3f} s = {(len(times) - 1) / decode:.1f} tokens/s")
    share = experts_seconds / total if total > 0 else 0.0
    kernels = sorted({m.kernel for m in experts})
    lines.append(f"time in ktcy experts: {experts_seconds:.3f} s of {total:.3f} s ({100 * share:.0f}%); "
                 f"the rest (attention, norms, routers, torch): {100 * (1 - share):.0f}%")
    lines.append(f"experts: {len(experts)} modules, {'; '.join(kernels)}")
    return "\n".join(lines)
