"""Every RawKernel of raw_kernels/ against its numpy reference, in one process on one GPU.

Windows are plain CuPy uint8 arrays of ``WindowLayout.window_bytes`` (F separate arrays act as
F peer windows), pre-filled with random bytes; each test rebuilds the whole expected window in
numpy and compares it byte for byte, so a wrong offset, a stray write or a missing row fails.
Payloads are random (never zeros); outputs are pre-filled with NaN / 0xFF garbage.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from afd_cupy import kernels, wire
from afd_cupy.routing import planner

from helpers import kernels as kh
from helpers.layouts import kernel_layout
from helpers.paths import TOOLS_DIR
from helpers.rng import node_rng

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.cuda

from afd_cupy.backends.cuda_attention import DispatchScratch  # noqa: E402 (imports torch)

DTYPES = ("bfloat16", "float16", "float32")
RAW = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}
NAN_WORD = {"bfloat16": 0xFFFF, "float16": 0xFFFF, "float32": 0xFFFFFFFF}
TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 2e-5}
NUM_EXPERTS = 10  # not a multiple of F = 3, 4: padded experts get zero counts
LONG_TIMEOUT_NS = 5_000_000_000


# --- helpers -----------------------------------------------------------------------------------
def to_raw(x: np.ndarray, dtype: str) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    if dtype == "float32":
        return x.view(np.uint32)
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    raw = np.ascontiguousarray(raw)
    if dtype == "float32":
        return raw.view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.astype(np.uint32) << 16).view(np.float32)


def random_rows(rng, num_rows: int, hidden: int, dtype: str) -> np.ndarray:
    """Raw payload words [num_rows, hidden] of random N(0, 1) values (never all zero)."""
    return to_raw(rng.standard_normal((num_rows, hidden)).astype(np.float32) + 0.01, dtype)


def put(window: np.ndarray, offset: int, values) -> None:
    data = np.ascontiguousarray(np.atleast_1d(values)).view(np.uint8).reshape(-1)
    window[offset:offset + data.size] = data


def take(window: np.ndarray, offset: int, dtype, count: int) -> np.ndarray:
    return window[offset:offset + count * np.dtype(dtype).itemsize].view(dtype)


def assert_window_equal(got: np.ndarray, want: np.ndarray, layout: wire.WindowLayout, what: str):
    """Byte-exact window comparison; a failure names the first differing slot and field."""
    diff = np.flatnonzero(got != want)
    if diff.size == 0:
        return
    offset = int(diff[0])
    if offset < layout.flags_bytes:
        where = f"flag word {offset // 8}"
    else:
        slot, within = divmod(offset - layout.flags_bytes, layout.slot_bytes)
        field = [f for f in wire.FIELD_NAMES if layout.field_offset(f) <= within][-1]
        where = (f"slot {slot} (region {slot // layout.ring_depth}, ring {slot % layout.ring_depth}) "
                 f"field {field} +{within - layout.field_offset(field)}")
    pytest.fail(f"{what}: {diff.size} bytes differ, first at byte {offset} = {where}")


def skewed_ids(rng, num_tokens, top_k, allowed_experts) -> np.ndarray:
    """int32 [T, K] ids drawn from ``allowed_experts`` with an unbalanced distribution."""
    allowed = np.asarray(allowed_experts)
    weights = 1.0 / (1.0 + np.arange(allowed.size)) ** 0.7
    return rng.choice(allowed, size=(num_tokens, top_k), p=weights / weights.sum()).astype(np.int32)


def sync():
    cp.cuda.runtime.deviceSynchronize()


def status_of(words) -> wire.StatusRecord:
    return wire.StatusRecord.decode(words)


class Dispatch:
    """One Attention rank (``src_rank``) dispatching to F peer windows through the two kernels."""

    def __init__(self, rng, *, dtype, num_ffn, num_tokens, top_k, hidden, has_shared, ids,
                 routed_cap=None, num_attn=2, ring_depth=2, ring=1, src_rank=1):
        self.rng, self.dtype, self.num_ffn, self.num_tokens, self.top_k = rng, dtype, num_ffn, num_tokens, top_k
        self.hidden, self.has_shared, self.ids, self.ring, self.src_rank = hidden, has_shared, ids, ring, src_rank
        self.epr = -(-NUM_EXPERTS // num_ffn)
        self.num_partials = num_tokens * top_k
        self.layout = kernel_layout(
            num_regions=max(num_attn, num_ffn), ring_depth=ring_depth, epr=self.epr, hidden=hidden,
            dtype=dtype, top_k=top_k, token_cap=max(num_tokens, 1),
            routed_cap=routed_cap if routed_cap is not None else max(self.num_partials, 1),
            has_shared=has_shared, num_ffn=num_ffn)
        self.hidden_raw = random_rows(rng, num_tokens, hidden, dtype)
        self.hidden_dev = cp.asarray(random_rows(rng, max(num_tokens, 1), hidden, dtype))
        self.hidden_dev[:num_tokens] = cp.asarray(self.hidden_raw)
        self.prefill = [rng.integers(0, 256, self.layout.window_bytes, dtype=np.uint8) for _ in range(num_ffn)]
        self.windows = [cp.asarray(p) for p in self.prefill]
        self.peer_windows = cp.asarray([w.data.ptr for w in self.windows], dtype=cp.uint64)
        self.scratch = DispatchScratch.allocate(self.num_partials + 300, num_ffn, self.epr)
        for arr in (self.scratch.chunk_hist, self.scratch.local_rank, self.scratch.expert_counts,
                    self.scratch.expert_start, self.scratch.rank_offsets, self.scratch.verdict):
            arr.fill(-7)
        self.pos_out = cp.full(self.num_partials + 5, -1, cp.int32)
        # seq counters on both sides of 2**32 so the header's low-32 truncation is exercised
        self.seq_before = rng.integers(1, 1000, num_ffn).astype(np.int64) + (np.arange(num_ffn) % 2) * (2**32 - 500)
        self.seq_counters = cp.asarray(self.seq_before)
        self.expected = cp.full(num_ffn, -5, cp.int64)
        self.expected_counts = cp.full((num_ffn, 2), -5, cp.int32)
        self.status = kernels.PinnedInt64(wire.STATUS_WORDS)
        self.layer_idx, self.stage_idx = int(rng.integers(0, 60)), int(rng.integers(0, 3))
        self.topk_ids = cp.asarray(ids.reshape(-1))

    def run(self, fused: bool = False):
        if fused:
            self.run_fused()
        else:
            self.run_plan()
            self.run_scatter()

    def _dispatch_args(self) -> dict:
        """The arguments the scatter and the fused kernel share."""
        scratch = self.scratch
        return dict(
            dtype_code=kernels.DTYPE_CODES[self.dtype], hidden=self.hidden_dev.data.ptr,
            num_tokens=self.num_tokens, hidden_size=self.hidden, topk_ids=self.topk_ids,
            num_partials=self.num_partials, top_k=self.top_k, expert_per_rank=self.epr,
            num_ffn_ranks=self.num_ffn, expert_start=scratch.expert_start,
            rank_offsets=scratch.rank_offsets, expert_counts=scratch.expert_counts,
            verdict=scratch.verdict, peer_windows=self.peer_windows,
            geo=self.layout.kernel_geometry(), ring=self.ring, has_shared=self.has_shared,
            pos_out=self.pos_out, src_rank=self.src_rank, layer_idx=self.layer_idx,
            stage_idx=self.stage_idx, hdr_flags=wire.FLAG_FP8 if self.fp8_rows else 0,
            seq_counters=self.seq_counters, expected=self.expected, expected_counts=self.expected_counts,
            done_counter=scratch.scatter_done)

    def run_fused(self):
        """afd_dispatch_fused: plan and scatter in one kernel (block 0 writes the plan outputs)."""
        kernels.dispatch_fused_spec(routed_cap=self.layout.routed_cap, skipped=self.scratch.skipped,
                                    status=self.status.ptr, **self._dispatch_args()).launch()
        sync()

    def run_plan(self):
        scratch = self.scratch
        kh.launch_dispatch_plan(
            topk_ids=self.topk_ids, num_partials=self.num_partials, num_ffn_ranks=self.num_ffn,
            expert_per_rank=self.epr, routed_cap=self.layout.routed_cap, layer_idx=self.layer_idx,
            chunk_hist=scratch.chunk_hist,
            local_rank=scratch.local_rank, expert_counts=scratch.expert_counts,
            expert_start=scratch.expert_start, rank_offsets=scratch.rank_offsets,
            verdict=scratch.verdict, done_counter=scratch.plan_done, status=self.status.ptr)
        sync()

    def run_scatter(self):
        kh.launch_dispatch_scatter(chunk_hist=self.scratch.chunk_hist,
                                   local_rank=self.scratch.local_rank, **self._dispatch_args())
        sync()

    def reference(self) -> planner.DispatchPlan:
        return planner.plan_dispatch_reference(self.ids, self.num_ffn, self.epr, num_experts=self.num_ffn * self.epr)

    def shared_rows(self, ffn_rank: int) -> int:
        return planner.shared_count(self.num_tokens, self.num_ffn, ffn_rank) if self.has_shared else 0

    #: the rows travel as FP8 wire rows with FLAG_FP8 (test_fp8_cuda.FP8Dispatch)
    fp8_rows = False

    def sent_rows(self) -> np.ndarray:
        """The rows as the windows must hold them, one per token: the payload here."""
        return self.hidden_raw

    def expected_window(self, ffn_rank: int, plan: planner.DispatchPlan, seq: int) -> np.ndarray:
        layout, j = self.layout, ffn_rank
        want = self.prefill[j].copy()
        base = layout.slot_offset(self.src_rank, self.ring)
        put(want, layout.slot_index(self.src_rank, self.ring) * 8, np.int64(seq))
        header = wire.dispatch_header(seq=seq, src_rank=self.src_rank, layer_idx=self.layer_idx,
                                      stage_idx=self.stage_idx, num_tokens=self.num_tokens,
                                      shared_tokens=self.shared_rows(j), top_k=self.top_k,
                                      expert_counts=plan.rank_counts(j), fp8=self.fp8_rows)
        put(want, base + layout.field_offset("header"), wire.encode_header(header, self.epr))
        put(want, base + layout.field_offset("route_table"), plan.rank_route_table(j))
        rows = self.sent_rows()
        tokens = plan.order[plan.rank_offsets[j]:plan.rank_offsets[j + 1]] // self.top_k
        put(want, base + layout.field_offset("routed_x"), rows[tokens])
        if self.has_shared:
            idx = planner.shared_split(self.num_tokens, self.num_ffn, j)
            put(want, base + layout.field_offset("shared_idx"), idx)
            put(want, base + layout.field_offset("shared_x"), rows[idx])
        return want

    def assert_sent_as_planned(self, plan: planner.DispatchPlan) -> None:
        """Every peer window holds what ``expected_window`` says for the next seq."""
        for j in range(self.num_ffn):
            assert_window_equal(self.windows[j].get(), self.expected_window(j, plan, int(self.seq_before[j]) + 1),
                                self.layout, f"peer {j}")


# --- wire constants ----------------------------------------------------------------------------
def test_wire_constants_read_back_equal_wire_py():
    """Constants, limits, dtype helpers and the SlotGeometry layout (sizeof, offsets)."""
    got = kh.read_wire_constants()
    want = kh.expected_wire_constants()
    mismatched = {name: (got[name], want[name]) for name in want if got[name] != want[name]}
    assert not mismatched, f"device value, expected: {mismatched}"


def test_pinned_int64_is_device_visible():
    pinned = kernels.PinnedInt64(3)
    assert pinned.array.tolist() == [0, 0, 0] and pinned.int32.shape == (6,)
    pinned.array[:] = [5, -6, 2**40]
    mem = cp.cuda.UnownedMemory(pinned.ptr, 24, pinned, device_id=cp.cuda.runtime.getDevice())
    view = cp.ndarray((3,), cp.int64, cp.cuda.MemoryPointer(mem, 0))
    assert view.get().tolist() == [5, -6, 2**40]
    view += 1
    sync()
    assert pinned.array.tolist() == [6, -5, 2**40 + 1]


# --- device trace probe (tools/device_trace.py) ------------------------------------------------
def trace_stamp_reference(calls, num_points: int, capacity: int):
    """Which call last wrote each cell of the [capacity, num_points] ring, and the final counter,
    for calls of (point, advance) in stream order."""
    row, writer = 0, {}
    for k, (point, advance) in enumerate(calls):
        writer[(row % capacity, point)] = k
        row += advance
    return writer, row


def test_trace_stamp_matches_reference(request):
    """afd_trace_stamp against its reference on a random call sequence that wraps the ring: the
    cells written, the counter, untouched cells keep the -1 fill, and the values written are
    %globaltimer readings in launch order (non-decreasing, positive)."""
    rng = node_rng(request)
    num_points, capacity = 3, 4
    calls = [(int(p), int(rng.random() < 0.4)) for p in rng.integers(0, num_points, 40)]
    writer, rows = trace_stamp_reference(calls, num_points, capacity)
    assert rows > capacity  # the case wraps
    ring = cp.full((capacity, num_points), -1, cp.int64)
    counter = cp.zeros(1, cp.int64)
    kernel = kernels.get_kernel("probes/bench.cu", "afd_trace_stamp")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for point, advance in calls:
            kernel((1,), (1,), (ring, counter, np.int32(point), np.int32(num_points),
                                np.int64(capacity), np.int32(advance)))
    stream.synchronize()
    got = ring.get()
    assert int(counter.get()[0]) == rows
    written = np.zeros(got.shape, bool)
    for cell in writer:
        written[cell] = True
    assert np.all(got[~written] == -1) and np.all(got[written] > 0)
    in_launch_order = [int(got[cell]) for cell in sorted(writer, key=writer.get)]
    assert in_launch_order == sorted(in_launch_order)


def test_device_trace_stamps_around_a_launch_inside_a_captured_graph():
    """DeviceTrace.install stamps before and after a named kernel's PackedLaunch, also while a
    CUDA graph is captured: each replay fills a new row (the row comes from device memory) and
    the kernel's own %globaltimer stamp lies between the row's two; uninstall restores the
    launch (no more rows)."""
    import sys

    import torch
    sys.path.insert(0, str(TOOLS_DIR))
    import device_trace as dt

    trace = dt.DeviceTrace(("before", "after"), capacity=8)
    flag, stamps = cp.zeros(1, cp.int64), cp.zeros(4, cp.int64)
    args = {"flag_addr": np.uint64(flag.data.ptr), "value": np.int64(7), "stamps": stamps, "index": np.int32(0)}
    probe = kernels.PackedLaunch(kernels.LaunchSpec(kernels.get_kernel("probes/bench.cu", "afd_bench_stamp"),
                                                    1, 1, 0, tuple(args), tuple(args.values())))
    original = kernels.PackedLaunch.launch
    trace.install({"afd_bench_stamp": ("before", "after")})
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            probe.launch(torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert trace.rows().shape == (0, 2)  # capturing runs nothing
        for _ in range(3):
            graph.replay()
        rows = trace.rows()
        assert rows.shape == (3, 2) and np.all(rows > 0)
        assert np.all(rows[:, 0] <= rows[:, 1]) and np.all(rows[1:, 0] >= rows[:-1, 1])
        assert rows[-1, 0] <= int(stamps.get()[0]) <= rows[-1, 1] and int(flag.get()[0]) == 7
    finally:
        trace.uninstall()
    assert kernels.PackedLaunch.launch is original
    probe.launch(cp.cuda.get_current_stream().ptr)
    assert trace.rows().shape == (3, 2)
    # the names the stamps key on, for a template instance (CuPy keeps its mangled name) too
    assert dt.kernel_base_name(kernels.get_kernel("attention/combine.cu", "afd_combine", dtype_code=0)) == "afd_combine"
    assert dt.kernel_base_name(kernels.get_kernel("ffn/ffn_graph_rows.cu", "afd_graph_dedup_reply", dtype_code=0)) == \
        "afd_graph_dedup_reply"
    assert dt.kernel_base_name(kernels.get_kernel("ffn/wait_any.cu", "afd_wait_any")) == "afd_wait_any"


# --- dispatch ----------------------------------------------------------------------------------
DISPATCH_CASES = [(f, t) for f in (1, 2, 3, 4) for t in (0, 1, 7, 300)]
TOP_KS = (1, 2, 6, 8)
HIDDENS = (64, 33, 50)  # 16-B rows, 2-B-only rows (bf16/fp16), 4-B rows


@pytest.mark.parametrize("fused", [False, True], ids=["plan+scatter", "fused"])
@pytest.mark.parametrize("has_shared", [0, 1])
@pytest.mark.parametrize("num_ffn,num_tokens", DISPATCH_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_matches_reference(request, dtype, num_ffn, num_tokens, has_shared, fused):
    rng = node_rng(request)
    case = DISPATCH_CASES.index((num_ffn, num_tokens)) + has_shared + DTYPES.index(dtype)
    top_k, hidden = TOP_KS[case % 4], HIDDENS[case % 3]
    epr = -(-NUM_EXPERTS // num_ffn)
    drop_last_rank = num_ffn > 1 and case % 2 == 0  # an FFN rank without routed partials
    allowed = np.arange(min(NUM_EXPERTS, (num_ffn - drop_last_rank) * epr))
    ids = skewed_ids(rng, num_tokens, top_k, allowed)
    d = Dispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                 hidden=hidden, has_shared=has_shared, ids=ids)
    d.run(fused=fused)

    assert status_of(d.status.array).ok
    plan = d.reference()
    nk = d.num_partials
    np.testing.assert_array_equal(d.scratch.expert_counts.get(), plan.expert_counts)
    np.testing.assert_array_equal(d.scratch.expert_start.get(), np.cumsum(plan.expert_counts) - plan.expert_counts)
    np.testing.assert_array_equal(d.scratch.rank_offsets.get(), plan.rank_offsets)
    pos_out = d.pos_out.get()
    np.testing.assert_array_equal(pos_out[:nk], plan.pos.reshape(-1))
    assert (pos_out[nk:] == -1).all()
    assert int(d.scratch.plan_done.get()[0]) == 0 and int(d.scratch.scatter_done.get()[0]) == 0
    assert int(d.scratch.verdict.get()[0]) == wire.STATUS_OK

    expected, seq_after = d.expected.get(), d.seq_counters.get()
    expected_counts = d.expected_counts.get()
    for j in range(num_ffn):
        non_empty = plan.routed_count(j) + d.shared_rows(j) > 0
        seq = int(d.seq_before[j]) + 1 if non_empty else 0
        assert expected[j] == seq, f"expected[{j}]"
        assert expected_counts[j].tolist() == [plan.routed_count(j), d.shared_rows(j)], f"expected_counts[{j}]"
        assert seq_after[j] == d.seq_before[j] + non_empty, f"seq_counters[{j}]"
        got = d.windows[j].get()
        if not non_empty:
            assert_window_equal(got, d.prefill[j], d.layout, f"empty peer {j} was written")
            continue
        base = d.layout.slot_offset(d.src_rank, d.ring)
        header = wire.decode_header(take(got, base + d.layout.field_offset("header"), np.int32,
                                         d.layout.header_words), d.epr)
        assert header.seq == seq & 0xFFFFFFFF and header.routed_tokens == plan.routed_count(j)
        assert header.shared_tokens == d.shared_rows(j) and header.expert_counts == tuple(plan.rank_counts(j))
        assert_window_equal(got, d.expected_window(j, plan, seq), d.layout, f"peer {j}")
    if drop_last_rank and not has_shared:
        assert expected[num_ffn - 1] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_large_batch_grid_stride(request, dtype):
    """More rows than 1024 blocks x 8 warps: the grid-stride loops and many plan chunks."""
    rng = node_rng(request)
    ids = skewed_ids(rng, 1500, 8, np.arange(NUM_EXPERTS))
    d = Dispatch(rng, dtype=dtype, num_ffn=3, num_tokens=1500, top_k=8, hidden=64, has_shared=1, ids=ids)
    d.run()
    assert status_of(d.status.array).ok
    plan = d.reference()
    np.testing.assert_array_equal(d.pos_out.get()[:d.num_partials], plan.pos.reshape(-1))
    d.assert_sent_as_planned(plan)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_dispatch_grid_stride(request, dtype):
    """afd_dispatch_fused with more rows than 1024 blocks x 8 warps (8800 partials + 1100
    shared rows), still within its shared memory: every block plans all 8800 ids."""
    rng = node_rng(request)
    ids = skewed_ids(rng, 1100, 8, np.arange(NUM_EXPERTS))
    d = Dispatch(rng, dtype=dtype, num_ffn=2, num_tokens=1100, top_k=8, hidden=64, has_shared=1, ids=ids)
    assert kernels.fused_dispatch_fits(d.num_partials, d.num_ffn * d.epr)
    d.run(fused=True)
    assert status_of(d.status.array).ok
    plan = d.reference()
    np.testing.assert_array_equal(d.pos_out.get()[:d.num_partials], plan.pos.reshape(-1))
    d.assert_sent_as_planned(plan)
    assert int(d.scratch.scatter_done.get()[0]) == 0 and int(d.scratch.skipped.get()[0]) == 0


def test_fused_dispatch_publishes_nothing_when_a_block_skipped(request):
    """The fused kernel's last block sends only if no block saw an earlier error: with the
    `skipped` word set (as a block that read a latched status would set it) no flag, header,
    seq or expected is written, and the word is left zero for the next dispatch."""
    rng = node_rng(request)
    ids = skewed_ids(rng, 40, 2, np.arange(NUM_EXPERTS))
    d = Dispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=40, top_k=2, hidden=64, has_shared=1, ids=ids)
    d.scratch.skipped.fill(1)
    d.run(fused=True)
    assert_skipped_dispatch_published_nothing(d)


def assert_skipped_dispatch_published_nothing(d):
    """After a one-kernel dispatch (pair ``Dispatch`` or dedup ``DedupDispatch``) that found its
    ``skipped`` word set: status OK, nothing expected, seq counters, every peer's flag and header
    as before, and ``skipped`` and the done counter left zero."""
    assert status_of(d.status.array).ok
    assert (d.expected.get() == 0).all()
    np.testing.assert_array_equal(d.seq_counters.get(), d.seq_before)
    for j in range(d.num_ffn):
        got = d.windows[j].get()
        flag_at = d.layout.slot_index(d.src_rank, d.ring) * 8
        assert (got[flag_at:flag_at + 8] == d.prefill[j][flag_at:flag_at + 8]).all(), f"peer {j} flagged"
        header_at = d.layout.slot_offset(d.src_rank, d.ring) + d.layout.field_offset("header")
        nbytes = 4 * d.layout.header_words
        assert (got[header_at:header_at + nbytes] == d.prefill[j][header_at:header_at + nbytes]).all()
    assert int(d.scratch.skipped.get()[0]) == 0 and int(d.scratch.scatter_done.get()[0]) == 0


def test_fused_dispatch_spec_refuses_what_does_not_fit():
    layout = kernel_layout(num_regions=2, ring_depth=2, epr=NUM_EXPERTS, hidden=64, dtype="bfloat16",
                         top_k=8, token_cap=2000, routed_cap=16000, has_shared=1, num_ffn=1)
    assert not kernels.fused_dispatch_fits(16000, NUM_EXPERTS)
    buf = cp.zeros(16000, cp.int32)
    with pytest.raises(ValueError, match="shared memory"):
        kernels.dispatch_fused_spec(
            dtype_code=0, hidden=buf.data.ptr, num_tokens=2000, hidden_size=64, topk_ids=buf,
            num_partials=16000, top_k=8, expert_per_rank=NUM_EXPERTS, num_ffn_ranks=1, routed_cap=16000,
            expert_counts=buf, expert_start=buf, rank_offsets=buf, verdict=buf, skipped=buf,
            peer_windows=cp.zeros(1, cp.uint64), geo=layout.kernel_geometry(), ring=0, has_shared=1,
            pos_out=buf, src_rank=0, layer_idx=0, stage_idx=0, hdr_flags=0,
            seq_counters=cp.zeros(1, cp.int64), expected=cp.zeros(1, cp.int64),
            expected_counts=buf, done_counter=cp.zeros(1, cp.uint32), status=buf.data.ptr)


def _assert_nothing_sent(d: Dispatch, verdict: int):
    assert int(d.scratch.verdict.get()[0]) == verdict
    assert (d.expected.get() == 0).all()
    np.testing.assert_array_equal(d.seq_counters.get(), d.seq_before)
    for j in range(d.num_ffn):
        assert_window_equal(d.windows[j].get(), d.prefill[j], d.layout, f"peer {j} written after an error")
    assert int(d.scratch.plan_done.get()[0]) == 0 and int(d.scratch.scatter_done.get()[0]) == 0


@pytest.mark.parametrize("fused", [False, True], ids=["plan+scatter", "fused"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dispatch_capacity_writes_nothing(request, dtype, fused):
    rng = node_rng(request)
    num_ffn, num_tokens, top_k = 3, 50, 4
    ids = skewed_ids(rng, num_tokens, top_k, np.arange(NUM_EXPERTS))
    epr = -(-NUM_EXPERTS // num_ffn)
    plan = planner.plan_dispatch_reference(ids, num_ffn, epr)
    counts = [plan.routed_count(j) for j in range(num_ffn)]
    cap = sorted(counts)[1]  # between the smallest and the largest: at least one rank overflows
    first_over = next(j for j, c in enumerate(counts) if c > cap)
    d = Dispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k, hidden=64,
                 has_shared=1, ids=ids, routed_cap=cap)
    d.run(fused=fused)
    assert status_of(d.status.array) == wire.StatusRecord(
        wire.STATUS_CAPACITY, first_over, -1, -1, -1, -1, counts[first_over], cap, d.layer_idx)
    _assert_nothing_sent(d, wire.STATUS_CAPACITY)


def test_capacity_latched_in_a_device_status_block_reaches_the_mirror(request):
    """The cuda backend's layout: status in device memory, read through the pinned mirror."""
    rng = node_rng(request)
    ids = skewed_ids(rng, 40, 2, np.arange(NUM_EXPERTS))
    d = Dispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=40, top_k=2, hidden=64, has_shared=1,
                 ids=ids, routed_cap=1)
    d.status = block = kernels.StatusBlock.allocate()
    stream = cp.cuda.Stream(non_blocking=True)
    d.run()
    assert block.read().ok  # nothing mirrored yet
    block.enqueue_mirror(stream.ptr)
    stream.synchronize()
    status = block.read()
    assert (status.name, status.cap) == ("CAPACITY", 1)
    _assert_nothing_sent(d, wire.STATUS_CAPACITY)
    block.clear(stream.ptr)
    stream.synchronize()
    device_words = cp.ndarray((wire.STATUS_WORDS,), cp.int64, cp.cuda.MemoryPointer(
        cp.cuda.UnownedMemory(block.ptr, block.NBYTES, block), 0))
    assert block.host.tolist() == device_words.get().tolist() == [0] * wire.STATUS_WORDS


