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
in the record, or skips the item with a warning when the slot's flag moved on while the table
was read (its sender timed out and re-sent there), as the eager path does.

The host keeps ``depth`` replays queued on one stream and, per completed replay (an event,
polled with sleeps while idle), reads one record from a pinned ring: IDLE (the wait timed out:
liveness check, replay again), SERVED, SHUTDOWN (counted like the eager receive), EAGER (a
valid item too large for the bucket or outside the stacked layers: served by an
:class:`~afd_cupy.ffn.worker.FFNWorker` on a second stream with the reply seq the device
reserved) or REJECTED (the header fails a check: decoded on the host, which raises the eager
path's WireError / ProtocolError).
"""
from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import torch

from afd_cupy import moe, wire
from afd_cupy.backends.base import Arrival, superseded
from afd_cupy.backends.cuda_ffn_graph_capture import EXPERT_GEMMS, GraphCapture, stack_weights
from afd_cupy.errors import (ConfigError, ConnectorShutdown, PeerLostError, PeerTimeoutError,
                             ProtocolError)
from afd_cupy.ffn import graph as ffn_graph
from afd_cupy.ffn.worker import FFNWorker
from afd_cupy.moe import stream_gemm
from afd_cupy.runtime.topology import Role
from afd_cupy.testing.reference import identity_experts

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
    (:func:`afd_cupy.ffn.graph.buckets_for_tokens`). ``depth``: replays kept queued.
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
    ``expert_gemm``: the graphs' expert GEMMs, ``"grouped_mm"`` (the default: torch's grouped
    GEMMs) or ``"stream"`` (``moe.stream_gemm``'s Triton kernels, a candidate measured against
    it: decision 0032; ConfigError where Triton cannot run them). The eager fallback keeps
    ``moe.grouped_mlp``.

    Both wire modes (dedup: the route table is checked in the graph; a rejected table raises
    the eager path's WireError from :meth:`run` / :meth:`step`). FP8 dispatch rows
    (``dispatch_dtype="fp8_e4m3"``, pair mode): the graph's gather decodes them into the
    GEMMs' staging rows (with identity experts too, whose reply then answers with the decoded
    rows); ``FFNWorker``'s automatic serving keeps its loop for them (docs/design/fp8.md).

    ``record_log``: None (the default), or a list that gets a copy of every collected replay's
    record (int64 [record_words], ``afd_cupy.ffn.graph.REC_*``; idle replays too), in replay
    order: instrumentation for benchmarks (what each replay did, which sender and layer it
    served); one list append per replay.

    Limits (ConfigError): ``poll_mode="device"``, the async schedule, every Attention peer
    reached by direct stores (no put transport: the reply is a kernel's stores); GEMM
    mode needs bf16 (FP8 routed experts with ``expert_gemm="stream"``), SM90/SM100, no
    expert biases and no shared-expert gate. Not thread-safe;
    while it runs, nothing else may receive on the connector. Not collective.
    """

    def __init__(self, connector, experts=None, shared=None, *, identity: bool = False,
                 bucket_tokens=(128,), depth: int = 4, idle_timeout_s: float = 0.01,
                 fused_wait_stage: bool = True, gemm_sm_carveout: int | str = "auto",
                 expert_gemm: str = "grouped_mm"):
        self._check_connector(connector, identity, experts)
        device = connector.device
        self.gemm_sm_carveout = self._check_settings(depth, idle_timeout_s, gemm_sm_carveout, device)
        self.expert_gemm = self._check_expert_gemm(expert_gemm, device)
        self.connector, self.layout, self.device = connector, connector.layout, device
        self.depth, self.idle_timeout_s = depth, float(idle_timeout_s)
        self.identity = bool(identity)  # ffn.serving.open_graph_server reuses a server by it
        layout, model = self.layout, connector.model
        weights = None
        if identity:
            self.buckets = (ffn_graph.identity_bucket(layout),)
            self.eager_worker = FFNWorker(connector, expert_fn=identity_experts,
                                          gemm_sm_carveout=self.gemm_sm_carveout)
        else:
            self.buckets = ffn_graph.buckets_for_tokens(
                bucket_tokens, layout, top_k=model.top_k, num_ffn_ranks=connector.topology.num_ffn_ranks)
            weights, views, shared_views = stack_weights(experts, shared, model.num_layers,
                                                         layout.expert_per_rank, device, self.expert_gemm)
            # the eager fallback's per-layer weights are views of the stacked ones
            self.eager_worker = FFNWorker(connector, views, shared_views,
                                          gemm_sm_carveout=self.gemm_sm_carveout)
        self.policy = ffn_graph.BucketPolicy(self.buckets)
        self.num_served = 0  # items answered (graph and eager)
        self.num_eager = 0   # of which on the eager path
        self.num_replays = 0
        resources = connector.path.graph_resources()  # the path's public hand-over
        self.device_id = resources.device_id
        self.kernels = GraphCapture(
            resources, layout=layout, model=model, torch_dtype=connector.torch_dtype, device=device,
            depth=depth, idle_timeout_s=self.idle_timeout_s, fused_wait_stage=bool(fused_wait_stage),
            identity=identity, gemm_sm_carveout=self.gemm_sm_carveout, weights=weights,
            expert_gemm=self.expert_gemm)
        self.reply_seqs = self.kernels.reply_seqs  # cupy int64 [num_slots], while the server runs
        self.records, self.num_records = self.kernels.records, self.kernels.num_records
        self.record_words = self.kernels.record_words
        self.stream = torch.cuda.Stream(device)
        self.eager_stream = torch.cuda.Stream(device)
        self._events = deque(torch.cuda.Event() for _ in range(depth))
        self._inflight: deque = deque()  # (replay number, event), oldest first
        self._next_replay = 0
        self._started = False
        self._idle_sleep_s = 0.0
        self._last_liveness = 0.0
        self.record_log: list | None = None
        self.graphs = [self.kernels.capture(bucket) for bucket in self.buckets]

    # --- set-up ---------------------------------------------------------------------------
    @staticmethod
    def _check_connector(connector, identity: bool, experts) -> None:
        """ConfigError unless the connector's declared capabilities let a graph drive it."""
        caps = connector.capabilities
        if connector.role is not Role.FFN or not caps.supports_nonblocking:
            raise ConfigError(f"GraphFFNServer needs an FFN-side cuda connector, got "
                              f"{connector.role.value} / {caps.backend}")
        if caps.put_peers:  # the graph's reply stores into the peers' windows; the link's copies are host calls
            raise ConfigError(f"GraphFFNServer replies by direct stores only, but Attention rank(s) "
                              f"{list(caps.put_peers)} are reached by host-initiated copies (transport="
                              f"{connector.config.transport!r}); use FFNWorker")
        if not caps.device_polling:
            raise ConfigError("GraphFFNServer needs poll_mode='device' (the wait is in the graph)")
        if not caps.supports_graph_server:
            raise ConfigError(f"GraphFFNServer cannot drive this connector's data path ({caps})")
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

    @staticmethod
    def _check_expert_gemm(expert_gemm, device) -> str:
        """``expert_gemm`` checked (ConfigError naming the value, or why "stream" cannot run)."""
        if expert_gemm not in EXPERT_GEMMS:
            raise ConfigError(f"GraphFFNServer.expert_gemm must be one of {EXPERT_GEMMS}, got {expert_gemm!r}")
        if expert_gemm == "stream":
            reason = stream_gemm.unavailable_reason(device)
            if reason is not None:
                raise ConfigError(f"GraphFFNServer(expert_gemm='stream') cannot run on {device}: {reason}")
        return expert_gemm

    # --- the host loop ----------------------------------------------------------------------
    def run(self, stop_event=None) -> int:
        """Serve until every Attention rank announced shutdown (a normal exit) or
        ``stop_event`` is set; then wait for the queued replays (at most ``depth`` in-graph
        timeouts) and give the reply seqs back to the eager path. Returns items served.

        Raises what the eager receive raises (WireError, ProtocolError, PeerLostError) and
        PeerTimeoutError when a replay does not complete within its bound; the queued replays
        then stay queued and :meth:`close` (or the next :meth:`run`) collects them. Before an
        exception other than PeerLostError leaves, the failure is announced to the Attention
        ranks (``AFDConnector.announce_failure``)."""
        try:
            self.start()
            while stop_event is None or not stop_event.is_set():
                self.step()
        except ConnectorShutdown:
            logger.info("afd_cupy ffn rank %d: shutdown after %d items (%d eager) in %d graph replays",
                        self.connector.role_rank, self.num_served, self.num_eager, self.num_replays)
        except Exception as exc:
            self._announce_failure(exc)
            raise
        self.close()
        return self.num_served

    def _announce_failure(self, exc: Exception) -> None:
        """Tell the Attention ranks that this server failed (``AFDConnector.announce_failure``,
        as ``FFNWorker.run`` does): they raise PeerFailedError naming this rank and ``exc``
        instead of timing out. Not for a lost peer (nobody is left to tell)."""
        if isinstance(exc, PeerLostError):
            return
        try:
            self.connector.announce_failure(exc)
        except Exception as announce_exc:  # the server's own error matters more
            logger.warning("afd_cupy ffn rank %d: could not announce the failure %r: %s",
                           self.connector.role_rank, exc, announce_exc)

    def start(self) -> None:
        """Take the reply seqs over from the eager path and queue ``depth`` replays."""
        if self._started:
            return
        cp = self.kernels.res.cp
        cp.cuda.Device(self.device_id).use()  # this server's GPU, whichever thread runs it
        # an arrival an interrupted host wait took but did not return is served eagerly first:
        # the graph's waits see only what comes after it
        while self.connector.path.has_unclaimed_wait:
            item = self.connector.recv_ffn_work_item(int(self.idle_timeout_s * 1000) + 1)
            if item is not None:
                self.eager_worker.serve(item)
                self.num_served, self.num_eager = self.num_served + 1, self.num_eager + 1
        torch.cuda.synchronize(self.device)  # eager replies queued before read their seqs
        self.reply_seqs.set(self.connector.reply_seq_counters().astype(np.int64))
        cp.cuda.Device(self.device_id).synchronize()
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
        if self.record_log is not None:
            self.record_log.append(record)
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
                self._reject_route(words, int(record[ffn_graph.REC_SLOT]), ffn_graph.route_verdict(record, self.layout))
                return 0
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

    def _reject_route(self, words: np.ndarray, slot: int, error: Exception) -> None:
        """A route table the graph's expand rejected: skipped with a warning when the slot was
        rewritten while it was read (its sender timed out and re-sent there; the newer message
        is the slot's next arrival), else ``error`` (the eager path's WireError) is raised."""
        arrival = self._arrival(words, slot)
        moved_on = superseded(arrival, self.connector.path.slot_flag(arrival.region, arrival.ring), error)
        if moved_on is None:
            raise error
        logger.warning("afd_cupy ffn rank %d: not served: %s", self.connector.role_rank, moved_on)

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
        with torch.cuda.stream(self.eager_stream):  # the item's views may launch (FP8 rows' decode)
            item = self.connector.accept_arrival(arrival)  # ProtocolError for a wrong source rank
            self.eager_worker.serve(item)
        self.num_eager += 1
        self.num_served += 1

    def _raise_rejected(self, words: np.ndarray, slot: int, detail: int) -> None:
        arrival = self._arrival(words, slot)  # raises the eager path's WireError
        header = arrival.header
        wire.check_dispatch_rows(header, self.layout)  # FP8 rows to a payload rank, or the reverse
        if header.src_rank != arrival.region:
            raise ProtocolError(f"message in region {arrival.region} claims source rank {header.src_rank}")
        raise ProtocolError(f"graph stage rejected a header the host accepts (header word {detail}): "
                            f"{header}")
