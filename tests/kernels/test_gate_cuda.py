"""``afd_gate_topk`` (raw_kernels/model/gate.cu) against its numpy twin ``gates.gate_topk_reference``
on one GPU: fresh random logits every run (the seed is in every failure message), outputs
pre-filled with NaN / -7 so that an element the kernel forgot shows, every payload dtype.

Ids are compared exactly on logits whose selections cannot tie after rounding
(``helpers.gates.separated_logits``) and up to ties on plain Gaussian logits (where two experts'
selections agree to 1e-6, either may come first); weights to a few ulp (``expf`` and the sum
orders differ from numpy's).
"""
from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch

from afd_cupy import kernels
from afd_cupy.kernels import PackedLaunch, specs
from afd_cupy.moe import gates

from helpers.gates import separated_logits

pytest.importorskip("cupy")
pytestmark = pytest.mark.cuda


TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SHAPES = [(8, 1), (8, 8), (64, 6), (100, 8), (160, 8), (256, 8), (1024, 32)]
WEIGHT_RTOL = 1e-5


@pytest.fixture
def seeded():
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), f"seed={seed}"


def run_kernel(logits: torch.Tensor, top_k: int, *, scoring: str, bias: torch.Tensor | None,
               renormalize: bool, max_blocks: int = specs.MAX_BLOCKS):
    """One launch through the spec (not the cached wrapper), outputs pre-filled with garbage."""
    num_tokens, num_experts = logits.shape
    weights = torch.full((num_tokens, top_k), float("nan"), dtype=torch.float32, device=logits.device)
    ids = torch.full((num_tokens, top_k), -7, dtype=torch.int32, device=logits.device)
    spec = specs.gate_topk_spec(
        dtype_code=kernels.DTYPE_CODES[str(logits.dtype).removeprefix("torch.")], logits=logits.data_ptr(),
        num_tokens=num_tokens, num_experts=num_experts, top_k=top_k,
        scoring=specs.GATE_SCORING[scoring], bias=0 if bias is None else bias.data_ptr(),
        renormalize=int(renormalize), topk_weights=weights.data_ptr(), topk_ids=ids.data_ptr(),
        max_blocks=max_blocks)
    PackedLaunch(spec).launch(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return weights.cpu().numpy(), ids.cpu().numpy()


def reference(logits: torch.Tensor, top_k: int, *, scoring: str, bias, renormalize: bool):
    return gates.gate_topk_reference(logits.float().cpu().numpy(), top_k, scoring_func=scoring,
                                     bias=None if bias is None else bias.cpu().numpy(),
                                     renormalize=renormalize)


def selections(logits: torch.Tensor, scoring: str, bias=None) -> np.ndarray:
    """[T, E] float32 selections in numpy (scores + bias), as the reference ranks them."""
    sel = gates.gate_scores_reference(logits.float().cpu().numpy(), scoring)
    return sel if bias is None else sel + bias.cpu().numpy()


def assert_ids_equal_up_to_ties(logits, got_ids, want_ids, scoring, bias, seed):
    """Every id in range and distinct per token, and the selections of the ids the kernel chose
    equal the reference's, rank by rank, within 1e-6 (two experts whose selections agree that
    closely may come in either order: the kernel's expf and sums round differently)."""
    num_experts, top_k = logits.shape[1], got_ids.shape[1]
    assert ((got_ids >= 0) & (got_ids < num_experts)).all(), seed
    assert all(len(set(row)) == top_k for row in got_ids.tolist()), seed
    sel = selections(logits, scoring, bias)
    got_sel = np.take_along_axis(sel, got_ids.astype(np.int64), axis=1)
    want_sel = np.take_along_axis(sel, want_ids.astype(np.int64), axis=1)
    np.testing.assert_allclose(got_sel, want_sel, rtol=1e-6, atol=1e-12, err_msg=seed)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("num_experts,top_k", SHAPES)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_gate_kernel_matches_reference_on_separated_logits(seeded, dtype, num_experts, top_k,
                                                           scoring, renormalize):
    rng, seed = seeded
    num_tokens = int(rng.integers(1, 300))
    logits = torch.from_numpy(separated_logits(rng, num_tokens, num_experts)).to("cuda", TORCH_DTYPES[dtype])
    got_w, got_ids = run_kernel(logits, top_k, scoring=scoring, bias=None, renormalize=renormalize)
    want_w, want_ids = reference(logits, top_k, scoring=scoring, bias=None, renormalize=renormalize)
    # rounded to bf16 / fp16, the ladder of 1024 experts has equal steps: ties, either order
    assert_ids_equal_up_to_ties(logits, got_ids, want_ids, scoring, None, seed)
    if dtype == "float32" or num_experts <= 256:
        np.testing.assert_array_equal(got_ids, want_ids, err_msg=seed)
    np.testing.assert_allclose(got_w, want_w, rtol=WEIGHT_RTOL, atol=1e-12, err_msg=seed)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_gate_kernel_selects_by_the_bias_and_weighs_by_the_score(seeded, dtype, scoring):
    # equal logits give every expert the same score (softmax: exactly 1/E for E = 64), so the
    # bias alone decides: ids = experts by decreasing bias; weights = the unbiased score
    rng, seed = seeded
    num_tokens, num_experts, top_k = int(rng.integers(1, 200)), 64, 8
    logits = torch.full((num_tokens, num_experts), float(rng.uniform(-2, 2)), dtype=TORCH_DTYPES[dtype], device="cuda")
    bias_np = rng.permutation(np.arange(num_experts, dtype=np.float32)) * np.float32(0.01)
    bias = torch.from_numpy(bias_np).cuda()
    got_w, got_ids = run_kernel(logits, top_k, scoring=scoring, bias=bias, renormalize=False)
    want_w, want_ids = reference(logits, top_k, scoring=scoring, bias=bias, renormalize=False)
    np.testing.assert_array_equal(got_ids, want_ids, err_msg=seed)
    np.testing.assert_array_equal(got_ids[0], np.argsort(-bias_np)[:top_k], err_msg=seed)
    np.testing.assert_allclose(got_w, want_w, rtol=WEIGHT_RTOL, err_msg=seed)
    got_w, _ = run_kernel(logits, top_k, scoring=scoring, bias=bias, renormalize=True)
    np.testing.assert_allclose(got_w, np.full_like(got_w, 1 / top_k), rtol=WEIGHT_RTOL, err_msg=seed)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_gate_kernel_on_gaussian_logits_up_to_ties(seeded, dtype, scoring):
    rng, seed = seeded
    num_tokens, num_experts, top_k = 512, 64, 8
    logits = torch.from_numpy(rng.standard_normal((num_tokens, num_experts)).astype(np.float32))
    logits = logits.to("cuda", TORCH_DTYPES[dtype])
    got_w, got_ids = run_kernel(logits, top_k, scoring=scoring, bias=None, renormalize=True)
    want_w, want_ids = reference(logits, top_k, scoring=scoring, bias=None, renormalize=True)
    assert_ids_equal_up_to_ties(logits, got_ids, want_ids, scoring, None, seed)
    same = (got_ids == want_ids).all(axis=1)  # rows without a tie inside the top-k: weights too
    assert same.mean() > 0.5, seed
    np.testing.assert_allclose(got_w[same], want_w[same], rtol=WEIGHT_RTOL, atol=1e-12, err_msg=seed)


def test_gate_kernel_ties_nan_and_grid_stride(seeded):
    rng, seed = seeded
    # ties go to the lower expert; NaN selections rank last; a NaN row still gives distinct
    # in-range ids; max_blocks=2 makes 16 warps stride over 100 tokens
    x = separated_logits(rng, 100, 16)
    x[0] = [1, 3, 3, 0, 3, 2, 2, 0] * 2
    x[1, :4] = np.nan
    x[2] = np.nan
    logits = torch.from_numpy(x).cuda()
    got_w, got_ids = run_kernel(logits, 4, scoring="sigmoid", bias=None, renormalize=False, max_blocks=2)
    want_w, want_ids = reference(logits, 4, scoring="sigmoid", bias=None, renormalize=False)
    np.testing.assert_array_equal(got_ids, want_ids, err_msg=seed)
    np.testing.assert_array_equal(got_ids[0], [1, 2, 4, 9])
    np.testing.assert_array_equal(got_ids[2], [0, 1, 2, 3])
    assert np.isnan(got_w[2]).all() and not np.isnan(got_w[np.r_[0:2, 3:100]]).any()
    np.testing.assert_allclose(got_w, want_w, rtol=WEIGHT_RTOL, err_msg=seed)


def test_select_experts_auto_uses_the_kernel_and_agrees_with_torch(seeded, monkeypatch):
    rng, seed = seeded
    from afd_cupy.backends import cuda_gate

    calls = []
    real = cuda_gate.select_experts
    monkeypatch.setattr(cuda_gate, "select_experts", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    logits = torch.from_numpy(separated_logits(rng, 77, 64)).to("cuda", torch.bfloat16)
    # a bias ladder with steps (2.0) wider than any score range: the bias alone orders, no ties
    bias = torch.from_numpy(rng.permutation(np.arange(64, dtype=np.float32)) * np.float32(2.0)).cuda()
    for kwargs in ({}, {"scoring_func": "sigmoid", "e_score_correction_bias": bias},
                   {"renormalize": False}):
        auto_w, auto_ids = gates.select_experts(logits, 6, **kwargs)
        torch_w, torch_ids = gates.select_experts(logits, 6, impl="torch", **kwargs)
        assert auto_ids.dtype == torch.int32 and auto_w.dtype == torch.float32 and auto_w.is_cuda
        assert torch.equal(auto_ids, torch_ids), seed
        torch.testing.assert_close(auto_w, torch_w, rtol=WEIGHT_RTOL, atol=1e-12, msg=seed)
    assert len(calls) == 3  # the three "auto" calls, not the "torch" ones
    empty_w, empty_ids = gates.select_experts(logits[:0], 6)
    assert empty_w.shape == empty_ids.shape == (0, 6) and len(calls) == 4
    # the grouped gates stay on torch's ops
    gates.select_experts(logits.float(), 6, use_grouped_topk=True, num_expert_group=8, topk_group=4)
    assert len(calls) == 4


def test_select_experts_kernel_in_a_cuda_graph(seeded):
    rng, seed = seeded
    static = torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda")
    gates.select_experts(static, 8)  # warm-up: compile and pack outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = gates.select_experts(static, 8, impl="kernel")
    for _ in range(3):
        fresh = torch.from_numpy(separated_logits(rng, 64, 128)).to("cuda", torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        want_w, want_ids = reference(fresh, 8, scoring="softmax", bias=None, renormalize=True)
        np.testing.assert_array_equal(ids.cpu().numpy(), want_ids, err_msg=seed)
        np.testing.assert_allclose(weights.cpu().numpy(), want_w, rtol=WEIGHT_RTOL, err_msg=seed)
