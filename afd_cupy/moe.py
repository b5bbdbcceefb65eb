"""The MoE layer's expert math: expert weights, grouped GEMM, shared experts, scaling rule.

The gates (router logits -> topk_weights, topk_ids) are in :mod:`afd_cupy.gates`.
FFN side: `grouped_mlp` runs the local experts over rows that arrive already grouped by
local expert (the wire format's `routed_x`), `shared_mlp` runs the shared experts, and
`apply_routed_scaling` applies `routed_scaling_factor` by the FFN-side rule. The Attention
side's combine multiplies by `combine_scale` at the end. Test fixtures (deterministic
weights, the naive fp64 reference) live in :mod:`afd_cupy.testing.reference`.

Experts are gated MLPs, ``out = glu(x @ w1.T + b1, x @ w3.T + b3) @ w2.T + b2``, stored with
fused gate/up weights ``w13 = cat([w1, w3])`` of shape [E, 2*I, H] and ``w2`` [E, H, I]
(torch.nn.Linear layout: out_features first); the biases are optional
(``ExpertWeights.w13_bias`` [E, 2*I] = cat([b1, b3]), ``w2_bias`` [E, H]). The gated
activation ``glu(gate, up)`` (``ExpertWeights.activation``, see ``gated_activation``) is
``act(gate) * up`` with act SiLU (default) or GELU (erf or tanh), or gpt-oss's clamped SwiGLU.

``sm_carveout`` (a context manager) makes the expert GEMMs launched inside it leave SMs free
for a kernel that spins next to them (docs/design/performance-decisions.md, "SM carve-out").

Only torch is used; nothing here touches CUDA at import time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from afd_cupy.errors import ConfigError

__all__ = [
    "ExpertWeights", "local_experts", "gated_activation", "shared_mlp", "grouped_mlp",
    "grouped_mm_supported", "apply_routed_scaling", "combine_scale", "sm_carveout",
    "check_sm_carveout", "resolve_gemm_sm_carveout", "current_sm_carveout", "AUTO_GEMM_SM_CARVEOUT",
]

# NOTE: limits of torch._grouped_mm's CUTLASS path (aten/src/ATen/native/cuda/GroupMM.cu,
# GroupedMMUtils.h): fewer than 1024 groups; every operand's data pointer and leading
# stride aligned to 16 bytes; only SM90/SM100 run it without a host sync.
_GROUPED_MM_MAX_GROUPS = 1023
_GROUPED_MM_ALIGN_BYTES = 16
_GROUPED_MM_ARCH_MAJORS = (9, 10)


# --------------------------------------------------------------------------- weights

@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """The weights of a set of gated MLP experts.

    w13: [num_experts, 2 * intermediate, hidden]: rows [0, I) are the gate w1, rows [I, 2I)
         the up projection w3. w2: [num_experts, hidden, intermediate]. Same dtype and device.
    num_experts: experts held (a local set includes its zero padded tail).
    first_expert: global id of expert 0 of this set (0 for a global set).
    gate: shared experts only: [1, hidden] weight of a per-token sigmoid gate on their output
          (Qwen2-MoE's ``shared_expert_gate``), or None.
    activation: the gated activation ``glu(gate, up)`` (``EXPERT_ACTIVATIONS``): "silu"
          (default), "gelu" (erf) or "gelu_tanh" (the tanh approximation): ``act(gate) * up``;
          "clamped_swiglu" (gpt-oss): ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with
          ``g = clamp(gate, max=L)``, L = ``swiglu_limit``, alpha = ``swiglu_alpha``.
    w13_bias: [num_experts, 2 * intermediate] bias of the gate/up projection (gate entries
          first, like w13's rows), or None. w2_bias: [num_experts, hidden] bias of the down
          projection, or None. Same dtype and device as w13. None costs nothing.
    swiglu_limit, swiglu_alpha: the clamp and the sigmoid slope of "clamped_swiglu" (gpt-oss:
          7.0 and 1.702); finite and > 0, unused by the other activations.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    num_experts: int
    first_expert: int = 0
    gate: torch.Tensor | None = None
    activation: str = "silu"
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        w13, w2 = self.w13, self.w2
        if w13.dim() != 3 or w2.dim() != 3:
            raise ValueError(f"w13 and w2 must be 3-D, got w13 {tuple(w13.shape)}, "
                             f"w2 {tuple(w2.shape)}")
        num_experts, two_inter, hidden = w13.shape
        expected_w2 = (num_experts, hidden, two_inter // 2)
        if two_inter % 2 or tuple(w2.shape) != expected_w2 or num_experts != self.num_experts:
            raise ValueError(f"inconsistent expert shapes: w13 {tuple(w13.shape)} "
                             f"(expected [E, 2I, H]), w2 {tuple(w2.shape)} (expected "
                             f"{expected_w2}), num_experts={self.num_experts}")
        if w13.dtype != w2.dtype or w13.device != w2.device:
            raise ValueError(f"w13 ({w13.dtype}, {w13.device}) and w2 ({w2.dtype}, "
                             f"{w2.device}) must share dtype and device")
        if self.first_expert < 0:
            raise ValueError(f"first_expert must be >= 0, got {self.first_expert}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"activation must be one of {EXPERT_ACTIVATIONS}, got {self.activation!r}")
        for name in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self._check_extra("gate", self.gate, (1, hidden))
        self._check_extra("w13_bias", self.w13_bias, (num_experts, two_inter))
        self._check_extra("w2_bias", self.w2_bias, (num_experts, hidden))

    def _check_extra(self, name: str, tensor: torch.Tensor | None, shape: tuple) -> None:
        """An optional tensor must have ``shape`` and w13's dtype and device."""
        w13 = self.w13
        if tensor is not None and (tuple(tensor.shape) != shape or tensor.dtype != w13.dtype
                                   or tensor.device != w13.device):
            raise ValueError(f"{name} must be [{', '.join(map(str, shape))}] {w13.dtype} on "
                             f"{w13.device}, got {tuple(tensor.shape)} {tensor.dtype} on "
                             f"{tensor.device}")

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def has_bias(self) -> bool:
        return self.w13_bias is not None or self.w2_bias is not None


def local_experts(global_weights: ExpertWeights, ffn_rank: int,
                  expert_per_rank: int) -> ExpertWeights:
    """The experts FFN rank `ffn_rank` owns: global ids [r*epr, (r+1)*epr).

    global_weights: a global set (first_expert == 0). Ids past its num_experts become ZERO
    experts (the padded tail: they receive no tokens, and would output zeros if they did).
    Returns new tensors (not views, so the global set can be freed), same dtype and device;
    the activation, its parameters and the biases (zero for the padded tail) come along.
    """
    if global_weights.first_expert != 0:
        raise ValueError("local_experts slices a global set (first_expert == 0), got "
                         f"first_expert={global_weights.first_expert}")
    if ffn_rank < 0 or expert_per_rank < 1:
        raise ValueError(f"need ffn_rank >= 0 and expert_per_rank >= 1, got "
                         f"ffn_rank={ffn_rank}, expert_per_rank={expert_per_rank}")
    first = ffn_rank * expert_per_rank
    num_owned = max(0, min(expert_per_rank, global_weights.num_experts - first))
    return dataclasses.replace(
        global_weights, num_experts=expert_per_rank, first_expert=first,
        **{name: _padded_slice(getattr(global_weights, name), first, num_owned, expert_per_rank)
           for name in ("w13", "w2", "w13_bias", "w2_bias")})


def _padded_slice(tensor: torch.Tensor | None, first: int, num_owned: int,
                  num_rows: int) -> torch.Tensor | None:
    """Rows [first, first + num_owned) of ``tensor`` copied into zeros of ``num_rows`` rows."""
    if tensor is None:
        return None
    out = tensor.new_zeros((num_rows,) + tuple(tensor.shape[1:]))
    out[:num_owned].copy_(tensor[first:first + num_owned])
    return out


# --------------------------------------------------------------------------- expert math

#: ``act`` of the gated activations ``act(gate) * up`` of ``ExpertWeights.activation``
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
               "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
#: gpt-oss's clamped SwiGLU (see ``gated_activation``)
CLAMPED_SWIGLU = "clamped_swiglu"
#: every value of ``ExpertWeights.activation``
EXPERT_ACTIVATIONS = tuple(ACTIVATIONS) + (CLAMPED_SWIGLU,)


def gated_activation(gate_up: torch.Tensor, activation: str, *, swiglu_limit: float = 7.0,
                     swiglu_alpha: float = 1.702) -> torch.Tensor:
    """glu(gate, up): gate_up [..., 2I] ([gate | up]) -> [..., I] in gate_up's dtype.

    "silu" / "gelu" / "gelu_tanh": ``act(gate) * up``. "clamped_swiglu" (gpt-oss):
    ``g = clamp(gate, max=L)``, ``u = clamp(up, -L, L)``, ``(u + 1) * g * sigmoid(alpha * g)``.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == CLAMPED_SWIGLU:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))
    return ACTIVATIONS[activation](gate) * up


def act_and_mul(gate_up: torch.Tensor, out_dtype: torch.dtype, weights: ExpertWeights,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [n, 2I] (+ bias [n, 2I], added in fp32) -> glu(gate, up) [n, I] in out_dtype,
    computed in fp32 (one rounding, like vLLM's fused silu_and_mul)."""
    gate_up = gate_up.float() if bias is None else torch.add(gate_up.float(), bias)
    return gated_activation(gate_up, weights.activation, swiglu_limit=weights.swiglu_limit,
                            swiglu_alpha=weights.swiglu_alpha).to(out_dtype)


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

def grouped_mlp(x: torch.Tensor, group_counts: torch.Tensor, weights: ExpertWeights, *,
                group_counts_host: list[int] | None = None) -> torch.Tensor:
    """Run each local expert on its rows: the FFN rank's routed compute.

    x: [num_rows, H] rows grouped by local expert (expert 0's rows first, then 1, ...),
       same dtype and device as `weights`; a view into a receive window is fine (not copied).
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
    Zero rows return an empty [0, H] tensor without launching anything.
    """
    _check_grouped_args(x, group_counts, weights, group_counts_host)
    if x.shape[0] == 0:
        return x.new_empty((0, weights.hidden_size))
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


def _check_grouped_args(x, group_counts, weights, group_counts_host) -> None:
    if x.dim() != 2 or x.shape[1] != weights.hidden_size:
        raise ValueError(f"x must be [num_rows, hidden={weights.hidden_size}], "
                         f"got {tuple(x.shape)}")
    if x.dtype != weights.dtype or x.device != weights.device:
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


# --------------------------------------------------------------------------- SM carve-out

def _carveout_binding():
    """(setter, getter) of torch's SM carve-out (``torch._C._set_sm_carveout_experimental`` /
    ``_get_sm_carveout_experimental``), or None when this torch has no such binding. Looked up
    at each call (cheap), so that a test can replace them."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    return None if setter is None or getter is None else (setter, getter)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def check_sm_carveout(value, *, device=None, name: str = "gemm_sm_carveout") -> int:
    """Validate an SM carve-out: an int >= 0 (not a bool), < the SM count of ``device`` when
    it is a CUDA device, and, when > 0, a torch that has the carve-out binding. Returns the
    value; ConfigError (a ValueError) naming ``name`` and the values otherwise. Reads the
    device's properties only for a value > 0 on a CUDA device (once per device)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int >= 0 (SMs left free by the expert GEMMs), got "
                          f"{type(value).__name__} {value!r}")
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")
    if value == 0:
        return 0
    if _carveout_binding() is None:
        raise ConfigError(f"{name}={value} needs torch._C._set_sm_carveout_experimental, which "
                          f"torch {torch.__version__} does not have; use 0")
    if device is not None and torch.device(device).type == "cuda":
        sm_count = _sm_count(torch.device(device))
        if value >= sm_count:
            raise ConfigError(f"{name}={value} must be < the SM count of {device} ({sm_count})")
    return value


AUTO_GEMM_SM_CARVEOUT = 2
"""What ``gemm_sm_carveout="auto"`` (the FFN side's default) leaves free on a CUDA device.
Measured on an H200 (docs/performance.md, "A spinning warp next to the expert GEMMs"): a one-warp
spinner resident next to the V2-Lite-shaped routed GEMM pair makes it 1.45x slower (615 vs
423 µs); with 1, 2 or 4 SMs carved out it runs at 0.99x of alone, and the GEMM alone with 2
SMs carved out is itself 0.99x of alone (nothing lost when no spinner is there). Two, not
one, so that two resident spinners (a peer's wait under MPS and the next item's wait) fit."""


def resolve_gemm_sm_carveout(value, *, device=None, name: str = "gemm_sm_carveout") -> int:
    """``value`` as the int the FFN side uses: ``"auto"`` is ``AUTO_GEMM_SM_CARVEOUT`` on a
    CUDA ``device`` whose torch has the carve-out binding and more than twice that many SMs,
    else 0 (the host backend, a CPU device, an older torch, a tiny GPU: nothing to do). Anything else goes
    through ``check_sm_carveout`` (an int >= 0, ConfigError otherwise)."""
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(f"{name} must be 'auto' or an int >= 0 (SMs left free by the expert "
                              f"GEMMs), got {value!r}")
        if device is None or torch.device(device).type != "cuda" or _carveout_binding() is None:
            return 0
        return AUTO_GEMM_SM_CARVEOUT if _sm_count(torch.device(device)) > 2 * AUTO_GEMM_SM_CARVEOUT else 0
    return check_sm_carveout(value, device=device, name=name)


def current_sm_carveout() -> int | None:
    """torch's current SM carve-out (None: unset, or a torch without the binding)."""
    binding = _carveout_binding()
    return None if binding is None else binding[1]()


@contextlib.contextmanager
def sm_carveout(n: int | None, *, device=None):
    """Inside the block, GEMMs launched by this process leave ``n`` SMs free; the previous
    setting comes back on exit (also on an exception).

    What it sets: torch's process-wide ``torch._C._set_sm_carveout_experimental(n)`` (torch
    itself warns once that it is experimental). torch reads it when a GEMM is *launched* (on
    the host), not when it runs: ``torch._grouped_mm``'s persistent CUTLASS kernel then gets
    ``multiProcessorCount - n`` CTAs instead of one per SM, and cuBLAS-Lt matmuls an SM count
    target; other kernels ignore it. A CUDA graph keeps the grid of its capture: capture
    inside the block to bake it in. On the CPU it changes nothing.

    ``n``: an int >= 0 (``check_sm_carveout``; with ``device`` also < its SM count). 0 or None:
    nothing at all happens (no call into torch; an outer block's setting stays). ConfigError
    for a bad value, and for n > 0 on a torch without the binding.

    Threads: the setting is global to the process (``at::globalContext()``), not to the thread
    or the stream, so every matmul any thread launches while a block is open gets it. The
    blocks themselves are kept in one process-wide list under a lock: while any is open, the
    most recently opened one's ``n`` is in force; when the last closes, the value from before
    the first comes back. So nested blocks restore in order, and blocks on two threads that
    overlap in time (two workers, a worker and a reply thread) never leave a stale value
    behind. Restoring "unset" calls the setter with None (torch 2.13's binding takes
    ``int | None``); a binding that refuses None gets 0 (no carve-out for the grouped GEMM;
    cuBLAS-Lt then targets every SM).
    """
    if n is None or (n == 0 and not isinstance(n, bool)):
        yield
        return
    n = check_sm_carveout(n, device=device, name="sm_carveout(n)")
    setter, getter = _carveout_binding()
    scope = _CarveoutScope(n)  # compared by identity: list.remove takes out this block only
    with _OPEN.lock:
        if not _OPEN.scopes:
            _OPEN.base = getter()
        _OPEN.scopes.append(scope)
        setter(n)
    try:
        yield
    finally:
        with _OPEN.lock:
            _OPEN.scopes.remove(scope)
            if _OPEN.scopes:
                setter(_OPEN.scopes[-1].n)
            else:
                _restore_carveout(setter, _OPEN.base)


@dataclass(eq=False)
class _CarveoutScope:
    n: int


@dataclass
class _OpenScopes:
    """The open ``sm_carveout`` blocks of this process, oldest first, and torch's value from
    before the oldest; guarded by ``lock``."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    scopes: list = dataclasses.field(default_factory=list)
    base: int | None = None


_OPEN = _OpenScopes()


def _restore_carveout(setter, previous: int | None) -> None:
    if previous is not None:
        setter(previous)
        return
    try:
        setter(None)
    except TypeError:  # a binding that takes an int only
        setter(0)
