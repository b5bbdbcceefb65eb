"""The FFN endpoint: an FFN rank's protocol bookkeeping over its data path
(docs/design/architecture.md).

:class:`~afd_cupy.connector.AFDConnector` is a thin facade over one endpoint per rank; on an
FFN rank it is an :class:`FFNEndpoint`, which owns what the protocol needs between a receive
and its reply: which item each slot holds and whether it was answered (each item answered
once, a superseded one not at all), the Attention ranks that announced shutdown or died, and
the output checks. The bytes move in the backend's :class:`~afd_cupy.backends.base.FFNPath`.

A loop that waits for arrivals itself (the graph FFN server) uses the public calls
:meth:`check_attention_alive`, :meth:`note_shutdown`, :meth:`accept_arrival` and the reply
seq hand-over, through the connector.
"""
from __future__ import annotations

import logging
import threading

from afd_cupy.attention.endpoint import check_device
from afd_cupy.backends.base import Arrival, ArrivalSuperseded
from afd_cupy.errors import ConnectorShutdown, PeerLostError, ProtocolError
from afd_cupy.handles import FFNWorkItem
from afd_cupy.runtime import peer_state
from afd_cupy.runtime.timeouts import check_optional_timeout

logger = logging.getLogger("afd_cupy")


class FFNEndpoint:
    """Receive and reply of one FFN rank (the connector's FFN-side calls).

    ``path``: the backend's FFNPath; ``attn_processes``: world rank -> ``PeerProcess`` of
    every Attention rank (for the idle liveness check); ``store`` / ``instance``: where a
    failure is published. One receiving and one replying thread may share it.
    """

    def __init__(self, path, *, model, config, topology, role_rank: int, torch_dtype,
                 attn_processes: dict, store, instance: int):
        self.path = path
        self.model, self.config, self.topology = model, config, topology
        self.role_rank, self.torch_dtype = role_rank, torch_dtype
        self._attn_processes = attn_processes
        self._store, self._instance = store, instance  # read only on error paths
        self._received: dict[tuple, int] = {}  # (src_rank, ring) -> seq of the newest item
        self._answered: set[tuple] = set()  # (src_rank, ring) whose newest item was answered
        # NOTE: the Attention rank may send the next item on a slot as soon as a reply's flag
        # is written; without the lock the receiving thread could record that item before the
        # replying thread marks the slot answered, and the new item would count as answered.
        # Taking an item and answering one are atomic w.r.t. each other.
        self._lock = threading.Lock()
        self._shutdown_from: set[int] = set()
        self._lost: set[int] = set()  # attention ranks found dead
        self.shutdown_announced = False
        self.peer_failed = False  # a peer died: close() must not hang on it

    # --- receive ------------------------------------------------------------------------
    def recv(self, timeout_ms) -> FFNWorkItem | None:
        """``AFDConnector.recv_ffn_work_item`` (its docstring)."""
        timeout_ms = check_optional_timeout("timeout_ms", timeout_ms, unit="ms") or self.config.recv_poll_timeout_ms
        while True:
            arrival = self.path.wait_any(timeout_ms / 1000.0)
            if arrival is None:
                self.check_attention_alive()
                return None
            if arrival.header.is_shutdown:
                self.note_shutdown(arrival.header.src_rank)
                continue
            try:
                return self.accept_arrival(arrival)
            except ArrivalSuperseded as exc:  # its newer message is the slot's next arrival
                logger.warning("afd_cupy ffn rank %d: not served: %s", self.role_rank, exc)

    def note_shutdown(self, src_rank: int) -> None:
        """Count Attention rank ``src_rank``'s shutdown (once per rank); ConnectorShutdown
        once every Attention rank has announced, PeerLostError as :meth:`check_attention_alive`."""
        if src_rank in self._shutdown_from:
            return  # the same announcement, seen on another ring
        self._shutdown_from.add(src_rank)
        logger.info("afd_cupy ffn rank %d: attention rank %d announced shutdown (%d/%d)",
                    self.role_rank, src_rank, len(self._shutdown_from), self.topology.num_attn_ranks)
        self._raise_if_lost()
        if len(self._shutdown_from) == self.topology.num_attn_ranks:
            raise ConnectorShutdown("every Attention rank announced shutdown", src_rank=src_rank)

    def finished_attention_ranks(self) -> frozenset:
        return frozenset(self._shutdown_from)

    def check_attention_alive(self) -> None:
        """Idle-time liveness check: raise PeerLostError once no Attention rank can send."""
        dead = [self.topology.role_of(pe)[1] for pe, proc in self._attn_processes.items()
                if proc.is_alive() is False]
        for rank in dead:
            if rank not in self._shutdown_from:
                logger.warning("afd_cupy ffn rank %d: attention rank %d died without shutdown",
                               self.role_rank, rank)
                self._shutdown_from.add(rank)
                self._lost.add(rank)
        self._raise_if_lost()

    def _raise_if_lost(self) -> None:
        """PeerLostError once every Attention rank is done and some of them died."""
        if self._lost and len(self._shutdown_from) == self.topology.num_attn_ranks:
            self.peer_failed = True
            raise PeerLostError(f"attention rank(s) {sorted(self._lost)} died without announcing "
                                "shutdown; every other attention rank has shut down",
                                peers=sorted(self._lost))

    def accept_arrival(self, arrival: Arrival) -> FFNWorkItem:
        """The work item of ``arrival``, recorded as received (ProtocolError when the header's
        source rank is not its region's; the path's ``item_views`` raises WireError when its
        rows' format, ``FLAG_FP8``, is not this rank's ``dispatch_dtype``)."""
        header = arrival.header
        if header.src_rank != arrival.region:
            raise ProtocolError(f"message in region {arrival.region} claims source rank {header.src_rank}")
        key = (arrival.region, arrival.ring)
        with self._lock:  # NOTE: a reply on this slot may be completing on another thread
            views = self.path.item_views(arrival)
            self._received[key] = header.seq
            self._answered.discard(key)
        return FFNWorkItem(arrival=arrival, routed_x=views.routed_x, group_counts=views.group_counts,
                           shared_x=views.shared_x if header.shared_tokens else None,
                           route_table=views.route_table)

    # --- reply --------------------------------------------------------------------------
    def reply(self, item: FFNWorkItem, routed_out, shared_out) -> None:
        """``AFDConnector.send_ffn_work_item_output`` (its docstring)."""
        self._check_outputs(item, routed_out, shared_out)
        key = (item.src_rank, item.ring)
        with self._lock:  # the flag write and the bookkeeping before the next item on the slot
            if self.shutdown_announced:
                raise ProtocolError(f"send_ffn_work_item_output after announce_shutdown(): the reply "
                                    f"to {item!r} would not be read (the attention ranks were told "
                                    "this rank is done)", peer=item.src_rank, layer_idx=item.layer_idx)
            newest = self._received.get(key)
            if newest == item.seq and key in self._answered:
                raise ProtocolError(f"work item from attention rank {item.src_rank} (layer {item.layer_idx}, "
                                    f"ring {item.ring}, seq {item.seq}) was already answered",
                                    peer=item.src_rank, layer_idx=item.layer_idx)
            if newest != item.seq:
                logger.warning("afd_cupy ffn rank %d: %r was superseded by seq %s on its slot; not answered",
                               self.role_rank, item, newest)
                return
            self.path.reply(item.arrival, routed_out, shared_out if item.shared_tokens else None)
            self._answered.add(key)

    def _check_outputs(self, item, routed_out, shared_out) -> None:
        hidden, device = self.model.hidden_size, self.path.device
        expected = (item.routed_tokens, hidden)
        if tuple(routed_out.shape) != expected or routed_out.dtype != self.torch_dtype:
            raise ValueError(f"routed_out must be {expected} {self.torch_dtype}, got "
                             f"{tuple(routed_out.shape)} {routed_out.dtype}")
        check_device("routed_out", routed_out, device)
        if item.shared_tokens:
            expected = (item.shared_tokens, hidden)
            if shared_out is None or tuple(shared_out.shape) != expected or shared_out.dtype != self.torch_dtype:
                raise ValueError(f"shared_out must be {expected} {self.torch_dtype} for an item with "
                                 f"shared rows, got {None if shared_out is None else tuple(shared_out.shape)}")
            check_device("shared_out", shared_out, device)

    # --- the reply seqs, handed to a loop that takes the replies over ---------------------
    def reply_seq_counters(self):
        self._require_host_reply_seqs("reply_seq_counters")
        return self.path.reply_seq_counters()

    def set_reply_seq_counters(self, counters, *, slot=None) -> None:
        self._require_host_reply_seqs("set_reply_seq_counters")
        self.path.set_reply_seq_counters(counters, slot=slot)

    def _require_host_reply_seqs(self, what: str) -> None:
        capabilities = self.path.capabilities
        if not capabilities.host_reply_seqs:
            raise ProtocolError(f"{what}: backend {capabilities.backend!r} keeps no host reply-seq counters")

    # --- shutdown -----------------------------------------------------------------------
    def announce_shutdown(self) -> None:
        with self._lock:  # not in the middle of a reply on another thread
            self.path.announce_shutdown()
            self.shutdown_announced = True

    def announce_failure(self, exc: BaseException) -> None:
        """``AFDConnector.announce_failure`` (its docstring)."""
        try:
            peer_state.publish_failure(self._store, self._instance, self.role_rank, exc)
        except Exception as store_exc:  # the shutdown below still releases the peers
            logger.warning("afd_cupy ffn rank %d: could not publish the failure %r: %s",
                           self.role_rank, exc, store_exc)
        if not self.shutdown_announced:
            self.announce_shutdown()

    def check_errors(self) -> None:
        self.path.check_errors()
