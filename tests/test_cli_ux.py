"""CLI conventions: one-line errors without tracebacks (--debug shows them), -v/-q on every
command, help with defaults, --version, logging and progress reporters."""
import io
import json
import logging
import os
import signal
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import ktcy
from test_model import build
from ktcy import _native, log, progress
from ktcy.interrupts import termination_as_interrupt

COMMANDS = ("info", "doctor", "bench", "run-block", "convert", "generate", "launch")


def ktcy_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "ktcy", *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kw)


def assert_one_line_error(r, *words, rc=None):
    assert r.returncode != 0 if rc is None else r.returncode == rc, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def missing_isa():
    """An ISA name this host cannot run (amx on most machines)."""
    for isa in ("amx", "avx512", "avx2"):
        if isa not in _native.available_isas():
            return isa
    pytest.skip("this host runs every ISA")


@pytest.mark.parametrize("args, words", [
    (("--shape", "garbage"), ("--shape", "garbage")),
    (("--shape", "0,64,4,2"), ("positive",)),
    (("--shape", "64,64,4,9"), ("k <= E",)),
    (("--formats", "INT3"), ("--formats", "INT3")),
    (("--tokens", "1,x"), ("--tokens",)),
    (("--tokens", "0"), ("--tokens",)),
    (("--shape", "100000,100000,1000,8"), ("GiB", "available")),
    (("--shape", "64,32,4,2", "--tokens", str(10**12)), ("GiB", "available")),
])
def test_bench_value_errors(args, words):
    assert_one_line_error(ktcy_cli("bench", *args), *words, rc=1)


@pytest.mark.parametrize("threads", ["-2", "0", str(10**6), "two"])
def test_bench_thread_counts(threads):
    assert_one_line_error(ktcy_cli("bench", "--threads", threads), "--threads", rc=2)


def test_bench_isa_this_cpu_lacks():
    isa = missing_isa()
    r = ktcy_cli("bench", "--isa", isa, "--shape", "64,32,4,2")
    assert_one_line_error(r, f"'{isa}'", "cannot run", rc=1)


def test_debug_shows_the_traceback():
    r = ktcy_cli("bench", "--debug", "--shape", "garbage")
    assert r.returncode != 0 and "Traceback" in r.stderr and "ValueError" in r.stderr


def test_unknown_flag_is_one_line():
    assert_one_line_error(ktcy_cli("bench", "--no-such-flag"), "unrecognized", rc=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    build(str(path), "qwen3")  # H 128, MoE blocks in layers 1-3
    return path


@pytest.fixture(scope="module")
def hidden(tmp_path_factory):
    path = tmp_path_factory.mktemp("h") / "h.npy"
    np.save(path, np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32))
    return path


def test_run_block_output_in_a_missing_folder(checkpoint, hidden, tmp_path):
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", hidden, "--output", tmp_path / "no" / "y.npy")
    assert_one_line_error(r, "--output", "does not exist", rc=1)


def test_run_block_output_is_a_folder(checkpoint, hidden, tmp_path):
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", hidden, "--output", tmp_path)
    assert_one_line_error(r, "--output", "is a folder", rc=1)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("array, words", [
    (np.ones((3, 128), np.int32), ("int32", "float32")),
    (np.ones((3, 64), np.float32), ("(3, 64)", "[T, 128]")),
    (np.ones(128, np.float32), ("(128,)",)),
])
def test_run_block_bad_inputs(checkpoint, tmp_path, array, words):
    src = tmp_path / "in.npy"
    np.save(src, array)
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", src, "--output", tmp_path / "y.npy")
    assert_one_line_error(r, "--input", *words, rc=1)
    assert not (tmp_path / "y.npy").exists()


def test_run_block_not_an_npy(checkpoint, tmp_path):
    src = tmp_path / "in.npy"
    src.write_text("not numpy")
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", src, "--output", tmp_path / "y.npy")
    assert_one_line_error(r, "--input", rc=1)


