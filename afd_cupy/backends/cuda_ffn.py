"""cuda backend, FFN side: wait_any (device spin ringing a pinned doorbell, or host polling),
zero-copy item views (with FP8 dispatch: the rows decoded into per-slot staging by
afd_fp8_dequant_rows), and the reply kernel with its header staged in pinned memory.

The FFN rank's path: it holds the rank's shared :class:`~afd_cupy.backends.cuda.CudaRank`
(context, window, streams, geometry; read through ``self.rank``) and its own buffers. Reply
sequence numbers are this side's own (one :class:`~afd_cupy.wire.seq.SeqCounter` entry per slot).
The dedup wire mode's expand and reduce+reply steps are a
:class:`~afd_cupy.backends.cuda_ffn_dedup.CudaDedupStaging` this path owns; wait_any, the
header staging, seqs and events are shared by both modes.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from afd_cupy import kernels, wire
from afd_cupy.backends.base import Arrival, ItemViews
from afd_cupy.backends.cuda_ffn_dedup import CudaDedupStaging
from afd_cupy.errors import PeerTimeoutError, ProtocolError
from afd_cupy.kernels import PinnedInt64
from afd_cupy.runtime.topology import Role
from afd_cupy.wire.dtypes import payload_dtype
from afd_cupy.wire.seq import SeqCounter

#: extra host-side wait beyond a kernel's own timeout before the host stops trusting it
_HOST_GRACE_S = 5.0
#: longest wait kernel of a receive that may sleep in the driver (recv_spin_us below its
#: timeout): bounds how long a signal handler (KeyboardInterrupt) waits while the FFN idles
_BLOCKING_CHUNK_S = 0.1
#: pinned reply-header staging rows per (Attention rank, ring): replies in flight per slot
STAGING_DEPTH = 4


class CudaFFNPath:
    """The FFN-side steps of the cuda backend (``rank``: the rank's shared
    :class:`~afd_cupy.backends.cuda.CudaRank`)."""

    def __init__(self, rank) -> None:
        self.rank = rank
        self.cp, self.ctx, self.layout = rank.cp, rank.ctx, rank.layout
        self.device, self.device_id = rank.device, rank.device_id
        self.window = rank.window  # (public for tools)
        self.capabilities = rank.capabilities
        self._init_buffers()

    def _init_buffers(self) -> None:
        cp, layout = self.cp, self.layout
        self.scan_start = cp.zeros(1, cp.int32)
        # the group sizes the GEMM reads: the validated counts of each slot's last arrival,
        # written by wait_any (or, with host polling, copied from the decoded header). NOTE:
        # wait_any writes every header word from HDR_FIXED_WORDS on, so a dedup row also holds
        # num_rows after the counts; the GEMM's view is the first expert_per_rank words.
        self.counts_snapshot = cp.zeros((layout.num_slots, layout.header_words - wire.HDR_FIXED_WORDS),
                                        cp.int32)
        self.doorbell = PinnedInt64(wire.DB_HEADER + -(-layout.header_words // 2))
        self.ticket = 0
        # (ticket, kernel timeout s) of a wait_any kernel whose host wait was interrupted
        # (KeyboardInterrupt...): the next wait claims its doorbell instead of launching
        self.unclaimed = None
        self.poll_stream = cp.cuda.Stream(non_blocking=True)
        # a blocking-sync event: an idle receive sleeps in the driver on it (_device_wait_any)
        self.idle_event = cp.cuda.Event(block=True, disable_timing=True)
        # Reply headers are staged in pinned memory and read by the reply kernel when it runs;
        # STAGING_DEPTH rows per slot, each reused only once the reply that read it has run.
        self.row_words = -(-layout.header_words // 2) * 2
        self.staging = PinnedInt64(layout.num_slots * STAGING_DEPTH * self.row_words // 2)
        self.staging_events = [[None] * STAGING_DEPTH for _ in range(layout.num_slots)]
        self.staging_next = [0] * layout.num_slots
        self.reply_seqs = SeqCounter(layout.num_slots)  # this rank's reply seq per slot
        self.reply_done = [cp.zeros(1, cp.uint32) for _ in range(layout.num_slots)]
        self.empty_rows = torch.empty(0, layout.hidden_size, dtype=self.ctx.torch_dtype, device=self.device)
        self.dedup = (CudaDedupStaging(rank=self.rank, poll_stream=self.poll_stream,
                                       empty_rows=self.empty_rows, slot_flag=self.slot_flag)
                      if layout.is_dedup else None)
        self.views = [self._slot_views(region, ring) for region in range(layout.num_regions)
                      for ring in range(layout.ring_depth)]
        # FP8 dispatch: afd_fp8_dequant_rows decodes a slot's rows into the slot's staging
        self.dequant_launch = (kernels.PackedLaunch(kernels.fp8_dequant_rows_spec(
            dtype_code=self.rank.dtype_code, window=self.rank.own_window, geo=self.rank.geometry,
            slot=0, hidden_size=layout.hidden_size, num_routed=0, num_shared=0, routed_out=0,
            shared_out=0)) if layout.is_fp8_dispatch else None)
        self.wait_any_launch = kernels.PackedLaunch(kernels.wait_any_spec(
            window=self.rank.own_window, geo=self.rank.geometry, last_seen=self.rank.last_seen,
            scan_start=self.scan_start, counts_snapshot=self.counts_snapshot, timeout_ns=0, doorbell=self.doorbell.ptr, ticket=0))
        self.reply_launches: dict[tuple, kernels.PackedLaunch] = {}  # (attn_rank, ring) -> launch

    def _slot_views(self, region: int, ring: int) -> dict:
        """Full-capacity torch views of one slot of the own window (created once)."""
        layout, window, pe = self.layout, self.window, self.ctx.world_rank
        words = payload_dtype(self.ctx.dtype).raw_word
        counts = self.counts_snapshot[layout.slot_index(region, ring), :layout.expert_per_rank]
        views = {"counts": self.rank.as_torch(counts)}
        if layout.is_dedup:
            return self.dedup.slot_views(views, region, ring)
        for name, cap in (("routed_x", layout.routed_cap), ("shared_x", layout.shared_cap)):
            if cap and layout.is_fp8_dispatch:  # the slot's own staging: the decoded rows
                views[name] = torch.empty(cap, layout.hidden_size, dtype=self.ctx.torch_dtype,
                                          device=self.device)
            elif cap:
                raw = window.field(pe, region, ring, name, words, (cap, layout.hidden_size))
                views[name] = self.rank.as_torch(raw).view(self.ctx.torch_dtype)
        if layout.routed_cap:
            views["route_table"] = self.rank.as_torch(
                window.field(pe, region, ring, "route_table", np.int32, (layout.routed_cap, 2)))
        return views

    def wait_any(self, timeout_s: float) -> Arrival | None:
        self.rank.use_device()
        if self.rank.host_polling is not None:
            found = self.rank.host_polling.wait_any(timeout_s)
            if found is None:
                return None
            header = self.rank.host_polling.read_header(found.region, found.ring)
            return Arrival(found.region, found.ring, header)
        if self.ctx.recv_spin_s >= timeout_s:  # spins throughout: one kernel, interruptible loop
            return self._device_wait_any(timeout_s)
        # The host may sleep in the driver, where signals (Ctrl-C) wait until the kernel ends:
        # kernels of at most _BLOCKING_CHUNK_S each bound that delay; a timed-out kernel
        # consumed nothing, so the next one simply watches on.
        deadline = time.monotonic() + timeout_s
        while True:
            chunk = min(deadline - time.monotonic(), _BLOCKING_CHUNK_S)
            arrival = self._device_wait_any(max(chunk, 0.0))
            if arrival is not None or time.monotonic() >= deadline:
                return arrival

    def _device_wait_any(self, timeout_s: float) -> Arrival | None:
        """Launch ``afd_wait_any``, spin on its doorbell ticket for ``ctx.recv_spin_s``, then
        sleep in the driver until the kernel ends (no host core burnt while idle; signals are
        handled only once it ends: :meth:`wait_any` bounds such kernels to
        ``_BLOCKING_CHUNK_S``).

        The kernel consumes the arrival it finds (advances ``last_seen``) before it rings, so
        a host wait interrupted in between (KeyboardInterrupt, any exception from a signal
        handler) leaves the kernel's ticket *unclaimed*: the next call waits for that ticket
        instead of launching, and returns its arrival. Nothing a kernel consumed is lost.
        """
        layout = self.layout
        bell = self.doorbell.array
        if self.unclaimed is None:
            self.ticket += 1
            launch = self.wait_any_launch
            launch.set("timeout_ns", int(timeout_s * 1e9))
            launch.set("ticket", self.ticket)
            launch.launch(self.poll_stream.ptr)
            self.unclaimed = (self.ticket, timeout_s)
        kernel_timeout_s = self.unclaimed[1]  # bounds the kernel once it runs
        now = time.monotonic()
        deadline, spin_until = now + kernel_timeout_s + _HOST_GRACE_S, now + self.ctx.recv_spin_s
        spins = 0
        # NOTE: reading the doorbell after its ticket relies on x86-64 load ordering (TSO);
        # a weakly ordered host would need an acquire fence here.
        while bell[wire.DB_TICKET] != self.ticket:
            spins += 1
            if spins % 256:
                continue
            now = time.monotonic()
            if now > spin_until:
                # Idle: sleep until the kernel ends (it rings before it exits). The event is
                # recorded only now: nothing else is queued on the poll stream behind the wait.
                # NOTE: the kernel may not have started (GPU busy); once it runs its own timeout
                # bounds this, and it must not consume an arrival unseen.
                self.idle_event.record(self.poll_stream)
                self.idle_event.synchronize()
                if bell[wire.DB_TICKET] != self.ticket:
                    self.unclaimed = None
                    raise PeerTimeoutError(f"wait_any kernel ended without reporting ticket {self.ticket}")
                break
            if now > deadline:  # unreachable unless recv_spin_s exceeds the kernel's timeout
                self.poll_stream.synchronize()
                if bell[wire.DB_TICKET] != self.ticket:
                    self.unclaimed = None
                    raise PeerTimeoutError(f"wait_any kernel did not report ticket {self.ticket}")
        self.unclaimed = None
        if bell[wire.DB_STATUS] != wire.STATUS_OK:
            return None
        slot = int(bell[wire.DB_SLOT])
        words = bell[wire.DB_HEADER:].view(np.int32)[:layout.header_words].copy()
        region, ring = divmod(slot, layout.ring_depth)
        return Arrival(region, ring, wire.decode_header(words, layout.expert_per_rank, layout))

    @property
    def has_unclaimed_wait(self) -> bool:
        return self.unclaimed is not None

    def slot_flag(self, region: int, ring: int) -> int:
        self.rank.use_device()
        with self.poll_stream:  # the stream the waits read the flags on
            return int(self.window.to_host(self.window.flag_view(self.window.own_pe, region, ring))[0])

    def pending_arrivals(self) -> int:
        """Own slots whose flag differs from its last-seen value. Device polling: two tiny
        kernels on the poll stream (where ``wait_any`` updates ``last_seen``) and a read-back
        that synchronizes that stream only (tens of µs; instrumentation, not the hot path)."""
        self.rank.use_device()
        if self.rank.host_polling is not None:
            return self.rank.host_polling.num_pending()
        with self.poll_stream:
            return int(self.cp.count_nonzero(self.window.flags != self.rank.last_seen))

    def item_views(self, arrival: Arrival) -> ItemViews:
        """Views of a received slot's rows (FP8 dispatch: decoded into the slot's staging).
        WireError when the header's row format (``FLAG_FP8``) is not this rank's
        ``dispatch_dtype``."""
        header = arrival.header
        wire.check_dispatch_rows(header, self.layout)  # before any row is read
        views = self.views[self.layout.slot_index(arrival.region, arrival.ring)]
        if self.rank.host_polling is not None:  # wait_any did not run: snapshot the decoded counts
            views["counts"].copy_(torch.tensor(header.expert_counts, dtype=torch.int32))
        if self.layout.is_dedup:
            return self.dedup.item_views(arrival, views)
        empty = self.empty_rows
        routed = views["routed_x"][:header.routed_tokens] if header.routed_tokens else empty
        shared = views["shared_x"][:header.shared_tokens] if header.shared_tokens else empty
        if self.layout.is_fp8_dispatch:
            self._dequantize(arrival, routed, shared)
        route = views["route_table"][:header.routed_tokens] if "route_table" in views else None
        return ItemViews(routed, shared, route, views["counts"])

    def _dequantize(self, arrival: Arrival, routed, shared) -> None:
        """FP8 dispatch: decode the arrival's FP8 wire rows into ``routed`` / ``shared`` (the
        slot's staging rows, payload dtype) on torch's current stream, where the experts
        then read them (afd_fp8_dequant_rows)."""
        header, dequant = arrival.header, self.dequant_launch
        num_rows = header.routed_tokens + header.shared_tokens
        if num_rows == 0:
            return
        dequant.set("slot", self.layout.slot_index(arrival.region, arrival.ring))
        dequant.set("num_routed", header.routed_tokens)
        dequant.set("num_shared", header.shared_tokens)
        dequant.set("routed_out", routed.data_ptr() if header.routed_tokens else 0)
        dequant.set("shared_out", shared.data_ptr() if header.shared_tokens else 0)
        dequant.launch(self.rank.stream_ptr(), kernels.reply_grid(num_rows))

    def reply(self, arrival: Arrival, routed_out, shared_out) -> None:
        """Write the outputs, the reply header and the flag into the sender's window."""
        layout = self.layout
        self.rank.use_device()
        slot = layout.slot_index(arrival.region, arrival.ring)
        seq = self.reply_seqs.advance(slot)
        header = wire.reply_header(arrival.header, seq=seq, src_rank=self.ctx.role_rank)
        row = self._staging_row(slot)
        start = row * self.row_words
        self.staging.int32[start:start + layout.header_words] = wire.header_word_list(
            header, layout.expert_per_rank)
        routed_out = routed_out.contiguous()
        num_routed = routed_out.shape[0]
        num_shared = 0 if shared_out is None else shared_out.shape[0]
        launch = self.reply_launches.get((arrival.region, arrival.ring))
        if launch is None:
            launch = self.reply_launches[(arrival.region, arrival.ring)] = self._reply_launch(
                arrival.region, arrival.ring)
        launch.set("routed_out", routed_out.data_ptr() if num_routed else 0)
        launch.set("num_routed", num_routed)
        launch.set("shared_out", shared_out.contiguous().data_ptr() if num_shared else 0)
        launch.set("num_shared", num_shared)
        launch.set("header_src", self.staging.ptr + start * 4)
        launch.set("seq", seq)
        if layout.is_dedup:  # the fused reduce: one reply row per dispatch row
            launch.set("num_rows", header.num_rows)
            grid = kernels.dedup_reply_grid(header.num_rows, self.layout.row_bytes)
        else:
            grid = kernels.reply_grid(num_routed + num_shared)
        # NOTE: a copy made by .contiguous() may be freed on return: torch's allocator reuses
        # it only for work queued later on this same stream, after the kernel has read it.
        stream = self.rank.stream_ptr()
        launch.launch(stream, grid)
        if self.rank.link.is_staged[arrival.region]:  # staging -> the sender's window, flag = seq (docs/design/put-transport.md)
            # dedup: one reply row per dispatch row, all in routed_x (the shared outputs are
            # folded into the first rows by the reduce)
            rows = (header.num_rows, 0) if layout.is_dedup else (num_routed, num_shared)
            self.rank.link.after_reply(stream, arrival.region, arrival.ring, routed_rows=rows[0],
                                       shared_rows=rows[1], seq=seq)
        event = self.staging_events[slot][row % STAGING_DEPTH]
        if event is None:
            event = self.staging_events[slot][row % STAGING_DEPTH] = self.cp.cuda.Event(disable_timing=True)
        event.record(self.rank.stream())
        if layout.is_dedup:  # the next expansion into this slot waits for this reply
            self.dedup.note_reply(slot, event)

    def _staging_row(self, slot: int) -> int:
        """The next pinned header row of ``slot`` that no queued reply still has to read.

        Normally the row's previous reply ran long ago; after a timeout the Attention side may
        send again on the slot while replies are still queued here, and then this waits
        (bounded by the reply kernels, which do not spin)."""
        k = self.staging_next[slot]
        self.staging_next[slot] = (k + 1) % STAGING_DEPTH
        event = self.staging_events[slot][k]
        if event is not None and not event.done:
            event.synchronize()
        return slot * STAGING_DEPTH + k

    def _reply_launch(self, attn_rank: int, ring: int) -> kernels.PackedLaunch:
        """The reply kernel of one (Attention rank, ring), checked and packed once."""
        layout, ctx = self.layout, self.ctx
        slot = layout.slot_index(attn_rank, ring)
        dst_window = (0 if self.rank.link.is_staged[attn_rank]  # 0: the kernel writes the staging
                      else self.window.peer_ptr(ctx.peer_pe(Role.ATTENTION, attn_rank)))
        staging = self.rank.link.staging_base
        if layout.is_dedup:
            return self.dedup.reply_launch(attn_rank, ring, dst_window, staging,
                                           header_src=self.staging.ptr, done_counter=self.reply_done[slot])
        return kernels.PackedLaunch(kernels.reply_spec(
            dtype_code=self.rank.dtype_code, dst_window=dst_window, staging=staging, dst_peer=attn_rank,
            geo=self.rank.geometry, src_rank=ctx.role_rank, ring=ring, routed_out=0, num_routed=0,
            shared_out=0, num_shared=0, hidden_size=layout.hidden_size,
            header_src=self.staging.ptr, seq=0, done_counter=self.reply_done[slot]))

    # --- the reply seqs, for a loop that takes the replies over (the graph FFN server) -------
    def reply_seq_counters(self):
        """A copy of the reply seq per slot (int64 numpy ``[num_slots]``, slot = region *
        ring_depth + ring)."""
        return self.reply_seqs.copy()

    def set_reply_seq_counters(self, counters, *, slot: int | None = None) -> None:
        """Give the counters back (``counters`` ``[num_slots]``), or with ``slot`` set that
        slot's (the next reply there carries ``counters + 1``). ValueError for a wrong length
        or slot."""
        num_slots = self.layout.num_slots
        if slot is None:
            try:
                self.reply_seqs.load(counters)
            except ValueError as exc:
                raise ValueError(f"set_reply_seq_counters: {exc}") from None
            return
        if isinstance(slot, bool) or not isinstance(slot, numbers.Integral) or not 0 <= slot < num_slots:
            raise ValueError(f"set_reply_seq_counters: slot={slot!r} outside [0, {num_slots})")
        self.reply_seqs.set_last(int(slot), int(counters))

    def graph_resources(self) -> "GraphResources":
        """The device state a graph-driven FFN loop (``GraphFFNServer``) builds its kernels
        on: this path's arrival detection and the peers' windows. ProtocolError unless
        ``capabilities.supports_graph_server``."""
        if not self.capabilities.supports_graph_server:
            raise ProtocolError(f"graph_resources: this FFN path cannot be driven by a graph "
                                f"({self.capabilities})")
        rank, ctx = self.rank, self.ctx
        num_attn = ctx.topology.num_attn_ranks
        return GraphResources(
            cp=self.cp, device_id=self.device_id, own_window=rank.own_window,
            geometry=rank.geometry, dtype_code=rank.dtype_code, src_rank=ctx.role_rank,
            num_attn_ranks=num_attn, last_seen=rank.last_seen, scan_start=self.scan_start,
            counts_snapshot=self.counts_snapshot,
            attention_windows=[rank.window.peer_ptr(ctx.peer_pe(Role.ATTENTION, i)) if i < num_attn else 0
                               for i in range(self.layout.num_regions)])

    # --- both roles' steps, on the shared rank -----------------------------------------------
    def check_errors(self) -> None:
        self.rank.check_errors()

    def announce_shutdown(self) -> None:
        slot = self.layout.slot_index  # over a staged peer: the last reply's seq keeps it deliverable
        self.rank.announce_shutdown(sent_reply_seq=lambda peer, ring: self.reply_seqs.last(slot(peer, ring)))

    def close(self, *, peers_healthy: bool = True) -> None:
        self.rank.close(peers_healthy=peers_healthy)


@dataclass(frozen=True)
class GraphResources:
    """What :meth:`CudaFFNPath.graph_resources` hands a graph-driven FFN loop.

    ``cp``: the cupy module; ``device_id``; ``own_window``: this rank's window base;
    ``geometry``: the kernels' window geometry; ``dtype_code``: the payload's kernel code;
    ``src_rank``: this FFN role rank; ``num_attn_ranks``; ``last_seen`` (cupy int64
    [num_slots]), ``scan_start`` (cupy int32 [1]), ``counts_snapshot`` (cupy int32
    [num_slots, *]): the arrival detection's device state, shared with this path's
    ``wait_any`` (one receiver at a time); ``attention_windows``: window base per region
    (0 past the Attention ranks).
    """

    cp: object
    device_id: int
    own_window: int
    geometry: object
    dtype_code: int
    src_rank: int
    num_attn_ranks: int
    last_seen: object = field(repr=False)
    scan_start: object = field(repr=False)
    counts_snapshot: object = field(repr=False)
    attention_windows: list = field(repr=False)
