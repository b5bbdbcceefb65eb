"""bench_afd's co-run solo round records the background replicas' pace.

- The tool on the host backend at its tiny size (a subprocess into a temporary folder): every
  co-run row carries one ``background`` entry per other replica, timed over that row's window,
  and the summary prints the co-run table.
- In-process: which background batches count (only those wholly inside the window), their
  statistics on synthetic spans with known answers, and that the raw spans leave the rows.
Numbers are not checked beyond consistency: benchmarks are tools, not tests.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from helpers.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import bench_afd  # noqa: E402

MS = 1_000_000  # ns


@pytest.mark.timeout(150)
def test_bench_afd_corun_round_records_the_background_pace_host(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), AFD_BACKEND="host")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_afd.py"), "--quick", "--backend", "host",
                           "--schedules", "async", "--workloads", "skewed", "--duration", "0.3",
                           "--solo-duration", "0.3", "--warmup", "1", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, f"bench_afd failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "bench_afd.json").read_text())
    layers = report["model"]["layers"]
    (row,) = report["results"]
    ranks = [rep["rank"] for rep in row["replicas"]]
    assert ranks == [0, 1]
    for rep in row["replicas"]:
        solo = rep["solo"]
        assert "background_ns" not in solo  # the raw spans stay out of the JSON
        corun = solo["corun"]
        # the fields the planner already reads are still there
        assert corun["batches"] >= 3 and corun["batch_mean_ms"] > 0 and corun["ffn"]["items_per_s"] > 0
        (bg,) = corun["background"]
        assert bg["rank"] == 1 - rep["rank"]
        # timed over the co-run row's own window: same length, every counted batch inside it
        assert bg["window_s"] == corun["elapsed_s"]
        window_ms = bg["window_s"] * 1e3
        assert bg["batches"] > 0 and bg["layers"] == bg["batches"] * layers
        assert 0 <= bg["first_begin_ms"] < bg["last_end_ms"] <= window_ms, bg
        assert 0 < bg["batch_p10_ms"] <= bg["batch_median_ms"] <= bg["batch_p90_ms"], bg
        assert bg["layer_mean_ms"] == pytest.approx(bg["batch_mean_ms"] / layers)
        # the batches' total time fits in the window and in the span from the first to the last
        busy_ms = bg["covered_fraction"] * window_ms
        assert busy_ms == pytest.approx(bg["batches"] * bg["batch_mean_ms"])
        assert 0 < busy_ms <= bg["last_end_ms"] - bg["first_begin_ms"] + 1e-6
    assert "co-run replica" in proc.stdout and "bg ms/layer" in proc.stdout
    assert "corun_background" in report["method"]


def _attn_result(rank: int, corun_window, background_ns) -> dict:
    solo = {"window_ns": (0, 1), "corun": {"window_ns": corun_window}, "background_ns": background_ns}
    return {"role": "attention", "rank": rank, "phases": [{"solo": solo}]}


def test_background_pace_counts_only_the_batches_inside_the_window():
    window = (100 * MS, 200 * MS)
    spans = [(90 * MS, 101 * MS),  # cut by the window's start: dropped
             (101 * MS, 103 * MS), (104 * MS, 108 * MS), (110 * MS, 111 * MS), (120 * MS, 130 * MS),
             (195 * MS, 201 * MS),  # cut by its end: dropped
             (250 * MS, 260 * MS)]  # another replica's turn: dropped
    pace = bench_afd.background_pace(spans, window, layers=2)
    assert pace["batches"] == 4 and pace["layers"] == 8 and pace["window_s"] == pytest.approx(0.1)
    # durations 2, 4, 1, 10 ms: nearest-rank p10 = 1, p90 = 10; median 3; mean 4.25
    assert (pace["batch_p10_ms"], pace["batch_median_ms"], pace["batch_p90_ms"]) == (1.0, 3.0, 10.0)
    assert pace["batch_mean_ms"] == pytest.approx(4.25) and pace["layer_mean_ms"] == pytest.approx(2.125)
    assert pace["covered_fraction"] == pytest.approx(17 / 100)
    assert (pace["first_begin_ms"], pace["last_end_ms"]) == (1.0, 30.0)
    # nothing inside: NaN statistics and no batch, never a made-up number
    empty = bench_afd.background_pace([(0, 300 * MS)], window, layers=2)
    assert empty["batches"] == 0 and empty["layers"] == 0 and empty["covered_fraction"] == 0
    assert all(math.isnan(empty[k]) for k in ("batch_median_ms", "batch_p10_ms", "batch_p90_ms", "batch_mean_ms",
                                              "layer_mean_ms", "first_begin_ms", "last_end_ms"))


def test_corun_background_gives_each_turn_the_others_batches_in_its_window():
    # replica 0's co-run turn 0-100 ms, replica 1's 200-300 ms; each runs background in the other's
    r0 = _attn_result(0, (0, 100 * MS), [(210 * MS, 220 * MS), (220 * MS, 240 * MS)])
    r1 = _attn_result(1, (200 * MS, 300 * MS), [(10 * MS, 15 * MS), (20 * MS, 25 * MS), (30 * MS, 35 * MS)])
    bench_afd.corun_background([r1, r0], 0, layers=5)
    bg0 = r0["phases"][0]["solo"]["corun"]["background"]
    bg1 = r1["phases"][0]["solo"]["corun"]["background"]
    assert [(b["rank"], b["batches"], b["layers"]) for b in bg0] == [(1, 3, 15)]
    assert bg0[0]["batch_mean_ms"] == pytest.approx(5.0) and bg0[0]["layer_mean_ms"] == pytest.approx(1.0)
    assert [(b["rank"], b["batches"]) for b in bg1] == [(0, 2)] and bg1[0]["batch_median_ms"] == pytest.approx(15.0)
    for r in (r0, r1):
        assert "background_ns" not in r["phases"][0]["solo"]
    # a replica without a co-run row (a report of one replica, or --solo-background none) gets nothing
    alone = {"role": "attention", "rank": 0, "phases": [{"solo": {"window_ns": (0, 1)}}]}
    bench_afd.corun_background([alone], 0, layers=5)
    assert alone["phases"][0]["solo"] == {"window_ns": (0, 1)}
