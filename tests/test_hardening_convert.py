"""The converter under misuse (issue 16 items 6-11 and 15, converter part; issue 17's converter
conventions): the output lock, --resume against a different request, writing into an input,
failed writes, --layers abuse, --quant-config, kt-kernel command lines, and the complete
Hugging Face FP8 per-channel checkpoint."""
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ktcy
from checkpoints import make_checkpoint
from ktcy import convert as convert_mod
from ktcy.convert_args import parse_quant_config
from ktcy.output_guard import ConvertError
from ktcy.packed_io import layer_file_name, read_metadata
from ktcy.safetensors_io import CheckpointError, SafetensorsFile, write
from test_model import build as build_family

QUIET = convert_mod.Progress(quiet=True)
KTCY = [sys.executable, "-m", "ktcy", "convert"]


def cli(*args, timeout=120, **kw):
    return subprocess.run(KTCY + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)


def assert_one_line_error(r, *needles):
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("note:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def leftovers(folder):
    return [n for n in os.listdir(folder) if n.endswith((".partial", ".tmp"))]


def mtimes(folder):
    return {n: os.path.getmtime(os.path.join(folder, n)) for n in os.listdir(folder) if n != ".ktcy_convert.lock"}


def inputs(H, T=5, E=4, k=2, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, H)).astype(np.float32),
            np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64), rng.random((T, k)).astype(np.float32))


@pytest.fixture
def src(tmp_path):
    make_checkpoint(tmp_path / "hf", num_layers=4, dense_layers=(0,))
    return tmp_path / "hf"


# -- item 7: two converters on one output folder -------------------------------------------------

HOLD_LOCK = ("import sys, ktcy.output_guard as g\n"
             "with g.OutputLock(sys.argv[1]):\n"
             "    print('locked', flush=True); sys.stdin.read()\n")