def test_run_block_works_with_threads_and_bfloat16(checkpoint, tmp_path):
    src = tmp_path / "in.npy"
    np.save(src, np.random.default_rng(1).standard_normal((2, 128)).astype(ml_dtypes.bfloat16))
    r = ktcy_cli("run-block", "-q", checkpoint, "--layer", 1, "--input", src, "--output", tmp_path / "y.npy",
                 "--threads", 1)
    assert r.returncode == 0, r.stderr
    assert np.load(tmp_path / "y.npy").shape == (2, 128)


def test_missing_checkpoint_is_one_line(hidden, tmp_path):
    r = ktcy_cli("run-block", tmp_path / "nothing", "--layer", 1, "--input", hidden, "--output", tmp_path / "y.npy")
    assert_one_line_error(r, rc=1)


def test_info_json_into_a_closed_pipe():
    p = subprocess.Popen([sys.executable, "-m", "ktcy", "info", "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before ktcy writes, as with `| head -0`
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) != 0 or err == ""
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_info_json_piped_to_head():
    r = subprocess.run(f"{sys.executable} -m ktcy info --json | head -1", shell=True, capture_output=True,
                       text=True, timeout=60)
    assert r.stdout == "{\n" and "Error" not in r.stderr


def test_version():
    r = ktcy_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ktcy {ktcy.__version__}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_verbosity_flags(command):
    r = ktcy_cli(command, "--help")
    assert r.returncode == 0, r.stderr
    if command != "convert":  # the converter documents its own flags
        assert "-v, --verbose" in r.stdout and "-q, --quiet" in r.stdout and "--debug" in r.stdout
        assert len(r.stdout.split("\n\n")[1].strip()) > 20  # a description


def test_help_shows_defaults():
    out = " ".join(ktcy_cli("bench", "--help").stdout.split())
    assert "(default: qwen3-30b)" in out and f"(default: all: {', '.join(ktcy.FORMATS)})" in out


@pytest.mark.parametrize("flags", [("-v",), ("-q",), ("-vv",), ("--verbose", "--quiet")])
def test_verbosity_flags_on_info_before_and_after_the_command(flags):
    assert ktcy_cli("info", *flags).returncode == 0
    assert ktcy_cli(*flags, "info").returncode == 0


def test_convert_takes_global_flags_and_keeps_one_line_errors(tmp_path):
    r = ktcy_cli("convert", "-q", "--input", tmp_path / "none", "--output", tmp_path / "out")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_check_cpu_features_help_and_json():
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "check_cpu_features.py")
    r = subprocess.run([sys.executable, tool, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--json" in r.stdout
    r = subprocess.run([sys.executable, tool, "--json"], capture_output=True, text=True)
    data = json.loads(r.stdout)
    assert set(data) == {"cpu", "features", "backends", "avx2_usable"} and "AMXINT8" in data["backends"]


# ---------------------------------------------------------------- logging and progress

@pytest.fixture
def fresh_logging():
    logger = logging.getLogger("ktcy")
    saved = (logger.level, list(logger.handlers), logger.propagate, log._handler)
    yield logger
    logger.level, logger.handlers[:], logger.propagate, log._handler = saved[0], saved[1], saved[2], saved[3]


def test_set_verbosity_formats_once_without_a_repeated_prefix(fresh_logging, capsys):
    log._handler = None
    log.set_verbosity("warning")
    fresh_logging.warning("ktcy: backend AMXINT8 asks for AMX; using avx512")
    fresh_logging.warning("ktcy: backend AMXINT8 asks for AMX; using avx512")
    fresh_logging.info("not shown at warning level")
    err = capsys.readouterr().err
    assert err == "ktcy: warning: backend AMXINT8 asks for AMX; using avx512\n"
    log.set_verbosity(logging.INFO)
    fresh_logging.info("now shown")
    assert capsys.readouterr().err == "ktcy: info: now shown\n"
    assert log.get_verbosity() == logging.INFO
    with pytest.raises(ValueError, match="verbosity"):
        log.set_verbosity("chatty")
    with pytest.raises(TypeError):
        log.set_verbosity(2.5)


def test_progress_reporter_off_a_terminal(fresh_logging):
    stream = io.StringIO()
    bar = progress.reporter("packing INT8", 4, unit="expert", stream=stream)
    for done in range(1, 5):
        bar.update(done, 4)
    assert stream.getvalue() == ""  # nothing until the step ends
    bar.close()
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("packing INT8: 4/4 expert in ")


def test_progress_reporter_is_silent_when_quiet(fresh_logging):
    log.set_verbosity("error")
    stream = io.StringIO()
    with progress.reporter("convert", 2, stream=stream) as bar:
        bar(1, 2)
        bar(2, 2)
    assert stream.getvalue() == ""


def test_progress_reporter_on_a_terminal_uses_tqdm(fresh_logging):
    class Tty(io.StringIO):
        def isatty(self):
            return True
    stream = Tty()
    with progress.reporter("packing", 10, unit="expert", stream=stream) as bar:
        bar.update(10, 10)
    text = stream.getvalue()
    assert "packing" in text and "10/10" in text and "expert/s" in text


# Needs the guard the lead puts at the top of ktcy/__init__.py (the package is imported before
# ktcy/__main__.py runs, so nothing else can catch it).  strict: when the guard lands this test
# passes, and the mark must go.
def test_python_m_ktcy_from_the_source_tree_says_what_to_do():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "ktcy", "_native.pyx")):
        pytest.skip("not run from a source checkout")
    r = subprocess.run([sys.executable, "-m", "ktcy", "info"], cwd=root, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "source tree" in r.stderr and "cd elsewhere" in r.stderr
    assert "circular import" not in r.stderr


def test_amx_fallback_notice_is_shown_once():
    if "amx" in _native.available_isas():
        pytest.skip("AMX runs here: no fallback to report")
    code = ("import numpy as np, ktcy\n"
            "from ktcy import log\n"
            "log.set_verbosity('info')\n"
            "w = np.zeros((4, 64, 128), np.float32); d = np.zeros((4, 128, 64), np.float32)\n"
            "for _ in range(3):\n"
            "    ktcy.MoE.from_weights(ktcy.MoeConfig(4, 2, 128, 64, backend='AMXINT8'), w, w, d)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    notices = [line for line in r.stderr.splitlines() if "AMXINT8" in line]
    assert len(notices) == 1, r.stderr
    assert notices[0].startswith("ktcy: ") and "ktcy: ktcy:" not in notices[0]


# ---- the fiftieth stop's review ----

def test_run_block_never_replaces_a_fifo_and_leaves_no_temporary_file(checkpoint, hidden, tmp_path):
    fifo = tmp_path / "y.npy"
    os.mkfifo(fifo)
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", hidden, "--output", fifo)
    assert_one_line_error(r, "--output", "not a regular file", rc=1)
    assert os.listdir(tmp_path) == ["y.npy"] and not os.path.isfile(fifo)
    out = tmp_path / "z.npy"
    assert ktcy_cli("run-block", "-q", checkpoint, "--layer", 1, "--input", hidden, "--output", out).returncode == 0
    assert sorted(os.listdir(tmp_path)) == ["y.npy", "z.npy"]


def test_run_block_takes_big_endian_input_and_refuses_float32_overflow(checkpoint, hidden, tmp_path):
    x = np.load(hidden)
    np.save(tmp_path / "be.npy", x.astype(">f4"))
    assert ktcy_cli("run-block", "-q", checkpoint, "--layer", 1, "--input", tmp_path / "be.npy",
                    "--output", tmp_path / "y_be.npy").returncode == 0
    assert ktcy_cli("run-block", "-q", checkpoint, "--layer", 1, "--input", hidden,
                    "--output", tmp_path / "y.npy").returncode == 0
    assert np.array_equal(np.load(tmp_path / "y_be.npy"), np.load(tmp_path / "y.npy"))
    big = x.astype(np.float64)
    big[1, 2] = 1e300
    np.save(tmp_path / "big.npy", big)
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", tmp_path / "big.npy", "--output", tmp_path / "b.npy")
    assert_one_line_error(r, "--input", "beyond float32's range", rc=1)
    assert not (tmp_path / "b.npy").exists()


def test_bench_refuses_a_shape_int8_cannot_run_before_measuring():
    r = ktcy_cli("bench", "--shape", "16,65600,1,1", "--formats", "BF16,INT8", "--tokens", "1")
    assert_one_line_error(r, "--formats INT8", "K > 65536", rc=1)
    assert r.stdout == ""  # nothing measured or printed first


def test_isa_names_take_any_case_and_a_bad_amx_switch_is_reported():
    env = dict(os.environ, KTCY_ISA="AVX2", CPUINFER_ENABLE_AMX="of")
    code = ("import json, ktcy; from ktcy import doctor; "
            "print(json.dumps([ktcy.kernel_table()['INT8']['isa'], doctor.environment_problems()]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    isa, problems = json.loads(r.stdout)
    assert isa == "avx2"
    assert any("CPUINFER_ENABLE_AMX='of'" in p and "AMX stays enabled" in p for p in problems)
    assert "CPUINFER_ENABLE_AMX='of'" in r.stderr  # logged once at import


# ---- the fifty-ninth session's review ----

def test_run_block_never_writes_over_its_input_the_checkpoint_or_a_foreign_file(checkpoint, hidden, tmp_path):
    shard = next(p for p in sorted(os.listdir(checkpoint)) if p.endswith(".safetensors"))
    before = (checkpoint / shard).read_bytes()
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", hidden, "--output", checkpoint / shard)
    assert_one_line_error(r, "--output", "is not a .npy file", rc=1)
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", hidden, "--output", checkpoint / "y.npy")
    assert_one_line_error(r, "--output", "inside the checkpoint folder", rc=1)
    assert (checkpoint / shard).read_bytes() == before and not (checkpoint / "y.npy").exists()
    src = tmp_path / "h.npy"
    src.write_bytes(hidden.read_bytes())
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", src, "--output", src)
    assert_one_line_error(r, "--output", "is the --input file", rc=1)
    assert src.read_bytes() == hidden.read_bytes()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", hidden, "--output", notes)
    assert_one_line_error(r, "--output", "is not a .npy file", rc=1)
    assert notes.read_text() == "mine"
    out = tmp_path / "y.npy"  # an earlier result is replaced
    for _ in range(2):
        assert ktcy_cli("run-block", "-q", checkpoint, "--layer", 1, "--input", hidden, "--output", out).returncode == 0
    assert sorted(os.listdir(tmp_path)) == ["h.npy", "notes.txt", "y.npy"]


def test_run_block_damaged_archive_and_deep_rules_are_one_line(checkpoint, hidden, tmp_path):
    src = tmp_path / "in.npy"
    src.write_bytes(b"PK\x03\x04" + bytes(60))  # np.load takes it for an .npz
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", src, "--output", tmp_path / "y.npy")
    assert_one_line_error(r, "--input", "not a readable .npy file", rc=1)
    rules = tmp_path / "rules.yaml"
    rules.write_text("[" * 5000 + "]" * 5000)
    r = ktcy_cli("run-block", checkpoint, "--layer", 1, "--input", hidden, "--output", tmp_path / "y.npy",
                 "--rules", rules)
    assert_one_line_error(r, "rules", "nested too deeply", rc=1)


def test_an_empty_output_file_is_taken_and_nohup_is_kept(checkpoint, hidden, tmp_path):
    empty = tmp_path / "made_by_mktemp.npy"
    empty.write_bytes(b"")
    assert ktcy_cli("run-block", "-q", checkpoint, "--layer", 1, "--input", hidden, "--output", empty).returncode == 0
    assert np.load(empty).shape == (3, 128)
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
    try:
        with termination_as_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)
