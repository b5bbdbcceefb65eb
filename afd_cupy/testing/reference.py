"""Test fixtures of the MoE math: deterministic weights, the naive fp64 reference, identity
experts.

- :func:`make_expert_weights` / :func:`make_shared_weights`: seeded weights, identical on
  every device and dtype for one seed.
- :func:`reference_moe`: one MoE layer computed in float64 on the CPU (each expert once on
  the tokens that picked it), the ground truth the tests compare the AFD output against.
- :func:`identity_experts`: an ``FFNWorker`` ``expert_fn`` that replies the received rows
  unchanged (transport-only benchmarks and tests).
"""
from __future__ import annotations

import math

import torch

from afd_cupy.moe import ExpertWeights

# Salt mixed into the shared experts' seed so that one seed never makes a shared expert
# equal to a routed expert (which would hide a routed/shared mix-up in a test).
_SHARED_SEED_SALT = 0x5EED_5A1D


# --------------------------------------------------------------------------- weights

def make_expert_weights(num_experts: int, hidden_size: int, intermediate_size: int, *,
                        dtype: torch.dtype, device, seed: int) -> ExpertWeights:
    """A deterministic global expert set (first_expert = 0) for tests and benchmarks.

    Values are drawn on the CPU in fp32 (so every device and dtype gets the same weights
    for one seed) from N(0, 1/fan_in), like a real init: outputs of O(1) inputs stay O(1).
    Drawn one expert at a time, so the fp32 staging never exceeds one expert.
    Returns w13 [E, 2I, H] and w2 [E, H, I] in `dtype` on `device`.
    """
    for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.empty((num_experts, 2 * intermediate_size, hidden_size), dtype=dtype,
                      device=device)
    w2 = torch.empty((num_experts, hidden_size, intermediate_size), dtype=dtype, device=device)
    for expert in range(num_experts):
        w13[expert].copy_(_init_matrix(2 * intermediate_size, hidden_size, generator))
        w2[expert].copy_(_init_matrix(hidden_size, intermediate_size, generator))
    return ExpertWeights(w13=w13, w2=w2, num_experts=num_experts, first_expert=0)


def _init_matrix(out_features: int, in_features: int, generator) -> torch.Tensor:
    values = torch.randn((out_features, in_features), generator=generator)
    return values.mul_(1.0 / math.sqrt(in_features))


def make_shared_weights(num_shared_experts: int, hidden_size: int, intermediate_size: int, *,
                        dtype: torch.dtype, device, seed: int) -> ExpertWeights | None:
    """The shared experts as ONE fused MLP of intermediate num_shared_experts * I, as
    DeepSeek stores them; None when num_shared_experts == 0.

    Returns an ExpertWeights with num_experts = 1: w13 [1, 2*S*I, H], w2 [1, H, S*I].
    The seed is salted so that it never reproduces a routed expert of the same seed.
    """
    if num_shared_experts < 0:
        raise ValueError(f"num_shared_experts must be >= 0, got {num_shared_experts}")
    if num_shared_experts == 0:
        return None
    return make_expert_weights(1, hidden_size, num_shared_experts * intermediate_size,
                               dtype=dtype, device=device, seed=seed ^ _SHARED_SEED_SALT)


# --------------------------------------------------------------------------- reference

