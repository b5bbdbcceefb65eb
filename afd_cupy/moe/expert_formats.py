"""How a torch MoE block's experts compute, detected from the block or a Hugging Face
config: the gated activation, the gate/up layout (concatenated or interleaved, standard or
transposed), biases, and the shared expert (docs/design/models.md). Used by
:mod:`afd_cupy.adapters`, which re-exports ``UnsupportedModelError`` and
``config_activation``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from afd_cupy import moe
from afd_cupy.errors import ConfigError

#: gpt-oss's clamped SwiGLU defaults (limit, alpha), for configs that name neither
#: (``GptOssConfig.swiglu_limit`` / ``swiglu_alpha``, read by transformers 5's GptOssExperts)
_GPT_OSS_SWIGLU = (7.0, 1.702)


class UnsupportedModelError(ConfigError):
    """A model or block afd_cupy cannot disaggregate; names the class and the feature."""


#: Hugging Face ``hidden_act`` names -> ExpertWeights.activation
_HF_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
            "gelu_new": "gelu_tanh"}


@dataclass(frozen=True)
class ExpertFormat:
    """How a family's fused experts compute: the gated activation (``ExpertWeights``'
    names and clamp parameters) and whether gate and up rows are interleaved
    (g0, u0, g1, u1, ...: gpt-oss) instead of concatenated ([gate | up])."""

    activation: str = "silu"
    interleaved: bool = False
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def weights_kwargs(self) -> dict:
        return dict(activation=self.activation, swiglu_limit=self.swiglu_limit,
                    swiglu_alpha=self.swiglu_alpha)


def config_activation(hf_config) -> str:
    """The experts' gated activation named by ``hf_config.hidden_act``; UnsupportedModelError
    for anything but SiLU and GELU, and for gpt-oss, whose experts need more than a name
    (pass ``hf_config=`` to ``ffn_weights`` instead)."""
    if getattr(hf_config, "model_type", None) == "gpt_oss":
        raise UnsupportedModelError("gpt_oss: the experts' clamped SwiGLU with interleaved gate/up rows "
                                    "is more than an activation name; pass hf_config= to ffn_weights")
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in _HF_ACTS:
        raise UnsupportedModelError(f"hidden_act {act!r}: only SiLU- and GELU-gated experts are "
                                    f"supported ({sorted(_HF_ACTS)})")
    return _HF_ACTS[act]


def config_format(hf_config) -> ExpertFormat:
    """The experts' format a Hugging Face config describes (for a state dict)."""
    if getattr(hf_config, "model_type", None) != "gpt_oss":
        return ExpertFormat(config_activation(hf_config))
    limit, alpha = (_swiglu_param(hf_config, name, default)
                    for name, default in zip(("swiglu_limit", "swiglu_alpha"), _GPT_OSS_SWIGLU))
    return ExpertFormat("clamped_swiglu", interleaved=True, swiglu_limit=limit, swiglu_alpha=alpha)


def _swiglu_param(hf_config, name: str, default: float) -> float:
    """``hf_config.<name>`` (``default`` when absent or None) as a finite float > 0, as
    transformers' GptOssExperts reads it; UnsupportedModelError naming the value otherwise."""
    value = getattr(hf_config, name, None)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UnsupportedModelError(f"gpt_oss: {name}={value!r} in the config; the clamped SwiGLU "
                                    "needs a finite number > 0")
    return float(value)


_ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu",
                "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh"}


def _activation_of(block: nn.Module) -> str:
    act = getattr(block.experts, "act_fn", None)
    if act is None:
        return "silu"
    kind = type(act).__name__
    if kind == "GELU":  # torch.nn.GELU: erf or tanh by its attribute
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    if kind not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{type(block).__name__}: expert activation {kind} (supported: "
                                    f"SiLU and GELU-gated experts: {sorted(_ACTIVATIONS)} or torch.nn.GELU)")
    return _ACTIVATIONS[kind]


def _format_of(block: nn.Module) -> ExpertFormat:
    """The experts' format, read from the block (see the module doc): ``act_fn`` alone, or the
    candidate that reproduces the experts' ``_apply_gate`` on a float64 probe."""
    experts = block.experts
    apply_gate = getattr(experts, "_apply_gate", None)
    has_act = getattr(experts, "act_fn", None) is not None
    if apply_gate is None:
        return ExpertFormat(_activation_of(block))
    candidates = []
    if has_act:
        candidates += [ExpertFormat(_activation_of(block), interleaved) for interleaved in (False, True)]
    limit, alpha = getattr(experts, "limit", None), getattr(experts, "alpha", None)
    if limit is not None and alpha is not None:
        candidates += [ExpertFormat("clamped_swiglu", interleaved, float(limit), float(alpha))
                       for interleaved in (False, True)]
    inter = _shapes_of(block)[1]
    gen = torch.Generator().manual_seed(0)
    # values out to +-16: beyond any clamp limit of a real model, on both sides
    probe = torch.randn((8, 2 * inter), generator=gen, dtype=torch.float64) * 6.0
    with torch.no_grad():
        got = apply_gate(probe)
    for fmt in candidates:
        gate_up = deinterleave(probe, dim=1) if fmt.interleaved else probe
        want = moe.gated_activation(gate_up, fmt.activation, swiglu_limit=fmt.swiglu_limit,
                                    swiglu_alpha=fmt.swiglu_alpha)
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-9, atol=1e-12):
            return fmt
    raise UnsupportedModelError(
        f"{type(block).__name__}: the experts' gate {type(experts).__name__}._apply_gate matches none "
        f"of the supported gated activations (act_fn: SiLU or GELU; clamped SwiGLU of the experts' "
        f"limit and alpha; gate/up concatenated or interleaved)")


