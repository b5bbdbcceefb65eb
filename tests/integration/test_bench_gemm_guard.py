"""The benchmarks' guard against wrong torch GEMMs (bench_common.require_correct_gemms) and the
bench_decode placements that stay clear of the MPS shares where they are wrong."""
import argparse
import os
import sys

import pytest

torch = pytest.importorskip("torch")
from helpers.paths import TOOLS_DIR  # noqa: E402

sys.path.insert(0, str(TOOLS_DIR))

import bench_afd  # noqa: E402
import bench_common as bc  # noqa: E402
import bench_decode  # noqa: E402
from afd_cupy.config import ModelConfig  # noqa: E402

MODEL = ModelConfig(hidden_size=48, num_experts=4, top_k=2, moe_intermediate_size=24, dtype="float32",
                    max_num_batched_tokens=64)


def test_gemm_shapes_follow_the_model():
    assert bc.gemm_shapes(MODEL) == [(64, 48, 48), (64, 48, 48), (64, 48, 24)]


def test_correct_gemms_pass_and_return_the_report():
    report = bc.require_correct_gemms(MODEL, "cpu")
    assert report["ok"] and len(report["results"]) == 3


def test_a_gemm_that_leaves_a_tile_unwritten_fails_naming_the_share(monkeypatch):
    def broken(x, w):
        out = torch.nn.functional.linear(x, w)
        out[:16, :16] = float("nan")  # a tile the GEMM never wrote
        return out

    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30")
    with pytest.raises(bc.GemmCheckError, match=r"MPS share 30%.*at least 50 %"):
        bc.require_correct_gemms(MODEL, "cpu", linear=broken)


def _decode_args(**over):
    ns = argparse.Namespace(attn=2, ffn=1, context=None, batch=None, presets=["uniform", "skew16x"],
                            base_context=8192, batch_size=64, mps_attn_pct=None, mps_ffn_pct=None)
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


@pytest.mark.parametrize("name", sorted(bench_decode.PLACEMENT_PRESETS))
def test_decode_presets_give_every_rank_a_share_where_gemms_are_right(name):
    spelled = bench_decode.PLACEMENT_PRESETS[name].placement
    shares = [int(rank.split(":")[1]) for rank in spelled.split(",")]
    assert len(shares) == 3 and min(shares) >= bc.MIN_MPS_SHARE_PCT


def test_ffn_bound_preset_divides_every_context():
    args = _decode_args()
    preset = bench_decode.PLACEMENT_PRESETS["ffn-bound"]
    divisor = preset.context_divisor
    assert divisor > 1 and preset.intermediate_scale > 1  # cheaper replica steps, costlier items
    full = bench_decode.make_workloads(args)
    short = bench_decode.make_workloads(args, divisor)
    assert [w.name for w in full] == [w.name for w in short]
    for a, b in zip(full, short):
        assert b.batches == a.batches
        assert all(abs(c / d - divisor) < 0.01 * divisor for c, d in zip(a.contexts, b.contexts))
    custom = bench_decode.make_workloads(_decode_args(context="1024,16384"), 16)
    assert custom[0].contexts == (64, 1024)


def test_bench_afd_default_shares_are_at_least_the_floor(monkeypatch):
    monkeypatch.setattr(bc, "num_visible_gpus", lambda: 1)
    for world in (2, 3, 4, 8):
        mps = bench_afd.mps_split(_decode_args(), "cuda", world)
        assert mps["shared_gpu"] and mps["attention_pct"] >= bc.MIN_MPS_SHARE_PCT
        assert mps["ffn_pct"] >= bc.MIN_MPS_SHARE_PCT
