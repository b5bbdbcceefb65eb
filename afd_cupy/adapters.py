"""Disaggregate a torch / Hugging Face MoE model: Attention-side proxies, FFN-side weights.

::

    # Attention rank: the whole model, each sparse-MoE block replaced by a proxy
    model = AutoModelForCausalLM.from_config(cfg)            # or from_pretrained
    conn = AFDConnector(adapters.model_config(cfg, dtype="bfloat16", max_num_batched_tokens=4096),
                        TopologyConfig(A, F), role="attention", role_rank=i, store=store, ...)
    adapters.disaggregate_attention(model, conn)              # forward() now round-trips to the FFN
    # FFN rank j: only its local experts and the shared experts, from a state dict
    experts, shared = adapters.ffn_weights(state_dict, cfg, ffn_rank=j, num_ffn_ranks=F)
    FFNWorker(conn, experts, shared).run()

A sparse-MoE block is recognised by its parts, whatever its class (the protocol any torch MoE
block can follow):

- ``block.gate``: a router module whose ``forward(x [T, H])`` returns ``router_logits`` first
  (the Hugging Face routers return ``(logits, weights, ids)``) and whose ``weight`` is
  [E, H]; optionally ``gate.e_score_correction_bias`` [E] (DeepSeek-V3).
- ``block.experts``: fused ``gate_up_proj`` [E, 2I, H] (gate rows first) and ``down_proj``
  [E, H, I] with a SiLU or GELU (erf or tanh) ``act_fn`` (the transformers 5 layout, and
  afd_cupy's own).
- optionally ``block.shared_experts`` / ``block.shared_expert``: an MLP with ``gate_proj``,
  ``up_proj``, ``down_proj`` linears, and ``block.shared_expert_gate`` [1, H] (Qwen2-MoE).

The gate itself is not taken from the block: ``model_config`` maps the family's config to
``ModelConfig`` fields (scoring, top-k, groups, ``topk_method``, renormalisation, routed
scaling), and the connector's ``select_experts`` applies them to the router's logits.
Anything else raises UnsupportedModelError naming the block class and the feature.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from afd_cupy import moe
from afd_cupy.config import ModelConfig
from afd_cupy.errors import ConfigError

#: model_type -> how its config maps to ModelConfig (experts, intermediate size, gate)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")


class UnsupportedModelError(ConfigError):
    """A model or block afd_cupy cannot disaggregate; names the class and the feature."""


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
    if family == "mixtral":
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


#: Hugging Face ``hidden_act`` names -> ExpertWeights.activation
_HF_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
            "gelu_new": "gelu_tanh"}


def config_activation(hf_config) -> str:
    """The experts' gated activation named by ``hf_config.hidden_act`` (for ``ffn_weights`` of
    a state dict); UnsupportedModelError for anything but SiLU and GELU."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in _HF_ACTS:
        raise UnsupportedModelError(f"hidden_act {act!r}: only SiLU- and GELU-gated experts are "
                                    f"supported ({sorted(_HF_ACTS)})")
    return _HF_ACTS[act]


def _num_moe_layers(c, family: str) -> int:
    if family.startswith("deepseek"):
        return c.num_hidden_layers - (c.first_k_dense_replace or 0)
    every = getattr(c, "decoder_sparse_step", 1) or 1
    dense = set(getattr(c, "mlp_only_layers", None) or ())
    return sum(1 for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % every == 0)


