"""Spans on one clock: what a benchmark rank did when, per lane (stream), for ``bench_afd``.

A :class:`SpanRecorder` keeps, per lane, a sequence of spans that never overlap:
``mark(lane, name, tag)`` ends the lane's open span at this instant and opens ``name``
(``None`` only ends it), so consecutive spans of a lane share their boundary stamp.

Clocks. Every span ends up in nanoseconds of ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on
Linux: one clock for every process of a machine, so spans of different ranks line up).
- ``host`` lanes stamp with ``perf_counter_ns`` when the mark is called.
- ``stream`` lanes (and ``stream1``, stage 1's lane: :func:`stage_lane`) stamp where the work
  runs. On the CPU (host backend) that is the calling thread: ``perf_counter_ns`` too. On cuda a mark records a ``torch.cuda.Event``
  (``enable_timing``) on the current stream: it completes when the stream reaches it, so a
  span is the device time from the work enqueued after one mark to the work enqueued before
  the next (including gaps where the stream waited for the host to enqueue). No mark
  synchronizes: completed events are read with ``query()`` as the run goes (the event goes
  back to a pool) and the rest by :meth:`SpanRecorder.finish`. Device times become host
  times through two anchors, each an event recorded on an idle device between two host
  stamps (their midpoint is the anchor's host time, half their distance its error): one when
  the recorder is made and one in ``finish``; the line through them removes the offset and
  the drift between the GPU and host clocks (over at least 1 s; shorter runs keep the offset
  only). Resolution: ``elapsed_time`` is a float of ms (about 0.5 µs; float rounding makes it
  a few µs a minute after the first anchor); alignment across processes: the anchors' errors.

The rest are pure functions on finished spans (``(name, begin_ns, end_ns, tag)`` tuples, per
lane): busy time in a window, queue statistics, clipping, the split of an Attention rank's
combine into the wait for its replies and the combine proper, and the timeline plot.
"""
from __future__ import annotations

import collections
import time
from typing import Sequence

#: lane names used by bench_afd: device-ordered work, and host-thread waits
STREAM, HOST = "stream", "host"


def stage_lane(stage: int) -> str:
    """The device lane of micro-batch stage ``stage`` (bench_afd ``--overlap attn``: one stream
    per stage): ``stream`` for stage 0 (the one-stage lane), ``stream1`` for stage 1."""
    return STREAM if stage == 0 else f"{STREAM}{stage}"


#: the FFN rank's reply lane under ``FFNWorker(overlap=True)`` (replies on their own stream)
REPLY_STREAM = f"{STREAM}_reply"


def is_device_lane(lane: str) -> bool:
    return lane.startswith(STREAM)

#: colour of each span name in the timeline plot
COLORS = {"attention": "tab:blue", "dispatch": "tab:orange", "combine": "tab:green",
          "wait": "lightgray", "compute": "tab:red", "reply": "tab:purple"}

_POLL_EVERY = 32  # cuda: marks between two non-blocking reads of completed events


class HostClock:
    """``perf_counter_ns`` stamps (already final)."""

    on_device = False

    def stamp(self) -> int:
        return time.perf_counter_ns()

    def drain(self) -> None:
        pass

    def finish(self) -> dict:
        return {"kind": "host perf_counter_ns"}

    def to_ns(self, stamp) -> int:
        return stamp


