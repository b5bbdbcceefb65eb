"""Variants of the routed experts' grouped GEMM, to find the fastest torch path per size.

The library computes the routed experts with :func:`afd_cupy.moe.grouped_mlp` (on Hopper two
``torch._grouped_mm`` launches over fused gate/up weights). This module holds the other
candidate paths of issue #34 so that ``tools/bench_moe_layer.py --gemm-variants`` can time
them against it on the same rows; it changes no default (the FFN side still calls
``moe.grouped_mlp``).

Each variant runs in two steps: :func:`prepare` once per expert set (a variant may keep its
own copy of the weights in another layout, or FP8), :func:`plan` once per routing (host work
and host-to-device copies from the group counts), then :func:`run` (device work only: no host
synchronization, no host-to-device copy, so a CUDA graph can capture it on SM90/SM100).

Variants (``VARIANTS``), all computing ``glu(x @ w1.T, x @ w3.T) @ w2.T`` per expert:

- ``current``: ``moe.grouped_mlp`` itself (the reference of the others).
- ``split_gate_up``: gate and up projections as two grouped GEMMs (contiguous w1, w3 copies)
  instead of one over the fused w13.
- ``trim_empty``: the leading and trailing experts without rows are left out of the problem
  list (weights sliced, no copy; inner empty groups stay).
- ``per_expert``: one dense GEMM pair per expert that has rows (empty experts skipped
  entirely), host counts.
- ``kn_layout``: weights stored transposed and contiguous (``[E, H, 2I]``, ``[E, I, H]``: the
  GEMMs' B operands row-major) instead of as column-major views of the nn.Linear layout.
- ``pad_rows16``: every group's rows padded to a multiple of 16 (zero rows), so that each
  group starts on a tile boundary.
- ``padded_bmm``: every expert's rows padded to the most any expert has (rounded up to 64),
  then two batched dense GEMMs (``torch.bmm``, cuBLAS) over [E, rows, ...]: dense tiles at
  the price of the padding (a prefill candidate; empty experts still cost their padded rows).
- ``carveout_auto``: ``current`` inside ``moe.sm_carveout`` with the FFN side's "auto" value
  (``current`` itself runs with no carve-out).
- ``stream``: :mod:`afd_cupy.moe.stream_gemm`'s weight-streaming Triton kernels (a program per
  expert and tile of output channels, gate and up in one program, ``silu(gate) * up`` fused);
  ``stream_fp8`` (an FP8 variant): the same on a block-scaled checkpoint's E4M3 weights
  converted per output channel, widened in registers, the rows kept in their dtype.
- ``fp8_rowwise`` and ``fp8_block`` (``FP8_VARIANTS``, timed separately): the library's FP8
  experts (``moe.FP8ExpertWeights`` through ``moe.grouped_mlp``: E4M3 weights with one fp32
  scale per output channel, per-row dynamic E4M3 activations, ``torch._scaled_grouped_mm``),
  the weights quantized per row from the bf16 ones (``fp8_rowwise``) or as a DeepSeek-V3
  checkpoint stores them, 128x128 blocks, then converted (``fp8_block``: what an FP8
  checkpoint serves with). Where torch's FP8 grouped GEMM cannot run (the CPU, an older torch,
  not SM90) it is emulated, so that its numerics can be tested anywhere
  (``fp8_unavailable_reason``).

Supported: the gated activations of ``moe.EXPERT_ACTIVATIONS``, no expert biases (the
benchmark's experts have none; ValueError otherwise). On the CPU every variant computes in
x.dtype (fp32 in the tests) with torch's own ``_grouped_mm`` loop. Nothing here touches CUDA
at import time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from afd_cupy import moe
from afd_cupy.moe import fp8, stream_gemm

__all__ = ["VARIANTS", "FP8_VARIANT", "FP8_BLOCK_VARIANT", "FP8_STREAM_VARIANT", "FP8_VARIANTS",
           "STREAM_VARIANTS", "PreparedExperts", "RowPlan", "prepare", "plan", "run",
           "fp8_unavailable_reason", "unavailable_reason"]

VARIANTS = ("current", "split_gate_up", "trim_empty", "per_expert", "kn_layout", "pad_rows16",
            "carveout_auto", "stream", "padded_bmm")
FP8_VARIANT = "fp8_rowwise"
FP8_BLOCK_VARIANT = "fp8_block"
FP8_STREAM_VARIANT = "stream_fp8"
FP8_VARIANTS = (FP8_VARIANT, FP8_BLOCK_VARIANT, FP8_STREAM_VARIANT)
#: the variants of :mod:`afd_cupy.moe.stream_gemm` (they need Triton: :func:`unavailable_reason`)
STREAM_VARIANTS = ("stream", FP8_STREAM_VARIANT)
ALL_VARIANTS = VARIANTS + FP8_VARIANTS

#: rows per group of ``pad_rows16``; the row multiple of ``padded_bmm``'s common group size
PAD_ROWS = 16
BMM_ROWS = 64


@dataclass(frozen=True, eq=False)
class PreparedExperts:
    """One variant's weights. ``weights``: the source set. ``w_a`` / ``w_b`` / ``w_c``: the
    variant's own tensors (split: w1 [E, I, H], w3 [E, I, H], w2; kn: [E, H, 2I], [E, I, H]),
    else None. ``fp8_weights``: the FP8 variants' ``moe.FP8ExpertWeights``. ``carveout``: SMs
    left free (carveout_auto)."""

    variant: str
    weights: moe.ExpertWeights
    w_a: torch.Tensor | None = None
    w_b: torch.Tensor | None = None
    w_c: torch.Tensor | None = None
    fp8_weights: moe.FP8ExpertWeights | None = None
    carveout: int = 0


@dataclass(frozen=True, eq=False)
class RowPlan:
    """Per routing, from the counts: ``counts`` (device int32 [E]), ``counts_host`` (list),
    ``offs`` (device int32 cumulative end rows of the variant's groups), ``first``/``last``
    (trim_empty: the expert range kept), ``pad_index`` (pad_rows16: int64 [rows] destination
    row of each input row in the padded buffer, on the device), ``padded_rows``."""

    counts: torch.Tensor
    counts_host: list
    offs: torch.Tensor
    first: int = 0
    last: int = 0
    pad_index: torch.Tensor | None = None
    padded_rows: int = 0


def fp8_unavailable_reason(device) -> str | None:
    """Why the FP8 variants run emulated on ``device`` (None: torch's scaled grouped GEMM)."""
    return fp8.scaled_mm_device_reason(device)


def unavailable_reason(variant: str, device) -> str | None:
    """Why ``variant`` cannot run on ``device`` at all (None: it can; the FP8 variants of
    ``moe.grouped_mlp`` always can, emulated where :func:`fp8_unavailable_reason` says)."""
    if variant in STREAM_VARIANTS:
        return stream_gemm.unavailable_reason(device)
    return None


# --------------------------------------------------------------------------- prepare / plan

def prepare(weights: moe.ExpertWeights, variant: str) -> PreparedExperts:
    """The variant's weights from ``weights`` (a local or global set, no biases). Copies for
    split_gate_up / kn_layout (one more copy of w13 or of both) and the FP8 variants (E4M3,
    half the bytes, quantized one expert at a time); the others keep views. ValueError for an unknown variant or biases."""
    if variant not in ALL_VARIANTS:
        raise ValueError(f"variant must be one of {ALL_VARIANTS}, got {variant!r}")
    if weights.has_bias:
        raise ValueError(f"expert_gemm variants run experts without biases; {variant!r} got biases")
    inter = weights.intermediate_size
    if variant == "split_gate_up":
        return PreparedExperts(variant, weights, weights.w13[:, :inter].contiguous(),
                               weights.w13[:, inter:].contiguous(), weights.w2)
    if variant == "kn_layout":
        return PreparedExperts(variant, weights, weights.w13.transpose(1, 2).contiguous(),
                               weights.w2.transpose(1, 2).contiguous())
    reason = unavailable_reason(variant, weights.device)
    if reason is not None:
        raise ValueError(f"variant {variant!r} cannot run on {weights.device}: {reason}")
    if variant in FP8_VARIANTS:
        blockwise = variant in (FP8_BLOCK_VARIANT, FP8_STREAM_VARIANT)  # as a checkpoint stores them
        fp8_weights = moe.FP8ExpertWeights.quantize(weights, blockwise=blockwise)
        return PreparedExperts(variant, weights, fp8_weights=fp8_weights)
    carveout = 0
    if variant == "carveout_auto":
        carveout = moe.resolve_gemm_sm_carveout("auto", device=weights.device)
    return PreparedExperts(variant, weights, carveout=carveout)


def plan(prepared: PreparedExperts, group_counts: torch.Tensor, group_counts_host) -> RowPlan:
    """Host-side work of one routing: ``group_counts`` int [E] on the weights' device,
    ``group_counts_host`` the same as a list (sum = the rows :func:`run` gets). May copy host
    arrays to the device (pad_rows16): run it outside a CUDA graph capture."""
    counts_host = [int(c) for c in group_counts_host]
    num_experts = prepared.weights.num_experts
    if len(counts_host) != num_experts or min(counts_host, default=0) < 0:
        raise ValueError(f"group_counts_host must be {num_experts} counts >= 0, got {counts_host}")
    device = prepared.weights.device
    counts = group_counts.to(device=device, dtype=torch.int32)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    hit = [e for e, c in enumerate(counts_host) if c]
    if prepared.variant == "trim_empty" and hit:
        first, last = hit[0], hit[-1] + 1
        return RowPlan(counts, counts_host, offs[first:last].clone(), first, last)  # own, aligned
    if prepared.variant == "pad_rows16":
        return _pad_plan(counts, counts_host, device)
    if prepared.variant == "padded_bmm":
        width = max(BMM_ROWS, -(-max(counts_host, default=0) // BMM_ROWS) * BMM_ROWS)
        return _pad_plan(counts, counts_host, device, padded=np.full(num_experts, width, np.int64))
    return RowPlan(counts, counts_host, offs, 0, num_experts)


def _pad_plan(counts, counts_host, device, padded=None) -> RowPlan:
    """Each expert's rows moved to the start of its group of ``padded`` rows (default: its
    count rounded up to PAD_ROWS)."""
    counts_np = np.asarray(counts_host, np.int64)
    padded = -(-counts_np // PAD_ROWS) * PAD_ROWS if padded is None else padded
    src_start = np.cumsum(counts_np) - counts_np
    dst_start = np.cumsum(padded) - padded
    index = np.repeat(dst_start - src_start, counts_np) + np.arange(int(counts_np.sum()))
    pad_index = torch.from_numpy(index).to(device)
    pad_offs = torch.from_numpy(np.cumsum(padded).astype(np.int32)).to(device)
    return RowPlan(counts, counts_host, pad_offs, pad_index=pad_index, padded_rows=int(padded.sum()))


# --------------------------------------------------------------------------- run

def run(prepared: PreparedExperts, x: torch.Tensor, row_plan: RowPlan,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts on x [rows, H] (grouped by expert as ``moe.grouped_mlp`` takes them,
    the weights' dtype and device) -> [rows, H] in x.dtype: ``out`` when given (written in
    place: per_expert writes each expert's rows into it, the others copy their result in),
    else a new tensor. Device work only (capturable in a CUDA graph where
    ``torch._grouped_mm`` is: SM90/SM100)."""
    weights = prepared.weights
    rows = sum(row_plan.counts_host)
    if x.dim() != 2 or x.shape[1] != weights.hidden_size or x.shape[0] != rows:
        raise ValueError(f"x must be [{rows}, {weights.hidden_size}] (the plan's rows), got "
                         f"{tuple(x.shape)}")
    if out is not None and (tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype
                            or out.device != x.device):
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if prepared.variant == "per_expert":
        return _per_expert(x, row_plan.counts_host, weights, out)
    result = _compute(prepared, x, row_plan) if rows else x.new_empty((0, weights.hidden_size))
    return result if out is None else out.copy_(result)


def _compute(prepared: PreparedExperts, x: torch.Tensor, row_plan: RowPlan) -> torch.Tensor:
    weights, variant = prepared.weights, prepared.variant
    if variant in ("current", "carveout_auto"):
        with moe.sm_carveout(prepared.carveout, device=x.device):
            return moe.grouped_mlp(x, row_plan.counts, weights, group_counts_host=row_plan.counts_host)
    if variant == "pad_rows16":
        padded = x.new_zeros((row_plan.padded_rows, x.shape[1]))
        padded.index_copy_(0, row_plan.pad_index, x)
        out = _fused_pair(padded, weights.w13.transpose(1, 2), weights.w2.transpose(1, 2),
                          row_plan.offs, weights)
        return out.index_select(0, row_plan.pad_index)
    if variant == "padded_bmm":
        num_experts = weights.num_experts
        padded = x.new_zeros((row_plan.padded_rows, x.shape[1]))
        padded.index_copy_(0, row_plan.pad_index, x)
        groups = padded.view(num_experts, -1, x.shape[1])
        hidden = _glu(torch.bmm(groups, weights.w13.transpose(1, 2)), weights, x.dtype)
        out = torch.bmm(hidden, weights.w2.transpose(1, 2)).reshape(row_plan.padded_rows, -1)
        return out.index_select(0, row_plan.pad_index)
    if variant == "trim_empty":
        kept = slice(row_plan.first, row_plan.last)
        return _fused_pair(x, weights.w13[kept].transpose(1, 2), weights.w2[kept].transpose(1, 2),
                           row_plan.offs, weights)
    if variant == "kn_layout":
        return _fused_pair(x, prepared.w_a, prepared.w_b, row_plan.offs, weights)
    if variant == "split_gate_up":
        return _split_pair(x, prepared, row_plan.offs)
    if variant in STREAM_VARIANTS:
        return stream_gemm.grouped_mlp_streamed(x, row_plan.counts, prepared.fp8_weights or weights)
    return moe.grouped_mlp(x, row_plan.counts, prepared.fp8_weights, group_counts_host=row_plan.counts_host)


def _glu(gate_up: torch.Tensor, weights: moe.ExpertWeights, out_dtype) -> torch.Tensor:
    """glu of the fused [n, 2I] pre-activation, in fp32, rounded once to ``out_dtype``."""
    return moe.gated_activation(gate_up.float(), weights.activation, swiglu_limit=weights.swiglu_limit,
                                swiglu_alpha=weights.swiglu_alpha).to(out_dtype)


def _fused_pair(x, w13_b, w2_b, offs, weights) -> torch.Tensor:
    """Two grouped GEMMs with the B operands given ([G, H, 2I], [G, I, H], any layout)."""
    gate_up = torch._grouped_mm(x, w13_b, offs=offs)
    return torch._grouped_mm(_glu(gate_up, weights, x.dtype), w2_b, offs=offs)


def _split_pair(x, prepared: PreparedExperts, offs) -> torch.Tensor:
    weights = prepared.weights
    gate = torch._grouped_mm(x, prepared.w_a.transpose(1, 2), offs=offs)
    up = torch._grouped_mm(x, prepared.w_b.transpose(1, 2), offs=offs)
    hidden = _glu(torch.cat([gate, up], dim=-1), weights, x.dtype)
    return torch._grouped_mm(hidden, prepared.w_c.transpose(1, 2), offs=offs)


def _per_expert(x, counts_host: list, weights: moe.ExpertWeights, out=None) -> torch.Tensor:
    """One dense pair per expert with rows, in x.dtype (bf16 on a GPU: tensor cores), written
    into ``out`` (or a new tensor)."""
    if out is None:
        out = torch.empty((x.shape[0], weights.hidden_size), dtype=x.dtype, device=x.device)
    start = 0
    for expert, num_rows in enumerate(counts_host):
        if not num_rows:
            continue
        rows = slice(start, start + num_rows)
        gate_up = torch.nn.functional.linear(x[rows], weights.w13[expert])
        out[rows] = torch.nn.functional.linear(_glu(gate_up, weights, x.dtype), weights.w2[expert])
        start += num_rows
    return out