# --- blocks ----------------------------------------------------------------------------
def is_sparse_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` has a router ``gate`` and fused ``experts`` (see the module doc)."""
    experts = getattr(module, "experts", None)
    return (hasattr(getattr(module, "gate", None), "weight") and experts is not None
            and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"))


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of every sparse-MoE block, in forward (layer) order."""
    return [(name, m) for name, m in model.named_modules() if is_sparse_moe_block(m)]


#: activation modules (by class name) -> ExpertWeights.activation
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


def _check_block(block: nn.Module) -> None:
    name = type(block).__name__
    _activation_of(block)
    for part in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(block.experts, part, None) is not None:
            raise UnsupportedModelError(f"{name}: expert biases ({part}) are not supported")
    if getattr(block.gate, "bias", None) is not None:
        raise UnsupportedModelError(f"{name}: a router bias is not supported")


@dataclass(frozen=True)
class _Shared:
    w13: torch.Tensor
    w2: torch.Tensor
    gate: torch.Tensor | None


def _shared_of(block: nn.Module) -> _Shared | None:
    mlp = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    if mlp is None:
        return None
    w13 = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()], dim=0)
    gate = getattr(block, "shared_expert_gate", None)
    return _Shared(w13, mlp.down_proj.weight.detach(), None if gate is None else gate.weight.detach())


class DisaggregatedMoE(nn.Module):
    """Attention-side stand-in for one sparse-MoE block: router on this rank, experts on the
    FFN ranks through ``connector``. ``forward(hidden [..., H])`` -> [..., H], same dtype.

    The router's logits come from the original router module (so they are computed exactly as
    the model does); the gate is the connector's (``ModelConfig``). With ``blocking=False``
    (cuda) the call enqueues without a host synchronization and can be captured in a CUDA
    graph; errors then surface at ``connector.check_errors()``.
    """

    def __init__(self, router: nn.Module, connector, layer_idx: int, *, blocking: bool = True):
        super().__init__()
        self.router = router
        self.connector = connector
        self.layer_idx = layer_idx
        self.blocking = blocking

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        logits = self.router(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        bias = getattr(self.router, "e_score_correction_bias", None)
        weights, ids = self.connector.select_experts(logits.reshape(x.shape[0], -1), bias)
        handle = self.connector.send_attn_output(x, ids, weights, self.layer_idx)
        return self.connector.recv_ffn_output(handle, blocking=self.blocking).view(shape)


def disaggregate_attention(model: nn.Module, connector, *, blocking: bool = True) -> int:
    """Replace every sparse-MoE block of ``model`` (in place) by a :class:`DisaggregatedMoE`
    numbered in layer order; frees the experts' weights on this rank. Returns the number of
    blocks replaced, which must equal ``connector.model.num_layers``."""
    blocks = moe_blocks(model)
    if len(blocks) != connector.model.num_layers:
        raise UnsupportedModelError(f"{type(model).__name__} has {len(blocks)} sparse-MoE blocks, "
                                    f"the connector's ModelConfig.num_layers is {connector.model.num_layers}")
    for layer_idx, (name, block) in enumerate(blocks):
        _check_block(block)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, DisaggregatedMoE(block.gate, connector, layer_idx, blocking=blocking))
    return len(blocks)


# --- FFN side ---------------------------------------------------------------------------
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def ffn_weights(source, *, ffn_rank: int, num_ffn_ranks: int, num_experts: int,
                activation: str = "silu"):
    """(local experts per MoE layer, shared experts per MoE layer or None) for FFN rank
    ``ffn_rank``, in layer order, from a model (``nn.Module``) or a state dict.

    Only this rank's experts are copied out (``moe.local_experts``); a state dict may be a
    memory-mapped one (``torch.load(..., mmap=True)`` / safetensors), so the whole model is
    never materialised here. ``num_experts``: the routed experts per layer; ``activation``:
    the experts' gated activation when ``source`` is a state dict (a model tells its own).
    """
    epr = -(-num_experts // num_ffn_ranks)
    layers = (_layers_from_module(source) if isinstance(source, nn.Module)
              else _layers_from_state(source, activation))
    experts, shared = [], []
    for gate_up, down, shared_parts, activation in layers:
        if gate_up.shape[0] != num_experts:
            raise UnsupportedModelError(f"expert weights hold {gate_up.shape[0]} experts, expected {num_experts}")
        global_set = moe.ExpertWeights(w13=gate_up, w2=down, num_experts=num_experts,
                                       activation=activation)
        experts.append(moe.local_experts(global_set, ffn_rank, epr))
        shared.append(None if shared_parts is None else moe.ExpertWeights(
            w13=shared_parts.w13.unsqueeze(0).clone(), w2=shared_parts.w2.unsqueeze(0).clone(),
            num_experts=1, gate=None if shared_parts.gate is None else shared_parts.gate.clone(),
            activation=activation))
    return experts, shared


def _layers_from_module(model: nn.Module):
    for _, block in moe_blocks(model):
        _check_block(block)
        yield (block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(), _shared_of(block),
               _activation_of(block))


def _layers_from_state(state: dict, activation: str):
    prefixes = sorted({key[:-len("experts.gate_up_proj")] for key in state
                       if key.endswith("experts.gate_up_proj")}, key=_layer_number)
    if not prefixes:
        raise UnsupportedModelError("the state dict has no '*.experts.gate_up_proj' tensors "
                                    "(fused expert weights, transformers >= 5 layout)")
    for prefix in prefixes:
        shared = None
        for name in ("shared_experts.", "shared_expert."):
            if prefix + name + "gate_proj.weight" in state:
                w13 = torch.cat([state[prefix + name + "gate_proj.weight"],
                                 state[prefix + name + "up_proj.weight"]], dim=0)
                gate = state.get(prefix + "shared_expert_gate.weight")
                shared = _Shared(w13, state[prefix + name + "down_proj.weight"], gate)
        yield state[prefix + "experts.gate_up_proj"], state[prefix + "experts.down_proj"], shared, activation


def _layer_number(prefix: str) -> int:
    match = _LAYER_RE.search(prefix)
    if match is None:
        raise UnsupportedModelError(f"cannot tell the layer of {prefix!r} (expected '...layers.N.')")
    return int(match.group(1))
