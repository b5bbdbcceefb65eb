"""afd_dedup_dispatch_ll (raw_kernels/attention/dedup_attn_ll.cu, ``ConnectorConfig(dedup_dispatch="ll")``)
against the numpy reference (afd_cupy/testing/dedup_reference.py) and byte for byte against
afd_dedup_dispatch_fused, in one process on one GPU.

Reuses tests/kernels/test_kernels_cuda_dedup_attn.py's ``DedupDispatch`` (F CuPy arrays as peer windows,
pre-filled with random bytes, or with all-ones bytes = NaN in every payload dtype; row_map
pre-filled with garbage; every expected window rebuilt in numpy and compared byte for byte).
The ll kernel orders the rows exactly as the plan does (shared rows first, token order within a
class), so no normalisation of the row order is needed: a mismatch names the peer and the
first differing field (``base.assert_window_equal``).
"""
from __future__ import annotations

import numpy as np
import pytest

from afd_cupy import kernels, wire
from afd_cupy.testing import dedup_reference
from helpers.rng import node_rng

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.cuda

import test_kernels_cuda as base  # noqa: E402 (imports cupy and torch)
import test_kernels_cuda_dedup_attn as dedup  # noqa: E402

NUM_EXPERTS = base.NUM_EXPERTS
# (F, T) incl. T = 0 and T = 1; K and hidden cycle through base.TOP_KS / base.HIDDENS
LL_CASES = [(f, t) for f in (1, 2, 3, 4, 8) for t in (0, 1, 7, 128, 300)]


class LLDispatch(dedup.DedupDispatch):
    """DedupDispatch sent by afd_dedup_dispatch_ll (``run_ll``) instead of the fused kernel."""

    def spec(self, max_blocks=kernels.MAX_BLOCKS):
        s, r = self.scratch, self.rows
        return kernels.dedup_dispatch_ll_spec(
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
            max_tokens=self.num_tokens + 3, max_blocks=max_blocks)

    def run_ll(self, max_blocks=kernels.MAX_BLOCKS, grid=None):
        """One launch; ``grid`` overrides the spec's (e.g. 1: block 0 writes every row itself)."""
        kernels.PackedLaunch(self.spec(max_blocks)).launch(cp.cuda.get_current_stream().ptr, grid)
        base.sync()

    def fill_nan(self):
        """Windows (and staging) pre-filled with all-ones bytes: NaN in bf16, fp16 and fp32."""
        for j in range(self.num_ffn):
            self.prefill[j].fill(0xFF)
            self.windows[j].fill(0xFF)
        if self.put_peers:
            self.staging_prefill.fill(0xFF)
            self.staging.fill(0xFF)


def _ids(rng, num_ffn, num_tokens, top_k, drop_last_rank):
    epr = -(-NUM_EXPERTS // num_ffn)
    allowed = np.arange(min(NUM_EXPERTS, (num_ffn - drop_last_rank) * epr))
    return base.skewed_ids(rng, num_tokens, top_k, allowed)


def _check_sent(d):
    assert base.status_of(d.status.array).ok, base.status_of(d.status.array)
    assert int(d.scratch.verdict.get()[0]) == wire.STATUS_OK
    plan = d.reference()
    d.assert_plan_outputs(plan)
    d.assert_plan_arrays()
    d.assert_sent(plan)
    return plan


@pytest.mark.parametrize("has_shared", [0, 1])
@pytest.mark.parametrize("num_ffn,num_tokens", LL_CASES)
@pytest.mark.parametrize("dtype", base.DTYPES)
def test_ll_dispatch_matches_reference(request, dtype, num_ffn, num_tokens, has_shared):
    rng = node_rng(request)
    case = LL_CASES.index((num_ffn, num_tokens)) + has_shared + base.DTYPES.index(dtype)
    top_k, hidden = base.TOP_KS[case % 4], base.HIDDENS[case % 3]
    drop_last_rank = num_ffn > 1 and case % 2 == 0  # an FFN rank without rows
    ids = _ids(rng, num_ffn, num_tokens, top_k, drop_last_rank)
    d = LLDispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                   hidden=hidden, has_shared=has_shared, ids=ids, always_send=case % 5 == 0,
                   num_attn=2)
    if case % 3 == 0:
        d.fill_nan()
    d.run_ll()
    _check_sent(d)
    if drop_last_rank and not d.always_send:
        assert d.expected.get()[num_ffn - 1] == 0, "an FFN rank without rows got a message"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_ffn,num_tokens,top_k,num_experts,hidden",
                         [(1, 128, 8, 256, 7168), (2, 128, 8, 256, 512), (4, 1, 8, 64, 256),
                          (8, 96, 6, 64, 96), (32, 40, 8, 64, 64)])
