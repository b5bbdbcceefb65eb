"""The self-driven FFN loop (docs/design/protocol.md, FFN side), with two schedules.

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
(:mod:`afd_cupy.ffn_overlap`): on cuda a communication stream that waits on an event of the
compute stream, so item i's reply runs while the worker receives item i+1 and its GEMMs run;
on the host backend a reply thread (the same ordering, emulated with real concurrency). The
wire, the replies and their order per worker are unchanged; see docs/design/overlap.md.

``gemm_sm_carveout`` ("auto" by default: 2 SMs on a CUDA device, 0 on the host backend)
launches each expert call's GEMMs inside ``moe.sm_carveout(n)``: they leave n SMs free for a
kernel spinning next to them (the next item's wait under ``overlap``, a peer's wait under MPS),
which otherwise makes torch's persistent grouped GEMM 1.45x slower; docs/design/performance-decisions.md.

Instrumentation is opt-in: ``FFNWorker(..., recorder=...)`` calls the :class:`FFNRecorder`
hooks around each receive, compute and reply (benchmarks use it for busy time, queue depth and
timelines); without a recorder each hook site costs one ``is None`` test.

A replica that announced shutdown, or that an idle poll found dead, leaves the lockstep set:
the worker serves the others without it (its held items are dropped, logged). When the loop
fails (an expert raises), :meth:`FFNWorker.run` calls ``AFDConnector.announce_failure`` before
it re-raises: the Attention ranks raise PeerFailedError naming this rank and the exception.

NOTE (lockstep): every replica must send every layer to every FFN rank, even when it has no
rows for it, or the worker waits for a message that never comes (until the Attention side's
peer timeout). Build the Attention-side connectors with ``AFDConnector(..., always_send=True)``.
The FFN side cannot check this: it only sees what arrives.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from afd_cupy import moe
from afd_cupy.connector import AFDConnector, FFNWorkItem
from afd_cupy.errors import ConfigError, ConnectorShutdown
from afd_cupy.ffn_overlap import reply_lane

logger = logging.getLogger("afd_cupy")

SCHEDULES = ("async", "lockstep")

#: (item) -> (routed_out [routed_tokens, H], shared_out [shared_tokens, H] or None)
ExpertFn = Callable[[FFNWorkItem], "tuple[torch.Tensor, torch.Tensor | None]"]


# --------------------------------------------------------------------------- batch merge/split

@dataclass(frozen=True)
class MergedBatch:
    """Work items of one (layer, stage) merged into one expert-grouped batch.

    - ``routed_x``: [num_routed, H] item dtype/device: for each local expert e, the rows of
      item 0's group e, then item 1's group e, ... (what ``moe.grouped_mlp`` reads).
    - ``group_counts_host``: rows per local expert of the merged batch (sum of the items').
    - ``order``: int64 [num_routed] on the items' device: merged row j is row ``order[j]`` of
      the items' routed rows concatenated in item order (each item in its own wire order).
    - ``routed_sizes`` / ``shared_sizes``: rows of each item.
    - ``shared_x``: [num_shared, H] the items' shared rows concatenated, or None if none.
    """

    routed_x: torch.Tensor
    group_counts_host: list
    order: torch.Tensor
    routed_sizes: list
    shared_x: torch.Tensor | None
    shared_sizes: list


def merge_order(counts: np.ndarray) -> np.ndarray:
    """counts: int [num_items, num_experts] rows per (item, local expert) -> int64 [sum]:
    position, in the items' rows concatenated in item order, of each merged row (expert-major,
    then item). Pure host arithmetic on header counts: no device access."""
    counts = np.asarray(counts, np.int64)
    item_rows = counts.sum(axis=1)
    item_start = np.concatenate(([0], np.cumsum(item_rows)[:-1]))
    group_start = np.cumsum(counts, axis=1) - counts  # start of group e inside its item
    seg_src = (item_start[:, None] + group_start).T.ravel()  # segments in (expert, item) order
    seg_len = counts.T.ravel()
    seg_dst = np.cumsum(seg_len) - seg_len
    total = int(seg_len.sum())
    return np.repeat(seg_src - seg_dst, seg_len) + np.arange(total, dtype=np.int64)


def merge_items(items: Sequence[FFNWorkItem]) -> MergedBatch:
    """Merge the routed and shared rows of ``items`` (same layer; same dtype and device).

    Two device copies at most (concatenate, then one ``index_select`` into expert-major
    order); the gather index is built on the host from the headers' counts and copied to
    the device without a synchronization.
    """
    counts = np.array([item.group_counts_host for item in items], np.int64).reshape(len(items), -1)
    routed_sizes = [int(item.routed_x.shape[0]) for item in items]
    first = items[0].routed_x
    order_host = torch.from_numpy(merge_order(counts))
    order = order_host.to(first.device, non_blocking=True)
    concatenated = torch.cat([item.routed_x for item in items]) if sum(routed_sizes) else first[:0]
    routed_x = concatenated.index_select(0, order) if sum(routed_sizes) else concatenated
    shared_parts = [item.shared_x for item in items if item.shared_x is not None]
    shared_sizes = [0 if item.shared_x is None else int(item.shared_x.shape[0]) for item in items]
    shared_x = torch.cat(shared_parts) if shared_parts else None
    return MergedBatch(routed_x=routed_x, group_counts_host=[int(c) for c in counts.sum(axis=0)],
                       order=order, routed_sizes=routed_sizes, shared_x=shared_x,
                       shared_sizes=shared_sizes)


def split_outputs(batch: MergedBatch, routed_out: torch.Tensor, shared_out: torch.Tensor | None):
    """Inverse of :func:`merge_items` for the outputs: a list, per item, of
    ``(routed_out [routed_sizes[i], H] in the item's wire order, shared_out [shared_sizes[i], H]
    or None when the item had no shared rows)``. Views of two new tensors."""
    wire_order = torch.empty_like(routed_out)
    if routed_out.shape[0]:
        wire_order.index_copy_(0, batch.order, routed_out)
    routed_parts = torch.split(wire_order, batch.routed_sizes)
    if shared_out is None:
        shared_parts = [None] * len(batch.shared_sizes)
    else:
        shared_parts = list(torch.split(shared_out, batch.shared_sizes))
    return [(routed, shared if size else None)
            for routed, shared, size in zip(routed_parts, shared_parts, batch.shared_sizes)]


# --------------------------------------------------------------------------- instrumentation

class FFNRecorder(Protocol):
    """Opt-in hooks of :class:`FFNWorker` (``recorder=``), called on the worker's thread.

    Per receive: ``polling()`` before ``recv_ffn_work_item``, ``received(worker, item)`` when it
    returned an item (before the item is served or, in lockstep, held). Per compute batch (one
    item under async, one per (layer, stage) under lockstep): ``computing(items)`` before the
    experts are called, ``replying(items)`` after them, before the first reply is written, and
    ``served(items)`` after the last reply call returned. On cuda the expert and reply calls
    only enqueue work on the current stream: a recorder that wants device time records events
    there (and must not synchronize). With ``overlap=True`` ``served`` runs once the replies
    were handed to the reply lane: on cuda with the reply stream current (an event recorded
    there completes when the replies have run), on the host right after the hand-off.
    """

    def polling(self) -> None: ...

    def received(self, worker: "FFNWorker", item: FFNWorkItem) -> None: ...

    def computing(self, items: Sequence[FFNWorkItem]) -> None: ...

    def replying(self, items: Sequence[FFNWorkItem]) -> None: ...

    def served(self, items: Sequence[FFNWorkItem]) -> None: ...


# --------------------------------------------------------------------------- the worker

class FFNWorker:
    """Serve work items of ``connector`` (an FFN-side connector).

    Either pass ``experts`` (this rank's local ``moe.ExpertWeights``, or a sequence of them
    indexed by layer) and optionally ``shared`` (fused shared-expert weights, or a sequence
    per layer), or a custom ``expert_fn`` (e.g. identity experts in benchmarks).

    ``schedule``: ``"async"`` (serve each item as it arrives) or ``"lockstep"`` (serve a
    (layer, stage) once every Attention rank sent it, as one batch; see the module doc: the
    Attention side must be built with ``always_send=True``). In lockstep the batch runs one
    grouped GEMM over all items' rows with the worker's own experts; a custom ``expert_fn``
    (given here or assigned to ``self.expert_fn`` later) is called per item instead, still on
    the lockstep schedule.

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
    per lockstep batch) runs inside ``moe.sm_carveout(n)``, so the persistent grouped GEMM
    launches ``SMs - n`` CTAs and a kernel spinning next to it (the next item's ``wait_any``
    under ``overlap``, a peer's wait under MPS) does not push one CTA's tiles to the tail
    (docs/design/performance-decisions.md, "SM carve-out": 1.45x slower without, 0.99x of alone with it, on an
    H200). The setting is process-global while the call runs (see ``moe.sm_carveout``);
    "auto" or an int >= 0 and < the device's SM count, else ConfigError. The resolved int is
    ``self.gemm_sm_carveout``. No effect on the host backend (CPU GEMMs).
    """

    def __init__(self, connector: AFDConnector, experts=None, shared=None, *,
                 expert_fn: ExpertFn | None = None, schedule: str = "async",
                 recorder: FFNRecorder | None = None, overlap: bool = False,
                 gemm_sm_carveout: int | str = "auto"):
        if (experts is None) == (expert_fn is None):
            raise ValueError("pass exactly one of experts= or expert_fn=")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.gemm_sm_carveout = moe.resolve_gemm_sm_carveout(
            gemm_sm_carveout, device=getattr(connector, "device", None), name="FFNWorker.gemm_sm_carveout")
        self.connector = connector
        self.experts = experts
        self.shared = shared
        if experts is not None:
            _check_weights(connector, experts, shared)
        self.expert_fn = expert_fn or self._moe_outputs
        self.schedule = schedule
        self.recorder = recorder
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be a bool, got {overlap!r}")
        self.overlap = overlap
        self._replies = reply_lane(connector, connector.send_ffn_work_item_output) if overlap else None
        self.num_served = 0
        self.num_batches = 0
        # lockstep: (layer_idx, stage_idx) -> {attention rank: items not yet served, oldest first}
        self._waiting: dict[tuple[int, int], dict[int, deque]] = {}

    @staticmethod
    def _for_layer(weights, layer_idx: int):
        if weights is None or isinstance(weights, moe.ExpertWeights):
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
    def _uses_own_experts(self) -> bool:
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
        if len(items) == 1 or not self._uses_own_experts:
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

    def step(self, timeout_ms: int | None = None) -> int:
        """Receive up to ``num_layers`` items (``num_layers * num_attn_ranks`` in lockstep)
        and serve what the schedule allows; return early on a poll timeout. Items served.

        Raises ConnectorShutdown when every Attention rank announced shutdown.
        """
        if self.schedule == "lockstep":
            return self._step_lockstep(timeout_ms)
        served = 0
        for _ in range(self.connector.model.num_layers):
            item = (self.connector.recv_ffn_work_item(timeout_ms) if self.recorder is None
                    else self._recorded_receive(timeout_ms))
            if item is None:
                break
            self.serve(item)
            served += 1
        return served

    def _step_lockstep(self, timeout_ms: int | None) -> int:
        served = 0
        num_attn = self.connector.topology.num_attn_ranks
        for _ in range(self.connector.model.num_layers * num_attn):
            item = (self.connector.recv_ffn_work_item(timeout_ms) if self.recorder is None
                    else self._recorded_receive(timeout_ms))
            if item is None:
                break
            batch = self._hold(item, self._lockstep_ranks())
            if batch:
                self.serve_batch(batch)
                served += len(batch)
        # a replica that shut down or died leaves the lockstep set: serve what the others sent
        for batch in self._ready_batches(self._lockstep_ranks()):
            self.serve_batch(batch)
            served += len(batch)
        return served

    def _lockstep_ranks(self) -> frozenset:
        """Attention ranks a lockstep batch waits for: every rank not known finished (shut
        down, or found dead by the connector's idle poll)."""
        finished = getattr(self.connector, "finished_attention_ranks", None)
        done = finished() if finished is not None else frozenset()
        return frozenset(range(self.connector.topology.num_attn_ranks)) - done

    def _hold(self, item: FFNWorkItem, ranks: frozenset) -> list[FFNWorkItem]:
        """Buffer ``item``; return the batch it completes (one item per rank of ``ranks``, the
        live Attention ranks, by rank), or [] while some of them has not sent this (layer,
        stage) yet."""
        key = (item.layer_idx, item.stage_idx)
        by_rank = self._waiting.setdefault(key, {})
        by_rank.setdefault(item.src_rank, deque()).append(item)
        return self._take_batch(key, ranks)

    def _take_batch(self, key, ranks: frozenset) -> list[FFNWorkItem]:
        by_rank = self._waiting[key]
        for rank in [rank for rank in by_rank if rank not in ranks]:  # finished: never answered
            logger.warning("afd_cupy ffn rank %d: dropping %d lockstep item(s) of attention rank %d "
                           "(layer %d stage %d): it shut down or died", self.connector.role_rank,
                           len(by_rank[rank]), rank, key[0], key[1])
            del by_rank[rank]
        if not by_rank or not ranks <= set(by_rank):
            if not by_rank:
                del self._waiting[key]
            return []
        batch = [by_rank[rank].popleft() for rank in sorted(by_rank)]
        for rank in [rank for rank, queue in by_rank.items() if not queue]:
            del by_rank[rank]
        if not by_rank:
            del self._waiting[key]
        return batch

    def _ready_batches(self, ranks: frozenset) -> list[list[FFNWorkItem]]:
        """Batches the held items complete with ``ranks`` (after a rank left the set)."""
        batches = []
        for key in sorted(self._waiting):
            while key in self._waiting:
                batch = self._take_batch(key, ranks)
                if not batch:
                    break
                batches.append(batch)
        return batches

    @property
    def num_waiting(self) -> int:
        """Items received but not yet served (lockstep buffer)."""
        return sum(len(queue) for by_rank in self._waiting.values() for queue in by_rank.values())

    def run(self, stop_event: threading.Event | None = None, timeout_ms: int | None = None) -> int:
        """Serve until every Attention rank announced shutdown or ``stop_event`` is set.

        ConnectorShutdown is a normal exit. Returns the number of items served. With
        ``overlap`` the reply lane is drained and stopped first (its errors raised; on an
        exception from the loop they are logged and the loop's exception propagates).
        """
        try:
            while stop_event is None or not stop_event.is_set():
                self.step(timeout_ms)
        except ConnectorShutdown:
            logger.info("afd_cupy ffn rank %d: shutdown after %d items",
                        self.connector.role_rank, self.num_served)
            self._warn_unserved()
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
        """Tell the Attention ranks that this loop failed (``AFDConnector.announce_failure``):
        they raise PeerFailedError naming this rank and ``exc`` instead of timing out. Not
        for a lost peer (nobody is left to tell) or a shut-down connector."""
        from afd_cupy.errors import PeerLostError

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

    def _warn_unserved(self) -> None:
        if not self._waiting:
            return
        held = {f"layer {layer} stage {stage}": {rank: len(queue) for rank, queue in by_rank.items()}
                for (layer, stage), by_rank in sorted(self._waiting.items())}
        logger.warning("afd_cupy ffn rank %d: shutdown with %d lockstep items never served "
                       "(protocol violation: some Attention rank skipped a layer; was it built "
                       "with always_send=True?); held per (layer, stage) by rank: %s",
                       self.connector.role_rank, self.num_waiting, held)


def per_layer(weights, num_layers: int) -> list:
    """One entry per layer: ``weights`` (one ExpertWeights or None) repeated, or its list."""
    if weights is None or isinstance(weights, moe.ExpertWeights):
        return [weights] * num_layers
    return list(weights)


def _check_weights(connector: AFDConnector, experts, shared) -> None:
    """The weights must be what the connector's ModelConfig says: this rank's
    ``expert_per_rank`` experts of ``moe_intermediate_size`` x ``hidden_size`` in the payload
    dtype, per layer, and shared experts exactly when ``num_shared_experts > 0``."""
    model, layout = connector.model, connector.layout
    routed, fused = per_layer(experts, model.num_layers), per_layer(shared, model.num_layers)
    if len(routed) != model.num_layers or len(fused) != model.num_layers:
        raise ConfigError(f"weights for {len(routed)} routed / {len(fused)} shared layers, "
                          f"ModelConfig.num_layers={model.num_layers}")
    for layer, (w, s) in enumerate(zip(routed, fused)):
        got = (w.num_experts, w.hidden_size, w.intermediate_size, w.dtype)
        want = (layout.expert_per_rank, model.hidden_size, model.moe_intermediate_size,
                connector.torch_dtype)
        if got != want:
            raise ConfigError(f"layer {layer}: routed experts are (num_experts, hidden, intermediate, "
                              f"dtype) = {got}, the ModelConfig says {want}")
        if (s is None) != (model.num_shared_experts == 0):
            raise ConfigError(f"layer {layer}: shared expert weights {'missing' if s is None else 'given'} "
                              f"but ModelConfig.num_shared_experts={model.num_shared_experts}")
        if s is not None and (s.hidden_size, s.dtype) != (model.hidden_size, connector.torch_dtype):
            raise ConfigError(f"layer {layer}: shared experts are (hidden, dtype) = "
                              f"{(s.hidden_size, s.dtype)}, the ModelConfig says "
                              f"{(model.hidden_size, connector.torch_dtype)}")


def attention_connector_kwargs(schedule: str) -> dict:
    """Extra ``AFDConnector`` keyword arguments an Attention rank needs to talk to FFN workers
    running ``schedule``: ``{"always_send": True}`` for lockstep (every FFN rank gets every
    layer, empty or not), ``{}`` otherwise."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return {"always_send": True} if schedule == "lockstep" else {}
