"""`ktcy bench` end to end on a small layer, and the roofline probes."""
import json
import subprocess
import sys

import pytest

from ktcy import _native, bench


def run_ktcy(*args):
    r = subprocess.run([sys.executable, "-m", "ktcy", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


def test_roofline_json_has_bandwidth_and_peaks():
    data = json.loads(run_ktcy("bench", "--roofline", "--json").stdout)
    assert data["read_bandwidth_gbs"] > 0.1
    assert set(data["peaks"]) == set(_native.peak_names())
    for peak in data["peaks"].values():
        assert peak["value"] > 0 and peak["unit"] in ("GFLOP/s", "GOP/s")


def test_bench_rows_on_a_custom_shape():
    data = json.loads(run_ktcy("bench", "--shape", "256,128,6,2", "--formats", "INT8,FP8", "--tokens", "1,3",
                               "--threads", "1", "--json").stdout)
    assert data["shape"]["hidden"] == 256 and data["shape"]["experts"] == 6
    assert [(r["format"], r["tokens"]) for r in data["rows"]] == [
        ("INT8", 1), ("INT8", 3), ("FP8_BLOCK", 1), ("FP8_BLOCK", 3)]
    for r in data["rows"]:
        assert r["median_ms"] > 0 and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["weight_gbs"] > 0 and r["bandwidth_pct"] > 0 and r["tokens_per_s"] > 0


def test_bench_text_output_and_forced_isa():
    out = run_ktcy("bench", "--shape", "128,64,4,2", "--formats", "BF16", "--tokens", "2", "--isa", "ref").stdout
    assert "Roofline" in out and "BF16" in out and " ref " in out and "T=2" in out


def test_bad_bench_arguments():
    r = subprocess.run([sys.executable, "-m", "ktcy", "bench", "--tokens", "1,x"], capture_output=True, text=True)
    assert r.returncode == 2 and "--tokens" in r.stderr
    with pytest.raises(ValueError, match="H,I,E,k"):
        bench.parse_shape("big")
