"""The FFN-side dedup kernels (raw_kernels/ffn/dedup_ffn.cu) and afd_wait_any on dedup headers,
against the numpy references of afd_cupy.testing.dedup_reference, on one GPU.

Messages are built by the references (plan_reference + scatter_reference) from fresh random
routings; windows are pre-filled with random bytes and compared byte for byte; the staging,
the route-table copy and the reply rows are pre-filled with NaN / canary words, with guard rows
after the message's rows that must stay untouched.
"""
from __future__ import annotations

import numpy as np
import pytest

from afd_cupy import kernels, wire
from afd_cupy.errors import WireError
from afd_cupy.testing import dedup_reference as ref

from helpers import kernels as kh
from helpers.layouts import kernel_layout
from helpers.rng import node_rng, node_seed

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.cuda

from test_kernels_cuda import (DTYPES, LONG_TIMEOUT_NS, NAN_WORD, NUM_EXPERTS, RAW,  # noqa: E402
                               assert_window_equal, put, random_rows, skewed_ids, sync, take,
                               to_f32, to_raw)

UNCLAIMED = 0x7FFFFFFF
GUARD_ROWS = 3  # canary rows after the staging and after the route-table copy
COPY_CANARY = -7


def dedup_layout(**fields) -> wire.WindowLayout:
    return kernel_layout(wire_mode="dedup", **fields)


