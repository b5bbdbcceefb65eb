"""cuda backend, FFN side of the dedup wire mode (docs/design/dedup.md, docs/design/kernels.md): the local staging
of each slot, the expand step of ``item_views`` and the packed launch of the fused reduce+reply.
A :class:`CudaDedupStaging` is owned by the FFN path
(:class:`afd_cupy.backends.cuda_ffn.CudaFFNPath`), built on the rank's shared
:class:`~afd_cupy.backends.cuda.CudaRank` and what the path hands it explicitly (its poll
stream and empty rows).

Per slot (region, ring) the path keeps, in ordinary device memory
(``wire.ffn_staging_size_hint`` bytes in all):

- ``grouped_rows[slot]``: payload [routed_cap, H], the rows expanded into pair mode's
  ``routed_x`` layout (grouped by local expert): the item's ``routed_x``;
- ``route_copies[slot]``: int32 [token_cap, 2 + 2K], the checked copy of the route table the
  reply reduces through (never the window: a sender that timed out and re-sent on the slot
  cannot change it under an item).

Verdict: ``afd_dedup_expand`` runs on the poll stream right after ``wait_any`` and latches a
bad route table in a pinned status record of its own (``expand_status``); ``item_views``
synchronizes the poll stream (the only wait it adds: the expansion must be complete before the
caller's stream reads the staging anyway), reads the record and raises
``wire.route_table_error`` (a WireError naming the row) from ``recv_ffn_work_item``, or
``ArrivalSuperseded`` when the slot's flag moved on while the table was read (its sender timed
out and re-sent there: the table mixed two messages; the FFN endpoint skips the item).
Ordering: the expansion into a slot waits (on the device) for the event of the slot's last
reply, so a reply still queued on the caller's stream never reads a route-table copy or staging
rewritten under it.
"""
from __future__ import annotations

import numpy as np

from afd_cupy import kernels, wire
from afd_cupy.backends.base import Arrival, ItemViews, superseded
from afd_cupy.kernels import PinnedInt64
from afd_cupy.wire.dtypes import payload_dtype

#: claims[] value of a staging row no route-table row has named (raw_kernels/ffn/dedup_ffn.cu)
UNCLAIMED = 0x7FFFFFFF


