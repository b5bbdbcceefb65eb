"""A deterministic stand-in for a model's Attention side, for :mod:`afd_cupy.attention.step_graph`'s test
and benchmark (``tests/integration/test_step_graph_cuda.py``, ``tools/bench_step_graph.py``).

Layer l: ``residual = x + x @ W_l^T`` (a fixed bf16 linear, W_l ~ N(0, scale^2 / H)),
``h = 0.5 * residual`` (the MoE input; a pre-MoE norm's place), router logits
``h @ R_l^T`` in fp32 (R_l ~ N(0, 1/H), ``[num_experts, H]``). Capturable: torch ops only.
"""
from __future__ import annotations

import math

import torch


class LinearStandIn:
    """Per-layer weights W [L, H, H], R [L, E, H] in ``dtype`` on ``device`` (seeded on the CPU,
    one layer at a time) and the callables :class:`~afd_cupy.attention.step_graph.DecodeStepGraph` takes.
    ``shared_weights``: one W for every layer (a benchmark at hidden 7168 and 50 layers would
    otherwise hold 5 GiB of stand-in weights). ``linear=False``: no W at all, ``residual = x``
    (one elementwise kernel instead of the GEMM: a step whose attention does not stream a
    weight through L2, to tell the AFD kernels' own cost from the cost of running cold).
    ``normalize``: the MoE input is the residual RMS-normalized (as a model's post-attention
    norm does) instead of ``residual * 0.5``; needed with real experts, whose gated MLP grows
    its input's scale quadratically (bf16 overflows within ~8 layers without it); identity
    experts only double the values per layer and do without."""

    def __init__(self, num_layers: int, hidden_size: int, num_experts: int, *, dtype, device,
                 seed: int = 0, scale: float = 1.0, shared_weights: bool = False, linear: bool = True,
                 normalize: bool = False):
        gen = torch.Generator().manual_seed(seed)
        std = 1.0 / math.sqrt(hidden_size)
        distinct = (1 if shared_weights else num_layers) if linear else 0
        w = [(torch.randn(hidden_size, hidden_size, generator=gen) * (scale * std)).to(dtype).to(device)
             for _ in range(distinct)]
        self.w = [w[min(layer, distinct - 1)] for layer in range(num_layers)] if linear else None
        self.r = [(torch.randn(num_experts, hidden_size, generator=gen) * std).to(dtype).to(device)
                  for _ in range(num_layers)]
        self.num_layers = num_layers
        self.normalize = bool(normalize)

    def attention(self, layer: int, x: torch.Tensor):
        """x [T, H] -> (residual [T, H], h [T, H]), both x's dtype."""
        residual = x + torch.nn.functional.linear(x, self.w[layer]) if self.w is not None else x * 1.0
        if self.normalize:  # RMSNorm without a weight, in fp32
            wide = residual.float()
            return residual, (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return residual, residual * 0.5

    def router(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> router logits fp32 [T, E]."""
        return torch.nn.functional.linear(h, self.r[layer]).float()

    def attention_fns(self) -> list:
        return [lambda x, layer=layer: self.attention(layer, x) for layer in range(self.num_layers)]

    def router_fns(self) -> list:
        return [lambda h, layer=layer: self.router(layer, h) for layer in range(self.num_layers)]
