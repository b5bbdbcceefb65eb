"""Host backend: the reference twin of the kernels, in numpy over POSIX shared memory.

Same wire format, protocol and step names as the cuda backend's RawKernels (plan -> scatter;
wait_replies -> combine; wait_any; reply), real processes, every step on the calling thread.
The rules both backends follow (headers, reply checks, capacities, late replies) are in
``afd_cupy.wire``; this file only applies them. Both wire modes: pair here, the dedup steps
in :mod:`afd_cupy.backends.host_dedup` (the reference for its kernels).

Shape (composition, no mixins): :func:`open_path` builds one :class:`HostRank` (what both
roles share: context, heap, window, polling, seq counters, the shutdown and close steps) and
the path of the rank's role around it: :class:`HostAttentionPath` here, or
:class:`~afd_cupy.backends.host_ffn.HostFFNPath`.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from afd_cupy import errors, wire
from afd_cupy.backends import host_dedup
from afd_cupy.backends.base import Capabilities, PathContext
from afd_cupy.backends.host_poll import HostPolling
from afd_cupy.errors import AfdError, reply_timeout_error
from afd_cupy.routing import dedup, planner
from afd_cupy.runtime.topology import Role
from afd_cupy.transports import get_transport
from afd_cupy.wire import fp8
from afd_cupy.wire.dtypes import raw_dtype, raw_to_f32, torch_to_raw
from afd_cupy.wire.seq import SeqCounter


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
#: what every host path can do: every step runs on the calling thread and blocks. Its
#: transports are those registered for "host" (afd_cupy.transports): shared memory maps every
#: peer, so ``"auto"`` is direct; ``"put"`` (NVSHMEM puts) is the cuda backend's only
CAPABILITIES = Capabilities(backend="host", wire_modes=WIRE_MODES)


def require_available() -> None:
    """The host backend runs wherever numpy and POSIX shared memory do."""


def open_path(ctx: PathContext, *, store, job_id: str, device_id, startup_timeout_s: float,
              nvshmem_env: dict | None = None,
              instance: int = 0):
    """Shared-memory heap and window of this rank (collective), and the host data path."""
    from afd_cupy.heap.host import HostHeap
    from afd_cupy.heap.window import Window

    heap = HostHeap(ctx.world_rank, ctx.topology.world_size, store, job_id,
                    timeout_s=startup_timeout_s)
    try:
        window = Window(heap, ctx.layout, store, name=f"window{instance}",
                        geometry_timeout_s=startup_timeout_s)  # shared memory maps every peer
        link = get_transport(ctx.transport).open(heap, window, ctx, instance=instance)
    except BaseException:
        heap.close()
        raise
    rank = HostRank(ctx, heap, window, link)
    if ctx.role is Role.ATTENTION:
        return HostAttentionPath(rank)
    from afd_cupy.backends.host_ffn import HostFFNPath

    return HostFFNPath(rank)


class HostRank:
    """What both role paths of one host rank share, built once by :func:`open_path`.

    ``ctx``: the frozen :class:`PathContext`; ``heap`` / ``window``: this rank's shared
    memory; ``link``: the transport's :class:`~afd_cupy.transports.Link`, through which every
    message goes out; ``raw``: the payload's raw numpy dtype; ``polling``: the host flag waits
    over the own window; ``seqs``: the seq of this rank's last message per (opposite-role peer,
    ring) (the flags are these values); ``capabilities`` (its ``put_peers``: the link's staged
    peers). Both roles' shutdown and close steps are here.
    """

    def __init__(self, ctx: PathContext, heap, window, link):
        self.ctx = ctx
        self.layout = ctx.layout
        self.heap = heap
        self.window = window
        self.link = link
        self.capabilities = dataclasses.replace(CAPABILITIES, put_peers=tuple(link.staged_peers))
        self.raw = raw_dtype(ctx.dtype)
        self.polling = HostPolling(window)
        self.seqs = SeqCounter((self.layout.num_regions, self.layout.ring_depth))
        if self.layout.is_dedup:
            dedup.warm_up()  # numba steps loaded now, not inside the first wait
        elif ctx.role is Role.ATTENTION:
            planner.warm_up()  # the FFN side of the pair mode runs no numba step

    def rows(self, region: int, ring: int, name: str, count: int) -> np.ndarray:
        """fp32 copy of ``count`` rows of field ``name`` of the own window's slot."""
        view = self.window.field(self.window.own_pe, region, ring, name, self.raw,
                                 (count, self.layout.hidden_size))
        return raw_to_f32(np.asarray(view), self.ctx.dtype)

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


