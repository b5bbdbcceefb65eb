#!/usr/bin/env python3
"""Transport benchmark of the AFD connector: decode-size round trip and prefill-size bandwidth.

1 Attention rank + F FFN ranks as processes (``afd_cupy.runtime.launch``); the FFN ranks run
``FFNWorker(conn, expert_fn=identity)`` (they reply the rows they received, unchanged), so
only the transport is measured. One launch per (hidden, top-k, F); every token count of that
shape runs inside it.

(a) decode round trip (Attention side): host wall time from ``send_attn_output`` until
    ``recv_ffn_output(blocking=True)`` returns (dispatch + FFN detect/identity/reply + wait
    + combine), median and p99 over the iterations after warm-up; and the pipelined variant:
    N layers of send + ``recv_ffn_output(blocking=False)``, one synchronization at the end,
    wall time / N. Same-run RFC baseline: the in-process torch-ops equivalent of the reference
    connector (see (b), baseline 2; no second process) on the same inputs and device, host wall
    time of its dispatch + combine per round trip, its own host syncs (``.cpu()`` counts,
    ``.item()`` flag polling) included, the device synchronized at the end (its output is ready,
    as after the blocking recv); same iteration and warm-up counts; ``speedup_vs_rfc`` =
    RFC median / connector median.
(b) prefill bandwidth (Attention side, device time via CUDA events on the connector's stream):
    - dispatch: from before ``send_attn_output`` to the completion of its kernels (rows,
      route tables, shared rows, headers and flags written into the F peer windows);
    - combine: the host first waits (by reading the flags) until every FFN reply has landed,
      then only ``recv_ffn_output`` is timed: the wait finds the flags set, so this is the
      fp32 weighted gather of the reply rows out of the own window;
    - round trip: send + recv back to back, FFN identity reply included;
    - bytes = routed rows (tokens * top_k * hidden * 2) + shared rows (tokens * hidden * 2);
    - baseline 1: ``copy_`` of a buffer of the same bytes on the same device;
    - baseline 2 (RFC path): an in-process torch-ops equivalent of the reference connector's
      steps on the same bytes: stable argsort of the flat topk_ids, bincount, counts to the
      host (``.cpu()``), per-peer ``index_select`` + ``copy_`` into F window-sized buffers,
      header H2D copy and flag write; combine = host polling of the F flags (``.item()``),
      cat of the reply rows and an fp32 ``index_add_`` of the weighted rows + shared rows.
    - baseline 3 (``--nccl-baseline``, cuda with one GPU per process): ``all_to_all_single``
      over torch NCCL between the same processes, same bytes: dispatch = the Attention rank
      sends each FFN rank its routed + shared rows, combine = each FFN rank sends them back;
      run after the connector's part (the FFN ranks leave ``FFNWorker.run()`` first), CUDA
      events on the Attention rank around each call after a barrier.
(c) the shared DESIGN.md §10 targets next to the numbers, PASS/MISS (reported, never asserted).
(d) ``--wire-mode both``: pair and dedup (docs/design/dedup.md) side by side, one launch per
    mode and shape: bytes on the wire per direction (``dedup.wire_bytes``: rows, route tables,
    headers, flags) and times, with the issue #12 targets. Every row carries its ``wire_mode``
    and ``dispatch_wire_bytes`` / ``reply_wire_bytes`` and their time at the link's limit
    (``LINK_GBPS``); decode rows also the dispatch alone (``dispatch_us``: CUDA events around
    ``send_attn_output`` on cuda, wall time on host).

(e) ``--transport both`` (cuda): direct stores and the put transport (docs/design/put-transport.md,
    every peer by NVSHMEM puts, on one node) side by side in the same run, with issue #16's
    targets: put within 1.3x of direct for prefill (dispatch + combine), within 20 us of it for
    the 128-token decode round trip. Every row carries its ``transport``.
(f) floors (cuda): each kernel time (decode ``dispatch_us``; prefill ``dispatch_ms``,
    ``combine_ms``) beside its floor, one CUDA graph node + the bytes the kernel reads and
    writes (``bench_common.kernel_bytes``, from the layout) at the rate of a large device copy,
    both measured at the start of the launch; ``*_floor_us`` / ``*_floor_ms`` and
    ``*_x_floor`` = time / floor in every row, ``floor_terms`` per launch in the report.

``--ffn-serving auto|graph|loop``: how the FFN ranks serve (``FFNWorker(serving=...)``; auto,
the library's default, is the graph FFN on cuda where it applies); in the JSON report.

On the host backend everything is numpy/shared memory at a tiny size: the numbers measure the
host protocol (and are labelled so), not a GPU transport; times are wall times.

    python3 tools/bench_transport.py --quick --out OUT     # GPU (< 4 min on one H200, MPS)
    python3 tools/bench_transport.py --quick --backend host
    python3 tools/bench_transport.py --quick --wire-mode both --ffn 1 2   # wire modes side by side
    python3 tools/bench_transport.py --quick --transport both --out OUT   # transports side by side
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.routing import dedup  # noqa: E402
from afd_cupy.routing.planner import shared_count  # noqa: E402
from afd_cupy.runtime.launch import Placement, launch  # noqa: E402
from afd_cupy.runtime.placement import detect_num_gpus  # noqa: E402
from afd_cupy.runtime.store import store_fetch, store_publish  # noqa: E402
from afd_cupy.wire import window_size_hint  # noqa: E402

#: DeepSeek-like expert counts per top-k (V2/V2-Lite: 64 experts top-6, V3: 256 top-8)
EXPERTS_FOR_TOPK = {6: 64, 8: 256}
IDENTITY_CHECK_TOL = 2e-2  # out must equal 2 * hidden (sum of renormalized weights + shared)
LINK_GBPS = 450.0  # one H200 NVLink pair, one direction (issue #12): bytes / LINK_GBPS = the floor
WIRE_MODE_CHOICES = ("pair", "dedup", "both")
TRANSPORT_CHOICES = ("direct", "put", "both")
RFC_LABEL = ("in-process torch-ops equivalent of the reference (RFC) connector: stable argsort + "
             "bincount + counts .cpu() + per-peer index_select/copy_ (+ header H2D, flag write) "
             "into F window-sized buffers on the same device; combine = .item() polling of the F "
             "flags + cat + fp32 index_add_ of weighted rows and shared rows. Same bytes, no 2nd process.")
DECODE_RFC_NOTE = ("in-process torch-ops equivalent (RfcTorchPath, no second process): host wall time "
                   "of its dispatch + combine per round trip on the same inputs and device, its .cpu() "
                   "and .item() host syncs included, device synchronized at the end; same iters/warm-up")
NCCL_NOTE = ("torch.distributed.all_to_all_single over NCCL between the same processes (one GPU each), "
             "same rows per FFN rank as the connector's dispatch (routed + shared); dispatch = Attention -> "
             "FFN ranks, combine = FFN ranks -> Attention (the received rows echoed); CUDA events on the "
             "Attention rank around each call after a barrier; same iters/warm-up as the prefill")
NCCL_ROWS_KEY = "bench_transport/nccl_rows"
HOST_LABEL = ("HOST BACKEND at a tiny size: measures the host protocol (POSIX shm + numpy/numba, "
              "wall times), not a GPU transport")


@dataclasses.dataclass(frozen=True)
class Group:
    """One launch: a (hidden, top-k, F) shape and the token counts measured with it."""

    backend: str
    poll_mode: str
    hidden: int
    top_k: int
    num_ffn: int
    decode_tokens: tuple
    prefill_tokens: tuple
    iters: int
    warmup: int
    pipeline_layers: int
    prefill_iters: int
    prefill_warmup: int
    peer_timeout_s: float = 60.0
    nccl_baseline: bool = False
    wire_mode: str = "pair"
    transport: str = "direct"
    ffn_serving: str = "auto"  # FFNWorker(serving=...): the graph FFN or the Python loop
    host_profile: int = 0  # > 0: cProfile that many blocking round trips per decode point

    @property
    def num_experts(self) -> int:
        return EXPERTS_FOR_TOPK.get(self.top_k, 32 * self.top_k)

    def model(self) -> ModelConfig:
        max_tokens = max(self.decode_tokens + self.prefill_tokens)
        return ModelConfig(hidden_size=self.hidden, num_experts=self.num_experts, top_k=self.top_k,
                           moe_intermediate_size=128, num_shared_experts=1, dtype="bfloat16",
                           max_num_batched_tokens=max_tokens, num_layers=1)

    def connector(self) -> ConnectorConfig:
        return ConnectorConfig(wire_mode=self.wire_mode, transport=self.transport)

    def describe(self) -> str:
        return (f"{self.wire_mode} {self.transport} hidden={self.hidden} top-{self.top_k} F={self.num_ffn} "
                f"decode={list(self.decode_tokens)} prefill={list(self.prefill_tokens)}")


# --------------------------------------------------------------------------- ranks

def _rank(ctx, group: Group) -> dict:
    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.testing.reference import identity_experts

    device = bc.set_device(group.backend, ctx)
    role, role_rank = ("attention", 0) if ctx.rank == 0 else ("ffn", ctx.rank - 1)
    conn = AFDConnector(group.model(), TopologyConfig(1, group.num_ffn), group.connector(),
                        role=role, role_rank=role_rank, store=ctx.store(), job_id=ctx.job_id,
                        backend=group.backend, device_id=ctx.device_id, poll_mode=group.poll_mode,
                        peer_timeout_s=group.peer_timeout_s)
    try:
        if role == "ffn":
            worker = FFNWorker(conn, expert_fn=identity_experts, serving=group.ffn_serving)
            worker.run()
            if group.nccl_baseline:  # after run(): the Attention rank announced shutdown
                _nccl_baseline(ctx, group, device)
            return {"role": "ffn", "served": worker.num_served}
        try:
            result = _attention(conn, group, device)
        finally:
            conn.announce_shutdown()
        if group.nccl_baseline:
            _nccl_baseline(ctx, group, device, result["prefill"])
        return result
    finally:
        conn.close()


def _attention(conn, group: Group, device) -> dict:
    watch = bc.Stopwatch(device)
    floor_terms = _floor_terms(device) if group.backend == "cuda" else None
    decode = [_decode_point(conn, group, tokens, device, watch) for tokens in group.decode_tokens]
    prefill = [_prefill_point(conn, group, tokens, device, watch) for tokens in group.prefill_tokens]
    if floor_terms is not None:
        for row in decode + prefill:
            add_floors(row, **floor_terms)
    if group.backend == "cuda":
        # last: a failed capture may leave the connector unusable (a dispatch left pending)
        for row in decode:
            row.update(_graph_decode(conn, group, row["tokens"], device, watch))
            if "graph_error" in row:
                break
    return {"role": "attention", "device": bc.device_name(device), "decode": decode, "prefill": prefill,
            "floor_terms": floor_terms}


def _floor_terms(device) -> dict:
    """The kernel floor's two terms on this GPU, now (the FFN ranks idle, as in the points)."""
    import device_trace  # cuda only: its stamp kernel is the graph node measured

    return {"node_us": device_trace.measure_node_us(device), "copy_gbps": bc.measure_copy_gbps(device)}


