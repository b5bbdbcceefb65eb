"""The cuda Attention path's own copy of each send's routing (``afd_own_routing``,
raw_kernels/attention/routing.cu; docs/design/kernels.md, decision 0031).

A pair-mode combine reads the routing of its send, after the caller may have reused its
tensors; one kernel copies (and where needed converts) it into per-ring buffers whose
addresses the dispatch and combine launches hold, so no torch op runs per send or receive.
"""
from __future__ import annotations

import torch

from afd_cupy import kernels

#: torch dtype of the routing weights -> afd_own_routing's template argument (wire.cuh DT_*);
#: other float dtypes are converted to fp32 by torch first
WEIGHT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
FP32_CODE = WEIGHT_CODES[torch.float32]


def routing_sources(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple:
    """(ids, weights, weights' dtype code) as afd_own_routing and the dispatch read them:
    contiguous, ids int32 or int64 (another integer dtype converted to int64 by torch),
    weights bf16, fp16 or fp32 (another float dtype converted to fp32)."""
    ids = topk_ids.detach()
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    weights = topk_weights.detach()
    code = WEIGHT_CODES.get(weights.dtype)
    if code is None:
        weights, code = weights.to(torch.float32), FP32_CODE
    return ids.contiguous(), weights.contiguous(), code


class OwnedRouting:
    """Per ring, ``buffers[ring]`` = (ids int32 [max_partials], weights fp32 [max_partials]),
    allocated once (static addresses: a captured graph keeps reading them), and the packed
    afd_own_routing launch that fills them (one per ring and weights dtype, built on first use).
    ``num_experts``: ids outside [0, num_experts) become -1 where the launch masks."""

    def __init__(self, cp, *, num_rings: int, max_partials: int, num_experts: int):
        self.buffers = [(cp.zeros(max_partials, cp.int32), cp.zeros(max_partials, cp.float32))
                        for _ in range(num_rings)]
        self.num_experts = num_experts
        self._launches = {}  # (ring, weights dtype code) -> PackedLaunch

    def launch(self, ring: int, stream: int, ids: torch.Tensor, weights: torch.Tensor,
               weights_code: int, num_partials: int, *, mask: bool) -> None:
        """afd_own_routing on ``stream``: ``ids`` / ``weights`` (:func:`routing_sources`) into
        ``buffers[ring]``. int64 ids are always masked (an id an int32 cast would wrap becomes
        -1: the plan then rejects it as BAD_EXPERT); int32 ids only with ``mask`` (padding
        experts)."""
        own = self._launches.get((ring, weights_code))
        if own is None:
            ids_out, weights_out = self.buffers[ring]
            own = self._launches[(ring, weights_code)] = kernels.PackedLaunch(kernels.own_routing_spec(
                weights_dtype_code=weights_code, ids=ids_out.data.ptr, ids_int64=0, mask=0,
                num_experts=self.num_experts, weights=weights_out.data.ptr,
                num_partials=ids_out.size, ids_out=ids_out, weights_out=weights_out))
        ids_int64 = int(ids.dtype == torch.int64)
        own.set("ids", ids.data_ptr())
        own.set("ids_int64", ids_int64)
        own.set("mask", int(ids_int64 or mask))
        own.set("weights", weights.data_ptr())
        own.set("num_partials", num_partials)
        own.launch(stream, kernels.own_routing_grid(num_partials))
