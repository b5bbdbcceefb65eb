"""Tests of afd_cupy.moe (gates, grouped GEMM, scaling rule) and of its fixtures in
afd_cupy.testing.reference (expert weights, the fp64 reference).

CPU everywhere (the CUDA grouped GEMM test is marked and skipped without a GPU). Every
comparison uses fresh random inputs and an independent reference written here.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from afd_cupy import moe
from afd_cupy.config import ModelConfig
from afd_cupy.errors import ConfigError
from afd_cupy.moe import carveout, gates
from afd_cupy.moe import compute as moe_compute
from afd_cupy.testing.reference import make_expert_weights, make_shared_weights, reference_moe

from helpers.fakes import FakeCarveout

HIDDEN = 64
INTER = 32


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _distinct_logits(num_tokens, num_experts, dtype, rng) -> torch.Tensor:
    """Per token a random permutation of a grid of distinct values exactly representable in
    bf16/fp16 (k/8, |k| < 256): no ties, whatever the dtype, so the top-k order is unique."""
    rows = [rng.permutation(num_experts) - num_experts / 2 for _ in range(num_tokens)]
    return torch.tensor(np.stack(rows) / 8.0, dtype=dtype)


# --------------------------------------------------------------------------- gate reference

def _np_scores(logits: np.ndarray, scoring_func: str) -> np.ndarray:
    if scoring_func == "softmax":
        shifted = np.exp(logits - logits.max())
        return shifted / shifted.sum()
    return 1.0 / (1.0 + np.exp(-logits))


def _np_select(logits, top_k, *, grouped=False, num_groups=1, topk_group=1,
               scoring_func="softmax", bias=None, renormalize=True):
    """Straightforward per-token loops in float64."""
    num_tokens, num_experts = logits.shape
    ids = np.zeros((num_tokens, top_k), dtype=np.int64)
    weights = np.zeros((num_tokens, top_k))
    for t in range(num_tokens):
        scores = _np_scores(logits[t].astype(np.float64), scoring_func)
        selection = scores + bias if bias is not None else scores
        allowed = list(range(num_experts))
        if grouped:
            allowed = _np_allowed_experts(selection, num_groups, topk_group, bias is not None)
        chosen = sorted(allowed, key=lambda e: -selection[e])[:top_k]
        ids[t] = chosen
        weights[t] = scores[chosen]
        if renormalize:
            weights[t] /= weights[t].sum()
    return weights, ids


def _np_allowed_experts(selection, num_groups, topk_group, use_top2_sum):
    group_size = len(selection) // num_groups
    group_scores = []
    for g in range(num_groups):
        members = sorted(selection[g * group_size:(g + 1) * group_size], reverse=True)
        group_scores.append(members[0] + members[1] if use_top2_sum else members[0])
    kept = sorted(range(num_groups), key=lambda g: -group_scores[g])[:topk_group]
    return [e for e in range(len(selection)) if e // group_size in kept]


def _check_gate(weights, ids, ref_weights, ref_ids, num_tokens, top_k):
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (num_tokens, top_k)
    np.testing.assert_array_equal(ids.numpy(), ref_ids)
    np.testing.assert_allclose(weights.numpy(), ref_weights, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_reference(dtype, renormalize):
    rng = _rng(1)
    logits = _distinct_logits(37, 16, dtype, rng)
    weights, ids = gates.select_experts(logits, 4, renormalize=renormalize)
    ref_w, ref_ids = _np_select(logits.double().numpy(), 4, renormalize=renormalize)
    _check_gate(weights, ids, ref_w, ref_ids, 37, 4)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_groups,topk_group,top_k", [(4, 2, 3), (8, 3, 6), (4, 4, 2)])
def test_grouped_topk_deepseek_v2(renormalize, num_groups, topk_group, top_k):
    rng = _rng(2)
    logits = _distinct_logits(41, 32, torch.float32, rng)
    weights, ids = gates.select_experts(
        logits, top_k, use_grouped_topk=True, num_expert_group=num_groups,
        topk_group=topk_group, renormalize=renormalize)
    ref_w, ref_ids = _np_select(logits.double().numpy(), top_k, grouped=True,
                                num_groups=num_groups, topk_group=topk_group,
                                renormalize=renormalize)
    _check_gate(weights, ids, ref_w, ref_ids, 41, top_k)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_grouped_topk_deepseek_v3_sigmoid_bias(renormalize, logits_dtype):
    rng = _rng(3)
    logits = _distinct_logits(53, 64, logits_dtype, rng)
    bias = torch.tensor(rng.normal(0.0, 0.3, 64), dtype=torch.float32)
    weights, ids = gates.select_experts(
        logits, 8, use_grouped_topk=True, num_expert_group=8, topk_group=4,
        scoring_func="sigmoid", e_score_correction_bias=bias, renormalize=renormalize)
    ref_w, ref_ids = _np_select(logits.double().numpy(), 8, grouped=True, num_groups=8,
                                topk_group=4, scoring_func="sigmoid",
                                bias=bias.double().numpy(), renormalize=renormalize)
    _check_gate(weights, ids, ref_w, ref_ids, 53, 8)


def test_bias_steers_selection_but_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    weights, ids = gates.select_experts(logits, 1, scoring_func="sigmoid",
                                      e_score_correction_bias=bias, renormalize=False)
    assert ids.tolist() == [[3]]
    assert weights.item() == pytest.approx(1.0 / (1.0 + math.exp(1.0)), rel=1e-6)


def test_select_experts_zero_tokens():
    weights, ids = gates.select_experts(torch.empty((0, 8)), 2)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(router_logits=torch.randn(8)), r"router_logits.*2-D.*\(8,\)"),
    (dict(router_logits=torch.ones(3, 8, dtype=torch.int32)), r"router_logits.*int32"),
    (dict(top_k=9), r"top_k.*num_experts=8.*9"),
    (dict(top_k=0), r"top_k.*got 0"),
    (dict(scoring_func="relu"), r"scoring_func.*'relu'"),
    (dict(e_score_correction_bias=torch.zeros(7)), r"e_score_correction_bias.*\(8,\).*\(7,\)"),
    (dict(use_grouped_topk=True, num_expert_group=3, topk_group=1),
     r"num_expert_group.*num_experts=8.*num_expert_group=3"),
    (dict(use_grouped_topk=True, num_expert_group=None, topk_group=1),
     r"num_expert_group=None"),
    (dict(use_grouped_topk=True, num_expert_group=4, topk_group=5),
     r"topk_group.*num_expert_group=4.*topk_group=5"),
    (dict(use_grouped_topk=True, num_expert_group=4, topk_group=0), r"topk_group=0"),
    (dict(use_grouped_topk=True, num_expert_group=4, topk_group=1, top_k=3),
     r"top_k=3.*topk_group=1.*2"),
    (dict(use_grouped_topk=True, num_expert_group=8, topk_group=2, top_k=2,
          e_score_correction_bias=torch.zeros(8)), r"group size must be >= 2.*= 1"),
])
def test_select_experts_validation(kwargs, match):
    args = dict(router_logits=torch.randn(3, 8), top_k=2)
    args.update(kwargs)
    logits, top_k = args.pop("router_logits"), args.pop("top_k")
    with pytest.raises(ValueError, match=match):
        gates.select_experts(logits, top_k, **args)


# --------------------------------------------------------------------------- expert weights

def _expert_f64(weights: moe.ExpertWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert in float64, written out from the definition (separate w1 / w3)."""
    inter = weights.intermediate_size
    w13 = weights.w13[expert].double()
    w1, w3, w2 = w13[:inter], w13[inter:], weights.w2[expert].double()
    x = x.double()
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def test_make_expert_weights_deterministic_and_scaled():
    a = make_expert_weights(3, HIDDEN, INTER, dtype=torch.float32, device="cpu", seed=7)
    b = make_expert_weights(3, HIDDEN, INTER, dtype=torch.float32, device="cpu", seed=7)
    c = make_expert_weights(3, HIDDEN, INTER, dtype=torch.float32, device="cpu", seed=8)
    assert a.w13.shape == (3, 2 * INTER, HIDDEN) and a.w2.shape == (3, HIDDEN, INTER)
    assert (a.num_experts, a.first_expert) == (3, 0)
    assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
    assert not torch.equal(a.w13, c.w13)
    out = _expert_f64(a, 1, torch.randn(256, HIDDEN))
    assert 0.1 < out.std().item() < 3.0  # O(1) in, O(1) out


