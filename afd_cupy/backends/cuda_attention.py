"""cuda backend, Attention side: plan -> scatter on send, wait_replies -> combine on receive.

The Attention rank's path: it holds the rank's shared :class:`~afd_cupy.backends.cuda.CudaRank`
(context, window, status channel, streams, geometry) and its own per-ring buffers and
launches (composition: the shared state is read through ``self.rank``). Four packed
launches per ring (five in dedup mode), built once; per call only the token count, pointers,
layer and stage are rewritten. Sequence numbers and what each reply must echo live on the
device (``seq_counters``, ``expected``, ``expected_counts``).

Dedup wire mode (docs/design/dedup.md): plan -> rows (``afd_dedup_rows``) -> dedup scatter on
send (``topk_weights`` read here: they travel in the route tables), wait_replies (``dedup=1``)
-> dedup combine over the ring's ``row_map`` on receive. Every buffer is allocated per ring
when the path opens, so both modes stay free of host syncs and allocations on the hot path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from afd_cupy import kernels, wire
from afd_cupy.backends.cuda_routing import FP32_CODE, OwnedRouting, routing_sources
from afd_cupy.backends.cuda_scratch import DedupRowsScratch, DispatchScratch  # noqa: F401 - re-exported
from afd_cupy.errors import reply_timeout_error
from afd_cupy.runtime.topology import Role


@dataclass
class CudaSendState:
    """One dispatch in flight: its ring's buffers and the tensors its kernels read."""

    ring: int
    expected: object  # cupy int64 [F]: seq sent to FFN rank j, 0 when nothing was sent
    # the caller's routing as the send's kernels read it (kept alive until they ran)
    topk_ids: torch.Tensor
    hidden: torch.Tensor
    num_tokens: int
    # dedup: the ring's row map (cupy int32 [token_cap, F], rows of the first num_tokens valid
    # once the send's kernels ran), read by the combine
    row_map: object = None
    topk_weights: torch.Tensor | None = None


