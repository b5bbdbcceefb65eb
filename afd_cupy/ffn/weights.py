"""The weights an :class:`~afd_cupy.ffn.worker.FFNWorker` serves with: one expert set
(``moe.ExpertWeights``, routed ``moe.FP8ExpertWeights``, or None) for every layer or one per
layer, checked against the connector's ModelConfig; what stacking them for the graph FFN
costs."""
from __future__ import annotations

from afd_cupy import moe
from afd_cupy.errors import ConfigError


def per_layer(weights, num_layers: int) -> list:
    """One entry per layer: ``weights`` (one expert set or None) repeated, or its list."""
    if weights is None or isinstance(weights, moe.EXPERT_SET_TYPES):
        return [weights] * num_layers
    return list(weights)


def check_weights(connector, experts, shared) -> None:
    """The weights must be what the connector's ModelConfig says: this rank's
    ``expert_per_rank`` experts of ``moe_intermediate_size`` x ``hidden_size`` in the payload
    dtype (FP8 routed experts take and return the payload dtype, whatever it is), per layer,
    and shared experts (``ExpertWeights``) exactly when ``num_shared_experts > 0``."""
    model, layout = connector.model, connector.layout
    routed, fused = per_layer(experts, model.num_layers), per_layer(shared, model.num_layers)
    if len(routed) != model.num_layers or len(fused) != model.num_layers:
        raise ConfigError(f"weights for {len(routed)} routed / {len(fused)} shared layers, "
                          f"ModelConfig.num_layers={model.num_layers}")
    for layer, (w, s) in enumerate(zip(routed, fused)):
        dtype = connector.torch_dtype if isinstance(w, moe.FP8ExpertWeights) else w.dtype
        got = (w.num_experts, w.hidden_size, w.intermediate_size, dtype)
        want = (layout.expert_per_rank, model.hidden_size, model.moe_intermediate_size,
                connector.torch_dtype)
        if got != want:
            raise ConfigError(f"layer {layer}: routed experts are (num_experts, hidden, intermediate, "
                              f"dtype) = {got}, the ModelConfig says {want}")
        if (s is None) != (model.num_shared_experts == 0):
            raise ConfigError(f"layer {layer}: shared expert weights {'missing' if s is None else 'given'} "
                              f"but ModelConfig.num_shared_experts={model.num_shared_experts}")
        if s is not None and not isinstance(s, moe.ExpertWeights):
            raise ConfigError(f"layer {layer}: shared experts must be a moe.ExpertWeights, got "
                              f"{type(s).__name__} (FP8 runs the routed experts only)")
        if s is not None and (s.hidden_size, s.dtype) != (model.hidden_size, connector.torch_dtype):
            raise ConfigError(f"layer {layer}: shared experts are (hidden, dtype) = "
                              f"{(s.hidden_size, s.dtype)}, the ModelConfig says "
                              f"{(model.hidden_size, connector.torch_dtype)}")


def stacked_expert_bytes(routed, shared) -> int:
    """Bytes of the stacked copies a GraphFFNServer makes of the per-layer expert weights."""
    return sum(w.w13.numel() * w.w13.element_size() + w.w2.numel() * w.w2.element_size()
               for w in list(routed) + list(shared))
