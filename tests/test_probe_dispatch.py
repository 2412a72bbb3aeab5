"""CPU probe, dispatch policy and its environment overrides (issue: foundation)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ktcy
from ktcy import _native

# /proc/cpuinfo spells some flags differently from ktcy's names.
CPUINFO_NAME = {"avx512_vbmi": "avx512vbmi"}
LISTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
          "avx512_bf16", "avx512_vbmi", "amx_tile", "amx_int8", "amx_bf16")
REPO = Path(__file__).resolve().parents[1]


def cpuinfo_flags():
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this system")
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo has no flags line")


def run_python(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("KTCY_ISA", "KTCY_TILES", "CPUINFER_ENABLE_AMX")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, cwd="/")


@pytest.mark.parametrize("feature", LISTED)
def test_probe_agrees_with_proc_cpuinfo(feature):
    flags = cpuinfo_flags()
    assert ktcy.cpu_features()[feature] == (CPUINFO_NAME.get(feature, feature) in flags)


def test_feature_dict_has_os_state():
    f = ktcy.cpu_features()
    for key in LISTED + ("os_avx", "os_avx512", "os_amx", "amx_permitted"):
        assert isinstance(f[key], bool)
    # a CPU flag without OS state never makes its ISA available
    if not f["os_avx512"]:
        assert "avx512" not in ktcy.available_isas()
    if not (f["amx_tile"] and f["os_amx"] and f["amx_permitted"]):
        assert "amx" not in ktcy.available_isas()


def test_default_table_picks_best_isa():
    avail = ktcy.available_isas()
    order = [i for i in ("amx", "avx512", "avx2", "ref") if i in avail]
    table = ktcy.kernel_table()
    assert set(table) == set(ktcy.FORMATS)
    for fmt, row in table.items():
        assert row["isa"] != "amx_emu"
        # the chosen ISA is the first in the ladder that serves this format
        serving = [i for i in order if any(v["isa"] == i and v["runnable"] and fmt in v["formats"]
                                           for v in _native.variants())]
        assert row["isa"] == serving[0]
    assert "amx_emu" in avail and "ref" in avail


TABLE_CODE = "import json, ktcy; print(json.dumps({f: r['isa'] for f, r in ktcy.kernel_table().items()}))"


@pytest.mark.parametrize("isa", ["ref", "avx2", "amx_emu"])
def test_ktcy_isa_forces_every_format(isa):
    if isa not in ktcy.available_isas():
        pytest.skip(f"{isa} not usable here")
    r = run_python(TABLE_CODE, KTCY_ISA=isa)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout).values()) == {isa}


def test_amx_off_skips_amx():
    r = run_python(TABLE_CODE + "; print(ktcy.available_isas())", CPUINFER_ENABLE_AMX="OFF")
    assert r.returncode == 0, r.stderr
    table = json.loads(r.stdout.splitlines()[0])
    assert "amx" not in table.values()
    assert "'amx'" not in r.stdout.splitlines()[1]
    # without AMX the choice equals the best non-AMX ISA of the default run
    expected = {f: row["isa"] for f, row in ktcy.kernel_table().items()}
    for f, isa in expected.items():
        if isa != "amx":
            assert table[f] == isa


def test_forcing_missing_isa_is_a_clear_error():
    if "amx" in ktcy.available_isas():
        pytest.skip("this machine runs AMX; nothing to refuse")
    r = run_python("import ktcy\ntry:\n    ktcy.kernel_table()\nexcept ktcy.UnsupportedISAError as e:\n"
                   "    print('refused:', e)\n", KTCY_ISA="amx")
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "Available for BF16: ref" in r.stdout and "lacks amx_tile" in r.stdout
    assert issubclass(ktcy.UnsupportedISAError, RuntimeError)


def test_unknown_isa_name_is_a_clear_error_where_it_matters():
    # import still works (ktcy info / ktcy convert must run); choosing a kernel names the variable
    r = run_python("import ktcy\ntry:\n    ktcy.kernels.linear([[1.0]], ktcy.kernels.pack([[1.0]], 'INT8'))\n"
                   "except ValueError as e:\n    print('ERR', e)", KTCY_ISA="avx1024")
    assert r.returncode == 0, r.stderr
    assert "ERR KTCY_ISA='avx1024' is not an ISA name" in r.stdout
    with pytest.raises(ValueError, match="unknown ISA"):
        _native.resolve("INT8", "avx1024")


def test_tile_choices_from_the_environment():
    """KTCY_TILES sets tile choices this CPU would not make (benchmarks measure them so without a
    rebuild); `ktcy info` says which."""
    code = "from ktcy import _native; t = _native.tile_choice(); print(t['plain_fetch_l2'], t['i16_rows'], t['overridden'])"
    r = run_python(code, KTCY_TILES="plain_fetch_l2=0, i16_rows=4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(None, 2) == ["False", "4", "['i16_rows', 'plain_fetch_l2']\n"]
    r = subprocess.run([sys.executable, "-m", "ktcy", "info"], capture_output=True, text=True, cwd="/",
                       env={**os.environ, "KTCY_TILES": "wide_tiles=1"})
    assert r.returncode == 0, r.stderr
    assert "Set by KTCY_TILES (the reasons in brackets are this CPU's): wide_tiles" in r.stdout


@pytest.mark.parametrize("spec, why", [("i16_rows=9", "i16_rows=9: must be an integer in 0..4"),
                                       ("i16_rows=4,f32_rows=-1", "f32_rows=-1: must be an integer in 0..4"),
                                       ("tiles=1", "'tiles' is not a tile choice"),
                                       ("tiles=x", "'tiles' is not a tile choice"),
                                       ("plain_fetch_l2", "'plain_fetch_l2' is not name=value"),
                                       ("wide_tiles=yes", "wide_tiles='yes': must be an integer in 0..1")])
def test_bad_tile_variable_keeps_the_cpus_choices(spec, why):
    """A KTCY_TILES that cannot be honoured whole is dropped whole: a warning at import, `ktcy
    doctor`'s environment problems, and this CPU's own choices."""
    if _native.TILES_OVERRIDDEN:
        pytest.skip("this run's own KTCY_TILES changed the choices the child is compared with")
    code = ("from ktcy import _native, doctor; print(_native.tile_choice() == {**_native.tile_choice(), "
            f"**{_native.tile_choice()!r}, 'overridden': []}}); print(doctor.environment_problems())")
    r = run_python(code, KTCY_TILES=spec)
    assert r.returncode == 0, r.stderr
    same, problems = r.stdout.splitlines()
    assert same == "True"
    assert why in problems and "this CPU's tile choices stay" in problems
    assert why in r.stderr


def test_bad_thread_variable_does_not_break_import():
    r = run_python("import ktcy; print(ktcy.get_num_threads())", KTCY_NUM_THREADS="100000")
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == _native.usable_cpus() and "KTCY_NUM_THREADS=100000" in r.stderr
    r = run_python("import ktcy; print(ktcy.get_num_threads())", KTCY_NUM_THREADS="many")
    assert r.returncode == 0 and "not a whole number" in r.stderr


def test_explicit_isa_the_cpu_lacks_raises():
    missing = [i for i in ("amx", "avx512", "avx2") if i not in ktcy.available_isas()]
    if not missing:
        pytest.skip("every ISA is usable here")
    with pytest.raises(ktcy.UnsupportedISAError, match="cannot run INT8"):
        _native.resolve("INT8", missing[0])


def test_info_json_matches_probe():
    r = subprocess.run([sys.executable, "-m", "ktcy", "info", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["features"] == ktcy.cpu_features()
    assert data["available_isas"] == ktcy.available_isas()
    assert {f: row["isa"] for f, row in data["kernels"].items()} == \
        {f: row["isa"] for f, row in ktcy.kernel_table().items()}


def test_info_text_marks_every_feature():
    r = subprocess.run([sys.executable, "-m", "ktcy", "info"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for feature in LISTED:
        assert f" {feature}" in r.stdout
    assert "INT8" in r.stdout and "Built with" in r.stdout


def test_check_cpu_features_tool():
    tool = REPO / "tools" / "check_cpu_features.py"
    if not tool.exists():
        pytest.skip("tools/ not present (tests run outside the source tree)")
    r = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "AMXINT8" in r.stdout and "FP8" in r.stdout
    assert ("will run on" in r.stdout)
    env = {**os.environ, "KTCY_ISA": "ref"}  # forced below every backend's ideal path: none is ideal
    r = subprocess.run([sys.executable, str(tool), "--json"], capture_output=True, text=True, env=env)
    rows = json.loads(r.stdout)["backends"]
    assert not any(row["ideal"] for row in rows.values()) and {row["isa"] for row in rows.values()} == {"ref"}
    r = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True, env=env)
    assert "✅" not in r.stdout and "fast path" not in r.stdout
    env["KTCY_ISA"] = "bogus"
    r = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True, env=env)
    assert "✅" not in r.stdout and "cannot run" in r.stdout
    # the reader leaving early (`| head -1`) is a quiet exit, as for ktcy's own commands
    p = subprocess.Popen([sys.executable, str(tool)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    assert p.wait(timeout=60) == 1 and b"Traceback" not in p.stderr.read()


def test_threads_setting():
    old = ktcy.get_num_threads()
    try:
        ktcy.set_num_threads(1)
        assert ktcy.get_num_threads() == 1
        with pytest.raises(ValueError):
            ktcy.set_num_threads(0)
    finally:
        ktcy.set_num_threads(old)


def test_tile_choice_follows_the_vendor():
    """cpuid's vendor string picks the few-row tile width and FP8's float rows, with AVX-512 BF16
    MXFP4's few-row path and with AVX-512 F AVX2 INT8's prefill tile, with the family (Zen 4) the
    E2M1 formats' tile width and FP8's prefetch level (registry.h); /proc/cpuinfo says the same."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this system")
    vendors = {line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")}
    if len(vendors) != 1:
        pytest.skip(f"/proc/cpuinfo names {len(vendors)} vendors")
    amd = vendors.pop() in ("AuthenticAMD", "HygonGenuine")
    flags = {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    families = {int(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("cpu family")}
    if len(families) != 1:
        pytest.skip(f"/proc/cpuinfo names {len(families)} CPU families")
    family = families.pop()
    zen4 = amd and family == 0x19 and "avx512f" in flags
    expected = {"amd": amd, "family": family, "one_panel_rows": 4 if amd else 0,
                "e2m1_panel_rows": 2 if zen4 else 0, "f32_rows": 1 if amd else 4,
                "i16_rows": 0 if amd and "avx512_bf16" in flags else 4,
                "avx2_i16_rows": 4,
                "fp8_fetch_l2": zen4, "wide_tiles": amd and "avx512f" in flags,
                "fp8_normal_panels": not amd, "plain_fetch_l2": not amd or "avx512f" in flags}
    expected.update(_native.TILES_OVERRIDDEN)  # a KTCY_TILES in this run's environment
    expected["overridden"] = sorted(_native.TILES_OVERRIDDEN)
    assert _native.tile_choice() == expected
    from ktcy import report
    assert report.info()["tiles"] == _native.tile_choice()  # what `ktcy info` shows