class CudaDedupStaging:
    """Dedup-mode steps of the cuda FFN path.

    ``rank``: the rank's CudaRank; ``poll_stream``: the path's poll stream (the expansions
    run there, right after ``wait_any``); ``empty_rows``: the path's empty payload view;
    ``slot_flag(region, ring)``: the path's read of an own slot's flag word.
    Allocates the staging and route-table copy per slot, the expand scratch, its status
    record and the packed expand launch."""

    def __init__(self, *, rank, poll_stream, empty_rows, slot_flag) -> None:
        self.rank, self.slot_flag = rank, slot_flag
        self.cp, self.ctx, self.layout = rank.cp, rank.ctx, rank.layout
        self.poll_stream, self.empty_rows = poll_stream, empty_rows
        cp, layout = self.cp, self.layout
        hidden, width = layout.hidden_size, layout.route_width
        rows_bytes = wire.align_up(layout.routed_cap * layout.row_bytes)
        table_bytes = wire.align_up(layout.token_cap * width * 4)
        per_slot = rows_bytes + table_bytes
        if per_slot * layout.num_slots != layout.ffn_staging_bytes:
            raise AssertionError(f"dedup staging of {per_slot} B per slot does not match "
                                 f"ffn_staging_bytes={layout.ffn_staging_bytes}")
        self.expand_memory = cp.zeros(layout.ffn_staging_bytes, cp.uint8)
        raw_word = payload_dtype(self.ctx.dtype).raw_word
        self.grouped_rows, self.route_copies = [], []
        for slot in range(layout.num_slots):
            base = slot * per_slot
            rows = self.expand_memory[base:base + layout.routed_cap * layout.row_bytes]
            table = self.expand_memory[base + rows_bytes:base + rows_bytes + layout.token_cap * width * 4]
            self.grouped_rows.append(rows.view(raw_word).reshape(layout.routed_cap, hidden))
            self.route_copies.append(table.view(cp.int32).reshape(layout.token_cap, width))
        # scratch of afd_dedup_expand: one set, the expansions are serialized on the poll stream
        self.expand_claims = cp.full(max(layout.routed_cap, 1), UNCLAIMED, cp.int32)
        self.expand_fault = cp.full(1, np.iinfo(np.uint64).max, cp.uint64)
        self.expand_claimed = cp.zeros(1, cp.uint32)
        self.expand_done = cp.zeros(1, cp.uint32)
        self.expand_status = PinnedInt64(wire.STATUS_WORDS)
        self.last_reply_event = [None] * layout.num_slots
        self.expand_launch = kernels.PackedLaunch(kernels.dedup_expand_spec(
            dtype_code=self.rank.dtype_code, window=self.rank.own_window, geo=self.rank.geometry, region=0, ring=0,
            num_rows=0, num_tokens=0, num_routed=0, num_shared=0, top_k=layout.top_k,
            hidden_size=hidden, staging=0, route_copy=self.route_copies[0],
            claims=self.expand_claims, fault=self.expand_fault, num_claimed=self.expand_claimed,
            layer_idx=0, status=self.expand_status.ptr, done_counter=self.expand_done))

    def note_reply(self, slot: int, event) -> None:
        """The reply on ``slot`` was enqueued; ``event`` completes when it has run: the next
        expansion into the slot waits for it."""
        self.last_reply_event[slot] = event

    def slot_views(self, views: dict, region: int, ring: int) -> dict:
        """Add a slot's torch views: the window's rows, the grouped staging, the table copy."""
        layout, slot = self.layout, self.layout.slot_index(region, ring)
        words = payload_dtype(self.ctx.dtype).raw_word
        raw = self.rank.window.field(self.ctx.world_rank, region, ring, "routed_x", words,
                                (layout.token_cap, layout.hidden_size))
        views["routed_x"] = self.rank.as_torch(raw).view(self.ctx.torch_dtype)
        views["staging"] = self.rank.as_torch(self.grouped_rows[slot]).view(self.ctx.torch_dtype)
        views["route_copy"] = self.rank.as_torch(self.route_copies[slot])
        return views

    def item_views(self, arrival: Arrival, views: dict) -> ItemViews:
        """Expand (and check) the arrival, then views: ``routed_x`` = the grouped staging,
        ``shared_x`` = the window's first ``shared_tokens`` rows, ``route_table`` = the copy."""
        header = arrival.header
        self._expand(arrival)
        empty = self.empty_rows
        routed = views["staging"][:header.routed_tokens] if header.routed_tokens else empty
        shared = views["routed_x"][:header.shared_tokens] if header.shared_tokens else empty
        return ItemViews(routed, shared, views["route_copy"][:header.num_rows], views["counts"])

    def _expand(self, arrival: Arrival) -> None:
        """afd_dedup_expand on the poll stream, then a synchronization of that stream; raises
        the WireError of a rejected route table (the record is cleared first)."""
        header, layout = arrival.header, self.layout
        slot = layout.slot_index(arrival.region, arrival.ring)
        launch = self.expand_launch
        launch.set("region", arrival.region)
        launch.set("ring", arrival.ring)
        launch.set("num_rows", header.num_rows)
        launch.set("num_tokens", header.num_tokens)
        launch.set("num_routed", header.routed_tokens)
        launch.set("num_shared", header.shared_tokens)
        launch.set("layer_idx", header.layer_idx)
        launch.set("staging", self.grouped_rows[slot].data.ptr)
        launch.set("route_copy", self.route_copies[slot].data.ptr)
        stream = self.poll_stream
        if self.last_reply_event[slot] is not None:
            stream.wait_event(self.last_reply_event[slot])
        launch.launch(stream.ptr, kernels.dedup_expand_grid(header.num_rows))
        stream.synchronize()
        record = self.expand_status.array
        if record[wire.ST_CODE] != wire.STATUS_OK:
            status = wire.StatusRecord.decode(record)
            record[:] = 0  # no expansion runs now: the poll stream is idle
            error = wire.route_table_error(status, shared_tokens=header.shared_tokens)
            moved_on = superseded(arrival, self.slot_flag(arrival.region, arrival.ring), error)
            if moved_on is not None:
                raise moved_on from error
            raise error

    def reply_launch(self, attn_rank: int, ring: int, dst_window: int, staging: int, *,
                     header_src: int, done_counter) -> kernels.PackedLaunch:
        """afd_dedup_reply of one (Attention rank, ring), checked and packed once; it reduces
        through that slot's route-table copy. ``dst_window`` 0: a put peer, the reply goes to
        staging slot (``attn_rank``, ``ring``) of ``staging`` (docs/design/put-transport.md).
        ``header_src``: the path's pinned reply-header staging."""
        layout = self.layout
        return kernels.PackedLaunch(kernels.dedup_reply_spec(
            dtype_code=self.rank.dtype_code, dst_window=dst_window, staging=staging, dst_peer=attn_rank,
            geo=self.rank.geometry, src_rank=self.ctx.role_rank, ring=ring,
            route_copy=self.route_copies[layout.slot_index(attn_rank, ring)], num_rows=0,
            top_k=layout.top_k, routed_out=0, num_routed=0, shared_out=0, num_shared=0,
            hidden_size=layout.hidden_size, header_src=header_src, seq=0,
            done_counter=done_counter))