def test_second_process_on_a_locked_output_gets_a_clear_error(src, tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = cli("--input", src, "--output", out, "--method", "INT8")
        assert_one_line_error(r, "another converter", f"pid {holder.pid}", str(out))
        assert sorted(os.listdir(out)) == [".ktcy_convert.lock"]  # nothing written
    finally:
        holder.communicate("", timeout=30)
    assert cli("--input", src, "--output", out, "--method", "INT8").returncode == 0  # released at exit


def test_two_real_converters_racing_leave_one_consistent_output(tmp_path):
    src = tmp_path / "hf"
    make_checkpoint(src, E=8, H=256, I=128, num_layers=6, dense_layers=())
    out = tmp_path / "out"
    procs = [subprocess.Popen(KTCY + ["--input", str(src), "--output", str(out), "--method", m],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for m in ("INT8", "BF16")]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    winners = [i for i, (rc, _) in enumerate(results) if rc == 0]
    assert len(winners) >= 1
    for rc, err in results:
        assert rc == 0 or ("another converter" in err or "differs from this conversion" in err), err
        assert "Traceback" not in err
    fmt = ("INT8", "BF16")[winners[0]]
    manifest = json.load(open(out / "ktcy_model.json"))
    assert manifest["layers"] == list(range(6)) and manifest["method"] == fmt
    for L in range(6):  # every layer of one format, loadable, and nothing half-written
        assert ktcy.load_experts(out, L).format == fmt
    assert leftovers(out) == []


# -- item 8: --resume compares what is on disk with what is asked ---------------------------------

def test_resume_refuses_another_method_group_or_source(src, tmp_path):
    out = tmp_path / "out"
    assert cli("--input", src, "--output", out, "--method", "INT4").returncode == 0
    before = mtimes(out)
    assert_one_line_error(cli("--input", src, "--output", out, "--method", "INT8", "--resume"),
                          "--resume", "format INT4 on disk, INT8 asked")
    assert_one_line_error(cli("--input", src, "--output", out, "--method", "INT4", "--group-size", "32", "--resume"),
                          "group size 64 on disk, 32 asked")
    other = tmp_path / "other"
    make_checkpoint(other, num_layers=4, dense_layers=(0,), seed=7)
    assert_one_line_error(cli("--input", other, "--output", out, "--method", "INT4", "--resume"),
                          "converted from another checkpoint")
    assert mtimes(out) == before  # refused before writing anything
    r = cli("--input", src, "--output", out, "--method", "INT4", "--resume")
    assert r.returncode == 0 and r.stderr.count("already converted, kept") == 3


def test_resume_keeps_the_layers_of_a_format_with_a_fixed_group(src, tmp_path):
    """MXFP4_A8 weights carry the activation-sum group 32 whatever was asked: a resume, and a
    plain re-run, recognise their own layers."""
    out = tmp_path / "out"
    assert cli("--input", src, "--output", out, "--method", "MXFP4_A8").returncode == 0
    layers = lambda: {k: v for k, v in mtimes(out).items() if k.startswith("ktcy_layer_")}  # noqa: E731
    before = layers()
    r = cli("--input", src, "--output", out, "--method", "MXFP4_A8", "--resume")
    assert r.returncode == 0 and r.stderr.count("already converted, kept") == 3, r.stderr
    assert layers() == before
    convert_mod.convert(src, out, method="MXFP4_A8", progress=QUIET)  # converts again, no conflict
    assert ktcy.load_experts(out, 1).format == "MXFP4_A8"


def test_source_edited_in_place_is_a_different_source(src, tmp_path):
    out = tmp_path / "out"
    convert_mod.convert(src, out, method="INT8", progress=QUIET)
    os.utime(src / "model.safetensors", ns=(1, 1))  # same header, re-saved data
    with pytest.raises(ConvertError, match="another checkpoint"):
        convert_mod.convert(src, out, method="INT8", resume=True, progress=QUIET)


def test_manifest_never_merges_another_models_or_methods_layers(src, tmp_path):
    out = tmp_path / "out"
    convert_mod.convert(src, out, method="INT8", layers="1", progress=QUIET)
    other = tmp_path / "other"
    make_checkpoint(other, num_layers=4, dense_layers=(0,), seed=7)
    with pytest.raises(ConvertError, match="differs from this conversion"):
        convert_mod.convert(other, out, method="INT8", layers="2", progress=QUIET)
    with pytest.raises(ConvertError, match="format INT8 on disk, BF16 asked"):
        convert_mod.convert(src, out, method="BF16", layers="2", progress=QUIET)
    convert_mod.convert(other, out, method="INT8", layers="2", progress=QUIET, overwrite=True)
    manifest = json.load(open(out / "ktcy_model.json"))
    assert manifest["layers"] == [2] and not os.path.exists(out / layer_file_name(1))
    x, ids, w = inputs(128)
    assert np.array_equal(ktcy.load_experts(out, 2).forward(x, ids, w),
                          ktcy.load_experts(other, 2, method="INT8").forward(x, ids, w))
    # same request again, other layers: merged, as they match
    convert_mod.convert(other, out, method="INT8", layers="3", progress=QUIET)
    assert json.load(open(out / "ktcy_model.json"))["layers"] == [2, 3]


def test_resume_layer_keeps_lower_layers_and_converts_the_rest(src, tmp_path):
    out = tmp_path / "out"
    convert_mod.convert(src, out, method="INT8", layers="1", progress=QUIET)
    mtime = os.path.getmtime(out / layer_file_name(1))
    r = cli("--input-path", src, "--output", out, "--quant-method", "int8", "--resume-layer", "2")
    assert r.returncode == 0, r.stderr
    assert os.path.getmtime(out / layer_file_name(1)) == mtime
    assert json.load(open(out / "ktcy_model.json"))["layers"] == [1, 2, 3]
    # the layer below is reported as kept (not as "no usable file"), and counted in what convert returns
    assert convert_mod.convert(src, out, method="INT8", resume_layer=2, progress=QUIET) == [1, 2, 3]
    assert os.path.getmtime(out / layer_file_name(1)) == mtime


# -- item 9: never write into an input -----------------------------------------------------------

def test_output_in_or_equal_to_input_is_refused(src, tmp_path):
    before = sorted(os.listdir(src))
    link = tmp_path / "link"
    os.symlink(src, link)
    for out in (src, src / "packed", link, link / "x", tmp_path / "hf" / ".." / "hf"):
        assert_one_line_error(cli("--input", src, "--output", out, "--method", "INT8"), "input folder")
        assert_one_line_error(cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", out, "--overwrite"),
                              "input folder")
    assert sorted(os.listdir(src)) == before


def test_files_the_converter_did_not_write_are_not_replaced(src, tmp_path):
    foreign = tmp_path / "foreign"
    make_checkpoint(foreign, num_layers=2, dense_layers=(0,), seed=3)
    config = open(foreign / "config.json").read()
    assert_one_line_error(cli("--input", src, "--output", foreign, "--method", "INT8"), "config.json", "--overwrite")
    os.rename(foreign / "model.safetensors", foreign / "keep.safetensors")
    write(foreign / "model.safetensors.index.json.bak", {"x": np.zeros(1, np.float32)})
    open(foreign / "model.safetensors.index.json", "w").write('{"weight_map": {}}')
    assert_one_line_error(cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", foreign),
                          "did not write", "--overwrite")
    assert open(foreign / "config.json").read() == config
    assert open(foreign / "model.safetensors.index.json").read() == '{"weight_map": {}}'
    assert cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", foreign, "--overwrite").returncode == 0
    assert "quantization_config" in json.load(open(foreign / "config.json"))
    # a second run replaces its own files without --overwrite
    assert cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", foreign).returncode == 0


# -- item 10: failed writes ----------------------------------------------------------------------

def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))


