"""FP8 (E4M3) expert weights: DeepSeek-V3's block-scaled checkpoint format, its conversion to the
per-output-channel format torch's scaled grouped GEMM runs, and :class:`FP8ExpertWeights`, the
routed experts :func:`afd_cupy.moe.grouped_mlp` computes in FP8 (docs/design/fp8.md). Part of
:mod:`afd_cupy.moe`.

Formats (E4M3 is ``torch.float8_e4m3fn``, largest finite value 448):

- **block-scaled** (a DeepSeek-V3 checkpoint): ``q`` [..., N, K] E4M3 and ``scale_inv`` fp32
  [..., ceil(N/128), ceil(K/128)]; the weight is ``q * scale_inv`` broadcast over 128x128 blocks
  (the last row and column of blocks may be partial). :func:`quantize_blockwise`,
  :func:`dequantize_blockwise`.
- **rowwise**: ``q`` [..., N, K] E4M3 and ``scale`` fp32 [..., N], one per row (per output
  channel of a weight, per token of an activation): ``q * scale[..., None]``.
  :func:`quantize_rowwise` (scale = amax(|row|) / 448), :func:`dequantize_rowwise`.
- :func:`blockwise_to_rowwise`: a block-scaled weight in the rowwise format. NOTE: torch has no
  block-scaled grouped GEMM on SM90 (``torch._scaled_grouped_mm`` takes tensorwise or rowwise
  scales), hence the conversion (docs/decisions/0027-fp8-rowwise-conversion.md). Each row keeps
  the largest block scale it spans: the row's values in that block keep their E4M3 codes
  exactly, the others are rounded once more (exactly kept too where the block scales of the row
  differ by powers of two).

Everything here is deterministic torch code that runs on any device; nothing touches CUDA at
import time.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from afd_cupy.moe.weights import EXPERT_ACTIVATIONS, ExpertWeights

__all__ = ["FP8_DTYPE", "FP8_MAX", "BLOCK", "FP8ExpertWeights", "quantize_blockwise",
           "dequantize_blockwise", "blockwise_to_rowwise", "quantize_rowwise", "dequantize_rowwise",
           "scaled_mm_device_reason", "scaled_mm_unavailable_reason", "num_blocks"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 (fn) value
BLOCK = 128  # DeepSeek-V3's weight block edge
_EPS = 1e-12  # amax floor: an all-zero row or block gets a tiny scale and zero codes
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# NOTE: torch._scaled_grouped_mm (aten ScaledBlas.cpp / GroupedMMUtils.h): E4M3 operands with
# fp32 rowwise scales on SM90 only, bf16 output, K and N strides multiples of 16 bytes, fewer
# than 1024 groups (one CUTLASS problem list)
_SCALED_MM_ARCH_MAJOR = 9
_SCALED_MM_MAX_GROUPS = 1023
_SCALED_MM_ALIGN = 16


def _to_e4m3(t: torch.Tensor) -> torch.Tensor:
    # NOTE: torch's cast does not saturate (values past 448 become NaN): clamp first
    return t.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check(t: torch.Tensor, name: str, dtypes, min_dim: int = 2) -> None:
    if t.dtype not in dtypes or t.dim() < min_dim:
        raise ValueError(f"{name} must be a {min_dim}-D or larger tensor of "
                         f"{' / '.join(map(str, dtypes))}, got {tuple(t.shape)} {t.dtype}")


def num_blocks(size: int) -> int:
    """Blocks of 128 along a dimension of ``size`` (the last one may be partial)."""
    return -(-size // BLOCK)


def _expand_blocks(scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """scale_inv [..., ceil(rows/128), ceil(cols/128)] -> [..., rows, cols], each block's value
    repeated over its 128x128 (or partial) block."""
    per_row = scale_inv.repeat_interleave(BLOCK, dim=-2)[..., :rows, :]
    return per_row.repeat_interleave(BLOCK, dim=-1)[..., :cols]


def quantize_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight in DeepSeek-V3's checkpoint format: w [..., N, K] float (any device) ->
    (q [..., N, K] E4M3, scale_inv fp32 [..., ceil(N/128), ceil(K/128)]), scale_inv = the
    block's amax(|w|) / 448 (floored at 1e-12 / 448), q = w / scale_inv rounded to nearest."""
    _check(w, "w", _FLOAT_DTYPES)
    rows, cols = w.shape[-2:]
    row_blocks, col_blocks = num_blocks(rows), num_blocks(cols)
    padded = F.pad(w.float().abs(), (0, col_blocks * BLOCK - cols, 0, row_blocks * BLOCK - rows))
    amax = padded.view(*w.shape[:-2], row_blocks, BLOCK, col_blocks, BLOCK).amax(dim=(-3, -1))
    scale_inv = amax.clamp(min=_EPS) / FP8_MAX
    return _to_e4m3(w.float() / _expand_blocks(scale_inv, rows, cols)), scale_inv