def add_floors(row: dict, *, node_us: float, copy_gbps: float) -> dict:
    """Each kernel time of a decode row (``dispatch_us``) or a prefill row (``dispatch_ms``,
    ``combine_ms``) beside its floor (``bench_common.floor_us`` of ``row["kernel_bytes"]``):
    ``<name>_floor_us`` / ``_floor_ms`` and ``<name>_x_floor`` = time / floor."""
    kernel_bytes = row["kernel_bytes"]
    if "dispatch_us" in row:
        times = {"dispatch": row["dispatch_us"]}
        unit, scale = "us", 1.0
    else:
        times = {"dispatch": row["dispatch_ms"], "combine": row["combine_ms"]}
        unit, scale = "ms", 1e-3
    for name, time_value in times.items():
        floor = bc.floor_us(kernel_bytes[name], node_us, copy_gbps) * scale
        row[f"{name}_floor_{unit}"] = floor
        row[f"{name}_x_floor"] = _ratio(time_value, floor)
    return row


def _inputs(conn, num_tokens: int, device, seed: int):
    """(hidden bf16 [T, H], topk_ids int32 [T, K], topk_weights fp32 [T, K]) on ``device``."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(num_tokens, conn.model.hidden_size, device=device, generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, conn.model.num_experts, device=device, generator=gen)
    weights, ids = conn.select_experts(logits)
    return hidden, ids, weights


def _check_identity(out, hidden, what: str) -> None:
    """Identity experts + one shared row per token: out = sum_k w_k x + x = 2x."""
    want = 2.0 * hidden.float()
    err = float((out.float() - want).norm()) / max(float(want.norm()), 1e-30)
    if not err <= IDENTITY_CHECK_TOL:  # NaN fails too
        raise RuntimeError(f"{what}: output is not 2*hidden (relative error {err:.3g}): "
                           "the transport corrupted or lost rows")


def _decode_point(conn, group: Group, num_tokens: int, device, watch) -> dict:
    hidden, ids, weights = _inputs(conn, num_tokens, device, seed=num_tokens)
    _check_identity(conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0)), hidden,
                    f"decode {num_tokens} tokens")
    times_us = _wall_times_us(group, lambda: conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0)))
    if group.host_profile > 0:
        _print_host_profile(group, num_tokens,
                            lambda: conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0)))
    per_layer_us = _pipelined(conn, group, hidden, ids, weights, watch)
    row = {"tokens": num_tokens, "hidden": group.hidden, "top_k": group.top_k, "num_ffn": group.num_ffn,
           "wire_mode": group.wire_mode, "transport": group.transport, **_wire_bytes(conn, ids),
           "dispatch_us": _decode_dispatch_us(conn, group, hidden, ids, weights, watch),
           "iters": len(times_us), "rt_median_us": bc.median(times_us),
           "rt_p99_us": bc.percentile(times_us, 99), "rt_min_us": min(times_us),
           "pipelined_us_per_layer": bc.median(per_layer_us),
           "pipelined_reps": len(per_layer_us), "pipelined_layers": group.pipeline_layers}
    row.update(_rfc_decode(conn, group, hidden, ids, weights, watch))
    row["speedup_vs_rfc"] = (row["rfc_rt_median_us"] / row["rt_median_us"] if row["rt_median_us"] > 0
                             else float("nan"))
    return row


def _wire_bytes(conn, ids) -> dict:
    """Bytes of one dispatch of ``ids`` and its replies in the connector's wire mode, their
    time at the link's limit (``LINK_GBPS``), and the bytes each kernel moves (read + written,
    ``bench_common.kernel_bytes``)."""
    host_ids = ids.cpu().numpy()
    shape = dict(num_ffn_ranks=conn.topology.num_ffn_ranks, has_shared=conn.model.num_shared_experts > 0)
    sizes = dedup.wire_bytes(conn.layout, host_ids, **shape)
    return {"dispatch_wire_bytes": sizes.dispatch, "reply_wire_bytes": sizes.reply,
            "dispatch_link_us": sizes.dispatch / (LINK_GBPS * 1e3),
            "reply_link_us": sizes.reply / (LINK_GBPS * 1e3),
            "kernel_bytes": bc.kernel_bytes(conn.layout, host_ids, **shape).as_dict()}


def _decode_dispatch_us(conn, group: Group, hidden, ids, weights, watch) -> float:
    """Median dispatch alone (µs): CUDA events around ``send_attn_output`` (its kernels), wall
    time on host; each followed by its receive, outside the timed span."""
    times_us = []
    for i in range(group.warmup + group.iters):
        start = watch.mark()
        handle = conn.send_attn_output(hidden, ids, weights, 0)
        elapsed_ms = watch.elapsed_ms(start, watch.mark())
        conn.recv_ffn_output(handle)
        if i >= group.warmup:
            times_us.append(elapsed_ms * 1e3)
    return bc.median(times_us)


def _print_host_profile(group: Group, num_tokens: int, round_trip) -> None:
    """Where the host time of ``group.host_profile`` blocking round trips goes: cProfile's 30
    most expensive functions by own time, printed (a diagnosis of the public API's host path;
    the profiler slows every Python call, so its times are relative, not the round trip's)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(group.host_profile):
        round_trip()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print(f"==== host profile: {group.host_profile} blocking round trips, {num_tokens} tokens, "
          f"{group.wire_mode} ====\n{text.getvalue()}", flush=True)


def _wall_times_us(group: Group, round_trip) -> list:
    """Host wall time (µs) of ``round_trip()`` per call, ``group.warmup`` calls dropped."""
    times_us = []
    for i in range(group.warmup + group.iters):
        start = time.perf_counter()
        round_trip()
        if i >= group.warmup:
            times_us.append((time.perf_counter() - start) * 1e6)
    return times_us


def _rfc_decode(conn, group: Group, hidden, ids, weights, watch) -> dict:
    """The decode round trip of the RFC torch-ops path (dispatch + combine, its own host syncs
    included, then a device synchronization so the output is ready, as after the blocking recv)."""
    rfc = RfcTorchPath(conn, hidden.device)
    _check_identity(rfc.round_trip(hidden, ids, weights), hidden, f"RFC decode {hidden.shape[0]} tokens")
    watch.sync()

    def round_trip():
        rfc.round_trip(hidden, ids, weights)
        watch.sync()

    times_us = _wall_times_us(group, round_trip)
    return {"rfc_rt_median_us": bc.median(times_us), "rfc_rt_p99_us": bc.percentile(times_us, 99)}


def _graph_decode(conn, group: Group, num_tokens: int, device, watch) -> dict:
    """The decode round trip with the Attention side's send + non-blocking recv captured once in
    a CUDA graph and replayed (host wall time of replay + synchronization; the FFN side serves
    as always). Shows the transport without the Attention side's Python per round trip; a
    capture failure is reported in ``graph_error`` instead of a number."""
    import torch

    hidden, ids, weights = _inputs(conn, num_tokens, device, seed=20_000 + num_tokens)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture, as torch recommends
            for _ in range(3):
                conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0), blocking=False)
        torch.cuda.current_stream(device).wait_stream(side)
        conn.check_errors()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0), blocking=False)
        out.fill_(float("nan"))
        graph.replay()
        conn.check_errors()
        _check_identity(out, hidden, f"graph decode {num_tokens} tokens")

        def round_trip():
            graph.replay()
            watch.sync()

        times_us = _wall_times_us(group, round_trip)
        conn.check_errors()
        _check_identity(out, hidden, f"graph decode {num_tokens} tokens, after the timed replays")
    except Exception as exc:  # reported, not hidden: the row carries the error
        return {"graph_error": f"{type(exc).__name__}: {exc}"[:400]}
    return {"graph_rt_median_us": bc.median(times_us), "graph_rt_p99_us": bc.percentile(times_us, 99)}


