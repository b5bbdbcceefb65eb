"""The cost model: how long a phase takes, given a model shape, a load and an SM share.

All costs are for a process holding a whole GPU (share 1.0). A share ``s`` scales a phase:

    time(s) = fixed + variable / rate(s),   rate(s) = min(1, s / s_sat)

with ``s_sat = compute_sat`` for FLOP-bound parts (GEMM FLOPs, attention FLOPs) and
``bandwidth_sat`` for byte-bound parts (expert weight reads, KV-cache reads): a few SMs
cannot keep HBM busy, but past ~55 % of them more SMs buy no bandwidth. Fixed parts (host
issue, kernel launches, polling) do not scale with the share.

Expert GEMM of one FFN compute batch (routed rows ``r`` over the rank's experts, shared rows
``q``): ``max(weight-read floor, compute)`` where the floor = experts touched x expert bytes
/ weight-read bandwidth and compute = rows x 6 x hidden x intermediate / GEMM FLOP/s.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from afd_cupy.capacity.spec import ModelShape, check_float


@dataclass(frozen=True)
class Costs:
    """Measured (or default) costs at share 1.0; see the module doc for the share model.

    Attention side, per layer of one step: ``attn_fixed_s`` + ``attn_per_token_s`` x tokens
    + ``attn_per_pair_s`` x causal (query, key) pairs (prefill: len x (len + 1) / 2 per request)
    + ``attn_per_ctx_token_s`` x cached tokens read (decode: sum of context lengths).
    Transport, per layer and FFN rank: ``dispatch_fixed_s`` / ``combine_fixed_s`` (the
    kernels' own cost) + the link's latency + bytes / bandwidth. FFN side, per compute batch:
    ``ffn_item_s`` (poll, header decode, launches, reply issue) + the expert GEMM;
    ``ffn_poll_s``: delay between an arrival and the FFN noticing it. The FFN rank is a host
    loop feeding a device stream: the host takes an arrival (``ffn_item_s``), then the device
    runs the GEMMs; with ``ffn_host_overlap`` (cuda: launches are stream-ordered) the host takes
    the next arrival while the device computes, without it (the host backend: one thread
    computes) the next take waits for the compute. ``attn_host_s``: the Attention host's issue
    time per layer (Python, torch's eager ops, the connector's calls) when it is not hidden:
    the host runs ahead of its stream, so the device's layer ``l`` of a step cannot start
    before ``(l + 1) x attn_host_s`` after the step began (0: the host is never the limit).
    ``copy_gbps``: a device copy's rate, GB copied per second (each byte read once and written
    once; DESIGN.md section 8, one H200: 528 MB in 254 us), for the copies that merge the
    items of a compute batch (:func:`merge_copy_time`).
    """

    attn_fixed_s: float = 100e-6
    attn_per_token_s: float = 0.0
    attn_per_pair_s: float = 0.0
    attn_per_ctx_token_s: float = 0.0
    attn_host_s: float = 0.0
    gemm_tflops: float = 600.0
    weight_read_gbps: float = 2600.0
    ffn_item_s: float = 65e-6
    ffn_poll_s: float = 5e-6
    dispatch_fixed_s: float = 20e-6
    combine_fixed_s: float = 15e-6
    compute_sat: float = 1.0
    bandwidth_sat: float = 0.55
    copy_gbps: float = 2080.0
    ffn_host_overlap: bool = True
    source: str = "defaults"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name in ("source", "ffn_host_overlap"):
                continue
            value = getattr(self, f.name)
            if f.name in ("gemm_tflops", "weight_read_gbps", "copy_gbps", "compute_sat", "bandwidth_sat"):
                check_float("Costs", f.name, value, maximum=1.0 if f.name.endswith("_sat") else None)
            else:
                check_float("Costs", f.name, value, inclusive=True)

    def replace(self, **kw) -> "Costs":
        return dataclasses.replace(self, **kw)

    def scaled(self, factor: float) -> "Costs":
        """Every time x ``factor`` (rates / ``factor``): a process that runs ``factor`` times
        slower, e.g. more busy-polling processes than CPU cores on the host backend."""
        check_float("Costs.scaled", "factor", factor)
        times = {f.name: getattr(self, f.name) * factor for f in dataclasses.fields(self)
                 if f.name.endswith("_s")}
        return self.replace(gemm_tflops=self.gemm_tflops / factor,
                            weight_read_gbps=self.weight_read_gbps / factor,
                            copy_gbps=self.copy_gbps / factor,
                            source=f"{self.source}; x{factor:.3g} slower", **times)


def rate(share: float, saturation: float) -> float:
    """Fraction of the full-GPU rate a process with ``share`` of the SMs gets."""
    return min(1.0, share / saturation)


def h200_costs(shape: ModelShape, attn_params: float | None = None,
               kv_bytes_per_token: float | None = None, pair_flops: float | None = None) -> Costs:
    """Documented H200 defaults for ``shape`` (eager issue, bf16):

    - attention FLOP/s 600 TFLOP/s effective (989 peak dense bf16), per token
      2 x ``attn_params`` FLOPs (default 4 x hidden^2: Q, K, V, O of multi-head attention),
      per causal pair ``pair_flops`` (default 4 x hidden: QK^T and PV);
    - decode: ``kv_bytes_per_token`` (default 2 x hidden x dtype bytes: K and V) per cached
      token, read at 3.0 TB/s effective (4.8 TB/s peak);
    - expert GEMMs 600 TFLOP/s; weight reads 2.6 TB/s for the whole GPU (probe_spin_gemm,
      one process, 64 V2-Lite experts = 1.11 GB in 423 us at 768 rows), saturating at 55 %
      of the SMs (bench_step_graph 1A1F at a 50 % MPS share: 66 experts' 1.14 GB in 483 us,
      2.36 TB/s = 2.6 x 0.5 / 0.55);
    - fixed costs of the eager path: 100 us Attention-side per layer, dispatch 20 us,
      combine 15 us, FFN item 65 us (bench_transport's eager decode round trip ~100 us).
    """
    attn_params = 4.0 * shape.hidden ** 2 if attn_params is None else attn_params
    kv_bytes = 2.0 * shape.hidden * shape.dtype_bytes if kv_bytes_per_token is None else kv_bytes_per_token
    pair_flops = 4.0 * shape.hidden if pair_flops is None else pair_flops
    tflops, hbm = 600e12, 3.0e12
    return Costs(attn_per_token_s=2 * attn_params / tflops, attn_per_pair_s=pair_flops / tflops,
                 attn_per_ctx_token_s=kv_bytes / hbm, source="h200 defaults")


def attention_time(costs: Costs, tokens: int, pairs: float, ctx_tokens: float, share: float) -> float:
    """One layer of attention for a step of ``tokens`` tokens, ``pairs`` causal pairs and
    ``ctx_tokens`` cached tokens read, on a process with ``share`` of a GPU (seconds)."""
    flops_part = (costs.attn_per_token_s * tokens + costs.attn_per_pair_s * pairs) / rate(share, costs.compute_sat)
    bytes_part = costs.attn_per_ctx_token_s * ctx_tokens / rate(share, costs.bandwidth_sat)
    return costs.attn_fixed_s + flops_part + bytes_part


def experts_touched(num_tokens: float, top_k: int, experts: int, local_experts: int) -> float:
    """Expected distinct experts of a rank's ``local_experts`` hit by ``num_tokens`` tokens
    routing uniformly to ``top_k`` of ``experts``: each is hit by a token w.p. k / E."""
    if num_tokens <= 0:
        return 0.0
    return local_experts * (1.0 - (1.0 - top_k / experts) ** num_tokens)


def expert_gemm_time(costs: Costs, shape: ModelShape, num_tokens: float, num_ffn: int, share: float) -> float:
    """Expert GEMM time of one FFN rank for a compute batch of ``num_tokens`` tokens (of all
    the items merged into it) under balanced routing: routed rows = tokens x k / F, shared rows
    = tokens / F; max(weight-read floor, compute) for the routed and the shared experts."""
    if num_tokens <= 0:
        return 0.0
    local = math.ceil(shape.experts / num_ffn)
    routed_rows = num_tokens * shape.top_k / num_ffn
    shared_rows = num_tokens / num_ffn if shape.shared_experts else 0.0
    touched = experts_touched(num_tokens, shape.top_k, shape.experts, local) + shape.shared_experts
    floor = touched * shape.expert_weight_bytes / (costs.weight_read_gbps * 1e9) / rate(share, costs.bandwidth_sat)
    flops = (routed_rows + shared_rows * shape.shared_experts) * shape.flops_per_expert_row
    compute = flops / (costs.gemm_tflops * 1e12) / rate(share, costs.compute_sat)
    return max(floor, compute)


def merge_copy_bytes(shape: ModelShape, num_tokens: float, num_ffn: int) -> float:
    """Bytes one FFN rank copies to merge a compute batch of ``num_tokens`` tokens (several
    items) and split its outputs, as ``afd_cupy.ffn.batch`` does: ``merge_items`` concatenates
    the items' routed rows and gathers them into expert-major order (two copies of the routed
    rows) and concatenates their shared rows (one copy); ``split_outputs`` scatters the routed
    outputs back into wire order (one more copy of the routed rows). Balanced routing, pair
    rows (tokens x k / F routed, tokens / F shared)."""
    routed_rows = num_tokens * shape.top_k / num_ffn
    shared_rows = num_tokens / num_ffn if shape.shared_experts else 0.0
    return (3 * routed_rows + shared_rows) * shape.hidden * shape.dtype_bytes


def merge_copy_time(costs: Costs, shape: ModelShape, num_tokens: float, num_ffn: int, share: float) -> float:
    """Device time of :func:`merge_copy_bytes` at ``costs.copy_gbps`` on a process with
    ``share`` of a GPU (a byte-bound part: it saturates at ``bandwidth_sat``), seconds."""
    nbytes = merge_copy_bytes(shape, num_tokens, num_ffn)
    return nbytes / (costs.copy_gbps * 1e9) / rate(share, costs.bandwidth_sat)


def ffn_batch_time(costs: Costs, shape: ModelShape, num_tokens: float, num_ffn: int, share: float) -> float:
    """One FFN compute batch: the fixed item cost + the expert GEMMs (seconds)."""
    return costs.ffn_item_s + expert_gemm_time(costs, shape, num_tokens, num_ffn, share)


def wire_rows(shape: ModelShape, num_tokens: float, num_ffn: int, wire_mode: str) -> float:
    """Rows one replica's item carries to ONE FFN rank (balanced routing).

    pair: one row per (token, expert) routed there (tokens x k / F) + the shared slice
    (tokens / F); dedup: one row per (token, rank) = tokens x P(a token hits the rank), with
    P = 1 - C(E - e, k) / C(E, k) for the rank's e experts (+ the shared slice)."""
    shared = num_tokens / num_ffn if shape.shared_experts else 0.0
    if wire_mode == "pair":
        return num_tokens * shape.top_k / num_ffn + shared
    local = shape.experts / num_ffn
    miss = 1.0
    for i in range(shape.top_k):
        miss *= max(0.0, (shape.experts - local - i) / (shape.experts - i))
    return num_tokens * (1.0 - miss) + shared
