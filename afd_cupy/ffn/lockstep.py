"""The lockstep schedule's buffer (``FFNWorker(schedule="lockstep")``, :mod:`afd_cupy.ffn.worker`):
items held per (layer, stage) and Attention rank until every live Attention rank sent that
(layer, stage); then they leave as one batch, by rank. A replica that announced shutdown, or
that an idle poll found dead, leaves the set: its held items are dropped (logged).

NOTE: every replica must send every layer to every FFN rank, even when it has no rows for it,
or the buffer waits for a message that never comes (until the Attention side's peer timeout):
:func:`attention_connector_kwargs` gives the Attention side's ``always_send=True``."""
from __future__ import annotations

import logging
from collections import deque

from afd_cupy.handles import FFNWorkItem

logger = logging.getLogger("afd_cupy")

SCHEDULES = ("async", "lockstep")


def check_schedule(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return schedule


def attention_connector_kwargs(schedule: str) -> dict:
    """Extra ``AFDConnector`` keyword arguments an Attention rank needs to talk to FFN workers
    running ``schedule``: ``{"always_send": True}`` for lockstep (every FFN rank gets every
    layer, empty or not), ``{}`` otherwise."""
    return {"always_send": True} if check_schedule(schedule) == "lockstep" else {}


def live_attention_ranks(connector) -> frozenset:
    """Attention ranks a lockstep batch waits for: every rank not known finished (shut down,
    or found dead by the connector's idle poll)."""
    finished = getattr(connector, "finished_attention_ranks", None)
    done = finished() if finished is not None else frozenset()
    return frozenset(range(connector.topology.num_attn_ranks)) - done


class LockstepBuffer:
    """Held items: (layer_idx, stage_idx) -> {attention rank: items not yet served, oldest
    first}. ``connector`` only names this rank in the log. Host bookkeeping, one thread."""

    def __init__(self, connector):
        self.connector = connector
        self._waiting: dict[tuple[int, int], dict[int, deque]] = {}

    @property
    def num_waiting(self) -> int:
        """Items held, not yet served."""
        return sum(len(queue) for by_rank in self._waiting.values() for queue in by_rank.values())

    def hold(self, item: FFNWorkItem, ranks: frozenset) -> list[FFNWorkItem]:
        """Buffer ``item``; return the batch it completes (one item per rank of ``ranks``, the
        live Attention ranks, by rank), or [] while some of them has not sent this (layer,
        stage) yet."""
        key = (item.layer_idx, item.stage_idx)
        by_rank = self._waiting.setdefault(key, {})
        by_rank.setdefault(item.src_rank, deque()).append(item)
        return self._take_batch(key, ranks)

    def ready_batches(self, ranks: frozenset) -> list[list[FFNWorkItem]]:
        """Batches the held items complete with ``ranks`` (after a rank left the set)."""
        batches = []
        for key in sorted(self._waiting):
            while key in self._waiting:
                batch = self._take_batch(key, ranks)
                if not batch:
                    break
                batches.append(batch)
        return batches

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

    def warn_unserved(self) -> None:
        """At shutdown: log what is still held (a protocol violation: some Attention rank
        skipped a layer)."""
        if not self._waiting:
            return
        held = {f"layer {layer} stage {stage}": {rank: len(queue) for rank, queue in by_rank.items()}
                for (layer, stage), by_rank in sorted(self._waiting.items())}
        logger.warning("afd_cupy ffn rank %d: shutdown with %d lockstep items never served "
                       "(protocol violation: some Attention rank skipped a layer; was it built "
                       "with always_send=True?); held per (layer, stage) by rank: %s",
                       self.connector.role_rank, self.num_waiting, held)
