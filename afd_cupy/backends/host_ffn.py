"""Host backend, FFN side: wait_any over the own window's flags, zero-copy item views and the
reply, in numpy over shared memory (the reference twin of the cuda FFN side's kernels).

Built by :func:`afd_cupy.backends.host.open_path` around the rank's
:class:`~afd_cupy.backends.host.HostRank`; the dedup steps are
:mod:`~afd_cupy.backends.host_dedup`'s functions.
"""
from __future__ import annotations

import numpy as np
import torch

from afd_cupy import wire
from afd_cupy.backends import host_dedup
from afd_cupy.backends.base import Arrival, ItemViews
from afd_cupy.backends.host import CAPABILITIES, HostRank
from afd_cupy.errors import ProtocolError
from afd_cupy.runtime.topology import Role
from afd_cupy.wire import fp8
from afd_cupy.wire.dtypes import f32_to_raw, raw_to_torch, torch_to_raw


class HostFFNPath:
    """wait_any / item_views / reply on numpy windows, in the layout's wire mode."""

    device = torch.device("cpu")
    capabilities = CAPABILITIES

    def __init__(self, rank: HostRank):
        self.rank = rank
        self.ctx = rank.ctx  # (public for tools: the context, window, seq counters)
        self.layout = rank.layout
        self.window = rank.window
        self.seqs = rank.seqs  # this rank's reply seq per (Attention rank, ring)
        self.capabilities = rank.capabilities
        # dedup: slot -> (seq, route table copy) of the item whose reply is pending
        self.dedup_tables: dict[int, tuple] = {}

    def wait_any(self, timeout_s: float) -> Arrival | None:
        polling = self.rank.polling
        found = polling.wait_any(timeout_s)
        if found is None:
            return None
        return Arrival(found.region, found.ring, polling.read_header(found.region, found.ring))

    def slot_flag(self, region: int, ring: int) -> int:
        return int(self.window.flag_view(self.window.own_pe, region, ring)[0])

    def pending_arrivals(self) -> int:
        return self.rank.polling.num_pending()

    @property
    def has_unclaimed_wait(self) -> bool:
        return False  # host waits take an arrival only as they return it

    def item_views(self, arrival: Arrival) -> ItemViews:
        """Zero-copy torch views of a received slot (dedup: the rows expanded into staging;
        FP8 dispatch: the rows dequantized to the payload dtype, fresh tensors). WireError
        when the header's row format (``FLAG_FP8``) is not this rank's ``dispatch_dtype``."""
        wire.check_dispatch_rows(arrival.header, self.layout)  # before any row is read
        if self.layout.is_dedup:
            return host_dedup.item_views(self.rank, self.dedup_tables, arrival)
        header, pe = arrival.header, self.window.own_pe
        region, ring = arrival.region, arrival.ring
        routed = self._rows(region, ring, "routed_x", header.routed_tokens)
        shared = self._rows(region, ring, "shared_x", header.shared_tokens)
        route = torch.from_numpy(self.window.field(pe, region, ring, "route_table", np.int32,
                                                   (header.routed_tokens, 2)))
        group_counts = torch.tensor(header.expert_counts, dtype=torch.int32)
        return ItemViews(routed, shared, route, group_counts)

    def _rows(self, region: int, ring: int, name: str, count: int) -> torch.Tensor:
        """[count, H] payload-dtype rows of field ``name`` of the own slot: a view of the
        window, or with FP8 dispatch the wire rows dequantized (``fp8.dequantize_wire_rows``,
        then rounded to the payload dtype: the reference of the FFN's dequantize kernels)."""
        layout, name_dtype, pe = self.layout, self.ctx.dtype, self.window.own_pe
        if not layout.is_fp8_dispatch:
            return raw_to_torch(self.window.field(pe, region, ring, name, self.rank.raw,
                                                  (count, layout.hidden_size)), name_dtype)
        wire_rows = self.window.field(pe, region, ring, name, np.uint8, (count, layout.dispatch_row_bytes))
        values = fp8.dequantize_wire_rows(np.asarray(wire_rows), layout.hidden_size)
        return raw_to_torch(f32_to_raw(values, name_dtype), name_dtype)

    def reply(self, arrival: Arrival, routed_out: torch.Tensor,
              shared_out: torch.Tensor | None) -> None:
        """Write the outputs, the reply header, then the flag (= this rank's reply seq)."""
        if self.layout.is_dedup:
            host_dedup.reply(self.rank, self.dedup_tables, arrival, routed_out, shared_out)
            return
        ctx = self.ctx
        seq = self.seqs.advance((arrival.region, arrival.ring))
        header = wire.reply_header(arrival.header, seq=seq, src_rank=ctx.role_rank)
        fields = {"routed_x": torch_to_raw(routed_out.detach(), ctx.dtype)}
        if shared_out is not None and arrival.header.shared_tokens:
            fields["shared_x"] = torch_to_raw(shared_out.detach(), ctx.dtype)
        self.rank.link.write_message(ctx.peer_pe(Role.ATTENTION, arrival.region), ctx.role_rank,
                                     arrival.ring, wire.encode_header(header, self.layout.expert_per_rank),
                                     seq, fields)

    def reply_seq_counters(self):
        raise ProtocolError("reply_seq_counters: backend 'host' keeps no host reply-seq counters "
                            "for another loop (capabilities.host_reply_seqs is False)")

    def set_reply_seq_counters(self, counters, *, slot: int | None = None) -> None:
        raise ProtocolError("set_reply_seq_counters: backend 'host' keeps no host reply-seq "
                            "counters for another loop (capabilities.host_reply_seqs is False)")

    def check_errors(self) -> None:
        """Nothing is ever latched: every host step raises where it fails."""

    def announce_shutdown(self) -> None:
        self.rank.announce_shutdown()

    def close(self, *, peers_healthy: bool = True) -> None:
        self.rank.close(peers_healthy=peers_healthy)