def _pipelined(conn, group: Group, hidden, ids, weights, watch) -> list:
    """Per-layer wall time (µs) of N non-blocking round trips + one synchronization, per rep
    (the first rep is a warm-up)."""
    num_layers = group.pipeline_layers
    reps = max(3, group.iters // num_layers)
    per_layer = []
    for rep in range(reps + 1):
        watch.sync()
        start = time.perf_counter()
        for _ in range(num_layers):
            out = conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0), blocking=False)
        conn.check_errors()  # the one synchronization (cuda); raises latched errors
        if rep:
            per_layer.append((time.perf_counter() - start) * 1e6 / num_layers)
    _check_identity(out, hidden, "pipelined decode")
    return per_layer


def _prefill_point(conn, group: Group, num_tokens: int, device, watch) -> dict:
    hidden, ids, weights = _inputs(conn, num_tokens, device, seed=10_000 + num_tokens)
    dispatch_ms, combine_ms, roundtrip_ms = [], [], []
    for i in range(group.prefill_warmup + group.prefill_iters):
        flags_before = conn.path.window.read_flags()
        start = watch.mark()
        handle = conn.send_attn_output(hidden, ids, weights, 0)
        sent = watch.mark()
        dispatched = watch.elapsed_ms(start, sent)
        _wait_replies_landed(conn, handle, flags_before)
        start = watch.mark()
        out = conn.recv_ffn_output(handle, blocking=False)
        combined = watch.elapsed_ms(start, watch.mark())
        conn.check_errors()
        start = watch.mark()
        conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0), blocking=False)
        round_trip = watch.elapsed_ms(start, watch.mark())
        conn.check_errors()
        if i >= group.prefill_warmup:
            dispatch_ms.append(dispatched)
            combine_ms.append(combined)
            roundtrip_ms.append(round_trip)
    _check_identity(out, hidden, f"prefill {num_tokens} tokens")
    row = {"tokens": num_tokens, "hidden": group.hidden, "top_k": group.top_k, "num_ffn": group.num_ffn,
           "wire_mode": group.wire_mode, "transport": group.transport, **_wire_bytes(conn, ids),
           "iters": len(dispatch_ms), "bytes": _payload_bytes(conn, ids),
           "dispatch_ms": bc.median(dispatch_ms), "combine_ms": bc.median(combine_ms),
           "roundtrip_ms": bc.median(roundtrip_ms)}
    if group.nccl_baseline:
        row["ffn_rows"] = _rows_per_ffn(conn, ids)
    row.update(_baselines(conn, group, hidden, ids, weights, row["bytes"], watch))
    return _with_ratios(row)


def _payload_bytes(conn, ids) -> int:
    """Payload rows one way x row bytes: pair = one per partial + one shared per token; dedup =
    one per (token, FFN rank it goes to)."""
    return sum(_rows_per_ffn(conn, ids)) * conn.model.hidden_size * conn.model.itemsize


def _rows_per_ffn(conn, ids) -> list:
    """Rows the connector's dispatch writes to each FFN rank: pair = its routed partials + its
    shared rows; dedup = its tokens."""
    import torch

    num_ffn, num_tokens = conn.topology.num_ffn_ranks, ids.shape[0]
    if conn.layout.is_dedup:
        plan = dedup.plan_dedup(ids.cpu().numpy(), num_ffn, conn.layout.expert_per_rank,
                                has_shared=conn.model.num_shared_experts > 0)
        return [int(n) for n in plan.num_rows]
    routed = torch.bincount(ids.reshape(-1).long() // conn.layout.expert_per_rank, minlength=num_ffn)
    return [int(n) + (shared_count(num_tokens, num_ffn, j) if conn.model.num_shared_experts else 0)
            for j, n in enumerate(routed.tolist())]


def _wait_replies_landed(conn, handle, flags_before, timeout_s: float = 60.0) -> None:
    """Host-poll the own window's flags until every FFN rank that was sent to has replied.
    Reads only: the combine's own wait still sees the arrivals (it compares with its own
    last-seen words)."""
    slots = [conn.layout.slot_index(j, handle.ring) for j in conn.sent_to(handle)]
    deadline = time.monotonic() + timeout_s
    while True:
        flags = conn.path.window.read_flags()
        if all(flags[s] != flags_before[s] for s in slots):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"FFN replies did not land within {timeout_s} s (slots {slots})")


