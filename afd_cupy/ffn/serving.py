"""Which way :meth:`FFNWorker.run <afd_cupy.ffn.worker.FFNWorker.run>` serves: the graph FFN
or the Python loop (docs/design/cuda-graphs.md, "FFNWorker's default serving").

- **graph**: a :class:`~afd_cupy.backends.cuda_ffn_graph.GraphFFNServer` built from the
  worker's experts (or ``identity=True`` for ``expert_fn=identity_experts``) replays CUDA
  graphs that wait for, stage, compute and answer one item each, with no Python per item;
  items too large for its bucket go to its own eager worker (which only ever serves items,
  never runs a loop of its own).
- **loop**: ``recv_ffn_work_item`` + experts + ``send_ffn_work_item_output`` per item in
  Python (both schedules, recorders, overlap, any ``expert_fn``, both backends).

``FFNWorker(serving=...)``: ``"auto"`` (the default) serves with the graph wherever
:func:`graph_ffn_applies` says it can and logs why not otherwise; ``"graph"`` raises
ConfigError naming the reason where it cannot; ``"loop"`` always loops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_cupy import moe
from afd_cupy.errors import ConfigError
from afd_cupy.ffn.graph import MAX_GROUPS
from afd_cupy.ffn.weights import per_layer, stacked_expert_bytes
from afd_cupy.runtime.timeouts import check_timeout

SERVING_MODES = ("auto", "graph", "loop")
#: the graph's in-graph wait bound when run() gets no timeout_ms (GraphFFNServer's default)
GRAPH_IDLE_TIMEOUT_S = 0.01
#: the stacked expert copies the graphs read may take at most this share of free device memory
STACK_MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class ServingPlan:
    """``mode``: "graph" or "loop"; ``reason``: why the loop ("" for the graph)."""

    mode: str
    reason: str = ""


def check_serving(serving: str) -> str:
    if serving not in SERVING_MODES:
        raise ConfigError(f"FFNWorker serving must be one of {SERVING_MODES}, got {serving!r}")
    return serving


def graph_ffn_applies(worker) -> tuple[bool, str]:
    """``(True, "")`` when a GraphFFNServer can serve what ``worker`` (an ``FFNWorker``) serves,
    else ``(False, why)``. Reads the connector's and the worker's settings; on the cuda backend
    also the device (SM major, free memory). Never synchronizes; no collective step."""
    for rule in (_backend_rule, _worker_rule, _connector_rule, _experts_rule):
        reason = rule(worker)
        if reason:
            return False, reason
    return True, ""


def plan_serving(worker) -> ServingPlan:
    """What ``worker.run()`` serves with, from ``worker.serving`` and :func:`graph_ffn_applies`:
    ConfigError for ``serving="graph"`` where the graph FFN does not apply."""
    if worker.serving == "loop":
        return ServingPlan("loop", "serving='loop'")
    is_ok, reason = graph_ffn_applies(worker)
    if is_ok:
        return ServingPlan("graph")
    if worker.serving == "graph":
        raise ConfigError(f"FFNWorker(serving='graph'): the graph FFN cannot serve here: {reason}")
    return ServingPlan("loop", reason)


def graph_idle_timeout_s(timeout_ms) -> float:
    """The graph's in-graph wait bound for ``run(timeout_ms=...)``: at most ``timeout_ms`` (so a
    ``stop_event`` is seen at least as soon as the loop would see it), at most
    :data:`GRAPH_IDLE_TIMEOUT_S` (``close`` waits up to ``depth`` of them)."""
    if timeout_ms is None:
        return GRAPH_IDLE_TIMEOUT_S
    return min(GRAPH_IDLE_TIMEOUT_S, check_timeout("timeout_ms", timeout_ms, unit="ms") / 1000.0)


def open_graph_server(worker, idle_timeout_s: float, previous=None):
    """A GraphFFNServer for ``worker`` (its connector, experts and ``gemm_sm_carveout``):
    ``previous`` (a server this function built for ``worker``) when it has the same wait bound
    and expert mode, else a new one, which captures its graphs (seconds) and holds stacked
    copies of the experts. ConfigError where the server refuses the configuration."""
    from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer  # imports this module's worker

    identity = _uses_identity(worker)
    if previous is not None and (previous.idle_timeout_s, previous.identity) == (idle_timeout_s, identity):
        return previous
    import cupy

    device = torch.device(worker.connector.device)
    # NOTE: run() may be called on a thread of its own, whose current device is GPU 0 for
    # both torch and CuPy: the server allocates and captures on the connector's GPU
    with torch.cuda.device(device), cupy.cuda.Device(device.index or 0):
        if identity:
            server = GraphFFNServer(worker.connector, identity=True, idle_timeout_s=idle_timeout_s,
                                    gemm_sm_carveout=worker.gemm_sm_carveout)
        else:
            server = GraphFFNServer(worker.connector, worker.experts, worker.shared, idle_timeout_s=idle_timeout_s,
                                    gemm_sm_carveout=worker.gemm_sm_carveout)
    server.eager_worker.serving = "loop"  # it serves single items; never a server of its own
    return server


# --------------------------------------------------------------------------- the rules

def _backend_rule(worker) -> str:
    # the data path's declared capabilities decide, not the backend's name
    capabilities = getattr(worker.connector, "capabilities", None)
    if capabilities is None:
        return "the connector declares no data-path capabilities (backend None is not 'cuda')"
    if capabilities.supports_nonblocking:  # receive and reply are enqueued kernels
        return ""
    return (f"the {capabilities.backend} backend has no CUDA graphs (its receive and reply are "
            "host code)")


def _worker_rule(worker) -> str:
    if worker.schedule != "async":
        return f"schedule={worker.schedule!r} (the graph FFN serves the async schedule)"
    if worker.recorder is not None:
        return "a recorder is set (its hooks run per item in the loop)"
    if worker.overlap:
        return "overlap=True (the reply lane is the loop's)"
    if not worker.uses_own_experts and not _uses_identity(worker):
        return (f"a custom expert_fn ({getattr(worker.expert_fn, '__name__', worker.expert_fn)!r}); "
                "the graph runs the worker's own experts or identity_experts")
    return ""


def _connector_rule(worker) -> str:
    capabilities = worker.connector.capabilities
    if not capabilities.device_polling:
        return "poll_mode='host' (the graph's wait is a device kernel: poll_mode='device')"
    if capabilities.put_peers:
        return (f"Attention rank(s) {list(capabilities.put_peers)} are reached by NVSHMEM puts (the "
                "graph replies by direct stores)")
    if worker.connector.layout.is_fp8_dispatch:
        return (f"dispatch_dtype={worker.connector.config.dispatch_dtype!r} (FP8 rows: the graph FFN "
                "decodes them when built directly, GraphFFNServer; FFNWorker's choice keeps the loop)")
    return ""


def _experts_rule(worker) -> str:
    if _uses_identity(worker):
        return ""
    num_layers = worker.connector.model.num_layers
    routed = per_layer(worker.experts, num_layers)
    shared = [s for s in per_layer(worker.shared, num_layers) if s is not None]
    if any(isinstance(w, moe.FP8ExpertWeights) for w in routed):
        return ("FP8 experts (moe.FP8ExpertWeights: the graph FFN runs them with its streamed GEMMs when "
                "built directly, GraphFFNServer(expert_gemm='stream'); FFNWorker's choice keeps the loop)")
    dtypes = sorted({str(w.dtype) for w in routed + shared})
    if dtypes != [str(torch.bfloat16)]:
        return f"experts in {', '.join(dtypes)} (the graph's grouped GEMMs need torch.bfloat16)"
    if any(w.has_bias for w in routed + shared):
        return "expert biases (the graph's GEMMs have none)"
    if any(s.gate is not None for s in shared):
        return "a shared-expert gate (not in the graph yet)"
    for name, group in (("routed", routed), ("shared", shared)):
        if len({_activation(w) for w in group}) > 1:
            return f"{name} experts with different activations per layer (the graph runs one)"
    if routed[0].num_experts > MAX_GROUPS:
        return f"{routed[0].num_experts} experts per rank > {MAX_GROUPS} (one grouped-GEMM problem list)"
    return _device_rule(worker.connector.device, routed, shared)


def _device_rule(device, routed, shared) -> str:
    probe = torch.empty(8, routed[0].hidden_size, dtype=torch.bfloat16, device=device)
    if not moe.grouped_mm_supported(probe, routed[0]):
        return (f"torch._grouped_mm does not take these experts on {device} (needs a CUDA device "
                "of SM 9.x/10.x, bf16, contiguous weights, hidden and intermediate sizes % 8 == 0)")
    free_bytes, _total = torch.cuda.mem_get_info(device)
    return stack_memory_rule(stacked_expert_bytes(routed, shared), free_bytes, device)


def stack_memory_rule(stacked_bytes: int, free_bytes: int, device) -> str:
    """"" when the stacked copies fit :data:`STACK_MEMORY_FRACTION` of the free memory."""
    if stacked_bytes <= STACK_MEMORY_FRACTION * free_bytes:
        return ""
    return (f"stacking the experts for the graphs needs {stacked_bytes / 2**30:.2f} GiB, "
            f"{free_bytes / 2**30:.2f} GiB free on {device} (at most "
            f"{STACK_MEMORY_FRACTION:.0%} of it is used)")


def _uses_identity(worker) -> bool:
    """``expert_fn`` is the testing helper that replies the received rows (the graph's
    ``identity=True``; benchmarks and tools use it)."""
    from afd_cupy.testing.reference import identity_experts  # NOTE: testing/ is a floor above

    return worker.expert_fn is identity_experts


def _activation(weights: moe.ExpertWeights) -> tuple:
    return (weights.activation, weights.swiglu_limit, weights.swiglu_alpha)

