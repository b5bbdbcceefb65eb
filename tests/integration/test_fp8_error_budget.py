"""tools/fp8_error_budget.py keeps working: run in-process at its tiny shape on the CPU; the
JSON's fields, the metrics on known answers, and the ordering every run must show (bf16
serving far closer to the checkpoint than any FP8 path; the conversion alone closer than the
conversion with quantized activations)."""
import json
import sys

import pytest
import torch

from helpers.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import fp8_error_budget  # noqa: E402


def test_metrics_on_known_answers():
    y = torch.tensor([3.0, -1.0, 2.0])
    assert fp8_error_budget.calc_diff(y, y) == pytest.approx(0.0, abs=1e-15)
    assert fp8_error_budget.calc_diff(2 * y, y) == pytest.approx(0.2)  # 1 - 2*2/(4+1)
    assert fp8_error_budget.calc_diff(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == pytest.approx(1.0)
    assert fp8_error_budget.rel_l2(1.5 * y, y) == pytest.approx(0.5)


def test_tiny_run_writes_every_path_against_both_references(tmp_path):
    assert fp8_error_budget.main(["--shapes", "tiny", "--experts", "3", "--rows", "24", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "fp8_error_budget.json").read_text())
    assert report["deepep_calc_diff"] == 7e-4 and len(report["results"]) == 2
    for result in report["results"]:
        assert sum(result["counts"]) == 24 and set(result["paths"]) == set(fp8_error_budget.PATHS)
        paths = result["paths"]
        for path in paths.values():
            assert set(path) == {"calc_diff_ckpt", "rel_l2_ckpt", "calc_diff_orig", "rel_l2_orig"}
            assert path["calc_diff_ckpt"] == pytest.approx(path["rel_l2_ckpt"] ** 2 / 2, rel=0.2)
        assert paths["bf16"]["rel_l2_ckpt"] < 0.01
        assert paths["rowwise_weights"]["rel_l2_ckpt"] < paths["afd_fp8"]["rel_l2_ckpt"] < 0.15
        assert 0.01 < paths["block_recipe"]["rel_l2_ckpt"] < 0.15