# --------------------------------------------------------------------------- baselines

class RfcTorchPath:
    """The reference connector's data path from torch ops (see RFC_LABEL), in process.

    ``windows``: per FFN peer, routed rows [routed_cap, H], route table [routed_cap, 2],
    shared rows [shared_cap, H], a header row and a flag, all on ``device``.
    """

    def __init__(self, conn, device):
        import torch

        layout, model = conn.layout, conn.model
        self.torch = torch
        self.num_ffn = conn.topology.num_ffn_ranks
        self.epr = layout.expert_per_rank
        self.top_k = model.top_k
        self.hidden = model.hidden_size
        dtype = conn.torch_dtype
        self.routed = [torch.empty(layout.routed_cap, self.hidden, dtype=dtype, device=device)
                       for _ in range(self.num_ffn)]
        self.route = [torch.empty(layout.routed_cap, 2, dtype=torch.int64, device=device)
                      for _ in range(self.num_ffn)]
        self.shared = [torch.empty(max(layout.shared_cap, 1), self.hidden, dtype=dtype, device=device)
                       for _ in range(self.num_ffn)]
        self.headers = torch.zeros(self.num_ffn, layout.header_words, dtype=torch.int32, device=device)
        self.flags = torch.zeros(self.num_ffn, dtype=torch.int64, device=device)
        self.device = device
        self.seq = 0

    def shared_idx(self, ffn_rank: int, num_tokens: int):
        """Token indices of ``ffn_rank``'s round-robin shared rows (empty when tokens <= rank)."""
        return self.torch.arange(ffn_rank, max(ffn_rank, num_tokens), self.num_ffn, device=self.device)

    def dispatch(self, hidden, topk_ids):
        torch = self.torch
        num_tokens = hidden.shape[0]
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_ffn * self.epr).cpu()  # D2H sync
        rank_counts = counts.view(self.num_ffn, self.epr).sum(dim=1).tolist()
        token_idx = order // self.top_k
        self.seq += 1
        start = 0
        for j, num_routed in enumerate(rank_counts):
            idx = token_idx[start:start + num_routed]
            self.routed[j][:num_routed].copy_(hidden.index_select(0, idx))
            self.route[j][:num_routed, 0].copy_(idx)
            self.route[j][:num_routed, 1].copy_(order[start:start + num_routed] % self.top_k)
            shared_idx = self.shared_idx(j, num_tokens)
            self.shared[j][:shared_idx.numel()].copy_(hidden.index_select(0, shared_idx))
            header = [self.seq, j, num_routed, shared_idx.numel()] + counts[j * self.epr:(j + 1) * self.epr].tolist()
            self.headers[j, :len(header)].copy_(torch.tensor(header, dtype=torch.int32))
            self.flags[j].fill_(self.seq)
            start += num_routed
        return order, token_idx, rank_counts

    def combine(self, state, topk_weights, num_tokens: int):
        torch = self.torch
        order, token_idx, rank_counts = state
        for j in range(self.num_ffn):  # host polling of the reply flags
            while int(self.flags[j].item()) != self.seq:
                pass
        rows = torch.cat([self.routed[j][:n] for j, n in enumerate(rank_counts)])
        weights = topk_weights.reshape(-1)[order].float()
        out = torch.zeros(num_tokens, self.hidden, dtype=torch.float32, device=self.device)
        out.index_add_(0, token_idx, rows.float() * weights[:, None])
        for j in range(self.num_ffn):
            shared_idx = self.shared_idx(j, num_tokens)
            out.index_add_(0, shared_idx, self.shared[j][:shared_idx.numel()].float())
        return out.to(self.routed[0].dtype)

    def round_trip(self, hidden, topk_ids, topk_weights):
        """dispatch + combine of ``hidden`` (the in-process stand-in for send + recv)."""
        return self.combine(self.dispatch(hidden, topk_ids), topk_weights, hidden.shape[0])


def _baselines(conn, group: Group, hidden, ids, weights, num_bytes: int, watch) -> dict:
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=hidden.device).normal_()
    dst = torch.empty_like(src)
    rfc = RfcTorchPath(conn, hidden.device)
    _check_identity(rfc.round_trip(hidden, ids, weights), hidden, "RFC baseline")
    copy_ms, rfc_dispatch_ms, rfc_combine_ms = [], [], []
    for i in range(group.prefill_warmup + group.prefill_iters):
        start = watch.mark()
        dst.copy_(src)
        copied = watch.elapsed_ms(start, watch.mark())
        start = watch.mark()
        state = rfc.dispatch(hidden, ids)
        dispatched = watch.elapsed_ms(start, watch.mark())
        start = watch.mark()
        rfc.combine(state, weights, hidden.shape[0])
        combined = watch.elapsed_ms(start, watch.mark())
        if i >= group.prefill_warmup:
            copy_ms.append(copied)
            rfc_dispatch_ms.append(dispatched)
            rfc_combine_ms.append(combined)
    del rfc, src, dst
    return {"copy_ms": bc.median(copy_ms), "rfc_dispatch_ms": bc.median(rfc_dispatch_ms),
            "rfc_combine_ms": bc.median(rfc_combine_ms)}


def _nccl_baseline(ctx, group: Group, device, prefill: list | None = None) -> None:
    """Baseline 3, on every rank after the connector's part: each prefill point over NCCL.
    The Attention rank (``prefill``: its rows) publishes the rows per FFN rank of every point
    and adds the NCCL medians to its rows; the FFN ranks fetch them and take part."""
    store = ctx.store()
    if prefill is not None:
        store_publish(store, NCCL_ROWS_KEY, json.dumps([row["ffn_rows"] for row in prefill]).encode())
    points = json.loads(store_fetch(store, NCCL_ROWS_KEY, group.peer_timeout_s))
    watch = bc.Stopwatch(device)
    with bc.nccl_process_group(ctx, group.peer_timeout_s) as dist:
        for index, rows in enumerate(points):
            times = _nccl_point(dist, ctx.rank, rows, group, device, watch)
            if prefill is not None:
                prefill[index].update(times)
                _with_nccl_ratios(prefill[index])


def _nccl_point(dist, rank: int, rows: list, group: Group, device, watch) -> dict:
    """``all_to_all_single`` of ``rows[j]`` rows between rank 0 and FFN rank j (world rank
    j + 1): dispatch 0 -> j, combine j -> 0 (FFN ranks echo what they received; rank 0
    checks it got its rows back). Medians of the events around each call (rank 0's count)."""
    import torch

    world = len(rows) + 1
    splits = [0] + list(rows) if rank == 0 else [rows[rank - 1]] + [0] * (world - 1)
    silent = [0] * world
    sent = torch.randn(sum(splits), group.hidden, device=device).to(torch.bfloat16)
    empty = sent.new_empty(0, group.hidden)
    back = torch.empty_like(sent) if rank == 0 else empty
    calls = {"nccl_dispatch_ms": (empty, sent, silent, splits) if rank == 0 else (sent, empty, splits, silent),
             "nccl_combine_ms": (back, empty, splits, silent) if rank == 0 else (empty, sent, silent, splits)}
    times = {name: [] for name in calls}
    for i in range(group.prefill_warmup + group.prefill_iters):
        for name, (output, source, output_splits, input_splits) in calls.items():
            dist.barrier()  # every rank enters the call at about the same time
            watch.sync()
            start = watch.mark()
            dist.all_to_all_single(output, source, output_splits, input_splits)
            elapsed = watch.elapsed_ms(start, watch.mark())
            if i >= group.prefill_warmup:
                times[name].append(elapsed)
    if rank == 0 and not torch.equal(back, sent):
        raise RuntimeError(f"NCCL baseline: rows {rows} did not come back unchanged")
    return {name: bc.median(values) for name, values in times.items()}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else float("nan")


