"""`ktcy generate` (ktcy.hf.generate_cli) on tiny checkpoints."""
import argparse
import io
import subprocess
import sys
import textwrap

import pytest

import hf_checkpoints as ckpts

torch = pytest.importorskip("torch")  # CI installs the hf extra: this never skips there
import ktcy.hf  # noqa: E402
from ktcy.hf import generate_cli  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return ckpts.build("qwen3_moe", tmp_path_factory.mktemp("gen") / "m", seed=ckpts.GREEDY_SEEDS["qwen3_moe"])


def parse(argv):
    parser = argparse.ArgumentParser(prog="ktcy generate")
    generate_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_generate_with_input_ids_prints_tokens_and_speeds(folder):
    out = io.StringIO()
    args = parse(["--model", folder, "--input-ids", "3,4,5,6", "--max-new-tokens", "6", "--backend", "AMXINT8",
                  "--threads", "1"])
    assert generate_cli.run(args, out) == 0
    lines = out.getvalue().splitlines()
    tokens = lines[0].split()
    assert len(tokens) == 6 and all(0 <= int(t) < ckpts.VOCAB for t in tokens)
    # the same tokens as the library's own greedy generate with the same experts
    model = ktcy.hf.from_pretrained(folder, backend="INT8")
    with torch.no_grad():
        ref = model.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert [int(t) for t in tokens] == ref[0, 4:].tolist()
    text = "\n".join(lines[1:])
    assert "prefill: 4 tokens in" in text and "decode: 5 tokens in" in text
    assert "time in ktcy experts" in text and "INT8 on " in text


def test_generate_with_prompt_uses_the_tokenizer(folder, tmp_path):
    model_dir = ckpts.build("olmoe", tmp_path / "olmoe", seed=ckpts.GREEDY_SEEDS["olmoe"])
    ckpts.add_word_tokenizer(model_dir)
    out = io.StringIO()
    assert generate_cli.run(parse(["--model", model_dir, "--prompt", "w3 w4 w5", "--max-new-tokens", "4"]), out) == 0
    first = out.getvalue().splitlines()[0].split()
    assert len(first) == 4 and all(w.startswith("w") for w in first)


def test_generate_user_errors(folder):
    with pytest.raises(ValueError, match="--input-ids"):
        generate_cli.run(parse(["--model", folder, "--prompt", "hello"]), io.StringIO())  # no tokenizer
    with pytest.raises(ValueError, match="vocabulary"):
        generate_cli.run(parse(["--model", folder, "--input-ids", "3,999"]), io.StringIO())
    with pytest.raises(SystemExit):
        parse(["--model", folder, "--input-ids", "3,x"])
    with pytest.raises(SystemExit):
        parse(["--model", folder, "--input-ids", "3", "--backend", "INT8", "--rules", "r.yaml"])
    with pytest.raises(ValueError):
        generate_cli.run(parse(["--model", folder, "--input-ids", "3", "--backend", "NOPE"]), io.StringIO())


def test_generate_without_torch_is_one_line():
    code = textwrap.dedent("""\
        import argparse, sys
        sys.modules["torch"] = None
        from ktcy.hf import generate_cli
        parser = argparse.ArgumentParser()
        generate_cli.add_arguments(parser)  # the command's flags need no torch
        sys.exit(generate_cli.run(parser.parse_args(["--model", "m", "--input-ids", "1"])))
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "pip install ktcy[hf]" in r.stderr


def test_generate_with_converted_experts_and_rules(folder, tmp_path):
    from ktcy.convert import convert
    packed = tmp_path / "packed"
    convert(folder, str(packed), method="INT8")
    out = io.StringIO()
    assert generate_cli.run(parse(["--model", folder, "--experts", str(packed), "--input-ids", "3,4",
                                   "--max-new-tokens", "3"]), out) == 0
    assert "INT8 on " in out.getvalue()
    rules = tmp_path / "rules.yaml"
    rules.write_text("- match: {name: 'model\\.layers\\.1\\.'}\n  replace: {kwargs: {backend: INT4}}\n")
    out = io.StringIO()
    assert generate_cli.run(parse(["--model", folder, "--rules", str(rules), "--input-ids", "3,4",
                                   "--max-new-tokens", "3"]), out) == 0
    assert "BF16 on " in out.getvalue() and "INT4 on " in out.getvalue()


def test_the_ktcy_command_runs_generate_with_a_passive_openmp_policy(folder, tmp_path):
    """`ktcy generate` from the command line: the subcommand is wired, and without an explicit
    OMP_WAIT_POLICY it starts itself again with PASSIVE (torch's and ktcy's OpenMP teams would
    otherwise spin against each other); a user error is one line."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    probe = tmp_path / "sitecustomize.py"   # reports the policy the final process saw
    probe.write_text("import os, sys\nsys.stderr.write('policy=%s\\n' % os.environ.get('OMP_WAIT_POLICY'))\n")
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", "import sys; from ktcy.cli import main; sys.argv[0] = 'ktcy'; "
                          "sys.exit(main())", "generate", "--model", folder, "--input-ids", "3,4,5",
                          "--max-new-tokens", "3", "--backend", "INT8", "--threads", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines()[:2] == ["policy=None", "policy=PASSIVE"], run.stderr
    assert len(run.stdout.splitlines()[0].split()) == 3 and "decode:" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "ktcy", "generate", "--model", str(tmp_path / "missing"),
                          "--input-ids", "1"], capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in bad.stderr.splitlines() if not line.startswith("policy=")]
    assert bad.returncode == 1 and len(errors) == 1 and errors[0].startswith("ktcy: error:"), bad.stderr


def test_characters_split_over_tokens_print_whole():
    """A byte-level tokenizer hands a 3-byte character over in 3 tokens; the printer wrote the
    U+FFFD the first two decode to, and could not take it back."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok)
    text = "ab 中文 ok 🙂"
    ids = hf_tok(text).input_ids
    assert len(ids) > len(text)  # some characters do come in pieces
    out = io.StringIO()
    printer = generate_cli._Printer(hf_tok, out)
    printer.put(torch.tensor([[0]]))  # generate() hands the streamer the prompt first
    for i in ids:
        printer.put(torch.tensor([i]))
    printer.end()
    assert out.getvalue() == text + "\n"


def test_generate_runs_an_image_text_model_on_text(tmp_path):
    """Qwen3-VL-MoE built whole (its vocabulary in the text part of the config): the command's
    tokens are the library's greedy ones."""
    folder = ckpts.build_qwen3_vl_moe(tmp_path / "m")
    out = io.StringIO()
    assert generate_cli.run(parse(["--model", folder, "--input-ids", "3,4,5", "--max-new-tokens", "5"]), out) == 0
    tokens = [int(t) for t in out.getvalue().splitlines()[0].split()]
    model = ktcy.hf.from_pretrained(folder)
    with torch.no_grad():
        ref = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert tokens == ref[0, 3:].tolist()
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 32\)"):
        generate_cli.run(parse(["--model", folder, "--input-ids", "3,32"]), io.StringIO())