def test_make_expert_weights_same_values_across_dtypes():
    f32 = make_expert_weights(2, HIDDEN, INTER, dtype=torch.float32, device="cpu", seed=3)
    bf16 = make_expert_weights(2, HIDDEN, INTER, dtype=torch.bfloat16, device="cpu", seed=3)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(f32.w13.bfloat16(), bf16.w13)


def test_expert_weights_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match=r"inconsistent expert shapes.*w2 \(2, 8, 3\)"):
        moe.ExpertWeights(w13=torch.zeros(2, 8, 8), w2=torch.zeros(2, 8, 3), num_experts=2)
    with pytest.raises(ValueError, match=r"num_experts=3"):
        moe.ExpertWeights(w13=torch.zeros(2, 8, 8), w2=torch.zeros(2, 8, 4), num_experts=3)


@pytest.mark.parametrize("num_experts,num_ffn", [(12, 4), (10, 4), (9, 4), (5, 1), (3, 5)])
def test_local_experts_slices_and_zero_pads(num_experts, num_ffn):
    glob = make_expert_weights(num_experts, 16, 8, dtype=torch.float32, device="cpu", seed=5)
    epr = math.ceil(num_experts / num_ffn)
    for rank in range(num_ffn):
        local = moe.local_experts(glob, rank, epr)
        assert (local.num_experts, local.first_expert) == (epr, rank * epr)
        assert local.w13.shape == (epr, 16, 16) and local.w2.shape == (epr, 16, 8)
        for i in range(epr):
            gid = rank * epr + i
            if gid < num_experts:
                assert torch.equal(local.w13[i], glob.w13[gid])
                assert torch.equal(local.w2[i], glob.w2[gid])
            else:  # padded tail: zero experts
                assert not local.w13[i].any() and not local.w2[i].any()


def test_local_experts_copies_and_validates():
    glob = make_expert_weights(4, 16, 8, dtype=torch.float32, device="cpu", seed=5)
    local = moe.local_experts(glob, 1, 2)
    assert local.w13.data_ptr() != glob.w13[2].data_ptr()
    with pytest.raises(ValueError, match=r"first_expert=2"):
        moe.local_experts(local, 0, 1)
    with pytest.raises(ValueError, match=r"ffn_rank=-1"):
        moe.local_experts(glob, -1, 2)


def test_shared_weights_fused_and_distinct_from_routed():
    assert make_shared_weights(0, 16, 8, dtype=torch.float32, device="cpu", seed=1) is None
    shared = make_shared_weights(2, 16, 8, dtype=torch.float32, device="cpu", seed=1)
    routed = make_expert_weights(1, 16, 16, dtype=torch.float32, device="cpu", seed=1)
    assert shared.num_experts == 1 and shared.w13.shape == (1, 32, 16)
    assert shared.w2.shape == (1, 16, 16)
    assert not torch.equal(shared.w13, routed.w13)
    with pytest.raises(ValueError, match=r"num_shared_experts.*-1"):
        make_shared_weights(-1, 16, 8, dtype=torch.float32, device="cpu", seed=1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 3e-3)])
def test_shared_mlp_matches_reference(dtype, tol):
    shared = make_shared_weights(2, HIDDEN, INTER, dtype=dtype, device="cpu", seed=4)
    x = torch.randn(19, HIDDEN).to(dtype)
    out = moe.shared_mlp(x, shared)
    assert out.dtype == dtype and out.shape == (19, HIDDEN)
    torch.testing.assert_close(out.double(), _expert_f64(shared, 0, x), rtol=tol, atol=tol)
    assert moe.shared_mlp(x[:0], shared).shape == (0, HIDDEN)


# --------------------------------------------------------------------------- grouped GEMM

GROUPED_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _grouped_reference(x, counts, weights) -> torch.Tensor:
    out = torch.full((x.shape[0], weights.hidden_size), float("nan"), dtype=torch.float64)
    start = 0
    for expert, num_rows in enumerate(counts):
        out[start:start + num_rows] = _expert_f64(weights, expert, x[start:start + num_rows])
        start += num_rows
    return out


def _check_grouped(x, counts, weights, **kwargs):
    out = moe.grouped_mlp(x, torch.tensor(counts), weights, **kwargs)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], weights.hidden_size)
    tol = GROUPED_TOL[x.dtype]
    torch.testing.assert_close(out.double(), _grouped_reference(x, counts, weights),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts", [[5, 0, 9, 1, 0, 3], [0, 0, 0, 17, 0, 0], [11, 0, 0, 0, 0, 0],
                                    [0, 0, 0, 0, 0, 13]])
def test_grouped_mlp_loop_matches_reference(dtype, counts):
    weights = make_expert_weights(6, HIDDEN, INTER, dtype=dtype, device="cpu", seed=11)
    x = torch.randn(sum(counts), HIDDEN).to(dtype)
    _check_grouped(x, counts, weights)
    _check_grouped(x, counts, weights, group_counts_host=list(counts))


def test_grouped_mlp_zero_rows_and_any_int_counts():
    weights = make_expert_weights(3, HIDDEN, INTER, dtype=torch.bfloat16, device="cpu", seed=1)
    out = moe.grouped_mlp(torch.empty((0, HIDDEN), dtype=torch.bfloat16),
                          torch.zeros(3, dtype=torch.int32), weights)
    assert out.shape == (0, HIDDEN) and out.dtype == torch.bfloat16
    x = torch.randn(7, HIDDEN).bfloat16()
    for counts_dtype in (torch.int32, torch.int64, torch.int16):
        out = moe.grouped_mlp(x, torch.tensor([2, 0, 5], dtype=counts_dtype), weights)
        torch.testing.assert_close(out.double(), _grouped_reference(x, [2, 0, 5], weights),
                                   rtol=2e-2, atol=2e-2)