def _with_ratios(row: dict) -> dict:
    gb = row["bytes"] / 1e9
    # fraction of the link's limit reached: bytes / LINK_GBPS over the measured time
    row["dispatch_of_link"] = _ratio(row["dispatch_link_us"] / 1e3, row["dispatch_ms"])
    row["combine_of_link"] = _ratio(row["reply_link_us"] / 1e3, row["combine_ms"])
    for name in ("dispatch", "combine", "copy", "rfc_dispatch", "rfc_combine"):
        row[f"{name}_GBps"] = _ratio(gb, row[f"{name}_ms"] / 1e3)
    pair = row["dispatch_ms"] + row["combine_ms"]
    # the pair moves the bytes twice (out and back); the copy moves them once
    row["pair_vs_copy"] = _ratio(2 * row["copy_ms"], pair)
    row["dispatch_vs_copy"] = _ratio(row["copy_ms"], row["dispatch_ms"])
    row["combine_vs_copy"] = _ratio(row["copy_ms"], row["combine_ms"])
    row["speedup_vs_rfc"] = _ratio(row["rfc_dispatch_ms"] + row["rfc_combine_ms"], pair)
    return row


def _with_nccl_ratios(row: dict) -> dict:
    """nccl_GBps: bytes of the pair (out and back) / its time; x_vs_nccl: NCCL pair / connector
    pair; rt_x_vs_nccl: NCCL pair / connector round trip (which includes the reply's transfer)."""
    nccl_pair = row["nccl_dispatch_ms"] + row["nccl_combine_ms"]
    row["nccl_GBps"] = _ratio(2 * row["bytes"] / 1e9, nccl_pair / 1e3)
    row["x_vs_nccl"] = _ratio(nccl_pair, row["dispatch_ms"] + row["combine_ms"])
    row["rt_x_vs_nccl"] = _ratio(nccl_pair, row["roundtrip_ms"])
    return row


# --------------------------------------------------------------------------- plan, report

GRIDS = {
    # backend, quick -> (decode tokens, hiddens, top-ks, Fs, prefill tokens, prefill shape)
    ("cuda", True): ((1, 32, 128), (7168,), (8,), (1, 4), (1024, 4096), (7168, 8, 4)),
    ("cuda", False): ((1, 8, 32, 128, 256), (2048, 7168), (6, 8), (1, 2, 4),
                      (512, 1024, 2048, 4096, 8192), (7168, 8, 4)),
    ("host", True): ((1, 8), (128,), (8,), (2,), (64, 256), (128, 8, 2)),
    ("host", False): ((1, 8, 32), (128, 256), (6, 8), (1, 2), (64, 256, 1024), (256, 8, 2)),
}
ITERS = {  # backend, quick -> (iters, warmup, pipeline layers, prefill iters, prefill warmup)
    ("cuda", True): (300, 30, 50, 20, 3),
    ("cuda", False): (1000, 50, 50, 50, 5),
    ("host", True): (200, 10, 20, 5, 1),
    ("host", False): (300, 20, 20, 10, 2),
}


def plan_groups(args, backend: str) -> list[Group]:
    decode, hiddens, topks, ffns, prefill, prefill_shape = GRIDS[(backend, args.quick)]
    decode = tuple(args.tokens or decode)
    hiddens, topks, ffns = tuple(args.hidden or hiddens), tuple(args.top_k or topks), tuple(args.ffn or ffns)
    prefill = tuple(args.prefill_tokens if args.prefill_tokens is not None else prefill)
    if args.hidden or args.top_k or args.ffn:  # prefill at the largest requested shape
        prefill_shape = (max(hiddens), max(topks), max(ffns))
    iters, warmup, layers, p_iters, p_warmup = ITERS[(backend, args.quick)]
    iters = args.iters or iters
    modes = ("pair", "dedup") if args.wire_mode == "both" else (args.wire_mode,)
    transports = ("direct", "put") if args.transport == "both" else (args.transport,)
    if backend != "cuda" and transports != ("direct",):
        raise SystemExit(f"--transport {args.transport}: the put transport runs on the cuda backend only")
    return [dataclasses.replace(group, wire_mode=mode, transport=tr) for group in
            _shape_groups(args, backend, decode, hiddens, topks, ffns, prefill, prefill_shape,
                          (iters, warmup, layers, p_iters, p_warmup)) for mode in modes
            for tr in transports]


def _shape_groups(args, backend, decode, hiddens, topks, ffns, prefill, prefill_shape, counts) -> list:
    """One Group per (hidden, top-k, F) (the caller sets its wire mode); prefill points on
    ``prefill_shape``."""
    iters, warmup, layers, p_iters, p_warmup = counts
    groups = []
    for hidden in hiddens:
        for top_k in topks:
            for num_ffn in ffns:
                shape_prefill = prefill if (hidden, top_k, num_ffn) == prefill_shape else ()
                groups.append(Group(backend, args.poll_mode, hidden, top_k, num_ffn, decode, shape_prefill,
                                    iters, warmup, layers, p_iters, p_warmup))
    if prefill and not any(g.prefill_tokens for g in groups):
        hidden, top_k, num_ffn = prefill_shape
        groups.append(Group(backend, args.poll_mode, hidden, top_k, num_ffn, (), prefill, iters, warmup,
                            layers, p_iters, p_warmup))
    return groups


def with_nccl_baseline(groups: list, backend: str) -> tuple[list, list]:
    """Turn baseline 3 on in the groups with prefill points where NCCL can run; the second
    value: one line per group where it cannot, saying why."""
    skipped = []
    for index, group in enumerate(groups):
        if not group.prefill_tokens:
            continue
        reason = bc.nccl_unavailable_reason(backend, 1 + group.num_ffn)
        if reason:
            skipped.append(f"NCCL baseline skipped for {group.describe()}: {reason}")
        groups[index] = dataclasses.replace(group, nccl_baseline=reason is None)
    return groups, skipped


def run_group(group: Group, timeout_s: float) -> dict:
    model = group.model()
    world = 1 + group.num_ffn
    window = window_size_hint(model, TopologyConfig(1, group.num_ffn), group.connector())
    child_env = bc.launch_env(group.backend, world, window, nccl=group.nccl_baseline)
    num_gpus = detect_num_gpus() if group.backend == "cuda" else 0
    placement = cross_gpu_placement(world, num_gpus)
    results = launch(_rank, world, args=(group,), timeout_s=timeout_s, env=child_env,
                     num_gpus=num_gpus, placement=placement)
    result = results[0]
    result["placement"] = describe_placement(world, placement, group.backend, num_gpus)
    return result


