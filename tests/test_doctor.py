"""`ktcy doctor`: every field present in --json, read from this host, and the text report."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ktcy
from ktcy import _native, doctor

FIELDS = {
    "versions": {"ktcy", "numpy", "python", "python_implementation", "platform", "extension", "built_with", "cc"},
    "memory": {"total_bytes", "available_bytes", "free_bytes"},
    "huge_pages": {"hugepages_total", "hugepages_free", "hugepage_size_bytes", "thp_enabled", "thp_defrag"},
    "cpu": {"model", "logical_cpus", "usable_cpus", "governor", "smt_active", "smt_control", "threads_per_core",
            "ktcy_threads"},
    "amx": {"cpu_has_amx", "os_enables_amx", "permission_requested", "permission_granted", "enabled_by_policy"},
}


def doctor_json(*env):
    r = subprocess.run([sys.executable, "-m", "ktcy", "doctor", "--json"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **dict(env)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_field_is_present():
    d = doctor_json()
    assert set(d) == set(FIELDS) | {"numa", "features", "available_isas", "build", "environment",
                                    "environment_problems", "kernels", "backends", "advice"}
    for section, keys in FIELDS.items():
        assert set(d[section]) == keys, section
    assert set(d["versions"]["cc"]) == {"command", "path", "version"}
    for node in d["numa"]:
        assert set(node) == {"node", "cpus", "memory_total_bytes", "memory_free_bytes"}
    assert set(d["kernels"]) == set(ktcy.FORMATS)
    for row in d["kernels"].values():
        assert set(row) == {"isa", "variant", "reason", "faster_options"}
    assert set(d["backends"]) >= {"AMXINT8", "AMXBF16", "FP8", "INT8", "BF16"}
    assert isinstance(d["advice"], list)


def test_values_match_this_host():
    d = doctor_json()
    v = d["versions"]
    assert v["ktcy"] == ktcy.__version__ and v["numpy"] == np.__version__
    assert v["python"] == "%d.%d.%d" % sys.version_info[:3]
    assert d["features"] == _native.cpu_features()
    assert d["memory"]["total_bytes"] >= d["memory"]["available_bytes"] > 0
    assert d["cpu"]["usable_cpus"] == len(os.sched_getaffinity(0))
    if os.path.isdir("/sys/devices/system/node/node0"):
        cpus = sorted(c for n in d["numa"] for c in n["cpus"])
        assert set(os.sched_getaffinity(0)) <= set(cpus)
    amx = d["amx"]
    assert amx["permission_granted"] == _native.cpu_features()["amx_permitted"]
    assert amx["permission_requested"] or not amx["permission_granted"]
    for fmt, row in d["kernels"].items():
        assert (row["isa"], row["variant"]) == _native.resolve(fmt)
        for option in row["faster_options"]:  # each names a faster path and why it is not taken
            assert option["why_not"] and ("isa" in option or "variant" in option)


def test_why_not_a_faster_kernel_is_explained():
    d = doctor_json()
    if "amx" not in _native.available_isas():
        for fmt in ("INT8", "BF16"):
            assert any(o.get("isa") == "amx" for o in d["kernels"][fmt]["faster_options"])
    d = doctor_json(("KTCY_ISA", "avx2"))
    assert d["environment"]["KTCY_ISA"] == "avx2"
    assert all(row["isa"] == "avx2" for row in d["kernels"].values())
    if "avx512" in _native.available_isas():
        assert {"isa": "avx512", "why_not": "KTCY_ISA=avx2 forces avx2"} in d["kernels"]["INT8"]["faster_options"]


def test_cpulist_parsing():  # doctor reads and writes CPU lists through numa's helpers
    assert doctor.parse_cpulist("0-3,8,10-11\n", "x") == (0, 1, 2, 3, 8, 10, 11)
    assert doctor.parse_cpulist("", "x") == ()
    assert doctor.cpulist_text([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_text_report():
    r = subprocess.run([sys.executable, "-m", "ktcy", "doctor"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for heading in ("ktcy ", "numpy", "Memory:", "Huge pages:", "NUMA:", "AMX:", "Frequency governor:",
                    "Kernel per format:", "KTransformers backends:"):
        assert heading in r.stdout


def test_mxfp4_a8_is_advised_where_mxfp4_has_no_bf16_dot_product():
    """Forced to AVX2 (as on an AVX2-only host) the advice names MXFP4_A8; where MXFP4 runs on
    AVX-512 or AMX it does not."""
    if "avx2" not in ktcy.available_isas():
        pytest.skip("no AVX2 on this host")
    forced = doctor_json(("KTCY_ISA", "avx2"))
    assert forced["kernels"]["MXFP4"]["isa"] == "avx2"
    assert any("MXFP4_A8" in note for note in forced["advice"])
    auto = doctor_json()
    if auto["kernels"]["MXFP4"]["isa"] in ("avx512", "amx"):
        assert not any("MXFP4_A8" in note for note in auto["advice"])


def test_a_backend_on_amx_is_ideal_where_amx_is_its_faster_path(monkeypatch):
    """INT8/BF16's ideal path is AVX-512; on an AMX host the policy picks AMX, which is better,
    not a fallback."""
    from ktcy import report
    monkeypatch.setattr(report._native, "cpu_features", lambda: {f: True for f in report.ISA_FEATURES + report.OS_STATE})
    monkeypatch.setattr(report._native, "resolve", lambda fmt, isa=None: ("amx", f"amx_{fmt.lower()}"))
    rows = report.backend_readiness()
    assert all(row["ideal"] for row in rows.values()), rows
    monkeypatch.setattr(report._native, "resolve", lambda fmt, isa=None: ("avx2", f"{fmt.lower()}_avx2"))
    assert not any(row["ideal"] for row in report.backend_readiness().values())
