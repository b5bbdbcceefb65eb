"""What an Attention-side connector remembers about its FFN peers and owns for its combine
(issue 35, items 7-9): why an FFN rank is gone (shut down, dead, failed with a reason it
published), and the pair-mode routing the combine reads, copied at send time.

A failed FFN rank (its expert code raised) publishes ``"<type>: <message>"`` in the store
before it announces shutdown, so that an Attention rank that sees the shutdown finds the
reason with one non-blocking look-up (``store.add(key, 0)``: 0 while absent).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from afd_cupy.errors import (ConnectorShutdown, PeerFailedError, PeerLostError, PeerTimeoutError)

logger = logging.getLogger("afd_cupy")

#: longest exception message published by a failing rank (a longer one is cut, marked so)
MAX_REASON_CHARS = 2000


@dataclass(frozen=True)
class Failure:
    """What a failed peer published: its exception's type name and message."""

    error_type: str
    error_message: str


@dataclass(frozen=True)
class GoneReason:
    """Why FFN rank ``rank`` cannot answer: ``kind`` "shutdown", "dead" or "failed"
    (``failure`` then holds what it published)."""

    rank: int
    kind: str
    failure: Failure | None = None

    def error(self, ranks: list[int]):
        """The typed error of a dispatch that went to ``ranks`` (this rank among them)."""
        if self.failure is not None:
            f = self.failure
            return PeerFailedError(f"FFN rank {self.rank} failed and left: {f.error_type}: "
                                   f"{f.error_message}", peers=(self.rank,),
                                   error_type=f.error_type, error_message=f.error_message)
        if self.kind == "dead":
            return PeerLostError(f"FFN rank(s) {ranks} died earlier (process gone); a dispatch to "
                                 "them cannot be answered", peers=ranks)
        return ConnectorShutdown(f"FFN rank(s) {ranks} announced shutdown earlier; a dispatch to "
                                 "them cannot be answered", src_rank=self.rank)


def _keys(instance: int, rank: int) -> tuple[str, str]:
    base = f"afd_failure/{instance}/ffn{rank}"
    return base + "/reason", base + "/published"


def describe(exc: BaseException) -> Failure:
    """``exc`` as a Failure; a message over MAX_REASON_CHARS is cut and says by how much."""
    message = str(exc)
    if len(message) > MAX_REASON_CHARS:
        message = (message[:MAX_REASON_CHARS]
                   + f"... [{len(message) - MAX_REASON_CHARS} more characters not published]")
    return Failure(type(exc).__name__, message)


def publish_failure(store, instance: int, rank: int, exc: BaseException) -> None:
    """Store FFN rank ``rank``'s failure (before its shutdown is announced)."""
    reason_key, flag_key = _keys(instance, rank)
    failure = describe(exc)
    store.set(reason_key, json.dumps({"type": failure.error_type,
                                      "message": failure.error_message}).encode())
    store.add(flag_key, 1)


def fetch_failure(store, instance: int, rank: int) -> Failure | None:
    """The failure FFN rank ``rank`` published, or None (not published, or the store is
    unreachable: logged). Never blocks on an absent key."""
    reason_key, flag_key = _keys(instance, rank)
    try:
        if store.add(flag_key, 0) <= 0:
            return None
        record = json.loads(bytes(store.get(reason_key)).decode())
        return Failure(str(record["type"]), str(record["message"]))
    except Exception as exc:  # an error path already: the shutdown is raised instead
        logger.warning("afd_cupy: could not read FFN rank %d's failure reason: %s", rank, exc)
        return None


def gone_reason(exc: Exception, ffn_processes: dict, store, instance: int) -> GoneReason | None:
    """Why the FFN rank named by ``exc`` (the error of a wait for its reply) is gone, or None
    when ``exc`` does not show that (a slow peer's timeout, a bad header, ...)."""
    if isinstance(exc, ConnectorShutdown) and exc.src_rank is not None:
        rank = int(exc.src_rank)
        failure = fetch_failure(store, instance, rank)
        return GoneReason(rank, "failed" if failure else "shutdown", failure)
    if isinstance(exc, PeerTimeoutError) and exc.peer is not None:
        process = ffn_processes.get(int(exc.peer))
        if process is not None and process.is_alive() is False:
            return GoneReason(int(exc.peer), "dead")
    return None


class FFNPeers:
    """An Attention-side connector's memory of FFN ranks that are gone (issue 35, item 8).

    ``processes``: FFN role rank -> ``handshake.PeerProcess`` (liveness, same host only);
    ``store`` / ``instance``: where a failed FFN rank published its reason."""

    def __init__(self, topology, peer_processes, store, instance: int):
        from afd_cupy.runtime.topology import Role

        self.processes = {topology.role_of(p.world_rank)[1]: p for p in peer_processes
                          if topology.role_of(p.world_rank)[0] is Role.FFN}
        self.store = store
        self.instance = instance
        self.gone: dict[int, GoneReason] = {}

    def refuse(self, sent_to: list[int]) -> None:
        """Raise the typed error of a dispatch sent to a rank known gone (lowest first)."""
        gone = sorted(set(sent_to) & set(self.gone))
        if gone:
            raise self.gone[gone[0]].error(gone)

    def note(self, exc: Exception) -> Exception:
        """Remember the rank ``exc`` (the error of a wait for its reply) shows gone; return
        what to raise: ``exc``, or the PeerFailedError of a rank that published a failure."""
        reason = gone_reason(exc, self.processes, self.store, self.instance)
        if reason is None:
            return exc
        self.gone.setdefault(reason.rank, reason)
        return reason.error([reason.rank]) if reason.failure is not None else exc


def owned_routing_buffers(layout, top_k: int, device: torch.device) -> list[tuple]:
    """Per ring: (int32 [token_cap, top_k], fp32 [token_cap, top_k]) on ``device``, allocated
    once (static addresses: a captured CUDA graph keeps using them)."""
    shape = (layout.token_cap, top_k)
    return [(torch.empty(shape, dtype=torch.int32, device=device),
             torch.empty(shape, dtype=torch.float32, device=device))
            for _ in range(layout.ring_depth)]


def own_routing(buffers: tuple, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """Copy the caller's routing into one ring's buffers; return the views [T, top_k].

    On cuda the copies are ordered on the current stream (no host synchronization, capturable):
    a caller that then overwrites its tensors on that stream does not change this dispatch.
    Ids arrive validated by the dispatch (a bad id fails the dispatch, never this copy)."""
    ids_buf, weights_buf = buffers
    num_tokens = topk_ids.shape[0]
    ids, weights = ids_buf[:num_tokens], weights_buf[:num_tokens]
    ids.copy_(topk_ids, non_blocking=True)
    weights.copy_(topk_weights, non_blocking=True)
    return ids, weights