def cross_gpu_placement(world: int, num_gpus: int) -> list | None:
    """Where the ranks of one launch go: None (``launch``'s default: one process per GPU when
    there are enough, else all on GPU 0) unless there are 2 <= GPUs < processes; then the
    Attention rank (rank 0) keeps GPU 0 and FFN rank i goes to GPU 1 + (i - 1) % (GPUs - 1),
    so every Attention-FFN message crosses a real link."""
    if num_gpus < 2 or num_gpus >= world:
        return None
    return [Placement(0)] + [Placement(1 + (i - 1) % (num_gpus - 1)) for i in range(1, world)]


def describe_placement(world: int, placement: list | None, backend: str, num_gpus: int) -> str:
    """``"rank:GPU"`` pairs for the JSON (what ``cross_gpu_placement`` chose for ``num_gpus``)."""
    if backend != "cuda":
        return "host backend: CPU processes"
    if placement is None:
        return ("one process per GPU" if num_gpus >= world else f"all {world} processes on GPU 0")
    return " ".join(f"{rank}:{p.gpu}" for rank, p in enumerate(placement))


def targets(decode: list, prefill: list) -> list:
    """The shared targets per wire mode measured (labelled with the mode when both ran), after
    issue #12's dedup targets; the copy-bandwidth target stays last."""
    out = _transport_targets(decode, prefill)
    if any(r.get("transport") == "direct" for r in decode + prefill):  # the shared targets: direct rows
        decode = [r for r in decode if r.get("transport", "direct") == "direct"]
        prefill = [r for r in prefill if r.get("transport", "direct") == "direct"]
    modes = [m for m in ("pair", "dedup") if any(r["wire_mode"] == m for r in decode + prefill)] or ["pair"]
    out += _dedup_targets(decode, prefill) if len(modes) == 2 else []
    for mode in modes:
        out += _mode_targets([r for r in decode if r["wire_mode"] == mode],
                             [r for r in prefill if r["wire_mode"] == mode],
                             f" [{mode}]" if len(modes) == 2 else "")
    return out


def transport_side_by_side(decode: list, prefill: list) -> list:
    """Direct and put rows of the same point and wire mode next to each other (issue #16):
    decode: round-trip medians and put - direct (us); prefill: dispatch + combine (ms) and
    put / direct."""
    out = []
    for kind, rows in (("decode", decode), ("prefill", prefill)):
        by_point = {}
        for row in rows:
            point = (row["wire_mode"], row["tokens"], row["hidden"], row["top_k"], row["num_ffn"])
            by_point.setdefault(point, {})[row.get("transport", "direct")] = row
        for point, pair in sorted(by_point.items()):
            if set(pair) != {"direct", "put"}:
                continue
            direct, put = (_point_time(kind, pair[t]) for t in ("direct", "put"))
            out.append({"kind": kind, "wire_mode": point[0], "tokens": point[1], "hidden": point[2],
                        "top_k": point[3], "num_ffn": point[4], "direct": direct, "put": put,
                        "put_minus_direct": put - direct, "put_over_direct": _ratio(put, direct),
                        "time_unit": "us (rt median)" if kind == "decode" else "ms (dispatch+combine)"})
    return out


def _transport_targets(decode: list, prefill: list) -> list:
    """Issue #16's targets, when both transports ran: put within 1.3x of direct for prefill
    (the largest prefill point of each F), within 20 us for the 128-token decode round trip."""
    pairs = transport_side_by_side(decode, prefill)
    if not pairs:
        return []
    out = []
    for row in (r for r in pairs if r["kind"] == "decode" and r["tokens"] == 128):
        out.append(bc.target_row(
            f"put vs direct, decode round trip, 128 tok, hidden {row['hidden']}, top-{row['top_k']}, "
            f"1A{row['num_ffn']}F [{row['wire_mode']}]", "<= +20 us", row["put_minus_direct"],
            "us (put - direct, median)", lambda v: v <= 20.0, "same run, blocking send+recv"))
    prefill_rows = [r for r in pairs if r["kind"] == "prefill"]
    for num_ffn in sorted({r["num_ffn"] for r in prefill_rows}):
        row = max((r for r in prefill_rows if r["num_ffn"] == num_ffn), key=lambda r: r["tokens"])
        out.append(bc.target_row(
            f"put vs direct, prefill {row['tokens']} tok, hidden {row['hidden']}, top-{row['top_k']}, "
            f"F={num_ffn} [{row['wire_mode']}]", "<= 1.3x", row["put_over_direct"],
            "x direct (dispatch+combine)", lambda v: v <= 1.3, "same run"))
    return out


def _mode_targets(decode: list, prefill: list, label: str) -> list:
    out = []
    for num_ffn in sorted({row["num_ffn"] for row in decode}) or [None]:
        match = [r for r in decode if (r["tokens"], r["hidden"], r["top_k"], r["num_ffn"]) == (128, 7168, 8, num_ffn)]
        out.append(bc.target_row(
            f"decode round trip, 128 tok, hidden 7168, top-8, 1A{num_ffn or '?'}F{label}", "<= 30 us",
            match[0]["rt_median_us"] if match else None, "us (median)", lambda v: v <= 30.0,
            "blocking send+recv, host wall time"))
    match = [r for r in prefill if (r["tokens"], r["hidden"], r["top_k"], r["num_ffn"]) == (4096, 7168, 8, 4)]
    out.append(bc.target_row(
        f"dispatch+combine vs plain copy, 4096 tok, hidden 7168, bf16, top-8, F=4{label}", ">= 0.70",
        match[0]["pair_vs_copy"] if match else None, "x copy bandwidth", lambda v: v >= 0.70,
        "2*copy_ms/(dispatch_ms+combine_ms)"))
    return out


def side_by_side(decode: list, prefill: list) -> list:
    """Pair and dedup rows of the same point next to each other: dicts with ``kind``, the
    point, both modes' dispatch bytes and times (decode: round-trip median and dispatch;
    prefill: dispatch + combine) and dedup/pair ratios."""
    out = []
    for kind, rows in (("decode", decode), ("prefill", prefill)):
        by_point = {}
        for row in rows:
            point = (row["tokens"], row["hidden"], row["top_k"], row["num_ffn"], row.get("transport", "direct"))
            by_point.setdefault(point, {})[row["wire_mode"]] = row
        for point, modes in sorted(by_point.items()):
            if set(modes) != {"pair", "dedup"}:
                continue
            pair, dd = modes["pair"], modes["dedup"]
            times = [_point_time(kind, row) for row in (pair, dd)]
            dispatch = [row["dispatch_us"] if kind == "decode" else row["dispatch_ms"] * 1e3 for row in (pair, dd)]
            out.append({"kind": kind, "tokens": point[0], "hidden": point[1], "top_k": point[2],
                        "num_ffn": point[3], "pair_dispatch_bytes": pair["dispatch_wire_bytes"],
                        "dedup_dispatch_bytes": dd["dispatch_wire_bytes"],
                        "pair_reply_bytes": pair["reply_wire_bytes"], "dedup_reply_bytes": dd["reply_wire_bytes"],
                        "bytes_ratio": _ratio(dd["dispatch_wire_bytes"], pair["dispatch_wire_bytes"]),
                        "pair_time": times[0], "dedup_time": times[1], "time_ratio": _ratio(times[1], times[0]),
                        "time_unit": "us (rt median)" if kind == "decode" else "ms (dispatch+combine)",
                        "pair_dispatch_us": dispatch[0], "dedup_dispatch_us": dispatch[1]})
    return out


def _point_time(kind: str, row: dict) -> float:
    """decode: round-trip median (us); prefill: dispatch + combine (ms)."""
    return row["rt_median_us"] if kind == "decode" else row["dispatch_ms"] + row["combine_ms"]


