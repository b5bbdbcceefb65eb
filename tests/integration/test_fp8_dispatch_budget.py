"""tools/fp8_dispatch_budget.py keeps working: run in-process at a tiny shape on the CPU (host
backend); the JSON's fields, the decode shape's bytes, and what every run must show (FP8 rows
within DeepEP's calc_diff bar, the FP8 layer further from the reference than bf16)."""
import json
import sys

import pytest

from helpers.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import fp8_dispatch_budget  # noqa: E402


def test_decode_shape_bytes():
    b = fp8_dispatch_budget.wire_bytes(7168, 8)
    assert b["payload"]["row_bytes"] == 14336 and b["fp8_e4m3"]["row_bytes"] == 7168 + 56 * 4
    # a routed partial carries its 8-B (token, top-k slot) route entry, a shared row a 4-B index
    assert b["fp8_e4m3"]["routed_partial_bytes"] == 7400 and b["payload"]["routed_partial_bytes"] == 14344
    assert b["fp8_e4m3"]["shared_row_bytes"] == 7396
    assert b["fp8_e4m3"]["reply_row_bytes"] == b["payload"]["reply_row_bytes"] == 14336  # bf16 replies


def test_tiny_run(tmp_path):
    argv = ["--hidden", "256", "--rows", "16", "--e2e-hidden", "128", "--e2e-tokens", "12",
            "--e2e-layers", "1", "--out", str(tmp_path)]
    assert fp8_dispatch_budget.main(argv) == 0
    report = json.loads((tmp_path / "fp8_dispatch_budget.json").read_text())
    assert [r["distribution"] for r in report["rows"]] == list(fp8_dispatch_budget.DISTRIBUTIONS)
    for rows in report["rows"]:
        assert 0 < rows["calc_diff"] < report["deepep_calc_diff"]
        assert rows["calc_diff"] == pytest.approx(rows["rel_l2"] ** 2 / 2, rel=0.2)
    (layer,) = report["e2e"]["layers"]
    assert layer["rel_l2_bf16_vs_ref"] < 0.01 < layer["rel_l2_fp8_vs_ref"] < 0.08
    assert 0 < layer["calc_diff_fp8_vs_bf16"] < 2e-3
