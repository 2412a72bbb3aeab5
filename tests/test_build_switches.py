"""Build-time switches: a CPUINFER_ENABLE_AMX=OFF build holds no AMX instruction (slow: it
compiles the extension a second time)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ktcy
from ktcy import _native

REPO = Path(__file__).resolve().parents[1]
TILE_MNEMONICS = re.compile(r"\b(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilezero|tilerelease|tdpb\w+)\b")


def tile_instructions(so_path):
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so_path)], capture_output=True, text=True,
                         check=True).stdout
    return set(TILE_MNEMONICS.findall(out))


def test_default_build_reports_switches():
    info = ktcy.build_info()
    assert set(info) >= {"amx", "avx512_vbmi", "avx512_bf16", "variants"}
    assert ("amx_int8" in info["variants"]) == info["amx"]
    assert "amx_emu_int8" in info["variants"]  # the emulation is always built


def test_default_build_contains_amx_when_enabled():
    if not ktcy.build_info()["amx"]:
        pytest.skip("this build was made with CPUINFER_ENABLE_AMX=OFF")
    found = tile_instructions(_native.__file__)
    assert {"ldtilecfg", "tileloadd", "tdpbssd", "tdpbf16ps"} <= found


@pytest.mark.slow
def test_amx_off_build_has_no_tile_instructions(tmp_path):
    if not (REPO / "setup.py").exists():
        pytest.skip("source tree not available")
    lib, tmp = tmp_path / "lib", tmp_path / "tmp"
    env = dict(os.environ, CPUINFER_ENABLE_AMX="OFF")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(lib), "--build-temp", str(tmp)],
                       cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    so = next((lib / "ktcy").glob("_native*.so"))
    assert tile_instructions(so) == set()
    for py in (REPO / "ktcy").glob("*.py"):
        shutil.copy(py, lib / "ktcy")
    probe = subprocess.run([sys.executable, "-c", "import ktcy, json; print(json.dumps(ktcy.build_info()));"
                            "print(ktcy.available_isas())"],
                           cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(lib)), capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    assert str(lib) in subprocess.run([sys.executable, "-c", "import ktcy; print(ktcy.__file__)"], cwd=tmp_path,
                                      env=dict(os.environ, PYTHONPATH=str(lib)), capture_output=True,
                                      text=True).stdout
    assert '"amx": false' in probe.stdout
    assert "'amx'" not in probe.stdout.splitlines()[1]
    assert "'amx_emu'" in probe.stdout.splitlines()[1]
