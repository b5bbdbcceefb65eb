"""tools/bench_stream_gemm.py on the CPU: its sweep, report arithmetic and targets on synthetic
numbers with known answers, and its refusal without a GPU (it times nothing on the CPU; the
GPU run is tools/gpu_suite.sh moe1)."""
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
    nothing = bsg.row_report(128, floor, 200.0, {"c": {"error": "x"}}, None, {})
    assert nothing["stream_best_us"] is None and nothing["fp8_us"] is None
    assert {t["status"] for t in bsg.targets({"v3": {"rows": [nothing]}})} == {"NOT MEASURED"}
    assert "error" in bsg.sweep_table({"rows": [nothing]}) and "128" in bsg.table({"rows": [row]})


def test_refuses_without_a_gpu(capsys):
    if bsg.bc.num_visible_gpus():
        pytest.skip("a GPU is visible")
    assert bsg.main(["--quick"]) == 2
    assert "needs a GPU" in capsys.readouterr().out