class Message:
    """FFN rank ``ffn_rank``'s dedup dispatch from Attention rank ``src_rank``: route table, rows
    and header from the numpy references, for fresh random ids and weights."""

    def __init__(self, rng, *, dtype, num_ffn, num_tokens, top_k, hidden, has_shared, ffn_rank=0,
                 src_rank=1, ring=1):
        self.dtype, self.top_k, self.hidden, self.src_rank, self.ring = dtype, top_k, hidden, src_rank, ring
        self.epr = -(-NUM_EXPERTS // num_ffn)
        ids = skewed_ids(rng, num_tokens, top_k, np.arange(NUM_EXPERTS))
        self.weights = (rng.random((num_tokens, top_k)) + 0.05).astype(np.float32)
        self.plan = ref.plan_reference(ids, num_ffn, self.epr, has_shared=bool(has_shared))
        hidden_raw = random_rows(rng, num_tokens, hidden, dtype)
        self.table, self.rows = ref.scatter_reference(self.plan, hidden_raw, ids, self.weights, ffn_rank)
        self.num_tokens, self.num_rows = num_tokens, int(self.plan.num_rows[ffn_rank])
        self.routed = self.plan.routed_count(ffn_rank)
        self.shared = int(self.plan.shared_rows[ffn_rank])
        self.counts = tuple(int(c) for c in self.plan.rank_counts(ffn_rank))
        self.layer_idx = int(rng.integers(0, 60))
        self.layout = dedup_layout(num_regions=max(2, num_ffn), epr=self.epr, hidden=hidden,
                                   dtype=dtype, top_k=top_k, token_cap=max(num_tokens, 1),
                                   routed_cap=max(num_tokens * top_k, 1), has_shared=has_shared)
        self.width = self.layout.route_width

    def header(self, seq: int) -> wire.Header:
        return wire.dispatch_header(seq=seq, src_rank=self.src_rank, layer_idx=self.layer_idx,
                                    stage_idx=1, num_tokens=self.num_tokens,
                                    shared_tokens=self.shared, top_k=self.top_k,
                                    expert_counts=self.counts, wire_mode="dedup",
                                    num_rows=self.num_rows)


class Expand:
    """The FFN's own window holding one message, the staging and copy with guard rows, the scratch."""

    def __init__(self, rng, msg: Message, *, table=None):
        self.msg, layout = msg, msg.layout
        self.table = msg.table if table is None else table
        self.window_np = rng.integers(0, 256, layout.window_bytes, dtype=np.uint8)
        base = layout.slot_offset(msg.src_rank, msg.ring)
        put(self.window_np, base + layout.field_offset("header"),
            wire.encode_header(msg.header(seq=17), msg.epr))
        put(self.window_np, base + layout.field_offset("route_table"), self.table)
        put(self.window_np, base + layout.field_offset("routed_x"), msg.rows)
        self.window = cp.asarray(self.window_np)
        raw = RAW[msg.dtype]
        self.staging = cp.full((msg.routed + GUARD_ROWS, msg.hidden), NAN_WORD[msg.dtype], raw)
        self.route_copy = cp.full((msg.num_rows + GUARD_ROWS, msg.width), COPY_CANARY, cp.int32)
        self.claims = cp.full(layout.routed_cap + GUARD_ROWS, UNCLAIMED, cp.int32)
        self.fault = cp.full(1, np.iinfo(np.uint64).max, cp.uint64)
        self.num_claimed = cp.zeros(1, cp.uint32)
        self.done = cp.zeros(1, cp.uint32)
        self.status = kernels.PinnedInt64(wire.STATUS_WORDS)

    def run(self, *, max_blocks=kernels.MAX_BLOCKS):
        msg = self.msg
        kh.launch_dedup_expand(
            dtype_code=kernels.DTYPE_CODES[msg.dtype], window=self.window.data.ptr,
            geo=msg.layout.kernel_geometry(), region=msg.src_rank, ring=msg.ring,
            num_rows=msg.num_rows, num_tokens=msg.num_tokens, num_routed=msg.routed,
            num_shared=msg.shared, top_k=msg.top_k, hidden_size=msg.hidden,
            staging=self.staging.data.ptr, route_copy=self.route_copy, claims=self.claims,
            fault=self.fault, num_claimed=self.num_claimed, layer_idx=msg.layer_idx,
            status=self.status.ptr, done_counter=self.done, max_blocks=max_blocks)
        sync()

    def assert_guards_and_scratch(self):
        """Nothing written past the message's rows; the window untouched; scratch as found."""
        msg = self.msg
        staging, copy = self.staging.get(), self.route_copy.get()
        assert (staging[msg.routed:] == NAN_WORD[msg.dtype]).all(), "staging guard rows written"
        assert (copy[msg.num_rows:] == COPY_CANARY).all(), "route-table copy guard rows written"
        assert_window_equal(self.window.get(), self.window_np, msg.layout, "expand wrote its window")
        assert (self.claims.get() == UNCLAIMED).all()
        assert int(self.fault.get()[0]) == np.iinfo(np.uint64).max
        assert int(self.num_claimed.get()[0]) == 0 and int(self.done.get()[0]) == 0


# --- expand ------------------------------------------------------------------------------------
EXPAND_CASES = [(1, 0), (1, 1), (2, 7), (3, 33), (4, 300), (2, 1500)]
TOP_KS = (1, 2, 8)
HIDDENS = (64, 33, 50)  # 16-B rows, 2-B-only rows (bf16/fp16; 4-B for fp32), 4-B rows


@pytest.mark.parametrize("has_shared", [0, 1])
@pytest.mark.parametrize("num_ffn,num_tokens", EXPAND_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_expand_matches_reference(request, dtype, num_ffn, num_tokens, has_shared):
    rng = node_rng(request)
    case = EXPAND_CASES.index((num_ffn, num_tokens)) + has_shared + DTYPES.index(dtype)
    top_k, hidden = TOP_KS[case % 3], HIDDENS[case % 3]
    for ffn_rank in range(num_ffn):
        msg = Message(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                      hidden=hidden, has_shared=has_shared, ffn_rank=ffn_rank)
        wire.check_route_table(msg.table, num_tokens=num_tokens, routed_tokens=msg.routed,
                               shared_tokens=msg.shared, top_k=top_k)
        e = Expand(rng, msg)
        e.run(max_blocks=3 if num_tokens == 1500 else kernels.MAX_BLOCKS)  # 3: grid-stride loop
        assert wire.StatusRecord.decode(e.status.array).ok, wire.StatusRecord.decode(e.status.array)
        want = ref.expand_reference(msg.table, msg.rows, msg.routed)
        np.testing.assert_array_equal(e.staging.get()[:msg.routed], want, err_msg=f"rank {ffn_rank}")
        np.testing.assert_array_equal(e.route_copy.get()[:msg.num_rows], msg.table)
        e.assert_guards_and_scratch()


def _faulty_message(request, fault, top_k):
    """(rng, message, its table with ``fault`` applied, the row the verdict names), from the
    first seed at or after the test id's whose table takes the fault (never a skip)."""
    def faulty(rng):
        msg = Message(rng, dtype="bfloat16", num_ffn=2, num_tokens=40, top_k=top_k, hidden=64,
                      has_shared=1)
        bad = msg.table.copy()
        row = kh.ROUTE_TABLE_FAULTS[fault](bad, num_tokens=msg.num_tokens, shared_tokens=msg.shared,
                                           routed_tokens=msg.routed)
        return None if row is None else (msg, bad, row)

    rng, (msg, bad, row) = kh.first_seed_taking(faulty, node_seed(request),
                                                what=f"a table that takes fault {fault}")
    return rng, msg, bad, row


@pytest.mark.parametrize("top_k", [4, 8])
@pytest.mark.parametrize("fault", sorted(kh.ROUTE_TABLE_FAULTS))
def test_expand_rejects_each_bad_route_table(request, fault, top_k):
    """BAD_HEADER with the model's record (row in ST_COUNT, column in ST_SLOT, rule in ST_CAP);
    the host check rejects the same table; nothing past the message's rows is written; the
    scratch is reusable: a valid message expands correctly right after."""
    rng, msg, bad, row = _faulty_message(request, fault, top_k)
    e = Expand(rng, msg, table=bad)
    e.run()
    verdict = ref.expand_verdict_reference(bad, num_tokens=msg.num_tokens, routed_tokens=msg.routed,
                                           shared_tokens=msg.shared)
    rule, want_row, column, expected, observed = verdict
    assert want_row == row
    record = wire.StatusRecord.decode(e.status.array)
    assert record == wire.StatusRecord(wire.STATUS_BAD_HEADER, msg.src_rank, column, msg.ring,
                                       expected, observed, row, rule, msg.layer_idx)
    with pytest.raises(WireError):
        wire.check_route_table(bad, num_tokens=msg.num_tokens, routed_tokens=msg.routed,
                               shared_tokens=msg.shared, top_k=top_k)
    assert isinstance(wire.route_table_error(record, shared_tokens=msg.shared), WireError)
    np.testing.assert_array_equal(e.route_copy.get()[:msg.num_rows], bad)  # the copy is what was checked
    e.assert_guards_and_scratch()

    good = Expand(rng, msg)  # a fresh window and outputs, the same scratch
    good.claims, good.fault, good.num_claimed, good.done = e.claims, e.fault, e.num_claimed, e.done
    good.run()
    assert wire.StatusRecord.decode(good.status.array).ok
    np.testing.assert_array_equal(good.staging.get()[:msg.routed],
                                  ref.expand_reference(msg.table, msg.rows, msg.routed))
    good.assert_guards_and_scratch()


def test_expand_verdict_with_several_faults_is_the_models(request):
    """The smallest (rule, row, column) wins, whatever order the warps ran in."""
    rng, msg, bad, _ = _faulty_message(request, "duplicate_staging_row", 4)  # at the last row
    range_row, dup_row = msg.num_rows // 2, msg.num_rows - 2
    bad[range_row, wire.ROUTE_SLOTS] = msg.routed
    bad[dup_row, wire.ROUTE_SLOTS + 1] = bad[dup_row, wire.ROUTE_SLOTS]  # a second duplicate
    for _ in range(3):
        e = Expand(rng, msg, table=bad)
        e.run(max_blocks=2)
        rule, row, column, expected, observed = ref.expand_verdict_reference(
            bad, num_tokens=msg.num_tokens, routed_tokens=msg.routed, shared_tokens=msg.shared)
        assert (rule, row) == (wire.ROUTE_FAULT_RANGE, range_row)
        assert wire.StatusRecord.decode(e.status.array) == wire.StatusRecord(
            wire.STATUS_BAD_HEADER, msg.src_rank, column, msg.ring, expected, observed, row, rule,
            msg.layer_idx)
        e.assert_guards_and_scratch()


# --- reply (fused reduce) ----------------------------------------------------------------------
REPLY_CASES = [(1, 0), (1, 1), (2, 7), (3, 33), (1, 300), (2, 1500)]


@pytest.mark.parametrize("transport", ["direct", "put"])
@pytest.mark.parametrize("has_shared", [0, 1])
@pytest.mark.parametrize("num_ffn,num_tokens", REPLY_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dedup_reply_lands_exactly(request, dtype, num_ffn, num_tokens, has_shared, transport):
    """Reply rows = reduce_reference rounded once (bitwise: no FMA on either side), header
    words and flag; every other byte of the Attention window untouched. ``put``: the same rows
    and header in staging slot (dst_peer, ring) of the FFN's own staging, and no flag at all
    (the host's put-with-signal sets it, docs/design/put-transport.md)."""
    rng = node_rng(request)
    case = REPLY_CASES.index((num_ffn, num_tokens)) + has_shared + DTYPES.index(dtype)
    top_k, hidden = TOP_KS[case % 3], HIDDENS[(case + 1) % 3]
    ffn_rank = num_ffn - 1
    msg = Message(rng, dtype=dtype, num_ffn=num_ffn, num_tokens=num_tokens, top_k=top_k,
                  hidden=hidden, has_shared=has_shared, ffn_rank=ffn_rank)
    layout = msg.layout
    routed = random_rows(rng, msg.routed, hidden, dtype)
    shared = random_rows(rng, msg.shared, hidden, dtype)
    routed_dev, shared_dev = cp.asarray(routed), cp.asarray(shared)
    route_copy = cp.asarray(msg.table) if msg.num_rows else cp.zeros((1, msg.width), cp.int32)
    # put: the buffer is the FFN's staging, slot (region = the Attention peer, ring)
    dst_peer = (ffn_rank + 1) % layout.num_regions
    region = dst_peer if transport == "put" else ffn_rank
    slot_base = layout.slot_offset(region, msg.ring)
    prefill = rng.integers(0, 256, layout.window_bytes, dtype=np.uint8)
    nan_rows = np.full((msg.num_rows, hidden), NAN_WORD[dtype], RAW[dtype])
    put(prefill, slot_base + layout.field_offset("routed_x"), nan_rows)  # an unwritten row is NaN
    window = cp.asarray(prefill)
    reply = wire.reply_header(msg.header(seq=2**32 + 41), seq=int(rng.integers(1, 2**31)),
                              src_rank=ffn_rank)
    words = wire.encode_header(reply, msg.epr)
    assert words.size == layout.header_words == wire.HDR_FIXED_WORDS + msg.epr + 1
    header_src = kernels.PinnedInt64(-(-layout.header_words // 2))
    header_src.int32[:layout.header_words] = words
    seq = 2**35 + int(rng.integers(1, 1000))
    done = cp.zeros(1, cp.uint32)
    is_put = transport == "put"
    kh.launch_dedup_reply(
        dtype_code=kernels.DTYPE_CODES[dtype], dst_window=0 if is_put else window.data.ptr,
        staging=window.data.ptr if is_put else 0, dst_peer=dst_peer, geo=layout.kernel_geometry(),
        src_rank=ffn_rank, ring=msg.ring, route_copy=route_copy, num_rows=msg.num_rows, top_k=top_k,
        routed_out=routed_dev.data.ptr if msg.routed else 0, num_routed=msg.routed,
        shared_out=shared_dev.data.ptr if msg.shared else 0, num_shared=msg.shared,
        hidden_size=hidden, header_src=header_src.ptr, seq=seq, done_counter=done,
        max_blocks=5 if num_tokens == 1500 else kernels.MAX_BLOCKS)
    sync()
    rows = ref.reduce_reference(msg.table, to_f32(routed, dtype).reshape(msg.routed, hidden),
                                to_f32(shared, dtype).reshape(msg.shared, hidden) if msg.shared else None)
    want = prefill.copy()
    if not is_put:  # a put peer's flag is the host's signal put
        put(want, layout.slot_index(ffn_rank, msg.ring) * 8, np.int64(seq))
    put(want, slot_base + layout.field_offset("header"), words)
    put(want, slot_base + layout.field_offset("routed_x"), to_raw(rows, dtype))
    assert_window_equal(window.get(), want, layout, f"dedup reply ({transport})")
    assert int(done.get()[0]) == 0
    decoded = wire.decode_header(take(window.get(), slot_base, np.int32, layout.header_words), msg.epr,
                                 layout)
    assert decoded.num_rows == msg.num_rows and decoded.is_dedup


def test_expand_then_identity_experts_then_reply_round_trip(request):
    """Expand -> identity experts (routed_out = staging) -> reply: each reply row is
    (sum of the row's weights) x its dispatch row (+ the row itself when shared), as the
    host backend's dedup.expand + dedup.reduce_rows compute it."""
    rng = node_rng(request)
    msg = Message(rng, dtype="float32", num_ffn=2, num_tokens=129, top_k=8, hidden=64, has_shared=1)
    e = Expand(rng, msg)
    e.run()
    assert wire.StatusRecord.decode(e.status.array).ok
    layout = msg.layout
    window = cp.asarray(rng.integers(0, 256, layout.window_bytes, dtype=np.uint8))
    header_src = kernels.PinnedInt64(-(-layout.header_words // 2))
    header_src.int32[:layout.header_words] = wire.encode_header(
        wire.reply_header(msg.header(seq=17), seq=3, src_rank=0), msg.epr)
    kh.launch_dedup_reply(
        dtype_code=kernels.DTYPE_CODES["float32"], dst_window=window.data.ptr,
        geo=layout.kernel_geometry(), src_rank=0, ring=msg.ring, route_copy=e.route_copy,
        num_rows=msg.num_rows, top_k=msg.top_k, routed_out=e.staging.data.ptr,
        num_routed=msg.routed, shared_out=e.window.data.ptr + layout.slot_offset(msg.src_rank, msg.ring)
        + layout.field_offset("routed_x"), num_shared=msg.shared, hidden_size=msg.hidden,
        header_src=header_src.ptr, seq=9, done_counter=cp.zeros(1, cp.uint32))
    sync()
    got = take(window.get(), layout.slot_offset(0, msg.ring) + layout.field_offset("routed_x"),
               np.float32, msg.num_rows * msg.hidden).reshape(msg.num_rows, msg.hidden)
    rows = msg.rows.view(np.float32)
    weights = msg.table[:, wire.ROUTE_SLOTS + msg.top_k:].copy().view(np.float32).sum(axis=1)
    want = weights[:, None] * rows + (np.arange(msg.num_rows) < msg.shared)[:, None] * rows
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- wait_any on dedup headers -------------------------------------------------------------------
def test_wait_any_rings_a_dedup_header_with_num_rows(request):
    """afd_wait_any, unchanged: the doorbell holds 13 + epr words and decodes in dedup mode;
    the counts snapshot row (header_words - 12 wide) ends with num_rows."""
    rng = node_rng(request)
    msg = Message(rng, dtype="bfloat16", num_ffn=2, num_tokens=40, top_k=4, hidden=32, has_shared=1)
    layout = msg.layout
    window = cp.asarray(rng.integers(0, 256, layout.window_bytes, dtype=np.uint8))
    last_seen = window[:layout.num_slots * 8].view(cp.int64).copy()
    words = wire.encode_header(msg.header(seq=2**32 + 5), msg.epr)
    slot = layout.slot_index(msg.src_rank, msg.ring)
    header_at = layout.slot_offset(msg.src_rank, msg.ring) + layout.field_offset("header")
    window[header_at:header_at + words.nbytes] = cp.asarray(words.view(np.uint8))
    flags = window[:layout.num_slots * 8].view(cp.int64)
    flags[slot] = flags[slot] + 12345
    flag = int(flags[slot].get())
    num_counts = layout.header_words - wire.HDR_FIXED_WORDS
    snapshot = cp.full((layout.num_slots, num_counts), -7, cp.int32)
    doorbell = kernels.PinnedInt64(wire.DB_HEADER + -(-layout.header_words // 2))
    sync()
    kh.launch_wait_any(window=window.data.ptr, geo=layout.kernel_geometry(), last_seen=last_seen,
                       scan_start=cp.zeros(1, cp.int32), counts_snapshot=snapshot,
                       timeout_ns=LONG_TIMEOUT_NS, doorbell=doorbell.ptr, ticket=1)
    sync()
    bell = doorbell.array
    assert (bell[wire.DB_TICKET], bell[wire.DB_STATUS], bell[wire.DB_SLOT], bell[wire.DB_FLAG]) == \
        (1, wire.STATUS_OK, slot, flag)
    got = bell[wire.DB_HEADER:].view(np.int32)[:layout.header_words]
    np.testing.assert_array_equal(got, words)
    header = wire.decode_header(got.copy(), layout.expert_per_rank, layout)  # as cuda_ffn decodes
    assert header == msg.header(seq=5)
    with pytest.raises(WireError, match="dedup-mode message"):
        wire.decode_header(got[:-1].copy(), layout.expert_per_rank)  # a pair receiver
    rows = snapshot.get()
    np.testing.assert_array_equal(rows[slot], list(msg.counts) + [msg.num_rows])
    assert (np.delete(rows, slot, axis=0) == -7).all()