class CudaEventClock:
    """Stamps = ``torch.cuda.Event`` recorded on the current stream; see the module doc."""

    on_device = True

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device
        self.anchor, self.anchor_ns, self.anchor_err_ns = self._anchor()
        self.pending = collections.deque()  # (stamp index, event) in record order
        self.offsets_ms: list = []  # stamp index -> device ms after the first anchor
        self.free: list = []
        self.scale = 1.0
        self.count = 0

    def _anchor(self):
        torch = self.torch
        torch.cuda.synchronize(self.device)
        event = torch.cuda.Event(enable_timing=True)
        before = time.perf_counter_ns()
        event.record()
        event.synchronize()
        after = time.perf_counter_ns()
        return event, (before + after) // 2, (after - before) // 2

    def stamp(self) -> int:
        event = self.free.pop() if self.free else self.torch.cuda.Event(enable_timing=True)
        event.record()
        index = len(self.offsets_ms)
        self.offsets_ms.append(None)
        self.pending.append((index, event))
        self.count += 1
        if self.count % _POLL_EVERY == 0:
            self.drain()
        return index

    def drain(self, wait: bool = False) -> None:
        """Read the events that completed (all of them with ``wait``, after a synchronize)."""
        while self.pending and (wait or self.pending[0][1].query()):
            index, event = self.pending.popleft()
            self.offsets_ms[index] = self.anchor.elapsed_time(event)
            self.free.append(event)

    def finish(self) -> dict:
        end, end_ns, end_err_ns = self._anchor()  # synchronizes: every event has completed
        self.drain(wait=True)
        device_ms = self.anchor.elapsed_time(end)
        host_ns = end_ns - self.anchor_ns
        # drift correction only over an interval long enough for the anchors' error
        if device_ms > 1e3 and host_ns > 0:
            self.scale = host_ns / (device_ms * 1e6)
        return {"kind": "cuda events on the current stream, mapped to host perf_counter_ns",
                "anchor_error_ns": [self.anchor_err_ns, end_err_ns], "scale": self.scale,
                "interval_s": host_ns / 1e9}

    def to_ns(self, stamp) -> int:
        return self.anchor_ns + int(round(self.offsets_ms[stamp] * 1e6 * self.scale))


class SpanRecorder:
    """Non-overlapping spans per lane (module doc). ``device``: a torch device; cuda devices
    get event stamps on ``stream`` lanes, everything else ``perf_counter_ns``."""

    def __init__(self, device=None):
        self.host_clock = HostClock()
        is_cuda = device is not None and getattr(device, "type", None) == "cuda"
        self.device_clock = CudaEventClock(device) if is_cuda else self.host_clock
        self._open: dict = {}  # lane -> (name, stamp, tag)
        self._raw: list = []  # (lane, name, begin stamp, end stamp, tag)
        self.clock_info: dict | None = None

    def _clock(self, lane: str):
        return self.device_clock if is_device_lane(lane) else self.host_clock

    def mark(self, lane: str, name: str | None = None, tag=None) -> None:
        """End ``lane``'s open span now; open ``name`` (with ``tag``) unless it is None."""
        now = self._clock(lane).stamp()
        opened = self._open.pop(lane, None)
        if opened is not None:
            self._raw.append((lane, opened[0], opened[1], now, opened[2]))
        if name is not None:
            self._open[lane] = (name, now, tag)

    def finish(self) -> dict:
        """Close the open spans, resolve every stamp; ``{lane: [(name, begin_ns, end_ns, tag)]}``
        in the order they were recorded. Call once, after the measured work."""
        for lane in list(self._open):
            self.mark(lane, None)
        self.clock_info = self.device_clock.finish()
        lanes: dict = {}
        for lane, name, begin, end, tag in self._raw:
            clock = self._clock(lane)
            lanes.setdefault(lane, []).append((name, clock.to_ns(begin), clock.to_ns(end), tag))
        self._raw = []
        return lanes


