"""Device timestamps at kernel boundaries: where a round trip's time goes, on the GPU's own clock.

A :class:`DeviceTrace` owns a ring of int64 ``[capacity, num_points]`` stamps (filled with -1)
and a row counter, both in device memory. :meth:`DeviceTrace.install` wraps
``afd_cupy.kernels.PackedLaunch.launch`` (class level, in this process only) so that a launch of
a named kernel is preceded and/or followed by a one-thread ``afd_trace_stamp``
(``raw_kernels/probes/bench.cu``) on the same stream: ``%globaltimer`` goes into the current
row's column of that point, and the row's last point closes it (counter + 1). Inside a CUDA graph
capture the stamps become graph nodes and the row still comes from device memory, so every
replay fills a new row. Rows are read after the run (:meth:`DeviceTrace.rows`); nothing in the
traced path synchronizes.

Scope and cost:
- One stream per trace: a row's stamps must come from one stream (the Attention side's step
  with one micro-batch stage; the graph-driven FFN, whose replays run on one stream). Not the
  eager FFN (its wait and reply run on different streams) and not S > 1 stages (their rows
  interleave on the one stream).
- Each stamp is one extra kernel (a graph node when captured): a few µs per point. A traced
  run's times are not the untraced run's; the phases show where the time goes, not its total.
- ``%globaltimer`` is one clock per GPU, shared by every process on it, so the phases between
  an Attention stamp and an FFN stamp (:data:`CROSS_PHASES`) need both ranks on one GPU; with
  one GPU per rank only the phases on one side are reported.

The rest are pure numpy functions on the rows: matching each Attention round trip with the FFN
replay that served it (:func:`match_round_trips`), the telescoping phases (:data:`PHASES`,
they sum to the round trip), their statistics (:func:`phase_summary`), each phase against its
floor (:func:`floor_rows`) and a stacked-bar plot.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

import bench_common as bc

#: Attention-side points of one round trip (one row per layer of a one-stage step)
ATTENTION_POINTS = ("a_send0", "a_planned", "a_sent", "a_wait0", "a_seen", "a_done")
#: graph-driven FFN points (one row per replay, idle replays included)
FFN_POINTS = ("f_seen", "f_staged", "f_gathered", "f_reply0", "f_reply1")

#: a combine launched with no afd_wait_replies right before it waits for the replies itself (a
#: small batch, kernels.combine_waits_itself): stamped a_wait0 before it and a_seen, a_done after
#: it, so "reply -> Attention wait returns" holds the whole combine and "combine" one stamp hop
SELF_WAITING_COMBINES = ("afd_combine", "afd_dedup_combine")

#: kernel name (without a template argument) -> (point stamped before it, point after it)
ATTENTION_STAMPS = {
    "afd_dispatch_plan": ("a_send0", "a_planned"),
    "afd_dispatch_scatter": (None, "a_sent"),
    "afd_dispatch_fused": ("a_send0", "a_sent"),  # plan + scatter in one kernel: no a_planned
    "afd_dedup_dispatch_fused": ("a_send0", "a_sent"),  # dedup: plan + rows + scatter in one
    "afd_dedup_scatter": (None, "a_sent"),
    "afd_wait_replies": ("a_wait0", "a_seen"),
    "afd_combine": (None, "a_done"),
    "afd_dedup_combine": (None, "a_done"),
}
FFN_STAMPS = {
    "afd_wait_any": (None, "f_seen"),
    "afd_graph_stage": (None, "f_staged"),
    "afd_graph_wait_stage": (None, "f_staged"),  # wait + stage in one kernel: no f_seen
    "afd_graph_gather": (None, "f_gathered"),
    "afd_graph_dedup_expand": (None, "f_gathered"),
    "afd_graph_reply": ("f_reply0", "f_reply1"),
    "afd_graph_dedup_reply": ("f_reply0", "f_reply1"),
}

#: (name, start point, end point), in round-trip order: consecutive, so they sum to the round trip
PHASES = (
    ("dispatch plan", "a_send0", "a_planned"),
    ("dispatch scatter (dedup: rows + scatter; fused: plan + scatter)", "a_planned", "a_sent"),
    ("doorbell -> FFN wait returns (fused: + stage)", "a_sent", "f_seen"),
    ("FFN stage", "f_seen", "f_staged"),
    ("FFN gather / expand", "f_staged", "f_gathered"),
    ("FFN experts", "f_gathered", "f_reply0"),
    ("FFN reply", "f_reply0", "f_reply1"),
    ("reply -> Attention wait returns", "f_reply1", "a_seen"),
    ("combine", "a_seen", "a_done"),
)
#: phases from one rank's stamp to another's: one clock only when both ranks share a GPU
CROSS_PHASES = ("doorbell -> FFN wait returns (fused: + stage)", "reply -> Attention wait returns")
#: the matched round trip less its "FFN experts" phase (the GEMMs and one stamp hop)
BEYOND_EXPERTS = "round trip - FFN experts (matched)"
#: phase -> the field of bench_common.KernelBytes its kernel moves (0: a wait, a flag and a
#: node, no payload; None: no floor, the expert GEMMs)
PHASE_BYTES = {
    "dispatch plan": 0,
    "dispatch scatter (dedup: rows + scatter; fused: plan + scatter)": "dispatch",
    "doorbell -> FFN wait returns (fused: + stage)": 0,
    "FFN stage": "stage",
    "FFN gather / expand": "expand",
    "FFN experts": None,
    "FFN reply": "reply",
    "reply -> Attention wait returns": 0,
    "combine": "combine",
}
#: not part of the sum: how long the Attention stream sat in its wait kernel
WAIT_PHASE = ("Attention in wait kernel", "a_wait0", "a_seen")


class DeviceTrace:
    """Stamps of ``points`` in a device ring of ``capacity`` rows (this process, current device).

    ``ring``: cupy int64 [capacity, len(points)], -1 where nothing was stamped; ``counter``:
    cupy int64 [1], rows closed so far (the ring wraps after ``capacity``)."""

    def __init__(self, points: Sequence[str], capacity: int = 1 << 16):
        if len(set(points)) != len(points) or not points or capacity < 1:
            raise ValueError(f"need distinct points and capacity >= 1, got {points}, {capacity}")
        import cupy

        from afd_cupy import kernels

        self.points, self.capacity = tuple(points), int(capacity)
        # the stamps launch through PackedLaunch.launch as it is now, not through an installed
        # wrapper (which would look each stamp up as a kernel to stamp around)
        self._launch = kernels.PackedLaunch.launch
        self.ring = cupy.full((self.capacity, len(self.points)), -1, cupy.int64)
        self.counter = cupy.zeros(1, cupy.int64)
        kernel = kernels.get_kernel("probes/bench.cu", "afd_trace_stamp")
        self._stamps = {}
        for index, point in enumerate(self.points):
            close = index == len(self.points) - 1
            args = {"ring": self.ring, "counter": self.counter, "point": np.int32(index),
                    "num_points": np.int32(len(self.points)), "capacity": np.int64(self.capacity),
                    "advance": np.int32(close)}
            self._stamps[point] = kernels.PackedLaunch(kernels.LaunchSpec(
                kernel, 1, 1, 0, tuple(args), tuple(args.values())))
        self._uninstall = None

    def stamp(self, stream_ptr: int, point: str) -> None:
        """Enqueue one stamp of ``point`` on the raw stream ``stream_ptr`` (the last point closes
        the row)."""
        self._launch(self._stamps[point], stream_ptr)

    def install(self, stamps: dict) -> None:
        """Stamp around every later ``PackedLaunch.launch`` of a kernel named in ``stamps``
        (name -> (point before, point after), either None) in this process."""
        from afd_cupy import kernels

        unknown = {p for pair in stamps.values() for p in pair if p is not None} - set(self.points)
        if unknown:
            raise ValueError(f"stamp points {sorted(unknown)} are not trace points {self.points}")
        if self._uninstall is not None:
            raise RuntimeError("this trace is installed already")
        inner = kernels.PackedLaunch.launch
        trace = self
        points_of = {}  # function pointer -> (name, before, after): a mangled name is parsed once
        last_kernel = {}  # stream -> the base name of the kernel launched last on it
        self_wait = "afd_wait_replies" in stamps and "a_wait0" in self.points

        def launch(packed, stream_ptr, grid=None):
            entry = points_of.get(packed.function_ptr)
            if entry is None:
                name = kernel_base_name(packed.spec.kernel)
                entry = points_of[packed.function_ptr] = (name,) + tuple(stamps.get(name, (None, None)))
            name, before, after = entry
            waits_itself = (self_wait and name in SELF_WAITING_COMBINES
                            and last_kernel.get(stream_ptr) != "afd_wait_replies")
            last_kernel[stream_ptr] = name
            if waits_itself:
                trace.stamp(stream_ptr, "a_wait0")
            elif before is not None:
                trace.stamp(stream_ptr, before)
            inner(packed, stream_ptr, grid)
            if waits_itself:
                trace.stamp(stream_ptr, "a_seen")
            if after is not None:
                trace.stamp(stream_ptr, after)

        kernels.PackedLaunch.launch = launch

        def uninstall():
            kernels.PackedLaunch.launch = inner
        self._uninstall = uninstall

    def uninstall(self) -> None:
        if self._uninstall is not None:
            self._uninstall()
            self._uninstall = None

    def reset(self) -> None:
        """Forget every row. Synchronizes the device after the fills (the traced streams need
        not be ordered after CuPy's current one); the caller makes sure nothing traced is queued."""
        import cupy

        self.ring.fill(-1)
        self.counter.fill(0)
        cupy.cuda.Device().synchronize()

    def rows(self) -> np.ndarray:
        """int64 [n, len(points)] rows closed so far, oldest first (the last ``capacity``);
        synchronizes the device."""
        import cupy

        cupy.cuda.Device().synchronize()
        count = int(self.counter.get()[0])
        ring = self.ring.get()
        if count <= self.capacity:
            return ring[:count].copy()
        start = count % self.capacity
        return np.concatenate([ring[start:], ring[:start]])


def kernel_base_name(kernel) -> str:
    """A RawKernel's function name without template arguments or namespaces. CuPy names a
    template instance by its mangled name (``_Z11afd_combineILi2EEvPv`` -> ``afd_combine``,
    ``_ZN3afd8afd_stepILi1EEEv`` -> ``afd_step``); an ``extern "C"`` kernel by its own name."""
    return base_name(str(getattr(kernel, "name", "")))


def base_name(name: str) -> str:
    """See :func:`kernel_base_name` (a plain or Itanium-mangled function name)."""
    if not name.startswith("_Z"):
        return name.split("<")[0]
    pos = 3 if name.startswith("_ZN") else 2
    last = name
    while pos < len(name) and name[pos].isdigit():
        end = pos
        while end < len(name) and name[end].isdigit():
            end += 1
        length = int(name[pos:end])
        last, pos = name[end:end + length], end + length
    return last


# --------------------------------------------------------------------------- pure functions

def match_round_trips(attention: np.ndarray, ffn: np.ndarray,
                      attention_points: Sequence[str] = ATTENTION_POINTS,
                      ffn_points: Sequence[str] = FFN_POINTS) -> tuple[dict, int]:
    """Pair each Attention row with the FFN replay that served it: the latest replay whose wait
    returned (``f_seen``) after the dispatch was published (``a_sent``) and whose reply ended
    (``f_reply1``) before the Attention wait returned (``a_seen``). Both arrays must carry stamps
    of one clock (one GPU). Returns (point name -> int64 [n] of the matched round trips, number of
    Attention rows without a match). A missing ``f_gathered`` (the identity pair graph has no
    gather) takes ``f_staged``'s value, and so does a missing ``f_seen`` (``afd_graph_wait_stage``
    waits and stages in one kernel): zero-length phases."""
    a = {p: attention[:, i] for i, p in enumerate(attention_points)}
    f = {p: ffn[:, i] for i, p in enumerate(ffn_points)}
    if "f_seen" in f and "f_staged" in f:
        f["f_seen"] = np.where(f["f_seen"] < 0, f["f_staged"], f["f_seen"])
    if "f_gathered" in f and "f_staged" in f:
        f["f_gathered"] = np.where(f["f_gathered"] < 0, f["f_staged"], f["f_gathered"])
    order = np.argsort(f["f_seen"], kind="stable")
    seen = f["f_seen"][order]
    matched_a, matched_f, unmatched = [], [], 0
    for i in range(attention.shape[0]):
        sent, back = a["a_sent"][i], a["a_seen"][i]
        if min(a[p][i] for p in attention_points) < 0:  # a stamp missing
            unmatched += 1
            continue
        lo, hi = np.searchsorted(seen, sent, "left"), np.searchsorted(seen, back, "right")
        pick = None
        for j in order[lo:hi][::-1]:  # latest first
            if 0 <= f["f_reply1"][j] <= back and min(f[p][j] for p in ffn_points) >= 0:
                pick = j
                break
        if pick is None:
            unmatched += 1
            continue
        matched_a.append(i)
        matched_f.append(pick)
    out = {p: a[p][matched_a] for p in attention_points}
    out.update({p: f[p][matched_f] for p in ffn_points})
    return out, unmatched


def fused_dispatch_rows(attention: np.ndarray) -> np.ndarray:
    """Rows of a fused dispatch (``afd_dispatch_fused``: no plan kernel, so no ``a_planned``
    stamp) get ``a_planned = a_send0``: a zero-length plan phase, the whole dispatch in the
    scatter phase. Other rows are unchanged (a copy)."""
    out = np.array(attention, np.int64, copy=True)
    if out.size:
        send0, planned = ATTENTION_POINTS.index("a_send0"), ATTENTION_POINTS.index("a_planned")
        fill = (out[:, planned] < 0) & (out[:, send0] >= 0)
        out[fill, planned] = out[fill, send0]
    return out


def phase_durations_us(points: dict, phases=PHASES) -> dict:
    """Phase name -> float64 [n] µs (``end - start`` of each matched round trip)."""
    return {name: (points[end] - points[start]) / 1e3 for name, start, end in phases}


def phase_summary(attention: np.ndarray, ffn: np.ndarray | None, *, same_clock: bool,
                  layers: int | None = None) -> dict:
    """Median / p10 / p90 µs of every phase, the round trip, the Attention's wait and (with
    ``layers``: rows come in steps of that many) the gap between layers of one step (attention,
    gate and residual); the phases' medians and their sum next to the round trip's median.
    ``ffn`` None or ``same_clock`` False: only the phases of the Attention side."""
    attention = fused_dispatch_rows(attention)
    a = {p: attention[:, i].astype(np.int64) for i, p in enumerate(ATTENTION_POINTS)}
    complete = np.all(attention >= 0, axis=1)
    stats = {}
    own = {
        "dispatch (plan + scatter)": a["a_sent"] - a["a_send0"],
        "sent -> Attention wait returns": a["a_seen"] - a["a_sent"],
        "combine": a["a_done"] - a["a_seen"],
        WAIT_PHASE[0]: a["a_seen"] - a["a_wait0"],
        "round trip": a["a_done"] - a["a_send0"],
    }
    for name, ns in own.items():
        stats[name] = stats_us(ns[complete] / 1e3)
    if layers and layers > 1:
        gaps = []
        for start in range(0, attention.shape[0] - layers + 1, layers):
            block = attention[start:start + layers]
            if np.all(block >= 0):
                gaps.extend((block[1:, 0] - block[:-1, -1]) / 1e3)
        stats["between layers (attention, gate, residual)"] = stats_us(gaps)
    report = {"rows": int(attention.shape[0]), "complete_rows": int(complete.sum()), "same_clock": same_clock,
              "phases": stats}
    if ffn is not None and same_clock:
        points, unmatched = match_round_trips(attention, ffn)
        durations = phase_durations_us(points)
        report["matched"], report["unmatched"] = len(points["a_send0"]), unmatched
        report["round_trip_phases"] = {name: stats_us(values) for name, values in durations.items()}
        report["phase_medians_sum_us"] = float(sum(s["median_us"] or 0.0
                                                   for s in report["round_trip_phases"].values()))
        round_trip = (points["a_done"] - points["a_send0"]) / 1e3
        report["matched_round_trip"] = stats_us(round_trip)
        # what the round trip costs beyond the expert GEMMs, per round trip (issue #13's "with
        # real experts <= GEMM time + 30 µs"); the experts phase holds one stamp hop as well
        report["beyond_experts"] = stats_us(round_trip - durations["FFN experts"])
    return report


def stats_us(values) -> dict:
    """{median_us, p10_us, p90_us, n} of µs values (None and 0 when empty)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {"median_us": None, "p10_us": None, "p90_us": None, "n": 0}
    return {"median_us": float(np.median(values)), "p10_us": float(np.percentile(values, 10)),
            "p90_us": float(np.percentile(values, 90)), "n": int(values.size)}


def phase_table(summaries: dict) -> tuple[tuple, list]:
    """(headers, rows) of a table: one column per traced case (label -> phase_summary), one row
    per phase (median µs)."""
    labels = list(summaries)
    names = [name for name, _, _ in PHASES]
    headers = ("phase (median µs)",) + tuple(labels)
    rows = []
    for name in names:
        rows.append((name,) + tuple(_median(summaries[lb].get("round_trip_phases", {}).get(name)) for lb in labels))
    rows.append(("sum of the phase medians",) + tuple(summaries[lb].get("phase_medians_sum_us") for lb in labels))
    rows.append(("round trip (matched)",) + tuple(_median(summaries[lb].get("matched_round_trip")) for lb in labels))
    rows.append((BEYOND_EXPERTS,) + tuple(_median(summaries[lb].get("beyond_experts")) for lb in labels))
    for name in ("round trip", WAIT_PHASE[0], "between layers (attention, gate, residual)"):
        rows.append((name + " [Attention clock]",) + tuple(_median(summaries[lb]["phases"].get(name)) for lb in labels))
    rows.append(("matched / unmatched rows",) + tuple(f"{summaries[lb].get('matched', '-')} / "
                                                       f"{summaries[lb].get('unmatched', '-')}" for lb in labels))
    return headers, rows


def floor_rows(summary: dict, kernel_bytes: dict, node_us: float, copy_gbps: float) -> list:
    """One :func:`bench_common.floor_row` per phase of a :func:`phase_summary` with matched round
    trips (``[]`` without): its median beside one node + the bytes its kernel moves
    (``kernel_bytes``: :meth:`bench_common.KernelBytes.as_dict`) at ``copy_gbps``. A phase with a
    zero median ran no kernel (the fused dispatch's plan, the identity graph's gather): no
    floor. Last row: the round trip beside the sum of the phase floors (the experts excluded)."""
    phases = summary.get("round_trip_phases")
    if not phases:
        return []
    rows = []
    for name, _, _ in PHASES:
        median = _median(phases.get(name))
        field = PHASE_BYTES[name]
        ran = median is not None and median > 0
        num_bytes = (kernel_bytes[field] if isinstance(field, str) else field) if ran else None
        rows.append(bc.floor_row(name, median, num_bytes, node_us, copy_gbps))
    floors = [r["floor_us"] for r in rows if r["floor_us"] is not None]
    total = {"name": "round trip (matched) / sum of the floors",
             "time_us": _median(summary.get("matched_round_trip")), "bytes": sum(r["bytes"] or 0 for r in rows),
             "floor_us": sum(floors) if floors else None}
    total["x_floor"] = (total["time_us"] / total["floor_us"]
                        if total["time_us"] is not None and total["floor_us"] else None)
    return rows + [total]


def measure_node_us(device) -> float:
    """µs per kernel node of a CUDA graph on this GPU (:func:`bench_common.measure_node_us`),
    the node being one one-thread ``afd_trace_stamp`` (a store, the least a kernel does)."""
    probe = DeviceTrace(("node", "end"), capacity=1)
    return bc.measure_node_us(lambda stream_ptr: probe.stamp(stream_ptr, "node"), device)


def _median(stats: dict | None):
    return None if not stats else stats["median_us"]


def draw_phases(summaries: dict, title: str):
    """A ``draw(plt)`` for ``bench_common.save_plot``: one horizontal stacked bar per traced
    case, the round trip's phases in order (medians, µs)."""
    def draw(plt):
        labels = [lb for lb in summaries if summaries[lb].get("round_trip_phases")]
        fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * max(1, len(labels))))
        colors = plt.get_cmap("tab10").colors
        for row, label in enumerate(labels):
            left = 0.0
            for k, (name, _, _) in enumerate(PHASES):
                width = summaries[label]["round_trip_phases"][name]["median_us"] or 0.0
                ax.barh(row, width, left=left, color=colors[k % len(colors)],
                        label=name if row == 0 else None)
                left += width
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("µs (median of each phase, %globaltimer)")
        ax.set_title(title)
        # the legend right of the bars: below them it covered the axis label
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1)
    return draw