def _dedup_targets(decode: list, prefill: list) -> list:
    """Issue #12 (x2, hidden 7168, top-8, bf16): dedup bytes <= 1/6 of pair's at F = 1;
    prefill dispatch + combine at 4096 tokens <= 0.3x pair's; decode dispatch at 128 tokens
    <= 15 us (dedup), per F measured."""
    rows = side_by_side(decode, prefill)
    at_f1 = [r for r in rows if (r["kind"], r["tokens"], r["hidden"], r["top_k"], r["num_ffn"])
             == ("decode", 128, 7168, 8, 1)]
    out = [bc.target_row(
        "dedup / pair dispatch bytes, 128 tok decode, hidden 7168, top-8, F=1", "<= 0.167",
        at_f1[0]["bytes_ratio"] if at_f1 else None, "x pair bytes", lambda v: v <= 1 / 6,
        "wire bytes incl. route tables and headers")]
    for num_ffn in sorted({r["num_ffn"] for r in rows}) or [1]:
        at = {(r["kind"], r["tokens"]): r for r in rows if (r["hidden"], r["top_k"], r["num_ffn"]) == (7168, 8, num_ffn)}
        decode_128, prefill_4096 = at.get(("decode", 128)), at.get(("prefill", 4096))
        out.append(bc.target_row(
            f"dedup / pair prefill dispatch+combine, 4096 tok, hidden 7168, top-8, F={num_ffn}", "<= 0.3",
            prefill_4096["time_ratio"] if prefill_4096 else None, "x pair time", lambda v: v <= 0.3,
            "medians"))
        out.append(bc.target_row(
            f"dedup decode dispatch, 128 tok, hidden 7168, top-8, F={num_ffn}", "<= 15 us",
            decode_128["dedup_dispatch_us"] if decode_128 else None, "us (median)", lambda v: v <= 15.0,
            "CUDA events around send_attn_output"))
    return out


def draw(decode: list, prefill: list, title: str):
    def _draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        shapes = sorted({(r["hidden"], r["top_k"], r["num_ffn"], r["wire_mode"]) for r in decode})
        for shape in shapes:
            rows = sorted((r for r in decode if (r["hidden"], r["top_k"], r["num_ffn"], r["wire_mode"]) == shape),
                          key=lambda r: r["tokens"])
            axes[0].plot([r["tokens"] for r in rows], [r["rt_median_us"] for r in rows], marker="o",
                         label=f"H={shape[0]} top-{shape[1]} F={shape[2]} {shape[3]}")
        axes[0].axhline(30.0, color="gray", linestyle="--", label="target 30 us")
        axes[0].set(xscale="log", xlabel="tokens", ylabel="round trip median (us)", title="decode round trip")
        axes[0].legend(fontsize=7)
        for mode in sorted({r["wire_mode"] for r in prefill}):
            rows = sorted((r for r in prefill if r["wire_mode"] == mode), key=lambda r: r["tokens"])
            for key, label in (("dispatch_GBps", "AFD dispatch"), ("combine_GBps", "AFD combine"),
                               ("copy_GBps", "plain copy_"), ("rfc_dispatch_GBps", "RFC-path dispatch"),
                               ("rfc_combine_GBps", "RFC-path combine"), ("nccl_GBps", "NCCL all_to_all pair")):
                if not all(key in r for r in rows):
                    continue
                axes[1].plot([r["tokens"] for r in rows], [r[key] for r in rows], marker="o",
                             label=f"{label} ({mode})")
        axes[1].set(xscale="log", xlabel="tokens", ylabel="GB/s", title="prefill bandwidth")
        axes[1].legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
    return _draw


PREFILL_NCCL_COLUMNS = {"nccl_dispatch_ms": "NCCL d ms", "nccl_combine_ms": "NCCL c ms",
                        "nccl_GBps": "NCCL GB/s", "x_vs_nccl": "x vs NCCL", "rt_x_vs_nccl": "rt x vs NCCL"}


def floor_note(floor_terms: list) -> str:
    """How the floor columns were made, with each launch's measured terms."""
    if not floor_terms:
        return "floor: not measured (cuda only)"
    terms = "; ".join(f"{t['group']}: {t['node_us']:.2f} us, {t['copy_gbps']:.0f} GB/s" for t in floor_terms)
    return ("floor = one graph node + the kernel's bytes (read + written, from the layout) / a device "
            f"copy's read + written rate, both measured in the launch ({terms}); x floor = time / floor")