class FFNStatsRecorder:
    """``afd_cupy.ffn.worker.FFNRecorder`` for benchmarks.

    Always: the compute spans (``computing`` -> ``replying``) of every compute batch on the
    ``stream`` lane (busy time), and one queue sample per received item: at that instant, the
    items that had arrived in the window and were not taken yet (``path.pending_arrivals()``)
    plus the items the worker holds unserved (lockstep: waiting for the other replicas' same
    layer). With ``timeline``: also ``wait`` spans on the ``host`` lane (``polling`` ->
    ``received``) and ``reply`` spans (``replying`` -> ``served``), every span tagged with the
    ``(attention rank, layer, stage)`` of its items. ``overlap`` (the worker's
    ``overlap=True``): the reply spans go to the :data:`REPLY_STREAM` lane (from the end of the
    compute to the end of the replies on the reply stream), since they overlap the next compute.
    """

    def __init__(self, device=None, *, timeline: bool = False, overlap: bool = False):
        self.spans = SpanRecorder(device)
        self.timeline = timeline
        self.reply_lane = REPLY_STREAM if overlap else STREAM
        self.queue_ns: list = []
        self.queue_items: list = []

    def polling(self) -> None:
        if self.timeline:
            self.spans.mark(HOST, "wait")

    def received(self, worker, item) -> None:
        if self.timeline:
            self.spans.mark(HOST, None)
        self.queue_ns.append(time.perf_counter_ns())
        self.queue_items.append(worker.connector.path.pending_arrivals() + worker.num_waiting)

    def computing(self, items) -> None:
        self.spans.mark(STREAM, "compute", _item_tags(items) if self.timeline else None)

    def replying(self, items) -> None:
        if self.reply_lane == STREAM:
            self.spans.mark(STREAM, "reply" if self.timeline else None,
                            _item_tags(items) if self.timeline else None)
            return
        self.spans.mark(STREAM, None)
        if self.timeline:
            self.spans.mark(self.reply_lane, "reply", _item_tags(items))

    def served(self, items) -> None:
        if self.timeline:
            self.spans.mark(self.reply_lane, None)

    def result(self) -> dict:
        lanes = self.spans.finish()
        compute = [(b, e) for name, b, e, _ in lanes.get(STREAM, ()) if name == "compute"]
        return {"compute_ns": compute, "queue_ns": self.queue_ns, "queue_items": self.queue_items,
                "lanes": lanes if self.timeline else {}, "clock": self.spans.clock_info}


def _item_tags(items) -> tuple:
    return tuple((item.src_rank, item.layer_idx, item.stage_idx) for item in items)


# --------------------------------------------------------------------------- span arithmetic

def overlap_ns(spans: Sequence[tuple], window: tuple) -> int:
    """Total time of ``(begin_ns, end_ns)`` spans inside ``window`` = (begin_ns, end_ns)."""
    lo, hi = window
    return sum(max(0, min(end, hi) - max(begin, lo)) for begin, end in spans)


def busy_fraction(spans: Sequence[tuple], window: tuple) -> float:
    """Fraction of ``window`` covered by the (non-overlapping) ``spans``; NaN for an empty window."""
    length = window[1] - window[0]
    return overlap_ns(spans, window) / length if length > 0 else float("nan")


def queue_stats(times_ns: Sequence[int], counts: Sequence[int], window: tuple) -> dict:
    """Mean and max of the queue samples taken inside ``window``, and how many there were."""
    inside = [c for t, c in zip(times_ns, counts) if window[0] <= t <= window[1]]
    if not inside:
        return {"mean": float("nan"), "max": None, "samples": 0}
    return {"mean": sum(inside) / len(inside), "max": max(inside), "samples": len(inside)}


def common_window(windows: Sequence[tuple]) -> tuple:
    """The part of time every window covers: (latest begin, earliest end)."""
    return max(w[0] for w in windows), min(w[1] for w in windows)


def clip(spans: Sequence[tuple], window: tuple) -> list:
    """``(name, begin, end, tag)`` spans cut to ``window``; spans outside it dropped."""
    lo, hi = window
    return [(name, max(b, lo), min(e, hi), tag) for name, b, e, tag in spans if e > lo and b < hi]