def reference_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  global_weights: ExpertWeights, shared_weights: ExpertWeights | None,
                  routed_scaling_factor: float) -> torch.Tensor:
    """Ground truth of one MoE layer, in float64 on the CPU, for tests.

    hidden: [T, H] any float dtype and device; topk_ids: [T, k] int (global ids);
    topk_weights: [T, k] float; global_weights: first_expert == 0; shared_weights or None.
    Returns [T, H] fp32 on the CPU:
        out[t] = f * sum_k w[t,k] * expert_{ids[t,k]}(x_t) + shared(x_t)
    expert_e(x) = w2_e @ glu(w13_e @ x + b13_e) + b2_e (biases when the weights carry them;
    glu written out here per ``ExpertWeights.activation``),
    (shared(x_t) scaled by sigmoid(x_t . gate) when the shared weights carry a gate)
    computed in float64 from the given (already rounded) inputs and weights, so that the
    reference adds no error of its own. Each expert runs once on the tokens that picked it
    (a float64 matmul, rows picked with a boolean mask: none of the library's routing code),
    and each token's k partials are summed in slot order k = 0..K-1.
    """
    _check_reference_args(hidden, topk_ids, topk_weights, global_weights)
    x = hidden.detach().to("cpu", torch.float64)
    ids = topk_ids.to("cpu", torch.int64)
    gate_weights = topk_weights.detach().to("cpu", torch.float64)
    partials = torch.zeros((*ids.shape, x.shape[1]), dtype=torch.float64)  # [T, k, H]
    for expert in torch.unique(ids).tolist():
        picked = ids == expert  # [T, k]
        token_idx = picked.nonzero()[:, 0]
        partials[picked] = _expert_f64(global_weights, expert, x[token_idx])
    out = (gate_weights.unsqueeze(-1) * partials).sum(dim=1) * routed_scaling_factor
    if shared_weights is not None:
        row = _expert_f64(shared_weights, 0, x)
        if shared_weights.gate is not None:  # Qwen2-MoE: sigmoid(x . gate) * shared(x)
            row = row * torch.sigmoid(x @ shared_weights.gate[0].to("cpu", torch.float64)).unsqueeze(-1)
        out = out + row
    return out.float()


def _expert_f64(weights: ExpertWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``expert`` of ``weights`` on rows x [n, H] float64 -> [n, H] float64."""
    w13, w2, b13, b2 = (None if t is None else t[expert].to("cpu", torch.float64)
                        for t in (weights.w13, weights.w2, weights.w13_bias, weights.w2_bias))
    gate_up = x @ w13.T
    if b13 is not None:
        gate_up = gate_up + b13
    out = _glu_f64(gate_up, weights) @ w2.T
    return out if b2 is None else out + b2


def _glu_f64(gate_up: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    """The gated activation of rows gate_up [n, 2I] float64 ([gate | up]) -> [n, I]."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if weights.activation == "clamped_swiglu":  # gpt-oss
        limit, alpha = weights.swiglu_limit, weights.swiglu_alpha
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1.0) * gate / (1.0 + torch.exp(-alpha * gate))
    if weights.activation == "silu":
        return gate / (1.0 + torch.exp(-gate)) * up
    if weights.activation == "gelu":
        return 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * up
    if weights.activation == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate ** 3)
        return 0.5 * gate * (1.0 + torch.tanh(inner)) * up
    raise ValueError(f"reference_moe: no reference for activation {weights.activation!r}")


def _check_reference_args(hidden, topk_ids, topk_weights, global_weights) -> None:
    if global_weights.first_expert != 0:
        raise ValueError("reference_moe needs the global expert set (first_expert == 0), "
                         f"got first_expert={global_weights.first_expert}")
    if hidden.dim() != 2 or hidden.shape[1] != global_weights.hidden_size:
        raise ValueError(f"hidden must be [T, {global_weights.hidden_size}], "
                         f"got {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape \
            or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={hidden.shape[0]}, k]")
    if topk_ids.numel() and not 0 <= int(topk_ids.min()) <= int(topk_ids.max()) \
            < global_weights.num_experts:
        raise ValueError(f"topk_ids must be in [0, {global_weights.num_experts}), got range "
                         f"[{int(topk_ids.min())}, {int(topk_ids.max())}]")


# --------------------------------------------------------------------------- identity experts

def identity_experts(item) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An ``FFNWorker`` ``expert_fn`` that replies the received rows unchanged.

    item: an ``FFNWorkItem`` (or anything with ``routed_x`` and ``shared_x``).
    Returns (routed_x [routed_tokens, H], shared_x [shared_tokens, H] or None): the item's own
    tensors, payload dtype, on its device; no copy, so a transport benchmark times the
    transport only. The Attention side's output is then sum_k w_k * x (+ x with shared rows).
    """
    return item.routed_x, item.shared_x
