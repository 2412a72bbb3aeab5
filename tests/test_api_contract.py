"""The public API as users call it: argument errors named as argument errors (not as faults of
a checkpoint), options checked before any work, numpy scalars accepted where Python numbers are,
the lazily loaded modules listing their names, and the annotations (the package ships py.typed)
clean under mypy for the package itself and for user code written against the README."""
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ktcy
from ktcy.config import checked_isa

from checkpoints import make_checkpoint
from test_model import build


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(str(path))
    return str(path)


@pytest.mark.parametrize("bad, error", [("bogus", ValueError), ("avx1024", ValueError), (3, TypeError)])
def test_isa_argument_errors_are_the_callers(checkpoint, tmp_path, bad, error):
    """An unknown isa= is the caller's error: ValueError/TypeError, never the CheckpointError that
    says the checkpoint is broken (an `except CheckpointError` would swallow the typo)."""
    calls = [lambda: ktcy.load_experts(checkpoint, 1, isa=bad),
             lambda: ktcy.MoeConfig(4, 2, 128, 64, isa=bad)]
    folder = tmp_path / "model"
    build(str(folder), "qwen3")
    calls.append(lambda: ktcy.MoEModel.from_pretrained(str(folder), isa=bad))
    for call in calls:
        with pytest.raises(error) as info:
            call()
        assert not isinstance(info.value, ktcy.CheckpointError), info.value
        if error is ValueError:
            assert "unknown ISA" in str(info.value) and "avx2" in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(method="bogus"), dict(group_size=48), dict(method="INT8", group_size=64)])
def test_format_argument_errors_are_the_callers(checkpoint, kwargs):
    with pytest.raises(ValueError) as info:
        ktcy.load_experts(checkpoint, 1, **kwargs)
    assert not isinstance(info.value, ktcy.CheckpointError), info.value


def test_isa_names_are_canonical():
    assert checked_isa(None) is None
    assert checked_isa(" AVX2 ") == "avx2"
    assert ktcy.MoeConfig(4, 2, 128, 64, isa="Ref").isa == "ref"
    with pytest.raises(ValueError, match="unknown ISA"):  # checked before the path is looked at
        ktcy.load_experts("/nonexistent/folder", 1, isa="avx")


def test_numpy_scalars_configure_like_python_numbers():
    cfg = ktcy.MoeConfig(np.int64(4), np.int32(2), 128, 64, activation="gpt_oss",
                         swiglu_alpha=np.float32(1.5), swiglu_limit=np.float64(6.0))
    assert (cfg.num_experts, cfg.top_k, cfg.swiglu_alpha, cfg.swiglu_limit) == (4, 2, 1.5, 6.0)
    assert type(cfg.swiglu_alpha) is float and type(cfg.num_experts) is int
    for bad in (np.bool_(True), True, np.float32("nan"), -1.0, "1.7"):
        with pytest.raises(ValueError, match="swiglu_alpha"):
            ktcy.MoeConfig(4, 2, 128, 64, swiglu_alpha=bad)


def test_expert_parallel_options_are_checked_before_packing():
    """A misspelt option fails at once (before this rank packs its experts), not at the end."""
    pytest.importorskip("torch")
    from ktcy.distributed import ExpertParallelMoE
    cfg = ktcy.MoeConfig(4, 2, 128, 64, quant_config=ktcy.QuantConfig("INT8"))
    rng = np.random.default_rng(0)
    gate, up = rng.standard_normal((2, 4, 64, 128), dtype=np.float32)
    down = rng.standard_normal((4, 128, 64), dtype=np.float32)
    packed = []

    def expert(e):
        packed.append(e)
        return {"gate": (gate[e], None), "up": (up[e], None), "down": (down[e], None)}

    with pytest.raises(TypeError, match="reduse"):
        ExpertParallelMoE.from_weights(cfg, gate, up, down, reduse="sum")
    with pytest.raises(ValueError, match="reduce"):
        ExpertParallelMoE.from_weights(cfg, gate, up, down, reduce="mean")
    with pytest.raises(TypeError, match="spin"):
        ExpertParallelMoE.from_experts(cfg, expert, spin=False)
    assert packed == []


