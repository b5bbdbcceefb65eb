"""The experts' compute on the FFN side: the grouped routed MLP (:func:`grouped_mlp`, on
Hopper two ``torch._grouped_mm`` launches, or two ``torch._scaled_grouped_mm`` launches for
FP8 experts), the shared MLP (:func:`shared_mlp`) and the ``routed_scaling_factor`` rule
(:func:`apply_routed_scaling`, :func:`combine_scale`). Part of :mod:`afd_cupy.moe`.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from afd_cupy.moe import fp8
from afd_cupy.moe.fp8 import FP8ExpertWeights
from afd_cupy.moe.weights import ExpertWeights, act_and_mul, gated_activation

# NOTE: limits of torch._grouped_mm's CUTLASS path (aten/src/ATen/native/cuda/GroupMM.cu,
# GroupedMMUtils.h): fewer than 1024 groups; every operand's data pointer and leading
# stride aligned to 16 bytes; only SM90/SM100 run it without a host sync.
_GROUPED_MM_MAX_GROUPS = 1023
_GROUPED_MM_ALIGN_BYTES = 16
_GROUPED_MM_ARCH_MAJORS = (9, 10)


def _dense_mlp(x: torch.Tensor, weights: ExpertWeights, expert: int,
               compute_dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert`` of ``weights`` on x [n, H] -> [n, H] in compute_dtype (biases, if
    any, added by the GEMMs in compute_dtype)."""
    b13, b2 = weights.w13_bias, weights.w2_bias
    gate_up = F.linear(x.to(compute_dtype), weights.w13[expert].to(compute_dtype),
                       None if b13 is None else b13[expert].to(compute_dtype))
    return F.linear(act_and_mul(gate_up, compute_dtype, weights),
                    weights.w2[expert].to(compute_dtype),
                    None if b2 is None else b2[expert].to(compute_dtype))


def shared_mlp(x: torch.Tensor, shared_weights: ExpertWeights) -> torch.Tensor:
    """The shared experts on every row: x [n, H] (any device) -> [n, H] in x.dtype.

    shared_weights: one fused shared MLP (num_experts == 1: w13 [1, 2*S*I, H], w2 [1, H, S*I]),
    on x's device; its activation and biases apply as for routed experts; with a ``gate`` the
    output is scaled per token by sigmoid(x · gate), in fp32. On CUDA the GEMMs run in
    x.dtype (tensor cores, fp32 accumulation); elsewhere in fp32.
    Zero rows return an empty [0, H] tensor without launching anything.
    """
    if shared_weights.num_experts != 1 or x.dim() != 2 \
            or x.shape[1] != shared_weights.hidden_size:
        raise ValueError(f"shared_mlp needs x [n, {shared_weights.hidden_size}] and one fused "
                         f"shared MLP, got x {tuple(x.shape)}, num_experts="
                         f"{shared_weights.num_experts}")
    if x.shape[0] == 0:
        return x.new_empty((0, x.shape[1]))
    compute_dtype = x.dtype if x.is_cuda else torch.float32
    out = _dense_mlp(x, shared_weights, 0, compute_dtype)
    if shared_weights.gate is not None:
        factor = torch.sigmoid(F.linear(x.float(), shared_weights.gate.float()))  # [n, 1]
        return (out.float() * factor).to(x.dtype)
    return out.to(x.dtype)


# --------------------------------------------------------------------------- grouped GEMM

