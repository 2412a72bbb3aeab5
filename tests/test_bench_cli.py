"""`ktcy bench` end to end on a small layer: rows, fresh routings, the closing summary, the plot."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ktcy import _native, bench, roofline


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
        assert isinstance(peak["reliable"], bool)


def test_bench_rows_on_a_custom_shape():
    data = json.loads(run_ktcy("bench", "--shape", "256,128,6,2", "--formats", "INT8,FP8", "--tokens", "1,3",
                               "--threads", "1", "--json").stdout)
    assert data["shape"]["hidden"] == 256 and data["shape"]["experts"] == 6
    assert [(r["format"], r["tokens"]) for r in data["rows"]] == [
        ("INT8", 1), ("INT8", 3), ("FP8_BLOCK", 1), ("FP8_BLOCK", 3)]
    for r in data["rows"]:
        assert r["median_ms"] > 0 and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["weight_gbs"] > 0 and r["bandwidth_pct"] > 0 and r["tokens_per_s"] > 0
        assert r["routings"] == r["runs"] + 1  # one drawn per call, warm-up included
        assert 1 < r["distinct_routings"] <= r["routings"]  # 6 experts, top 2: draws may repeat by chance
    assert any(line.startswith("Best format for decode here:") for line in data["summary"])


def test_named_shapes_are_listed_and_fit_every_format():
    """--help names every built-in shape, and each one's layer configuration is valid in every
    format (checked before any weight is drawn)."""
    help_text = run_ktcy("bench", "--help").stdout
    for name, (H, I, E, k, _) in bench.SHAPES.items():
        assert name in help_text, name
        bench.check_shape(H, I, E, k, bench.DEFAULT_FORMATS)


def test_text_output_has_header_legend_and_summary():
    r = run_ktcy("bench", "--shape", "128,64,4,2", "--formats", "BF16", "--tokens", "2", "--isa", "ref")
    out = r.stdout
    assert "Roofline" in out
    assert bench.HEADER in out and "[p10-p90]: the 10th-90th percentile" in out
    row = next(line for line in out.splitlines() if line.startswith("BF16"))
    assert row.split()[1] == "ref" and row.split()[2] == "2"
    assert "Best format for decode here: BF16" in out
    # progress goes to stderr, one line per step, even though stderr is a pipe here
    assert "packing BF16: 4/4 expert" in r.stderr and "packed BF16" in r.stderr
    assert "\r" not in r.stderr


def test_quiet_bench_prints_no_progress():
    r = run_ktcy("bench", "-q", "--shape", "128,64,4,2", "--formats", "INT8", "--tokens", "1")
    assert r.stderr == "" and "INT8" in r.stdout


class _Recorder:
    """A layer stand-in that records the routing of every call."""

    def __init__(self):
        self.ids = []

    def forward(self, x, ids, w):
        self.ids.append(np.array(ids))


def test_every_call_gets_a_fresh_routing():
    rng = np.random.default_rng(1)
    layer = _Recorder()
    times, used = bench.time_forward(layer, None, lambda: bench.draw_routing(rng, 4, 64, 8), None,
                                     min_seconds=0, min_reps=20, max_reps=20)
    assert len(layer.ids) == 21 and len(times) == 20
    assert bench.distinct_routings(layer.ids) == 21
    assert all(np.array_equal(a, b) for a, b in zip(layer.ids, used))
    for ids in layer.ids:  # k distinct experts per token, all in range
        assert ids.shape == (4, 8) and all(len(set(row)) == 8 for row in ids) and ids.max() < 64


def test_default_and_full_token_counts():
    assert bench.DEFAULT_TOKENS == (1, 32, 512)
    assert set(bench.DEFAULT_TOKENS) < set(bench.FULL_TOKENS)


def test_summary_and_the_note_on_rows_over_the_bandwidth():
    rows = [dict(format="INT8", isa="avx512", tokens=1, median_ms=1.0, tokens_per_s=1000.0, weight_gbs=30.0,
                 read_bw_gbs=40.0, bandwidth_pct=75.0, gflops=10.0, peak="avx512_vnni", peak_pct=1.0,
                 layer_bytes=2**40),
            dict(format="BF16", isa="avx512", tokens=1, median_ms=2.0, tokens_per_s=500.0, weight_gbs=20.0,
                 read_bw_gbs=40.0, bandwidth_pct=50.0, gflops=5.0, peak="avx512_bf16", peak_pct=0.5,
                 layer_bytes=2**40)]
    assert bench.over_bandwidth_note(rows) is None
    text = bench.summary(rows)
    assert text[0] == ("Decode (T=1) reads weights at up to 75% of the read bandwidth measured beside it "
                       "(INT8, 30.0 of 40.0 GB/s).")
    assert text[-1].startswith("Best format for decode here: INT8")
    prefill = [dict(r, tokens=512, peak_pct=60.0 - i, gflops=900.0, median_ms=10.0 + i) for i, r in enumerate(rows)]
    text = bench.summary(rows + prefill)
    assert text[1] == "Prefill (T=512) reaches up to 60% of the multiply-add peak (INT8: 900 GFLOP/s against avx512_vnni)."
    assert text[2] == ("Best format for decode here: INT8 (1.00 ms per layer call, 1000 tokens/s); "
                       "for prefill: INT8 (1000 tokens/s).")
    text = bench.summary(prefill)  # a prefill run alone is not called decode
    assert len(text) == 2 and text[0].startswith("Prefill (T=512)") and text[1].startswith("Best format for prefill")
    rows[1].update(bandwidth_pct=120.0, layer_bytes=2**20)  # a layer the cache holds
    note = bench.over_bandwidth_note(rows)
    assert note.startswith("1 row(s) read weights faster") and ("cache holds part of it" in note
                                                               or not roofline.llc_bytes())


def test_rows_are_set_against_passes_taken_between_their_calls():
    rng = np.random.default_rng(2)
    layer, order = _Recorder(), []
    layer.forward = lambda x, ids, w: order.append("call")
    times, used = bench.time_forward(layer, None, lambda: bench.draw_routing(rng, 1, 8, 2), None,
                                     min_seconds=0, min_reps=6, max_reps=6, between=lambda: order.append("pass"))
    assert order == ["call"] + ["pass", "call"] * 6  # the warm-up call, then a pass before every timed one
    data = json.loads(run_ktcy("bench", "--shape", "256,128,4,2", "--formats", "BF16", "--tokens", "1",
                               "--threads", "1", "--json").stdout)
    (row,) = data["rows"]
    assert row["read_bw_gbs"] > 0.1
    assert row["bandwidth_pct"] == pytest.approx(100 * row["weight_gbs"] / row["read_bw_gbs"])
    assert row["bandwidth_pct_of_startup_probe"] == pytest.approx(
        100 * row["weight_gbs"] / data["roofline"]["read_bandwidth_gbs"])


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    run_ktcy("bench", "-q", "--shape", "128,64,4,2", "--formats", "INT8,BF16", "--tokens", "1,8",
             "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    run_ktcy("bench", "-q", "--shape", "128,64,4,2", "--formats", "INT8", "--tokens", "1", "--plot", str(png))
    assert os.listdir(tmp_path) == ["bench.png"]  # an earlier plot replaced, no temporary file left
    notes = tmp_path / "notes.png"
    notes.write_text("mine")
    r = subprocess.run([sys.executable, "-m", "ktcy", "bench", "--shape", "128,64,4,2", "--plot", str(notes)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "is not a PNG file" in r.stderr
    assert notes.read_text() == "mine"


def test_plot_without_matplotlib_is_one_clear_line(tmp_path):
    # a stub that makes `import matplotlib` fail, first on the path
    (tmp_path / "matplotlib.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {"PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "ktcy", "bench", "--shape", "128,64,4,2", "--plot",
                        str(tmp_path / "x.png")], capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["ktcy: error: --plot needs matplotlib: pip install 'ktcy[plot]' "
                                             "(or pip install matplotlib)"]
