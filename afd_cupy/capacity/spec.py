"""Inputs of the capacity planner: frozen dataclasses validated on construction.

Every invalid value raises :class:`afd_cupy.errors.ConfigError` naming the class, the field
and the value (``Link.bandwidth_gbps must be a finite number > 0, got -1``). Times are
seconds, bandwidths GB/s (1e9 bytes/s), shares fractions of one GPU's SMs in (0, 1].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from afd_cupy.errors import ConfigError

SCHEDULES = ("async", "lockstep", "async_merge")
WIRE_MODES = ("pair", "dedup")
#: the order in which an FFN rank's host loop takes the arrivals waiting for it (SimConfig.ffn_pick)
FFN_PICKS = ("rotate", "fifo")
LOAD_KINDS = ("prefill", "decode")


def check_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    """Raise ConfigError unless ``value`` is an int >= ``minimum`` (bool rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{owner}.{name} must be >= {minimum}, got {value}")


def check_float(owner: str, name: str, value: Any, *, minimum: float = 0.0,
                inclusive: bool = False, maximum: float | None = None) -> None:
    """Raise ConfigError unless ``value`` is a finite number > ``minimum`` (>= if inclusive)
    and <= ``maximum`` when given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{owner}.{name} must be a finite number, got {value!r}")
    low_ok = value >= minimum if inclusive else value > minimum
    if not low_ok:
        op = ">=" if inclusive else ">"
        raise ConfigError(f"{owner}.{name} must be a finite number {op} {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{owner}.{name} must be <= {maximum}, got {value!r}")


def check_choice(owner: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{owner}.{name} must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """The MoE model as the planner sees it (per layer; every layer identical)."""

    layers: int
    hidden: int
    experts: int
    top_k: int
    intermediate: int
    shared_experts: int = 0
    dtype_bytes: int = 2

    def __post_init__(self):
        for name in ("layers", "hidden", "experts", "top_k", "intermediate", "dtype_bytes"):
            check_int("ModelShape", name, getattr(self, name))
        check_int("ModelShape", "shared_experts", self.shared_experts, minimum=0)
        if self.top_k > self.experts:
            raise ConfigError(f"ModelShape.top_k={self.top_k} > experts={self.experts}")

    @property
    def expert_weight_bytes(self) -> int:
        """Bytes of one routed expert's w13 + w2 (3 x hidden x intermediate)."""
        return 3 * self.hidden * self.intermediate * self.dtype_bytes

    @property
    def flops_per_expert_row(self) -> int:
        """FLOPs of one (token, expert) row through one expert: 2 x 3 x hidden x intermediate."""
        return 6 * self.hidden * self.intermediate

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype_bytes


@dataclass(frozen=True)
class Link:
    """One direction of a connection: time(bytes) = latency_s + bytes / (bandwidth_gbps * 1e9)."""

    bandwidth_gbps: float
    latency_s: float
    name: str = ""

    def __post_init__(self):
        check_float("Link", "bandwidth_gbps", self.bandwidth_gbps)
        check_float("Link", "latency_s", self.latency_s, inclusive=True)

    def time_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / (self.bandwidth_gbps * 1e9)


#: presets (effective, not peak): H200 NVLink 4 ~ 450 GB/s one way of 900 bidirectional,
#: achieved ~ 70 % by copy kernels; one GPU: device-local copy (HBM read + write) ~ 2 TB/s;
#: RDMA 400 Gb/s ConnectX-7 per GPU ~ 45 GB/s effective with ~ 5 us extra latency.
LINK_PRESETS = {
    "same_gpu": Link(2000.0, 2e-6, "same_gpu"),
    "nvlink": Link(320.0, 4e-6, "nvlink"),
    "rdma": Link(45.0, 10e-6, "rdma"),
}


@dataclass(frozen=True)
class Placement:
    """Where one process runs: a GPU id and its SM share (CUDA MPS active thread percentage
    / 100; 1.0 = the whole GPU). ``node`` picks the link class between GPUs."""

    gpu: int
    share: float = 1.0
    node: int = 0

    def __post_init__(self):
        check_int("Placement", "gpu", self.gpu, minimum=0)
        check_int("Placement", "node", self.node, minimum=0)
        check_float("Placement", "share", self.share, maximum=1.0)


def parse_placements(text: str) -> tuple:
    """``'0:30,0:30,1'`` -> (Placement(0, .30), Placement(0, .30), Placement(1, 1.0)); a GPU
    may carry a node as ``node/gpu`` (``'1/0:50'``)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            raise ConfigError(f"empty placement entry in {text!r}")
        try:
            where, _, pct = item.partition(":")
            node, _, gpu = where.rpartition("/")
            out.append(Placement(int(gpu), float(pct) / 100 if pct else 1.0, int(node) if node else 0))
        except ValueError as err:
            raise ConfigError(f"bad placement {item!r} in {text!r}: {err}") from None
    return tuple(out)


@dataclass(frozen=True)
class ReplicaLoad:
    """What one Attention replica runs.

    prefill: every batch is the requests ``lengths`` (tokens each; causal attention per
    request). decode: a batch of up to ``batch_size`` requests with ``context_len`` tokens of
    KV cache each; one output token per request per step; a request leaves after
    ``output_len`` steps. ``arrival_rate``: new batches (prefill) or requests (decode) per
    second, open loop (Poisson, seeded); ``None`` = closed loop (always full / back to back).
    ``ffn``: False for a replica that runs its attention only and sends nothing (a background
    load on its GPU, as bench_decode's co-run solo round runs the other replicas).
    """

    kind: str = "prefill"
    lengths: tuple = (2048,)
    batch_size: int = 1
    context_len: int = 1024
    output_len: int = 256
    arrival_rate: float | None = None
    ffn: bool = True

    def __post_init__(self):
        check_choice("ReplicaLoad", "kind", self.kind, LOAD_KINDS)
        if not isinstance(self.ffn, bool):
            raise ConfigError(f"ReplicaLoad.ffn must be a bool, got {self.ffn!r}")
        if not isinstance(self.lengths, tuple) or not self.lengths:
            raise ConfigError(f"ReplicaLoad.lengths must be a non-empty tuple, got {self.lengths!r}")
        for length in self.lengths:
            check_int("ReplicaLoad", "lengths[]", length)
        check_int("ReplicaLoad", "batch_size", self.batch_size)
        check_int("ReplicaLoad", "context_len", self.context_len)
        check_int("ReplicaLoad", "output_len", self.output_len)
        if self.arrival_rate is not None:
            check_float("ReplicaLoad", "arrival_rate", self.arrival_rate)

    def full_tokens(self) -> int:
        """Tokens of one full batch (prefill: sum of lengths; decode: batch_size)."""
        return sum(self.lengths) if self.kind == "prefill" else self.batch_size


@dataclass(frozen=True)
class Deployment:
    """A Attention replicas and F FFN ranks, their placements and the links between them.

    ``links``: optional ``{(attention_idx, ffn_idx): Link}`` overrides; otherwise a pair on the
    same GPU uses ``same_gpu``, on the same node ``intra_node``, else ``inter_node``.
    ``hbm_contention`` (κ, per unit of share): one-GPU model, a compute phase that starts
    while other processes of its GPU are busy takes ``1 + κ * (sum of their shares)`` times
    longer; ``ffn_contention``: the FFN's expert GEMMs' own κ (None: ``hbm_contention``, one
    κ for every kind of phase), so the attention phases keep ``hbm_contention``;
    ``attn_gemm_contention``: an attention phase's κ per unit share of the expert-GEMM phases
    beside it (None: ``hbm_contention``, the same as beside another attention).
    ``mps_caps``: the shares are CUDA MPS caps (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``), which
    may sum past 1 on a GPU (the benchmarks' presets run three processes at 50 % each);
    otherwise they are partitions and a GPU's shares must sum to at most 1.
    """

    attention: tuple
    ffn: tuple
    intra_node: Link = LINK_PRESETS["nvlink"]
    inter_node: Link = LINK_PRESETS["rdma"]
    same_gpu: Link = LINK_PRESETS["same_gpu"]
    links: dict = field(default_factory=dict)
    hbm_contention: float = 0.0
    mps_caps: bool = False
    ffn_contention: float | None = None
    attn_gemm_contention: float | None = None

    def __post_init__(self):
        for name in ("attention", "ffn"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not value:
                raise ConfigError(f"Deployment.{name} must be a non-empty tuple of Placement, got {value!r}")
            for p in value:
                if not isinstance(p, Placement):
                    raise ConfigError(f"Deployment.{name} holds {p!r}, not a Placement")
        check_float("Deployment", "hbm_contention", self.hbm_contention, inclusive=True)
        for name in ("ffn_contention", "attn_gemm_contention"):
            if getattr(self, name) is not None:
                check_float("Deployment", name, getattr(self, name), inclusive=True)
        for key, link in self.links.items():
            a, f = key
            if not (0 <= a < len(self.attention) and 0 <= f < len(self.ffn)) or not isinstance(link, Link):
                raise ConfigError(f"Deployment.links[{key!r}] = {link!r}: bad pair or not a Link")
        totals: dict = {}
        for p in self.attention + self.ffn:
            totals[(p.node, p.gpu)] = totals.get((p.node, p.gpu), 0.0) + p.share
        for (node, gpu), total in sorted(totals.items()):
            if total > 1.0 + 1e-9 and not self.mps_caps:
                raise ConfigError(f"Deployment: shares on node {node} GPU {gpu} sum to {total:.2f} > 1 "
                                  f"(MPS caps may: mps_caps=True)")

    def contention(self, phase: str, beside: str | None = None) -> float:
        """κ of a kind of phase, ``"attention"`` or ``"ffn"`` (the expert GEMMs), per unit
        share of the phases of kind ``beside`` running next to it (None: any kind)."""
        if phase == "ffn" and self.ffn_contention is not None:
            return self.ffn_contention
        if phase == "attention" and beside == "ffn" and self.attn_gemm_contention is not None:
            return self.attn_gemm_contention
        return self.hbm_contention

    @property
    def contended(self) -> bool:
        """True where some phase slows next to others (any κ > 0)."""
        return self.hbm_contention > 0 or bool(self.ffn_contention) or bool(self.attn_gemm_contention)

    @property
    def num_attn(self) -> int:
        return len(self.attention)

    @property
    def num_ffn(self) -> int:
        return len(self.ffn)

    def link(self, attn_idx: int, ffn_idx: int) -> Link:
        if (attn_idx, ffn_idx) in self.links:
            return self.links[(attn_idx, ffn_idx)]
        a, f = self.attention[attn_idx], self.ffn[ffn_idx]
        if a.node != f.node:
            return self.inter_node
        return self.same_gpu if a.gpu == f.gpu else self.intra_node

    @property
    def num_gpus(self) -> int:
        return len({(p.node, p.gpu) for p in self.attention + self.ffn})

    @classmethod
    def one_per_gpu(cls, num_attn: int, num_ffn: int, gpus_per_node: int = 8, **kw) -> "Deployment":
        """Every process on its own GPU (share 1), Attention first, ``gpus_per_node`` per node."""
        check_int("Deployment", "num_attn", num_attn)
        check_int("Deployment", "num_ffn", num_ffn)
        check_int("Deployment", "gpus_per_node", gpus_per_node)
        ranks = [Placement(i % gpus_per_node, 1.0, i // gpus_per_node) for i in range(num_attn + num_ffn)]
        return cls(tuple(ranks[:num_attn]), tuple(ranks[num_attn:]), **kw)


@dataclass(frozen=True)
class SimConfig:
    """How to run the simulation: the schedule, the wire mode, how long, the seed.

    ``noise_cv``: service-time noise, the coefficient of variation (std / mean) of a
    lognormal factor of mean 1 drawn independently for every attention layer, FFN host take
    and expert GEMM batch (0: deterministic costs). ``seed`` seeds the open-loop arrivals and,
    through a separate stream, the noise.

    ``ffn_pick``: which waiting arrival an FFN rank takes next. ``"rotate"`` (the library's:
    ``afd_wait_any`` and the graph FFN's wait scan the slots from the one after the slot they
    last took, and a slot is ``Attention rank x ring depth + ring``, so the waiting replicas are
    taken round robin in rank order); ``"fifo"``: by arrival time (a what-if).
    ``merge_copies``: a compute batch of several items (lockstep, async_merge) pays the device
    copies that merge them and split the outputs (``costs.merge_copy_time``); False leaves
    them out (an ablation).
    """

    schedule: str = "async"
    wire_mode: str = "pair"
    warmup_steps: int = 2
    steps: int = 10
    seed: int = 0
    noise_cv: float = 0.0
    ffn_pick: str = "rotate"
    merge_copies: bool = True

    def __post_init__(self):
        check_choice("SimConfig", "schedule", self.schedule, SCHEDULES)
        check_choice("SimConfig", "wire_mode", self.wire_mode, WIRE_MODES)
        check_choice("SimConfig", "ffn_pick", self.ffn_pick, FFN_PICKS)
        check_int("SimConfig", "warmup_steps", self.warmup_steps, minimum=0)
        check_int("SimConfig", "steps", self.steps)
        check_int("SimConfig", "seed", self.seed, minimum=0)
        check_float("SimConfig", "noise_cv", self.noise_cv, inclusive=True, maximum=2.0)
