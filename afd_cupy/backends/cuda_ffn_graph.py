"""The graph-driven FFN server (cuda backend, both wire modes; docs/design/cuda-graphs.md).

One CUDA graph per size bucket serves one work item per replay with no host step per item::

    afd_graph_wait_stage (bounded wait + stage in one kernel) -> afd_graph_gather
    -> torch._grouped_mm over every layer's experts stacked into one problem list (offsets
       from the device: zero-size groups for every layer but the arrived one) -> activation
    -> the same for the shared experts -> routed scaling -> afd_graph_reply

(``fused_wait_stage=False``: ``afd_wait_any`` into a device doorbell, then ``afd_graph_stage``.)

In the dedup wire mode (docs/design/dedup.md) ``afd_graph_dedup_expand`` replaces the gather (it copies and
checks the route table, scatters the received rows into the grouped staging and copies the
shared rows) and ``afd_graph_dedup_reply`` the reply (the fused reduce: one row per received
row). A route table the expand rejects ends the replay as BAD_ROUTE (nothing answered, the
reserved reply seq given back): the host raises the eager path's WireError from the verdict
in the record.

The host keeps ``depth`` replays queued on one stream and, per completed replay (an event,
polled with sleeps while idle), reads one record from a pinned ring: IDLE (the wait timed out:
liveness check, replay again), SERVED, SHUTDOWN (counted like the eager receive), EAGER (a
valid item too large for the bucket or outside the stacked layers: served by an
:class:`~afd_cupy.ffn_worker.FFNWorker` on a second stream with the reply seq the device
reserved) or REJECTED (the header fails a check: decoded on the host, which raises the eager
path's WireError / ProtocolError).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

import numpy as np
import torch

from afd_cupy import ffn_graph, kernels, moe, wire
from afd_cupy.backends.base import Arrival
from afd_cupy.backends.cuda_ffn_dedup import UNCLAIMED
from afd_cupy.errors import ConfigError, ConnectorShutdown, ProtocolError, PeerTimeoutError
from afd_cupy.ffn_worker import FFNWorker, per_layer
from afd_cupy.kernels import specs
from afd_cupy.testing.reference import identity_experts
from afd_cupy.topology import Role

logger = logging.getLogger("afd_cupy")

#: host wait beyond the in-graph timeout before a replay is declared stuck
_HOST_GRACE_S = 5.0
#: longest sleep between two polls of an idle replay's event
_MAX_IDLE_SLEEP_S = 1e-3
#: least time between two liveness checks while idle
_LIVENESS_PERIOD_S = 0.1


class GraphFFNServer:
    """Serve an FFN-side cuda connector's work items by replaying CUDA graphs.

    ``experts`` / ``shared``: as :class:`FFNWorker` (one ``moe.ExpertWeights`` or one per
    layer); they are stacked once into ``[num_layers * epr, 2I, H]`` / ``[num_layers * epr, H,
    I]`` tensors (and ``[num_layers, ...]`` for the shared experts) and the eager fallback's
    per-layer weights become views of those. ``identity=True`` instead: the outputs are the
    received rows (benchmarks), no GEMMs (dedup: each reply row is then the reduce of the
    received row, ``sum_s w_s * x_r (+ x_r)``, as the eager path with ``identity_experts``
    replies). ``bucket_tokens``: one graph per batch size
    (:func:`afd_cupy.ffn_graph.buckets_for_tokens`). ``depth``: replays kept queued.
    ``idle_timeout_s``: the in-graph wait's bound (frozen at capture); an idle replay returns
    after it and is replayed again, and :meth:`close` waits at most ``depth`` of them.
    ``fused_wait_stage``: the graph's first node is ``afd_graph_wait_stage`` (the wait and the
    stage in one kernel, the default); False: ``afd_wait_any`` into a device doorbell, then
    ``afd_graph_stage`` (the two-kernel form, kept to measure against).
    ``gemm_sm_carveout``: SMs the expert GEMMs leave free; ``"auto"`` (the default) is
    ``moe.AUTO_GEMM_SM_CARVEOUT`` (2) when this torch has the carve-out binding, 0 (untouched)
    otherwise. The graphs' GEMMs are captured inside ``moe.sm_carveout(n)``, so their grids
    (``SMs - n`` CTAs) are frozen into the graphs, and the eager fallback worker gets the same
    value. The server's own replays run one after another on one stream, so the spinner that
    the carve-out makes room for is another process's: on one GPU under MPS, the Attention's
    reply wait (docs/design/performance-decisions.md, "SM carve-out": on an H200 the V2-Lite-shaped experts phase
    of the 1A1F round trip drops from ~690 to ~485 µs). "auto" or an int >= 0 and < the device's
    SM count (ConfigError). With ``identity=True`` there are no GEMMs: no effect.

    Both wire modes (dedup: the route table is checked in the graph; a rejected table raises
    the eager path's WireError from :meth:`run` / :meth:`step`).

    Limits (ConfigError): ``poll_mode="device"``, the async schedule, every Attention peer
    reached by direct stores (no put transport: the reply is a kernel's stores); GEMM
    mode needs bf16, SM90/SM100, no expert biases and no shared-expert gate. Not thread-safe;
    while it runs, nothing else may receive on the connector. Not collective.
    """

    def __init__(self, connector, experts=None, shared=None, *, identity: bool = False,
                 bucket_tokens=(128,), depth: int = 4, idle_timeout_s: float = 0.01,
                 fused_wait_stage: bool = True, gemm_sm_carveout: int | str = "auto"):
        path = connector.path
        self._check_connector(connector, identity, experts)
        self.gemm_sm_carveout = self._check_settings(depth, idle_timeout_s, gemm_sm_carveout, path.device)
        self.connector, self.path, self.layout = connector, path, connector.layout
        self.identity = identity
        self.is_dedup = connector.layout.is_dedup
        self.depth, self.idle_timeout_s = depth, float(idle_timeout_s)
        self.fused_wait_stage = bool(fused_wait_stage)
        self.num_layers = connector.model.num_layers
        self.device = path.device
        layout = self.layout
        self.lpc = ffn_graph.layers_per_chunk(self.num_layers, layout.expert_per_rank)
        self.num_chunks = ffn_graph.num_chunks(self.num_layers, layout.expert_per_rank)
        if identity:
            self.buckets = (ffn_graph.identity_bucket(layout),)
            self.eager_worker = FFNWorker(connector, expert_fn=identity_experts,
                                          gemm_sm_carveout=self.gemm_sm_carveout)
        else:
            self.buckets = ffn_graph.buckets_for_tokens(
                bucket_tokens, layout, top_k=connector.model.top_k,
                num_ffn_ranks=connector.topology.num_ffn_ranks)
            self._stack_weights(experts, shared)
        self.policy = ffn_graph.BucketPolicy(self.buckets)
        self.num_served = 0  # items answered (graph and eager)
        self.num_eager = 0   # of which on the eager path
        self.num_replays = 0
        self._alloc_device_state()
        self.stream = torch.cuda.Stream(self.device)
        self.eager_stream = torch.cuda.Stream(self.device)
        self._events = deque(torch.cuda.Event() for _ in range(depth))
        self._inflight: deque = deque()  # (replay number, event), oldest first
        self._next_replay = 0
        self._started = False
        self._idle_sleep_s = 0.0
        self._last_liveness = 0.0
        self._graph_buffers: list = []
        self.graphs = [self._capture(bucket) for bucket in self.buckets]

    # --- set-up ---------------------------------------------------------------------------
    @staticmethod
    def _check_connector(connector, identity: bool, experts) -> None:
        if connector.role is not Role.FFN or connector.backend != "cuda":
            raise ConfigError(f"GraphFFNServer needs an FFN-side cuda connector, got "
                              f"{connector.role.value} / {connector.backend}")
        staged = connector.path.link.staged_peers
        if staged:  # the graph's reply stores into the peers' windows; the link's copies are host calls
            raise ConfigError(f"GraphFFNServer replies by direct stores only, but Attention rank(s) "
                              f"{staged} are reached by host-initiated copies (transport="
                              f"{connector.config.transport!r}); use FFNWorker")
        if connector.path.host_polling is not None:
            raise ConfigError("GraphFFNServer needs poll_mode='device' (the wait is in the graph)")
        if identity == (experts is not None):
            raise ConfigError("pass exactly one of experts= or identity=True")

    @staticmethod
    def _check_settings(depth, idle_timeout_s, gemm_sm_carveout, device=None) -> int:
        """The server's own knobs (ConfigError with the values); returns ``gemm_sm_carveout``
        (checked against ``device``'s SM count when it is a CUDA device)."""
        if depth < 1 or not idle_timeout_s > 0:
            raise ConfigError(f"depth must be >= 1 and idle_timeout_s > 0, got {depth}, {idle_timeout_s}")
        return moe.resolve_gemm_sm_carveout(gemm_sm_carveout, device=device,
                                            name="GraphFFNServer.gemm_sm_carveout")

    def _stack_weights(self, experts, shared) -> None:
        """Stacked copies of every layer's weights; the eager worker gets views of them."""
        num_layers, epr = self.num_layers, self.layout.expert_per_rank
        routed = per_layer(experts, num_layers)
        fused = per_layer(shared, num_layers)
        first = routed[0]
        if first.dtype != torch.bfloat16 or any(w.has_bias for w in routed + [s for s in fused if s]):
            raise ConfigError("the graph FFN's GEMM mode needs bf16 experts without biases")
        if any(s is not None and s.gate is not None for s in fused):
            raise ConfigError("the graph FFN does not run a shared-expert gate yet")
        self.w13 = torch.cat([w.w13 for w in routed]).contiguous()
        self.w2 = torch.cat([w.w2 for w in routed]).contiguous()
        views = [dataclasses.replace(w, w13=self.w13[l * epr:(l + 1) * epr], w2=self.w2[l * epr:(l + 1) * epr])
                 for l, w in enumerate(routed)]
        self.activation = first
        self.shared_w13 = self.shared_w2 = None
        shared_views = fused
        if fused[0] is not None:
            self.shared_w13 = torch.cat([s.w13 for s in fused]).contiguous()
            self.shared_w2 = torch.cat([s.w2 for s in fused]).contiguous()
            shared_views = [dataclasses.replace(s, w13=self.shared_w13[l:l + 1], w2=self.shared_w2[l:l + 1])
                            for l, s in enumerate(fused)]
            self.shared_activation = fused[0]
        self.eager_worker = FFNWorker(self.connector, views, shared_views,
                                      gemm_sm_carveout=self.gemm_sm_carveout)
        if not moe.grouped_mm_supported(torch.empty(8, first.hidden_size, dtype=torch.bfloat16,
                                                    device=self.device), views[0]):
            raise ConfigError("the graph FFN's GEMM mode needs torch._grouped_mm (SM90/SM100, "
                              "bf16, 16-byte aligned operands)")

    def _alloc_device_state(self) -> None:
        cp, layout, path = self.path.cp, self.layout, self.path
        hw = layout.header_words
        self.doorbell = cp.zeros(wire.DB_HEADER + -(-hw // 2), cp.int64)  # device, not pinned
        self.state = cp.zeros(ffn_graph.state_words(hw), cp.int64)
        self.reply_seqs = cp.zeros(layout.num_slots, cp.int64)
        self.replay_counter = cp.zeros(1, cp.int64)
        self.num_records = 2 * self.depth
        self.record_words = ffn_graph.record_words(hw, dedup=self.is_dedup)
        self.records = kernels.PinnedInt64(self.num_records * self.record_words)
        self.routed_offs = cp.zeros(self.num_layers * layout.expert_per_rank, cp.int32)
        has_shared = self.connector.model.num_shared_experts > 0 and not self.identity
        self.shared_offs = cp.zeros(self.num_layers, cp.int32) if has_shared else None
        ctx = path.ctx
        num_attn = ctx.topology.num_attn_ranks
        self.peer_windows = cp.asarray(
            [path.window.peer_ptr(ctx.peer_pe(Role.ATTENTION, i)) if i < num_attn else 0
             for i in range(layout.num_regions)], dtype=cp.uint64)
        self.reply_done = cp.zeros(1, cp.uint32)
        if self.is_dedup:  # afd_graph_dedup_expand: the checked route-table copy and its scratch
            # NOTE: one copy for every bucket: replays run one after another on self.stream
            self.route_copy = cp.zeros((max(1, layout.token_cap), layout.route_width), cp.int32)
            self.expand_claims = cp.full(max(1, layout.routed_cap), UNCLAIMED, cp.int32)
            self.expand_fault = cp.full(1, np.iinfo(np.uint64).max, cp.uint64)
            self.expand_claimed = cp.zeros(1, cp.uint32)
            self.expand_done = cp.zeros(1, cp.uint32)
        # torch views made here, not inside a capture (__cuda_array_interface__ carries a stream)
        self.routed_offs_t = self._as_torch(self.routed_offs)
        self.shared_offs_t = None if self.shared_offs is None else self._as_torch(self.shared_offs)
        self.wait_launch = kernels.PackedLaunch(kernels.wait_any_spec(
            window=path.own_window, geo=path.geometry, last_seen=path.last_seen,
            scan_start=path.scan_start, counts_snapshot=path.counts_snapshot,
            timeout_ns=int(self.idle_timeout_s * 1e9), doorbell=self.doorbell.data.ptr, ticket=0))
        cp.cuda.Device(path.device_id).synchronize()

    def _as_torch(self, array) -> torch.Tensor:
        return torch.as_tensor(array, device=self.device)

    # --- capture ----------------------------------------------------------------------------
    def _capture(self, bucket: ffn_graph.Bucket) -> torch.cuda.CUDAGraph:
        """Capture one bucket's graph. Every kernel goes to the capture stream (torch's current
        stream inside ``torch.cuda.graph``); buffers are allocated before, torch's own in the
        graph's pool; nothing synchronizes inside."""
        path, layout = self.path, self.layout
        hidden, dtype = layout.hidden_size, self.connector.torch_dtype
        stage_args = dict(
            geo=path.geometry,
            expert_per_rank=layout.expert_per_rank, is_dedup=int(self.is_dedup), src_rank=path.ctx.role_rank,
            num_attn_ranks=path.ctx.topology.num_attn_ranks, token_cap=layout.token_cap,
            routed_cap=layout.routed_cap, shared_cap=layout.shared_cap,
            routed_bucket=bucket.routed_rows, shared_bucket=bucket.shared_rows,
            num_layers=self.num_layers, layers_per_chunk=self.lpc, routed_offs=self.routed_offs,
            shared_offs=0 if self.shared_offs is None else self.shared_offs.data.ptr,
            reply_seqs=self.reply_seqs, state=self.state, replay_counter=self.replay_counter,
            records=self.records.ptr, num_records=self.num_records, record_words=self.record_words)
        if self.fused_wait_stage:  # one kernel: the wait and the stage
            first = [kernels.PackedLaunch(specs.graph_wait_stage_spec(
                window=path.own_window, last_seen=path.last_seen, scan_start=path.scan_start,
                counts_snapshot=path.counts_snapshot, timeout_ns=int(self.idle_timeout_s * 1e9),
                **stage_args))]
        else:
            first = [self.wait_launch, kernels.PackedLaunch(specs.graph_stage_spec(
                doorbell=self.doorbell.data.ptr, **stage_args))]
        num_chunks = self.num_chunks
        routed_outs = path.cp.zeros(num_chunks, path.cp.uint64)
        keep = {"routed_outs": routed_outs}
        if not self.identity:
            keep["x"] = torch.empty(max(1, bucket.routed_rows), hidden, dtype=dtype, device=self.device)
            keep["xs"] = (torch.empty(max(1, bucket.shared_rows), hidden, dtype=dtype, device=self.device)
                          if self.shared_offs is not None else None)
        staging = 0 if self.identity else keep["x"].data_ptr()
        shared_staging = 0 if self.identity or keep["xs"] is None else keep["xs"].data_ptr()
        if self.is_dedup:
            gather, reply = self._dedup_launches(bucket, routed_outs, staging, shared_staging)
        else:
            reply = kernels.PackedLaunch(specs.graph_reply_spec(
                dtype_code=path.dtype_code, own_window=path.own_window, peer_windows=self.peer_windows,
                geo=path.geometry, src_rank=path.ctx.role_rank, state=self.state, routed_outs=routed_outs,
                shared_out=0, hidden_size=hidden, done_counter=self.reply_done,
                routed_bucket=bucket.routed_rows, shared_bucket=bucket.shared_rows, num_chunks=num_chunks))
            gather = None if self.identity else kernels.PackedLaunch(specs.graph_gather_spec(
                dtype_code=path.dtype_code, window=path.own_window, geo=path.geometry,
                state=self.state, hidden_size=hidden, routed_staging=staging,
                shared_staging=shared_staging, routed_bucket=bucket.routed_rows,
                shared_bucket=bucket.shared_rows))
        if not self.identity:
            side = torch.cuda.Stream(self.device)
            # warm-up: offsets are all 0, no GEMM work (with the capture's carve-out: the same
            # workspace sizes and kernels as the capture's)
            with torch.cuda.stream(side), moe.sm_carveout(self.gemm_sm_carveout):
                self._expert_ops(keep["x"], keep["xs"])
            side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            stream_ptr = torch.cuda.current_stream(self.device).cuda_stream
            for launch in first:  # wait + stage (one kernel or two)
                launch.launch(stream_ptr)
            if gather is not None:  # dedup: the expand runs with identity experts too (its check)
                gather.launch(stream_ptr)
            if not self.identity:
                # the GEMMs' grids (SMs - carve-out CTAs) are read at launch: frozen in the graph
                with moe.sm_carveout(self.gemm_sm_carveout):
                    keep["outs"], keep["shared_out"] = self._expert_ops(keep["x"], keep["xs"])
                if keep["shared_out"] is not None:
                    reply.set("shared_out", keep["shared_out"].data_ptr())
            reply.launch(stream_ptr)
        if not self.identity:  # the chunk outputs' addresses are fixed now: the reply reads them
            routed_outs.set(np.array([out.data_ptr() for out in keep["outs"]], np.uint64))
        path.cp.cuda.Device(path.device_id).synchronize()
        self._graph_buffers.append(keep)  # the graph's buffers live as long as the server
        return graph

    def _dedup_launches(self, bucket: ffn_graph.Bucket, routed_outs, staging: int,
                        shared_staging: int):
        """(expand, reply) of one bucket's graph in the dedup wire mode, packed once."""
        path, layout = self.path, self.layout
        rows = bucket.rows or layout.token_cap
        expand = kernels.PackedLaunch(specs.graph_dedup_expand_spec(
            dtype_code=path.dtype_code, window=path.own_window, geo=path.geometry, state=self.state,
            top_k=layout.top_k, hidden_size=layout.hidden_size, routed_staging=staging,
            shared_staging=shared_staging, route_copy=self.route_copy, claims=self.expand_claims,
            fault=self.expand_fault, num_claimed=self.expand_claimed, reply_seqs=self.reply_seqs,
            done_counter=self.expand_done, token_cap=layout.token_cap,
            routed_cap=layout.routed_cap, rows_bucket=rows))
        reply = kernels.PackedLaunch(specs.graph_dedup_reply_spec(
            dtype_code=path.dtype_code, own_window=path.own_window, peer_windows=self.peer_windows,
            geo=path.geometry, src_rank=path.ctx.role_rank, state=self.state,
            route_copy=self.route_copy, top_k=layout.top_k, routed_outs=routed_outs, shared_out=0,
            hidden_size=layout.hidden_size, done_counter=self.reply_done,
            token_cap=layout.token_cap, rows_bucket=rows, num_chunks=self.num_chunks))
        return expand, reply

    def _expert_ops(self, x: torch.Tensor, xs: torch.Tensor | None):
        """The expert math over the staging rows, capturable: per layer chunk two grouped GEMMs
        (offsets from the device), the activation and the routed scaling; the shared experts
        the same over one group per layer. Rows past the served item's are never read."""
        epr, lpc = self.layout.expert_per_rank, self.lpc
        offs_all = self.routed_offs_t
        outs = []
        for chunk in range(self.num_chunks):
            groups = slice(chunk * lpc * epr, min(self.num_layers, (chunk + 1) * lpc) * epr)
            out = _gated_mlp(x, self.w13[groups], self.w2[groups], offs_all[groups], self.activation)
            factor = self.connector.model.routed_scaling_factor
            outs.append(out if factor == 1.0 else out * factor)  # bf16: routed x f (moe rule)
        shared_out = None
        if xs is not None:
            shared_out = _gated_mlp(xs, self.shared_w13, self.shared_w2,
                                    self.shared_offs_t, self.shared_activation)
        return outs, shared_out

    # --- the host loop ----------------------------------------------------------------------
    def run(self, stop_event=None) -> int:
        """Serve until every Attention rank announced shutdown (a normal exit) or
        ``stop_event`` is set; then wait for the queued replays (at most ``depth`` in-graph
        timeouts) and give the reply seqs back to the eager path. Returns items served.

        Raises what the eager receive raises (WireError, ProtocolError, PeerLostError) and
        PeerTimeoutError when a replay does not complete within its bound; the queued replays
        then stay queued and :meth:`close` (or the next :meth:`run`) collects them."""
        self.start()
        try:
            while stop_event is None or not stop_event.is_set():
                self.step()
        except ConnectorShutdown:
            logger.info("afd_cupy ffn rank %d: shutdown after %d items (%d eager) in %d graph replays",
                        self.connector.role_rank, self.num_served, self.num_eager, self.num_replays)
        self.close()
        return self.num_served

    def start(self) -> None:
        """Take the reply seqs over from the eager path and queue ``depth`` replays."""
        if self._started:
            return
        path = self.path
        path.cp.cuda.Device(path.device_id).use()  # this server's GPU, whichever thread runs it
        torch.cuda.synchronize(self.device)  # eager replies queued before read their seqs
        self.reply_seqs.set(self.connector.reply_seq_counters().astype(np.int64))
        path.cp.cuda.Device(path.device_id).synchronize()
        self._started = True
        while len(self._inflight) < self.depth:
            self._launch_replay()

    def step(self) -> int:
        """Collect the oldest replay, act on its record, queue a successor (in the bucket the
        record may have moved the policy to; none when the record raised). Items served."""
        record = self._collect_oldest()
        served = self._handle(record, raising=True)
        self._launch_replay()
        return served

    def close(self) -> None:
        """Collect every queued replay (serving eager items, logging errors), then hand the
        reply seqs back to the eager path. Idempotent; not collective."""
        if not self._started:
            return
        try:
            while self._inflight:
                record = self._collect_oldest()
                try:
                    self._handle(record, raising=False)
                except ConnectorShutdown:
                    pass
        finally:
            self.connector.set_reply_seq_counters(self.reply_seqs.get())  # synchronizes the copy
            self._started = False

    def __enter__(self) -> "GraphFFNServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _launch_replay(self) -> None:
        event = self._events.popleft()
        with torch.cuda.stream(self.stream):
            self.graphs[self.policy.current].replay()
            event.record(self.stream)
        self._inflight.append((self._next_replay, event))
        self._next_replay += 1

    def _collect_oldest(self) -> np.ndarray:
        """Wait (bounded, sleeping while idle) for the oldest replay; return a copy of its record."""
        replay, event = self._inflight[0]
        deadline = time.monotonic() + self.idle_timeout_s + _HOST_GRACE_S
        while not event.query():
            if time.monotonic() > deadline:
                raise PeerTimeoutError(f"graph replay {replay} did not complete within "
                                       f"{self.idle_timeout_s + _HOST_GRACE_S:.3f} s")
            time.sleep(self._idle_sleep_s)
        self._inflight.popleft()
        self._events.append(event)
        self.num_replays += 1
        start = (replay % self.num_records) * self.record_words
        record = self.records.array[start:start + self.record_words].copy()
        if record[ffn_graph.REC_REPLAY] != replay:
            raise ProtocolError(f"graph replay {replay} left no record (found replay "
                                f"{record[ffn_graph.REC_REPLAY]}): was the connector received on "
                                "by someone else while the server ran?")
        return record

    def _handle(self, record: np.ndarray, *, raising: bool) -> int:
        status = int(record[ffn_graph.REC_STATUS])
        words = record[ffn_graph.REC_HEADER:].view(np.int32)[:self.layout.header_words]
        if status == ffn_graph.GS_IDLE:
            self._idle_sleep_s = min(2 * self._idle_sleep_s or 5e-5, _MAX_IDLE_SLEEP_S)
            now = time.monotonic()
            if raising and now - self._last_liveness > _LIVENESS_PERIOD_S:
                self._last_liveness = now
                self.connector.check_attention_alive()  # PeerLostError once no sender is left
            return 0
        self._idle_sleep_s = 0.0  # busy: poll without sleeping
        if status == ffn_graph.GS_SHUTDOWN:
            self.connector.note_shutdown(int(words[wire.HDR_SRC_RANK]))  # may raise ConnectorShutdown
            return 0
        if status in (ffn_graph.GS_SERVED, ffn_graph.GS_EAGER):
            self.policy.observe(int(words[wire.HDR_ROUTED_TOKENS]), int(words[wire.HDR_SHARED_TOKENS]))
        if status == ffn_graph.GS_SERVED:
            self.num_served += 1
            return 1
        try:
            if status == ffn_graph.GS_BAD_ROUTE:  # dedup: the eager path's WireError, same words
                raise ffn_graph.route_verdict(record, self.layout)
            if status == ffn_graph.GS_EAGER:
                self._serve_eager(words, int(record[ffn_graph.REC_SLOT]), int(record[ffn_graph.REC_SEQ]))
                return 1
            self._raise_rejected(words, int(record[ffn_graph.REC_SLOT]), int(record[ffn_graph.REC_DETAIL]))
        except Exception as exc:
            if raising:
                raise
            logger.warning("afd_cupy ffn rank %d: graph replay record dropped while closing: %s",
                           self.connector.role_rank, exc)
        return 0

    def _arrival(self, words: np.ndarray, slot: int) -> Arrival:
        layout = self.layout
        header = wire.decode_header(words.copy(), layout.expert_per_rank, layout)  # WireError
        region, ring = divmod(slot, layout.ring_depth)
        return Arrival(region, ring, header)

    def _serve_eager(self, words: np.ndarray, slot: int, seq: int) -> None:
        """An item the graph did not serve: the eager worker on the second stream, replying
        with the seq the stage reserved (the eager path's host counter is set to seq - 1)."""
        arrival = self._arrival(words, slot)
        self.connector.set_reply_seq_counters(seq - 1, slot=slot)
        item = self.connector.accept_arrival(arrival)  # ProtocolError for a wrong source rank
        with torch.cuda.stream(self.eager_stream):
            self.eager_worker.serve(item)
        self.num_eager += 1
        self.num_served += 1

    def _raise_rejected(self, words: np.ndarray, slot: int, detail: int) -> None:
        arrival = self._arrival(words, slot)  # raises the eager path's WireError
        header = arrival.header
        if header.src_rank != arrival.region:
            raise ProtocolError(f"message in region {arrival.region} claims source rank {header.src_rank}")
        raise ProtocolError(f"graph stage rejected a header the host accepts (header word {detail}): "
                            f"{header}")


def _gated_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
               weights: moe.ExpertWeights) -> torch.Tensor:
    """Two grouped GEMMs and the gated activation (``weights``' options), as
    ``moe._grouped_mlp_fused`` without biases. NOTE: output rows past ``offs[-1]`` are left
    unwritten by torch._grouped_mm (no GEMM work for them); nobody reads them."""
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
    hidden = moe.act_and_mul(gate_up, x.dtype, weights)
    return torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offs)
