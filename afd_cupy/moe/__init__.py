"""The MoE layer's expert math: expert weights, grouped GEMM, shared experts, scaling rule.

The gates (router logits -> topk_weights, topk_ids) are in :mod:`afd_cupy.moe.gates`.
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

FP8 experts: :class:`FP8ExpertWeights` (E4M3 weights with per-output-channel scales, from
bf16 weights or a DeepSeek-V3 block-scaled checkpoint, :mod:`afd_cupy.moe.fp8`) are accepted
wherever routed ``ExpertWeights`` are (``grouped_mlp``, ``FFNWorker``); the type selects the
FP8 compute (docs/design/fp8.md).

One module per responsibility, every public name importable from here:
:mod:`~afd_cupy.moe.weights` (the weights and the gated activation),
:mod:`~afd_cupy.moe.fp8` (the FP8 formats and ``FP8ExpertWeights``),
:mod:`~afd_cupy.moe.compute` (grouped and shared MLPs, the scaling rule),
:mod:`~afd_cupy.moe.carveout` (the SM carve-out).

Only torch is used; nothing here touches CUDA at import time.
"""
from afd_cupy.moe.carveout import (AUTO_GEMM_SM_CARVEOUT, check_sm_carveout, current_sm_carveout,
                                   resolve_gemm_sm_carveout, sm_carveout)
from afd_cupy.moe.compute import (apply_routed_scaling, combine_scale, grouped_mlp,
                                  grouped_mm_supported, shared_mlp)
from afd_cupy.moe.fp8 import FP8ExpertWeights
from afd_cupy.moe.weights import (ACTIVATIONS, CLAMPED_SWIGLU, EXPERT_ACTIVATIONS, ExpertWeights,
                                  act_and_mul, gated_activation, local_experts)

#: the routed expert sets ``grouped_mlp`` and ``FFNWorker`` take (the type picks the compute)
EXPERT_SET_TYPES = (ExpertWeights, FP8ExpertWeights)

__all__ = [
    "ExpertWeights", "local_experts", "gated_activation", "shared_mlp", "grouped_mlp",
    "grouped_mm_supported", "apply_routed_scaling", "combine_scale", "sm_carveout",
    "check_sm_carveout", "resolve_gemm_sm_carveout", "current_sm_carveout", "AUTO_GEMM_SM_CARVEOUT",
    "ACTIVATIONS", "CLAMPED_SWIGLU", "EXPERT_ACTIVATIONS", "act_and_mul", "FP8ExpertWeights",
    "EXPERT_SET_TYPES",
]