def test_grouped_mlp_padded_local_experts():
    glob = make_expert_weights(5, HIDDEN, INTER, dtype=torch.float32, device="cpu", seed=2)
    local = moe.local_experts(glob, 1, 3)  # experts 3, 4 and one zero expert
    x = torch.randn(9, HIDDEN)
    out = moe.grouped_mlp(x, torch.tensor([4, 5, 0]), local)
    torch.testing.assert_close(out[:4].double(), _expert_f64(glob, 3, x[:4]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[4:].double(), _expert_f64(glob, 4, x[4:]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(counts=[2, 2, 2]), r"group counts \[2, 2, 2\] \(sum 6\).*x.shape\[0\] = 7"),
    (dict(counts=[8, -1, 0]), r"group counts \[8, -1, 0\]"),
    (dict(counts=[7, 0]), r"group_counts.*\[3\].*\(2,\)"),
    (dict(counts=[7, 0, 0], host=[7, 0]), r"group_counts_host has 2 entries, expected 3"),
    (dict(counts=[7, 0, 0], host=[3, 0, 0]), r"sum 3"),
    (dict(counts=[7, 0, 0], x_dtype=torch.float16), r"float16.*bfloat16"),
    (dict(counts=[7, 0, 0], hidden=HIDDEN + 1), r"hidden=64.*\(7, 65\)"),
])
def test_grouped_mlp_validation(kwargs, match):
    weights = make_expert_weights(3, HIDDEN, INTER, dtype=torch.bfloat16, device="cpu", seed=1)
    x = torch.randn(7, kwargs.get("hidden", HIDDEN)).to(kwargs.get("x_dtype", torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        moe.grouped_mlp(x, torch.tensor(kwargs["counts"]), weights,
                        group_counts_host=kwargs.get("host"))


def test_grouped_mm_not_used_on_cpu():
    weights = make_expert_weights(2, HIDDEN, INTER, dtype=torch.bfloat16, device="cpu", seed=1)
    assert not moe.grouped_mm_supported(torch.randn(4, HIDDEN).bfloat16(), weights)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("counts", [[5, 0, 9, 1, 0, 3], [0, 0, 18, 0, 0, 0]])
def test_grouped_mm_layout_on_cpu_fallback(counts):
    """The fused path's operand layout and offsets, run through torch's CPU fallback of
    _grouped_mm (same validation of strides and offsets, no CUDA)."""
    weights = make_expert_weights(6, HIDDEN, INTER, dtype=torch.bfloat16, device="cpu", seed=9)
    x = torch.randn(sum(counts), HIDDEN).bfloat16()
    out = moe_compute._grouped_mlp_fused(x, torch.tensor(counts), weights)
    torch.testing.assert_close(out.double(), _grouped_reference(x, counts, weights),
                               rtol=3e-2, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("counts", [[37, 0, 91, 1, 0, 300, 0, 7], [0, 0, 0, 0, 0, 0, 0, 64]])
def test_grouped_mlp_cuda_bf16(counts):
    weights = make_expert_weights(8, 256, 128, dtype=torch.bfloat16, device="cuda", seed=1)
    x = torch.randn(sum(counts), 256, device="cuda").bfloat16()
    if torch.cuda.get_device_capability()[0] in (9, 10):
        assert moe.grouped_mm_supported(x, weights)
    counts_dev = torch.tensor(counts, device="cuda")
    out = moe.grouped_mlp(x, counts_dev, weights)
    ref = _grouped_reference(x.cpu(), counts, _to_cpu(weights))
    torch.testing.assert_close(out.cpu().double(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("counts", [[37, 0, 91, 1, 0, 300, 0, 7], [0, 0, 0, 0, 0, 0, 0, 64]])
def test_grouped_mlp_cuda_bf16_with_biases_and_clamped_swiglu(counts):
    weights = make_expert_weights(8, 256, 128, dtype=torch.bfloat16, device="cuda", seed=2)
    gen = torch.Generator().manual_seed(3)
    weights = dataclasses.replace(weights, activation="clamped_swiglu", swiglu_limit=1.5,
                                  w13_bias=torch.randn(8, 256, generator=gen).bfloat16().cuda(),
                                  w2_bias=torch.randn(8, 256, generator=gen).bfloat16().cuda())
    x = torch.randn(sum(counts), 256, device="cuda").bfloat16()
    if torch.cuda.get_device_capability()[0] in (9, 10):
        assert moe.grouped_mm_supported(x, weights)
    out = moe.grouped_mlp(x, torch.tensor(counts, device="cuda"), weights)
    ref = _grouped_reference_full(x.cpu(), counts, _to_cpu(weights))
    torch.testing.assert_close(out.cpu().double(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


def _to_cpu(weights: moe.ExpertWeights) -> moe.ExpertWeights:
    return dataclasses.replace(weights, **{name: getattr(weights, name).cpu()
                                           for name in ("w13", "w2", "w13_bias", "w2_bias", "gate")
                                           if getattr(weights, name) is not None})


# --------------------------------------------------------------------------- scaling rule

def test_routed_scaling_bf16_scales_routed():
    routed, shared = torch.randn(5, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    out_routed, out_shared = moe.apply_routed_scaling(routed, shared, 2.5)
    torch.testing.assert_close(out_routed, routed * 2.5)
    assert torch.equal(out_shared, shared)
    assert moe.combine_scale(torch.bfloat16, 2.5) == 1.0
    assert moe.combine_scale(torch.float32, 2.5) == 1.0


@pytest.mark.parametrize("num_routed", [5, 0])
def test_routed_scaling_fp16_divides_shared(num_routed):
    routed, shared = torch.randn(num_routed, 8).half(), torch.randn(3, 8).half()
    out_routed, out_shared = moe.apply_routed_scaling(routed, shared, 2.5)
    assert torch.equal(out_routed, routed)
    torch.testing.assert_close(out_shared, shared / 2.5)
    assert out_shared.dtype == torch.float16
    assert moe.combine_scale(torch.float16, 2.5) == 2.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_routed_scaling_round_trip_is_the_model_result(dtype):
    """(routed' + shared') * combine_scale == f * routed + shared, whatever the dtype."""
    routed, shared = torch.randn(6, 8).to(dtype), torch.randn(6, 8).to(dtype)
    out_routed, out_shared = moe.apply_routed_scaling(routed, shared, 4.0)
    combined = (out_routed.double() + out_shared.double()) * moe.combine_scale(dtype, 4.0)
    torch.testing.assert_close(combined, routed.double() * 4.0 + shared.double(),
                               rtol=1e-2, atol=1e-2)


def test_routed_scaling_without_shared_and_validation():
    routed = torch.randn(4, 8).half()
    assert moe.apply_routed_scaling(routed, None, 2.0)[1] is None
    with pytest.raises(ValueError, match=r"routed_scaling_factor.*-1.0"):
        moe.apply_routed_scaling(routed, None, -1.0)
    with pytest.raises(ValueError, match=r"float16.*bfloat16"):
        moe.apply_routed_scaling(routed, torch.randn(2, 8).bfloat16(), 2.0)


# --------------------------------------------------------------------------- reference_moe

def _vectorized_moe(hidden, ids, weights, glob, shared, factor) -> torch.Tensor:
    """Every expert on every token at once, then gather: an independent formulation."""
    x = hidden.double()
    gate_up = torch.einsum("th,eoh->eto", x, glob.w13.double())
    gate, up = gate_up.chunk(2, dim=-1)
    all_out = torch.einsum("eti,ehi->eth", F.silu(gate) * up, glob.w2.double())  # [E, T, H]
    token_idx = torch.arange(x.shape[0]).unsqueeze(1)
    picked = all_out[ids.long(), token_idx]  # [T, k, H]
    out = (weights.double().unsqueeze(-1) * picked).sum(dim=1) * factor
    if shared is not None:
        out = out + _expert_f64(shared, 0, x)
    return out


@pytest.mark.parametrize("with_shared", [True, False])
def test_reference_moe_matches_vectorized(with_shared):
    rng = _rng(4)
    glob = make_expert_weights(8, 32, 16, dtype=torch.bfloat16, device="cpu", seed=21)
    shared = (make_shared_weights(1, 32, 16, dtype=torch.bfloat16, device="cpu", seed=21)
              if with_shared else None)
    hidden = torch.randn(13, 32).bfloat16()
    weights, ids = gates.select_experts(_distinct_logits(13, 8, torch.float32, rng), 3)
    out = reference_moe(hidden, ids, weights, glob, shared, 2.5)
    assert out.dtype == torch.float32 and out.shape == (13, 32)
    torch.testing.assert_close(out.double(),
                               _vectorized_moe(hidden, ids, weights, glob, shared, 2.5),
                               rtol=1e-5, atol=1e-6)


def test_reference_moe_validation():
    glob = make_expert_weights(4, 16, 8, dtype=torch.float32, device="cpu", seed=1)
    hidden, weights = torch.randn(2, 16), torch.rand(2, 2)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 4\).*\[0, 4\]"):
        reference_moe(hidden, torch.tensor([[0, 1], [2, 4]]), weights, glob, None, 1.0)
    with pytest.raises(ValueError, match=r"first_expert=2"):
        reference_moe(hidden, torch.zeros(2, 2, dtype=torch.int32), weights,
                          moe.local_experts(glob, 1, 2), None, 1.0)


def _disaggregated_moe(hidden, ids, weights, glob, shared, factor, num_ffn):
    """The whole AFD data flow in one process: route to F ranks, grouped GEMM per rank,
    FFN-side scaling rule, Attention-side fp32 combine times combine_scale."""
    epr = math.ceil(glob.num_experts / num_ffn)
    flat_ids = ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)  # grouped by global expert = by rank, local
    routed_rows = torch.full((flat_ids.numel(), hidden.shape[1]), float("nan"),
                             dtype=torch.float32)
    shared_out = torch.full(hidden.shape, float("nan"), dtype=torch.float32)
    for rank in range(num_ffn):
        local = moe.local_experts(glob, rank, epr)
        mine = order[(flat_ids[order] >= rank * epr) & (flat_ids[order] < (rank + 1) * epr)]
        counts = torch.bincount(flat_ids[mine] - rank * epr, minlength=epr)
        routed = moe.grouped_mlp(hidden[mine // ids.shape[1]], counts, local)
        shared_idx = torch.arange(rank, hidden.shape[0], num_ffn)
        shared_part = moe.shared_mlp(hidden[shared_idx], shared) if shared else None
        routed, shared_part = moe.apply_routed_scaling(routed, shared_part, factor)
        routed_rows[mine] = routed.float()
        if shared_part is not None:
            shared_out[shared_idx] = shared_part.float()
    per_slot = routed_rows.view(ids.shape[0], ids.shape[1], -1)
    out = (weights.unsqueeze(-1) * per_slot).sum(dim=1)
    out = out + shared_out if shared else out
    return out * moe.combine_scale(hidden.dtype, factor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_ffn", [1, 3])
def test_disaggregated_pipeline_matches_reference(dtype, num_ffn):
    rng = _rng(6)
    glob = make_expert_weights(10, 32, 16, dtype=dtype, device="cpu", seed=31)
    shared = make_shared_weights(2, 32, 16, dtype=dtype, device="cpu", seed=31)
    hidden = torch.randn(17, 32).to(dtype)
    logits = _distinct_logits(17, 10, torch.float32, rng)
    weights, ids = gates.select_experts(logits, 4, use_grouped_topk=True, num_expert_group=5,
                                      topk_group=3)
    out = _disaggregated_moe(hidden, ids, weights, glob, shared, 2.5, num_ffn)
    ref = reference_moe(hidden, ids, weights, glob, shared, 2.5)
    torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)


# --------------------------------------------------------------------------- model gates

def _np_select_grouped(logits, top_k, num_groups, topk_group, *, bias, use_top2_sum, renormalize):
    """float64 loops of a grouped gate with the group score chosen explicitly."""
    num_tokens, num_experts = logits.shape
    ids, weights = np.zeros((num_tokens, top_k), np.int64), np.zeros((num_tokens, top_k))
    for t in range(num_tokens):
        scores = 1.0 / (1.0 + np.exp(-logits[t].astype(np.float64)))
        selection = scores + bias
        allowed = _np_allowed_experts(selection, num_groups, topk_group, use_top2_sum)
        chosen = sorted(allowed, key=lambda e: -selection[e])[:top_k]
        ids[t], weights[t] = chosen, scores[chosen]
        if renormalize:
            weights[t] /= weights[t].sum()
    return weights, ids


def _gate_model(**overrides):
    fields = dict(hidden_size=16, num_experts=32, top_k=4, moe_intermediate_size=8,
                  scoring_func="sigmoid", n_group=8, topk_group=3, topk_method="noaux_tc")
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [True, False])
def test_noaux_tc_gate_scores_groups_by_their_top2_sum_with_or_without_bias(with_bias, renormalize):
    rng = _rng(7)
    logits = _distinct_logits(29, 32, torch.float32, rng)
    bias = rng.normal(0.0, 0.2, 32) if with_bias else np.zeros(32)
    model = _gate_model(renormalize=renormalize)
    weights, ids = gates.model_gate(model, logits, torch.tensor(bias, dtype=torch.float32) if with_bias else None)
    ref_w, ref_ids = _np_select_grouped(logits.double().numpy(), 4, 8, 3, bias=bias,
                                        use_top2_sum=True, renormalize=renormalize)
    _check_gate(weights, ids, ref_w, ref_ids, 29, 4)


def test_gate_methods_differ_where_they_should():
    rng = _rng(8)
    logits = _distinct_logits(64, 32, torch.float32, rng)
    v2 = gates.model_gate(_gate_model(topk_method="group_limited_greedy"), logits)
    v3 = gates.model_gate(_gate_model(topk_method="noaux_tc"), logits)
    greedy = gates.model_gate(_gate_model(topk_method="greedy"), logits)
    ref_v2 = _np_select_grouped(logits.double().numpy(), 4, 8, 3, bias=np.zeros(32),
                                use_top2_sum=False, renormalize=True)
    ref_greedy = _np_select(logits.double().numpy(), 4, scoring_func="sigmoid")
    _check_gate(*v2, *ref_v2, 64, 4)
    _check_gate(*greedy, *ref_greedy, 64, 4)
    assert not torch.equal(v2[1], v3[1])  # max vs top-2 sum group scores pick other groups
    default = gates.model_gate(_gate_model(topk_method=None), logits)  # n_group set: V2
    assert torch.equal(default[1], v2[1])


def test_gate_with_ties_picks_a_set_of_maximal_scores():
    """Ties may be broken either way, for groups and for experts: the gate must keep some
    valid top-`topk_group` set of groups (every group scoring above the cut, the rest among
    those tied at it) and pick a top-k of the experts in it."""
    import itertools

    rng = _rng(9)
    logits = torch.tensor(rng.integers(-2, 3, size=(50, 32)) / 2.0, dtype=torch.float32)  # many ties
    weights, ids = gates.model_gate(_gate_model(topk_method="noaux_tc"), logits)
    scores = torch.sigmoid(logits.double())
    for t in range(50):
        grouped = scores[t].view(8, 4)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        cut = group_scores.topk(3).values[-1]
        above = [g for g in range(8) if group_scores[g] > cut + 1e-12]
        tied = [g for g in range(8) if abs(group_scores[g] - cut) <= 1e-12]
        chosen = sorted(int(e) for e in ids[t])
        got = scores[t][chosen].sort(descending=True).values
        valid = False
        for extra in itertools.combinations(tied, 3 - len(above)):
            kept = set(above) | set(extra)
            if not all(e // 4 in kept for e in chosen):
                continue
            best = torch.cat([grouped[g] for g in sorted(kept)]).topk(4).values
            valid |= bool(torch.allclose(got, best))
        assert valid, (t, chosen, group_scores)
        np.testing.assert_allclose(float(weights[t].sum()), 1.0, rtol=1e-6)


def test_topk_method_validation():
    with pytest.raises(ConfigError, match="topk_method must be one of"):
        _gate_model(topk_method="aux_loss")
    with pytest.raises(ConfigError, match="topk_method='noaux_tc' needs n_group"):
        _gate_model(n_group=None, topk_group=None)


def test_qwen2_shared_expert_gate_matches_the_float64_formula():
    torch.manual_seed(0)
    shared = make_shared_weights(1, 16, 8, dtype=torch.float32, device="cpu", seed=3)
    gate = torch.randn(1, 16)
    gated = moe.ExpertWeights(w13=shared.w13, w2=shared.w2, num_experts=1, gate=gate)
    x = torch.randn(9, 16)
    got = moe.shared_mlp(x, gated)
    plain = moe.shared_mlp(x, shared)
    factor = torch.sigmoid(x.double() @ gate[0].double())
    np.testing.assert_allclose(got.double().numpy(), (plain.double() * factor[:, None]).numpy(),
                               rtol=1e-5, atol=1e-6)
    ids = torch.zeros(9, 2, dtype=torch.int64)
    experts = make_expert_weights(2, 16, 8, dtype=torch.float32, device="cpu", seed=4)
    ref = reference_moe(x, ids, torch.zeros(9, 2), experts, gated, 1.0)  # shared part only
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"gate must be \[1, 16\]"):
        moe.ExpertWeights(w13=shared.w13, w2=shared.w2, num_experts=1, gate=torch.randn(2, 16))


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_grouped_and_shared_mlp_apply_the_activation_like_the_reference(activation):
    experts = make_expert_weights(3, 16, 8, dtype=torch.float32, device="cpu", seed=5)
    experts = moe.ExpertWeights(w13=experts.w13, w2=experts.w2, num_experts=3, activation=activation)
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(6))
    counts = torch.tensor([3, 0, 4], dtype=torch.int32)
    got = moe.grouped_mlp(x, counts, experts)
    ids = torch.tensor([[0], [0], [0], [2], [2], [2], [2]])
    ref = reference_moe(x, ids, torch.ones(7, 1), experts, None, 1.0)
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    local = moe.local_experts(experts, 0, 2)
    assert local.activation == activation
    with pytest.raises(ValueError, match="activation must be one of"):
        moe.ExpertWeights(w13=experts.w13, w2=experts.w2, num_experts=3, activation="relu")


# --------------------------------------------------------------------------- expert biases, clamped SwiGLU

def _biased(weights: moe.ExpertWeights, seed: int, *, w13_bias=True, w2_bias=True, **fields):
    """``weights`` with random biases of O(1) (same dtype and device) and ``fields`` replaced."""
    gen = torch.Generator().manual_seed(seed)
    num, two_inter, hidden = weights.w13.shape
    b13 = torch.randn(num, two_inter, generator=gen).to(weights.dtype) if w13_bias else None
    b2 = torch.randn(num, hidden, generator=gen).to(weights.dtype) if w2_bias else None
    return dataclasses.replace(weights, w13_bias=b13, w2_bias=b2, **fields)


def _gpt_oss_expert_f64(x, gate_up, gate_up_bias, down, down_bias, limit=7.0, alpha=1.702):
    """One gpt-oss expert in float64 exactly as transformers' GptOssExperts writes it:
    gate_up [H, 2I] with gate and up columns INTERLEAVED, down [I, H] (x @ W layout)."""
    out = x.double() @ gate_up.double() + gate_up_bias.double()
    gate, up = out[..., ::2], out[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return ((up + 1) * glu) @ down.double() + down_bias.double()


def _expert_f64_full(weights: moe.ExpertWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert in float64 from the definition, biases and every activation included
    (numpy, separate w1 / w3: independent of the torch code paths)."""
    inter = weights.intermediate_size
    w13 = weights.w13[expert].double().numpy()
    x = x.double().numpy()
    gate_up = x @ w13.T
    if weights.w13_bias is not None:
        gate_up = gate_up + weights.w13_bias[expert].double().numpy()
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if weights.activation == "clamped_swiglu":
        limit, alpha = weights.swiglu_limit, weights.swiglu_alpha
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
        hidden = (up + 1.0) * gate / (1.0 + np.exp(-alpha * gate))
    elif weights.activation == "silu":
        hidden = gate / (1.0 + np.exp(-gate)) * up
    else:  # gelu (erf)
        hidden = 0.5 * gate * (1.0 + np.vectorize(math.erf)(gate / math.sqrt(2.0))) * up
    out = hidden @ weights.w2[expert].double().numpy().T
    if weights.w2_bias is not None:
        out = out + weights.w2_bias[expert].double().numpy()
    return torch.from_numpy(out)


def _grouped_reference_full(x, counts, weights) -> torch.Tensor:
    out = torch.full((x.shape[0], weights.hidden_size), float("nan"), dtype=torch.float64)
    start = 0
    for expert, num_rows in enumerate(counts):
        out[start:start + num_rows] = _expert_f64_full(weights, expert, x[start:start + num_rows])
        start += num_rows
    assert not out.isnan().any()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "clamped_swiglu"])
@pytest.mark.parametrize("which", ["both", "w13", "w2"])
def test_grouped_mlp_with_expert_biases_matches_reference(dtype, activation, which):
    weights = _biased(make_expert_weights(6, HIDDEN, INTER, dtype=dtype, device="cpu", seed=12), 13,
                      w13_bias=which != "w2", w2_bias=which != "w13", activation=activation)
    counts = [5, 0, 9, 1, 0, 3]
    x = (torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(14)) * 3).to(dtype)
    out = moe.grouped_mlp(x, torch.tensor(counts), weights)
    assert out.dtype == dtype and out.shape == (sum(counts), HIDDEN)
    ref = _grouped_reference_full(x, counts, weights)
    tol = GROUPED_TOL[dtype]
    atol = tol * ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=atol)
    # the biases matter at this tolerance: the output without them would fail the check
    plain = dataclasses.replace(weights, w13_bias=None, w2_bias=None)
    assert not torch.allclose(_grouped_reference_full(x, counts, plain), ref, rtol=tol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_experts_match_the_gpt_oss_formula(dtype):
    """ExpertWeights built from gpt-oss's interleaved, transposed tensors (de-interleaved here
    by hand) compute what transformers' GptOssExperts computes, clamp included."""
    gen = torch.Generator().manual_seed(21)
    num, hidden, inter = 4, HIDDEN, INTER
    gate_up = torch.randn(num, hidden, 2 * inter, generator=gen) / hidden ** 0.5 * 4  # reaches the clamp
    gate_up_bias = torch.randn(num, 2 * inter, generator=gen)
    down = torch.randn(num, inter, hidden, generator=gen) / inter ** 0.5
    down_bias = torch.randn(num, hidden, generator=gen)
    gate_up, gate_up_bias, down, down_bias = (t.to(dtype) for t in (gate_up, gate_up_bias, down, down_bias))
    w13 = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2).contiguous()
    b13 = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1)
    weights = moe.ExpertWeights(w13=w13, w2=down.transpose(1, 2).contiguous(), num_experts=num,
                                w13_bias=b13, w2_bias=down_bias, activation="clamped_swiglu")
    counts = [6, 0, 11, 4]
    x = torch.randn(sum(counts), hidden, generator=gen).to(dtype)
    ref = torch.full((sum(counts), hidden), float("nan"), dtype=torch.float64)
    start = 0
    pre_activation = []
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        ref[rows] = _gpt_oss_expert_f64(x[rows], gate_up[e], gate_up_bias[e], down[e], down_bias[e])
        pre_activation.append(x[rows].double() @ gate_up[e].double() + gate_up_bias[e].double())
        start += n
    pre = torch.cat(pre_activation)
    assert (pre[:, 0::2] > 7).any() and (pre[:, 1::2].abs() > 7).any()  # both clamps reached
    tol = GROUPED_TOL[dtype]
    scale = ref.abs().max().item()
    got = moe.grouped_mlp(x, torch.tensor(counts), weights)
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(reference_moe(x, _ids_of_counts(counts), torch.ones(sum(counts), 1),
                                             weights, None, 1.0).double().numpy(),
                               ref.float().double().numpy(), rtol=1e-5, atol=1e-5 * scale)
    unclamped = dataclasses.replace(weights, swiglu_limit=1e6)  # the clamp matters at this tolerance
    assert not torch.allclose(moe.grouped_mlp(x, torch.tensor(counts), unclamped).double(), ref,
                              rtol=tol, atol=tol * scale)


def _ids_of_counts(counts) -> torch.Tensor:
    """[rows, 1] global ids: expert e repeated counts[e] times (one expert per row)."""
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).unsqueeze(1)


@pytest.mark.parametrize("limit,alpha", [(7.0, 1.702), (2.5, 1.0)])
def test_gated_activation_clamped_swiglu_matches_a_float64_formula(limit, alpha):
    gate_up = torch.linspace(-12, 12, 2 * 97, dtype=torch.float64)[torch.randperm(2 * 97)].view(2, 97)
    gate_up = torch.cat([gate_up, gate_up.flip(-1)], dim=-1)  # [2, 194]: gate | up
    got = moe.gated_activation(gate_up, "clamped_swiglu", swiglu_limit=limit, swiglu_alpha=alpha)
    gate, up = gate_up[:, :97].numpy(), gate_up[:, 97:].numpy()
    g = np.where(gate > limit, limit, gate)
    u = np.where(up > limit, limit, np.where(up < -limit, -limit, up))
    np.testing.assert_allclose(got.numpy(), (u + 1) * g / (1 + np.exp(-alpha * g)), rtol=1e-12, atol=1e-12)


def test_shared_mlp_with_biases_and_clamped_swiglu():
    shared = _biased(make_shared_weights(2, HIDDEN, INTER, dtype=torch.float32, device="cpu", seed=15), 16,
                     activation="clamped_swiglu", swiglu_limit=3.0)
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(17)) * 2
    out = moe.shared_mlp(x, shared)
    torch.testing.assert_close(out.double(), _expert_f64_full(shared, 0, x), rtol=1e-5, atol=1e-5)
    ref = reference_moe(x, torch.zeros(11, 1, dtype=torch.int64), torch.zeros(11, 1),
                        make_expert_weights(1, HIDDEN, INTER, dtype=torch.float32, device="cpu", seed=1),
                        shared, 1.0)  # the shared part only
    torch.testing.assert_close(ref.double(), _expert_f64_full(shared, 0, x), rtol=1e-5, atol=1e-5)


def test_reference_moe_applies_biases_per_expert():
    glob = _biased(make_expert_weights(5, 16, 8, dtype=torch.float32, device="cpu", seed=18), 19,
                   activation="gelu")
    hidden = torch.randn(7, 16, generator=torch.Generator().manual_seed(20))
    weights, ids = gates.select_experts(_distinct_logits(7, 5, torch.float32, _rng(10)), 2)
    out = reference_moe(hidden, ids, weights, glob, None, 1.5)
    expect = torch.zeros(7, 16, dtype=torch.float64)
    for t in range(7):
        for k in range(2):
            expect[t] += weights[t, k].double() * _expert_f64_full(glob, int(ids[t, k]), hidden[t:t + 1])[0]
    torch.testing.assert_close(out.double(), expect * 1.5, rtol=1e-5, atol=1e-6)


def test_local_experts_carry_biases_and_the_activation():
    glob = _biased(make_expert_weights(5, 16, 8, dtype=torch.float32, device="cpu", seed=22), 23,
                   activation="clamped_swiglu", swiglu_limit=5.0, swiglu_alpha=1.5)
    local = moe.local_experts(glob, 1, 3)  # experts 3, 4 and one zero expert
    assert (local.activation, local.swiglu_limit, local.swiglu_alpha) == ("clamped_swiglu", 5.0, 1.5)
    assert torch.equal(local.w13_bias[:2], glob.w13_bias[3:]) and torch.equal(local.w2_bias[:2], glob.w2_bias[3:])
    assert not local.w13_bias[2].any() and not local.w2_bias[2].any()
    assert local.w13_bias.data_ptr() != glob.w13_bias[3].data_ptr()
    x = torch.randn(6, 16) * 3
    out = moe.grouped_mlp(x, torch.tensor([4, 2, 0]), local)
    torch.testing.assert_close(out[:4].double(), _expert_f64_full(glob, 3, x[:4]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[4:].double(), _expert_f64_full(glob, 4, x[4:]), rtol=1e-5, atol=1e-5)
    unbiased = moe.local_experts(make_expert_weights(5, 16, 8, dtype=torch.float32, device="cpu", seed=22), 1, 3)
    assert unbiased.w13_bias is None and unbiased.w2_bias is None


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("which", ["both", "w13", "w2"])
@pytest.mark.parametrize("counts", [[5, 0, 9, 1, 0, 3], [0, 0, 18, 0, 0, 0]])
def test_grouped_mm_path_with_biases_on_cpu_fallback(which, counts):
    """The fused path's bias handling (row -> expert ids without a sync, gather, adds),
    through torch's CPU fallback of _grouped_mm."""
    weights = _biased(make_expert_weights(6, HIDDEN, INTER, dtype=torch.bfloat16, device="cpu", seed=24), 25,
                      w13_bias=which != "w2", w2_bias=which != "w13", activation="clamped_swiglu")
    x = (torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(26)) * 3).bfloat16()
    out = moe_compute._grouped_mlp_fused(x, torch.tensor(counts, dtype=torch.int32), weights)
    ref = _grouped_reference_full(x, counts, weights)
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_grouped_mm_path_without_biases_runs_no_bias_ops():
    """No biases, no extra ops: the fused path runs the same aten ops as before biases existed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    plain = make_expert_weights(3, HIDDEN, INTER, dtype=torch.bfloat16, device="cpu", seed=27)
    x, counts = torch.randn(7, HIDDEN).bfloat16(), torch.tensor([2, 0, 5], dtype=torch.int32)
    runs = {}
    for name, weights in (("plain", plain), ("biased", _biased(plain, 28))):
        with Ops() as ops:
            moe_compute._grouped_mlp_fused(x, counts, weights)
        runs[name] = ops.names
    bias_ops = {"repeat_interleave", "index", "add", "add_"}
    assert not bias_ops & set(runs["plain"]), runs["plain"]
    assert {"repeat_interleave", "index", "add_"} <= set(runs["biased"]), runs["biased"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(w13_bias=torch.zeros(3, 15)), r"w13_bias must be \[3, 16\] torch.float32 on cpu, got \(3, 15\)"),
    (dict(w13_bias=torch.zeros(2, 16)), r"w13_bias must be \[3, 16\].*got \(2, 16\)"),
    (dict(w13_bias=torch.zeros(3, 16, dtype=torch.bfloat16)),
     r"w13_bias must be \[3, 16\] torch.float32 on cpu, got \(3, 16\) torch.bfloat16 on cpu"),
    (dict(w13_bias=torch.zeros(3, 16, device="meta")), r"w13_bias must be .* on cpu, got .* on meta"),
    (dict(w2_bias=torch.zeros(3, 8, 1)), r"w2_bias must be \[3, 16\] torch.float32 on cpu, got \(3, 8, 1\)"),
    (dict(w2_bias=torch.zeros(3, 8)), r"w2_bias must be \[3, 16\].*got \(3, 8\)"),
    (dict(w2_bias=torch.zeros(3, 16, dtype=torch.float16)), r"w2_bias.*got \(3, 16\) torch.float16"),
    (dict(swiglu_limit=0.0), r"swiglu_limit must be a finite number > 0, got 0.0"),
    (dict(swiglu_limit=float("inf")), r"swiglu_limit must be a finite number > 0, got inf"),
    (dict(swiglu_limit=True), r"swiglu_limit must be a finite number > 0, got True"),
    (dict(swiglu_alpha=-1.702), r"swiglu_alpha must be a finite number > 0, got -1.702"),
    (dict(swiglu_alpha=float("nan")), r"swiglu_alpha must be a finite number > 0, got nan"),
    (dict(activation="swiglu"), r"activation must be one of \('silu', 'gelu', 'gelu_tanh', "
                                r"'clamped_swiglu'\), got 'swiglu'"),
])
def test_expert_weights_validates_biases_and_activation_parameters(kwargs, match):
    base = make_expert_weights(3, 16, 8, dtype=torch.float32, device="cpu", seed=29)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(base, **kwargs)


# --------------------------------------------------------------------------- gpt-oss router

def _np_gpt_oss_router(logits: np.ndarray, top_k: int):
    """gpt-oss's router in float64 loops: the top-k logits, then softmax over those k."""
    ids = np.zeros((logits.shape[0], top_k), np.int64)
    weights = np.zeros((logits.shape[0], top_k))
    for t, row in enumerate(logits.astype(np.float64)):
        chosen = sorted(range(len(row)), key=lambda e: -row[e])[:top_k]
        top = np.exp(row[chosen] - row[chosen].max())
        ids[t], weights[t] = chosen, top / top.sum()
    return weights, ids


def _gpt_oss_gate_model(num_experts=32, top_k=4):
    return ModelConfig(hidden_size=16, num_experts=num_experts, top_k=top_k, moe_intermediate_size=8,
                       scoring_func="softmax", renormalize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_router_is_softmax_topk_renormalised(dtype):
    """top-k of the logits then softmax over the k == softmax, top-k, renormalise."""
    logits = _distinct_logits(61, 32, dtype, _rng(30))
    weights, ids = gates.model_gate(_gpt_oss_gate_model(), logits)
    ref_w, ref_ids = _np_gpt_oss_router(logits.double().numpy(), 4)
    _check_gate(weights, ids, ref_w, ref_ids, 61, 4)


def test_gpt_oss_router_with_ties_picks_a_top_k_and_its_softmax():
    """Tied logits may be broken either way: the ids must be some top-k of the logits (all
    above the cut, the rest among those tied at it), the weights the softmax over them."""
    rng = _rng(31)
    logits = torch.tensor(rng.integers(-3, 4, size=(80, 16)) / 2.0, dtype=torch.float32)  # many ties
    weights, ids = gates.model_gate(_gpt_oss_gate_model(16, 4), logits)
    for t in range(80):
        row = logits[t].double()
        cut = row.topk(4).values[-1]
        chosen = ids[t].long()
        assert len(set(chosen.tolist())) == 4
        assert (row[chosen] >= cut).all()
        assert set(torch.nonzero(row > cut).flatten().tolist()) <= set(chosen.tolist())
        expect = torch.softmax(row[chosen], dim=0)
        np.testing.assert_allclose(weights[t].double().numpy(), expect.numpy(), rtol=1e-6, atol=1e-7)


def test_gpt_oss_router_far_below_the_best_logit_gets_zero_weight_either_way():
    """Logits > ~100 below the best underflow to a zero softmax score in fp32; among those the
    gate may pick other experts than the logits' order, but only with weight 0 (gpt-oss's
    own weight there is below 1e-40: its output is the same)."""
    logits = torch.tensor([[0.0, -200.0, -201.0, -202.0, 5.0, -203.0]])
    weights, ids = gates.model_gate(_gpt_oss_gate_model(6, 3), logits)
    ref_w, ref_ids = _np_gpt_oss_router(logits.double().numpy(), 3)
    assert ids[0, :2].tolist() == ref_ids[0, :2].tolist() == [4, 0]
    np.testing.assert_allclose(weights[0].double().numpy(), ref_w[0], rtol=1e-6, atol=1e-40)
    assert weights[0, 2].item() == 0.0


# --------------------------------------------------------------------------- SM carve-out

def test_sm_carveout_sets_and_restores_unset_nested_and_on_errors(monkeypatch):
    fake = FakeCarveout().install(monkeypatch)
    with moe.sm_carveout(3):
        assert fake.value == 3 and moe.current_sm_carveout() == 3
        with moe.sm_carveout(5):
            assert fake.value == 5
        assert fake.value == 3  # the outer block's value is back
        with moe.sm_carveout(0), moe.sm_carveout(None):  # 0 / None: the outer value stays
            assert fake.value == 3
    assert fake.value is None and fake.calls == [3, 5, 3, None]
    with pytest.raises(RuntimeError, match="boom"):
        with moe.sm_carveout(2):
            assert fake.value == 2
            raise RuntimeError("boom")
    assert fake.value is None and fake.calls[-2:] == [2, None]
    preset = FakeCarveout(value=7).install(monkeypatch)  # someone else's setting: restored as is
    with moe.sm_carveout(1):
        assert preset.value == 1
    assert preset.calls == [1, 7]
    old = FakeCarveout(accepts_none=False).install(monkeypatch)  # int-only binding: "unset" -> 0
    with moe.sm_carveout(4):
        pass
    assert old.calls == [4, 0] and old.value == 0


def test_sm_carveout_blocks_on_two_threads_that_overlap(monkeypatch):
    # thread A opens 2, thread B opens 3, A closes first: B's 3 stays in force (not A's
    # "previous"), and when B closes the value from before both comes back; then the same
    # with B closing first. A plain save/restore per block would leave 2 or 3 behind.
    import threading

    for close_first in ("a", "b"):
        fake = FakeCarveout(value=9).install(monkeypatch)
        steps = {name: (threading.Event(), threading.Event()) for name in "ab"}  # (open, close)
        opened = {name: threading.Event() for name in "ab"}
        errors = []

        def block(name, n):
            try:
                steps[name][0].wait(5)
                with moe.sm_carveout(n):
                    opened[name].set()
                    steps[name][1].wait(5)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=block, args=("a", 2)), threading.Thread(target=block, args=("b", 3))]
        for t in threads:
            t.start()
        steps["a"][0].set()
        assert opened["a"].wait(5) and fake.value == 2
        steps["b"][0].set()
        assert opened["b"].wait(5) and fake.value == 3
        first, second = ("a", "b") if close_first == "a" else ("b", "a")
        steps[first][1].set()
        threads["ab".index(first)].join(5)
        # the newest open block's value: B's 3 when A closed first, A's 2 when B did
        assert fake.value == (3 if first == "a" else 2)
        steps[second][1].set()
        threads["ab".index(second)].join(5)
        assert not errors and fake.value == 9 and not carveout._OPEN.scopes


def test_sm_carveout_zero_or_none_does_not_touch_torch(monkeypatch):
    fake = FakeCarveout(value=6).install(monkeypatch)
    for n in (0, None):
        with moe.sm_carveout(n):
            assert fake.value == 6
    assert fake.calls == [] and fake.reads == 0
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental")  # a torch without the binding
    with moe.sm_carveout(0):
        pass
    assert moe.check_sm_carveout(0) == 0 and moe.current_sm_carveout() is None
    with pytest.raises(ConfigError, match=r"gemm_sm_carveout=2 needs torch._C._set_sm_carveout_experimental"):
        moe.check_sm_carveout(2)
    with pytest.raises(ConfigError, match=r"sm_carveout\(n\)=1 needs"):
        with moe.sm_carveout(1):
            pass


@pytest.mark.parametrize("value,match", [
    (-1, r"gemm_sm_carveout must be >= 0, got -1"),
    (True, r"must be an int >= 0 .*got bool True"),
    (1.0, r"must be an int >= 0 .*got float 1.0"),
    ("2", r"must be an int >= 0 .*got str '2'"),
])
def test_check_sm_carveout_rejects_bad_values(value, match):
    with pytest.raises(ConfigError, match=match):
        moe.check_sm_carveout(value)
    with pytest.raises(ConfigError, match=r"sm_carveout\(n\) must"):
        with moe.sm_carveout(value):
            pass


def test_check_sm_carveout_against_the_device_sm_count(monkeypatch):
    FakeCarveout().install(monkeypatch)
    seen = []
    monkeypatch.setattr(carveout, "_sm_count", lambda device: seen.append(device) or 132)
    assert moe.check_sm_carveout(131, device=torch.device("cuda", 1)) == 131
    assert seen == [torch.device("cuda", 1)]
    with pytest.raises(ConfigError, match=r"FFNWorker.gemm_sm_carveout=132 must be < the SM count of "
                                          r"cuda:0 \(132\)"):
        moe.check_sm_carveout(132, device="cuda:0", name="FFNWorker.gemm_sm_carveout")
    with pytest.raises(ConfigError, match=r"< the SM count"):
        with moe.sm_carveout(200, device="cuda:0"):
            pass
    assert moe.check_sm_carveout(500, device="cpu") == 500  # CPU: no SM count to check
    assert moe.check_sm_carveout(0, device="cuda:0") == 0 and len(seen) == 3  # 0: no lookup


def test_resolve_gemm_sm_carveout_auto_and_ints(monkeypatch):
    # "auto" (the FFN side's default): AUTO_GEMM_SM_CARVEOUT on a CUDA device with the binding
    # and enough SMs; 0 on the CPU, without a device, without the binding, on a tiny GPU
    FakeCarveout().install(monkeypatch)
    sms = {"n": 132}
    monkeypatch.setattr(carveout, "_sm_count", lambda device: sms["n"])
    resolve = moe.resolve_gemm_sm_carveout
    assert resolve("auto", device=torch.device("cuda", 0)) == moe.AUTO_GEMM_SM_CARVEOUT == 2
    assert resolve("auto", device="cuda:1") == 2
    assert resolve("auto", device="cpu") == 0 and resolve("auto") == 0
    sms["n"] = 4
    assert resolve("auto", device="cuda:0") == 0  # would leave too few SMs for the GEMM
    sms["n"] = 132
    assert resolve(0, device="cuda:0") == 0 and resolve(7, device="cuda:0") == 7
    assert resolve(7) == 7  # no device: not checked against an SM count
    for bad, match in (("Auto", r"X must be 'auto' or an int >= 0 .*got 'Auto'"),
                       ("2", r"got '2'"), (-1, r"X must be >= 0, got -1"),
                       (None, r"X must be an int >= 0 .*got NoneType None"),
                       (132, r"X=132 must be < the SM count of cuda:0 \(132\)")):
        with pytest.raises(ConfigError, match=match):
            resolve(bad, device="cuda:0", name="X")
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental")
    assert resolve("auto", device="cuda:0") == 0  # a torch without the binding: nothing to do
    with pytest.raises(ConfigError, match=r"X=2 needs torch._C._set_sm_carveout_experimental"):
        resolve(2, device="cuda:0", name="X")


def test_sm_carveout_with_this_torch_binding():
    # the real binding (torch 2.13 takes int | None): set, then back to what it was
    before = moe.current_sm_carveout()
    with moe.sm_carveout(3):
        assert torch._C._get_sm_carveout_experimental() == 3
        out = moe.grouped_mlp(torch.randn(5, HIDDEN), torch.tensor([2, 3]),
                              make_expert_weights(2, HIDDEN, INTER, dtype=torch.float32, device="cpu", seed=0))
    assert moe.current_sm_carveout() == before and out.shape == (5, HIDDEN)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mlp_cuda_is_bit_identical_under_an_sm_carveout():
    """The persistent grouped GEMM computes every tile the same way whatever its grid (no
    split-K, no stream-K in torch's grouped CUTLASS kernel): outputs with 2 and with half the
    SMs left free equal the default's bit for bit. 16 experts x 64 rows x 2048 columns: more
    tiles than SMs, so the grid really shrinks. The shared MLP (cuBLAS, which may pick another
    algorithm for a smaller SM target) is held to the bf16 tolerance only."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch._grouped_mm's CUTLASS path needs SM90/SM100")
    weights = make_expert_weights(16, 1024, 1024, dtype=torch.bfloat16, device="cuda", seed=4)
    shared = make_shared_weights(2, 1024, 1024, dtype=torch.bfloat16, device="cuda", seed=5)
    counts = torch.full((16,), 64, device="cuda")
    x = torch.randn(1024, 1024, device="cuda").bfloat16()
    assert moe.grouped_mm_supported(x, weights)
    want, want_shared = moe.grouped_mlp(x, counts, weights), moe.shared_mlp(x, shared)
    half = torch.cuda.get_device_properties(0).multi_processor_count // 2
    for n in (2, half):
        with moe.sm_carveout(n, device=x.device):
            got, got_shared = moe.grouped_mlp(x, counts, weights), moe.shared_mlp(x, shared)
        assert moe.current_sm_carveout() is None
        assert torch.equal(got, want), (n, float((got.float() - want.float()).abs().max()))
        torch.testing.assert_close(got_shared.float(), want_shared.float(), rtol=2e-2, atol=2e-2)
