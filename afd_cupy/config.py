"""Frozen, validated configuration: model dimensions, topology, connector extra config.

Every dataclass validates itself in ``__post_init__``; ``from_mapping`` builds one from a
plain dict (e.g. a serving stack's ``connector_extra_config``) and rejects unknown keys.
Messages show the offending values.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from afd_cupy.errors import ConfigError
from afd_cupy.transports import transport_names
from afd_cupy.wire import DISPATCH_DTYPES, WIRE_MODES
from afd_cupy.wire.dtypes import PAYLOAD_DTYPES

#: gate scoring functions of ``ModelConfig.scoring_func`` and ``gates.select_experts``
SCORING_FUNCS = ("softmax", "sigmoid")
#: DeepSeek's gate names (None: group_limited_greedy with n_group, greedy without)
TOPK_METHODS = (None, "greedy", "group_limited_greedy", "noaux_tc")
MOE_SPLITS = ("even",)
#: ConnectorConfig fields local to a rank: they change nothing another rank sees (how long
#: this FFN rank polls, which of two kernel paths writes the same bytes), so they need not
#: agree across ranks (the start-up handshake leaves them out)
RANK_LOCAL_FIELDS = ("recv_poll_timeout_ms", "fused_dispatch", "dedup_dispatch")
#: ConnectorConfig.dedup_dispatch values: the dedup dispatch kernels of the cuda backend
DEDUP_DISPATCHES = ("plan", "ll")
#: largest ConnectorConfig.routed_cap_multiplier: the cap is clipped at every partial of a
#: batch anyway (multiplier = number of FFN ranks covers the worst case)
MAX_ROUTED_CAP_MULTIPLIER = 65536.0


def _require_int(owner: str, name: str, value: Any, *, minimum: int = 1) -> None:
    # NOTE: bool is a subclass of int; a True where a size is expected is a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{owner}.{name} must be >= {minimum}, got {value}")


def _require_float(owner: str, name: str, value: Any, *, positive: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{owner}.{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{owner}.{name} must be a finite number > 0, got {value!r}")


def _require_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be a bool, got {type(value).__name__} {value!r}")


def _from_mapping(cls, mapping: Mapping[str, Any]):
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{cls.__name__}.from_mapping expects a mapping, got {type(mapping).__name__}")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    known = {f.name for f in fields}
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} keys: {unknown}; known keys: {sorted(known)}")
    required = [f.name for f in fields if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in mapping]
    if missing:
        raise ConfigError(f"{cls.__name__} keys missing: {missing} (required: {required})")
    return cls(**dict(mapping))


@dataclass(frozen=True)
class ModelConfig:
    """MoE layer dimensions as the connector and the experts see them.

    ``dtype`` is the payload dtype on the wire and of the expert weights.
    The gate (``gates.model_gate``): ``scoring_func`` softmax or sigmoid, ``renormalize``
    (``norm_topk_prob``), ``n_group``/``topk_group`` for DeepSeek grouped top-k, and
    ``topk_method`` (DeepSeek's names, see ``TOPK_METHODS``; "noaux_tc" is V3's gate).
    """

    hidden_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int = 0
    dtype: str = "bfloat16"
    max_num_batched_tokens: int = 8192
    routed_scaling_factor: float = 1.0
    num_layers: int = 1
    scoring_func: str = "softmax"
    renormalize: bool = True
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str | None = None

    def __post_init__(self) -> None:
        owner = "ModelConfig"
        for name in ("hidden_size", "num_experts", "top_k", "moe_intermediate_size",
                     "max_num_batched_tokens", "num_layers"):
            _require_int(owner, name, getattr(self, name))
        _require_int(owner, "num_shared_experts", self.num_shared_experts, minimum=0)
        _require_float(owner, "routed_scaling_factor", self.routed_scaling_factor)
        _require_bool(owner, "renormalize", self.renormalize)
        if self.dtype not in PAYLOAD_DTYPES:
            raise ConfigError(f"ModelConfig.dtype must be one of {sorted(PAYLOAD_DTYPES)}, got {self.dtype!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"ModelConfig.scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"ModelConfig.top_k={self.top_k} > num_experts={self.num_experts}")
        self._check_groups()
        self._check_topk_method()

    def _check_topk_method(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ConfigError(f"ModelConfig.topk_method must be one of {TOPK_METHODS}, got "
                              f"{self.topk_method!r}")
        if self.topk_method in ("group_limited_greedy", "noaux_tc") and self.n_group is None:
            raise ConfigError(f"ModelConfig.topk_method={self.topk_method!r} needs n_group and "
                              "topk_group")

    def _check_groups(self) -> None:
        if (self.n_group is None) != (self.topk_group is None):
            raise ConfigError(f"ModelConfig.n_group and topk_group go together, got "
                              f"n_group={self.n_group!r} topk_group={self.topk_group!r}")
        if self.n_group is None:
            return
        _require_int("ModelConfig", "n_group", self.n_group)
        _require_int("ModelConfig", "topk_group", self.topk_group)
        if self.num_experts % self.n_group:
            raise ConfigError(f"ModelConfig.num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"ModelConfig.topk_group={self.topk_group} > n_group={self.n_group}")

    @property
    def itemsize(self) -> int:
        """Bytes per payload element."""
        return PAYLOAD_DTYPES[self.dtype].itemsize

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "ModelConfig":
        return _from_mapping(cls, mapping)


@dataclass(frozen=True)
class TopologyConfig:
    """``num_attn_ranks`` Attention ranks and ``num_ffn_ranks`` FFN ranks (any ratio)."""

    num_attn_ranks: int
    num_ffn_ranks: int

    def __post_init__(self) -> None:
        _require_int("TopologyConfig", "num_attn_ranks", self.num_attn_ranks)
        _require_int("TopologyConfig", "num_ffn_ranks", self.num_ffn_ranks)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "TopologyConfig":
        return _from_mapping(cls, mapping)


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's extra config: the RFC's fields, plus ``wire_mode``.

    - ``attn_ranks_per_dp``: Attention ranks per data-parallel replica (tensor parallel
      inside a replica); only rank 0 of a replica sends when > 1.
    - ``ring_depth``: slots per (peer, region); defaults to the number of stages (None).
    - ``routed_cap_multiplier``: head-room of ``routed_cap`` over the even split.
    - ``recv_poll_timeout_ms``: how long one FFN receive polls before returning None (local
      to the rank: need not match across ranks, :data:`RANK_LOCAL_FIELDS`).
    - ``async_moe_ubatching`` / ``async_moe_num_ubatches``: micro-batch stages per layer.
    - ``async_moe_split``: how a batch is split into micro-batches (``"even"``).
    - ``wire_mode``: ``"pair"`` (one row per (token, expert) partial: the RFC's format) or
      ``"dedup"`` (one row per (token, FFN rank it goes to), expanded and reduced on the FFN
      rank); docs/design/dedup.md. Every rank must use the same mode (checked at start-up).
    - ``transport``: how messages reach a peer (docs/design/put-transport.md): ``"direct"`` (stores
      through the peer's mapped window; every peer must be load/store reachable), ``"put"``
      (NVSHMEM one-sided puts from a local staging slot, for every peer: the multi-node path,
      testable on one node) or ``"auto"`` (direct where the peer's window maps, put
      elsewhere), or any transport registered with ``afd_cupy.transports.register``. The host
      backend runs ``"direct"`` and ``"auto"`` (= direct); each transport lists its backends.
    - ``fused_dispatch``: the cuda backend's dispatch in one kernel (every block plans in its
      shared memory) whenever a dispatch of ``max_num_batched_tokens`` fits it: pair mode
      ``afd_dispatch_fused`` (plan + scatter), dedup mode ``afd_dedup_dispatch_fused`` (plan +
      rows + scatter); docs/design/kernels.md. False: always the separate kernels. The same bytes
      reach the window either way (local to the rank, like ``recv_poll_timeout_ms``).
    - ``dedup_dispatch``: which one-kernel dedup dispatch the cuda backend runs: ``"plan"``
      (``afd_dedup_dispatch_fused``, or the separate kernels, as ``fused_dispatch`` says) or
      ``"ll"`` (``afd_dedup_dispatch_ll``: only block 0 ranks the partials, the other blocks
      write the payload rows after a per-token plan; used whenever a dispatch of
      ``max_num_batched_tokens`` fits it, at most 32 FFN ranks, else ``"plan"``). Same bytes
      either way (local to the rank); docs/design/kernels.md.
    - ``dispatch_dtype``: what the dispatched rows (Attention -> FFN) are on the wire:
      ``"payload"`` (the model's dtype, the default) or ``"fp8_e4m3"`` (E4M3 codes with one fp32
      scale per 128 channels, quantized by the Attention side, dequantized to the payload
      dtype by the FFN side before its experts; replies stay in the payload dtype;
      docs/design/fp8.md). FP8 needs a bf16 or fp16 payload, ``hidden_size % 128 == 0`` (checked
      with the model, ConfigError) and ``wire_mode="pair"``. Every rank must use the same value
      (checked at start-up).
    """

    attn_ranks_per_dp: int = 1
    ring_depth: int | None = None
    routed_cap_multiplier: float = 2.0
    recv_poll_timeout_ms: int = 100
    async_moe_ubatching: bool = False
    async_moe_num_ubatches: int = 2
    async_moe_split: str = "even"
    wire_mode: str = "pair"
    transport: str = "direct"
    fused_dispatch: bool = True
    dedup_dispatch: str = "plan"
    dispatch_dtype: str = "payload"

    def __post_init__(self) -> None:
        owner = "ConnectorConfig"
        _require_bool(owner, "fused_dispatch", self.fused_dispatch)
        _require_int(owner, "attn_ranks_per_dp", self.attn_ranks_per_dp)
        _require_float(owner, "routed_cap_multiplier", self.routed_cap_multiplier)
        if self.routed_cap_multiplier > MAX_ROUTED_CAP_MULTIPLIER:
            raise ConfigError(f"{owner}.routed_cap_multiplier must be <= {MAX_ROUTED_CAP_MULTIPLIER:g} "
                              f"(the cap is clipped at every partial of a batch; the number of FFN "
                              f"ranks covers the worst case), got {self.routed_cap_multiplier!r}")
        _require_int(owner, "recv_poll_timeout_ms", self.recv_poll_timeout_ms)
        _require_bool(owner, "async_moe_ubatching", self.async_moe_ubatching)
        _require_int(owner, "async_moe_num_ubatches", self.async_moe_num_ubatches)
        if self.async_moe_split not in MOE_SPLITS:
            raise ConfigError(f"{owner}.async_moe_split must be one of {MOE_SPLITS}, got {self.async_moe_split!r}")
        if self.wire_mode not in WIRE_MODES:
            raise ConfigError(f"{owner}.wire_mode must be one of {WIRE_MODES}, got {self.wire_mode!r}")
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            raise ConfigError(f"{owner}.dispatch_dtype must be one of {DISPATCH_DTYPES}, "
                              f"got {self.dispatch_dtype!r}")
        if self.dispatch_dtype != "payload" and self.wire_mode != "pair":
            raise ConfigError(f"{owner}.dispatch_dtype={self.dispatch_dtype!r} is implemented for "
                              f"wire_mode='pair' only, got wire_mode={self.wire_mode!r}")
        if self.dedup_dispatch not in DEDUP_DISPATCHES:
            raise ConfigError(f"{owner}.dedup_dispatch must be one of {DEDUP_DISPATCHES}, "
                              f"got {self.dedup_dispatch!r}")
        if self.transport not in transport_names():  # the registry (afd_cupy.transports)
            raise ConfigError(f"{owner}.transport must be one of {transport_names()}, got {self.transport!r}")
        if self.ring_depth is None:
            object.__setattr__(self, "ring_depth", self.num_stages)
        _require_int(owner, "ring_depth", self.ring_depth)
        if self.ring_depth < self.num_stages:
            raise ConfigError(f"{owner}.ring_depth={self.ring_depth} < number of stages {self.num_stages}: "
                              "every stage needs its own ring slot")

    @property
    def num_stages(self) -> int:
        """Micro-batch stages per layer (1 without micro-batching)."""
        return self.async_moe_num_ubatches if self.async_moe_ubatching else 1

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "ConnectorConfig":
        return _from_mapping(cls, mapping)