def grouped_mlp(x: torch.Tensor, group_counts: torch.Tensor,
                weights: ExpertWeights | FP8ExpertWeights, *,
                group_counts_host: list[int] | None = None) -> torch.Tensor:
    """Run each local expert on its rows: the FFN rank's routed compute.

    x: [num_rows, H] rows grouped by local expert (expert 0's rows first, then 1, ...),
       same dtype and device as `weights` (FP8 weights: any float dtype, their device); a
       view into a receive window is fine (not copied).
    group_counts: [weights.num_experts] any int dtype, on x's device (or CPU): rows per
       expert. NOTE: sum(group_counts) must equal num_rows; this is verified only when the
       counts are already on the host (group_counts_host given, CPU counts, or loop path).
    group_counts_host: the same counts as a host list, when the caller has them (e.g. from
       a decoded header), to spare the loop path its one `.tolist()` sync.
    Returns [num_rows, H] in x.dtype on x's device, a new tensor.

    Paths:
    - `grouped_mm_supported(x, weights)` (CUDA SM90/SM100, bf16, 16-byte aligned): two
      `torch._grouped_mm` launches (w13, then w2) with int32 cumulative offsets computed on
      the device: no host synchronization, safe inside CUDA graph capture. Expert biases
      add a row -> expert index (`repeat_interleave` with `output_size`: no sync either),
      a gather and an add per bias.
    - otherwise a per-expert loop over host counts, computed in fp32 (inputs and weights
      upcast per expert; reference-grade accuracy, slower), rounded once to x.dtype.
    - `FP8ExpertWeights` (`moe.fp8`): the rows quantized to E4M3 per row on the device, then
      per GEMM E4M3 x E4M3 with the rows' and the weights' per-output-channel scales; the
      activation in fp32, quantized per row again. Where `fp8.scaled_mm_unavailable_reason`
      is None (SM90, bf16 rows) two `torch._scaled_grouped_mm` launches: device offsets, no
      host synchronization, no host-to-device copy (group_counts on x's device): capturable.
      Elsewhere the same operands emulated: per expert, the E4M3 codes in fp32 multiplied,
      the scales applied to the product and the result rounded to x.dtype as torch's GEMM
      does (equal to the native path up to fp32 accumulation order); host counts, as the loop.
    Zero rows return an empty [0, H] tensor without launching anything.
    """
    _check_grouped_args(x, group_counts, weights, group_counts_host)
    if x.shape[0] == 0:
        return x.new_empty((0, weights.hidden_size))
    if isinstance(weights, FP8ExpertWeights):
        return _grouped_mlp_fp8(x, group_counts, weights, group_counts_host)
    if grouped_mm_supported(x, weights):
        return _grouped_mlp_fused(x, group_counts, weights)
    counts = group_counts_host if group_counts_host is not None else group_counts.tolist()
    _check_counts_sum(counts, x.shape[0])
    return _grouped_mlp_loop(x, counts, weights)


def grouped_mm_supported(x: torch.Tensor, weights: ExpertWeights) -> bool:
    """Whether `grouped_mlp` takes the `torch._grouped_mm` path for these operands.

    Requirements checked (torch's GroupedMMUtils.h / GroupMM.cu / GroupedBlas.cpp):
    - CUDA device of compute capability 9.x or 10.x: elsewhere torch falls back to a loop
      that copies the offsets to the host (a hidden sync), so our own loop is used instead;
    - x, w13, w2 all bf16 (the only dtype of the CUTLASS kernel);
    - fewer than 1024 groups;
    - every operand's data pointer 16-byte aligned and its non-unit stride a multiple of
      16 bytes: x row-major with stride(0) % 8 == 0; weights contiguous with H % 8 == 0 and
      I % 8 == 0, so that the "B" operands w13.transpose(1, 2) [E, H, 2I] and
      w2.transpose(1, 2) [E, I, H] are column-major views (K contiguous: no copy) and the
      [rows, 2I] / [rows, I] intermediates are unpadded.
    Reads no device memory and never synchronizes.
    """
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16:
        return False
    if _device_arch_major(x.device) not in _GROUPED_MM_ARCH_MAJORS:
        return False
    if weights.num_experts > _GROUPED_MM_MAX_GROUPS:
        return False
    return _is_aligned_for_grouped_mm(x, weights)


def _is_aligned_for_grouped_mm(x: torch.Tensor, weights: ExpertWeights) -> bool:
    elems = _GROUPED_MM_ALIGN_BYTES // x.element_size()
    dims_ok = weights.hidden_size % elems == 0 and weights.intermediate_size % elems == 0
    x_ok = x.stride(1) == 1 and x.stride(0) % elems == 0
    weights_ok = weights.w13.is_contiguous() and weights.w2.is_contiguous()
    ptrs = (x.data_ptr(), weights.w13.data_ptr(), weights.w2.data_ptr())
    ptrs_ok = all(ptr % _GROUPED_MM_ALIGN_BYTES == 0 for ptr in ptrs)
    return dims_ok and x_ok and weights_ok and ptrs_ok


