"""The graph FFN's busy time for the serving benchmarks, from device stamps inside its replays.

On cuda ``FFNWorker`` serves with the graph FFN by default (``GraphFFNServer``: CUDA graph
replays, no Python per item). The loop's ``bench_spans.FFNStatsRecorder`` hooks run per item in
Python, so a worker given a recorder falls back to the loop; :class:`GraphFFNStats` measures the
graph itself instead:

- A ``device_trace.DeviceTrace`` is installed before the graphs are captured, so its one-thread
  ``%globaltimer`` stamps become graph nodes: ``f_staged`` after the wait + stage,
  ``f_gathered`` after the gather (dedup: the expand), ``f_reply0`` / ``f_reply1`` around the
  reply. Every replay (idle ones too) fills one trace row; row ``r`` is replay ``r``.
- The server's ``record_log`` says what each replay did (``GS_*``) and, for a served one, the
  sender, layer and stage it answered.
- ``%globaltimer`` becomes host ``perf_counter_ns`` (the clock of every other span) through
  two anchors, each a stamp on an idle device between two host stamps (their midpoint, error
  half their distance): one before the run, one after; the line through them removes the offset
  and the drift (over at least 1 s, else the offset only).

Spans, as the loop recorder's: ``compute`` = ``f_gathered`` -> ``f_reply0`` of every SERVED
replay (the expert GEMMs, the loop's "expert call start to first reply start"), and with
``timeline`` ``reply`` = ``f_reply0`` -> ``f_reply1`` and ``wait`` = the previous replay's
``f_reply1`` -> ``f_staged`` (the in-graph wait), tagged ``(sender, layer, stage)``. Items
waiting are not measured (no host step per item samples the queue): NaN, one sample per
served item (so the item rate still counts). Items the graph hands to the eager path (too large
for its bucket) are counted, their compute is not in the busy time.

Cost: four stamp nodes per replay, about 1 µs each (docs/performance.md, floors).
"""
from __future__ import annotations

import time

import numpy as np

import bench_spans as spans
import device_trace as dt

#: graph points of the busy and timeline spans, in replay order (the last closes a row)
POINTS = ("f_staged", "f_gathered", "f_reply0", "f_reply1")
STAMPS = {name: pair for name, pair in dt.FFN_STAMPS.items() if all(p is None or p in POINTS for p in pair)}
#: trace rows kept (one per replay; the last this many)
CAPACITY = 1 << 18


def clock_map(anchors: list) -> tuple:
    """``(to_ns, info)`` from ``[(device_ns, host_ns, err_ns), ...]`` (two anchors, oldest first):
    ``to_ns(device_ns) -> host ns`` along the line through them when they are at least 1 s
    apart on both clocks, else with the first anchor's offset only."""
    (d0, h0, e0), (d1, h1, e1) = anchors[0], anchors[-1]
    scale = (h1 - h0) / (d1 - d0) if d1 - d0 > 1e9 and h1 - h0 > 0 else 1.0

    def to_ns(device_ns):  # int64 first: %globaltimer counts ns since 1970, past float64's 2**53
        return h0 + (np.asarray(device_ns, dtype=np.int64) - d0).astype(np.float64) * scale

    return to_ns, {"kind": "%globaltimer in graph nodes, mapped to host perf_counter_ns",
                   "anchor_error_ns": [int(e0), int(e1)], "scale": float(scale),
                   "interval_s": (h1 - h0) / 1e9}


