"""Spec builder of ``raw_kernels/model/gate.cu``: the greedy gate in one kernel (afd_gate_topk)."""
from __future__ import annotations

from afd_cupy.kernels import checks, loader
from afd_cupy.kernels.launches import LaunchSpec, launch_spec
from afd_cupy.kernels.specs.limits import KERNEL_LIMITS, MAX_BLOCKS


GATE_LIMITS = {name: KERNEL_LIMITS[name] for name in ("GATE_THREADS", "GATE_MAX_EXPERTS", "GATE_MAX_TOP_K")}
#: ``scoring`` codes of afd_gate_topk (SCORE_* in raw_kernels/model/gate.cu)
GATE_SCORING = {"softmax": 0, "sigmoid": 1}


def gate_grid(num_tokens: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_gate_topk: one warp per token, tokens grid-strided past ``max_blocks``."""
    warps = GATE_LIMITS["GATE_THREADS"] // 32
    return max(1, min(-(-int(num_tokens) // warps), max_blocks))


def gate_topk_spec(*, dtype_code, logits, num_tokens, num_experts, top_k, scoring, bias,
                   renormalize, topk_weights, topk_ids, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """The greedy gate in one kernel (afd_gate_topk<DT>; ``gates.gate_topk_reference``).

    ``logits``: address of [num_tokens, num_experts] of dtype ``dtype_code``, row-major;
    ``bias``: address of float32 [num_experts] (selection only) or 0; ``scoring``: 0 softmax,
    1 sigmoid; ``renormalize``: 0 or 1. Outputs: ``topk_weights`` float32 [T, K] and
    ``topk_ids`` int32 [T, K] (addresses), every element written. num_experts in [1,
    GATE_MAX_EXPERTS], top_k in [1, min(num_experts, GATE_MAX_TOP_K)]. Grid: :func:`gate_grid`.
    """
    num_tokens = checks.count("num_tokens", num_tokens)
    num_experts = checks.count("num_experts", num_experts, low=1, high=GATE_LIMITS["GATE_MAX_EXPERTS"])
    top_k = checks.count("top_k", top_k, low=1, high=min(int(num_experts), GATE_LIMITS["GATE_MAX_TOP_K"]))
    empty = int(num_tokens) == 0
    args = {"logits": checks.address("logits", logits, allow_null=empty), "num_tokens": num_tokens,
            "num_experts": num_experts, "top_k": top_k,
            "scoring": checks.count("scoring", scoring, high=max(GATE_SCORING.values())),
            "bias": checks.address("bias", bias, allow_null=True),
            "renormalize": checks.count("renormalize", renormalize, high=1),
            "topk_weights": checks.address("topk_weights", topk_weights, allow_null=empty),
            "topk_ids": checks.address("topk_ids", topk_ids, allow_null=empty)}
    kernel = loader.get_kernel("model/gate.cu", "afd_gate_topk", dtype_code=checks.dtype_code(dtype_code))
    return launch_spec(kernel, gate_grid(int(num_tokens), max_blocks), GATE_LIMITS["GATE_THREADS"], args)