def test_ll_dispatch_bytes_equal_the_fused_kernel(request, seed, num_ffn, num_tokens, top_k,
                                                   num_experts, hidden):
    """The same inputs (two dispatches built from one seed) through afd_dedup_dispatch_fused and
    afd_dedup_dispatch_ll: every window byte and every output array equal (the decode shape of
    the issue, hidden 7168 top-8 E=256 F=1, first)."""
    key = int(node_rng(request).integers(0, 2**31)) + seed
    uniform = np.random.default_rng(key).integers(0, num_experts, (num_tokens, top_k)).astype(np.int32)
    pair = []
    for _ in range(2):
        rng = np.random.default_rng(key)
        pair.append(LLDispatch(rng, dtype="bfloat16", num_ffn=num_ffn, num_tokens=num_tokens,
                               top_k=top_k, hidden=hidden, has_shared=seed % 2, ids=uniform,
                               num_experts=num_experts))
    fused, ll = pair
    assert kernels.fused_dedup_dispatch_fits(num_tokens + 3, top_k, num_experts, num_ffn)
    fused.run_fused()
    ll.run_ll()
    for j in range(num_ffn):
        base.assert_window_equal(ll.windows[j].get(), fused.windows[j].get(), ll.layout,
                                 f"peer {j}: ll vs fused")
    for name in ("expert_counts", "expert_start", "rank_offsets", "verdict", "skipped", "scatter_done"):
        np.testing.assert_array_equal(getattr(ll.scratch, name).get(), getattr(fused.scratch, name).get(),
                                      err_msg=name)
    for name in ("row_map", "shared_rank", "num_rows", "shared_rows"):
        np.testing.assert_array_equal(getattr(ll.rows, name).get(), getattr(fused.rows, name).get(),
                                      err_msg=name)
    for name in ("expected", "expected_counts", "seq_counters"):
        np.testing.assert_array_equal(getattr(ll, name).get(), getattr(fused, name).get(), err_msg=name)
    _check_sent(ll)


@pytest.mark.parametrize("grid", [1, 2, None], ids=["grid1", "grid2", "spec-grid"])
@pytest.mark.parametrize("max_blocks", [1, 3, kernels.MAX_BLOCKS])
def test_ll_dispatch_any_grid_writes_every_row(request, grid, max_blocks):
    """Block 0 alone (grid 1: it writes the payload rows too), one copy block, and copy blocks
    striding over more (cell, part) items than they have warps (max_blocks 1, 3)."""
    rng = node_rng(request)
    ids = _ids(rng, 3, 150, 6, drop_last_rank=False)
    d = LLDispatch(rng, dtype="float16", num_ffn=3, num_tokens=150, top_k=6, hidden=3000,
                   has_shared=1, ids=ids)  # 6000-B rows: 2 parts per row
    d.run_ll(max_blocks=max_blocks, grid=grid)
    _check_sent(d)


