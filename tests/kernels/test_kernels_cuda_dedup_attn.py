"""The Attention-side dedup kernels (raw_kernels/attention/dedup_attn.cu, afd_wait_replies with dedup=1)
against the numpy references of afd_cupy/testing/dedup_reference.py, in one process on one GPU.

Same method as tests/kernels/test_kernels_cuda.py (whose helpers this reuses): F CuPy arrays act as F
peer windows, pre-filled with random bytes; each dispatch test rebuilds every expected window in
numpy (``scatter_reference`` + ``wire.dispatch_header(wire_mode="dedup")``) and compares byte
for byte. Routings are fresh and random per test, payloads random, outputs pre-filled with NaN
(or -7 / 12345 garbage for index outputs).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import kernels as kh
from afd_cupy import errors, kernels, wire
from afd_cupy.testing import dedup_reference

from helpers import kernels as kh
from helpers.layouts import kernel_layout
from helpers.rng import node_rng

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.cuda

import test_kernels_cuda as base  # noqa: E402 (imports cupy and torch)
from afd_cupy.backends.cuda_attention import DedupRowsScratch, DispatchScratch  # noqa: E402

DTYPES = base.DTYPES
NUM_EXPERTS = base.NUM_EXPERTS
GARBAGE_ROW = 12345  # pre-fill of row_map: a cell the kernel forgot to write shows as this


def dedup_layout(**fields) -> wire.WindowLayout:
    return kernel_layout(wire_mode="dedup", **fields)


class DedupDispatch:
    """One Attention rank (``src_rank``) sending a dedup dispatch to F peer windows through
    afd_dispatch_plan -> afd_dedup_rows -> afd_dedup_scatter."""

    def __init__(self, rng, *, dtype, num_ffn, num_tokens, top_k, hidden, has_shared, ids,
                 num_experts=NUM_EXPERTS, routed_cap=None, num_attn=2, ring=1, src_rank=1,
                 always_send=0, put_peers=()):
        self.rng, self.dtype, self.num_ffn, self.num_tokens, self.top_k = rng, dtype, num_ffn, num_tokens, top_k
        self.hidden, self.has_shared, self.ids, self.ring, self.src_rank = hidden, has_shared, ids, ring, src_rank
        self.always_send = always_send
        self.epr = -(-num_experts // num_ffn)
        self.num_partials = num_tokens * top_k
        self.layout = dedup_layout(
            num_regions=max(num_attn, num_ffn), epr=self.epr, hidden=hidden, dtype=dtype,
            top_k=top_k, token_cap=max(num_tokens, 1),
            routed_cap=routed_cap if routed_cap is not None else max(self.num_partials, 1),
            has_shared=has_shared)
        self.hidden_raw = base.random_rows(rng, num_tokens, hidden, dtype)
        self.hidden_dev = cp.asarray(base.random_rows(rng, max(num_tokens, 1), hidden, dtype))
        self.hidden_dev[:num_tokens] = cp.asarray(self.hidden_raw)
        self.weights = (rng.random((num_tokens, top_k)) + 0.05).astype(np.float32)
        self.prefill = [rng.integers(0, 256, self.layout.window_bytes, dtype=np.uint8) for _ in range(num_ffn)]
        self.windows = [cp.asarray(p) for p in self.prefill]
        # put peers (docs/design/put-transport.md): window pointer 0, their messages go to the own staging
        self.put_peers = frozenset(put_peers)
        self.staging_prefill = (rng.integers(0, 256, self.layout.window_bytes, dtype=np.uint8)
                                if self.put_peers else None)
        self.staging = cp.asarray(self.staging_prefill) if self.put_peers else None
        self.peer_windows = cp.asarray([0 if j in self.put_peers else w.data.ptr
                                        for j, w in enumerate(self.windows)], dtype=cp.uint64)
        self.scratch = DispatchScratch.allocate(self.num_partials + 300, num_ffn, self.epr)
        for arr in (self.scratch.chunk_hist, self.scratch.local_rank, self.scratch.expert_counts,
                    self.scratch.expert_start, self.scratch.rank_offsets, self.scratch.verdict):
            arr.fill(-7)
        self.rows = DedupRowsScratch.allocate(num_tokens + 3, top_k, num_ffn)
        for arr in (self.rows.rows_hist, self.rows.rows_local, self.rows.num_rows, self.rows.shared_rows,
                    self.rows.shared_rank):
            arr.fill(-7)
        self.rows.row_map.fill(GARBAGE_ROW)
        self.seq_before = rng.integers(1, 1000, num_ffn).astype(np.int64) + (np.arange(num_ffn) % 2) * (2**32 - 500)
        self.seq_counters = cp.asarray(self.seq_before)
        self.expected = cp.full(num_ffn, -5, cp.int64)
        self.expected_counts = cp.full((num_ffn, 3), -5, cp.int32)
        self.status = kernels.PinnedInt64(wire.STATUS_WORDS)
        self.layer_idx, self.stage_idx = int(rng.integers(0, 60)), int(rng.integers(0, 3))
        self.topk_ids = cp.asarray(ids.reshape(-1))
        self.topk_weights = cp.asarray(self.weights.reshape(-1))

    def run(self, fused: bool = False):
        if fused:
            self.run_fused()
            return
        self.run_plan()
        self.run_rows()
        self.run_scatter()

    def run_fused(self):
        """afd_dedup_dispatch_fused: plan, rows and scatter in one kernel (block 0 writes the
        plan's and the rows' per-rank outputs, every cell's warp its row_map entry)."""
        s, r = self.scratch, self.rows
        kernels.dedup_dispatch_fused_spec(
            dtype_code=kernels.DTYPE_CODES[self.dtype], hidden=self.hidden_dev.data.ptr,
            num_tokens=self.num_tokens, hidden_size=self.hidden, topk_ids=self.topk_ids,
            topk_weights=self.topk_weights, top_k=self.top_k, expert_per_rank=self.epr,
            num_ffn_ranks=self.num_ffn, routed_cap=self.layout.routed_cap, has_shared=self.has_shared,
            expert_counts=s.expert_counts, expert_start=s.expert_start, rank_offsets=s.rank_offsets,
            verdict=s.verdict, skipped=s.skipped, row_map=r.row_map, shared_rank=r.shared_rank,
            num_rows=r.num_rows, shared_rows=r.shared_rows, peer_windows=self.peer_windows,
            geo=self.layout.kernel_geometry(), ring=self.ring, always_send=self.always_send,
            src_rank=self.src_rank, layer_idx=self.layer_idx, stage_idx=self.stage_idx,
            seq_counters=self.seq_counters, expected=self.expected,
            expected_counts=self.expected_counts, done_counter=s.scatter_done, status=self.status.ptr,
            staging=self.staging.data.ptr if self.put_peers else 0,
            max_tokens=self.num_tokens + 3).launch()
        base.sync()

    def run_plan(self):
        s = self.scratch
        kh.launch_dispatch_plan(
            topk_ids=self.topk_ids, num_partials=self.num_partials, num_ffn_ranks=self.num_ffn,
            expert_per_rank=self.epr, routed_cap=self.layout.routed_cap, layer_idx=self.layer_idx,
            chunk_hist=s.chunk_hist, local_rank=s.local_rank, expert_counts=s.expert_counts,
            expert_start=s.expert_start, rank_offsets=s.rank_offsets, verdict=s.verdict,
            done_counter=s.plan_done, status=self.status.ptr)
        base.sync()

    def run_rows(self):
        r = self.rows
        kernels.dedup_rows_spec(
            topk_ids=self.topk_ids, num_tokens=self.num_tokens, top_k=self.top_k,
            expert_per_rank=self.epr, num_ffn_ranks=self.num_ffn, has_shared=self.has_shared,
            verdict=self.scratch.verdict, rows_hist=r.rows_hist, rows_local=r.rows_local,
            row_map=r.row_map, shared_rank=r.shared_rank, num_rows=r.num_rows,
            shared_rows=r.shared_rows, done_counter=r.rows_done).launch()
        base.sync()

    def run_scatter(self):
        s, r = self.scratch, self.rows
        kernels.dedup_scatter_spec(
            dtype_code=kernels.DTYPE_CODES[self.dtype], hidden=self.hidden_dev.data.ptr,
            num_tokens=self.num_tokens, hidden_size=self.hidden, topk_ids=self.topk_ids,
            topk_weights=self.topk_weights, top_k=self.top_k, expert_per_rank=self.epr,
            num_ffn_ranks=self.num_ffn, chunk_hist=s.chunk_hist, local_rank=s.local_rank,
            expert_start=s.expert_start, rank_offsets=s.rank_offsets,
            expert_counts=s.expert_counts, verdict=s.verdict, row_map=r.row_map,
            shared_rank=r.shared_rank, num_rows=r.num_rows, shared_rows=r.shared_rows,
            peer_windows=self.peer_windows, geo=self.layout.kernel_geometry(), ring=self.ring,
            always_send=self.always_send, src_rank=self.src_rank, layer_idx=self.layer_idx,
            stage_idx=self.stage_idx, seq_counters=self.seq_counters, expected=self.expected,
            expected_counts=self.expected_counts, done_counter=s.scatter_done,
            staging=self.staging.data.ptr if self.put_peers else 0).launch()
        base.sync()

    def reference(self):
        return dedup_reference.plan_reference(self.ids, self.num_ffn, self.epr,
                                              has_shared=bool(self.has_shared),
                                              num_experts=self.num_ffn * self.epr)

    def expected_window(self, ffn_rank: int, plan, seq: int, image=None) -> np.ndarray:
        """Rank j's window after the send, or (``image``: the staging so far) the staging with
        j's message in slot (region = j, ring), as a put peer's."""
        layout, j = self.layout, ffn_rank
        want = (self.prefill[j] if image is None else image).copy()
        region = self.src_rank if image is None else j
        slot = layout.slot_offset(region, self.ring)
        base.put(want, layout.slot_index(region, self.ring) * 8, np.int64(seq))
        header = wire.dispatch_header(
            seq=seq, src_rank=self.src_rank, layer_idx=self.layer_idx, stage_idx=self.stage_idx,
            num_tokens=self.num_tokens, shared_tokens=int(plan.shared_rows[j]), top_k=self.top_k,
            expert_counts=plan.rank_counts(j), wire_mode="dedup", num_rows=int(plan.num_rows[j]))
        base.put(want, slot + layout.field_offset("header"), wire.encode_header(header, self.epr))
        table, rows = dedup_reference.scatter_reference(plan, self.hidden_raw, self.ids, self.weights, j)
        base.put(want, slot + layout.field_offset("route_table"), table)
        base.put(want, slot + layout.field_offset("routed_x"), rows)
        return want

    def assert_plan_outputs(self, plan):
        """row_map / shared_rank / num_rows / shared_rows == plan_reference; nothing past T."""
        t = self.num_tokens
        row_map, shared_rank = self.rows.row_map.get(), self.rows.shared_rank.get()
        np.testing.assert_array_equal(row_map[:t], plan.row_map)
        assert (row_map[t:] == GARBAGE_ROW).all(), "row_map written past num_tokens"
        np.testing.assert_array_equal(shared_rank[:t], plan.shared_rank)
        assert (shared_rank[t:] == -7).all(), "shared_rank written past num_tokens"
        np.testing.assert_array_equal(self.rows.num_rows.get(), plan.num_rows)
        np.testing.assert_array_equal(self.rows.shared_rows.get(), plan.shared_rows)
        for counter in (self.scratch.plan_done, self.rows.rows_done, self.scratch.scatter_done,
                        self.scratch.skipped):
            assert int(counter.get()[0]) == 0

    def assert_plan_arrays(self):
        """expert_counts / expert_start / rank_offsets == the pair plan's reference (the fused
        kernel's block 0 writes them as afd_dispatch_plan does)."""
        counts = np.bincount(self.ids.reshape(-1), minlength=self.num_ffn * self.epr)
        start = np.cumsum(counts) - counts
        np.testing.assert_array_equal(self.scratch.expert_counts.get(), counts)
        np.testing.assert_array_equal(self.scratch.expert_start.get(), start)
        np.testing.assert_array_equal(self.scratch.rank_offsets.get(),
                                      np.append(start[::self.epr], counts.sum()))

    def assert_sent(self, plan):
        """expected, expected_counts [F, 3], seq counters and every window byte for byte (a put
        peer's window untouched, its message in the staging)."""
        expected, seq_after = self.expected.get(), self.seq_counters.get()
        expected_counts = self.expected_counts.get()
        want_staging = self.staging_prefill
        for j in range(self.num_ffn):
            sends = plan.num_rows[j] > 0 or bool(self.always_send)
            seq = int(self.seq_before[j]) + 1 if sends else 0
            assert expected[j] == seq, f"expected[{j}]"
            assert expected_counts[j].tolist() == [plan.routed_count(j), int(plan.shared_rows[j]),
                                                   int(plan.num_rows[j])], f"expected_counts[{j}]"
            assert seq_after[j] == self.seq_before[j] + sends, f"seq_counters[{j}]"
            got = self.windows[j].get()
            is_put = j in self.put_peers
            if not sends or is_put:
                base.assert_window_equal(got, self.prefill[j], self.layout, f"peer {j} was written "
                                         f"({'put peer' if is_put else 'empty'})")
            if not sends:
                continue
            if is_put:
                want_staging = self.expected_window(j, plan, seq, image=want_staging)
                got, region = self.staging.get(), j
            else:
                base.assert_window_equal(got, self.expected_window(j, plan, seq), self.layout, f"peer {j}")
                region = self.src_rank
            slot = self.layout.slot_offset(region, self.ring)
            header = wire.decode_header(base.take(got, slot, np.int32, self.layout.header_words),
                                        self.epr, self.layout)
            table = base.take(got, slot + self.layout.field_offset("route_table"), np.int32,
                              header.num_rows * self.layout.route_width)
            wire.check_route_table(table.reshape(header.num_rows, self.layout.route_width), num_tokens=header.num_tokens,
                                   routed_tokens=header.routed_tokens,
                                   shared_tokens=header.shared_tokens, top_k=self.top_k)
        if self.put_peers:
            base.assert_window_equal(self.staging.get(), want_staging, self.layout, "put staging")

    def assert_nothing_sent(self, verdict: int):
        assert int(self.scratch.verdict.get()[0]) == verdict
        assert (self.expected.get() == 0).all()
        np.testing.assert_array_equal(self.seq_counters.get(), self.seq_before)
        for j in range(self.num_ffn):
            base.assert_window_equal(self.windows[j].get(), self.prefill[j], self.layout,
                                     f"peer {j} written after an error")
        if self.put_peers:
            base.assert_window_equal(self.staging.get(), self.staging_prefill, self.layout,
                                     "put staging written after an error")
        t = self.num_tokens
        assert (self.rows.row_map.get()[:t] == -1).all() and (self.rows.shared_rank.get()[:t] == -1).all()
        assert (self.rows.num_rows.get() == 0).all() and (self.rows.shared_rows.get() == 0).all()
        for counter in (self.scratch.plan_done, self.rows.rows_done, self.scratch.scatter_done):
            assert int(counter.get()[0]) == 0


# --- dispatch: plan -> rows -> scatter ----------------------------------------------------------
DISPATCH_CASES, TOP_KS, HIDDENS = base.DISPATCH_CASES, base.TOP_KS, base.HIDDENS  # pair's grid


@pytest.mark.parametrize("fused", [False, True], ids=["3-kernel", "fused"])
@pytest.mark.parametrize("has_shared", [0, 1])
@pytest.mark.parametrize("num_ffn,num_tokens", DISPATCH_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dedup_dispatch_matches_reference(request, dtype, num_ffn, num_tokens, has_shared, fused):
    rng = node_rng(request)
    case = DISPATCH_CASES.index((num_ffn, num_tokens)) + has_shared + DTYPES.index(dtype)
    top_k, hidden = TOP_KS[case % 4], HIDDENS[case % 3]
    epr = -(-NUM_EXPERTS // num_ffn)
    drop_last_rank = num_ffn > 1 and case % 2 == 0  # an FFN rank without rows
    allowed = np.arange(min(NUM_EXPERTS, (num_ffn - drop_last_rank) * epr))
    ids = base.skewed_ids(rng, num_tokens, top_k, allowed)
    d = DedupDispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                      hidden=hidden, has_shared=has_shared, ids=ids, always_send=case % 5 == 0)
    d.run(fused=fused)
    assert base.status_of(d.status.array).ok
    assert int(d.scratch.verdict.get()[0]) == wire.STATUS_OK
    plan = d.reference()
    d.assert_plan_outputs(plan)
    d.assert_plan_arrays()
    d.assert_sent(plan)
    if drop_last_rank and not d.always_send:
        assert d.expected.get()[num_ffn - 1] == 0


@pytest.mark.parametrize("fused", [False, True], ids=["3-kernel", "fused"])
@pytest.mark.parametrize("put_peers", [(0,), (1, 2), (0, 1, 2, 3)], ids=["put0", "put12", "put-all"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dedup_dispatch_to_put_peers_fills_the_staging(request, dtype, put_peers, fused):
    """Mixed peers in one scatter (docs/design/put-transport.md): a zero window pointer sends rank j's route
    table, rows, header and flag to slot (j, ring) of the own staging, the others to their
    windows; a put peer's window is never touched, an empty one's staging slot neither."""
    rng = node_rng(request)
    num_ffn, num_tokens, top_k = 4, 37, 6
    epr = -(-NUM_EXPERTS // num_ffn)
    ids = base.skewed_ids(rng, num_tokens, top_k, np.arange(3 * epr))  # rank 3 gets no rows
    for always_send in (0, 1):
        d = DedupDispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                          hidden=50, has_shared=1, ids=ids, always_send=always_send, put_peers=put_peers)
        d.run(fused=fused)
        assert base.status_of(d.status.array).ok
        plan = d.reference()
        d.assert_plan_outputs(plan)
        d.assert_sent(plan)


@pytest.mark.parametrize("fused", [False, True], ids=["3-kernel", "fused"])
def test_dedup_dispatch_to_put_peers_capacity_writes_nothing(request, fused):
    rng = node_rng(request)
    ids = base.skewed_ids(rng, 40, 4, np.arange(NUM_EXPERTS // 2))  # rank 0 over its cap
    d = DedupDispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=40, top_k=4, hidden=64,
                      has_shared=1, ids=ids, routed_cap=20, put_peers=(0,))
    d.run(fused=fused)
    d.assert_nothing_sent(wire.STATUS_CAPACITY)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dedup_dispatch_large_batch_grid_stride(request, dtype):
    """More (token, rank) cells than 1024 blocks x 8 warps, ~100 row chunks."""
    rng = node_rng(request)
    ids = base.skewed_ids(rng, 3000, 8, np.arange(NUM_EXPERTS))
    d = DedupDispatch(rng, dtype=dtype, num_ffn=4, num_tokens=3000, top_k=8, hidden=64, has_shared=1, ids=ids)
    d.run()
    assert base.status_of(d.status.array).ok
    plan = d.reference()
    d.assert_plan_outputs(plan)
    d.assert_sent(plan)


@pytest.mark.parametrize("fused", [False, True], ids=["3-kernel", "fused"])
@pytest.mark.parametrize("has_shared", [0, 1])
def test_dedup_dispatch_many_ranks_and_top_k_over_a_warp(request, has_shared, fused):
    """F = 33 (row keys past one warp) and top_k = 40 (two ballot rounds per route-table row)."""
    rng = node_rng(request)
    num_experts = 99
    ids = rng.integers(0, num_experts, (57, 40)).astype(np.int32)
    d = DedupDispatch(rng, dtype="bfloat16", num_ffn=33, num_tokens=57, top_k=40, hidden=40,
                      has_shared=has_shared, ids=ids, num_experts=num_experts, num_attn=2)
    d.run(fused=fused)
    assert base.status_of(d.status.array).ok
    plan = d.reference()
    d.assert_plan_outputs(plan)
    d.assert_sent(plan)


@pytest.mark.parametrize("fused", [False, True], ids=["3-kernel", "fused"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dedup_dispatch_capacity_writes_nothing(request, dtype, fused):
    rng = node_rng(request)
    num_ffn, num_tokens, top_k = 3, 50, 4
    ids = base.skewed_ids(rng, num_tokens, top_k, np.arange(NUM_EXPERTS))
    epr = -(-NUM_EXPERTS // num_ffn)
    plan = dedup_reference.plan_reference(ids, num_ffn, epr, has_shared=True)
    counts = [plan.routed_count(j) for j in range(num_ffn)]
    cap = sorted(counts)[1]  # at least one rank's staging would overflow
    first_over = next(j for j, c in enumerate(counts) if c > cap)
    d = DedupDispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                      hidden=64, has_shared=1, ids=ids, routed_cap=cap)
    d.run(fused=fused)
    assert base.status_of(d.status.array) == wire.StatusRecord(
        wire.STATUS_CAPACITY, first_over, -1, -1, -1, -1, counts[first_over], cap, d.layer_idx)
    d.assert_nothing_sent(wire.STATUS_CAPACITY)


@pytest.mark.parametrize("fused", [False, True], ids=["3-kernel", "fused"])
def test_dedup_dispatch_bad_expert_id_writes_nothing(request, fused):
    rng = node_rng(request)
    num_ffn = 4
    epr = -(-NUM_EXPERTS // num_ffn)
    ids = base.skewed_ids(rng, 30, 2, np.arange(NUM_EXPERTS))
    ids[17, 1] = num_ffn * epr  # first id past the padded experts
    ids[3, 0] = -1
    d = DedupDispatch(rng, dtype="float16", num_ffn=num_ffn, num_tokens=30, top_k=2, hidden=64,
                      has_shared=1, ids=ids)
    d.run(fused=fused)
    assert base.status_of(d.status.array).name == "BAD_EXPERT"
    d.assert_nothing_sent(wire.STATUS_BAD_EXPERT)


@pytest.mark.parametrize("fused", [False, True], ids=["3-kernel", "fused"])
def test_dedup_dispatch_after_latched_error_writes_nothing(request, fused):
    rng = node_rng(request)
    ids = base.skewed_ids(rng, 20, 2, np.arange(NUM_EXPERTS))
    d = DedupDispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=20, top_k=2, hidden=64,
                      has_shared=1, ids=ids)
    d.status.array[:] = [wire.STATUS_TIMEOUT, 1, 3, 1, 9, 8, -1, -1, 7]
    d.run(fused=fused)
    assert d.status.array.tolist() == [wire.STATUS_TIMEOUT, 1, 3, 1, 9, 8, -1, -1, 7]
    d.assert_nothing_sent(wire.STATUS_TIMEOUT)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dedup_fused_dispatch_grid_stride(request, dtype):
    """afd_dedup_dispatch_fused with more (token, rank) cells than 1024 blocks x 8 warps (1100
    tokens x 8 ranks), still within its shared memory: every block plans all 1100 tokens."""
    rng = node_rng(request)
    ids = base.skewed_ids(rng, 1100, 2, np.arange(NUM_EXPERTS))
    d = DedupDispatch(rng, dtype=dtype, num_ffn=8, num_tokens=1100, top_k=2, hidden=64,
                      has_shared=1, ids=ids, num_experts=16)
    assert kernels.fused_dedup_dispatch_fits(d.num_tokens + 3, d.top_k, d.num_ffn * d.epr, d.num_ffn)
    assert d.num_tokens * d.num_ffn > kernels.MAX_BLOCKS * kernels.ROWS_PER_BLOCK
    d.run(fused=True)
    assert base.status_of(d.status.array).ok
    plan = d.reference()
    d.assert_plan_outputs(plan)
    d.assert_plan_arrays()
    d.assert_sent(plan)


def test_dedup_fused_dispatch_publishes_nothing_when_a_block_skipped(request):
    """The last block sends only if no block saw an earlier error: with the `skipped` word set
    (as a block that read a latched status sets it) no flag, header, seq or expected is
    written, and the word is left zero for the next dispatch."""
    rng = node_rng(request)
    ids = base.skewed_ids(rng, 40, 2, np.arange(NUM_EXPERTS))
    d = DedupDispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=40, top_k=2, hidden=64,
                      has_shared=1, ids=ids)
    d.scratch.skipped.fill(1)
    d.run(fused=True)
    base.assert_skipped_dispatch_published_nothing(d)


def test_dedup_fused_dispatch_spec_refuses_what_does_not_fit():
    assert kernels.fused_dedup_dispatch_fits(128, 8, 64, 1)
    assert not kernels.fused_dedup_dispatch_fits(3000, 8, NUM_EXPERTS, 1)
    layout = dedup_layout(num_regions=2, epr=NUM_EXPERTS, hidden=64, dtype="bfloat16", top_k=8,
                          token_cap=3000, routed_cap=24000, has_shared=1)
    buf = cp.zeros(24000, cp.int32)
    with pytest.raises(ValueError, match="shared memory"):
        kernels.dedup_dispatch_fused_spec(
            dtype_code=0, hidden=buf.data.ptr, num_tokens=3000, hidden_size=64, topk_ids=buf,
            topk_weights=buf.view(cp.float32), top_k=8, expert_per_rank=NUM_EXPERTS, num_ffn_ranks=1,
            routed_cap=24000, has_shared=1, expert_counts=buf, expert_start=buf, rank_offsets=buf,
            verdict=buf, skipped=buf, row_map=buf, shared_rank=buf, num_rows=buf, shared_rows=buf,
            peer_windows=cp.zeros(1, cp.uint64), geo=layout.kernel_geometry(), ring=0, src_rank=0,
            layer_idx=0, stage_idx=0, seq_counters=cp.zeros(1, cp.int64), expected=cp.zeros(1, cp.int64),
            expected_counts=buf, done_counter=cp.zeros(1, cp.uint32), status=buf.data.ptr)


# --- wait_replies (dedup = 1) -> dedup combine ---------------------------------------------------
class DedupCombine:
    """The Attention rank's own window with dedup replies from F FFN ranks written in by hand."""

    def __init__(self, rng, *, dtype, num_ffn, num_tokens, top_k, hidden, has_shared, ids,
                 num_experts=NUM_EXPERTS, ring=0, num_attn=2):
        self.rng, self.dtype, self.num_ffn, self.num_tokens, self.top_k = rng, dtype, num_ffn, num_tokens, top_k
        self.hidden, self.ring, self.ids = hidden, ring, ids
        self.epr = -(-num_experts // num_ffn)
        self.plan = dedup_reference.plan_reference(ids, num_ffn, self.epr, has_shared=bool(has_shared),
                                                   num_experts=num_ffn * self.epr)
        self.layout = dedup_layout(num_regions=max(num_attn, num_ffn), epr=self.epr, hidden=hidden,
                                   dtype=dtype, top_k=top_k, token_cap=max(num_tokens, 1),
                                   routed_cap=max(num_tokens * top_k, 1), has_shared=has_shared)
        self.window_np = rng.integers(0, 256, self.layout.window_bytes, dtype=np.uint8)
        self.last_seen_before = base.take(self.window_np, 0, np.int64, self.layout.num_slots).copy()
        self.replies = [base.random_rows(rng, int(self.plan.num_rows[j]), hidden, dtype) for j in range(num_ffn)]
        self.expected = np.array([int(rng.integers(1, 2**40)) if self.plan.num_rows[j] else 0
                                  for j in range(num_ffn)], np.int64)
        self.expected_counts = np.array([[self.plan.routed_count(j), self.plan.shared_rows[j],
                                          self.plan.num_rows[j]] for j in range(num_ffn)], np.int32)
        self.layer_idx, self.stage_idx = 3, 1
        self.status = kernels.PinnedInt64(wire.STATUS_WORDS)
        self.done = cp.zeros(1, cp.uint32)
        self.out = cp.full((max(num_tokens, 1), hidden), base.NAN_WORD[dtype], dtype=base.RAW[dtype])
        self.new_flags = {}

    @property
    def rows_word(self) -> int:
        return self.layout.num_rows_word

    def reply_words(self, j, words: dict | None = None) -> np.ndarray:
        """The correct reply header words of FFN rank ``j``, then ``words`` (header word index
        -> int32 value) written over them."""
        plan = self.plan
        header = wire.Header(seq=int(self.rng.integers(1, 2**31)), src_rank=j, layer_idx=self.layer_idx,
                             stage_idx=self.stage_idx, num_tokens=self.num_tokens,
                             routed_tokens=plan.routed_count(j), shared_tokens=int(plan.shared_rows[j]),
                             top_k=self.top_k, flags=wire.FLAG_DEDUP, echo_seq=int(self.expected[j]),
                             expert_counts=tuple(int(c) for c in plan.rank_counts(j)),
                             num_rows=int(plan.num_rows[j]))
        out = wire.encode_header(header, self.epr)
        for index, value in (words or {}).items():
            out[index] = value
        return out

    def write_reply(self, j, *, words=None, arrive=True):
        layout = self.layout
        slot, offset = layout.slot_index(j, self.ring), layout.slot_offset(j, self.ring)
        words = self.reply_words(j) if words is None else words
        base.put(self.window_np, offset + layout.field_offset("header"), words)
        base.put(self.window_np, offset + layout.field_offset("routed_x"), self.replies[j])
        if arrive:
            flag = int(self.last_seen_before[slot]) + int(self.rng.integers(1, 1000))
            self.new_flags[slot] = flag
            base.put(self.window_np, slot * 8, np.int64(flag))

    def run(self, *, timeout_ns=base.LONG_TIMEOUT_NS, out_scale=1.0, wait_kernel=True,
            reply_flags=None):
        """afd_wait_replies (dedup; optional) then afd_dedup_combine. ``reply_flags``: int64
        [F + 1] start value (zeros by default), left in ``self.reply_flags``."""
        self.reply_flags = (cp.zeros(self.num_ffn + 1, cp.int64) if reply_flags is None
                            else cp.asarray(reply_flags))
        self.window = cp.asarray(self.window_np)
        self.last_seen = cp.asarray(self.last_seen_before)
        self.row_map = cp.asarray(self.plan.row_map if self.num_tokens else
                                  np.full((1, self.num_ffn), -1, np.int32))
        replies = dict(window=self.window.data.ptr, geo=self.layout.kernel_geometry(),
                       num_ffn_ranks=self.num_ffn, ring=self.ring, expected=cp.asarray(self.expected),
                       expected_counts=cp.asarray(self.expected_counts), layer_idx=self.layer_idx,
                       stage_idx=self.stage_idx, last_seen=self.last_seen,
                       reply_flags=self.reply_flags, timeout_ns=timeout_ns, status=self.status.ptr)
        combine = kernels.dedup_combine_spec(
            dtype_code=kernels.DTYPE_CODES[self.dtype], out=self.out.data.ptr,
            num_tokens=self.num_tokens, hidden_size=self.hidden, row_map=self.row_map,
            out_scale=out_scale, done_counter=self.done, **replies)
        wait = kernels.wait_replies_spec(**replies, dedup=1)  # both compiled before the clock
        base.sync()
        start = time.perf_counter()
        if wait_kernel:
            wait.launch()
        combine.launch()
        base.sync()
        return time.perf_counter() - start

    def reference(self, out_scale):
        rows = [base.to_f32(r, self.dtype).reshape(-1, self.hidden) for r in self.replies]
        return dedup_reference.combine_reference(self.plan.row_map, rows, out_scale)

    def assert_rows_nan(self):
        assert np.isnan(base.to_f32(self.out.get()[:self.num_tokens], self.dtype)).all()

    def assert_last_seen_unchanged(self):
        np.testing.assert_array_equal(self.last_seen.get(), self.last_seen_before)


COMBINE_CASES = [  # num_ffn, num_tokens, top_k, has_shared, hidden, out_scale
    (1, 1, 1, 0, 64, 1.0), (1, 300, 8, 1, 64, 2.5), (2, 7, 2, 1, 33, 0.5), (3, 300, 6, 1, 64, 2.5),
    (4, 300, 8, 0, 50, 1.0), (4, 7, 8, 1, 64, 1.0), (3, 0, 2, 1, 64, 1.0), (2, 1, 6, 1, 72, 1.0),
    (2, 1300, 2, 1, 64, 0.25), (4, 2, 1, 1, 40, 1.0),
    # a token's row in parts, a block each (kernels.combine_parts); 4105: rows not 16-byte
    # aligned (the element path in parts); 6 ranks: a full and a partial batch of loads
    (1, 1, 8, 1, 7168, 1.0), (2, 5, 8, 1, 7168, 0.5), (3, 9, 5, 0, 4105, 1.0), (6, 4, 8, 1, 4104, 1.0)]


@pytest.mark.parametrize("wait_kernel", [True, False], ids=["wait+combine", "combine-alone"])
@pytest.mark.parametrize("case", COMBINE_CASES, ids=[str(c) for c in COMBINE_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dedup_combine_matches_reference(request, dtype, case, wait_kernel):
    num_ffn, num_tokens, top_k, has_shared, hidden, out_scale = case
    rng = node_rng(request)
    epr = -(-NUM_EXPERTS // num_ffn)
    allowed = np.arange(min(NUM_EXPERTS, max(1, num_ffn - 1) * epr))  # the last rank gets no rows
    ids = base.skewed_ids(rng, num_tokens, top_k, allowed)
    c = DedupCombine(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                     hidden=hidden, has_shared=has_shared, ids=ids, ring=num_tokens % 2)
    for j in range(num_ffn):
        if c.expected[j]:
            c.write_reply(j)
    c.run(out_scale=out_scale, wait_kernel=wait_kernel)
    assert base.status_of(c.status.array).ok, base.status_of(c.status.array)
    got = base.to_f32(c.out.get()[:num_tokens], dtype)
    assert not np.isnan(got).any(), "rows left unwritten"
    want = base.to_f32(base.to_raw(c.reference(out_scale), dtype), dtype)
    tol = base.TOLERANCE[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, out_scale))
    last_seen = c.last_seen_before.copy()
    for slot, flag in c.new_flags.items():
        last_seen[slot] = flag
    np.testing.assert_array_equal(c.last_seen.get(), last_seen)
    assert int(c.done.get()[0]) == 0
    assert int(c.reply_flags.get()[num_ffn]) == 0  # the wait's pass mark, cleared by the combine


@pytest.mark.parametrize("mark", ["own", "older"])
def test_dedup_combine_trusts_only_its_own_pass_mark(request, mark):
    """afd_dedup_combine alone over a reply with a wrong echo and reply_flags as a clean wait
    would leave them: with the dispatch's own pass mark the blocks skip the re-check and combine;
    with the ring's previous dispatch's mark they re-check: REPLY_MISMATCH, NaN rows."""
    rng = node_rng(request)
    ids = base.skewed_ids(rng, 9, 4, np.arange(NUM_EXPERTS))
    c = DedupCombine(rng, dtype="bfloat16", num_ffn=2, num_tokens=9, top_k=4, hidden=64,
                     has_shared=1, ids=ids)
    sent = [j for j in range(2) if c.expected[j]]
    for j in sent:
        c.write_reply(j, words=c.reply_words(
            j, {wire.HDR_ECHO_SEQ: np.array([int(c.expected[j]) + 1], np.uint64).astype(np.uint32).view(np.int32)[0]}))
    slots = [c.layout.slot_index(j, c.ring) for j in range(2)]
    start = np.array([c.new_flags.get(slot, 0) for slot in slots] + [0], np.int64)
    own = kernels.wait_pass_mark(c.expected)
    start[-1] = own if mark == "own" else own - kernels.MAX_FFN_RANKS
    c.run(wait_kernel=False, reply_flags=start)
    record = base.status_of(c.status.array)
    if mark == "own":
        assert record.ok, record
        got = base.to_f32(c.out.get()[:c.num_tokens], c.dtype)
        want = base.to_f32(base.to_raw(c.reference(1.0), c.dtype), c.dtype)
        tol = base.TOLERANCE[c.dtype]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        assert (record.code, record.peer, record.count) == (
            wire.STATUS_REPLY_MISMATCH, sent[0], wire.HDR_ECHO_SEQ)
        c.assert_rows_nan()
        c.assert_last_seen_unchanged()
    assert int(c.reply_flags.get()[-1]) == 0


def test_dedup_combine_many_ranks(request):
    """F = 33: the per-token row list is built over two ballot rounds."""
    rng = node_rng(request)
    ids = rng.integers(0, 99, (40, 12)).astype(np.int32)
    c = DedupCombine(rng, dtype="float32", num_ffn=33, num_tokens=40, top_k=12, hidden=64,
                     has_shared=1, ids=ids, num_experts=99)
    for j in range(33):
        if c.expected[j]:
            c.write_reply(j)
    c.run(out_scale=1.5)
    assert base.status_of(c.status.array).ok
    np.testing.assert_allclose(base.to_f32(c.out.get()[:40], "float32"), c.reference(1.5), rtol=1e-6, atol=1e-6)


def _two_rank_dedup_combine(request, dtype="bfloat16", hidden=64):
    """Rank 1 has a token with two partials (token 0) and one with one (token 1), so num_rows
    can move by one either way and stay a possible dedup size."""
    rng = node_rng(request)
    ids = base.skewed_ids(rng, 7, 2, np.arange(NUM_EXPERTS))
    ids[0], ids[1] = [5, 6], [0, 9]  # epr = 5: experts 5..9 live on rank 1
    return DedupCombine(rng, dtype=dtype, num_ffn=2, num_tokens=7, top_k=2, hidden=hidden, has_shared=1,
                        ids=ids, ring=1)


def _int32(u32: int) -> int:
    """The int32 header word with the bits of the unsigned 32-bit value ``u32``."""
    return u32 - 2**32 if u32 >= 2**31 else u32


def _routed_plus_one(c):
    """routed_tokens and one expert count of rank 1 raised together (consistent, not what was sent)."""
    words = c.reply_words(1)
    words[wire.HDR_ROUTED_TOKENS] += 1
    words[wire.HDR_FIXED_WORDS + int(np.argmax(c.plan.rank_counts(1)))] += 1
    return words


DEDUP_REPLY_FAULTS = {  # fault -> (reply words of rank 1, (code, ST_COUNT)); rw = num_rows word
    "missing_flag": (lambda c: c.reply_words(1, {wire.HDR_FLAGS: 0}),
                     lambda rw: (wire.STATUS_BAD_HEADER, wire.HDR_FLAGS)),
    "pair_shutdown": (lambda c: c.reply_words(1, {wire.HDR_FLAGS: wire.FLAG_SHUTDOWN}),
                      lambda rw: (wire.STATUS_BAD_HEADER, wire.HDR_FLAGS)),
    "shutdown": (lambda c: c.reply_words(1, {wire.HDR_FLAGS: wire.FLAG_SHUTDOWN | wire.FLAG_DEDUP,
                                             wire.HDR_ECHO_SEQ: 0}),
                 lambda rw: (wire.STATUS_SHUTDOWN, -1)),
    "magic": (lambda c: c.reply_words(1, {wire.HDR_MAGIC: 0x12345678}),
              lambda rw: (wire.STATUS_BAD_HEADER, wire.HDR_MAGIC)),
    "negative_rows": (lambda c: c.reply_words(1, {c.rows_word: -1}),
                      lambda rw: (wire.STATUS_BAD_HEADER, rw)),
    "rows_over_routed": (lambda c: c.reply_words(1, {c.rows_word: c.plan.routed_count(1) + 1}),
                         lambda rw: (wire.STATUS_BAD_HEADER, rw)),
    "shared_over_rows": (lambda c: c.reply_words(1, {wire.HDR_SHARED_TOKENS: int(c.plan.num_rows[1]) + 1}),
                         lambda rw: (wire.STATUS_BAD_HEADER, rw)),
    "num_rows": (lambda c: c.reply_words(1, {c.rows_word: int(c.plan.num_rows[1]) + 1}),
                 lambda rw: (wire.STATUS_REPLY_MISMATCH, rw)),
    "echo": (lambda c: c.reply_words(1, {wire.HDR_ECHO_SEQ: _int32((int(c.expected[1]) + 1) & 0xFFFFFFFF)}),
             lambda rw: (wire.STATUS_REPLY_MISMATCH, wire.HDR_ECHO_SEQ)),
    "layer": (lambda c: c.reply_words(1, {wire.HDR_LAYER: c.layer_idx + 1}),
              lambda rw: (wire.STATUS_REPLY_MISMATCH, wire.HDR_LAYER)),
    "routed": (_routed_plus_one, lambda rw: (wire.STATUS_REPLY_MISMATCH, wire.HDR_ROUTED_TOKENS)),
}


@pytest.mark.parametrize("wait_kernel", [True, False], ids=["wait+combine", "combine-alone"])
@pytest.mark.parametrize("fault", sorted(DEDUP_REPLY_FAULTS))
def test_dedup_combine_header_faults(request, fault, wait_kernel):
    """Each faulty dedup reply latches the record of wire.reply_verdict (wire_mode="dedup"),
    the host checks raise the same type for the same bytes, rows are NaN."""
    c = _two_rank_dedup_combine(request, dtype="float16")
    c.write_reply(0)
    make_words, record_of = DEDUP_REPLY_FAULTS[fault]
    words = make_words(c)
    c.write_reply(1, words=words)
    c.run(wait_kernel=wait_kernel)
    slot = c.layout.slot_index(1, c.ring)
    want = wire.ReplyExpectation(peer=1, seq=int(c.expected[1]), layer_idx=c.layer_idx,
                                 stage_idx=c.stage_idx, routed_tokens=int(c.expected_counts[1, 0]),
                                 shared_tokens=int(c.expected_counts[1, 1]),
                                 num_rows=int(c.expected_counts[1, 2]))
    verdict = wire.reply_verdict(words, want, wire_mode="dedup", slot=slot, ring=c.ring,
                                 flag=c.new_flags[slot])
    assert (verdict.code, verdict.count) == record_of(c.rows_word)
    record = base.status_of(c.status.array)
    assert record == verdict
    device_error = record.error(layer_idx=c.layer_idx, expert_per_rank=c.epr)
    with pytest.raises(type(device_error)):
        wire.check_reply(wire.decode_header(words, c.epr, wire_mode="dedup"), want)
    if verdict.count == c.rows_word:
        assert "num_rows" in str(device_error)
    c.assert_rows_nan()
    c.assert_last_seen_unchanged()


@pytest.mark.parametrize("hidden", [64, 7168])  # 7168: every token's row in 4 parts (blocks)
def test_dedup_combine_timeout_names_peer_and_writes_nan(request, hidden):
    c = _two_rank_dedup_combine(request, hidden=hidden)
    c.write_reply(0)
    c.write_reply(1, arrive=False)
    elapsed = c.run(timeout_ns=50_000_000)
    slot = c.layout.slot_index(1, c.ring)
    assert base.status_of(c.status.array) == wire.StatusRecord(
        wire.STATUS_TIMEOUT, 1, slot, c.ring, int(c.expected[1]), int(c.last_seen_before[slot]), -1, -1,
        c.layer_idx)
    assert elapsed < 5.0
    c.assert_rows_nan()
    c.assert_last_seen_unchanged()


@pytest.mark.parametrize("wait_kernel", [True, False], ids=["wait+combine", "combine-alone"])
def test_pair_wait_refuses_a_dedup_reply(request, wait_kernel):
    """A pair receiver latches BAD_HEADER (flags) for FLAG_DEDUP, as wire.decode_header refuses it."""
    c = base._two_rank_combine(request)
    c.write_reply(0)
    words = c.reply_words(1)
    words[wire.HDR_FLAGS] |= wire.FLAG_DEDUP
    c.write_reply(1, words=words)
    c.run(wait_kernel=wait_kernel)
    record = base.status_of(c.status.array)
    assert (record.code, record.count, record.expected, record.observed) == (
        wire.STATUS_BAD_HEADER, wire.HDR_FLAGS, 0, wire.FLAG_DEDUP)
    with pytest.raises(errors.WireError):
        wire.decode_header(words, c.epr)
    c.assert_rows_nan()
    c.assert_last_seen_unchanged()


# --- dedup dispatch -> numpy FFN (expand, experts, reduce) -> wait -> dedup combine -------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_ffn,num_tokens,top_k,has_shared", [
    (1, 33, 8, 1), (2, 129, 8, 1), (4, 5, 2, 0), (4, 64, 6, 1), (3, 1, 3, 1)])
def test_dedup_round_trip(request, dtype, num_ffn, num_tokens, top_k, has_shared):
    """The FFN side in numpy: check the route table, expand, scale each expert's rows by its own
    factor, reduce with the travelled weights (+ the shared rows x 0.5), reply into the
    Attention window; the device wait + dedup combine must give the reference combine and the
    end-to-end formula out[t] = scale * (sum_k w[t,k] * f(e[t,k]) + 0.5 * has_shared) * x[t]."""
    rng = node_rng(request)
    ids = base.skewed_ids(rng, num_tokens, top_k, np.arange(NUM_EXPERTS))
    d = DedupDispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                      hidden=64, has_shared=has_shared, ids=ids, ring=0)
    d.run()
    assert base.status_of(d.status.array).ok
    layout, epr, out_scale = d.layout, d.epr, 1.5
    factor = 1.0 + 0.25 * np.arange(num_ffn * epr, dtype=np.float32)  # expert e's "MLP": x * f(e)
    attn_np = rng.integers(0, 256, layout.window_bytes, dtype=np.uint8)
    last_seen = base.take(attn_np, 0, np.int64, layout.num_slots).copy()
    reply_rows, expected = [], d.expected.get()
    for j in range(num_ffn):
        if expected[j] == 0:
            reply_rows.append(np.zeros((0, d.hidden), np.float32))
            continue
        got, slot = d.windows[j].get(), layout.slot_offset(d.src_rank, d.ring)
        request_hdr = wire.decode_header(base.take(got, slot, np.int32, layout.header_words), epr, layout)
        num_rows = request_hdr.num_rows
        table = base.take(got, slot + layout.field_offset("route_table"), np.int32,
                          num_rows * layout.route_width).reshape(num_rows, layout.route_width).copy()
        wire.check_route_table(table, num_tokens=num_tokens, routed_tokens=request_hdr.routed_tokens,
                               shared_tokens=request_hdr.shared_tokens, top_k=top_k)
        rows = base.to_f32(base.take(got, slot + layout.field_offset("routed_x"), base.RAW[dtype],
                                     num_rows * d.hidden).reshape(num_rows, d.hidden), dtype)
        staging = dedup_reference.expand_reference(table, rows, request_hdr.routed_tokens)
        local_expert = np.repeat(np.arange(epr), request_hdr.expert_counts)
        routed_out = staging * factor[j * epr + local_expert][:, None]
        shared_out = rows[:request_hdr.shared_tokens] * 0.5 if has_shared else None
        reply = base.to_f32(base.to_raw(dedup_reference.reduce_reference(table, routed_out, shared_out), dtype), dtype)
        reply_rows.append(reply)
        header = wire.reply_header(request_hdr, seq=int(rng.integers(1, 2**31)), src_rank=j)
        offset = layout.slot_offset(j, d.ring)
        base.put(attn_np, offset + layout.field_offset("header"), wire.encode_header(header, epr))
        base.put(attn_np, offset + layout.field_offset("routed_x"), base.to_raw(reply, dtype))
        base.put(attn_np, layout.slot_index(j, d.ring) * 8, np.int64(last_seen[layout.slot_index(j, d.ring)] + 1))
    attn_window, last_seen_dev = cp.asarray(attn_np), cp.asarray(last_seen)
    out = cp.full((num_tokens, d.hidden), base.NAN_WORD[dtype], dtype=base.RAW[dtype])
    status = kernels.PinnedInt64(wire.STATUS_WORDS)
    replies = dict(window=attn_window.data.ptr, geo=layout.kernel_geometry(), num_ffn_ranks=num_ffn,
                   ring=d.ring, expected=d.expected, expected_counts=d.expected_counts,
                   layer_idx=d.layer_idx, stage_idx=d.stage_idx, last_seen=last_seen_dev,
                   reply_flags=cp.zeros(num_ffn + 1, cp.int64), timeout_ns=base.LONG_TIMEOUT_NS,
                   status=status.ptr)
    kernels.wait_replies_spec(**replies, dedup=1).launch()
    kernels.dedup_combine_spec(dtype_code=kernels.DTYPE_CODES[dtype], out=out.data.ptr,
                               num_tokens=num_tokens, hidden_size=d.hidden, row_map=d.rows.row_map,
                               out_scale=out_scale, done_counter=cp.zeros(1, cp.uint32), **replies).launch()
    base.sync()
    assert base.status_of(status.array).ok, base.status_of(status.array)
    got = base.to_f32(out.get(), dtype)
    tol = base.TOLERANCE[dtype]
    plan = d.reference()
    want = base.to_f32(base.to_raw(dedup_reference.combine_reference(plan.row_map, reply_rows, out_scale), dtype), dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * out_scale)
    x = base.to_f32(d.hidden_raw, dtype)
    gain = (d.weights * factor[ids]).sum(axis=1) + 0.5 * has_shared
    direct = out_scale * gain[:, None] * x
    np.testing.assert_allclose(got, direct, rtol=3 * tol, atol=3 * tol * np.abs(direct).max())
