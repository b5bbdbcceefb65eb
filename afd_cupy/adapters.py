"""Disaggregate a torch / Hugging Face MoE model: Attention-side proxies, FFN-side weights.

::

    # Attention rank: the whole model, each sparse-MoE block replaced by a proxy
    model = AutoModelForCausalLM.from_config(cfg)            # or from_pretrained
    conn = AFDConnector(adapters.model_config(cfg, dtype="bfloat16", max_num_batched_tokens=4096),
                        TopologyConfig(A, F), role="attention", role_rank=i, store=store, ...)
    adapters.disaggregate_attention(model, conn)              # forward() now round-trips to the FFN
    # FFN rank j: only its local experts and the shared experts, from a state dict
    experts, shared = adapters.ffn_weights(state_dict, ffn_rank=j, num_ffn_ranks=F,
                                           num_experts=conn.model.num_experts, hf_config=cfg)
    FFNWorker(conn, experts, shared).run()

``ffn_weights`` also reads a DeepSeek-V3-style FP8 checkpoint (per-expert E4M3 linears with
128x128 ``weight_scale_inv`` block scales): the routed experts come back as
``moe.FP8ExpertWeights`` (converted to per-output-channel scales for torch's scaled grouped
GEMM) and the FFN computes them in FP8, or with ``fp8_experts=False`` dequantized to bf16
(docs/design/fp8.md).

A sparse-MoE block is recognised by its parts, whatever its class (the protocol any torch MoE
block can follow):

- a router ``block.gate`` (or ``block.router``, gpt-oss): a module whose ``forward(x [T, H])``
  returns ``router_logits`` first (the Hugging Face routers return ``(logits, weights, ids)``)
  and whose ``weight`` is [E, H]; its own forward computes the logits, a router bias
  included; optionally ``e_score_correction_bias`` [E] (DeepSeek-V3).
- ``block.experts``: fused ``gate_up_proj`` and ``down_proj``, either [E, 2I, H] and
  [E, H, I] (transformers 5, afd_cupy's own) or transposed, [E, H, 2I] and [E, I, H]
  (gpt-oss); the two layouts are told apart by the shapes (they cannot both fit). Optional
  ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H]. The gated activation: an
  ``act_fn`` (SiLU, GELU erf or tanh) on gate rows first; or, for experts with an
  ``_apply_gate(gate_up)`` method (transformers' experts), whichever of those or of the
  clamped SwiGLU of their ``limit`` and ``alpha`` (gpt-oss), with gate and up rows
  concatenated or interleaved, reproduces ``_apply_gate`` on a probe: detected, not assumed.
  Interleaved weights are de-interleaved when extracted, so the FFN hot path always sees
  ``[gate | up]``.
- optionally ``block.shared_experts`` / ``block.shared_expert``: an MLP with ``gate_proj``,
  ``up_proj``, ``down_proj`` linears (biases taken if present), and
  ``block.shared_expert_gate`` [1, H] (Qwen2-MoE).

The gate itself is not taken from the block: ``model_config`` maps the family's config to
``ModelConfig`` fields (scoring, top-k, groups, ``topk_method``, renormalisation, routed
scaling), and the connector's ``select_experts`` applies them to the router's logits.
gpt-oss's router (top-k of the logits, softmax over the k) is softmax top-k renormalised:
the same ids and weights. Anything else raises UnsupportedModelError naming the block class
and the feature.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from afd_cupy import moe
from afd_cupy.config import ModelConfig
from afd_cupy.moe import fp8_checkpoint
from afd_cupy.moe.expert_formats import (ExpertFormat, SharedParts, UnsupportedModelError,  # noqa: F401
                                     check_block, config_activation, config_format, deinterleave,
                                     shared_from, shared_of, weight_layout)

#: model_type -> how its config maps to ModelConfig (experts, intermediate size, gate)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
#: families whose MoE block returns ``(hidden, router_scores)`` instead of ``hidden``
_BLOCK_RETURNS_SCORES = ("gpt_oss",)
def model_config(hf_config, *, dtype: str, max_num_batched_tokens: int,
                 num_layers: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face config of one of ``FAMILIES``.

    ``num_layers``: the number of sparse-MoE layers (default: from the config; DeepSeek's
    first ``first_k_dense_replace`` layers are dense).
    """
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise UnsupportedModelError(f"model_type {family!r} is not one of {FAMILIES}; build a "
                                    "ModelConfig by hand and use disaggregate_attention / ffn_weights")
    c = hf_config
    layers = num_layers if num_layers is not None else _num_moe_layers(c, family)
    common = dict(hidden_size=c.hidden_size, top_k=c.num_experts_per_tok, dtype=dtype,
                  max_num_batched_tokens=max_num_batched_tokens, num_layers=layers)
    if family in ("mixtral", "gpt_oss"):
        # gpt-oss: softmax over the top-k logits == softmax top-k renormalised
        return ModelConfig(num_experts=c.num_local_experts, moe_intermediate_size=c.intermediate_size,
                           renormalize=True, **common)
    if family in ("qwen2_moe", "qwen3_moe", "olmoe"):
        inter = c.intermediate_size if family == "olmoe" else c.moe_intermediate_size
        shared = 1 if family == "qwen2_moe" and c.shared_expert_intermediate_size else 0
        return ModelConfig(num_experts=c.num_experts, moe_intermediate_size=inter,
                           num_shared_experts=shared, renormalize=bool(c.norm_topk_prob), **common)
    grouped = family == "deepseek_v3" or c.topk_method == "group_limited_greedy"
    return ModelConfig(
        num_experts=c.n_routed_experts, moe_intermediate_size=c.moe_intermediate_size,
        num_shared_experts=c.n_shared_experts or 0,
        routed_scaling_factor=float(c.routed_scaling_factor),
        scoring_func="sigmoid" if family == "deepseek_v3" else "softmax",
        # DeepSeek-V2's router never renormalises; V3's does when norm_topk_prob is set
        renormalize=bool(c.norm_topk_prob) if family == "deepseek_v3" else False,
        n_group=c.n_group if grouped else None, topk_group=c.topk_group if grouped else None,
        topk_method="noaux_tc" if family == "deepseek_v3" else c.topk_method, **common)


