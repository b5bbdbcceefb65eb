"""The weights an :class:`~afd_cupy.ffn.worker.FFNWorker` serves with: one
``moe.ExpertWeights`` (or None) for every layer or one per layer, checked against the
connector's ModelConfig; what stacking them for the graph FFN costs."""
from __future__ import annotations

from afd_cupy import moe
from afd_cupy.errors import ConfigError


def per_layer(weights, num_layers: int) -> list:
    """One entry per layer: ``weights`` (one ExpertWeights or None) repeated, or its list."""
    if weights is None or isinstance(weights, moe.ExpertWeights):
        return [weights] * num_layers
    return list(weights)


def check_weights(connector, experts, shared) -> None:
    """The weights must be what the connector's ModelConfig says: this rank's
    ``expert_per_rank`` experts of ``moe_intermediate_size`` x ``hidden_size`` in the payload
    dtype, per layer, and shared experts exactly when ``num_shared_experts > 0``."""
    model, layout = connector.model, connector.layout
    routed, fused = per_layer(experts, model.num_layers), per_layer(shared, model.num_layers)
    if len(routed) != model.num_layers or len(fused) != model.num_layers:
        raise ConfigError(f"weights for {len(routed)} routed / {len(fused)} shared layers, "
                          f"ModelConfig.num_layers={model.num_layers}")
    for layer, (w, s) in enumerate(zip(routed, fused)):
        got = (w.num_experts, w.hidden_size, w.intermediate_size, w.dtype)
        want = (layout.expert_per_rank, model.hidden_size, model.moe_intermediate_size,
                connector.torch_dtype)
        if got != want:
            raise ConfigError(f"layer {layer}: routed experts are (num_experts, hidden, intermediate, "
                              f"dtype) = {got}, the ModelConfig says {want}")
        if (s is None) != (model.num_shared_experts == 0):
            raise ConfigError(f"layer {layer}: shared expert weights {'missing' if s is None else 'given'} "
                              f"but ModelConfig.num_shared_experts={model.num_shared_experts}")
        if s is not None and (s.hidden_size, s.dtype) != (model.hidden_size, connector.torch_dtype):
            raise ConfigError(f"layer {layer}: shared experts are (hidden, dtype) = "
                              f"{(s.hidden_size, s.dtype)}, the ModelConfig says "
                              f"{(model.hidden_size, connector.torch_dtype)}")


def stacked_expert_bytes(routed, shared) -> int:
    """Bytes of the stacked copies a GraphFFNServer makes of the per-layer expert weights."""
    return sum(w.w13.numel() * w.w13.element_size() + w.w2.numel() * w.w2.element_size()
               for w in list(routed) + list(shared))
