"""The numpy reference of afd_cupy.moe.stream_gemm and random expert sets for its tests (the
CPU interpreter's and the GPU's)."""
from __future__ import annotations

import numpy as np
import torch

from afd_cupy import moe
from afd_cupy.moe.weights import EXPERT_ACTIVATIONS, gated_activation

__all__ = ["random_experts", "random_counts", "random_rows", "rel_error", "stream_reference", "EXPERT_ACTIVATIONS"]


def random_experts(rng, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device="cpu",
                   activation: str = "silu", fp8: bool = False):
    """Experts of N(0, 1/fan_in) weights in ``dtype`` (``fp8``: the same quantized as a
    DeepSeek-V3 block-scaled checkpoint, then converted: ``moe.FP8ExpertWeights``)."""
    gen = torch.Generator(device).manual_seed(int(rng.integers(2 ** 31)))  # drawn where they live

    def draw(shape, fan_in):
        return (torch.randn(shape, generator=gen, device=device) / fan_in ** 0.5).to(dtype)

    weights = moe.ExpertWeights(draw((num_experts, 2 * inter, hidden), hidden),
                                draw((num_experts, hidden, inter), inter), num_experts, activation=activation)
    return moe.FP8ExpertWeights.quantize(weights, blockwise=True) if fp8 else weights


def random_counts(rng, num_experts: int, mean_rows: float, *, empty: int = 1, big: int = 1) -> np.ndarray:
    """Rows per expert: Poisson(mean_rows), ``empty`` experts forced to 0 rows and ``big``
    experts to 3x the mean + 20 (more than one row tile)."""
    counts = rng.poisson(mean_rows, num_experts)
    picks = rng.permutation(num_experts)
    counts[picks[:empty]] = 0
    counts[picks[empty:empty + big]] = int(3 * mean_rows) + 20
    return counts


def random_rows(rng, counts, hidden: int, dtype: torch.dtype, device="cpu", stride_pad: int = 0) -> torch.Tensor:
    """x [sum(counts), hidden] N(0, 1) in ``dtype`` on ``device``; with ``stride_pad`` a view
    into wider rows."""
    full = torch.tensor(rng.standard_normal((int(counts.sum()), hidden + stride_pad)), dtype=dtype, device=device)
    return full[:, :hidden]


def rel_error(got: torch.Tensor, want: np.ndarray) -> float:
    """Max abs error of ``got`` (any device) against the float64 ``want``, relative to max |want|;
    fails on a NaN left by the prefill (a row the kernel did not write)."""
    got = got.double().cpu()
    assert not torch.isnan(got).any(), "a row was left unwritten (NaN prefill)"
    return float(np.abs(got.numpy() - want).max() / max(np.abs(want).max(), 1e-30))


def _round(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(values).to(dtype).double().numpy()


def stream_reference(x: torch.Tensor, counts, weights) -> np.ndarray:
    """What ``grouped_mlp_streamed`` computes, in float64 with its roundings: per expert,
    ``silu(gate) * up`` rounded once to x.dtype (other activations: the gate/up product rounded
    to x.dtype, the activation in fp32, rounded), then the down product rounded to x.dtype. FP8
    weights: the E4M3 codes times their channel's scale. Returns float64 [rows, H]."""
    is_fp8 = isinstance(weights, moe.FP8ExpertWeights)
    w13 = weights.w13.double().cpu().numpy()
    w2 = weights.w2.double().cpu().numpy()
    if is_fp8:
        w13 = w13 * weights.w13_scale.double().cpu().numpy()[..., None]
        w2 = w2 * weights.w2_scale.double().cpu().numpy()[..., None]
    xs = x.double().cpu().numpy()
    inter = weights.intermediate_size
    out = np.full((xs.shape[0], weights.hidden_size), np.nan)
    start = 0
    for expert, num in enumerate(int(c) for c in counts):
        rows = xs[start:start + num]
        gate_up = rows @ w13[expert].T
        if weights.activation == "silu":
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            hidden = _round(gate / (1.0 + np.exp(-gate)) * up, x.dtype)
        else:
            gate_up = torch.from_numpy(_round(gate_up, x.dtype)).float()
            hidden = _round(gated_activation(gate_up, weights.activation).double().numpy(), x.dtype)
        out[start:start + num] = _round(hidden @ w2[expert].T, x.dtype)
        start += num
    return out