class HostAttentionPath:
    """Dispatch/combine on numpy windows, in the layout's wire mode (the dedup steps are
    :mod:`~afd_cupy.backends.host_dedup`'s functions)."""

    device = torch.device("cpu")
    capabilities = CAPABILITIES

    def __init__(self, rank: HostRank):
        self.rank = rank
        self.ctx = rank.ctx  # (public for tools: the context, window, seq counters)
        self.layout = rank.layout
        self.window = rank.window
        self.seqs = rank.seqs
        self.capabilities = rank.capabilities

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
            return host_dedup.dispatch(self.rank, HostSendState(None, expected, shared),
                                       ids.astype(np.int32), hidden, topk_weights,
                                       layer_idx=layer_idx, stage_idx=stage_idx, ring=ring)
        plan = planner.plan_dispatch(ids.astype(np.int32), num_ffn, layout.expert_per_rank,
                                     ctx.num_experts)
        try:  # every check before any write: an overflowing dispatch sends nothing
            for j in range(num_ffn):
                wire.check_capacity(layout, num_tokens=num_tokens, routed_tokens=plan.routed_count(j),
                                    shared_tokens=int(shared[j]), peer=j, nothing_sent=True,
                                    layer_idx=layer_idx)
        except errors.CapacityError as exc:
            return HostSendState(None, expected, shared, error=exc)
        rows = self._wire_rows(hidden)
        for j in range(num_ffn):
            if plan.routed_count(j) == 0 and shared[j] == 0 and not ctx.always_send:
                continue  # empty message: not sent, not waited on
            expected[j] = self.seqs.advance((j, ring))
            self._scatter(j, plan, rows, int(shared[j]), ring, int(expected[j]), layer_idx, stage_idx)
        return HostSendState(plan, expected, shared)

    def _wire_rows(self, hidden: torch.Tensor) -> np.ndarray:
        """The dispatched row of every token: raw payload words [T, H] (int16/int32), or with
        FP8 dispatch the quantized wire rows uint8 [T, fp8_row_bytes(H)] (afd_cupy.wire.fp8:
        the reference of the kernels' quantizer)."""
        ctx, layout = self.ctx, self.layout
        raw = torch_to_raw(hidden.detach(), ctx.dtype).reshape(hidden.shape[0], layout.hidden_size)
        if not layout.is_fp8_dispatch:
            return raw
        return fp8.quantize_wire_rows(raw_to_f32(raw, ctx.dtype))

    def _scatter(self, ffn_rank, plan, rows, num_shared, ring, seq, layer_idx, stage_idx) -> None:
        ctx = self.ctx
        num_tokens = plan.num_tokens
        route_table = plan.rank_route_table(ffn_rank)
        fields = {"route_table": route_table, "routed_x": rows[route_table[:, 0]]}
        if num_shared:
            shared_idx = planner.shared_split(num_tokens, ctx.num_ffn_ranks, ffn_rank)
            fields["shared_idx"] = shared_idx
            fields["shared_x"] = rows[shared_idx]
        header = wire.dispatch_header(seq=seq, src_rank=ctx.role_rank, layer_idx=layer_idx,
                                      stage_idx=stage_idx, num_tokens=num_tokens,
                                      shared_tokens=num_shared, top_k=plan.top_k,
                                      expert_counts=plan.rank_counts(ffn_rank),
                                      fp8=self.layout.is_fp8_dispatch)
        self.rank.link.write_message(ctx.peer_pe(Role.FFN, ffn_rank), ctx.role_rank, ring,
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
            return host_dedup.combine(self.rank, state, self.wait_reply, ring=ring,
                                      layer_idx=layer_idx, stage_idx=stage_idx, out_scale=out_scale)
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
            header = self.wait_reply(want, ring, deadline)
            routed_rows.append(self.rank.rows(j, ring, "routed_x", header.routed_tokens))
            shared_rows.append(self.rank.rows(j, ring, "shared_x", header.shared_tokens))
        num_tokens = state.plan.num_tokens
        out = np.full((num_tokens, hidden), np.nan, np.float32)
        if num_tokens:
            planner.combine(out, topk_ids.detach().to(torch.int32).numpy(),
                            topk_weights.detach().to(torch.float32).numpy(), state.plan.pos,
                            self.layout.expert_per_rank, routed_rows,
                            shared_rows if ctx.has_shared else None, out_scale)
        return torch.from_numpy(out).to(ctx.torch_dtype)

    def wait_reply(self, want: wire.ReplyExpectation, ring: int, deadline: float) -> wire.Header:
        """The reply answering ``want``; late replies to earlier dispatches are dropped.

        A shutdown that kept the reply to ``want`` (``wire.FLAG_KEPT_REPLY``) is that reply;
        once a peer's shutdown was consumed on the slot, the next wait raises at once."""
        polling = self.rank.polling
        if polling.last_seen(want.peer, ring) == wire.SHUTDOWN_SEQ:
            raise errors.shutdown_during_reply_error(want.peer, want.layer_idx)
        while True:
            flag = polling.wait_flag(want.peer, ring, deadline)
            if flag is None:
                raise reply_timeout_error(want.peer, ring, want.layer_idx, want.seq,
                                          polling.last_seen(want.peer, ring), self.ctx.peer_timeout_s)
            header = polling.read_header(want.peer, ring)
            if wire.is_late_reply(header, want.seq):
                continue
            wire.check_reply(header, want)
            return header

    def check_errors(self) -> None:
        """Nothing is ever latched: every host step raises where it fails."""

    def order_graph_replay(self, rings, stream: int) -> None:
        """Nothing to order: the host path has no streams (and no graph capture)."""

    def announce_shutdown(self) -> None:
        self.rank.announce_shutdown()

    def close(self, *, peers_healthy: bool = True) -> None:
        self.rank.close(peers_healthy=peers_healthy)