@pytest.mark.parametrize("fused", [False, True], ids=["plan+scatter", "fused"])
def test_dispatch_after_latched_error_writes_nothing(request, fused):
    rng = node_rng(request)
    ids = skewed_ids(rng, 20, 2, np.arange(NUM_EXPERTS))
    d = Dispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=20, top_k=2, hidden=64, has_shared=1, ids=ids)
    d.status.array[:] = [wire.STATUS_TIMEOUT, 1, 3, 1, 9, 8, -1, -1, 7]
    d.run(fused=fused)
    assert d.status.array.tolist() == [wire.STATUS_TIMEOUT, 1, 3, 1, 9, 8, -1, -1, 7]
    _assert_nothing_sent(d, wire.STATUS_TIMEOUT)
    np.testing.assert_array_equal(d.scratch.rank_offsets.get(), d.reference().rank_offsets)


def test_scatter_follows_the_plan_verdict_not_the_status_block(request):
    """The send decision is made once, by the plan: a status written between plan and scatter
    (another stream's combine latching an error, the host clearing one) does not split it."""
    rng = node_rng(request)
    ids = skewed_ids(rng, 20, 2, np.arange(NUM_EXPERTS))
    d = Dispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=20, top_k=2, hidden=64, has_shared=1, ids=ids)
    d.run_plan()
    assert int(d.scratch.verdict.get()[0]) == wire.STATUS_OK
    d.status.array[:] = [wire.STATUS_TIMEOUT, 1, 3, 1, 9, 8, -1, -1, 7]  # latched after the plan
    d.run_scatter()
    plan = d.reference()
    d.assert_sent_as_planned(plan)  # sent completely: rows, header and flag
    e = Dispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=20, top_k=2, hidden=64, has_shared=1, ids=ids)
    e.status.array[:] = [wire.STATUS_TIMEOUT, 1, 3, 1, 9, 8, -1, -1, 7]
    e.run_plan()
    e.status.array[:] = 0  # cleared after the plan decided
    e.run_scatter()
    _assert_nothing_sent(e, wire.STATUS_TIMEOUT)