def graph_spans(rows: np.ndarray, first_replay: int, records: list, to_ns, *, timeline: bool) -> dict:
    """The ``FFNStatsRecorder.result()`` dict from trace ``rows`` (int64 [n, len(POINTS)], row i =
    replay ``first_replay + i``, -1 where a point was not stamped) and the server's
    ``records`` (one per replay from replay 0, ``afd_cupy.ffn.graph.REC_*``); ``to_ns`` maps
    device ns to host ns (:func:`clock_map`). Pure: no device."""
    from afd_cupy import wire
    from afd_cupy.ffn import graph as ffn_graph

    rows = np.asarray(rows)
    host_ns = to_ns(rows)  # columns in POINTS order
    compute, lanes, queue_ns = [], [], []
    counts = {name: 0 for name in ffn_graph.GS_NAMES.values()}
    previous_end = None
    for i, row in enumerate(rows):
        replay = first_replay + i
        if replay >= len(records) or (row < 0).any():
            previous_end = None
            continue
        record = records[replay]
        if int(record[ffn_graph.REC_REPLAY]) != replay:
            raise ValueError(f"record {replay} is of replay {int(record[ffn_graph.REC_REPLAY])}")
        status = int(record[ffn_graph.REC_STATUS])
        name = ffn_graph.GS_NAMES.get(status, str(status))
        counts[name] = counts.get(name, 0) + 1
        staged, gathered, reply0, reply1 = (int(v) for v in host_ns[i])
        if status == ffn_graph.GS_SERVED:
            words = record[ffn_graph.REC_HEADER:].view(np.int32)
            tag = ((int(words[wire.HDR_SRC_RANK]), int(words[wire.HDR_LAYER]), int(words[wire.HDR_STAGE])),)
            compute.append((gathered, reply0))
            queue_ns.append(staged)
            if timeline:
                if previous_end is not None:
                    lanes.append(("wait", previous_end, staged, tag))
                lanes += [("compute", gathered, reply0, tag), ("reply", reply0, reply1, tag)]
        previous_end = reply1
    return {"compute_ns": compute, "queue_ns": queue_ns, "queue_items": [float("nan")] * len(queue_ns),
            "lanes": {spans.STREAM: lanes} if timeline else {}, "replays": counts}


class GraphFFNStats:
    """Busy time of a ``GraphFFNServer`` (module doc). Make it before the server captures its
    graphs (the trace is installed here), :meth:`attach` the server, run, then :meth:`result`
    (which uninstalls the trace). ``device``: the server's torch CUDA device (made CuPy's
    current device here: the stamps, the ring and the anchors are on it)."""

    def __init__(self, device, *, timeline: bool = False, capacity: int = CAPACITY):
        import cupy

        cupy.cuda.Device(device.index or 0).use()
        self.timeline = timeline
        self._anchor_trace = dt.DeviceTrace(("t",), capacity=4)
        self.anchors = [self._anchor()]
        self.trace = dt.DeviceTrace(POINTS, capacity=capacity)
        self.trace.install(STAMPS)
        self.server = None

    def _anchor(self) -> tuple:
        import cupy

        cupy.cuda.Device().synchronize()
        stream = cupy.cuda.get_current_stream()
        before = time.perf_counter_ns()
        self._anchor_trace.stamp(stream.ptr, "t")
        stream.synchronize()
        after = time.perf_counter_ns()
        return (before + after) // 2, (after - before) // 2

    def attach(self, server) -> None:
        """Log ``server``'s records (``GraphFFNServer.record_log``) from its first replay on."""
        if server.num_replays:
            raise ValueError(f"attach the server before it replays (it has {server.num_replays})")
        server.record_log = []
        self.server = server

    def result(self) -> dict:
        """Uninstall the trace and return the spans (:func:`graph_spans`) and the clock."""
        self.trace.uninstall()
        self.anchors.append(self._anchor())
        count = int(self.trace.counter.get()[0])
        rows = self.trace.rows()
        device = self._anchor_trace.rows()[:, 0]
        anchors = [(int(d), h, e) for d, (h, e) in zip(device, self.anchors)]
        to_ns, clock = clock_map(anchors)
        records = self.server.record_log if self.server is not None else []
        out = graph_spans(rows, count - len(rows), records, to_ns, timeline=self.timeline)
        out.update(clock=clock, trace_rows=count, records=len(records),
                   eager=getattr(self.server, "num_eager", 0))
        return out
