"""afd_cupy.moe.expert_gemm: every variant of the routed grouped GEMM computes what the fp64
per-expert reference computes, on fresh random data, with the output pre-filled with NaN (an
unwritten row fails); FP8 (both weight formats, through moe.grouped_mlp) within its
quantization error (its formats and compute: test_fp8.py); the stream variants through Triton's
CPU interpreter (skipped without Triton; their kernel's own tests: test_stream_gemm.py). CPU in fp32 here; the cuda tests
compare each variant with the library's path in bf16 and inside a CUDA graph."""
import math

import pytest
import torch

from afd_cupy import moe
from afd_cupy.moe import expert_gemm


def _weights(num_experts, hidden, inter, *, dtype=torch.float32, device="cpu", seed=0,
             activation="silu"):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / math.sqrt(inter)
    return moe.ExpertWeights(w13=w13.to(device, dtype), w2=w2.to(device, dtype),
                             num_experts=num_experts, activation=activation)


def _reference(x, counts, weights) -> torch.Tensor:
    """fp64 per expert: glu(x W13^T) W2^T, rows grouped by expert."""
    out, start = [], 0
    inter = weights.intermediate_size
    for expert, num_rows in enumerate(counts):
        rows = x[start:start + num_rows].double()
        gate_up = rows @ weights.w13[expert].double().T
        hidden = moe.gated_activation(gate_up, weights.activation)
        assert hidden.shape[1] == inter
        out.append(hidden @ weights.w2[expert].double().T)
        start += num_rows
    return torch.cat(out)


# leading, inner and trailing empty experts; counts not multiples of 16; one big group
COUNTS = [0, 3, 0, 17, 1, 0, 40, 5, 0, 0]


def _run(variant, weights, x, counts, out=None):
    reason = expert_gemm.unavailable_reason(variant, x.device)
    if reason is not None:  # the stream variants without Triton (CI installs it)
        pytest.skip(reason)
    prepared = expert_gemm.prepare(weights, variant)
    device_counts = torch.tensor(counts, dtype=torch.int32, device=x.device)
    row_plan = expert_gemm.plan(prepared, device_counts, counts)
    return expert_gemm.run(prepared, x, row_plan, out)


@pytest.mark.parametrize("variant", expert_gemm.VARIANTS)
@pytest.mark.parametrize("activation", ["silu", "clamped_swiglu"])
def test_variant_matches_reference_fp32(variant, activation):
    weights = _weights(len(COUNTS), 64, 48, seed=hash(variant) % 1000, activation=activation)
    x = torch.randn(sum(COUNTS), 64, generator=torch.Generator().manual_seed(7)) * 2
    out = torch.full_like(x, float("nan"))
    got = _run(variant, weights, x, COUNTS, out)
    assert got is out
    assert not torch.isnan(out).any()
    ref = _reference(x, COUNTS, weights)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", expert_gemm.ALL_VARIANTS)
def test_variant_zero_rows_and_all_in_one_expert(variant):
    weights = _weights(4, 32, 16, seed=3)
    empty = _run(variant, weights, torch.empty(0, 32), [0, 0, 0, 0])
    assert empty.shape == (0, 32)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(5))
    got = _run(variant, weights, x, [0, 0, 9, 0])
    tol = 0.1 if variant in expert_gemm.FP8_VARIANTS else 1e-4
    ref = _reference(x, [0, 0, 9, 0], weights)
    assert float((got.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("variant", expert_gemm.FP8_VARIANTS)
def test_fp8_emulated_within_quantization_error(variant):
    weights = _weights(len(COUNTS), 128, 64, seed=11)
    x = torch.randn(sum(COUNTS), 128, generator=torch.Generator().manual_seed(12))
    out = torch.full_like(x, float("nan"))
    _run(variant, weights, x, COUNTS, out)
    ref = _reference(x, COUNTS, weights)
    rel = float((out.double() - ref).norm() / ref.norm())
    # E4M3 has a 3-bit mantissa: ~3.6 % rms per quantized element (weights and activations,
    # two GEMMs); errors and signal both add in quadrature over K, so the output keeps ~6 %
    assert 1e-3 < rel < 0.1, rel


def test_bad_arguments():
    weights = _weights(4, 32, 16)
    with pytest.raises(ValueError, match="variant must be one of"):
        expert_gemm.prepare(weights, "nope")
    biased = moe.ExpertWeights(weights.w13, weights.w2, 4, w2_bias=torch.zeros(4, 32))
    with pytest.raises(ValueError, match="without biases"):
        expert_gemm.prepare(biased, "current")
    prepared = expert_gemm.prepare(weights, "current")
    with pytest.raises(ValueError, match="4 counts"):
        expert_gemm.plan(prepared, torch.zeros(3, dtype=torch.int32), [1, 2, 3])
    row_plan = expert_gemm.plan(prepared, torch.tensor([1, 1, 0, 0]), [1, 1, 0, 0])
    with pytest.raises(ValueError, match=r"x must be \[2, 32\]"):
        expert_gemm.run(prepared, torch.zeros(3, 32), row_plan)
    with pytest.raises(ValueError, match="out must be"):
        expert_gemm.run(prepared, torch.zeros(2, 32), row_plan, out=torch.zeros(2, 31))


def test_fp8_unavailable_reason_on_cpu():
    reason = expert_gemm.fp8_unavailable_reason("cpu")
    assert reason is not None and ("CUDA" in reason or "no torch._scaled_grouped_mm" in reason)


# --------------------------------------------------------------------------- cuda

@pytest.mark.cuda
@pytest.mark.parametrize("variant", expert_gemm.ALL_VARIANTS)
def test_variant_matches_current_bf16_cuda_in_a_graph(variant):
    if variant in expert_gemm.FP8_VARIANTS and expert_gemm.fp8_unavailable_reason("cuda"):
        pytest.skip(expert_gemm.fp8_unavailable_reason("cuda"))
    if expert_gemm.unavailable_reason(variant, "cuda"):
        pytest.skip(expert_gemm.unavailable_reason(variant, "cuda"))
    counts = [0, 5, 0, 130, 1, 0, 64, 7] * 4
    weights = _weights(len(counts), 256, 128, dtype=torch.bfloat16, device="cuda", seed=21)
    x = (torch.randn(sum(counts), 256, generator=torch.Generator().manual_seed(22))).to("cuda", torch.bfloat16)
    ref = _reference(x.cpu().float(), counts, _weights(len(counts), 256, 128, seed=21))
    prepared = expert_gemm.prepare(weights, variant)
    row_plan = expert_gemm.plan(prepared, torch.tensor(counts, device="cuda"), counts)
    out = torch.full_like(x, float("nan"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        expert_gemm.run(prepared, x, row_plan, out)  # warm-up outside the capture
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expert_gemm.run(prepared, x, row_plan, out)
    graph.replay()
    torch.cuda.synchronize()
    got = out.double().cpu()
    assert not torch.isnan(got).any()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < (0.1 if variant in expert_gemm.FP8_VARIANTS else 1.5e-2), rel