class CudaAttentionPath:
    """The Attention-side steps of the cuda backend (``rank``: the rank's shared
    :class:`~afd_cupy.backends.cuda.CudaRank`).

    A pair-mode send copies the caller's routing into the ring's own buffers with one kernel
    (afd_own_routing: int32 ids, fp32 weights) for the combine, so the connector need not own it
    (``owns_routing``) and no torch op runs per send or receive. The dispatch reads the caller's
    routing as it is where it can (int32 ids, no padding experts; dedup: fp32 weights), else
    afd_own_routing converts it first (int64 ids: masked as an int32 cast would wrap them)."""

    #: the sends keep their own copy of the routing (the endpoint copies nothing)
    owns_routing = True

    def __init__(self, rank) -> None:
        self.rank = rank
        self.cp, self.ctx, self.layout = rank.cp, rank.ctx, rank.layout
        self.device, self.device_id = rank.device, rank.device_id
        self.window = rank.window  # (public for tools)
        self.capabilities = rank.capabilities
        self._init_buffers()

    def _init_buffers(self) -> None:
        cp, ctx, layout, rank = self.cp, self.ctx, self.layout, self.rank
        num_ffn = ctx.num_ffn_ranks
        max_partials = layout.token_cap * layout.top_k
        # 0 marks an FFN rank reached through the staging: the scatter fills it instead (docs/design/put-transport.md)
        self.peer_windows = cp.array([0 if rank.link.is_staged[j] else rank.window.peer_ptr(ctx.peer_pe(Role.FFN, j))
                                      for j in range(num_ffn)], dtype=cp.uint64)
        self.seq_counters = cp.zeros((layout.ring_depth, num_ffn), cp.int64)
        self.scratch = [DispatchScratch.allocate(max_partials, num_ffn, layout.expert_per_rank)
                        for _ in range(layout.ring_depth)]
        self.expected = [cp.zeros(num_ffn, cp.int64) for _ in range(layout.ring_depth)]
        # the ring's own routing (afd_own_routing writes it, the combine reads it)
        self.routing = OwnedRouting(cp, num_rings=layout.ring_depth, max_partials=max_partials,
                                    num_experts=ctx.num_experts)
        self.is_dedup = layout.is_dedup
        # the dispatch in one kernel when a full batch fits its shared memory (pair: plan +
        # scatter; dedup: plan + rows + scatter, afd_dedup_dispatch_ll with dedup_dispatch="ll")
        num_experts, fit = num_ffn * layout.expert_per_rank, (layout.token_cap, layout.top_k)
        self.ll_dispatch = self.is_dedup and ctx.dedup_dispatch == "ll" and \
            kernels.ll_dedup_dispatch_fits(*fit, num_experts, num_ffn)
        fits = (kernels.fused_dedup_dispatch_fits(*fit, num_experts, num_ffn) if self.is_dedup
                else kernels.fused_dispatch_fits(max_partials, num_experts))
        self.fused_dispatch = self.ll_dispatch or (ctx.fused_dispatch and fits)
        # expected_counts: (routed, shared) rows sent to each FFN rank (+ num_rows: dedup), echoed
        count_cols = 3 if self.is_dedup else 2
        self.expected_counts = [cp.zeros((num_ffn, count_cols), cp.int32)
                                for _ in range(layout.ring_depth)]
        self.dedup_rows = [DedupRowsScratch.allocate(layout.token_cap, layout.top_k, num_ffn)
                           for _ in range(layout.ring_depth)] if self.is_dedup else None
        self.reply_flags = [cp.zeros(num_ffn + 1, cp.int64) for _ in range(layout.ring_depth)]
        self.combine_done = [cp.zeros(1, cp.uint32) for _ in range(layout.ring_depth)]
        self.launches = [self._attention_launches(ring) for ring in range(layout.ring_depth)]
        # ring reuse across streams: the stream of each ring's last send/receive, and an event
        # recorded on it only when the next use of the ring comes from another stream
        self._ring_stream = [None] * layout.ring_depth
        self._ring_event = [cp.cuda.runtime.eventCreateWithFlags(cp.cuda.runtime.eventDisableTiming)
                            for _ in range(layout.ring_depth)]
        # expert ids outside [0, num_experts) must reach the plan kernel as invalid ids
        self._mask_ids = ctx.num_experts != num_ffn * layout.expert_per_rank

    def _attention_launches(self, ring: int) -> dict:
        """The four Attention-side kernels of one ring, checked and packed once.

        The specs are checked at full capacity (``token_cap`` tokens) with placeholders for
        the per-call arguments (token count, hidden/ids/weights/output pointers, layer,
        stage), which :meth:`dispatch` and :meth:`combine` rewrite before each launch.
        NOTE: the connector checks ``num_tokens <= token_cap`` before every dispatch, so the
        scratch buffers checked here fit every launch.
        """
        ctx, layout, geo = self.ctx, self.layout, self.rank.geometry
        scratch, expected = self.scratch[ring], self.expected[ring]
        num_ffn, epr, cap = ctx.num_ffn_ranks, layout.expert_per_rank, layout.token_cap
        ids, weights = self.routing.buffers[ring]  # what afd_own_routing writes per send
        replies = dict(window=self.rank.own_window, geo=geo, num_ffn_ranks=num_ffn, ring=ring,
                       expected=expected, expected_counts=self.expected_counts[ring], layer_idx=0,
                       stage_idx=0, last_seen=self.rank.last_seen, reply_flags=self.reply_flags[ring],
                       timeout_ns=self.rank.timeout_ns, status=self.rank.status.ptr)
        # what every sending kernel of either mode takes (the per-call ones are placeholders)
        sends = dict(
            dtype_code=self.rank.dtype_code, hidden=self.rank.own_window, num_tokens=cap,
            hidden_size=layout.hidden_size, topk_ids=ids, top_k=layout.top_k,
            expert_per_rank=epr, num_ffn_ranks=num_ffn, expert_start=scratch.expert_start,
            rank_offsets=scratch.rank_offsets, expert_counts=scratch.expert_counts,
            verdict=scratch.verdict, peer_windows=self.peer_windows, geo=geo, ring=ring,
            always_send=int(ctx.always_send), src_rank=ctx.role_rank, layer_idx=0, stage_idx=0,
            seq_counters=self.seq_counters[ring], expected=expected,
            expected_counts=self.expected_counts[ring], done_counter=scratch.scatter_done,
            staging=self.rank.link.staging_base)
        fused_only = dict(routed_cap=layout.routed_cap, has_shared=int(ctx.has_shared),
                          skipped=scratch.skipped, status=self.rank.status.ptr)
        if self.is_dedup:
            launches = self._dedup_launches(ring, replies, sends, fused_only)
        else:
            wait = kernels.wait_replies_spec(**replies)
            combine = kernels.combine_spec(
                dtype_code=self.rank.dtype_code, out=self.rank.own_window, num_tokens=cap,
                hidden_size=layout.hidden_size, topk_ids=ids, topk_weights=weights, pos=scratch.pos,
                top_k=layout.top_k, expert_per_rank=epr, has_shared=int(ctx.has_shared),
                out_scale=1.0, done_counter=self.combine_done[ring], **replies)
            # FLAG_FP8: the dispatch kernels quantize the rows into FP8 wire rows (common/fp8.cuh)
            hdr_flags = wire.FLAG_FP8 if layout.is_fp8_dispatch else 0
            pair = dict(sends, num_partials=cap * layout.top_k, pos_out=scratch.pos, hdr_flags=hdr_flags)
            if self.fused_dispatch:
                launches = {"fused": kernels.dispatch_fused_spec(**fused_only, **pair)}
            else:
                launches = {"scatter": kernels.dispatch_scatter_spec(
                    chunk_hist=scratch.chunk_hist, local_rank=scratch.local_rank,
                    has_shared=int(ctx.has_shared), **pair)}
            launches.update(wait=wait, combine=combine)
        if not self.fused_dispatch:  # both modes: the grid-wide plan first
            launches["plan"] = kernels.dispatch_plan_spec(
                topk_ids=ids, num_partials=cap * layout.top_k, num_ffn_ranks=num_ffn,
                expert_per_rank=epr, routed_cap=layout.routed_cap, layer_idx=0,
                chunk_hist=scratch.chunk_hist, local_rank=scratch.local_rank,
                expert_counts=scratch.expert_counts, expert_start=scratch.expert_start,
                rank_offsets=scratch.rank_offsets, verdict=scratch.verdict,
                done_counter=scratch.plan_done, status=self.rank.status.ptr)
        return {name: kernels.PackedLaunch(spec) for name, spec in launches.items()}

    def _dedup_launches(self, ring: int, replies: dict, sends: dict, fused_only: dict) -> dict:
        """The dedup-mode specs of one ring (the fused dispatch, or rows and scatter; wait and
        combine), checked; ``sends`` / ``fused_only`` as in :meth:`_attention_launches`."""
        ctx, layout = self.ctx, self.layout
        scratch, rows = self.scratch[ring], self.dedup_rows[ring]
        ids, weights = self.routing.buffers[ring]  # what afd_own_routing writes per send
        row_outputs = dict(row_map=rows.row_map, shared_rank=rows.shared_rank,
                           num_rows=rows.num_rows, shared_rows=rows.shared_rows)
        dedup = dict(sends, topk_weights=weights, **row_outputs)
        if self.fused_dispatch:  # the one-kernel dispatch: "ll" (where it fits) or the fused one
            one_kernel = kernels.dedup_dispatch_ll_spec if self.ll_dispatch else kernels.dedup_dispatch_fused_spec
            launches = {"fused": one_kernel(**fused_only, **dedup)}
        else:
            launches = {
                "rows": kernels.dedup_rows_spec(
                    topk_ids=ids, num_tokens=layout.token_cap, top_k=layout.top_k,
                    expert_per_rank=layout.expert_per_rank, num_ffn_ranks=ctx.num_ffn_ranks,
                    has_shared=int(ctx.has_shared), verdict=scratch.verdict,
                    rows_hist=rows.rows_hist, rows_local=rows.rows_local,
                    done_counter=rows.rows_done, **row_outputs),
                "scatter": kernels.dedup_scatter_spec(chunk_hist=scratch.chunk_hist,
                                                      local_rank=scratch.local_rank, **dedup)}
        launches["wait"] = kernels.wait_replies_spec(**replies, dedup=1)
        launches["combine"] = kernels.dedup_combine_spec(
            dtype_code=self.rank.dtype_code, out=self.rank.own_window, num_tokens=layout.token_cap,
            hidden_size=layout.hidden_size, row_map=rows.row_map, out_scale=1.0,
            done_counter=self.combine_done[ring], **replies)
        return launches

    def order_graph_replay(self, rings, stream: int) -> None:
        """A captured graph that sends and receives on ``rings`` is about to be replayed on
        ``stream`` (a raw stream pointer): order the replay after each ring's last use on
        another stream, and that ring's next use elsewhere after the replay (the replay's
        stream becomes the ring's stream). The replay itself bypasses :meth:`_order_ring`."""
        for ring in sorted(rings):
            self._order_ring(ring, stream)

    def _order_ring(self, ring: int, stream: int) -> None:
        """Order this use of ``ring`` on ``stream`` after its previous use on another stream.

        A ring's scratch, ``expected`` words and reply slot are rewritten by every send on it
        and read by the receive: a receive on stream A followed by a send on stream B (or a
        send on A and its receive on B) must not overlap. Same stream (the common case): stream
        order suffices and this costs nothing. On a switch, an event recorded now on the old
        stream (after everything queued there, the ring's last kernels included) is waited on
        by the new one. NOTE: skipped when either stream is capturing a CUDA graph (an event
        across the capture boundary is a capture error): a graph is ordered by the stream it
        is replayed on (:meth:`order_graph_replay`). A capture runs nothing, so it leaves the
        ring's stream as it was: the replay then waits for the ring's last use that really
        ran (an eager step on another stream, still in flight), not for the idle capture
        stream. (A capture that stays on the ring's stream, e.g. a step's stage streams after
        their warm-up, changes nothing either.)
        """
        previous = self._ring_stream[ring]
        if previous is None or previous == stream:
            self._ring_stream[ring] = stream
            return
        runtime = self.cp.cuda.runtime
        if runtime.streamIsCapturing(stream) or runtime.streamIsCapturing(previous):
            return
        self._ring_stream[ring] = stream
        runtime.eventRecord(self._ring_event[ring], previous)
        runtime.streamWaitEvent(stream, self._ring_event[ring])

    def dispatch(self, hidden, topk_ids, topk_weights, *, layer_idx: int, stage_idx: int,
                 ring: int) -> CudaSendState:
        """Pair mode: plan -> scatter, or the one fused kernel (``self.fused_dispatch``);
        ``topk_weights`` are read by the combine. Dedup mode: plan -> rows -> scatter, or one
        kernel (fused, or ``self.ll_dispatch``; the weights travel in the route tables)."""
        ctx, layout = self.ctx, self.layout
        self.rank.use_device()
        self.rank.status.raise_latched()
        num_tokens = hidden.shape[0]
        hidden = hidden.contiguous()
        launches, stream = self.launches[ring], self.rank.stream_ptr()
        self._order_ring(ring, stream)
        num_partials = num_tokens * layout.top_k
        ids, weights, weights_code = routing_sources(topk_ids, topk_weights)
        # The caller's routing as it is (int32 ids that need no mask; dedup: fp32 weights) is
        # read by the dispatch itself, and pair mode copies it for the combine behind the
        # dispatch, off the round trip's critical path (the stream then waits for the replies
        # anyway). Otherwise afd_own_routing converts it into the ring's buffers first.
        direct = (ids.dtype == torch.int32 and not self._mask_ids
                  and (not self.is_dedup or weights_code == FP32_CODE))
        own_ids, own_weights = self.routing.buffers[ring]
        if not direct:
            self.routing.launch(ring, stream, ids, weights, weights_code, num_partials,
                                mask=self._mask_ids)
        ids_ptr = ids.data_ptr() if direct else own_ids.data.ptr
        if self.is_dedup:  # the weights travel in the route tables: read by the sender
            per_call = (("topk_weights", weights.data_ptr() if direct else own_weights.data.ptr),)
            grid = (kernels.dedup_ll_grid if self.ll_dispatch else kernels.dedup_scatter_grid)(
                num_tokens, ctx.num_ffn_ranks, layout.row_bytes)
        else:
            per_call = (("num_partials", num_partials),)
            grid = kernels.scatter_grid(num_tokens, layout.top_k, int(ctx.has_shared),
                                        row_bytes=layout.dispatch_row_bytes if self.fused_dispatch else 0)
        if not self.fused_dispatch:  # the grid-wide plan (and in dedup mode the rows) first
            plan = launches["plan"]
            plan.set("topk_ids", ids_ptr)
            plan.set("num_partials", num_partials)
            plan.set("layer_idx", layer_idx)  # named by a latched capacity or bad-expert error
            plan.launch(stream, kernels.plan_grid(num_partials))
            if self.is_dedup:
                rows = launches["rows"]
                rows.set("topk_ids", ids_ptr)
                rows.set("num_tokens", num_tokens)
                rows.launch(stream, kernels.dedup_rows_grid(num_tokens, layout.top_k))
        sender = launches["fused" if self.fused_dispatch else "scatter"]
        for name, value in (("hidden", hidden.data_ptr()), ("num_tokens", num_tokens),
                            ("topk_ids", ids_ptr), ("layer_idx", layer_idx),
                            ("stage_idx", stage_idx)) + per_call:
            sender.set(name, value)
        sender.launch(stream, grid)
        if direct and not self.is_dedup:  # the combine's copy
            self.routing.launch(ring, stream, ids, weights, weights_code, num_partials,
                                mask=self._mask_ids)
        self._put_dispatch(stream, ring, num_tokens)
        if self.is_dedup:
            return CudaSendState(ring, self.expected[ring], ids, hidden, num_tokens,
                                 row_map=self.dedup_rows[ring].row_map, topk_weights=weights)
        return CudaSendState(ring, self.expected[ring], ids, hidden, num_tokens, topk_weights=weights)

    def _put_dispatch(self, stream: int, ring: int, num_tokens: int) -> None:
        """Staged peers (both modes): staging -> their windows, flags last, behind the scatter on
        ``stream`` (the transport's link; docs/design/put-transport.md). Direct: nothing."""
        self.rank.link.after_dispatch(stream, ring, num_tokens, num_ffn_ranks=self.ctx.num_ffn_ranks,
                                      has_shared=self.ctx.has_shared)

    def sent_to(self, state: CudaSendState) -> list[int]:
        return [int(j) for j in np.flatnonzero(state.expected.get())]

    # --- Attention side: wait_replies -> combine --------------------------------------------
    def combine(self, state: CudaSendState, topk_ids, topk_weights, *, ring: int, layer_idx: int,
                stage_idx: int, out_scale: float, blocking: bool = True) -> torch.Tensor:
        layout, ctx = self.layout, self.ctx
        self.rank.use_device()
        if blocking:
            self.rank.no_capture("recv_ffn_output(blocking=True)")
        num_tokens = state.num_tokens
        out = torch.empty(num_tokens, layout.hidden_size, dtype=ctx.torch_dtype, device=self.device)
        launches, stream = self.launches[ring], self.rank.stream_ptr()
        self._order_ring(ring, stream)
        wait, combine = launches["wait"], launches["combine"]
        wait.set("layer_idx", layer_idx)  # what this ring's replies must echo
        wait.set("stage_idx", stage_idx)
        combine.set("layer_idx", layer_idx)
        combine.set("stage_idx", stage_idx)
        grid = kernels.combine_grid(num_tokens, out.shape[-1] * out.element_size())
        if self.rank.host_polling is not None:
            self._host_wait_replies(state, ring, layer_idx, stage_idx)
        elif not kernels.combine_waits_itself(grid):
            wait.launch(stream)
        # else: a small combine's blocks wait for the replies themselves: one kernel less
        if self.is_dedup:
            self._launch_dedup_combine(combine, stream, state, out, out_scale, grid)
        else:
            combine.set("out", out.data_ptr())
            combine.set("num_tokens", num_tokens)
            # ids and weights: the ring's own copy, taken at send time (fixed in the launch)
            combine.set("out_scale", out_scale)
            combine.launch(stream, grid)
        if blocking:
            self.rank.status.sync_and_raise(layer_idx=layer_idx)
        return out

    @staticmethod
    def _launch_dedup_combine(dedup_combine, stream: int, state: CudaSendState, out: torch.Tensor,
                              out_scale: float, grid: int) -> None:
        """Dedup mode: the combine reads neither ids nor weights, only the send's row map."""
        dedup_combine.set("out", out.data_ptr())
        dedup_combine.set("num_tokens", state.num_tokens)
        dedup_combine.set("row_map", state.row_map.data.ptr)
        dedup_combine.set("out_scale", out_scale)
        dedup_combine.launch(stream, grid)

    def _host_wait_replies(self, state: CudaSendState, ring: int, layer_idx: int, stage_idx: int) -> None:
        """poll_mode="host": wait for the replies with host copies of the flags (no spinning
        kernel); late replies are dropped here as on the device, the combine re-checks."""
        self.rank.no_capture("poll_mode='host'")
        self.rank.status.sync_and_raise(layer_idx=layer_idx)
        expected = state.expected.get()
        deadline = time.monotonic() + self.ctx.peer_timeout_s
        polling = self.rank.host_polling
        for j in np.flatnonzero(expected):
            want_seq = int(expected[j])
            if polling.last_seen(int(j), ring) == wire.SHUTDOWN_SEQ:
                continue  # the peer's shutdown was consumed: the combine's check raises at once
            while True:
                if polling.wait_flag(int(j), ring, deadline) is None:
                    raise reply_timeout_error(int(j), ring, layer_idx, want_seq,
                                              polling.last_seen(int(j), ring), self.ctx.peer_timeout_s)
                if not wire.is_late_reply(polling.read_header(int(j), ring), want_seq):
                    break

    # --- both roles' steps, on the shared rank -----------------------------------------------
    def check_errors(self) -> None:
        self.rank.check_errors()

    def announce_shutdown(self) -> None:
        self.rank.announce_shutdown()

    def close(self, *, peers_healthy: bool = True) -> None:
        self.rank.close(peers_healthy=peers_healthy, events=self._ring_event)
