"""tools/bench_stream_gemm.py on the CPU: its sweep, report arithmetic and targets on synthetic
numbers with known answers, its refusal without a GPU, and a whole run at the tiny shape in
Triton's interpreter (every config checked against the current path before it is timed; the
times say nothing). The GPU run is tools/gpu_suite.sh stream1."""
import importlib.util
import json
import sys

import pytest

from helpers.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import bench_stream_gemm as bsg  # noqa: E402


def test_sweep_is_the_product_of_the_tiles():
    args = bsg.parse_args(["--block-n", "32", "64", "--block-k", "128", "--stages", "3", "4"])
    sweep = bsg.configs(args)
    assert list(sweep) == ["n32/k128/w4/s3", "n32/k128/w4/s4", "n64/k128/w4/s3", "n64/k128/w4/s4"]
    assert all(bsg.label(c) == name for name, c in sweep.items())
    with pytest.raises(ValueError, match="block_n"):
        bsg.configs(bsg.parse_args(["--block-n", "48"]))
    assert bsg.parse_args(["--quick"]).tokens == [32, 128]
    rows = bsg.configs(bsg.parse_args(["--block-n", "64", "--block-k", "64", "--stages", "3", "--block-m", "auto", "128"]))
    assert list(rows) == ["n64/k64/w4/s3", "n64/k64/w4/s3/m128"] and rows["n64/k64/w4/s3/m128"].block_m == 128
    with pytest.raises(SystemExit):
        bsg.parse_args(["--block-m", "big"])
    with pytest.raises(ValueError, match="block_m"):
        bsg.configs(bsg.parse_args(["--block-m", "96"]))


def test_row_report_arithmetic():
    floor = {"routed_floor_us": 100.0, "experts_hit": 64, "routed_bytes": 1, "layer_bytes": 1, "layer_floor_us": 1}
    default = bsg.label(bsg._default())
    sweep = {default: {"median_us": 150.0}, "b": {"median_us": 125.0}, "c": {"error": "does not compile"}}
    fp8 = {"default": {"median_us": 80.0, "rel_err": 0.03}, "best": {"median_us": 70.0, "rel_err": 0.031}}
    row = bsg.row_report(128, floor, 200.0, sweep, "b", fp8)
    assert row["current_floor_fraction"] == pytest.approx(0.5)
    assert row["stream_default_us"] == 150.0 and row["stream_best_us"] == 125.0
    assert row["stream_best_floor_fraction"] == pytest.approx(0.8)
    assert row["stream_over_current"] == pytest.approx(1.6)
    assert row["fp8_us"] == 70.0 and row["fp8_rel_err"] == pytest.approx(0.03)
    assert row["fp8_floor_fraction"] == pytest.approx(50 / 70)  # E4M3: half the bytes
    assert row["fp8_over_bf16_stream"] == pytest.approx(125 / 70)
    assert row["fp8_over_current"] == pytest.approx(200 / 70)
    (floor_target, fp8_target) = bsg.targets({"v2lite": {"rows": [row]}})
    assert floor_target["status"] == "MISS" and fp8_target["status"] == "PASS"
    assert row["dense_tflops"] is None and row["current_over_dense"] is None  # decode: no dense pair
    prefill = bsg.row_report(4096, floor, 5000.0, {"b": {"median_us": 4000.0}}, "b", {}, flops=2e9, dense_tflops=0.8)
    assert prefill["current_tflops"] == pytest.approx(0.4) and prefill["stream_best_tflops"] == pytest.approx(0.5)
    assert prefill["current_over_dense"] == pytest.approx(0.5) and prefill["stream_best_over_dense"] == pytest.approx(0.625)
    dense_target = bsg.targets({"v3": {"rows": [prefill]}})[-1]
    assert "prefill 4096" in dense_target["name"] and dense_target["status"] == "MISS"
    nothing = bsg.row_report(128, floor, 200.0, {"c": {"error": "x"}}, None, {})
    assert nothing["stream_best_us"] is None and nothing["fp8_us"] is None
    assert {t["status"] for t in bsg.targets({"v3": {"rows": [nothing]}})} == {"NOT MEASURED"}
    assert "error" in bsg.sweep_table({"rows": [nothing]}) and "128" in bsg.table({"rows": [row]})


def test_refuses_without_a_gpu(capsys):
    if bsg.bc.num_visible_gpus():
        pytest.skip("a GPU is visible")
    assert bsg.main(["--quick"]) == 2
    assert "needs a GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bsg.parse_args(["--device", "cpu", "--shapes", "v2lite"])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(240)
def test_tiny_run_in_the_interpreter(tmp_path, capsys):
    from afd_cupy.moe import stream_gemm

    if stream_gemm.unavailable_reason("cpu") is not None:  # an interpreter this numpy breaks
        pytest.skip(stream_gemm.unavailable_reason("cpu"))
    argv = ["--device", "cpu", "--quick", "--tokens", "1", "4", "--block-n", "16", "32", "--block-k", "16",
            "--stages", "3", "--iters", "2", "--warmup", "1", "--out", str(tmp_path)]
    assert bsg.main(argv) == 0
    report = json.loads((tmp_path / "bench_stream_gemm.json").read_text())
    (tiny,) = report["shapes"].values()
    assert [r["tokens"] for r in tiny["rows"]] == [1, 4]
    for row in tiny["rows"]:
        assert set(row["sweep"]) == {"n16/k16/w4/s3", "n32/k16/w4/s3"}
        assert all("median_us" in v and v["rel_err"] <= bsg.CHECK_TOL for v in row["sweep"].values()), row["sweep"]
        assert row["best_config"] in row["sweep"] and row["current_us"] > 0
        assert set(row["fp8"]) == {"default", "best"} and 1e-3 < row["fp8_rel_err"] <= bsg.FP8_CHECK_TOL
    assert "the sweep, bf16" in capsys.readouterr().out