@pytest.mark.parametrize("put_peers", [(0,), (1, 2), (0, 1, 2, 3)], ids=["put0", "put12", "put-all"])
@pytest.mark.parametrize("always_send", [0, 1])
def test_ll_dispatch_to_put_peers_fills_the_staging(request, put_peers, always_send):
    rng = node_rng(request)
    epr = -(-NUM_EXPERTS // 4)
    ids = base.skewed_ids(rng, 37, 6, np.arange(3 * epr))  # rank 3 gets no rows
    d = LLDispatch(rng, dtype="bfloat16", num_ffn=4, num_tokens=37, top_k=6, hidden=50,
                   has_shared=1, ids=ids, always_send=always_send, put_peers=put_peers)
    d.run_ll()
    assert base.status_of(d.status.array).ok
    plan = d.reference()
    d.assert_plan_outputs(plan)
    d.assert_sent(plan)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("put_peers", [(), (0,)], ids=["direct", "put0"])
def test_ll_dispatch_capacity_writes_nothing(request, dtype, put_peers):
    rng = node_rng(request)
    num_ffn, num_tokens, top_k = 3, 50, 4
    ids = base.skewed_ids(rng, num_tokens, top_k, np.arange(NUM_EXPERTS))
    epr = -(-NUM_EXPERTS // num_ffn)
    plan = dedup_reference.plan_reference(ids, num_ffn, epr, has_shared=True)
    counts = [plan.routed_count(j) for j in range(num_ffn)]
    cap = sorted(counts)[1]  # at least one rank's staging would overflow
    first_over = next(j for j, c in enumerate(counts) if c > cap)
    d = LLDispatch(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                   hidden=64, has_shared=1, ids=ids, routed_cap=cap, put_peers=put_peers)
    d.run_ll()
    assert base.status_of(d.status.array) == wire.StatusRecord(
        wire.STATUS_CAPACITY, first_over, -1, -1, -1, -1, counts[first_over], cap, d.layer_idx)
    d.assert_nothing_sent(wire.STATUS_CAPACITY)


def test_ll_dispatch_bad_expert_id_writes_nothing(request):
    rng = node_rng(request)
    num_ffn = 4
    epr = -(-NUM_EXPERTS // num_ffn)
    ids = base.skewed_ids(rng, 30, 2, np.arange(NUM_EXPERTS))
    ids[17, 1] = num_ffn * epr  # first id past the padded experts
    ids[3, 0] = -1
    d = LLDispatch(rng, dtype="float16", num_ffn=num_ffn, num_tokens=30, top_k=2, hidden=64,
                   has_shared=1, ids=ids)
    d.run_ll()
    record = base.status_of(d.status.array)
    assert record.name == "BAD_EXPERT" and record.slot == 3 * 2 + 0, record  # the lowest bad index
    d.assert_nothing_sent(wire.STATUS_BAD_EXPERT)


def test_ll_dispatch_after_latched_error_writes_nothing(request):
    rng = node_rng(request)
    ids = base.skewed_ids(rng, 20, 2, np.arange(NUM_EXPERTS))
    d = LLDispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=20, top_k=2, hidden=64,
                   has_shared=1, ids=ids)
    d.status.array[:] = [wire.STATUS_TIMEOUT, 1, 3, 1, 9, 8, -1, -1, 7]
    d.run_ll()
    assert d.status.array.tolist() == [wire.STATUS_TIMEOUT, 1, 3, 1, 9, 8, -1, -1, 7]
    d.assert_nothing_sent(wire.STATUS_TIMEOUT)


def test_ll_dispatch_publishes_nothing_when_a_block_skipped(request):
    rng = node_rng(request)
    ids = base.skewed_ids(rng, 40, 2, np.arange(NUM_EXPERTS))
    d = LLDispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=40, top_k=2, hidden=64,
                   has_shared=1, ids=ids)
    d.scratch.skipped.fill(1)
    d.run_ll()
    base.assert_skipped_dispatch_published_nothing(d)


def test_ll_dispatch_twice_on_one_ring_bumps_the_seq_again(request):
    """The done counter and `skipped` are left zero: a second launch (new ids) sends seq + 2."""
    rng = node_rng(request)
    d = LLDispatch(rng, dtype="bfloat16", num_ffn=2, num_tokens=64, top_k=8, hidden=64,
                   has_shared=1, ids=base.skewed_ids(rng, 64, 8, np.arange(NUM_EXPERTS)))
    d.run_ll()
    _check_sent(d)
    d.ids = base.skewed_ids(rng, 64, 8, np.arange(NUM_EXPERTS))
    d.topk_ids[:] = cp.asarray(d.ids.reshape(-1))
    d.seq_before = d.seq_counters.get()
    d.prefill = [w.get() for w in d.windows]
    d.run_ll()
    _check_sent(d)


def test_ll_dispatch_spec_refuses_what_does_not_fit():
    assert kernels.ll_dedup_dispatch_fits(128, 8, 256, 1)
    assert not kernels.ll_dedup_dispatch_fits(57, 8, 99, 33)  # 33 ranks: past one mask word
    assert not kernels.ll_dedup_dispatch_fits(3000, 8, 256, 1)  # shared memory
    layout = dedup.dedup_layout(num_regions=2, epr=NUM_EXPERTS, hidden=64, dtype="bfloat16", top_k=8,
                                token_cap=3000, routed_cap=24000, has_shared=1)
    buf = cp.zeros(24000, cp.int32)
    with pytest.raises(ValueError, match="dedup_dispatch='plan'"):
        kernels.dedup_dispatch_ll_spec(
            dtype_code=0, hidden=buf.data.ptr, num_tokens=3000, hidden_size=64, topk_ids=buf,
            topk_weights=buf.view(cp.float32), top_k=8, expert_per_rank=NUM_EXPERTS, num_ffn_ranks=1,
            routed_cap=24000, has_shared=1, expert_counts=buf, expert_start=buf, rank_offsets=buf,
            verdict=buf, skipped=buf, row_map=buf, shared_rank=buf, num_rows=buf, shared_rows=buf,
            peer_windows=cp.zeros(1, cp.uint64), geo=layout.kernel_geometry(), ring=0, src_rank=0,
            layer_idx=0, stage_idx=0, seq_counters=cp.zeros(1, cp.int64),
            expected=cp.zeros(1, cp.int64), expected_counts=buf, done_counter=cp.zeros(1, cp.uint32),
            status=buf.data.ptr)
