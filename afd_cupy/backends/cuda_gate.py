"""The greedy gate as one RawKernel (``raw_kernels/model/gate.cu``): what ``gates.select_experts``
runs for CUDA logits when ``impl`` is "auto" (the default) or "kernel".

torch's greedy gate is ~7 kernels per call (float cast, softmax or sigmoid, optional bias add,
top-k, gather, renormalize, int32 cast); ``afd_gate_topk`` does the same per token in one warp.
Same results as torch's path up to float rounding: the weights within a few ulp (``expf`` and
the order of the sums differ), the ids equal except where two selections tie after rounding
(the kernel then takes the lower expert id; torch's order among ties is unspecified). The
numpy twin is ``gates.gate_topk_reference``.

Launches go on torch's current stream of the logits' device, with no host synchronization:
safe inside CUDA graph capture (the outputs come from torch's allocator, i.e. the graph's pool
during a capture). One packed launch is kept per (device, dtype, experts, top_k, scoring,
renormalize, bias or not); each call rewrites its addresses and token count.
"""
from __future__ import annotations

import functools

import torch

from afd_cupy.kernels import specs
from afd_cupy.wire.dtypes import PAYLOAD_DTYPES

#: torch dtype -> the kernels' payload dtype code (raw_kernels/common/wire.cuh DT_*)
_DTYPE_CODES = {payload.torch_dtype: payload.kernel_code for payload in PAYLOAD_DTYPES.values()}
_LAUNCHES: dict = {}


def unsupported_reason(router_logits: torch.Tensor, top_k: int, bias: torch.Tensor | None) -> str | None:
    """Why the kernel cannot gate these logits (None: it can). Checks what the kernel needs:
    CUDA logits of bf16/fp16/fp32, at most GATE_MAX_EXPERTS experts, top_k at most
    GATE_MAX_TOP_K, a bias (if any) on the logits' device, CuPy importable."""
    limits = specs.GATE_LIMITS
    if not router_logits.is_cuda:
        return f"the logits are on {router_logits.device}, not a CUDA device"
    if router_logits.dtype not in _DTYPE_CODES:
        return f"logits dtype {router_logits.dtype} (the kernel reads bf16, fp16 or fp32)"
    if router_logits.shape[1] > limits["GATE_MAX_EXPERTS"]:
        return f"{router_logits.shape[1]} experts > GATE_MAX_EXPERTS = {limits['GATE_MAX_EXPERTS']}"
    if top_k > limits["GATE_MAX_TOP_K"]:
        return f"top_k {top_k} > GATE_MAX_TOP_K = {limits['GATE_MAX_TOP_K']}"
    if bias is not None and bias.device != router_logits.device:
        return f"the bias is on {bias.device}, the logits on {router_logits.device}"
    return _cupy_import_error()


@functools.lru_cache(maxsize=None)
def _cupy_import_error() -> str | None:
    """Why CuPy cannot be imported (None: it can), tried once per process: a failing import
    rescans sys.path every time, too slow for a per-layer call."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: use torch
        return f"CuPy cannot be imported ({type(exc).__name__}: {exc})"
    return None


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring_func: str = "softmax",
                   bias: torch.Tensor | None = None,
                   renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights fp32 [T, K], topk_ids int32 [T, K])`` of the greedy gate, by the kernel.

    ``router_logits``: [T, E] bf16/fp16/fp32 on a CUDA device (made contiguous if it is not);
    ``bias``: float [E] on the same device (selection only) or None. The caller checks the
    arguments (``gates.select_experts`` does; ``unsupported_reason`` must be None).
    """
    device = router_logits.device
    logits = router_logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    scoring = specs.GATE_SCORING[scoring_func]
    key = (device.index, _DTYPE_CODES[logits.dtype], num_experts, top_k, scoring, bool(renormalize),
           bias32 is not None)
    with torch.cuda.device(device):
        launch = _LAUNCHES.get(key)
        if launch is None:
            from afd_cupy import kernels

            launch = _LAUNCHES[key] = kernels.PackedLaunch(specs.gate_topk_spec(
                dtype_code=key[1], logits=logits.data_ptr(), num_tokens=num_tokens,
                num_experts=num_experts, top_k=top_k, scoring=scoring,
                bias=0 if bias32 is None else bias32.data_ptr(), renormalize=int(renormalize),
                topk_weights=weights.data_ptr(), topk_ids=ids.data_ptr()))
        launch.set("logits", logits.data_ptr())
        launch.set("num_tokens", num_tokens)
        launch.set("bias", 0 if bias32 is None else bias32.data_ptr())
        launch.set("topk_weights", weights.data_ptr())
        launch.set("topk_ids", ids.data_ptr())
        launch.launch(torch.cuda.current_stream(device).cuda_stream, specs.gate_grid(num_tokens))
    return weights, ids