def deinterleave(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows (g0, u0, g1, u1, ...) along ``dim`` -> [g0, g1, ... | u0, u1, ...] (a new tensor)."""
    index = torch.arange(tensor.shape[dim], device=tensor.device)
    return torch.cat([tensor.index_select(dim, index[0::2]), tensor.index_select(dim, index[1::2])], dim=dim)


def weight_layout(gate_up_shape, down_shape, owner: str) -> tuple[bool, int, int]:
    """(transposed, intermediate, hidden) of fused expert weights, from their shapes:
    [E, 2I, H] + [E, H, I], or transposed [E, H, 2I] + [E, I, H] (never both)."""
    (_, a, b), (_, c, d) = tuple(gate_up_shape), tuple(down_shape)
    if a == 2 * d and b == c:
        return False, d, b
    if b == 2 * c and a == d:
        return True, c, a
    raise UnsupportedModelError(f"{owner}: expert weights gate_up_proj {tuple(gate_up_shape)} and "
                                f"down_proj {tuple(down_shape)} are neither [E, 2I, H] + [E, H, I] "
                                "nor [E, H, 2I] + [E, I, H]")


def _shapes_of(block: nn.Module) -> tuple[bool, int, int]:
    experts, name = block.experts, type(block).__name__
    if experts.gate_up_proj.dim() != 3 or experts.down_proj.dim() != 3:
        raise UnsupportedModelError(f"{name}: expert weights must be fused 3-D tensors, got gate_up_proj "
                                    f"{tuple(experts.gate_up_proj.shape)}, down_proj {tuple(experts.down_proj.shape)}")
    transposed, inter, hidden = weight_layout(experts.gate_up_proj.shape, experts.down_proj.shape, name)
    flag = getattr(experts, "is_transposed", None)
    if flag is not None and bool(flag) != transposed:
        raise UnsupportedModelError(f"{name}: experts.is_transposed={flag} contradicts the weight shapes "
                                    f"gate_up_proj {tuple(experts.gate_up_proj.shape)}, "
                                    f"down_proj {tuple(experts.down_proj.shape)}")
    return transposed, inter, hidden


def check_block(block: nn.Module) -> ExpertFormat:
    """The block's experts' format; UnsupportedModelError for anything we cannot run."""
    _shapes_of(block)
    return _format_of(block)


@dataclass(frozen=True)
class SharedParts:
    """A block's shared experts as one fused MLP: ``w13`` [2*S*I, H] (gate rows, then up),
    ``w2`` [H, S*I], the optional per-token ``gate`` [1, H] (Qwen2-MoE) and biases."""

    w13: torch.Tensor
    w2: torch.Tensor
    gate: torch.Tensor | None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None


def shared_from(gate_w, up_w, down_w, gate_b, up_b, down_b, shared_gate) -> SharedParts:
    """The fused shared MLP of its linears' weights and (optional) biases; a missing bias of
    gate or up next to a present one counts as zeros."""
    w13_bias = None
    if gate_b is not None or up_b is not None:
        w13_bias = torch.cat([gate_w.new_zeros(gate_w.shape[0]) if gate_b is None else gate_b,
                              up_w.new_zeros(up_w.shape[0]) if up_b is None else up_b])
    return SharedParts(torch.cat([gate_w, up_w], dim=0), down_w, shared_gate, w13_bias, down_b)


def shared_of(block: nn.Module) -> SharedParts | None:
    """The shared experts of a Hugging Face MoE block (``shared_experts`` / ``shared_expert``,
    with ``shared_expert_gate``), detached; None when it has none."""
    mlp = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    if mlp is None:
        return None
    gate = getattr(block, "shared_expert_gate", None)
    parts = [getattr(getattr(mlp, name), attr) for attr in ("weight", "bias")
             for name in ("gate_proj", "up_proj", "down_proj")]
    return shared_from(*(None if t is None else t.detach() for t in parts),
                        None if gate is None else gate.weight.detach())
