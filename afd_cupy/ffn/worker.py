"""The self-driven FFN worker (docs/design/protocol.md, FFN side), with two schedules.

How :meth:`FFNWorker.run` serves (``serving="auto"``, :mod:`afd_cupy.ffn.serving`): on the cuda
backend, wherever the configuration allows it (async schedule, the worker's own bf16 experts or
``identity_experts``, ``poll_mode="device"``, direct-store peers, no recorder, no overlap, an
SM90/SM100 device), through the graph FFN: a :class:`~afd_cupy.backends.cuda_ffn_graph.GraphFFNServer`
replays CUDA graphs that wait for, compute and answer one item each, no Python per item.
Elsewhere (the host backend included) through the Python loop below, and the log says why once
per ``run()`` ("graph FFN not used: <reason>; serving with the Python loop").

- ``schedule="async"`` (the default, the point of the library): the worker pulls work items as
  they arrive, from any Attention replica and any layer, and answers each one on its own.
- ``schedule="lockstep"``: the synchronous connector's schedule, kept as a baseline. Layer L
  (of micro-batch stage s) is served only once EVERY Attention replica has sent it; the items
  are computed as ONE batch and all replicas get their results together, so a fast replica
  waits for the slow one. Same kernels, same wire; only the schedule differs.

Either way the worker runs the local experts on the already routed and grouped rows (no
re-routing: a grouped GEMM), the shared experts on the shared rows, applies
``routed_scaling_factor`` and writes the results back. No per-step device synchronization:
ordering rides on the stream.

``overlap=True`` (off by default) hands each item's replies to a reply lane
(:mod:`afd_cupy.ffn.overlap`): on cuda a communication stream that waits on an event of the
compute stream, so item i's reply runs while the worker receives item i+1 and its GEMMs run;
on the host backend a reply thread (the same ordering, emulated with real concurrency). The
wire, the replies and their order per worker are unchanged; see docs/design/overlap.md.

``gemm_sm_carveout`` ("auto": 2 SMs on a CUDA device) leaves SMs free beside the expert
GEMMs (class doc). ``recorder=`` (:class:`~afd_cupy.ffn.recorder.FFNRecorder`, opt-in) gets
hooks around each receive, compute and reply; without one each hook site costs an ``is None``.

A replica that announced shutdown, or that an idle poll found dead, leaves the lockstep set
(:mod:`afd_cupy.ffn.lockstep`; NOTE: lockstep needs every replica to send every layer to every
FFN rank: ``AFDConnector(..., always_send=True)`` on the Attention side). When serving fails
(an expert raises), :meth:`FFNWorker.run` calls ``AFDConnector.announce_failure`` before it
re-raises: the Attention ranks raise PeerFailedError naming this rank and the exception.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from afd_cupy import moe
from afd_cupy.connector import AFDConnector, FFNWorkItem
from afd_cupy.errors import ConfigError, ConnectorShutdown, PeerLostError
from afd_cupy.ffn import serving as ffn_serving
from afd_cupy.ffn.batch import MergedBatch, merge_items, merge_order, split_outputs
from afd_cupy.ffn.lockstep import (SCHEDULES, LockstepBuffer, attention_connector_kwargs,
                                   check_schedule, live_attention_ranks)
from afd_cupy.ffn.overlap import reply_lane
from afd_cupy.ffn.recorder import FFNRecorder
from afd_cupy.ffn.serving import SERVING_MODES, ServingPlan
from afd_cupy.ffn.weights import check_weights, per_layer

__all__ = ("FFNWorker", "FFNRecorder", "ExpertFn", "SCHEDULES", "SERVING_MODES", "ServingPlan",
           "MergedBatch", "merge_items", "merge_order", "split_outputs", "per_layer",
           "attention_connector_kwargs")  # the split-out helpers stay importable from here

logger = logging.getLogger("afd_cupy")

#: (item) -> (routed_out [routed_tokens, H], shared_out [shared_tokens, H] or None)
ExpertFn = Callable[[FFNWorkItem], "tuple[torch.Tensor, torch.Tensor | None]"]


class FFNWorker:
    """Serve work items of ``connector`` (an FFN-side connector).

    Either pass ``experts`` (this rank's local ``moe.ExpertWeights``, or FP8 ones,
    ``moe.FP8ExpertWeights``, served by the loop only; or a sequence of them indexed by layer)
    and optionally ``shared`` (fused shared-expert weights, or a sequence per layer), or a
    custom ``expert_fn`` (e.g. identity experts in benchmarks).

    ``schedule``: ``"async"`` (serve each item as it arrives) or ``"lockstep"`` (serve a
    (layer, stage) once every Attention rank sent it, as one batch; see the module doc: the
    Attention side must be built with ``always_send=True``). In lockstep the batch runs one
    grouped GEMM over all items' rows with the worker's own experts; a custom ``expert_fn``
    (given here or assigned to ``self.expert_fn`` later) is called per item instead, still on
    the lockstep schedule.

    ``serving``: how :meth:`run` serves: ``"auto"`` (default: the graph FFN wherever it
    applies, else the Python loop, logged with the reason), ``"graph"`` (ConfigError with the
    reason where it does not apply) or ``"loop"`` (always the Python loop). Decided at each
    :meth:`run` (``expert_fn`` may be reassigned before), by :meth:`serving_plan`; after a run
    ``served_by`` is "graph" or "loop", ``serving_reason`` why the loop, and ``graph_server``
    the server (kept for the next run).
    :meth:`serve`, :meth:`serve_batch` and :meth:`step` are the loop's parts, whatever ``serving``.

    ``overlap``: hand the replies to a reply lane (module doc; cuda: a communication stream,
    host backend: a reply thread) instead of writing them inline. The same replies in the same
    order; :meth:`run` drains the lane before it returns, :meth:`flush` drains it on demand;
    a reply's error is raised on this thread at the next hand-off or drain.

    Counters: ``num_served`` (items answered, or handed to the reply lane) and
    ``num_batches`` (compute batches: one per item under async, one per (layer, stage) under
    lockstep). ``recorder``: an optional :class:`FFNRecorder` (instrumentation hooks; None
    costs nothing but a test per hook site).

    ``gemm_sm_carveout``: SMs the expert GEMMs leave free. ``"auto"`` (the default) is
    ``moe.AUTO_GEMM_SM_CARVEOUT`` (2) on a CUDA device whose torch has the carve-out binding,
    else 0 (``moe.resolve_gemm_sm_carveout``); 0: untouched, no call into torch. When > 0
    every expert call (``expert_fn``, the worker's own experts or a custom one, per item or
    per lockstep batch; the graph FFN's captured GEMMs) runs inside ``moe.sm_carveout(n)``, so
    the persistent grouped GEMM launches ``SMs - n`` CTAs and a kernel spinning next to it (the
    next item's ``wait_any`` under ``overlap``, a peer's wait under MPS) does not push one CTA's
    tiles to the tail (docs/design/performance-decisions.md, "SM carve-out": 1.45x slower
    without, 0.99x of alone with it, on an H200). The setting is process-global while the call
    runs (see ``moe.sm_carveout``); "auto" or an int >= 0 and < the device's SM count, else
    ConfigError. The resolved int is ``self.gemm_sm_carveout``. No effect on the host backend.
    """

    def __init__(self, connector: AFDConnector, experts=None, shared=None, *,
                 expert_fn: ExpertFn | None = None, schedule: str = "async",
                 recorder: FFNRecorder | None = None, overlap: bool = False,
                 gemm_sm_carveout: int | str = "auto", serving: str = "auto"):
        if (experts is None) == (expert_fn is None):
            raise ValueError("pass exactly one of experts= or expert_fn=")
        self.schedule = check_schedule(schedule)
        self.serving = ffn_serving.check_serving(serving)
        self.gemm_sm_carveout = moe.resolve_gemm_sm_carveout(
            gemm_sm_carveout, device=getattr(connector, "device", None), name="FFNWorker.gemm_sm_carveout")
        self.connector, self.experts, self.shared = connector, experts, shared
        if experts is not None:
            check_weights(connector, experts, shared)
        self.expert_fn = expert_fn or self._moe_outputs
        self.recorder = recorder
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be a bool, got {overlap!r}")
        self.overlap = overlap
        self._replies = reply_lane(connector, connector.send_ffn_work_item_output) if overlap else None
        self.num_served = 0
        self.num_batches = 0
        self.served_by: str | None = None  # "graph" / "loop" once run() chose
        self.serving_reason = ""  # why the last run() looped ("" for the graph)
        self.graph_server = None  # the GraphFFNServer of the last graph run
        self._lockstep = LockstepBuffer(connector)

    @staticmethod
    def _for_layer(weights, layer_idx: int):
        if weights is None or isinstance(weights, moe.EXPERT_SET_TYPES):
            return weights
        if not 0 <= layer_idx < len(weights):
            raise ValueError(f"work item for layer {layer_idx}, worker has weights for {len(weights)} layers")
        return weights[layer_idx]

    def _moe_outputs(self, item: FFNWorkItem):
        experts = self._for_layer(self.experts, item.layer_idx)
        routed = moe.grouped_mlp(item.routed_x, item.group_counts, experts,
                                 group_counts_host=list(item.group_counts_host))
        return self._finish(routed, item.shared_x, item.layer_idx)

    def _finish(self, routed: torch.Tensor, shared_x: torch.Tensor | None, layer_idx: int):
        """Shared experts on ``shared_x`` (if any) and the routed-scaling rule."""
        shared = None
        if shared_x is not None:
            shared_weights = self._for_layer(self.shared, layer_idx)
            if shared_weights is None:
                raise ValueError("work item carries shared rows but the worker has no shared experts")
            shared = moe.shared_mlp(shared_x, shared_weights)
        return moe.apply_routed_scaling(routed, shared, self.connector.model.routed_scaling_factor)

    def _merged_outputs(self, items: list[FFNWorkItem]) -> list:
        """One grouped GEMM (and one shared MLP) over all ``items``; outputs per item."""
        batch = merge_items(items)
        experts = self._for_layer(self.experts, items[0].layer_idx)
        counts = batch.group_counts_host
        routed = moe.grouped_mlp(batch.routed_x, torch.tensor(counts, dtype=torch.int32), experts,
                                 group_counts_host=counts)
        routed, shared = self._finish(routed, batch.shared_x, items[0].layer_idx)
        return split_outputs(batch, routed, shared)

    @property
    def uses_own_experts(self) -> bool:
        """Whether ``expert_fn`` is the worker's own experts (not a custom function)."""
        return self.expert_fn == self._moe_outputs

    def serve(self, item: FFNWorkItem) -> None:
        """Compute one item and send its outputs back."""
        recorder = self.recorder
        if recorder is not None:
            recorder.computing((item,))
        routed, shared = self._in_carveout(self.expert_fn, item)
        if recorder is not None:
            recorder.replying((item,))
        self._reply((item,), ((routed, shared),))
        self.num_served += 1
        self.num_batches += 1

    def serve_batch(self, items: list[FFNWorkItem]) -> None:
        """Compute the items of one (layer, stage) together and answer all of them."""
        recorder = self.recorder
        if recorder is not None:
            recorder.computing(items)
        outputs = self._in_carveout(self._batch_outputs, items)
        if recorder is not None:
            recorder.replying(items)
        self._reply(items, outputs)
        self.num_served += len(items)
        self.num_batches += 1

    def _batch_outputs(self, items: list[FFNWorkItem]) -> list:
        if len(items) == 1 or not self.uses_own_experts:
            return [self.expert_fn(item) for item in items]
        return self._merged_outputs(items)

    def _in_carveout(self, compute, arg):
        """``compute(arg)``, inside ``moe.sm_carveout`` when ``gemm_sm_carveout`` > 0 (the GEMMs
        read it when they are launched, i.e. inside the call); plain call otherwise."""
        if not self.gemm_sm_carveout:
            return compute(arg)
        with moe.sm_carveout(self.gemm_sm_carveout):
            return compute(arg)

    def _reply(self, items, outputs) -> None:
        """Answer ``items`` (``outputs[i]`` = (routed_out, shared_out)), then the recorder's
        ``served``: inline by default, through the reply lane with ``overlap``."""
        served = self.recorder.served if self.recorder is not None else None
        if self._replies is not None:
            self._replies.submit(items, outputs, after=served)
            return
        for item, (routed, shared) in zip(items, outputs):
            self.connector.send_ffn_work_item_output(item, routed, shared)
        if served is not None:
            served(items)

    def flush(self) -> None:
        """``overlap``: wait (bounded) until every reply handed to the lane was written (cuda:
        the reply stream synchronized) and raise a reply's error; no-op without overlap."""
        if self._replies is not None:
            self._replies.drain()

    def _recorded_receive(self, timeout_ms: int | None) -> FFNWorkItem | None:
        """``recv_ffn_work_item`` between the recorder's ``polling`` and ``received`` hooks."""
        self.recorder.polling()
        item = self.connector.recv_ffn_work_item(timeout_ms)
        if item is not None:
            self.recorder.received(self, item)
        return item

    def _receive(self, timeout_ms: int | None) -> FFNWorkItem | None:
        return (self.connector.recv_ffn_work_item(timeout_ms) if self.recorder is None
                else self._recorded_receive(timeout_ms))

    def step(self, timeout_ms: int | None = None) -> int:
        """Receive up to ``num_layers`` items (``num_layers * num_attn_ranks`` in lockstep)
        and serve what the schedule allows; return early on a poll timeout. Items served.

        Raises ConnectorShutdown when every Attention rank announced shutdown.
        """
        if self.schedule == "lockstep":
            return self._step_lockstep(timeout_ms)
        served = 0
        for _ in range(self.connector.model.num_layers):
            item = self._receive(timeout_ms)
            if item is None:
                break
            self.serve(item)
            served += 1
        return served

    def _step_lockstep(self, timeout_ms: int | None) -> int:
        served = 0
        num_attn = self.connector.topology.num_attn_ranks
        for _ in range(self.connector.model.num_layers * num_attn):
            item = self._receive(timeout_ms)
            if item is None:
                break
            batch = self._lockstep.hold(item, live_attention_ranks(self.connector))
            if batch:
                self.serve_batch(batch)
                served += len(batch)
        # a replica that shut down or died leaves the lockstep set: serve what the others sent
        for batch in self._lockstep.ready_batches(live_attention_ranks(self.connector)):
            self.serve_batch(batch)
            served += len(batch)
        return served

    @property
    def num_waiting(self) -> int:
        """Items received but not yet served (lockstep buffer)."""
        return self._lockstep.num_waiting

    # --- run: the graph FFN or the loop ----------------------------------------------------
    def serving_plan(self) -> ServingPlan:
        """What :meth:`run` would serve with now (``ffn_serving.plan_serving``): ``mode``
        "graph" or "loop" and, for the loop, why. ConfigError for ``serving="graph"`` where
        the graph FFN cannot serve."""
        return ffn_serving.plan_serving(self)

    def run(self, stop_event: threading.Event | None = None, timeout_ms: int | None = None) -> int:
        """Serve until every Attention rank announced shutdown or ``stop_event`` is set, with
        the graph FFN or the Python loop (``serving``; the class doc). Returns ``num_served``
        (items served by this worker, over all its runs).

        ConnectorShutdown is a normal exit. ``timeout_ms``: the loop's poll timeout; the graph's
        in-graph wait bound is at most it (and at most 10 ms): either way ``stop_event`` is
        seen within about ``timeout_ms``. With ``overlap`` the reply lane is drained and
        stopped first (its errors raised; on an exception from the loop they are logged and
        the loop's exception propagates). On an exception (building the graph server included)
        the connector's ``announce_failure`` is called before it propagates.
        """
        try:
            server = self._graph_server(timeout_ms)
        except Exception as exc:
            self._announce_failure(exc)
            raise
        if server is None:
            return self._run_loop(stop_event, timeout_ms)
        return self._run_graph(server, stop_event)

    def _graph_server(self, timeout_ms):
        """The GraphFFNServer this run serves with (built, or the last run's when it fits), or
        None for the loop (logged once here with the reason)."""
        plan = self.serving_plan()
        if plan.mode == "graph":
            idle_timeout_s = ffn_serving.graph_idle_timeout_s(timeout_ms)
            try:
                server = ffn_serving.open_graph_server(self, idle_timeout_s, self.graph_server)
            except ConfigError as exc:  # a limit the check above does not know
                if self.serving == "graph":
                    raise
                plan = ServingPlan("loop", f"GraphFFNServer refused: {exc}")
            if plan.mode == "graph":
                self.graph_server, self.served_by, self.serving_reason = server, "graph", ""
                logger.info("afd_cupy ffn rank %s: serving with the graph FFN (%d bucket(s), "
                            "%d queued replays)", self.connector.role_rank, len(server.buckets), server.depth)
                return server
        self.served_by, self.serving_reason = "loop", plan.reason
        level = logging.WARNING if getattr(self.connector, "backend", None) == "cuda" \
            and self.serving == "auto" else logging.INFO
        logger.log(level, "afd_cupy ffn rank %s: graph FFN not used: %s; serving with the Python loop",
                   getattr(self.connector, "role_rank", "?"), plan.reason)
        return None

    def _run_graph(self, server, stop_event) -> int:
        """``server.run``; its items count as this worker's. On an error: the queued replays
        collected (``close``, logged), then the failure announced."""
        before = server.num_served
        try:
            server.run(stop_event)
        except BaseException as exc:
            try:
                server.close()
            except Exception as close_exc:
                logger.warning("afd_cupy ffn rank %s: graph FFN closed with an error after it "
                               "failed: %r", self.connector.role_rank, close_exc)
            if isinstance(exc, Exception):
                self._announce_failure(exc)
            raise
        finally:
            self.num_served += server.num_served - before
            self.num_batches += server.num_served - before
        return self.num_served

    def _run_loop(self, stop_event, timeout_ms) -> int:
        try:
            while stop_event is None or not stop_event.is_set():
                self.step(timeout_ms)
        except ConnectorShutdown:
            logger.info("afd_cupy ffn rank %d: shutdown after %d items",
                        self.connector.role_rank, self.num_served)
            self._lockstep.warn_unserved()
        except Exception as exc:
            self._close_replies(quiet=True)
            self._announce_failure(exc)
            raise
        except BaseException:
            self._close_replies(quiet=True)
            raise
        self._close_replies(quiet=False)
        return self.num_served

    def _announce_failure(self, exc: Exception) -> None:
        """Tell the Attention ranks that this worker failed (``AFDConnector.announce_failure``):
        they raise PeerFailedError naming this rank and ``exc`` instead of timing out. Not
        for a lost peer (nobody is left to tell) or a shut-down connector."""
        announce = getattr(self.connector, "announce_failure", None)
        if announce is None or isinstance(exc, PeerLostError):
            return
        try:
            announce(exc)
        except Exception as announce_exc:  # the loop's own error matters more
            logger.warning("afd_cupy ffn rank %d: could not announce the failure %r: %s",
                           self.connector.role_rank, exc, announce_exc)

    def _close_replies(self, *, quiet: bool) -> None:
        if self._replies is None:
            return
        try:
            self._replies.close()
        except Exception as exc:
            if not quiet:
                raise
            logger.warning("afd_cupy ffn rank %d: reply lane closed with an error after the loop "
                           "failed: %r", self.connector.role_rank, exc)