def _num_moe_layers(c, family: str) -> int:
    if family.startswith("deepseek"):
        return c.num_hidden_layers - (c.first_k_dense_replace or 0)
    every = getattr(c, "decoder_sparse_step", 1) or 1
    dense = set(getattr(c, "mlp_only_layers", None) or ())
    return sum(1 for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % every == 0)


# --- blocks ----------------------------------------------------------------------------
def router_of(module: nn.Module) -> nn.Module | None:
    """The router of a block: ``gate`` or ``router`` with a ``weight``, or None."""
    for name in ("gate", "router"):
        router = getattr(module, name, None)
        if isinstance(router, nn.Module) and hasattr(router, "weight"):
            return router
    return None


def is_sparse_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` has a router (``gate`` or ``router``) and fused ``experts`` (see the
    module doc)."""
    experts = getattr(module, "experts", None)
    return (router_of(module) is not None and experts is not None
            and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"))


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of every sparse-MoE block, in forward (layer) order."""
    return [(name, m) for name, m in model.named_modules() if is_sparse_moe_block(m)]


#: activation modules (by class name) -> ExpertWeights.activation
class DisaggregatedMoE(nn.Module):
    """Attention-side stand-in for one sparse-MoE block: router on this rank, experts on the
    FFN ranks through ``connector``. ``forward(hidden [..., H])`` -> [..., H], same dtype.

    The router's logits come from the original router module (so they are computed exactly as
    the model does); the gate is the connector's (``ModelConfig``). With ``blocking=False``
    (cuda) the call enqueues without a host synchronization and can be captured in a CUDA
    graph; errors then surface at ``connector.check_errors()``. With ``return_scores`` (blocks
    that return ``(hidden, router_scores)``, gpt-oss) it returns ``(out, topk_weights)``, the
    weights fp32 [T, K] as ``select_experts`` gave them.
    """

    def __init__(self, router: nn.Module, connector, layer_idx: int, *, blocking: bool = True,
                 return_scores: bool = False):
        super().__init__()
        self.router = router
        self.connector = connector
        self.layer_idx = layer_idx
        self.blocking = blocking
        self.return_scores = return_scores

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        logits = self.router(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        bias = getattr(self.router, "e_score_correction_bias", None)
        weights, ids = self.connector.select_experts(logits.reshape(x.shape[0], -1), bias)
        handle = self.connector.send_attn_output(x, ids, weights, self.layer_idx)
        out = self.connector.recv_ffn_output(handle, blocking=self.blocking).view(shape)
        return (out, weights) if self.return_scores else out


def disaggregate_attention(model: nn.Module, connector, *, blocking: bool = True) -> int:
    """Replace every sparse-MoE block of ``model`` (in place) by a :class:`DisaggregatedMoE`
    numbered in layer order; frees the experts' weights on this rank. Returns the number of
    blocks replaced, which must equal ``connector.model.num_layers``. The proxies of a family
    whose blocks return ``(hidden, router_scores)`` (gpt-oss) return the same pair."""
    blocks = moe_blocks(model)
    if len(blocks) != connector.model.num_layers:
        raise UnsupportedModelError(f"{type(model).__name__} has {len(blocks)} sparse-MoE blocks, "
                                    f"the connector's ModelConfig.num_layers is {connector.model.num_layers}")
    return_scores = getattr(getattr(model, "config", None), "model_type", None) in _BLOCK_RETURNS_SCORES
    for layer_idx, (name, block) in enumerate(blocks):
        check_block(block)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, DisaggregatedMoE(router_of(block), connector, layer_idx, blocking=blocking,
                                               return_scores=return_scores))
    return len(blocks)


# --- FFN side ---------------------------------------------------------------------------
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class _Layer:
    """One MoE layer's expert tensors as stored (any layout), and how they compute."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    shared: SharedParts | None
    format: ExpertFormat
    owner: str  # for error messages: the block class or the state-dict prefix


def ffn_weights(source, *, ffn_rank: int, num_ffn_ranks: int, num_experts: int,
                activation: str | None = None, hf_config=None, fp8_experts: bool = True,
                dequant_dtype: torch.dtype | None = None):
    """(local experts per MoE layer, shared experts per MoE layer or None) for FFN rank
    ``ffn_rank``, in layer order, from a model (``nn.Module``) or a state dict.

    Only this rank's experts are copied out; a state dict may be a memory-mapped one
    (``torch.load(..., mmap=True)`` / safetensors), so the whole model is never materialised
    here. ``num_experts``: the routed experts per layer. Transposed weights ([E, H, 2I],
    gpt-oss) are transposed and interleaved gate/up rows de-interleaved while copying, so
    every returned ``ExpertWeights`` has the canonical layout; expert biases come along.

    How the experts compute: a model tells its own (module doc). For a state dict pass
    ``hf_config`` (its family's activation, clamp and gate/up order; required for gpt-oss),
    or ``activation`` (an ``ExpertWeights.activation``, gate/up rows concatenated; default
    "silu"), not both.

    A state dict whose experts are stored per expert in FP8 (``*.experts.<e>.gate_proj.weight``
    E4M3 with ``weight_scale_inv``, DeepSeek-V3's checkpoint; :mod:`afd_cupy.moe.fp8_checkpoint`)
    gives one ``moe.FP8ExpertWeights`` per layer (the FFN computes them in FP8), on the
    checkpoint's device, and its shared experts dequantized to ``dequant_dtype`` (the payload
    dtype; default torch.bfloat16). ``fp8_experts=False``: the routed experts dequantized to
    ``dequant_dtype`` too (bf16 serving: slower, closer to the checkpoint; docs/design/fp8.md
    has the error budget of both). Both apply to such a state dict only (ValueError otherwise).
    """
    if isinstance(source, nn.Module):
        layers = _layers_from_module(source)
    else:
        if hf_config is not None and activation is not None:
            raise ValueError(f"pass activation ({activation!r}) or hf_config, not both: the config "
                             "names the experts' activation")
        fmt = config_format(hf_config) if hf_config is not None else ExpertFormat(activation or "silu")
        fp8_layers = fp8_checkpoint.layer_prefixes(source)
        if fp8_layers:
            return _fp8_weights(source, fp8_layers, fmt, ffn_rank, num_ffn_ranks, num_experts,
                                None if fp8_experts else dequant_dtype or torch.bfloat16,
                                dequant_dtype or torch.bfloat16)
        layers = _layers_from_state(source, fmt)
    if dequant_dtype is not None or not fp8_experts:
        raise ValueError(f"fp8_experts={fp8_experts} and dequant_dtype={dequant_dtype} apply to FP8 state "
                         "dicts (per-expert weights with weight_scale_inv); this source keeps its stored dtype")
    epr = -(-num_experts // num_ffn_ranks)
    experts, shared = [], []
    for layer in layers:
        experts.append(_local_set(layer, ffn_rank, epr, num_experts))
        parts = layer.shared
        shared.append(None if parts is None else moe.ExpertWeights(
            w13=parts.w13.unsqueeze(0).clone(), w2=parts.w2.unsqueeze(0).clone(), num_experts=1,
            gate=None if parts.gate is None else parts.gate.clone(),
            w13_bias=None if parts.w13_bias is None else parts.w13_bias.unsqueeze(0).clone(),
            w2_bias=None if parts.w2_bias is None else parts.w2_bias.unsqueeze(0).clone(),
            **layer.format.weights_kwargs()))
    return experts, shared


def _fp8_weights(state: dict, layers: dict, fmt: ExpertFormat, ffn_rank: int, num_ffn_ranks: int,
                 num_experts: int, routed_dtype: torch.dtype | None, shared_dtype: torch.dtype):
    """``ffn_weights`` of an FP8 state dict: ([FP8ExpertWeights, or ExpertWeights of
    ``routed_dtype``], [ExpertWeights or None])."""
    epr = -(-num_experts // num_ffn_ranks)
    prefixes = sorted(layers, key=_layer_number)
    experts = [fp8_checkpoint.local_experts(state, prefix, layers[prefix], ffn_rank=ffn_rank, expert_per_rank=epr,
                                            num_experts=num_experts, fmt=fmt, dequantize_to=routed_dtype)
               for prefix in prefixes]
    shared = [fp8_checkpoint.shared_experts(state, prefix, dtype=shared_dtype, fmt=fmt) for prefix in prefixes]
    return experts, shared


def _local_set(layer: _Layer, ffn_rank: int, epr: int, num_experts: int) -> moe.ExpertWeights:
    """FFN rank ``ffn_rank``'s experts of ``layer`` (padded to ``epr``), canonical layout.
    Only the owned experts are read: sliced first, then transposed / de-interleaved."""
    if layer.gate_up.shape[0] != num_experts:
        raise UnsupportedModelError(f"{layer.owner}: expert weights hold {layer.gate_up.shape[0]} experts, "
                                    f"expected {num_experts}")
    transposed, inter, hidden = weight_layout(layer.gate_up.shape, layer.down.shape, layer.owner)
    for name, bias, shape in (("gate_up_proj_bias", layer.gate_up_bias, (num_experts, 2 * inter)),
                              ("down_proj_bias", layer.down_bias, (num_experts, hidden))):
        if bias is not None and tuple(bias.shape) != shape:
            raise UnsupportedModelError(f"{layer.owner}: {name} is {tuple(bias.shape)}, expected {shape}")
    first = ffn_rank * epr
    owned = slice(first, first + max(0, min(epr, num_experts - first)))
    w13, w2 = layer.gate_up[owned], layer.down[owned]
    if transposed:
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    b13 = None if layer.gate_up_bias is None else layer.gate_up_bias[owned]
    if layer.format.interleaved:
        w13 = deinterleave(w13, dim=1)
        b13 = None if b13 is None else deinterleave(b13, dim=1)
    mine = moe.ExpertWeights(w13=w13, w2=w2, num_experts=w13.shape[0], w13_bias=b13,
                             w2_bias=None if layer.down_bias is None else layer.down_bias[owned],
                             **layer.format.weights_kwargs())
    return dataclasses.replace(moe.local_experts(mine, 0, epr), first_expert=first)


def _layers_from_module(model: nn.Module):
    for _, block in moe_blocks(model):
        fmt = check_block(block)
        experts = block.experts
        biases = [getattr(experts, name, None) for name in ("gate_up_proj_bias", "down_proj_bias")]
        yield _Layer(experts.gate_up_proj.detach(), experts.down_proj.detach(),
                     *(None if b is None else b.detach() for b in biases), shared_of(block), fmt,
                     type(block).__name__)


def _layers_from_state(state: dict, fmt: ExpertFormat):
    prefixes = sorted({key[:-len("experts.gate_up_proj")] for key in state
                       if key.endswith("experts.gate_up_proj")}, key=_layer_number)
    if not prefixes:
        raise UnsupportedModelError("the state dict has no '*.experts.gate_up_proj' tensors "
                                    "(fused expert weights, transformers >= 5 layout) and no FP8 "
                                    "'*.experts.<e>.gate_proj.weight_scale_inv'")
    for prefix in prefixes:
        shared = None
        for name in ("shared_experts.", "shared_expert."):
            if prefix + name + "gate_proj.weight" in state:
                shared = shared_from(*(state.get(f"{prefix}{name}{proj}.{attr}") for attr in ("weight", "bias")
                                        for proj in ("gate_proj", "up_proj", "down_proj")),
                                      state.get(prefix + "shared_expert_gate.weight"))
        yield _Layer(state[prefix + "experts.gate_up_proj"], state[prefix + "experts.down_proj"],
                     state.get(prefix + "experts.gate_up_proj_bias"), state.get(prefix + "experts.down_proj_bias"),
                     shared, fmt, prefix + "experts")


def _layer_number(prefix: str) -> int:
    match = _LAYER_RE.search(prefix)
    if match is None:
        raise UnsupportedModelError(f"cannot tell the layer of {prefix!r} (expected '...layers.N.')")
    return int(match.group(1))
