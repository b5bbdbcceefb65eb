"""The experts' weights (:class:`ExpertWeights`, one FFN rank's share of them with
:func:`local_experts`) and their gated activation (:func:`gated_activation`). Part of
:mod:`afd_cupy.moe`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