@pytest.mark.parametrize("fused", [False, True], ids=["plan+scatter", "fused"])
def test_dispatch_bad_expert_id_writes_nothing(request, fused):
    rng = node_rng(request)
    num_ffn = 4
    epr = -(-NUM_EXPERTS // num_ffn)
    ids = skewed_ids(rng, 30, 2, np.arange(NUM_EXPERTS))
    ids[17, 1] = num_ffn * epr  # first id past the padded experts
    d = Dispatch(rng, dtype="float16", num_ffn=num_ffn, num_tokens=30, top_k=2, hidden=64, has_shared=0, ids=ids)
    d.run(fused=fused)
    status = status_of(d.status.array)
    assert status.name == "BAD_EXPERT"
    assert (status.slot, status.expected, status.observed) == (17 * 2 + 1, num_ffn * epr, num_ffn * epr)
    assert status.layer == d.layer_idx  # the failing dispatch's layer, latched by the plan
    _assert_nothing_sent(d, wire.STATUS_BAD_EXPERT)


# --- combine -----------------------------------------------------------------------------------
class Combine:
    """The Attention rank's own window with replies from F FFN ranks written in by hand."""

    def __init__(self, rng, *, dtype, num_ffn, num_tokens, top_k, hidden, has_shared, ids,
                 ring_depth=2, ring=0, num_attn=2):
        self.rng, self.dtype, self.num_ffn, self.num_tokens, self.top_k = rng, dtype, num_ffn, num_tokens, top_k
        self.hidden, self.has_shared, self.ring, self.ids = hidden, has_shared, ring, ids
        self.epr = -(-NUM_EXPERTS // num_ffn)
        self.plan = planner.plan_dispatch_reference(ids, num_ffn, self.epr, num_experts=num_ffn * self.epr)
        self.layout = kernel_layout(
            num_regions=max(num_attn, num_ffn), ring_depth=ring_depth, epr=self.epr, hidden=hidden,
            dtype=dtype, top_k=top_k, token_cap=max(num_tokens, 1),
            routed_cap=max(num_tokens * top_k, 1), has_shared=has_shared, num_ffn=num_ffn)
        self.window_np = rng.integers(0, 256, self.layout.window_bytes, dtype=np.uint8)
        self.last_seen_before = take(self.window_np, 0, np.int64, self.layout.num_slots).copy()
        self.routed = [random_rows(rng, self.plan.routed_count(j), hidden, dtype) for j in range(num_ffn)]
        self.shared = [random_rows(rng, self.shared_rows(j), hidden, dtype) for j in range(num_ffn)]
        self.expected = np.array([int(rng.integers(1, 2**40)) if self.non_empty(j) else 0
                                  for j in range(num_ffn)], np.int64)
        self.expected_counts = np.array([[self.plan.routed_count(j), self.shared_rows(j)]
                                         for j in range(num_ffn)], np.int32)
        self.layer_idx, self.stage_idx = 3, 1
        self.weights = (rng.random((num_tokens, top_k)) + 0.1).astype(np.float32)
        self.status = kernels.PinnedInt64(wire.STATUS_WORDS)
        self.done = cp.zeros(1, cp.uint32)
        self.out = cp.full((max(num_tokens, 1), hidden), NAN_WORD[dtype], dtype=RAW[dtype])
        self.new_flags = {}

    def shared_rows(self, j):
        return planner.shared_count(self.num_tokens, self.num_ffn, j) if self.has_shared else 0

    def non_empty(self, j):
        return self.plan.routed_count(j) + self.shared_rows(j) > 0

    def reply_words(self, j, **overrides) -> np.ndarray:
        """The correct reply header of FFN rank ``j`` with ``overrides`` (Header fields, or
        ``magic`` / ``version`` words)."""
        fields = dict(seq=int(self.rng.integers(1, 2**31)), src_rank=j, layer_idx=self.layer_idx,
                      stage_idx=self.stage_idx, num_tokens=self.num_tokens,
                      routed_tokens=self.plan.routed_count(j), shared_tokens=self.shared_rows(j),
                      top_k=self.top_k, flags=0, echo_seq=int(self.expected[j]),
                      expert_counts=tuple(int(c) for c in self.plan.rank_counts(j)))
        words_over = {name: overrides.pop(name) for name in ("magic", "version") if name in overrides}
        fields.update(overrides)
        words = wire.encode_header(wire.Header(**fields), self.epr)
        for name, value in words_over.items():
            words[wire.HDR_MAGIC if name == "magic" else wire.HDR_VERSION] = value
        return words

    def write_reply(self, j, *, words=None, arrive=True, **overrides):
        layout = self.layout
        slot = layout.slot_index(j, self.ring)
        base = layout.slot_offset(j, self.ring)
        words = self.reply_words(j, **overrides) if words is None else words
        put(self.window_np, base + layout.field_offset("header"), words)
        put(self.window_np, base + layout.field_offset("routed_x"), self.routed[j])
        put(self.window_np, base + layout.field_offset("shared_x"), self.shared[j])
        if arrive:
            flag = int(self.last_seen_before[slot]) + int(self.rng.integers(1, 1000))
            self.new_flags[slot] = flag
            put(self.window_np, slot * 8, np.int64(flag))

    def run(self, *, timeout_ns=LONG_TIMEOUT_NS, out_scale=1.0, wait_kernel=True, combine=True,
            reply_flags=None):
        """Launch afd_wait_replies (as the connector does; optional) then afd_combine (optional).
        ``reply_flags``: int64 [F + 1] start value (zeros by default), left in ``self.reply_flags``."""
        self.window = cp.asarray(self.window_np)
        self.last_seen = cp.asarray(self.last_seen_before)
        self.reply_flags = cp.zeros(self.num_ffn + 1, cp.int64) if reply_flags is None else cp.asarray(reply_flags)
        kernels.get_kernel("attention/combine.cu", "afd_combine", dtype_code=kernels.DTYPE_CODES[self.dtype])  # compile
        kernels.get_kernel("attention/combine.cu", "afd_wait_replies")
        replies = dict(window=self.window.data.ptr, geo=self.layout.kernel_geometry(),
                       num_ffn_ranks=self.num_ffn, ring=self.ring, expected=cp.asarray(self.expected),
                       expected_counts=cp.asarray(self.expected_counts), layer_idx=self.layer_idx,
                       stage_idx=self.stage_idx, last_seen=self.last_seen,
                       reply_flags=self.reply_flags, timeout_ns=timeout_ns, status=self.status.ptr)
        sync()
        start = time.perf_counter()
        if wait_kernel:
            kh.launch_wait_replies(**replies)
        if combine:
            kh.launch_combine(
                dtype_code=kernels.DTYPE_CODES[self.dtype], out=self.out.data.ptr,
                num_tokens=self.num_tokens, hidden_size=self.hidden, topk_ids=cp.asarray(self.ids.reshape(-1)),
                topk_weights=cp.asarray(self.weights.reshape(-1)), pos=cp.asarray(self.plan.pos.reshape(-1)),
                top_k=self.top_k, expert_per_rank=self.epr, has_shared=self.has_shared,
                out_scale=out_scale, done_counter=self.done, **replies)
        sync()
        return time.perf_counter() - start

    def reference(self, out_scale):
        routed = [to_f32(r, self.dtype).reshape(-1, self.hidden) for r in self.routed]
        shared = [to_f32(s, self.dtype).reshape(-1, self.hidden) for s in self.shared] if self.has_shared else None
        return planner.combine_reference(self.ids, self.weights, self.plan.pos, self.epr, routed, shared, out_scale)

    def assert_rows_nan(self):
        got = to_f32(self.out.get()[:self.num_tokens], self.dtype)
        assert np.isnan(got).all()

    def assert_last_seen_unchanged(self):
        np.testing.assert_array_equal(self.last_seen.get(), self.last_seen_before)


COMBINE_CASES = [  # num_ffn, num_tokens, top_k, has_shared, hidden, out_scale
    (1, 1, 1, 0, 64, 1.0), (2, 7, 2, 1, 33, 0.5), (3, 300, 6, 1, 64, 2.5), (4, 300, 8, 0, 50, 1.0),
    (4, 7, 8, 1, 64, 1.0), (3, 0, 2, 1, 64, 1.0), (2, 1, 6, 1, 72, 1.0), (2, 1300, 2, 1, 64, 0.25),
    (4, 2, 1, 1, 40, 1.0),
    # wide rows: more 16-byte vectors per row than threads per block (7168 bf16 = 896 over
    # 256 threads; 4104 leaves a partial last pass), top-5 and top-8
    (2, 5, 8, 1, 7168, 1.0), (3, 9, 5, 0, 4104, 0.5),
    # a token's row in parts, a block each (kernels.combine_parts: 1 token, 7168 bf16 = 4 parts;
    # fp32 7); rows not 16-byte aligned (4105: the element path in parts); top-12 = a full and a
    # partial batch of loads
    (1, 1, 8, 1, 7168, 1.0), (2, 3, 6, 1, 4105, 1.0), (2, 4, 12, 1, 7168, 0.5),
    # more FFN ranks than a warp has lanes (the wait preloads ranks < 32 per lane): every rank
    # gets a shared row, ranks >= 10 nothing routed
    (40, 45, 2, 1, 64, 1.0)]


@pytest.mark.parametrize("wait_kernel", [True, False], ids=["wait+combine", "combine-alone"])
@pytest.mark.parametrize("case", COMBINE_CASES, ids=[str(c) for c in COMBINE_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_matches_reference(request, dtype, case, wait_kernel):
    num_ffn, num_tokens, top_k, has_shared, hidden, out_scale = case
    rng = node_rng(request)
    epr = -(-NUM_EXPERTS // num_ffn)
    allowed = np.arange(min(NUM_EXPERTS, max(1, num_ffn - 1) * epr))  # the last rank gets no partials
    ids = skewed_ids(rng, num_tokens, top_k, allowed)
    c = Combine(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k, hidden=hidden,
                has_shared=has_shared, ids=ids, ring=num_tokens % 2)
    for j in range(num_ffn):
        if c.non_empty(j):
            c.write_reply(j)
    c.run(out_scale=out_scale, wait_kernel=wait_kernel)

    assert status_of(c.status.array).ok
    got = to_f32(c.out.get()[:num_tokens], dtype)
    assert not np.isnan(got).any(), "rows left unwritten"
    want = to_f32(to_raw(c.reference(out_scale), dtype), dtype)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, out_scale))
    last_seen = c.last_seen_before.copy()
    for slot, flag in c.new_flags.items():
        last_seen[slot] = flag
    np.testing.assert_array_equal(c.last_seen.get(), last_seen)
    assert int(c.done.get()[0]) == 0
    assert int(c.reply_flags.get()[num_ffn]) == 0  # the wait's pass mark, cleared by the combine


def _two_rank_combine(request, dtype="bfloat16", hidden=64):
    rng = node_rng(request)
    ids = skewed_ids(rng, 7, 2, np.arange(NUM_EXPERTS))
    ids[0] = [0, NUM_EXPERTS - 1]  # both FFN ranks get routed partials
    return Combine(rng, dtype=dtype, num_ffn=2, num_tokens=7, top_k=2, hidden=hidden, has_shared=1, ids=ids,
                   ring=1)


@pytest.mark.parametrize("hidden", [64, 7168])  # 7168: every token's row in 4 parts (blocks)
@pytest.mark.parametrize("wait_kernel", [True, False], ids=["wait+combine", "combine-alone"])
def test_combine_timeout_names_peer_and_writes_nan(request, wait_kernel, hidden):
    c = _two_rank_combine(request, hidden=hidden)
    c.write_reply(0)
    c.write_reply(1, arrive=False)  # payload there, flag never changes
    timeout_s = 0.05
    elapsed = c.run(timeout_ns=int(timeout_s * 1e9), wait_kernel=wait_kernel)
    slot = c.layout.slot_index(1, c.ring)
    assert status_of(c.status.array) == wire.StatusRecord(
        wire.STATUS_TIMEOUT, 1, slot, c.ring, int(c.expected[1]), int(c.last_seen_before[slot]), -1, -1,
        c.layer_idx)
    assert elapsed < 5.0, f"combine took {elapsed:.3f} s with a {timeout_s} s timeout"
    c.assert_rows_nan()
    c.assert_last_seen_unchanged()
    assert int(c.done.get()[0]) == 0


@pytest.mark.parametrize("wait_kernel", [True, False], ids=["wait+combine", "combine-alone"])
def test_combine_drops_a_late_reply_and_keeps_waiting(request, wait_kernel):
    """A reply echoing an earlier dispatch (its wait timed out) is skipped like wire.is_late_reply
    says: the wait goes on and ends in TIMEOUT (never REPLY_MISMATCH), last_seen untouched."""
    c = _two_rank_combine(request)
    c.write_reply(0)
    late_echo = (int(c.expected[1]) - 1) & 0xFFFFFFFF
    words = c.reply_words(1, echo_seq=late_echo)
    header = wire.decode_header(words, c.epr)
    assert wire.is_late_reply(header, int(c.expected[1]))
    c.write_reply(1, words=words)
    elapsed = c.run(timeout_ns=int(0.05 * 1e9), wait_kernel=wait_kernel)
    slot = c.layout.slot_index(1, c.ring)
    assert status_of(c.status.array) == wire.StatusRecord(
        wire.STATUS_TIMEOUT, 1, slot, c.ring, int(c.expected[1]), c.new_flags[slot], -1, -1, c.layer_idx)
    assert elapsed < 5.0
    c.assert_rows_nan()
    c.assert_last_seen_unchanged()


def _corrupt_counts(c, j, *, first_count=None, routed_delta=0):
    """Reply words of rank ``j`` with the first expert count replaced, or routed_tokens and one
    count shifted together by ``routed_delta`` (consistent counts, wrong total)."""
    words = c.reply_words(j)
    counts = slice(wire.HDR_FIXED_WORDS, None)
    if first_count is not None:
        words[counts][0] = first_count
    if routed_delta:
        words[wire.HDR_ROUTED_TOKENS] += routed_delta
        words[counts][int(np.argmax(words[counts]))] += routed_delta
    return words


REPLY_FAULTS = {  # fault -> reply words of rank 1 (c: the Combine)
    "magic": lambda c: c.reply_words(1, magic=0x12345678),
    "version": lambda c: c.reply_words(1, version=7),
    "negative_routed": lambda c: c.reply_words(1, routed_tokens=-3),
    "negative_count": lambda c: _corrupt_counts(c, 1, first_count=-1),
    "negative_shared": lambda c: c.reply_words(1, shared_tokens=-2),
    "counts_sum": lambda c: _corrupt_counts(c, 1, first_count=int(c.plan.rank_counts(1)[0]) + 1),
    "shutdown": lambda c: c.reply_words(1, flags=wire.FLAG_SHUTDOWN, echo_seq=0),
    "echo": lambda c: c.reply_words(1, echo_seq=(int(c.expected[1]) + 1) & 0xFFFFFFFF),
    "layer": lambda c: c.reply_words(1, layer_idx=c.layer_idx + 1),
    "stage": lambda c: c.reply_words(1, stage_idx=c.stage_idx + 1),
    "routed": lambda c: _corrupt_counts(c, 1, routed_delta=1),
    "shared": lambda c: c.reply_words(1, shared_tokens=c.shared_rows(1) + 1),
}
REPLY_FAULT_RECORDS = {  # fault -> (code, header word in ST_COUNT)
    "magic": (wire.STATUS_BAD_HEADER, wire.HDR_MAGIC),
    "version": (wire.STATUS_BAD_HEADER, wire.HDR_VERSION),
    "negative_routed": (wire.STATUS_BAD_HEADER, wire.HDR_ROUTED_TOKENS),
    "negative_count": (wire.STATUS_BAD_HEADER, wire.HDR_ROUTED_TOKENS),
    "negative_shared": (wire.STATUS_BAD_HEADER, wire.HDR_SHARED_TOKENS),
    "counts_sum": (wire.STATUS_BAD_HEADER, wire.HDR_ROUTED_TOKENS),
    "shutdown": (wire.STATUS_SHUTDOWN, -1),
    "echo": (wire.STATUS_REPLY_MISMATCH, wire.HDR_ECHO_SEQ),
    "layer": (wire.STATUS_REPLY_MISMATCH, wire.HDR_LAYER),
    "stage": (wire.STATUS_REPLY_MISMATCH, wire.HDR_STAGE),
    "routed": (wire.STATUS_REPLY_MISMATCH, wire.HDR_ROUTED_TOKENS),
    "shared": (wire.STATUS_REPLY_MISMATCH, wire.HDR_SHARED_TOKENS),
}


@pytest.mark.parametrize("wait_kernel", [True, False], ids=["wait+combine", "combine-alone"])
@pytest.mark.parametrize("fault", sorted(REPLY_FAULTS))
def test_combine_header_faults(request, fault, wait_kernel):
    """Each faulty reply latches the record of wire.reply_verdict (the host's verdict for the
    same words, whose errors wire.decode_header + wire.check_reply raise) and leaves NaN rows."""
    c = _two_rank_combine(request, dtype="float16")
    c.write_reply(0)
    words = REPLY_FAULTS[fault](c)
    c.write_reply(1, words=words)
    c.run(wait_kernel=wait_kernel)
    slot = c.layout.slot_index(1, c.ring)
    want = wire.ReplyExpectation(peer=1, seq=int(c.expected[1]), layer_idx=c.layer_idx,
                                 stage_idx=c.stage_idx, routed_tokens=int(c.expected_counts[1, 0]),
                                 shared_tokens=int(c.expected_counts[1, 1]))
    verdict = wire.reply_verdict(words, want, slot=slot, ring=c.ring, flag=c.new_flags[slot])
    assert (verdict.code, verdict.count) == REPLY_FAULT_RECORDS[fault]
    record = status_of(c.status.array)
    assert record == verdict
    # the host backend, fed the same bytes, raises the same typed error
    with pytest.raises(type(record.error(layer_idx=c.layer_idx))):
        wire.check_reply(wire.decode_header(words, c.epr), want)
    c.assert_rows_nan()
    c.assert_last_seen_unchanged()


def test_wait_pass_mark_reference():
    assert kernels.wait_pass_mark([0, 0, 0]) == 0
    assert kernels.wait_pass_mark([0, 7, 3]) == 7 * kernels.MAX_FFN_RANKS + 1
    assert kernels.wait_pass_mark([2**40]) == 2**40 * kernels.MAX_FFN_RANKS


@pytest.mark.parametrize("fault", [None, "echo", "magic"])
def test_wait_leaves_the_pass_mark_only_when_every_reply_passed(request, fault):
    """afd_wait_replies alone: reply_flags[F] = wait_pass_mark(expected) after a clean wait; 0
    after a failed one, whatever was there before (here: the right mark)."""
    c = _two_rank_combine(request)
    c.write_reply(0)
    c.write_reply(1, words=None if fault is None else REPLY_FAULTS[fault](c))
    mark = kernels.wait_pass_mark(c.expected)
    assert mark == int(c.expected[0]) * kernels.MAX_FFN_RANKS  # rank 0 was sent to
    start = np.zeros(c.num_ffn + 1, np.int64)
    start[-1] = mark
    c.run(combine=False, reply_flags=start)
    flags = c.reply_flags.get()
    assert status_of(c.status.array).ok == (fault is None)
    assert int(flags[-1]) == (mark if fault is None else 0)
    if fault is None:
        slots = [c.layout.slot_index(j, c.ring) for j in range(c.num_ffn)]
        assert flags[:-1].tolist() == [c.new_flags[slot] for slot in slots]


@pytest.mark.parametrize("case", ["own_mark", "older_mark", "latched_error"])
def test_combine_trusts_only_its_own_pass_mark(request, case):
    """afd_combine alone, over a reply whose header is wrong (echo of another seq), with
    reply_flags set as a clean wait would leave them. own_mark: the blocks skip the re-check
    (the rows are combined, status OK, last_seen from reply_flags, mark cleared); older_mark
    (the mark of the ring's previous dispatch): they re-check and latch REPLY_MISMATCH with NaN
    rows; latched_error (own mark, but an error latched since): NaN rows, the record kept."""
    c = _two_rank_combine(request)
    c.write_reply(0)
    words = REPLY_FAULTS["echo"](c)
    c.write_reply(1, words=words)
    slots = [c.layout.slot_index(j, c.ring) for j in range(c.num_ffn)]
    start = np.array([c.new_flags[slot] for slot in slots] + [0], np.int64)
    mark = kernels.wait_pass_mark(c.expected)
    start[-1] = mark - kernels.MAX_FFN_RANKS if case == "older_mark" else mark
    latched = [wire.STATUS_TIMEOUT, 1, 3, 1, 9, 8, -1, -1, 7]
    if case == "latched_error":
        c.status.array[:] = latched
    c.run(wait_kernel=False, reply_flags=start)
    record = status_of(c.status.array)
    if case == "own_mark":
        assert record.ok
        got = to_f32(c.out.get()[:c.num_tokens], c.dtype)
        want = to_f32(to_raw(c.reference(1.0), c.dtype), c.dtype)
        np.testing.assert_allclose(got, want, rtol=TOLERANCE[c.dtype], atol=TOLERANCE[c.dtype])
        last_seen = c.last_seen_before.copy()
        last_seen[slots] = start[:-1]
        np.testing.assert_array_equal(c.last_seen.get(), last_seen)
    else:
        if case == "older_mark":
            assert (record.code, record.peer, record.count) == (
                wire.STATUS_REPLY_MISMATCH, 1, wire.HDR_ECHO_SEQ)
        else:
            assert record == wire.StatusRecord(*latched)
        c.assert_rows_nan()
        c.assert_last_seen_unchanged()
    assert int(c.reply_flags.get()[-1]) == 0  # cleared by the last block either way
    assert int(c.done.get()[0]) == 0


def test_combine_after_latched_error_returns_nan_without_waiting(request):
    c = _two_rank_combine(request)  # no reply ever arrives
    c.status.array[:] = [wire.STATUS_CAPACITY, 0, -1, -1, -1, -1, 99, 98, 7]
    elapsed = c.run(timeout_ns=LONG_TIMEOUT_NS)
    assert elapsed < 2.0
    assert c.status.array.tolist() == [wire.STATUS_CAPACITY, 0, -1, -1, -1, -1, 99, 98, 7]
    c.assert_rows_nan()
    c.assert_last_seen_unchanged()


# --- wait_any ----------------------------------------------------------------------------------
class WaitAny:
    """An FFN rank's own window, its last_seen/scan_start and a pinned doorbell."""

    def __init__(self, rng, *, num_regions=3, ring_depth=2, epr=5):
        self.rng = rng
        self.layout = kernel_layout(num_regions=num_regions, ring_depth=ring_depth, epr=epr, hidden=32,
                                  dtype="bfloat16", top_k=2, token_cap=16, routed_cap=32, has_shared=1,
                                  num_ffn=2)
        self.window = cp.asarray(rng.integers(0, 256, self.layout.window_bytes, dtype=np.uint8))
        self.last_seen = self.window[:self.layout.num_slots * 8].view(cp.int64).copy()
        self.scan_start = cp.zeros(1, cp.int32)
        self.hdr_words = self.layout.header_words
        self.counts_snapshot = cp.full((self.layout.num_slots, epr), -7, cp.int32)
        self.doorbell = kernels.PinnedInt64(wire.DB_HEADER + -(-self.hdr_words // 2))
        self.headers = {}
        self.snapshot_rows_written = set()
        self.ticket = 100

    def arrive(self, slot):
        """Give ``slot`` a new flag value and a fresh random header."""
        layout = self.layout
        words = self.rng.integers(-2**31, 2**31, self.hdr_words).astype(np.int32)
        base = layout.flags_bytes + slot * layout.slot_bytes + layout.field_offset("header")
        self.window[base:base + words.nbytes] = cp.asarray(words.view(np.uint8))
        flags = self.window[:layout.num_slots * 8].view(cp.int64)
        flags[slot] = flags[slot] + int(self.rng.integers(1, 2**40))
        self.headers[slot] = (words, int(flags[slot].get()))
        sync()

    def call(self, timeout_ns=LONG_TIMEOUT_NS):
        """One wait_any; the host spins on the ticket like the real FFN loop. Returns the doorbell."""
        self.ticket += 1
        layout = self.layout
        kernels.get_kernel("ffn/wait_any.cu", "afd_wait_any")  # compile outside the timed region
        start = time.perf_counter()
        kh.launch_wait_any(
            window=self.window.data.ptr, geo=layout.kernel_geometry(), last_seen=self.last_seen,
            scan_start=self.scan_start, counts_snapshot=self.counts_snapshot, timeout_ns=timeout_ns,
            doorbell=self.doorbell.ptr,
            ticket=self.ticket)
        while self.doorbell.array[wire.DB_TICKET] != self.ticket:
            assert time.perf_counter() - start < 10.0, "doorbell never rang"
        elapsed = time.perf_counter() - start
        sync()
        return self.doorbell.array.copy(), elapsed

    def check_arrival(self, bell) -> int:
        assert bell[wire.DB_STATUS] == wire.STATUS_OK
        slot = int(bell[wire.DB_SLOT])
        words, flag = self.headers[slot]
        assert bell[wire.DB_FLAG] == flag
        header = bell.view(np.int32)[2 * wire.DB_HEADER:2 * wire.DB_HEADER + self.hdr_words]
        np.testing.assert_array_equal(header, words)
        # the GEMM's group sizes: this slot's row holds the header's counts, no other row moved
        snapshot = self.counts_snapshot.get()
        np.testing.assert_array_equal(snapshot[slot], words[wire.HDR_FIXED_WORDS:])
        self.snapshot_rows_written.add(slot)
        untouched = [s for s in range(self.layout.num_slots) if s not in self.snapshot_rows_written]
        assert (snapshot[untouched] == -7).all()
        assert int(self.last_seen.get()[slot]) == flag
        assert int(self.scan_start.get()[0]) == (slot + 1) % self.layout.num_slots
        return slot


def test_wait_any_returns_each_arrival_once_in_rotated_order(request):
    w = WaitAny(node_rng(request))
    w.scan_start.fill(3)
    for slot in (1, 4, 5):
        w.arrive(slot)
    served = [w.check_arrival(w.call()[0]) for _ in range(3)]
    assert served == [4, 5, 1]  # rotated from scan_start = 3
    bell, elapsed = w.call(timeout_ns=20_000_000)
    assert bell[wire.DB_STATUS] == wire.STATUS_TIMEOUT and bell[wire.DB_SLOT] == -1
    assert 0.015 < elapsed < 5.0


def test_wait_any_is_fair_when_every_slot_is_busy(request):
    w = WaitAny(node_rng(request), num_regions=5, ring_depth=3)  # 15 slots, one warp pass
    num_slots = w.layout.num_slots
    for slot in range(num_slots):
        w.arrive(slot)
    served = []
    for _ in range(2 * num_slots):
        slot = w.check_arrival(w.call()[0])
        served.append(slot)
        w.arrive(slot)  # a busy sender re-arms at once: it must not starve the others
    assert len(set(served[:num_slots])) == num_slots and len(set(served[num_slots:])) == num_slots
    assert all(b == (a + 1) % num_slots for a, b in zip(served, served[1:]))


def test_wait_any_scans_more_slots_than_a_warp(request):
    w = WaitAny(node_rng(request), num_regions=20, ring_depth=2)  # 40 slots: two passes of the warp
    w.scan_start.fill(30)
    for slot in (2, 35):
        w.arrive(slot)
    assert [w.check_arrival(w.call()[0]) for _ in range(2)] == [35, 2]
    w.arrive(39)
    assert w.check_arrival(w.call()[0]) == 39


def test_wait_any_timeout_with_nothing_arrived(request):
    w = WaitAny(node_rng(request))
    before = w.last_seen.get()
    bell, elapsed = w.call(timeout_ns=30_000_000)
    assert bell[wire.DB_STATUS] == wire.STATUS_TIMEOUT and bell[wire.DB_TICKET] == w.ticket
    assert 0.025 < elapsed < 5.0
    np.testing.assert_array_equal(w.last_seen.get(), before)
    assert int(w.scan_start.get()[0]) == 0


# --- reply -------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_routed,num_shared", [(37, 5), (0, 5), (37, 0), (0, 0), (2000, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reply_lands_exactly(request, dtype, num_routed, num_shared):
    rng = node_rng(request)
    hidden = 64 if num_routed % 2 else 33
    epr, ffn_rank, ring = 4, 1, 1
    layout = kernel_layout(num_regions=3, ring_depth=2, epr=epr, hidden=hidden, dtype=dtype, top_k=4,
                         token_cap=max(num_routed, 8), routed_cap=max(num_routed, 8), has_shared=1, num_ffn=2)
    prefill = rng.integers(0, 256, layout.window_bytes, dtype=np.uint8)
    window = cp.asarray(prefill)
    routed = random_rows(rng, num_routed, hidden, dtype)
    shared = random_rows(rng, num_shared, hidden, dtype)
    routed_dev, shared_dev = cp.asarray(routed), cp.asarray(shared)
    counts = np.zeros(epr, np.int64)
    counts[0] = num_routed
    header = wire.encode_header(wire.Header(
        seq=77, src_rank=ffn_rank, layer_idx=5, stage_idx=1, num_tokens=9, routed_tokens=num_routed,
        shared_tokens=num_shared, top_k=4, flags=0, echo_seq=2**32 + 12, expert_counts=tuple(counts)), epr)
    header_src = kernels.PinnedInt64(-(-layout.header_words // 2))
    header_src.int32[:layout.header_words] = header
    done = cp.zeros(1, cp.uint32)
    seq = 2**35 + int(rng.integers(1, 1000))
    base = layout.slot_offset(ffn_rank, ring)
    kh.launch_reply(
        dtype_code=kernels.DTYPE_CODES[dtype], dst_window=window.data.ptr, geo=layout.kernel_geometry(),
        src_rank=ffn_rank, ring=ring, routed_out=routed_dev.data.ptr if num_routed else 0,
        num_routed=num_routed, shared_out=shared_dev.data.ptr if num_shared else 0,
        num_shared=num_shared, hidden_size=hidden, header_src=header_src.ptr, seq=seq,
        done_counter=done)
    sync()
    want = prefill.copy()
    put(want, layout.slot_index(ffn_rank, ring) * 8, np.int64(seq))
    put(want, base + layout.field_offset("header"), header)
    put(want, base + layout.field_offset("routed_x"), routed)
    put(want, base + layout.field_offset("shared_x"), shared)
    assert_window_equal(window.get(), want, layout, "reply")
    assert int(done.get()[0]) == 0


# --- dispatch -> FFN identity reply -> combine ---------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_ffn,num_tokens,top_k,has_shared", [(3, 129, 8, 1), (2, 5, 2, 0), (4, 3, 6, 1)])
def test_round_trip_through_all_kernels(request, dtype, num_ffn, num_tokens, top_k, has_shared):
    rng = node_rng(request)
    epr = -(-NUM_EXPERTS // num_ffn)
    ids = skewed_ids(rng, num_tokens, top_k, np.arange(NUM_EXPERTS))
    d = Dispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k, hidden=64,
                 has_shared=has_shared, ids=ids, ring=0)
    d.run()
    assert status_of(d.status.array).ok
    layout, geo = d.layout, d.layout.kernel_geometry()
    off_header, off_routed_x, off_shared_x = (layout.field_offset(name) for name in ("header", "routed_x", "shared_x"))
    attn_window = cp.asarray(rng.integers(0, 256, layout.window_bytes, dtype=np.uint8))
    last_seen = attn_window[:layout.num_slots * 8].view(cp.int64).copy()
    expected = d.expected.get()
    header_bufs, done = [], cp.zeros(1, cp.uint32)
    for j in range(num_ffn):
        if expected[j] == 0:
            continue
        ffn_slot = d.layout.slot_offset(d.src_rank, d.ring)
        got = d.windows[j].get()
        request_hdr = wire.decode_header(take(got, ffn_slot + off_header, np.int32, layout.header_words), epr)
        reply = wire.reply_header(request_hdr, seq=int(rng.integers(1, 2**31)), src_rank=j)
        header_bufs.append(kernels.PinnedInt64(-(-layout.header_words // 2)))
        header_bufs[-1].int32[:layout.header_words] = wire.encode_header(reply, epr)
        ffn_base = d.windows[j].data.ptr + ffn_slot
        kh.launch_reply(  # identity experts: the routed/shared rows go straight back
            dtype_code=kernels.DTYPE_CODES[dtype], dst_window=attn_window.data.ptr, geo=geo,
            src_rank=j, ring=d.ring, routed_out=ffn_base + off_routed_x,
            num_routed=request_hdr.routed_tokens, shared_out=ffn_base + off_shared_x,
            num_shared=request_hdr.shared_tokens, hidden_size=d.hidden,
            header_src=header_bufs[-1].ptr,
            seq=int(last_seen[layout.slot_index(j, d.ring)].get()) + 1, done_counter=done)
    out = cp.full((num_tokens, d.hidden), NAN_WORD[dtype], dtype=RAW[dtype])
    weights = (rng.random((num_tokens, top_k)) + 0.1).astype(np.float32)
    status = kernels.PinnedInt64(wire.STATUS_WORDS)
    replies = dict(window=attn_window.data.ptr, geo=geo, num_ffn_ranks=num_ffn, ring=d.ring,
                   expected=d.expected, expected_counts=d.expected_counts, layer_idx=d.layer_idx,
                   stage_idx=d.stage_idx, last_seen=last_seen,
                   reply_flags=cp.zeros(num_ffn + 1, cp.int64), timeout_ns=LONG_TIMEOUT_NS,
                   status=status.ptr)
    kh.launch_wait_replies(**replies)
    kh.launch_combine(
        dtype_code=kernels.DTYPE_CODES[dtype], out=out.data.ptr, num_tokens=num_tokens,
        hidden_size=d.hidden, topk_ids=d.topk_ids, topk_weights=cp.asarray(weights.reshape(-1)),
        pos=d.pos_out, top_k=top_k, expert_per_rank=epr, has_shared=has_shared, out_scale=1.0,
        done_counter=cp.zeros(1, cp.uint32), **replies)
    sync()
    assert status_of(status.array).ok, status_of(status.array)
    hidden_f32 = to_f32(d.hidden_raw, dtype)
    want = (weights.sum(axis=1, dtype=np.float32) + has_shared)[:, None] * hidden_f32
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(to_f32(out.get(), dtype), to_f32(to_raw(want, dtype), dtype), rtol=tol, atol=tol)


# --- afd_own_routing: the caller's routing into the ring's own buffers ---------------------------
OWN_ROUTING_CASES = [  # num_partials, ids int64, mask
    (0, False, False), (1, False, False), (8, True, True), (1000, False, True), (5000, True, True),
    # more partials than MAX_BLOCKS blocks of PLAN_THREADS threads cover: the blocks stride
    (kernels.MAX_BLOCKS * kernels.KERNEL_LIMITS["PLAN_THREADS"] + 777, True, True)]


@pytest.mark.parametrize("case", OWN_ROUTING_CASES, ids=[str(c) for c in OWN_ROUTING_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_own_routing_matches_reference(request, dtype, case):
    """afd_own_routing against kernels.specs.own_routing_reference on fresh random ids (in range,
    negative, >= num_experts and, int64, beyond int32) and weights of every payload dtype;
    outputs pre-filled with NaN / a sentinel id, and the tail past num_partials untouched."""
    num_partials, ids_int64, mask = case
    rng = node_rng(request)
    num_experts = 96
    ids = rng.integers(0, num_experts, num_partials).astype(np.int64)
    if num_partials:
        bad = rng.random(num_partials) < 0.2
        wild = rng.choice(np.array([-1, -7, num_experts, num_experts + 5] +
                                   ([2**31 + 3, -2**33] if ids_int64 else []), np.int64), num_partials)
        ids = np.where(bad, wild, ids)
    ids = ids.astype(np.int64 if ids_int64 else np.int32)
    weights = to_raw(rng.standard_normal(num_partials).astype(np.float32), dtype)
    ids_dev, weights_dev = cp.asarray(ids), cp.asarray(weights)
    extra = 5  # past num_partials: must stay as filled
    ids_out = cp.full(num_partials + extra, -12345, cp.int32)
    weights_out = cp.full(num_partials + extra, np.nan, cp.float32)
    spec = kernels.own_routing_spec(
        weights_dtype_code=kernels.DTYPE_CODES[dtype], ids=ids_dev.data.ptr if num_partials else 0,
        ids_int64=int(ids_int64), mask=int(mask), num_experts=num_experts,
        weights=weights_dev.data.ptr if num_partials else 0, num_partials=num_partials,
        ids_out=ids_out, weights_out=weights_out)
    spec.launch()
    cp.cuda.Device().synchronize()
    want_ids, want_weights = kernels.specs.own_routing_reference(
        ids, to_f32(weights, dtype), mask=mask, num_experts=num_experts)
    got_ids, got_weights = ids_out.get(), weights_out.get()
    np.testing.assert_array_equal(got_ids[:num_partials], want_ids)
    np.testing.assert_array_equal(got_weights[:num_partials], want_weights)
    assert (got_ids[num_partials:] == -12345).all() and np.isnan(got_weights[num_partials:]).all()
