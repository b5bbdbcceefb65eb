"""Search the Attention:FFN split: for a GPU budget, every (A, F) with one process per GPU,
simulated under each schedule; the best is the highest tokens/s per GPU whose worst
replica step time p99 meets the SLA (for decode: the time per output token)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from afd_cupy.capacity.costs import Costs
from afd_cupy.capacity.sim import simulate
from afd_cupy.capacity.spec import (LINK_PRESETS, Deployment, Link, ModelShape, ReplicaLoad,
                                    SimConfig, check_float, check_int)
from afd_cupy.errors import ConfigError


@dataclass(frozen=True)
class Target:
    """What the search maximizes under which constraint: tokens/s per GPU with every
    replica's step time p99 <= ``step_p99_sla_s``; F large enough that the experts fit in
    ``hbm_gb`` x ``weight_fraction`` per FFN GPU."""

    step_p99_sla_s: float = math.inf
    hbm_gb: float = 141.0
    weight_fraction: float = 0.85

    def __post_init__(self):
        if self.step_p99_sla_s != math.inf:
            check_float("Target", "step_p99_sla_s", self.step_p99_sla_s)
        check_float("Target", "hbm_gb", self.hbm_gb)
        check_float("Target", "weight_fraction", self.weight_fraction, maximum=1.0)

    def min_ffn(self, shape: ModelShape) -> int:
        """The fewest FFN GPUs that hold every layer's routed + shared experts."""
        total = shape.layers * (shape.experts + shape.shared_experts) * shape.expert_weight_bytes
        return max(1, math.ceil(total / (self.hbm_gb * 1e9 * self.weight_fraction)))


@dataclass(frozen=True)
class Candidate:
    """One simulated (A, F, schedule) point."""

    num_gpus: int
    num_attn: int
    num_ffn: int
    schedule: str
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    step_p50_s: float
    step_p99_s: float
    ffn_busy: float
    meets_sla: bool


def ffn_counts(num_gpus: int, minimum: int) -> list:
    """F candidates: powers of two and multiples of 8 in [minimum, num_gpus - 1]."""
    out = {f for f in range(minimum, num_gpus) if f & (f - 1) == 0 or f % 8 == 0}
    if minimum < num_gpus:
        out.add(minimum)
    return sorted(out)


def search(shape: ModelShape, costs: Costs, load: ReplicaLoad, num_gpus: int, *,
           target: Target = Target(), schedules=("async", "lockstep"), wire_mode: str = "pair",
           gpus_per_node: int = 8, intra_node: Link = LINK_PRESETS["nvlink"],
           inter_node: Link = LINK_PRESETS["rdma"], steps: int = 6, seed: int = 0,
           skew: tuple = ()) -> tuple[list, Candidate | None]:
    """(every candidate, the best meeting the SLA or None). Every replica runs ``load``;
    ``skew``: per-replica multipliers of the decode context length (cycled), e.g. (1, 4, 16)."""
    check_int("search", "num_gpus", num_gpus, minimum=2)
    minimum = target.min_ffn(shape)
    if minimum >= num_gpus:
        raise ConfigError(f"search: the experts need >= {minimum} FFN GPUs of {target.hbm_gb} GB, "
                          f"num_gpus={num_gpus} leaves no Attention GPU")
    rows = []
    for num_ffn in ffn_counts(num_gpus, minimum):
        num_attn = num_gpus - num_ffn
        dep = Deployment.one_per_gpu(num_attn, num_ffn, gpus_per_node, intra_node=intra_node,
                                     inter_node=inter_node)
        loads = tuple(_skewed(load, skew[a % len(skew)]) if skew else load for a in range(num_attn))
        for schedule in schedules:
            res = simulate(shape, dep, loads, costs, SimConfig(schedule, wire_mode, 1, steps, seed))
            p50 = max(r.step_p50_s for r in res.replicas)
            p99 = res.worst_step_p99_s
            rows.append(Candidate(num_gpus, num_attn, num_ffn, schedule, res.tokens_per_s,
                                  res.tokens_per_s_per_gpu, p50, p99, res.ffn_busy,
                                  p99 <= target.step_p99_sla_s))
    ok = [c for c in rows if c.meets_sla]
    return rows, max(ok, key=lambda c: c.tokens_per_s_per_gpu) if ok else None


def _skewed(load: ReplicaLoad, factor: int) -> ReplicaLoad:
    if load.kind == "decode":
        return ReplicaLoad("decode", load.lengths, load.batch_size, load.context_len * factor,
                           load.output_len, load.arrival_rate)
    return ReplicaLoad("prefill", tuple(max(1, n // factor) for n in load.lengths), load.batch_size,
                       load.context_len, load.output_len, load.arrival_rate)
