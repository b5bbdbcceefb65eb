"""The self-driven FFN loop (DESIGN §6, FFN side).

The worker pulls work items as they arrive, from any Attention replica and any layer, runs
the local experts on the already routed and grouped rows (no re-routing: a top-1 grouped
GEMM), the shared experts on the shared rows, applies ``routed_scaling_factor`` and writes
the results back. No per-step device synchronization: ordering rides on the stream.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from afd_cupy import moe
from afd_cupy.connector import AFDConnector, FFNWorkItem
from afd_cupy.errors import ConnectorShutdown

logger = logging.getLogger("afd_cupy")

#: (item) -> (routed_out [routed_tokens, H], shared_out [shared_tokens, H] or None)
ExpertFn = Callable[[FFNWorkItem], "tuple[torch.Tensor, torch.Tensor | None]"]


class FFNWorker:
    """Serve work items of ``connector`` (an FFN-side connector).

    Either pass ``experts`` (this rank's local ``moe.ExpertWeights``, or a sequence of them
    indexed by layer) and optionally ``shared`` (fused shared-expert weights, or a sequence
    per layer), or a custom ``expert_fn`` (e.g. identity experts in benchmarks).
    """

    def __init__(self, connector: AFDConnector, experts=None, shared=None, *,
                 expert_fn: ExpertFn | None = None):
        if (experts is None) == (expert_fn is None):
            raise ValueError("pass exactly one of experts= or expert_fn=")
        self.connector = connector
        self.experts = experts
        self.shared = shared
        self.expert_fn = expert_fn or self._moe_outputs
        self.num_served = 0

    @staticmethod
    def _for_layer(weights, layer_idx: int):
        if weights is None or isinstance(weights, moe.ExpertWeights):
            return weights
        if not 0 <= layer_idx < len(weights):
            raise ValueError(f"work item for layer {layer_idx}, worker has weights for {len(weights)} layers")
        return weights[layer_idx]

    def _moe_outputs(self, item: FFNWorkItem):
        experts = self._for_layer(self.experts, item.layer_idx)
        routed = moe.grouped_mlp(item.routed_x, item.group_list, experts,
                                 group_counts_host=list(item.group_list_host))
        shared = None
        if item.shared_x is not None:
            shared_weights = self._for_layer(self.shared, item.layer_idx)
            if shared_weights is None:
                raise ValueError("work item carries shared rows but the worker has no shared experts")
            shared = moe.shared_mlp(item.shared_x, shared_weights)
        return moe.apply_routed_scaling(routed, shared, self.connector.model.routed_scaling_factor)

    def serve(self, item: FFNWorkItem) -> None:
        """Compute one item and send its outputs back."""
        routed, shared = self.expert_fn(item)
        self.connector.send_ffn_work_item_output(item, routed, shared)
        self.num_served += 1

    def step(self, timeout_ms: int | None = None) -> int:
        """Drain up to ``num_layers`` items; return early on a poll timeout. Items served.

        Raises ConnectorShutdown when every Attention rank announced shutdown.
        """
        served = 0
        for _ in range(self.connector.model.num_layers):
            item = self.connector.recv_ffn_work_item(timeout_ms)
            if item is None:
                break
            self.serve(item)
            served += 1
        return served

    def run(self, stop_event: threading.Event | None = None, timeout_ms: int | None = None) -> int:
        """Serve until every Attention rank announced shutdown or ``stop_event`` is set.

        ConnectorShutdown is a normal exit. Returns the number of items served.
        """
        try:
            while stop_event is None or not stop_event.is_set():
                self.step(timeout_ms)
        except ConnectorShutdown:
            logger.info("afd_cupy ffn rank %d: shutdown after %d items",
                        self.connector.role_rank, self.num_served)
        return self.num_served