def split_waits(attn_spans: Sequence[tuple], attn_rank: int, ffn_lanes: Sequence[Sequence[tuple]],
                stage: int | None = None) -> list:
    """Split each ``combine`` span of Attention rank ``attn_rank`` (tag ``(batch, layer)``)
    into ``wait`` (until its replies landed) and ``combine`` (the rest).

    The replies are the FFN ranks' ``reply`` spans tagged with ``(attn_rank, layer[, stage])``
    (only those of ``stage`` when it is given and the tags carry one) that end
    after the layer's ``dispatch`` began and no later than the combine's end; the wait ends at
    the latest such reply end (clamped into the span). The reply end is when the FFN rank's
    reply call returned (host backend) or its reply kernel completed (cuda): the moment the
    data was in the Attention rank's window, not the moment the Attention rank saw it, so the
    wait is a lower bound, up to the clocks' anchor error across processes. A combine span
    with no matching reply stays whole.
    """
    ends: dict = collections.defaultdict(list)  # layer -> reply ends
    for lane in ffn_lanes:
        for name, _, end, tag in lane:
            if name == "reply":
                for src, layer, *rest in tag or ():
                    if src == attn_rank and (stage is None or not rest or rest[0] == stage):
                        ends[layer].append(end)
    for layer_ends in ends.values():
        layer_ends.sort()
    out, dispatch_begin = [], {}
    for name, begin, end, tag in attn_spans:
        if name == "dispatch":
            dispatch_begin[tag] = begin
        if name != "combine" or tag not in dispatch_begin:
            out.append((name, begin, end, tag))
            continue
        layer = tag[1]
        landed = [r for r in ends.get(layer, ()) if dispatch_begin[tag] <= r <= end]
        if not landed:
            out.append((name, begin, end, tag))
            continue
        split = min(max(max(landed), begin), end)
        if split > begin:
            out.append(("wait", begin, split, tag))
        if end > split:
            out.append(("combine", split, end, tag))
    return out


def check_lane(spans: Sequence[tuple]) -> None:
    """Raise ValueError unless the lane's spans are in time order and do not overlap."""
    previous_end = None
    for name, begin, end, _ in spans:
        if end < begin:
            raise ValueError(f"span {name} ends before it begins ({begin} > {end})")
        if previous_end is not None and begin < previous_end:
            raise ValueError(f"span {name} begins at {begin}, before the previous span's end {previous_end}")
        previous_end = end


# --------------------------------------------------------------------------- the picture

def draw_timeline(panels: Sequence[dict], title: str):
    """``draw(plt)`` for ``bench_common.save_plot``: one panel per entry of ``panels``
    (``{"title", "window_ns", "rows": [(label, spans)]}``), one row per (rank, lane), spans
    as ``broken_barh`` bars coloured by name, time in ms from the panel's window start."""

    def _draw(plt):
        heights = [max(1, len(p["rows"])) for p in panels]
        fig, axes = plt.subplots(len(panels), 1, figsize=(12, 0.45 * sum(heights) + 1.2 * len(panels)),
                                 squeeze=False, gridspec_kw={"height_ratios": heights})
        seen = {}
        for ax, panel in zip(axes[:, 0], panels):
            origin = panel["window_ns"][0]
            labels = []
            for row, (label, spans) in enumerate(panel["rows"]):
                labels.append(label)
                by_name = collections.defaultdict(list)
                for name, begin, end, _ in spans:
                    by_name[name].append(((begin - origin) / 1e6, (end - begin) / 1e6))
                for name, bars in by_name.items():
                    handle = ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLORS.get(name, "black"),
                                            edgecolor="none")
                    seen.setdefault(name, handle)
            ax.set_yticks(range(len(labels)), labels, fontsize=7)
            ax.set_ylim(len(labels) - 0.5, -0.5)
            ax.set_xlim(0, (panel["window_ns"][1] - origin) / 1e6)
            ax.set_title(panel["title"], fontsize=8)
            ax.set_xlabel("ms", fontsize=7)
        names = [n for n in COLORS if n in seen] + [n for n in seen if n not in COLORS]
        fig.legend([seen[n] for n in names], names, loc="upper right", fontsize=7, ncol=len(names))
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    return _draw