@functools.lru_cache(maxsize=None)
def _device_arch_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def _grouped_mlp_fused(x: torch.Tensor, group_counts: torch.Tensor,
                       weights: ExpertWeights) -> torch.Tensor:
    """Two grouped GEMMs. NOTE: _grouped_mm leaves output rows past offs[-1] uninitialized;
    the caller guarantees offs[-1] == x.shape[0].

    Biases (``_grouped_mm`` takes none): each row's expert id comes from
    ``repeat_interleave`` with ``output_size`` given (no host sync); the gate/up bias is added
    in fp32 before the activation, the down bias to the x.dtype output. Without biases
    nothing of this runs."""
    # offs[g] is the END row of group g (group g spans [offs[g-1], offs[g])); an empty group
    # repeats the previous offset.
    offs = torch.cumsum(group_counts, dim=0, dtype=torch.int32).to(x.device, non_blocking=True)
    row_expert = None
    if weights.has_bias:
        row_expert = torch.repeat_interleave(
            torch.arange(weights.num_experts, device=x.device),
            group_counts.to(x.device, non_blocking=True), output_size=x.shape[0])
    gate_up = torch._grouped_mm(x, weights.w13.transpose(1, 2), offs=offs)
    b13 = None if weights.w13_bias is None else weights.w13_bias[row_expert]
    hidden = act_and_mul(gate_up, x.dtype, weights, b13)
    out = torch._grouped_mm(hidden, weights.w2.transpose(1, 2), offs=offs)
    if weights.w2_bias is not None:
        out.add_(weights.w2_bias[row_expert])
    return out


def _grouped_mlp_loop(x: torch.Tensor, counts: list[int], weights: ExpertWeights) -> torch.Tensor:
    out = torch.empty((x.shape[0], weights.hidden_size), dtype=x.dtype, device=x.device)
    start = 0
    for expert, num_rows in enumerate(counts):
        if num_rows == 0:
            continue
        rows = slice(start, start + num_rows)
        out[rows] = _dense_mlp(x[rows], weights, expert, torch.float32)
        start += num_rows
    return out


def _grouped_mlp_fp8(x: torch.Tensor, group_counts: torch.Tensor, weights: FP8ExpertWeights,
                     group_counts_host: list[int] | None) -> torch.Tensor:
    """FP8 experts on x [rows, H] -> [rows, H] x.dtype (``grouped_mlp``'s doc)."""
    if fp8.scaled_mm_unavailable_reason(x, weights) is None:
        offs = torch.cumsum(group_counts, dim=0, dtype=torch.int32).to(x.device, non_blocking=True)
        gemm = functools.partial(_scaled_grouped_mm, offs=offs)
    else:
        counts = group_counts_host if group_counts_host is not None else group_counts.tolist()
        _check_counts_sum(counts, x.shape[0])
        gemm = functools.partial(_emulated_scaled_mm, counts=counts)
    x_q, x_scale = fp8.quantize_rowwise(x)
    gate_up = gemm(x_q, x_scale, weights.w13, weights.w13_scale, out_dtype=x.dtype)
    hidden = gated_activation(gate_up.float(), weights.activation, swiglu_limit=weights.swiglu_limit,
                              swiglu_alpha=weights.swiglu_alpha)
    hidden_q, hidden_scale = fp8.quantize_rowwise(hidden)
    return gemm(hidden_q, hidden_scale, weights.w2, weights.w2_scale, out_dtype=x.dtype)


def _scaled_grouped_mm(a_q, a_scale, w_q, w_scale, *, offs, out_dtype) -> torch.Tensor:
    """a_q [rows, K] E4M3 row-major, a_scale fp32 [rows], w_q [E, N, K] E4M3 (its transpose is
    the column-major B), w_scale fp32 [E, N] -> [rows, N] out_dtype (bf16). NOTE: rows past
    offs[-1] would be left unwritten; the caller has offs[-1] == rows."""
    return torch._scaled_grouped_mm(a_q, w_q.transpose(1, 2), a_scale, w_scale, offs=offs,
                                    out_dtype=out_dtype)