def print_summary(report: dict) -> None:
    print()
    print(f"==== bench_transport summary: backend={report['backend']} commit={report['run']['commit']} "
          f"device={report['device']} wire_mode={report['wire_mode']} ====")
    if report["label"]:
        print(report["label"])
    print("\n(a) decode round trip (1 Attention rank, identity FFN; us; KB = wire bytes per direction)")
    print(bc.format_table(
        ("mode", "tokens", "hidden", "top-k", "F", "median", "p99", "min", "pipelined/layer", "dispatch",
         "disp floor", "x floor", "disp KB", "reply KB", "RFC med", "x vs RFC", "graph med", "graph p99"),
        [(r["wire_mode"], r["tokens"], r["hidden"], r["top_k"], r["num_ffn"], r["rt_median_us"], r["rt_p99_us"],
          r["rt_min_us"], r["pipelined_us_per_layer"], r["dispatch_us"], r.get("dispatch_floor_us"),
          r.get("dispatch_x_floor"), r["dispatch_wire_bytes"] / 1e3,
          r["reply_wire_bytes"] / 1e3, r["rfc_rt_median_us"], r["speedup_vs_rfc"],
          r.get("graph_rt_median_us"), r.get("graph_rt_p99_us"))
         for r in report["decode"]]))
    print(f"RFC med = {report['rfc_baseline_kind']}, no second process (host wall time of its dispatch + "
          "combine, its .cpu()/.item() syncs included); x vs RFC = RFC med / median")
    print("graph = the Attention side's send + recv captured in one CUDA graph, replay + sync "
          "(cuda only; '-' = not measured)")
    print(floor_note(report.get("floor_terms") or []))
    for r in report["decode"]:
        if "graph_error" in r:
            print(f"graph capture FAILED at {r['tokens']} tokens, F={r['num_ffn']}: {r['graph_error']}")
    print("\n(b) prefill bandwidth (medians; MB = payload rows one way in the row's mode; GB/s = MB / time; "
          "RFC = " + report["rfc_baseline_kind"] + ")")
    nccl = [key for key in PREFILL_NCCL_COLUMNS if any(key in r for r in report["prefill"])]
    print(bc.format_table(
        ("mode", "tokens", "F", "MB", "disp ms", "disp floor", "x floor", "comb ms", "comb floor", "x floor",
         "rt ms", "disp GB/s", "comb GB/s", "of link",
         "copy GB/s", "pair/copy", "RFC d+c ms", "x vs RFC") + tuple(PREFILL_NCCL_COLUMNS[key] for key in nccl),
        [(r["wire_mode"], r["tokens"], r["num_ffn"], r["bytes"] / 1e6, r["dispatch_ms"], r.get("dispatch_floor_ms"),
          r.get("dispatch_x_floor"), r["combine_ms"], r.get("combine_floor_ms"), r.get("combine_x_floor"),
          r["roundtrip_ms"], r["dispatch_GBps"], r["combine_GBps"], r["dispatch_of_link"], r["copy_GBps"],
          r["pair_vs_copy"], r["rfc_dispatch_ms"] + r["rfc_combine_ms"], r["speedup_vs_rfc"])
         + tuple(r.get(key) for key in nccl)
         for r in report["prefill"]]))
    print(f"of link = (dispatch wire bytes / {LINK_GBPS:.0f} GB/s) / disp ms")
    if nccl:
        print("NCCL = " + NCCL_NOTE + "; NCCL GB/s = 2 * bytes / (NCCL d + c); x vs NCCL = (NCCL d + c) / "
              "(disp + comb); rt x vs NCCL = (NCCL d + c) / rt")
    if report["side_by_side"]:
        print("\n(d) wire modes side by side (wire bytes per direction; time: decode = rt median us, "
              "prefill = dispatch + combine ms)")
        print(bc.format_table(
            ("kind", "tokens", "F", "pair disp MB", "dedup disp MB", "pair reply MB", "dedup reply MB",
             "bytes dedup/pair", "pair time", "dedup time", "time dedup/pair", "pair disp us", "dedup disp us"),
            [(r["kind"], r["tokens"], r["num_ffn"], r["pair_dispatch_bytes"] / 1e6, r["dedup_dispatch_bytes"] / 1e6,
              r["pair_reply_bytes"] / 1e6, r["dedup_reply_bytes"] / 1e6, r["bytes_ratio"], r["pair_time"],
              r["dedup_time"], r["time_ratio"], r["pair_dispatch_us"], r["dedup_dispatch_us"])
             for r in report["side_by_side"]]))
    if report.get("transport_side_by_side"):
        print("\n(e) transports side by side (decode: rt median us; prefill: dispatch + combine ms)")
        print(bc.format_table(
            ("kind", "mode", "tokens", "hidden", "top-k", "F", "direct", "put", "put - direct", "put / direct"),
            [(r["kind"], r["wire_mode"], r["tokens"], r["hidden"], r["top_k"], r["num_ffn"], r["direct"],
              r["put"], r["put_minus_direct"], r["put_over_direct"]) for r in report["transport_side_by_side"]]))
    print("\n(c) targets")
    print(bc.targets_table(report["targets"]))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_common_args(parser, quick_help="small subset (< 60 s on GPU and host)")
    parser.add_argument("--tokens", type=int, nargs="+", help="decode token counts")
    parser.add_argument("--prefill-tokens", type=int, nargs="*", help="prefill token counts (none: skip)")
    parser.add_argument("--hidden", type=int, nargs="+")
    parser.add_argument("--top-k", type=int, nargs="+")
    parser.add_argument("--ffn", type=int, nargs="+", help="numbers of FFN ranks")
    parser.add_argument("--iters", type=int, help="decode iterations after warm-up (>= 200)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per launch, seconds")
    parser.add_argument("--wire-mode", choices=WIRE_MODE_CHOICES, default="pair",
                        help="ConnectorConfig.wire_mode; 'both': one launch per mode, side by side")
    parser.add_argument("--transport", choices=TRANSPORT_CHOICES, default="direct",
                        help="ConnectorConfig.transport (cuda): 'put' forces NVSHMEM puts for every "
                             "peer; 'both': one launch per transport, side by side (issue #16)")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="print a cProfile of N blocking round trips per decode point (cuda and host)")
    parser.add_argument("--ffn-serving", choices=("auto", "graph", "loop"), default="auto",
                        help="the FFN ranks' FFNWorker(serving=...): 'auto' (default: the graph FFN on "
                             "cuda where it applies), 'graph' or 'loop' (the Python loop)")
    parser.add_argument("--nccl-baseline", action="store_true",
                        help="prefill baseline 3: all_to_all_single over torch NCCL between the same "
                             "processes (cuda, one GPU per process; skipped with a message otherwise)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = args.backend or bc.detect_backend()
    groups = [dataclasses.replace(g, ffn_serving=args.ffn_serving, host_profile=args.host_profile)
              for g in plan_groups(args, backend)]
    if args.nccl_baseline:
        groups, nccl_skipped = with_nccl_baseline(groups, backend)
        print("\n".join(nccl_skipped) or "NCCL baseline on", flush=True)
    started = time.perf_counter()
    decode, prefill, devices, placements, floor_terms = [], [], set(), [], []
    for group in bc.progress(groups, "bench_transport", lambda g: g.describe()):
        result = run_group(group, args.timeout)
        decode += result["decode"]
        prefill += result["prefill"]
        devices.add(result["device"])
        placements.append({"group": group.describe(), "placement": result["placement"]})
        if result.get("floor_terms"):
            floor_terms.append({"group": group.describe(), **result["floor_terms"]})
        print(f"placement ({group.describe()}): {result['placement']}", flush=True)
    report = {"tool": "bench_transport", "backend": backend, "quick": args.quick, "wire_mode": args.wire_mode,
              "transport": args.transport, "ffn_serving": args.ffn_serving, "placements": placements, "floor_terms": floor_terms,
              "label": HOST_LABEL if backend == "host" else "",
              "device": ", ".join(sorted(devices)), "run": bc.run_info(backend),
              "poll_mode": args.poll_mode if backend == "cuda" else "host",
              "rfc_baseline_kind": "in-process torch-ops equivalent", "rfc_baseline": RFC_LABEL,
              "timing": {
                  "decode": "host wall time send_attn_output -> recv_ffn_output(blocking=True); "
                            "pipelined = N x (send + recv(blocking=False)) + one sync, / N",
                  "decode_rfc": DECODE_RFC_NOTE,
                  "decode_speedup_vs_rfc": "rfc_rt_median_us / rt_median_us",
                  "dispatch": "CUDA events around send_attn_output (its kernels complete)" if backend == "cuda"
                              else "wall time of send_attn_output",
                  "combine": "replies landed first (host flag poll), then recv_ffn_output alone "
                             + ("(CUDA events)" if backend == "cuda" else "(wall time)"),
                  "bytes": "payload rows one way x hidden x 2: pair = tokens*top_k + tokens (shared rows), "
                           "dedup = one per (token, FFN rank it goes to)",
                  "pair_vs_copy": "2*copy_ms / (dispatch_ms + combine_ms)",
                  "speedup_vs_rfc": "(rfc_dispatch_ms + rfc_combine_ms) / (dispatch_ms + combine_ms)",
                  "wire_bytes": "dedup.wire_bytes: fields + headers + 8-byte flags of every message "
                                "sent, per direction, in the row's wire_mode",
                  "link": f"bytes / {LINK_GBPS} GB/s (dispatch_link_us, reply_link_us); "
                          "dispatch_of_link = link time / dispatch time",
                  "dispatch_us": "decode: median of send_attn_output alone (CUDA events on cuda, wall on "
                                 "host), each followed by an untimed receive",
                  "floor": "bench_common.floor_us: one CUDA graph node + kernel_bytes (read + written, "
                           "from the layout) / a device copy's read + written GB/s; *_x_floor = time / floor"},
              "decode": decode, "prefill": prefill, "side_by_side": side_by_side(decode, prefill),
              "transport_side_by_side": transport_side_by_side(decode, prefill),
              "targets": targets(decode, prefill),
              "wall_s": time.perf_counter() - started}
    if args.nccl_baseline:
        report["nccl_baseline"] = {"kind": NCCL_NOTE, "skipped": nccl_skipped}
        report["timing"]["x_vs_nccl"] = "(nccl_dispatch_ms + nccl_combine_ms) / (dispatch_ms + combine_ms)"
    json_path = bc.write_json(args.out, "bench_transport.json", report)
    title = f"afd_cupy bench_transport ({backend}, {report['device']}, {report['run']['commit']})"
    plot_path = bc.save_plot(args.out, "bench_transport.png", draw(decode, prefill, title))
    print(f"wrote {json_path}" + (f" and {plot_path}" if plot_path else "")
          + f" in {report['wall_s']:.1f} s")
    print_summary(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
