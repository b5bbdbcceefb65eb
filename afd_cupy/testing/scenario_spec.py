"""The end-to-end scenario's description, importable without torch or the connector.

:class:`Scenario` says what one run does; :func:`run_scenario_rank` is the function a launcher
starts in every rank. Both live here, away from :mod:`afd_cupy.testing.scenario` (which does
the work and imports torch, the connector and the FFN worker), so that a parent process that
only starts ranks (``tools/smoke.py``) does not pay torch's import (3.5 s on the GPU machine)
before its children start paying their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from afd_cupy.config import ConnectorConfig, ModelConfig
from afd_cupy.testing.phases import NO_PHASES


@dataclass(frozen=True)
class Scenario:
    """One run. ``tokens[a][layer]`` = tokens Attention rank a sends at that layer
    (default: ``num_tokens`` everywhere); ``sleep_s[a]`` = pause of rank a between layers,
    so replicas sit at different layers and the FFN serves them out of order."""

    model: ModelConfig
    num_attn: int
    num_ffn: int
    backend: str = "host"
    poll_mode: str = "device"
    num_tokens: int = 16
    tokens: tuple | None = None
    sleep_s: tuple | None = None
    seed: int = 0
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    peer_timeout_s: float = 60.0
    check: bool = True
    favor_ffn_rank: int | None = None  # gate logits pushed towards this FFN rank's experts
    always_send: bool = False  # Attention sends to every FFN rank even when empty (lockstep)
    schedule: str = "async"  # FFN worker schedule: "async" or "lockstep"
    ffn_overlap: bool = False  # FFNWorker(overlap=True): replies on a reply stream / thread
    gemm_sm_carveout: int | str = "auto"  # FFN ranks' gemm_sm_carveout (FFNWorker, GraphFFNServer)
    ffn_serving: str = "loop"  # FFNWorker(serving=...); the loop records each item's history,
    #                            "auto" (tools/smoke.py: what a user gets) serves with the graph
    #                            FFN where it applies (no history then)
    graph_replays: int = 0  # cuda: > 0 captures each layer's send + recv in a CUDA graph and
    #                         replays every layer this many times with fresh inputs
    stage_streams: bool = False  # each layer as two in-flight stages (needs num_stages = 2): the
    #                              first half of the tokens stage 0, the rest stage 1 (cuda: on
    #                              a second stream, events only); combines with graph_replays
    mixed_transport: bool = False  # cuda with transport="auto": a mixed job on one node, the
    #                                (Attention a, FFN j) pairs with a + j odd reached by puts in
    #                                both directions as if nvshmem_ptr did not map them, the
    #                                others direct (docs/design/put-transport.md)

    @property
    def num_checks(self) -> int:
        """Reference comparisons each Attention rank reports."""
        return self.model.num_layers * max(1, self.graph_replays)

    def tokens_for(self, attn_rank: int, layer_idx: int) -> int:
        return self.tokens[attn_rank][layer_idx] if self.tokens else self.num_tokens

    @property
    def world_size(self) -> int:
        return self.num_attn + self.num_ffn


def run_scenario_rank(ctx, scenario: Scenario, timer=NO_PHASES) -> dict:
    """:func:`afd_cupy.testing.scenario.run_rank`, imported in the rank that runs it."""
    from afd_cupy.testing.scenario import run_rank

    return run_rank(ctx, scenario, timer)


def tolerance(dtype: str) -> float:
    """Relative-error bound against the fp64 reference per payload dtype."""
    return {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}[dtype]
