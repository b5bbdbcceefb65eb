"""The greedy gate's numpy twin (``gates.gate_topk_reference``, what ``raw_kernels/model/gate.cu``
computes) against torch's ``select_experts`` on the CPU, and ``select_experts(impl=...)``.

The kernel itself runs in tests/kernels/test_gate_cuda.py (GPU) against the same reference.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from afd_cupy.moe import gates

from helpers.gates import separated_logits


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (64, 6), (160, 8), (256, 8), (1024, 32)])
def test_reference_equals_torch_greedy_gate(scoring, with_bias, renormalize, num_experts, top_k):
    rng = np.random.default_rng(num_experts * 7 + top_k)
    logits = separated_logits(rng, 97, num_experts)
    # a bias below the ladder's spacing keeps the selections apart too
    bias = rng.uniform(-0.01, 0.01, num_experts).astype(np.float32) if with_bias else None
    weights, ids = gates.gate_topk_reference(logits, top_k, scoring_func=scoring, bias=bias,
                                             renormalize=renormalize)
    want_w, want_ids = gates.select_experts(
        torch.from_numpy(logits), top_k, scoring_func=scoring, renormalize=renormalize,
        e_score_correction_bias=None if bias is None else torch.from_numpy(bias), impl="torch")
    assert ids.dtype == np.int32 and weights.dtype == np.float32 and ids.shape == (97, top_k)
    np.testing.assert_array_equal(ids, want_ids.numpy())
    np.testing.assert_allclose(weights, want_w.numpy(), rtol=2e-6, atol=1e-9)


def test_reference_breaks_ties_by_the_lower_expert_and_ranks_nan_last():
    logits = np.zeros((3, 8), np.float32)
    logits[0] = [1, 3, 3, 0, 3, 2, 2, 0]          # ties at 3 and at 2
    logits[1] = [np.nan, 1, np.nan, 2, 0, 0, 0, 0]  # sigmoid(NaN) = NaN: below every number
    logits[2] = np.nan                              # every selection NaN: ids 0, 1, 2 in order
    weights, ids = gates.gate_topk_reference(logits, 3, scoring_func="sigmoid", renormalize=False)
    np.testing.assert_array_equal(ids, [[1, 2, 4], [3, 1, 4], [0, 1, 2]])
    assert np.isnan(weights[2]).all() and not np.isnan(weights[:2]).any()
    sig = 1 / (1 + np.exp(-np.float32(3)))
    np.testing.assert_allclose(weights[0], [sig] * 3, rtol=1e-6)


def test_reference_renormalizes_in_k_order_in_float32():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((40, 32)).astype(np.float32)
    weights, ids = gates.gate_topk_reference(logits, 5)
    raw, raw_ids = gates.gate_topk_reference(logits, 5, renormalize=False)
    np.testing.assert_array_equal(ids, raw_ids)
    total = np.zeros(40, np.float32)
    for k in range(5):
        total = (total + raw[:, k]).astype(np.float32)
    np.testing.assert_array_equal(weights, raw / total[:, None])


def test_select_experts_impl_on_the_cpu():
    # CPU logits: "auto" is torch's path (bit for bit); "kernel" says why it cannot run
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    auto = gates.select_experts(logits, 4)
    plain = gates.select_experts(logits, 4, impl="torch")
    assert torch.equal(auto[0], plain[0]) and torch.equal(auto[1], plain[1])
    with pytest.raises(ValueError, match=r"select_experts\(impl='kernel'\) cannot run the kernel: the logits are on cpu"):
        gates.select_experts(logits, 4, impl="kernel")
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'torch', 'kernel'\), got 'fast'"):
        gates.select_experts(logits, 4, impl="fast")
    with pytest.raises(ValueError, match=r"grouped gates run with torch's ops"):
        gates.select_experts(logits, 4, use_grouped_topk=True, num_expert_group=8, topk_group=2,
                             impl="kernel")


def test_unsupported_reasons_name_the_limit():
    from afd_cupy.backends import cuda_gate
    from afd_cupy.kernels import specs

    class FakeCuda:  # only what unsupported_reason reads
        is_cuda, device = True, torch.device("cuda", 0)

        def __init__(self, dtype=torch.bfloat16, num_experts=64):
            self.dtype, self.shape = dtype, (4, num_experts)

    assert "logits dtype torch.float64" in cuda_gate.unsupported_reason(FakeCuda(torch.float64), 2, None)
    too_many = specs.KERNEL_LIMITS["GATE_MAX_EXPERTS"] + 1
    assert f"{too_many} experts > GATE_MAX_EXPERTS" in cuda_gate.unsupported_reason(FakeCuda(num_experts=too_many), 2, None)
    assert "top_k 33 > GATE_MAX_TOP_K = 32" in cuda_gate.unsupported_reason(FakeCuda(), 33, None)
    assert "the bias is on cpu" in cuda_gate.unsupported_reason(FakeCuda(), 2, torch.zeros(64))
