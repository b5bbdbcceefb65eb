"""Host backend: the reference twin of the kernels, in numpy over POSIX shared memory.

Same wire format, protocol and step names as the cuda backend's RawKernels (plan -> scatter;
wait_replies -> combine; wait_any; reply), real processes, every step on the calling thread.
The rules both backends follow (headers, reply checks, capacities, late replies) are in
``afd_cupy.wire``; this file only applies them. Both wire modes: pair here, the dedup steps
in :mod:`afd_cupy.backends.host_dedup` (the reference for its future kernels).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from afd_cupy import dedup, errors, planner, wire
from afd_cupy.backends.base import Arrival, ItemViews, PathContext
from afd_cupy.backends.host_dedup import HostDedupSteps
from afd_cupy.backends.host_poll import HostPolling
from afd_cupy.errors import AfdError, reply_timeout_error
from afd_cupy.dtypes import raw_dtype, raw_to_f32, raw_to_torch, torch_to_raw
from afd_cupy.topology import Role


@dataclass
class HostSendState:
    """What the combine of one dispatch needs (stays on the Attention side).

    ``plan``: a ``planner.DispatchPlan`` (pair) or ``dedup.DedupPlan`` (dedup; its ``row_map``
    is the combine's map), None when nothing was sent. ``expected``: int64 [F], seq sent to
    FFN rank j, 0 when nothing was sent; ``shared_counts``: int64 [F] shared rows per rank;
    ``error``: why a dispatch sent nothing (CapacityError, InvalidRoutingError), raised by
    its combine.
    """

    plan: object
    expected: np.ndarray
    shared_counts: np.ndarray
    error: AfdError | None = None


#: wire modes this backend implements (``ConnectorConfig.wire_mode``)
WIRE_MODES = ("pair", "dedup")


def require_available() -> None:
    """The host backend runs wherever numpy and POSIX shared memory do."""


def open_path(ctx: PathContext, *, store, job_id: str, device_id, startup_timeout_s: float,
              nvshmem_env: dict | None = None,
              instance: int = 0):
    """Shared-memory heap and window of this rank (collective), and the host data path."""
    from afd_cupy.heap.host import HostHeap
    from afd_cupy.transports import get_transport
    from afd_cupy.window import Window

    heap = HostHeap(ctx.world_rank, ctx.topology.world_size, store, job_id,
                    timeout_s=startup_timeout_s)
    try:
        window = Window(heap, ctx.layout, store, name=f"window{instance}",
                        geometry_timeout_s=startup_timeout_s)  # shared memory maps every peer
        link = get_transport(ctx.transport).open(heap, window, ctx, instance=instance)
    except BaseException:
        heap.close()
        raise
    return HostDataPath(ctx, heap, window, link)


class HostDataPath(HostDedupSteps):
    """Dispatch/combine (Attention) and wait_any/reply (FFN) on numpy windows, in the
    layout's wire mode (the dedup steps come from :class:`HostDedupSteps`)."""

    device = torch.device("cpu")
    supports_nonblocking = False

    def __init__(self, ctx: PathContext, heap, window, link):
        self.ctx = ctx
        self.heap = heap
        self.window = window
        self.link = link  # every message goes out through the transport (afd_cupy.transports)
        self.layout = ctx.layout
        self.raw = raw_dtype(ctx.dtype)
        self.polling = HostPolling(window)
        # seq of this rank's last message to (peer role rank, ring); flags are these values
        self._seqs = np.zeros((self.layout.num_regions, self.layout.ring_depth), np.int64)
        # dedup FFN: slot -> (seq, route table copy) of the item whose reply is pending
        self._dedup_tables: dict[int, tuple] = {}
        if self.layout.is_dedup:
            dedup.warm_up()  # numba steps loaded now, not inside the first wait
        elif ctx.role is Role.ATTENTION:
            planner.warm_up()  # the FFN side of the pair mode runs no numba step

    def _next_seq(self, peer: int, ring: int) -> int:
        self._seqs[peer, ring] += 1
        return int(self._seqs[peer, ring])

    # --- Attention side: plan -> scatter ------------------------------------------------
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 layer_idx: int, stage_idx: int, ring: int) -> HostSendState:
        ctx, layout = self.ctx, self.layout
        num_ffn, num_tokens = ctx.num_ffn_ranks, hidden.shape[0]
        shared = np.array([planner.shared_count(num_tokens, num_ffn, j) if ctx.has_shared else 0
                           for j in range(num_ffn)], np.int64)
        expected = np.zeros(num_ffn, np.int64)
        ids = topk_ids.detach().to(torch.int64).numpy()  # int64 first: no wrap of a bad id
        bad = np.flatnonzero((ids < 0) | (ids >= ctx.num_experts))
        if bad.size:  # like the plan kernel: nothing is sent, the combine raises
            error = errors.bad_expert_error(int(ids.flat[bad[0]]), int(bad[0]),
                                            ctx.num_experts, layer_idx)
            return HostSendState(None, expected, shared, error=error)
        if layout.is_dedup:
            return self._dispatch_dedup(HostSendState(None, expected, shared), ids.astype(np.int32),
                                        hidden, topk_weights, layer_idx=layer_idx,
                                        stage_idx=stage_idx, ring=ring)
        plan = planner.plan_dispatch(ids.astype(np.int32), num_ffn, layout.expert_per_rank,
                                     ctx.num_experts)
        try:  # every check before any write: an overflowing dispatch sends nothing
            for j in range(num_ffn):
                wire.check_capacity(layout, num_tokens=num_tokens, routed_tokens=plan.routed_count(j),
                                    shared_tokens=int(shared[j]), peer=j, nothing_sent=True,
                                    layer_idx=layer_idx)
        except errors.CapacityError as exc:
            return HostSendState(None, expected, shared, error=exc)
        raw = torch_to_raw(hidden.detach(), ctx.dtype).reshape(num_tokens, layout.hidden_size)
        for j in range(num_ffn):
            if plan.routed_count(j) == 0 and shared[j] == 0 and not ctx.always_send:
                continue  # empty message: not sent, not waited on
            expected[j] = self._next_seq(j, ring)
            self._scatter(j, plan, raw, int(shared[j]), ring, int(expected[j]), layer_idx, stage_idx)
        return HostSendState(plan, expected, shared)

    def _scatter(self, ffn_rank, plan, raw, num_shared, ring, seq, layer_idx, stage_idx) -> None:
        ctx = self.ctx
        num_tokens = plan.num_tokens
        route_table = plan.rank_route_table(ffn_rank)
        fields = {"route_table": route_table, "routed_x": raw[route_table[:, 0]]}
        if num_shared:
            shared_idx = planner.shared_split(num_tokens, ctx.num_ffn_ranks, ffn_rank)
            fields["shared_idx"] = shared_idx
            fields["shared_x"] = raw[shared_idx]
        header = wire.dispatch_header(seq=seq, src_rank=ctx.role_rank, layer_idx=layer_idx,
                                      stage_idx=stage_idx, num_tokens=num_tokens,
                                      shared_tokens=num_shared, top_k=plan.top_k,
                                      expert_counts=plan.rank_counts(ffn_rank))
        self.link.write_message(ctx.peer_pe(Role.FFN, ffn_rank), ctx.role_rank, ring,
                                wire.encode_header(header, self.layout.expert_per_rank), seq, fields)

    def sent_to(self, state: HostSendState) -> list[int]:
        return [int(j) for j in np.flatnonzero(state.expected)]

    # --- Attention side: wait_replies -> combine ----------------------------------------
    def combine(self, state: HostSendState, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                *, ring: int, layer_idx: int, stage_idx: int, out_scale: float,
                blocking: bool = True) -> torch.Tensor:
        if state.error is not None:
            raise state.error
        if self.layout.is_dedup:
            return self._combine_dedup(state, ring=ring, layer_idx=layer_idx, stage_idx=stage_idx,
                                       out_scale=out_scale)
        ctx, hidden = self.ctx, self.layout.hidden_size
        deadline = time.monotonic() + ctx.peer_timeout_s
        routed_rows, shared_rows = [], []
        for j in range(ctx.num_ffn_ranks):
            if state.expected[j] == 0:
                routed_rows.append(np.zeros((0, hidden), np.float32))
                shared_rows.append(np.zeros((0, hidden), np.float32))
                continue
            want = wire.ReplyExpectation(
                peer=j, seq=int(state.expected[j]), layer_idx=layer_idx, stage_idx=stage_idx,
                routed_tokens=state.plan.routed_count(j), shared_tokens=int(state.shared_counts[j]))
            header = self._wait_reply(want, ring, deadline)
            routed_rows.append(self._rows(j, ring, "routed_x", header.routed_tokens))
            shared_rows.append(self._rows(j, ring, "shared_x", header.shared_tokens))
        num_tokens = state.plan.num_tokens
        out = np.full((num_tokens, hidden), np.nan, np.float32)
        if num_tokens:
            planner.combine(out, topk_ids.detach().to(torch.int32).numpy(),
                            topk_weights.detach().to(torch.float32).numpy(), state.plan.pos,
                            self.layout.expert_per_rank, routed_rows,
                            shared_rows if ctx.has_shared else None, out_scale)
        return torch.from_numpy(out).to(ctx.torch_dtype)

    def _wait_reply(self, want: wire.ReplyExpectation, ring: int, deadline: float) -> wire.Header:
        """The reply answering ``want``; late replies to earlier dispatches are dropped.

        A shutdown that kept the reply to ``want`` (``wire.FLAG_KEPT_REPLY``) is that reply;
        once a peer's shutdown was consumed on the slot, the next wait raises at once."""
        if self.polling.last_seen(want.peer, ring) == wire.SHUTDOWN_SEQ:
            raise errors.shutdown_during_reply_error(want.peer, want.layer_idx)
        while True:
            flag = self.polling.wait_flag(want.peer, ring, deadline)
            if flag is None:
                raise reply_timeout_error(want.peer, ring, want.layer_idx, want.seq,
                                          self.polling.last_seen(want.peer, ring), self.ctx.peer_timeout_s)
            header = self.polling.read_header(want.peer, ring)
            if wire.is_late_reply(header, want.seq):
                continue
            wire.check_reply(header, want)
            return header

    def _rows(self, region: int, ring: int, name: str, count: int) -> np.ndarray:
        view = self.window.field(self.window.own_pe, region, ring, name, self.raw,
                                 (count, self.layout.hidden_size))
        return raw_to_f32(np.asarray(view), self.ctx.dtype)

    def check_errors(self) -> None:
        """Nothing is ever latched: every host step raises where it fails."""

    # --- FFN side -----------------------------------------------------------------------
    def wait_any(self, timeout_s: float) -> Arrival | None:
        found = self.polling.wait_any(timeout_s)
        if found is None:
            return None
        return Arrival(found.region, found.ring, self.polling.read_header(found.region, found.ring))

    def pending_arrivals(self) -> int:
        return self.polling.num_pending()

    def item_views(self, arrival: Arrival) -> ItemViews:
        """Zero-copy torch views of a received slot (dedup: the rows expanded into staging)."""
        if self.layout.is_dedup:
            return self._item_views_dedup(arrival)
        header, hidden, name = arrival.header, self.layout.hidden_size, self.ctx.dtype
        region, ring, pe = arrival.region, arrival.ring, self.window.own_pe
        routed = raw_to_torch(self.window.field(pe, region, ring, "routed_x", self.raw,
                                                (header.routed_tokens, hidden)), name)
        shared = raw_to_torch(self.window.field(pe, region, ring, "shared_x", self.raw,
                                                (header.shared_tokens, hidden)), name)
        route = torch.from_numpy(self.window.field(pe, region, ring, "route_table", np.int32,
                                                   (header.routed_tokens, 2)))
        group_counts = torch.tensor(header.expert_counts, dtype=torch.int32)
        return ItemViews(routed, shared, route, group_counts)

    def reply(self, arrival: Arrival, routed_out: torch.Tensor,
              shared_out: torch.Tensor | None) -> None:
        """Write the outputs, the reply header, then the flag (= this rank's reply seq)."""
        if self.layout.is_dedup:
            self._reply_dedup(arrival, routed_out, shared_out)
            return
        ctx = self.ctx
        seq = self._next_seq(arrival.region, arrival.ring)
        header = wire.reply_header(arrival.header, seq=seq, src_rank=ctx.role_rank)
        fields = {"routed_x": torch_to_raw(routed_out.detach(), ctx.dtype)}
        if shared_out is not None and arrival.header.shared_tokens:
            fields["shared_x"] = torch_to_raw(shared_out.detach(), ctx.dtype)
        self.link.write_message(ctx.peer_pe(Role.ATTENTION, arrival.region), ctx.role_rank,
                                arrival.ring, wire.encode_header(header, self.layout.expert_per_rank),
                                seq, fields)

    # --- both ---------------------------------------------------------------------------
    def announce_shutdown(self) -> None:
        ctx, layout = self.ctx, self.layout
        words = wire.encode_header(wire.shutdown_header(src_rank=ctx.role_rank, top_k=ctx.top_k,
                                                        expert_per_rank=layout.expert_per_rank,
                                                        wire_mode=layout.wire_mode),
                                   layout.expert_per_rank)
        window = self.window
        for pe in ctx.opposite_pes():
            for ring in range(layout.ring_depth):
                out = words
                if ctx.role is Role.FFN:  # keep a reply the Attention side may not have read
                    flag = int(window.flag_view(pe, ctx.role_rank, ring)[0])
                    current = window.to_host(window.header_view(pe, ctx.role_rank, ring))
                    out = wire.shutdown_over_reply(current, flag, words)
                self.link.write_message(pe, ctx.role_rank, ring, out, wire.SHUTDOWN_SEQ)

    def close(self, *, peers_healthy: bool = True) -> None:
        self.window.close()
        self.heap.close(peers_healthy=peers_healthy)