def test_file_size_limit_fails_cleanly(src, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(KTCY + ["--input", str(src), "--output", str(out), "--method", "BF16"], capture_output=True,
                       text=True, preexec_fn=_limit_file_size, timeout=120)
    assert_one_line_error(r, "File too large", "ktcy_layer_0001", "nothing partial")
    assert leftovers(out) == [] and not os.path.exists(out / layer_file_name(1))
    r = subprocess.run(KTCY + ["--input", str(src), "--output", str(out), "--method", "BF16", "--debug"],
                       capture_output=True, text=True, preexec_fn=_limit_file_size, timeout=120)
    assert r.returncode != 0 and "Traceback" in r.stderr and leftovers(out) == []


def test_unwritable_outputs_fail_with_one_line(src, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert_one_line_error(cli("--input", src, "--output", afile, "--method", "INT8"), "not a folder")
    assert_one_line_error(cli("--input", src, "--output", afile / "sub", "--method", "INT8"), "cannot create")
    assert afile.read_text() == "mine"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    assert_one_line_error(cli("--input", src, "--output", dangling, "--method", "INT8"), "symbolic link",
                          str(tmp_path / "gone"), "does not exist")
    if os.geteuid() != 0:  # root writes into read-only folders
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        assert_one_line_error(cli("--input", src, "--output", ro, "--method", "INT8"), str(ro))


# -- item 11: --layers abuse ---------------------------------------------------------------------

@pytest.mark.parametrize("layers,needle", [
    ("0-1000000000", "past the checkpoint's last layer (3)"), ("99999999999999999999999", "past"),
    ("-3", "start at 0"), ("3-1", "backwards"), ("1,,2", "neither"), ("1e3", "neither"), ("", "ranges like"),
    ("٣", "neither"), ("0", "not MoE layers"), ("1-", "neither"), ("x" * 20000, "ranges like"),
])
def test_layers_abuse_is_one_quick_line(src, tmp_path, layers, needle):
    t0 = time.perf_counter()
    r = cli("--input", src, "--output", tmp_path / "out", "--method", "INT8", f"--layers={layers}")
    assert_one_line_error(r, needle)
    assert time.perf_counter() - t0 < 60
    assert not os.path.exists(tmp_path / "out")


def test_parse_layers_checks_bounds_before_expanding():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="past"):
        convert_mod.parse_layers("0-999999999", range(1, 48), num_layers=48)
    assert time.perf_counter() - t0 < 0.1
    assert convert_mod.parse_layers("5-7, 1,6", range(1, 48), num_layers=48) == [1, 5, 6, 7]


LAYER_TEXT = st.text(alphabet="0123456789,- x٣", max_size=40)
QUANT_CONFIG = st.dictionaries(st.sampled_from(["method", "per_channel", "group_size", "extra"]),
                               st.one_of(st.none(), st.booleans(), st.integers(-1, 200), st.text(max_size=8),
                                         st.sampled_from(["INT4", "int8", "FP8", "FP8_PERCHANNEL", "BF16", "no"])))


def _layers_property(text):
    available = list(range(1, 48, 2))
    try:
        chosen = convert_mod.parse_layers(text, available, num_layers=48)
    except ValueError:
        return
    assert chosen == sorted(set(chosen)) and set(chosen) <= set(available)


def _quant_config_property(qc):
    try:
        fmt, group = parse_quant_config(json.dumps(qc))
    except (ValueError, TypeError):
        return
    assert set(qc) <= {"method", "per_channel", "group_size"} and fmt in ktcy.FORMATS
    assert qc.get("per_channel") in (None, True, False) and (group is None or fmt == "INT4")


@settings(max_examples=300, deadline=None)
@given(LAYER_TEXT)
def test_layers_text_property(text):
    """Any --layers text: a ValueError, or sorted distinct MoE layers."""
    _layers_property(text)


@settings(max_examples=300, deadline=None)
@given(QUANT_CONFIG)
def test_quant_config_property(qc):
    """Any --quant-config object: a ValueError, or a known format with only known keys."""
    _quant_config_property(qc)


@pytest.mark.fuzz
@settings(max_examples=3000, deadline=None)
@given(LAYER_TEXT, QUANT_CONFIG)
def test_converter_arguments_fuzz(text, qc):
    _layers_property(text)
    _quant_config_property(qc)


# -- item 6: --quant-config ----------------------------------------------------------------------

@pytest.mark.parametrize("text,needle", [
    ('{"method": "FP8", "per_channel": "no"}', "true or false"), ('{"method": "FP8", "per_channel": 1}', "true or false"),
    ('{"method": "INT8", "grop_size": 32}', "unknown key(s) 'grop_size'"), ('{"method": "INT4", "group_size": 48}', "32, 64, 128"),
    ('{"method": "INT8", "group_size": 32}', "INT4 / INT4_ZP / INT4_MIN / INT8_GROUP / INT8_MIN only"), ('{"per_channel": true}', '"method"'),
    ('["INT8"]', "JSON object"), ('{"method": "INT8"', "not valid JSON"), ('{"method": "BF16", "per_channel": true}', "does not fit"),
    ('{"method": "FP8_PERCHANNEL", "per_channel": false}', "does not fit"),
    ('{"method": "INT8", "method": "INT4"}', "lists 'method' twice"), ("[" * 100000, "not valid JSON"),
])
def test_bad_quant_configs_are_refused(src, tmp_path, text, needle):
    with pytest.raises(ValueError) as e:
        parse_quant_config(text)
    assert needle in str(e.value)
    assert_one_line_error(cli("--input", src, "--output", tmp_path / "o", "--quant-config", text), needle)


def test_quant_config_group_size_is_honoured(src, tmp_path):
    out = tmp_path / "out"
    r = cli("--input", src, "--output", out, "--quant-config", '{"method": "INT4", "group_size": 32}')
    assert r.returncode == 0, r.stderr
    assert read_metadata(out / layer_file_name(2))[2]["group_size"] == 32
    x, ids, w = inputs(128)
    assert np.array_equal(ktcy.load_experts(out, 2).forward(x, ids, w),
                          ktcy.load_experts(src, 2, method="INT4", group_size=32).forward(x, ids, w))
    assert parse_quant_config('{"method": "FP8", "per_channel": false}') == ("FP8_BLOCK", None)
    assert parse_quant_config('{"method": "int4"}') == ("INT4", None)
    assert_one_line_error(cli("--input", src, "--output", out, "--quant-config", '{"method": "INT4", "group_size": 32}',
                              "--group-size", "128"), "disagree")
    assert_one_line_error(cli("--input", src, "--output", out, "--method", "INT8", "--group-size", "32"), "INT4 / INT4_ZP / INT4_MIN / INT8_GROUP / INT8_MIN only")


# -- item 15 and issue 17: command lines ---------------------------------------------------------

def test_kt_kernel_command_line_runs_unchanged(src, tmp_path):
    out = tmp_path / "out"
    r = cli("--input-path", src, "--input-type", "bf16", "--output", out, "--quant-method", "int4",
            "--cpuinfer-threads", "60", "--threadpool-count", "2", "--gpu", "--no-merge-safetensor",
            "--fp8-expert-batch", "16", "--resume-layer", "0")
    assert r.returncode == 0, r.stderr
    for flag in ("--threadpool-count", "--gpu", "--no-merge-safetensor", "--fp8-expert-batch", "--threads 60"):
        assert any(l.startswith("note: " + flag) for l in r.stderr.splitlines()), (flag, r.stderr)
    assert ktcy.load_experts(out, 1).format == "INT4"
    # not a terminal: one line per layer
    assert [l.split(" (")[0] for l in r.stderr.splitlines() if l.startswith("layer ")] == ["layer 1", "layer 2", "layer 3"]
    r = cli("-i", src, "-o", "~/o2", "--quant-method", "moe_int8", "--layers", "2", env=dict(os.environ, HOME=str(tmp_path)))
    assert r.returncode == 0 and ktcy.load_experts(tmp_path / "o2", 2).format == "INT8"  # ~ expanded
    assert_one_line_error(cli("-i", src, "-o", tmp_path / "o3", "--quant-method", "awq"), "AWQ")
    assert_one_line_error(cli("-i", src, "-o", tmp_path / "o3", "--quant-method", "int8", "--method", "BF16"), "disagree")


def test_quiet_and_verbose(src, tmp_path):
    r = cli("--input", src, "--output", tmp_path / "q", "--method", "INT8", "-q", "--gpu")
    assert r.returncode == 0 and r.stderr.splitlines() == ["note: --gpu: ktcy converts on the CPU; ignored"]
    r = cli("--input", src, "--output", tmp_path / "v", "--method", "INT8", "-v")
    assert r.returncode == 0 and r.stderr.count("layer ") >= 3
    assert_one_line_error(cli("--input", src, "--output", tmp_path / "x", "-q", "-v"), "not allowed with")


def test_progress_on_a_terminal_uses_tqdm(src, tmp_path):
    import pty
    leader, follower = pty.openpty()
    r = subprocess.run(KTCY + ["--input", str(src), "--output", str(tmp_path / "o"), "--method", "INT8"],
                       stdout=subprocess.DEVNULL, stderr=follower, timeout=120)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert r.returncode == 0
    text = shown.decode(errors="replace")
    assert "expert/s" in text and "\r" in text  # tqdm's bar: redrawn in place, with a rate
    assert text.count("experts/s)") == 3  # and the summary line of each layer stays


def test_interrupt_leaves_complete_files_only(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    make_checkpoint(src, E=8, H=512, I=256, num_layers=8, dense_layers=())
    proc = subprocess.Popen(KTCY + ["--input", str(src), "--output", str(out), "--method", "INT4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not os.path.exists(out / layer_file_name(0)):
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    if proc.returncode == 0:  # finished before the signal landed: nothing to check about interrupts
        return
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert leftovers(out) == []
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            read_metadata(out / name)
    r = cli("--input", src, "--output", out, "--method", "INT4", "--resume")
    assert r.returncode == 0 and json.load(open(out / "ktcy_model.json"))["layers"] == list(range(8))


@pytest.mark.parametrize("args,needle", [
    (["--threads", "0"], "at least 1"), (["--threads", "x"], "invalid int"), (["--method", "INT3"], "unknown weight format"),
    (["--resume-layer", "-1"], ">= 0"), (["--nonsense"], "unrecognized"), ([], "required"),
    (["--input-bf16-hf-path", "x"], "go together"),
])
def test_user_errors_are_one_line(src, tmp_path, args, needle):
    base = ["--input", src, "--output", tmp_path / "o"] if args and args[0] != "--input-bf16-hf-path" else []
    assert_one_line_error(cli(*base, *args), needle)


def test_debug_shows_the_traceback_and_help_lists_defaults(src, tmp_path):
    r = cli("--input", tmp_path / "missing", "--output", tmp_path / "o", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr
    assert_one_line_error(cli("--input", tmp_path / "missing", "--output", tmp_path / "o"), "not a folder")
    h = cli("--help")
    assert h.returncode == 0 and "Converts a Hugging Face MoE checkpoint" in h.stdout
    for text in ("--quant-method", "--cpuinfer-threads", "--resume-layer", "default: 64", "default: all", "examples:"):
        assert text in h.stdout, text
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "convert_cpu_weights.py")
    if os.path.exists(tool):  # the repository's tool runs the same code
        r = subprocess.run([sys.executable, tool, "--input", str(src), "--output", str(src)], capture_output=True, text=True)
        assert_one_line_error(r, "input folder")


# -- issue 17: a complete HF FP8 per-channel checkpoint -------------------------------------------

@pytest.mark.parametrize("family", ["qwen2", "deepseek", "mixtral"])
def test_hf_fp8_output_is_a_complete_checkpoint(tmp_path, family):
    src, out = tmp_path / "bf16", tmp_path / "fp8"
    build_family(src, family)
    (src / "tokenizer.json").write_text('{"model": "test"}')
    r = cli("--input-type", "bf16", "--input-bf16-hf-path", src, "--output-fp8-hf-path", out,
            "--quant-config", '{"method": "FP8", "per_channel": true}')
    assert r.returncode == 0, r.stderr
    config = json.load(open(out / "config.json"))
    qc = config.pop("quantization_config")
    assert config == json.load(open(src / "config.json"))
    group = qc["config_groups"]["group_0"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert group["weights"]["strategy"] == "channel" and group["weights"]["type"] == "float"
    assert group["weights"]["num_bits"] == 8
    index = json.load(open(out / "model.safetensors.index.json"))["weight_map"]
    ckpt = ktcy.checkpoint.Checkpoint(src)
    fp8 = ktcy.checkpoint.Checkpoint(out)
    import re
    target = re.compile(group["targets"][0][3:])
    expert_names = set()
    for L in ckpt.arch.moe_layers:
        kind, pattern, names = ckpt.layer(L).scheme
        expert_names |= {pattern.format(e=e, proj=names[p]) for e in range(8) for p in ("gate", "up", "down")}
    for name in ckpt.tensor_names():
        if name in expert_names:
            assert fp8.get(name).dtype.name == "float8_e4m3fn" and fp8.get(name + "_scale").shape[1] == 1
            assert target.match(name[: -len(".weight")])
        else:  # every other tensor carried over byte for byte
            a, b = ckpt.get(name), fp8.get(name)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
            assert not target.match(name.rsplit(".", 1)[0])
    assert set(index) == set(fp8.tensor_names()) and all(os.path.exists(out / f) for f in set(index.values()))
    assert (out / "tokenizer.json").read_text() == '{"model": "test"}'
    x = np.random.default_rng(5).standard_normal((6, 128)).astype(np.float32)
    ids, w = np.argsort(np.random.default_rng(6).random((6, 8)), axis=1)[:, :2].astype(np.int64), np.full((6, 2), 0.5, np.float32)
    for L in ckpt.arch.moe_layers:
        a, b = ktcy.load_experts(out, L), ktcy.load_experts(src, L, method="FP8_PERCHANNEL")
        assert a.format == "FP8_PERCHANNEL"
        assert np.array_equal(a.forward(x, ids, w), b.forward(x, ids, w))
    converted = ktcy.MoEModel.from_pretrained(out)
    direct = ktcy.MoEModel.from_pretrained(src, backend="FP8_PERCHANNEL")
    assert list(converted.blocks) == list(direct.blocks)
    for name, block in converted.blocks.items():
        y, ref = block.forward(x), direct.blocks[name].forward(x)
        assert block.experts.format == "FP8_PERCHANNEL"
        assert np.linalg.norm(y - ref) <= 1e-6 * np.linalg.norm(ref), name
    assert leftovers(out) == []


def test_hf_fp8_resume_and_refusals(tmp_path):
    src, out = tmp_path / "bf16", tmp_path / "fp8"
    make_checkpoint(src, num_layers=4, dense_layers=(0,))
    assert cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", out).returncode == 0
    mtimes = {n: os.path.getmtime(out / n) for n in os.listdir(out) if n.startswith("model-fp8")}
    r = cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", out, "--resume")
    assert r.returncode == 0 and r.stderr.count("already converted, kept") == 3
    assert {n: os.path.getmtime(out / n) for n in mtimes} == mtimes
    other = tmp_path / "other"
    make_checkpoint(other, num_layers=4, dense_layers=(0,), seed=9)
    assert_one_line_error(cli("--input-bf16-hf-path", other, "--output-fp8-hf-path", out, "--resume"),
                          "another checkpoint")
    fp8_src = tmp_path / "fp8src"
    make_checkpoint(fp8_src, fp8="block", H=256, I=128, extra_config={"quantization_config": {"quant_method": "fp8"}})
    assert_one_line_error(cli("--input-bf16-hf-path", fp8_src, "--output-fp8-hf-path", tmp_path / "x"), "already quantized")
    assert_one_line_error(cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", tmp_path / "y", "--method", "INT8"),
                          "FP8 per-channel")


def test_hf_fp8_export_narrowed_removes_only_its_own_unreferenced_shards(tmp_path):
    src, out = tmp_path / "bf16", tmp_path / "fp8"
    make_checkpoint(src, num_layers=4, dense_layers=(0,))
    assert cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", out).returncode == 0
    before = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert [n for n in before if n.startswith("model-fp8-layer")] == [f"model-fp8-layer{L:04d}.safetensors" for L in (1, 2, 3)]
    (out / "notes.safetensors").write_bytes(b"the user's")  # never ours: stays
    r = cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", out, "--layers", "2")
    assert r.returncode == 0, r.stderr
    index = json.load(open(out / "model.safetensors.index.json"))["weight_map"]
    on_disk = {n for n in os.listdir(out) if n.endswith(".safetensors")}
    assert on_disk == set(index.values()) | {"notes.safetensors"}
    assert "model-fp8-layer0002.safetensors" in on_disk and "model-fp8-layer0001.safetensors" not in on_disk
    assert json.load(open(out / "ktcy_fp8_export.json"))["files"] == sorted(
        set(index.values()) | {"config.json", "model.safetensors.index.json"}
        | {n for n in os.listdir(src) if not n.endswith(".safetensors") and n not in ("config.json",
                                                                                       "model.safetensors.index.json")})
    assert ktcy.load_experts(out, 2).format == "FP8_PERCHANNEL"


# ---- the fiftieth stop's review: files in the output the converter did not create ----

def test_missing_or_clashing_flags_exit_2_as_a_malformed_command_line(src, tmp_path):
    for args in ([], ["--input", src], ["--input-bf16-hf-path", src],
                 ["--input", src, "--output", tmp_path / "o", "--output-fp8-hf-path", tmp_path / "p"],
                 ["--input", src, "--output", tmp_path / "o", "--method", "INT8", "--quant-method", "int4"],
                 ["--input", src, "--output", tmp_path / "o", "--group-size", "64", "--quant-config",
                  '{"method": "INT4", "group_size": 32}']):
        r = cli(*args)
        assert_one_line_error(r)
        assert r.returncode == 2, (args, r.stderr)


@pytest.mark.parametrize("kind", ["symlink", "hard link", "foreign text", "fifo"])
def test_a_lock_file_ktcy_cannot_own_is_refused_and_left_alone(src, tmp_path, kind):
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "precious.txt"
    victim.write_text("not ktcy's\n" * 10)
    lock = out / ".ktcy_convert.lock"
    if kind == "symlink":
        os.symlink(victim, lock)
    elif kind == "hard link":
        os.link(victim, lock)
    elif kind == "foreign text":
        lock.write_text("someone's notes\n")
    else:
        os.mkfifo(lock)
    for flags in (["--input", src, "--output", out], ["--input-bf16-hf-path", src, "--output-fp8-hf-path", out]):
        assert_one_line_error(cli(*flags), ".ktcy_convert.lock")
    assert victim.read_text() == "not ktcy's\n" * 10
    assert sorted(os.listdir(out)) == [".ktcy_convert.lock"]


def test_a_hard_linked_lock_of_a_copied_output_folder_still_locks(src, tmp_path):
    out = tmp_path / "out"
    assert cli("--input", src, "--output", out, "--layers", "1").returncode == 0
    snapshot = tmp_path / "snapshot"
    subprocess.run(["cp", "-al", str(out), str(snapshot)], check=True)  # the lock file now has 2 links
    assert os.stat(out / ".ktcy_convert.lock").st_nlink == 2
    r = cli("--input", src, "--output", out, "--resume")
    assert r.returncode == 0, r.stderr
    assert json.load(open(out / "ktcy_model.json"))["layers"] == [1, 2, 3]


def test_hf_fp8_export_refuses_a_small_file_linked_from_outside(src, tmp_path):
    secret = tmp_path / "SECRET"
    secret.write_text("outside the checkpoint")
    os.symlink(secret, src / "tokenizer.model")
    out = tmp_path / "out"
    assert_one_line_error(cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", out), "tokenizer.model",
                          "outside the checkpoint folder")
    assert not (out / "tokenizer.model").exists()


@pytest.mark.parametrize("marker", ["[" * 100000, '{"files": [["a"]]}', "fifo"])
def test_a_hostile_export_marker_is_one_line(src, tmp_path, marker):
    out = tmp_path / "out"
    out.mkdir()
    path = out / "ktcy_fp8_export.json"
    if marker == "fifo":
        os.mkfifo(path)
    else:
        path.write_text(marker)
    assert_one_line_error(cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", out, timeout=60),
                          "ktcy_fp8_export.json is unreadable")


def test_a_layer_file_renamed_to_another_layer_is_not_that_layer(src, tmp_path):
    out = tmp_path / "out"
    assert cli("--input", src, "--output", out, "--layers", "1").returncode == 0
    os.rename(out / layer_file_name(1), out / layer_file_name(2))
    with pytest.raises(CheckpointError, match="holds layer 1, not layer 2"):
        ktcy.load_experts(out, 2)
    assert_one_line_error(cli("--input", src, "--output", out, "--layers", "2", "--resume"), "it holds layer 1")


@pytest.mark.parametrize("key,value", [("num_experts", "\u00b2"), ("hidden_size", "9" * 5000),
                                       ("source", "[" * 100000), ("source", "1" * 5000)])
def test_odd_metadata_in_an_output_layer_file_is_one_line(src, tmp_path, key, value):
    good = tmp_path / "good"
    convert_mod.convert(src, good, method="INT8", layers="1", progress=QUIET)
    f = SafetensorsFile(good / layer_file_name(1))
    tensors, meta = {n: np.array(f.get(n)) for n in f.keys()}, dict(f.metadata)
    del f
    out = tmp_path / "out"
    out.mkdir()
    write(out / layer_file_name(1), tensors, dict(meta, **{key: value}))
    if key != "source":
        with pytest.raises(CheckpointError, match=f"metadata {key}="):
            read_metadata(out / layer_file_name(1))
    r = cli("--input", src, "--output", out, "--method", "INT8", "--layers", "1")
    if key == "source":  # readable, from an unknown source: a conversion of its own that differs
        assert_one_line_error(r, "differs from this conversion", "not recorded")
    else:  # not a packed layer ktcy can read: kept unless --overwrite
        assert_one_line_error(r, "is not a packed layer this ktcy can read", "--overwrite")
        assert cli("--input", src, "--output", out, "--method", "INT8", "--layers", "1", "--overwrite").returncode == 0
        read_metadata(out / layer_file_name(1))


def test_a_converted_folder_given_as_the_input_says_so(src, tmp_path):
    out = tmp_path / "out"
    assert cli("--input", src, "--output", out, "--layers", "1").returncode == 0
    assert_one_line_error(cli("--input", out, "--output", tmp_path / "again"), "a converted folder holds experts only")
    assert_one_line_error(cli("--input-bf16-hf-path", out, "--output-fp8-hf-path", tmp_path / "fp8"),
                          "a converted folder holds experts only")


# -- the fifty-ninth session's review ----------------------------------------------------------

def test_sigterm_mid_conversion_leaves_no_temporary_file(tmp_path):
    """kill, timeout and docker stop send SIGTERM, whose default ended the converter on the spot
    and left its temporary file (10 MiB here) for good; it now cleans up as Ctrl-C does."""
    src, out = tmp_path / "hf", tmp_path / "out"
    make_checkpoint(src, E=8, H=1024, I=512, num_layers=3, dense_layers=())
    p = subprocess.Popen(KTCY + ["--input", str(src), "--output", str(out), "--method", "BF16"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and p.poll() is None and not (out.is_dir() and leftovers(out)):
        time.sleep(0.002)
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=60)[1]
    assert p.returncode in (0, 130), err  # 0: it had just finished
    if p.returncode == 130:
        assert err.strip().splitlines() == ["ktcy convert: interrupted (files already complete stay; run again "
                                            "with --resume)"]
    assert leftovers(out) == []


def test_temporaries_of_dead_converters_are_removed_under_the_lock(src, tmp_path):
    """A converter killed outright (SIGKILL, power) leaves its temporary file; the next one on the
    folder removes it, and leaves those of a process still running."""
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = f".{layer_file_name(1)}.{gone.pid}.deadbeef.tmp.partial"
    live = f".{layer_file_name(2)}.{os.getpid()}.0badcafe.tmp"
    for name in (dead, live):
        (out / name).write_bytes(b"x" * 100)
    convert_mod.convert(src, out, method="INT8", layers="1", progress=QUIET)
    assert not (out / dead).exists() and (out / live).exists()


def test_an_interrupted_overwrite_leaves_no_manifest_vouching_for_the_old_layers(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    convert_mod.convert(src, out, method="BF16", progress=QUIET)
    assert ktcy.load_experts(out, 1).format == "BF16"

    def interrupted(*_, **__):
        raise KeyboardInterrupt
    monkeypatch.setattr(convert_mod, "pack_layer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_mod.convert(src, out, method="INT8", overwrite=True, progress=QUIET)
    manifest = json.loads((out / "ktcy_model.json").read_text())
    assert manifest["method"] == "INT8" and manifest["layers"] == []  # it vouches for no old layer
    with pytest.raises(CheckpointError, match="not converted"):
        ktcy.MoEModel.from_pretrained(src, experts_path=out, layers=[1])
    monkeypatch.undo()
    convert_mod.convert(src, out, method="INT8", resume=True, progress=QUIET)
    assert ktcy.load_experts(out, 1).format == "INT8"


@pytest.mark.parametrize("flag", ["--method", "--quant-method"])
def test_an_empty_method_is_refused_not_taken_as_none(src, tmp_path, flag):
    r = cli("--input", src, "--output", tmp_path / "o", flag, "")
    assert_one_line_error(r, f"{flag} is empty")
    assert r.returncode == 2 and not (tmp_path / "o").exists()


def test_only_the_converters_own_dead_temporaries_are_removed(src, tmp_path):
    """A name merely shaped like a temporary is someone else's file, a folder of that name stays,
    and nothing that cannot be removed keeps the lock held."""
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    mine = out / f".ktcy_model.json.{gone.pid}.0badf00d.tmp"
    theirs = out / f".notes.{gone.pid}.deadbeef.tmp"
    folder = out / f".{layer_file_name(3)}.{gone.pid}.cafebabe.tmp"
    mine.write_text("x")
    theirs.write_text("mine")
    folder.mkdir()
    for _ in range(2):  # the lock is released both times
        convert_mod.convert(src, out, method="INT8", layers="1", progress=QUIET)
    assert not mine.exists() and theirs.read_text() == "mine" and folder.is_dir()


def test_dead_temporaries_of_any_file_the_fp8_export_copies_are_removed(src, tmp_path):
    """The FP8 export also publishes tokenizer files: their temporaries carry ktcy's prefix, so a
    killed export's are found whatever file they were to become."""
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = out / f".ktcy-tmp.tokenizer.json.{gone.pid}.deadbeef.tmp"
    dead.write_text("{")
    assert cli("--input-bf16-hf-path", src, "--output-fp8-hf-path", out).returncode == 0
    assert not dead.exists() and leftovers(out) == []


def test_a_failure_just_after_locking_releases_the_lock(src, tmp_path, monkeypatch):
    from ktcy import output_guard

    def disk_full(folder):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(output_guard, "_remove_dead_temporaries", disk_full)
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match="cannot write the lock file .*No space left"):
        convert_mod.convert(src, out, method="INT8", layers="1", progress=QUIET)
    monkeypatch.undo()
    convert_mod.convert(src, out, method="INT8", layers="1", progress=QUIET)  # not "another converter"
    assert ktcy.load_experts(out, 1).format == "INT8"