def test_lazy_modules_list_their_names():
    import ktcy.distributed
    import ktcy.hf
    assert {"from_pretrained", "KtcyExperts", "SUPPORTED", "UnsupportedArchitectureError"} <= set(dir(ktcy.hf))
    assert {"ExpertParallelMoE", "Placement", "init_process_group", "DistributedError"} <= set(dir(ktcy.distributed))


USER_CODE = """
import numpy as np
import ktcy
from ktcy import kernels

cfg = ktcy.MoeConfig(8, 2, 256, 128, ktcy.QuantConfig("FP8", per_channel=None), backend=None, isa=None,
                     num_threads=None)
rng = np.random.default_rng(0)
moe = ktcy.MoE.from_weights(cfg, rng.standard_normal((8, 128, 256), dtype=np.float32),
                            rng.standard_normal((8, 128, 256), dtype=np.float32),
                            rng.standard_normal((8, 256, 128), dtype=np.float32))
y: np.ndarray = moe.forward(np.zeros((3, 256), np.float32), np.zeros((3, 2), np.int64), np.ones((3, 2), np.float32))
slots: np.ndarray = moe.forward_slots(np.zeros((3, 256), np.float32), [[0, 1]] * 3, [[1.0, 1.0]] * 3)
text: str = moe.kernel
threads: int = moe.num_threads + ktcy.get_num_threads()
ktcy.set_num_threads(1)
isas: list[str] = ktcy.available_isas()
features: dict[str, bool] = ktcy.cpu_features()
p = kernels.pack(np.ones((16, 32), np.float32), "BF16")
scale = p.scale
if scale is not None:
    print(scale.shape)
out: np.ndarray = kernels.linear(np.ones((2, 32), np.float32), p)
model = ktcy.MoEModel.from_pretrained("path/to/checkpoint", backend="INT8", layers=[3])
print(model.describe(), model.inject_expert_backend(r"model\\.layers\\.[0-9]\\.", "INT4"))


def whole_model() -> None:  # checked, not run
    import ktcy.hf
    lm = ktcy.hf.from_pretrained("path/to/checkpoint", backend="AMXINT8")
    lm.inject_expert_backend(r"model\\.layers\\.(4[0-7])\\.", "INT4")
"""


def run_mypy(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull, *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.fixture(scope="module")
def mypy():
    pytest.importorskip("mypy", reason="mypy comes with the test extra")


def test_the_package_type_checks(mypy, tmp_path):
    """What py.typed promises: the installed package's own annotations hold, and it ships the stub
    of its compiled part (without it every name from ktcy._native is Any to a checker).  Checked
    on a copy of its sources: mypy given a folder inside site-packages takes site-packages for a
    source root, where other packages' modules shadow the standard ones."""
    package = os.path.dirname(os.path.abspath(ktcy.__file__))
    assert os.path.isfile(os.path.join(package, "py.typed")) and os.path.isfile(os.path.join(package, "_native.pyi"))
    shutil.copytree(package, tmp_path / "ktcy", ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__"))
    result = run_mypy("--ignore-missing-imports", "ktcy", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_user_code_type_checks_strictly(mypy, tmp_path):
    """The README's calls under mypy --strict: documented Optional arguments accept None, results
    have the types the docs give (not Any), a packed weight's optional arrays are Optional (a
    BF16 weight has no scale: reading it unchecked is the one error the checker must report)."""
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_CODE))
    (tmp_path / "wrong.py").write_text("import numpy as np\nfrom ktcy import kernels\n"
                                       "p = kernels.pack(np.ones((16, 32), np.float32), 'BF16')\n"
                                       "print(p.scale.shape)\n")
    result = run_mypy("--strict", "--ignore-missing-imports", "user.py", "wrong.py", cwd=tmp_path)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("wrong.py:4:") and '"None"' in errors[0], result.stdout[-4000:]