def _check_block_scales(q: torch.Tensor, scale_inv: torch.Tensor, name: str) -> None:
    _check(q, name, (FP8_DTYPE,))
    want = tuple(q.shape[:-2]) + (num_blocks(q.shape[-2]), num_blocks(q.shape[-1]))
    if tuple(scale_inv.shape) != want or scale_inv.dtype != torch.float32 \
            or scale_inv.device != q.device:
        raise ValueError(f"{name}'s scale_inv must be fp32 {list(want)} (one per 128x128 block of "
                         f"{name} {tuple(q.shape)}) on {q.device}, got {tuple(scale_inv.shape)} "
                         f"{scale_inv.dtype} on {scale_inv.device}")


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """q [..., N, K] E4M3, scale_inv fp32 [..., ceil(N/128), ceil(K/128)] -> fp32 [..., N, K]
    ``q * scale_inv`` per block (DeepSeek-V3's ``weight_dequant``), on q's device."""
    _check_block_scales(q, scale_inv, "q")
    return q.float() * _expand_blocks(scale_inv, *q.shape[-2:])


def blockwise_to_rowwise(q: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled weight (q [..., N, K] E4M3, scale_inv fp32 [..., ceil(N/128), ceil(K/128)])
    in the rowwise format: (q_row [..., N, K] E4M3, scale fp32 [..., N]). Row n's scale is the
    largest block scale of its row of blocks; its values are dequantized (fp32) and rounded to
    E4M3 at that scale (module doc: where the row's blocks share the scale, codes are kept)."""
    _check_block_scales(q, scale_inv, "q")
    rows = q.shape[-2]
    scale = scale_inv.amax(dim=-1).repeat_interleave(BLOCK, dim=-1)[..., :rows]  # [..., N]
    # |dequantized| <= 448 * scale: no value saturates
    return _to_e4m3(dequantize_blockwise(q, scale_inv) / scale.unsqueeze(-1)), scale.contiguous()


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with one fp32 scale per row: t [..., N, K] float -> (q [..., N, K] E4M3, scale fp32
    [..., N]), scale = amax(|row|) / 448 (floored: an all-zero row gets zeros). Device ops only
    (no host synchronization, no host-to-device copy: capturable in a CUDA graph)."""
    _check(t, "t", _FLOAT_DTYPES)
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    scale = amax.clamp(min=_EPS) / FP8_MAX
    return _to_e4m3(t.float() / scale), scale.squeeze(-1)


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rowwise`: q [..., N, K] E4M3, scale fp32 [..., N] -> fp32
    ``q * scale[..., None]``."""
    _check(q, "q", (FP8_DTYPE,))
    if tuple(scale.shape) != tuple(q.shape[:-1]) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 {list(q.shape[:-1])} (one per row of q "
                         f"{tuple(q.shape)}), got {tuple(scale.shape)} {scale.dtype}")
    return q.float() * scale.unsqueeze(-1)


# --------------------------------------------------------------------------- expert sets

@dataclass(frozen=True, eq=False)
class FP8ExpertWeights:
    """A set of gated MLP experts with E4M3 weights in the rowwise format: what
    ``moe.grouped_mlp`` runs through ``torch._scaled_grouped_mm`` (SM90) or its emulation.

    w13: E4M3 [num_experts, 2 * intermediate, hidden] (gate rows first, as ``ExpertWeights``),
    w13_scale: fp32 [num_experts, 2 * intermediate]; w2: E4M3 [num_experts, hidden,
    intermediate], w2_scale: fp32 [num_experts, hidden]; one device. Dequantized weight:
    ``w13.float() * w13_scale[..., None]``. num_experts, first_expert, activation,
    swiglu_limit, swiglu_alpha: as ``ExpertWeights``. No biases and no shared-expert gate.

    Build one with :meth:`quantize` (from an ``ExpertWeights``) or from a checkpoint with
    ``adapters.ffn_weights``. The experts take and return rows in the payload dtype (bf16 for
    the native GEMM; any float dtype on the emulated path).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    num_experts: int
    first_expert: int = 0
    activation: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    #: no biases, no gate (the attributes ``ExpertWeights`` readers look at)
    w13_bias = None
    w2_bias = None
    gate = None
    has_bias = False

    def __post_init__(self):
        w13, w2 = self.w13, self.w2
        if w13.dim() != 3 or w2.dim() != 3 or w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
            raise ValueError(f"w13 and w2 must be 3-D {FP8_DTYPE}, got w13 {tuple(w13.shape)} "
                             f"{w13.dtype}, w2 {tuple(w2.shape)} {w2.dtype}")
        num_experts, two_inter, hidden = w13.shape
        if two_inter % 2 or tuple(w2.shape) != (num_experts, hidden, two_inter // 2) \
                or num_experts != self.num_experts:
            raise ValueError(f"inconsistent expert shapes: w13 {tuple(w13.shape)} (expected [E, 2I, H]), "
                             f"w2 {tuple(w2.shape)} (expected {[num_experts, hidden, two_inter // 2]}), "
                             f"num_experts={self.num_experts}")
        for name, scale, want in (("w13_scale", self.w13_scale, (num_experts, two_inter)),
                                  ("w2_scale", self.w2_scale, (num_experts, hidden))):
            if tuple(scale.shape) != want or scale.dtype != torch.float32 or not scale.is_contiguous():
                raise ValueError(f"{name} must be contiguous fp32 {list(want)}, got "
                                 f"{tuple(scale.shape)} {scale.dtype}")
        devices = {t.device for t in (w13, w2, self.w13_scale, self.w2_scale)}
        if len(devices) != 1:
            raise ValueError(f"w13, w13_scale, w2 and w2_scale must share a device, got {sorted(map(str, devices))}")
        if self.first_expert < 0 or self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"need first_expert >= 0 and activation in {EXPERT_ACTIVATIONS}, got "
                             f"{self.first_expert}, {self.activation!r}")
        for name in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, E4M3 (the rows' dtype is the caller's payload dtype)."""
        return FP8_DTYPE

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def options(self) -> dict:
        """The keyword arguments both expert types share (ids, activation)."""
        return dict(num_experts=self.num_experts, first_expert=self.first_expert, activation=self.activation,
                    swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> ExpertWeights:
        """The same experts as an ``ExpertWeights`` in ``dtype`` (the weights these codes
        stand for, rounded once to ``dtype``), on this device."""
        return ExpertWeights(w13=dequantize_rowwise(self.w13, self.w13_scale).to(dtype),
                             w2=dequantize_rowwise(self.w2, self.w2_scale).to(dtype), **self.options())

    @classmethod
    def quantize(cls, weights: ExpertWeights, *, blockwise: bool = True) -> "FP8ExpertWeights":
        """``weights`` (no biases, no gate) in FP8, one expert at a time (fp32 temporaries of one
        expert, never the whole set). ``blockwise`` (default): as a DeepSeek-V3 checkpoint would
        store them (128x128 blocks, gate, up and down projections quantized apart), then
        converted with :func:`blockwise_to_rowwise`: what loading such a checkpoint gives.
        ``blockwise=False``: rowwise from the weights directly (:func:`quantize_rowwise`)."""
        if weights.has_bias or weights.gate is not None:
            raise ValueError("FP8ExpertWeights has no biases and no shared-expert gate; the weights carry "
                             f"w13_bias={weights.w13_bias is not None}, w2_bias={weights.w2_bias is not None}, "
                             f"gate={weights.gate is not None}")
        inter = weights.intermediate_size
        convert = _checkpoint_rowwise if blockwise else quantize_rowwise
        parts = {"w13": [], "w13_scale": [], "w2": [], "w2_scale": []}
        for expert in range(weights.num_experts):
            w13 = weights.w13[expert]
            halves = [convert(w13[:inter]), convert(w13[inter:])]
            for name, (q, scale) in (("w13", [torch.cat(t) for t in zip(*halves)]),
                                     ("w2", convert(weights.w2[expert]))):
                parts[name].append(q)
                parts[name + "_scale"].append(scale)
        stacked = {name: torch.stack(tensors) for name, tensors in parts.items()}
        return cls(**stacked, num_experts=weights.num_experts, first_expert=weights.first_expert,
                   activation=weights.activation, swiglu_limit=weights.swiglu_limit,
                   swiglu_alpha=weights.swiglu_alpha)


def _checkpoint_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return blockwise_to_rowwise(*quantize_blockwise(w))


def scaled_mm_device_reason(device) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot run on ``device`` (None: it can): it needs the
    op (torch >= 2.8) and a CUDA device of SM 9.x."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if device.type != "cuda":
        return f"torch._scaled_grouped_mm needs a CUDA device, got {device}"
    major = _arch_major(device)
    if major != _SCALED_MM_ARCH_MAJOR:
        return f"torch's FP8 grouped GEMM runs on SM90, this device is SM{major}x"
    return None


@functools.lru_cache(maxsize=None)
def _arch_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def scaled_mm_unavailable_reason(x: torch.Tensor, weights: FP8ExpertWeights) -> str | None:
    """Why ``moe.grouped_mlp`` runs ``weights`` on rows ``x`` emulated (the same E4M3 operands
    multiplied in fp32, per expert) instead of through ``torch._scaled_grouped_mm``; None:
    natively. Needs :func:`scaled_mm_device_reason` None, bf16 rows, hidden and intermediate
    sizes multiples of 16 (16-byte E4M3 strides), fewer than 1024 experts, contiguous 16-byte
    aligned weights. Reads no device memory and never synchronizes."""
    reason = scaled_mm_device_reason(x.device)
    if reason is not None:
        return reason
    if x.dtype != torch.bfloat16:
        return f"torch._scaled_grouped_mm writes bf16, the rows are {x.dtype}"
    if weights.hidden_size % _SCALED_MM_ALIGN or weights.intermediate_size % _SCALED_MM_ALIGN:
        return (f"hidden {weights.hidden_size} and intermediate {weights.intermediate_size} must be "
                f"multiples of {_SCALED_MM_ALIGN}")
    if weights.num_experts > _SCALED_MM_MAX_GROUPS:
        return f"{weights.num_experts} experts > {_SCALED_MM_MAX_GROUPS} (one grouped-GEMM problem list)"
    tensors = (weights.w13, weights.w2, weights.w13_scale, weights.w2_scale)
    if not all(t.is_contiguous() and t.data_ptr() % _SCALED_MM_ALIGN == 0 for t in tensors):
        return "the FP8 weights and scales must be contiguous and 16-byte aligned"
    return None
