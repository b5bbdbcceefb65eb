"""Shared by the planner's CPU tests: small, fast cost sets for the simulator."""
from __future__ import annotations

from afd_cupy.capacity import Costs


def small_costs(**kw) -> Costs:
    """Costs of a tiny model whose phases are all visible at a few hundred tokens."""
    base = dict(attn_fixed_s=50e-6, attn_per_token_s=1e-7, attn_per_pair_s=0.0, attn_per_ctx_token_s=1e-9,
                gemm_tflops=1.0, weight_read_gbps=1e6, ffn_item_s=20e-6, ffn_poll_s=1e-6,
                dispatch_fixed_s=5e-6, combine_fixed_s=4e-6)
    base.update(kw)
    return Costs(**base)
