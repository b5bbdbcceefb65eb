"""bench_corun (co-run slowdown on one GPU) keeps working and computes what it claims.

- The tool at its toy size on the host backend (a subprocess into a temporary folder): exit
  code, one row per rank with iterations in both phases, slowdown = together mean / alone mean.
- In-process: the together window keeps only the iterations every rank overlapped, and the
  workload parser's errors.
Numbers are never checked beyond sanity: benchmarks are tools, not tests.
"""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import bench_corun  # noqa: E402


@pytest.mark.timeout(240)
def test_bench_corun_quick_host(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), AFD_BACKEND="host")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_corun.py"), "--quick", "--backend", "host",
                           "--duration", "0.3", "--alone-duration", "0.2", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"bench_corun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "bench_corun.json").read_text())
    assert report["backend"] == "host" and "HOST BACKEND" in report["label"]
    [case] = report["cases"]
    assert case["case"] == bench_corun.HOST_CASES[0]
    assert [r["workload"] for r in case["rows"]] == case["case"].split(",")
    for row in case["rows"]:
        assert row["alone_iters"] >= 5 and row["together_iters"] >= 1, row
        assert 0 < row["alone_p50_ms"] and 0 < row["together_p50_ms"], row
        assert row["slowdown"] == pytest.approx(row["together_mean_ms"] / row["alone_mean_ms"])
    assert "bench_corun summary" in proc.stdout and "slowdown" in proc.stdout


def test_case_rows_keep_the_iterations_every_rank_overlapped():
    ms = 1_000_000
    # rank 0 runs together from 0 to 100 ms in 10 ms iterations; rank 1 from 25 to 75 ms in 5 ms ones
    r0 = {"rank": 0, "workload": "attn:8", "alone": [(0, 5 * ms), (5 * ms, 10 * ms)],
          "together": [(i * 10 * ms, (i + 1) * 10 * ms) for i in range(10)]}
    r1 = {"rank": 1, "workload": "experts", "alone": [(0, 4 * ms)] * 3,
          "together": [(25 * ms + i * 5 * ms, 30 * ms + i * 5 * ms) for i in range(10)]}
    rows = bench_corun.case_rows([r1, r0])
    assert [r["rank"] for r in rows] == [0, 1]
    # the common window is 25..75 ms: rank 0's iterations 30-40, 40-50, 50-60, 60-70 lie inside it
    assert rows[0]["together_iters"] == 4 and rows[0]["together_mean_ms"] == pytest.approx(10.0)
    assert rows[0]["alone_mean_ms"] == pytest.approx(5.0) and rows[0]["slowdown"] == pytest.approx(2.0)
    assert rows[1]["together_iters"] == 10 and rows[1]["slowdown"] == pytest.approx(5.0 / 4.0)
    # no iteration inside the window: NaN, never a made-up number
    lone = {"rank": 2, "workload": "experts", "alone": [(0, ms)], "together": [(0, 90 * ms)]}
    rows = bench_corun.case_rows([r0, r1, lone])
    assert all(math.isnan(rows[2][k]) for k in ("together_mean_ms", "together_p50_ms", "slowdown"))
    assert np.isfinite(rows[0]["slowdown"])


def test_workloads_parse_or_name_the_bad_text():
    assert bench_corun.parse_workload("attn:32768") == ("attn", 32768)
    assert bench_corun.parse_workload("experts") == ("experts", 0)
    for bad in ("attn", "attn:0", "attn:x", "experts:3", "ffn"):
        with pytest.raises(ValueError, match=bad.replace(":", ":")):
            bench_corun.parse_workload(bad)
    with pytest.raises(SystemExit, match="attn:-1"):
        bench_corun.main(["--backend", "host", "--cases", "attn:-1,experts", "--out", "/nonexistent"])
