"""afd_cupy.testing.gemm_check on the CPU: right GEMMs pass, a GEMM that leaves tiles unwritten
or returns NaN on reused memory fails, and the failure line names the shape and the share."""
import pytest
import torch
import torch.nn.functional as F

from afd_cupy.testing.gemm_check import check_gemms, describe_failure

SHAPES = [(8, 48, 32), (1, 16, 64)]


def test_torch_linear_on_cpu_passes():
    report = check_gemms(SHAPES, "cpu", dtype="float32")
    assert report["ok"], report
    assert [(r["m"], r["n"], r["k"]) for r in report["results"]] == SHAPES
    assert all(r["rel_err"] < 1e-5 and r["nan"] == 0 for r in report["results"])


def test_bf16_linear_on_cpu_passes_within_tolerance():
    assert check_gemms(SHAPES, "cpu")["ok"]


def test_unwritten_tiles_fail(monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30")

    def missing_tile(x, w):  # the second column block never written (zeros)
        y = F.linear(x, w)
        y[:, y.shape[1] // 2:] = 0
        return y

    report = check_gemms([(8, 48, 32)], "cpu", dtype="float32", linear=missing_tile)
    assert not report["ok"] and report["mps_share_pct"] == 30
    assert report["results"][0]["rel_err"] > 0.3
    line = describe_failure(report)
    assert "8x32->48" in line and "MPS share 30%" in line


def test_nan_on_second_product_fails():
    calls = []

    def nan_on_reuse(x, w):
        calls.append(1)
        y = F.linear(x, w)
        if len(calls) == 2:
            y[0, 0] = float("nan")
        return y

    report = check_gemms([(4, 8, 16)], "cpu", dtype="float32", linear=nan_on_reuse)
    assert not report["ok"] and report["results"][0]["nan"] == 1 and len(calls) == 2


@pytest.mark.parametrize("shape", [(0, 4, 4), (4, 4), (4, 4.0, 4)])
def test_bad_shape_is_named(shape):
    with pytest.raises(ValueError, match="GEMM shape"):
        check_gemms([shape], "cpu")


def test_bad_dtype_is_named():
    with pytest.raises(ValueError, match="int8"):
        check_gemms(SHAPES, "cpu", dtype="int8")