def _emulated_scaled_mm(a_q, a_scale, w_q, w_scale, *, counts, out_dtype) -> torch.Tensor:
    """What :func:`_scaled_grouped_mm` computes, per expert on host counts: the E4M3 codes
    multiplied in fp32 (their products are exact), then both scales, then one rounding."""
    out = torch.empty((a_q.shape[0], w_q.shape[1]), dtype=out_dtype, device=a_q.device)
    start = 0
    for expert, num_rows in enumerate(counts):
        rows = slice(start, start + num_rows)
        if num_rows:
            product = a_q[rows].float() @ w_q[expert].float().T
            out[rows] = (product * a_scale[rows].unsqueeze(1) * w_scale[expert]).to(out_dtype)
        start += num_rows
    return out


def _check_grouped_args(x, group_counts, weights, group_counts_host) -> None:
    if x.dim() != 2 or x.shape[1] != weights.hidden_size:
        raise ValueError(f"x must be [num_rows, hidden={weights.hidden_size}], "
                         f"got {tuple(x.shape)}")
    if isinstance(weights, FP8ExpertWeights):
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.device != weights.device:
            raise ValueError(f"x ({x.dtype}, {x.device}) must be bf16, fp16 or fp32 rows on the FP8 "
                             f"experts' device ({weights.device})")
    elif x.dtype != weights.dtype or x.device != weights.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) must match the expert weights "
                         f"({weights.dtype}, {weights.device})")
    if group_counts.dim() != 1 or group_counts.shape[0] != weights.num_experts \
            or group_counts.is_floating_point():
        raise ValueError(f"group_counts must be an int tensor [{weights.num_experts}] "
                         f"(num local experts), got shape {tuple(group_counts.shape)} "
                         f"dtype {group_counts.dtype}")
    if group_counts_host is not None:
        if len(group_counts_host) != weights.num_experts:
            raise ValueError(f"group_counts_host has {len(group_counts_host)} entries, "
                             f"expected {weights.num_experts} (num local experts)")
        _check_counts_sum(group_counts_host, x.shape[0])
    elif group_counts.device.type == "cpu":
        _check_counts_sum(group_counts.tolist(), x.shape[0])


def _check_counts_sum(counts: list[int], num_rows: int) -> None:
    if any(count < 0 for count in counts) or sum(counts) != num_rows:
        raise ValueError(f"group counts {list(counts)} (sum {sum(counts)}) must be >= 0 and "
                         f"sum to x.shape[0] = {num_rows}")


# --------------------------------------------------------------------------- scaling rule

def apply_routed_scaling(routed_out: torch.Tensor, shared_out: torch.Tensor | None,
                         routed_scaling_factor: float
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The FFN-side `routed_scaling_factor` rule (f below). Out of place.

    routed_out: [num_routed, H], shared_out: [num_shared, H] or None; same dtype, any device.
    Returns (routed_out, shared_out) to send back:
    - bf16 / fp32: (routed * f, shared). The combined sum routed + shared is final.
    - fp16: (routed, shared / f). Why: routed outputs times f (DeepSeek: f = 2.5 .. 16) can
      overflow fp16, so the routed part is left unscaled and the shared part divided
      instead. The Attention-side sum is then (routed + shared / f), and the caller who
      wants the model's result multiplies the final sum by f: `combine_scale` returns that
      factor. This holds even when routed_out has zero rows (the shared part alone is still
      divided), so every rank's reply follows one convention.
    """
    if not (math.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
        raise ValueError(f"routed_scaling_factor must be finite and > 0, "
                         f"got {routed_scaling_factor}")
    if shared_out is not None and shared_out.dtype != routed_out.dtype:
        raise ValueError(f"routed_out ({routed_out.dtype}) and shared_out "
                         f"({shared_out.dtype}) must share a dtype")
    if routed_scaling_factor == 1.0:
        return routed_out, shared_out
    if routed_out.dtype == torch.float16:
        return routed_out, None if shared_out is None else shared_out / routed_scaling_factor
    return routed_out * routed_scaling_factor, shared_out


def combine_scale(dtype: torch.dtype, routed_scaling_factor: float) -> float:
    """The factor the Attention side multiplies the combined output by (after
    sum_k w*routed + shared): f for fp16 payloads (see `apply_routed_scaling`), else 1.0."""
    return float(routed_scaling_factor) if dtype == torch.float16 else 1.0
