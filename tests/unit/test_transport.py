"""The put transport's host-side rules (``afd_cupy.transports.put``), on the CPU: per-peer choice,
config validation, and the byte ranges a put copies, checked against the reference planners
on random and skewed routings (every byte a receiver reads is covered; nothing outside the
slot is)."""
from __future__ import annotations

import numpy as np
import pytest

from afd_cupy.backends.base import require_backend
from afd_cupy.config import ConnectorConfig
from afd_cupy.errors import ConfigError
from afd_cupy.routing import planner
from afd_cupy.testing.dedup_reference import plan_reference
from afd_cupy.transports import get_transport, put as put_transport
from afd_cupy.wire.layout import WindowLayout, routed_capacity, shared_capacity


def _layout(*, num_ffn, epr, top_k, token_cap, hidden, wire_mode, multiplier=2.0, has_shared=True,
            num_attn=2, ring_depth=2):
    return WindowLayout(num_regions=max(num_attn, num_ffn), ring_depth=ring_depth,
                        expert_per_rank=epr, hidden_size=hidden, itemsize=2, top_k=top_k,
                        token_cap=token_cap,
                        routed_cap=routed_capacity(token_cap, top_k, num_ffn, multiplier),
                        shared_cap=shared_capacity(token_cap, num_ffn, int(has_shared), wire_mode),
                        wire_mode=wire_mode)


def _covered(ranges, start, nbytes) -> bool:
    """Whether [start, start + nbytes) lies inside one of ``ranges``."""
    return nbytes == 0 or any(o <= start and start + nbytes <= o + n for o, n in ranges)


def test_staged_peers_and_config():
    assert put_transport.staged_peers(False, [True, False, True]) == [False, True, False]  # auto
    assert put_transport.staged_peers(True, [True, False]) == [True, True]  # put
    put, auto, direct = get_transport("put"), get_transport("auto"), get_transport("direct")
    assert (put.stages_mapped, auto.stages_mapped) == (True, False)
    assert put.is_host_initiated and auto.is_host_initiated and not direct.is_host_initiated
    assert put.allows_unmapped_peers and not direct.allows_unmapped_peers
    with pytest.raises(ConfigError, match=r"transport must be one of \('direct', 'put', 'auto'\), got 'rdma'"):
        get_transport("rdma")
    assert ConnectorConfig().transport == "direct"
    assert ConnectorConfig.from_mapping({"transport": "auto"}).transport == "auto"
    with pytest.raises(ConfigError, match=r"ConnectorConfig.transport must be one of .* got 'ib'"):
        ConnectorConfig(transport="ib")


def test_host_backend_refuses_the_put_transport_before_any_collective_step():
    require_backend("host", "pair", "auto")
    assert get_transport("put").backends == ("cuda",)
    with pytest.raises(ConfigError, match=r"backend 'host' does not implement transport='put' "
                                          r"\(it implements \('direct', 'auto'\)\)"):
        require_backend("host", "pair", "put")


@pytest.mark.parametrize("num_ffn,epr,top_k,has_shared", [(1, 8, 2, True), (3, 4, 4, True),
                                                          (4, 16, 8, False), (2, 1, 1, True)])
def test_pair_dispatch_ranges_cover_every_routing(num_ffn, epr, top_k, has_shared):
    rng = np.random.default_rng([num_ffn, epr, top_k])
    layout = _layout(num_ffn=num_ffn, epr=epr, top_k=top_k, token_cap=48, hidden=40,
                     wire_mode="pair", has_shared=has_shared)
    num_experts = num_ffn * epr
    for trial in range(40):
        num_tokens = int(rng.integers(0, layout.token_cap + 1))
        if trial % 4 == 0:  # skewed: every partial on one rank's experts (capacity decides)
            hot = int(rng.integers(0, num_ffn))
            ids = rng.integers(hot * epr, (hot + 1) * epr, size=(num_tokens, top_k))
        else:
            ids = np.array([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)],
                           dtype=np.int64).reshape(num_tokens, top_k)
        plan = planner.plan_dispatch_reference(ids, num_ffn, epr)
        for j in range(num_ffn):
            ranges = put_transport.dispatch_ranges(layout, num_tokens=num_tokens, num_ffn_ranks=num_ffn,
                                               ffn_rank=j, has_shared=has_shared)
            assert all(0 <= o and o + n <= layout.slot_bytes for o, n in ranges)
            assert put_transport.ranges_bytes(ranges) <= layout.slot_bytes
            routed = plan.routed_count(j)
            if routed > layout.routed_cap:
                continue  # a CapacityError: nothing is sent
            shared = planner.shared_count(num_tokens, num_ffn, j) if has_shared else 0
            assert shared == put_transport.shared_rows_of(num_tokens, num_ffn, j) * has_shared
            assert shared <= layout.shared_cap
            needed = [(layout.field_offset("header"), layout.header_words * 4),
                      (layout.field_offset("route_table"), routed * 8),
                      (layout.field_offset("routed_x"), routed * layout.row_bytes),
                      (layout.field_offset("shared_idx"), shared * 4),
                      (layout.field_offset("shared_x"), shared * layout.row_bytes)]
            for start, nbytes in needed:
                assert _covered(ranges, start, nbytes), (trial, j, start, nbytes, ranges)


def test_pair_dispatch_bound_is_tight_where_the_host_can_know():
    """T * top_k partials at most (all on one rank), never beyond routed_cap; the shared rows
    are exact; the decode case of a large token_cap moves T rows, not the capacity."""
    layout = _layout(num_ffn=4, epr=8, top_k=8, token_cap=4096, hidden=64, wire_mode="pair")
    ranges = put_transport.dispatch_ranges(layout, num_tokens=128, num_ffn_ranks=4, ffn_rank=1, has_shared=True)
    routed = 128 * 8
    expected = (layout.header_words * 4 + routed * (8 + layout.row_bytes) + 32 * (4 + layout.row_bytes))
    assert expected <= put_transport.ranges_bytes(ranges) <= expected + 4 * put_transport.MERGE_GAP_BYTES
    full = put_transport.dispatch_ranges(layout, num_tokens=4096, num_ffn_ranks=4, ffn_rank=0, has_shared=True)
    assert all(o + n <= layout.slot_bytes for o, n in full)
    assert put_transport.ranges_bytes(full) >= layout.routed_cap * layout.row_bytes
    with pytest.raises(ValueError, match=r"num_tokens=4097 outside \[0, token_cap=4096\]"):
        put_transport.dispatch_ranges(layout, num_tokens=4097, num_ffn_ranks=4, ffn_rank=0, has_shared=True)


@pytest.mark.parametrize("num_ffn,epr,top_k", [(1, 8, 4), (3, 4, 2), (4, 2, 8)])
def test_dedup_dispatch_ranges_cover_every_routing(num_ffn, epr, top_k):
    rng = np.random.default_rng([7, num_ffn, top_k])
    layout = _layout(num_ffn=num_ffn, epr=epr, top_k=top_k, token_cap=40, hidden=24, wire_mode="dedup")
    for _ in range(20):
        num_tokens = int(rng.integers(1, layout.token_cap + 1))
        ids = rng.integers(0, num_ffn * epr, size=(num_tokens, top_k))
        plan = plan_reference(ids, num_ffn, epr, has_shared=True)
        for j in range(num_ffn):
            ranges = put_transport.dispatch_ranges(layout, num_tokens=num_tokens, num_ffn_ranks=num_ffn,
                                               ffn_rank=j, has_shared=True)
            rows = int(plan.num_rows[j])
            assert rows <= layout.token_cap and all(o + n <= layout.slot_bytes for o, n in ranges)
            for start, nbytes in [(layout.field_offset("header"), layout.header_words * 4),
                                  (layout.field_offset("route_table"), rows * layout.route_width * 4),
                                  (layout.field_offset("routed_x"), rows * layout.row_bytes)]:
                assert _covered(ranges, start, nbytes), (j, start, nbytes, ranges)


def _dedup_routing(rng, num_tokens, num_ffn, epr, top_k, trial):
    """Random ids, or (every third trial) every token's experts on one rank: its message then
    has exactly T rows, the bound."""
    if trial % 3 == 0:
        hot = int(rng.integers(0, num_ffn))
        return rng.integers(hot * epr, (hot + 1) * epr, size=(num_tokens, top_k))
    return rng.integers(0, num_ffn * epr, size=(num_tokens, top_k))


def _put(staging: bytearray, remote: bytearray, ranges) -> None:
    """What PutLink's puts do to one slot: copy ``ranges`` of the staging slot."""
    for offset, nbytes in ranges:
        remote[offset:offset + nbytes] = staging[offset:offset + nbytes]


def _write(slot: bytearray, offset: int, array) -> None:
    data = np.ascontiguousarray(array).tobytes()
    slot[offset:offset + len(data)] = data


@pytest.mark.parametrize("num_ffn,epr,top_k,has_shared", [(1, 8, 4, True), (3, 4, 2, True),
                                                          (4, 2, 8, False), (2, 3, 1, True)])
def test_dedup_messages_survive_a_put_of_their_ranges(num_ffn, epr, top_k, has_shared):
    """A dedup dispatch and its reply written into a staging slot full of stale bytes (as the
    scatter and the reduce write them: dedup_reference), then only the ranges of
    dispatch_ranges / reply_ranges copied onto a receiver slot full of other bytes: the
    receiver reads exactly the message (header with num_rows, route table, rows)."""
    from afd_cupy import wire
    from afd_cupy.testing.dedup_reference import scatter_reference

    rng = np.random.default_rng([11, num_ffn, top_k])
    layout = _layout(num_ffn=num_ffn, epr=epr, top_k=top_k, token_cap=24, hidden=20,
                     wire_mode="dedup", has_shared=has_shared)
    width, header_off = layout.route_width, layout.field_offset("header")
    table_off, rows_off = layout.field_offset("route_table"), layout.field_offset("routed_x")
    for trial, num_tokens in enumerate([0, 1, layout.token_cap] + list(rng.integers(1, 25, size=9))):
        num_tokens = int(num_tokens)
        ids = _dedup_routing(rng, num_tokens, num_ffn, epr, top_k, trial)
        weights = rng.random((num_tokens, top_k), dtype=np.float32)
        hidden = rng.integers(0, 2**16, size=(num_tokens, layout.hidden_size), dtype=np.uint16)
        plan = plan_reference(ids, num_ffn, epr, has_shared=has_shared)
        for j in range(num_ffn):
            ranges = put_transport.dispatch_ranges(layout, num_tokens=num_tokens, num_ffn_ranks=num_ffn,
                                               ffn_rank=j, has_shared=has_shared)
            assert all(0 <= o and o + n <= layout.slot_bytes for o, n in ranges), ranges
            if plan.pairs.routed_count(j) > layout.routed_cap:
                continue  # a CapacityError: nothing is sent
            rows = int(plan.num_rows[j])
            table, payload = scatter_reference(plan, hidden, ids, weights, j)
            header = wire.dispatch_header(seq=trial + 1, src_rank=1, layer_idx=2, stage_idx=0,
                                          num_tokens=num_tokens, shared_tokens=int(plan.shared_rows[j]),
                                          top_k=top_k, expert_counts=plan.pairs.rank_counts(j),
                                          wire_mode="dedup", num_rows=rows)
            staging = bytearray(rng.integers(0, 256, layout.slot_bytes, dtype=np.uint8).tobytes())
            remote = bytearray(rng.integers(0, 256, layout.slot_bytes, dtype=np.uint8).tobytes())
            _write(staging, header_off, wire.encode_header(header, epr))
            _write(staging, table_off, table)
            _write(staging, rows_off, payload)
            _put(staging, remote, ranges)
            got = np.frombuffer(bytes(remote), np.uint8)
            words = got[header_off:header_off + layout.header_words * 4].view(np.int32)
            assert wire.decode_header(words, epr, layout) == header
            assert np.array_equal(got[table_off:table_off + rows * width * 4].view(np.int32)
                                  .reshape(rows, width), table)
            assert np.array_equal(got[rows_off:rows_off + rows * layout.row_bytes].view(np.uint16)
                                  .reshape(rows, layout.hidden_size), payload)
            # the reply: one row per dispatch row, in routed_x, and the echoed header
            reply = wire.reply_header(header, seq=trial + 7, src_rank=j)
            out = rng.integers(0, 2**16, size=(rows, layout.hidden_size), dtype=np.uint16)
            _write(staging, header_off, wire.encode_header(reply, epr))
            _write(staging, rows_off, out)
            reply_ranges = put_transport.reply_ranges(layout, routed_rows=rows, shared_rows=0)
            assert all(0 <= o and o + n <= layout.slot_bytes for o, n in reply_ranges)
            _put(staging, remote, reply_ranges)
            got = np.frombuffer(bytes(remote), np.uint8)
            words = got[header_off:header_off + layout.header_words * 4].view(np.int32)
            assert wire.decode_header(words, epr, layout) == reply
            assert np.array_equal(got[rows_off:rows_off + rows * layout.row_bytes].view(np.uint16)
                                  .reshape(rows, layout.hidden_size), out)


def test_dedup_dispatch_bound_is_one_row_per_token():
    """Decode: T rows and T route-table rows, not the capacity, and nothing for shared fields
    (there are none); a full batch stays inside the slot; a dedup put bound is about
    1/top_k of pair's at the same sizes (pair's bound is T * top_k partials)."""
    dedup = _layout(num_ffn=4, epr=8, top_k=8, token_cap=4096, hidden=64, wire_mode="dedup")
    pair = _layout(num_ffn=4, epr=8, top_k=8, token_cap=4096, hidden=64, wire_mode="pair")
    ranges = put_transport.dispatch_ranges(dedup, num_tokens=128, num_ffn_ranks=4, ffn_rank=3, has_shared=True)
    expected = dedup.header_words * 4 + 128 * (dedup.route_width * 4 + dedup.row_bytes)
    assert expected <= put_transport.ranges_bytes(ranges) <= expected + 2 * put_transport.MERGE_GAP_BYTES
    assert ranges == put_transport.dispatch_ranges(dedup, num_tokens=128, num_ffn_ranks=4, ffn_rank=0,
                                               has_shared=False)  # neither rank nor shared matter
    full = put_transport.dispatch_ranges(dedup, num_tokens=4096, num_ffn_ranks=4, ffn_rank=0, has_shared=True)
    assert full[-1][0] + full[-1][1] == dedup.field_offset("routed_x") + dedup.field_bytes("routed_x")
    assert all(o + n <= dedup.slot_bytes for o, n in full)
    assert put_transport.dispatch_ranges(dedup, num_tokens=0, num_ffn_ranks=4, ffn_rank=0, has_shared=True) \
        == [(0, dedup.header_words * 4)]  # always_send's header-only message
    pair_bytes = put_transport.ranges_bytes(put_transport.dispatch_ranges(
        pair, num_tokens=128, num_ffn_ranks=4, ffn_rank=3, has_shared=True))
    assert put_transport.ranges_bytes(ranges) < pair_bytes / 4


def test_reply_ranges_refuse_rows_the_slot_does_not_have():
    dedup = _layout(num_ffn=2, epr=4, top_k=2, token_cap=64, hidden=32, wire_mode="dedup")
    offset, nbytes = put_transport.reply_ranges(dedup, routed_rows=64, shared_rows=0)[-1]
    assert offset + nbytes == dedup.field_offset("routed_x") + 64 * dedup.row_bytes == dedup.slot_bytes
    with pytest.raises(ValueError, match=r"a dedup reply has no shared rows \(got shared_rows=3\)"):
        put_transport.reply_ranges(dedup, routed_rows=10, shared_rows=3)
    with pytest.raises(ValueError, match=r"reply rows \(routed=65, shared=0\) exceed the slot's "
                                         r"\(64, 0\) in wire_mode='dedup'"):
        put_transport.reply_ranges(dedup, routed_rows=65, shared_rows=0)
    pair = _layout(num_ffn=2, epr=4, top_k=2, token_cap=64, hidden=32, wire_mode="pair")
    with pytest.raises(ValueError, match=r"exceed the slot's \(128, 32\) in wire_mode='pair'"):
        put_transport.reply_ranges(pair, routed_rows=1, shared_rows=33)


def test_reply_and_control_ranges():
    layout = _layout(num_ffn=2, epr=4, top_k=2, token_cap=64, hidden=32, wire_mode="pair")
    ranges = put_transport.reply_ranges(layout, routed_rows=10, shared_rows=3)
    for start, nbytes in [(0, layout.header_words * 4),
                          (layout.field_offset("routed_x"), 10 * layout.row_bytes),
                          (layout.field_offset("shared_x"), 3 * layout.row_bytes)]:
        assert _covered(ranges, start, nbytes)
    assert put_transport.ranges_bytes(ranges) < layout.slot_bytes
    header_only = put_transport.reply_ranges(layout, routed_rows=0, shared_rows=0)
    assert header_only == put_transport.control_ranges(layout) == [(0, layout.header_words * 4)]
    with pytest.raises(ValueError, match="reply rows must be >= 0, got routed=-1, shared=0"):
        put_transport.reply_ranges(layout, routed_rows=-1, shared_rows=0)


def test_close_ranges_merge_far_ones_do_not():
    layout = _layout(num_ffn=1, epr=2, top_k=1, token_cap=4, hidden=8, wire_mode="pair")
    ranges = put_transport.dispatch_ranges(layout, num_tokens=4, num_ffn_ranks=1, ffn_rank=0, has_shared=True)
    assert len(ranges) == 1 and ranges[0][0] == 0  # a tiny slot: one put
    big = _layout(num_ffn=1, epr=2, top_k=8, token_cap=512, hidden=1024, wire_mode="pair")
    ranges = put_transport.dispatch_ranges(big, num_tokens=1, num_ffn_ranks=1, ffn_rank=0, has_shared=True)
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(ranges, ranges[1:])]
    assert len(ranges) > 1 and min(gaps) > put_transport.MERGE_GAP_BYTES


# --- the cuda put channel's call sequence, with a recording stand-in for the library --------------
class _RecordingLib:
    def __init__(self):
        self.calls = []

    def nvshmemx_putmem_on_stream(self, dest, source, nbytes, pe, stream):
        self.calls.append(("put", dest.value, source.value, nbytes, pe, stream.value))

    def nvshmemx_putmem_signal_on_stream(self, dest, source, nbytes, sig_addr, signal, sig_op, pe, stream):
        self.calls.append(("put_signal", dest.value, source.value, nbytes, sig_addr.value, signal.value,
                           sig_op, pe, stream.value))

    def nvshmemx_quiet_on_stream(self, stream):
        self.calls.append(("quiet", stream.value))


def _channel(layout, is_put):
    lib = _RecordingLib()
    channel = put_transport.PutLink(put_transport.PUT, _FakeWindow({}), lib, layout, staging_base=2 << 40,
                                own_region=1, peer_pes=[10, 11, 12], is_staged=is_put)
    return channel, lib


def test_dispatch_puts_every_put_peer_then_one_quiet_then_the_flag_words():
    layout = _layout(num_ffn=3, epr=4, top_k=2, token_cap=32, hidden=64, wire_mode="pair", num_attn=2)
    channel, lib = _channel(layout, [True, False, True])
    channel.after_dispatch(stream=77, ring=1, num_tokens=20, num_ffn_ranks=3, has_shared=True)
    kinds = [call[0] for call in lib.calls]
    quiet = kinds.index("quiet")
    assert kinds.count("quiet") == 1 and kinds[quiet + 1:] == ["put", "put"]  # flags after the quiet
    remote_slot = (1 << 40) + layout.slot_offset(1, 1)  # own region 1, ring 1, in every peer
    for peer, pe in ((0, 10), (2, 12)):
        ranges = put_transport.dispatch_ranges(layout, num_tokens=20, num_ffn_ranks=3, ffn_rank=peer, has_shared=True)
        data = [c for c in lib.calls[:quiet] if c[4] == pe]
        assert [(c[1] - remote_slot, c[3]) for c in data] == ranges
        assert all(c[2] - ((2 << 40) + layout.slot_offset(peer, 1)) == c[1] - remote_slot for c in data)
        (flag,) = [c for c in lib.calls[quiet + 1:] if c[4] == pe]
        assert flag[1:4] == ((1 << 40) + 8 * layout.slot_index(1, 1),
                             (2 << 40) + 8 * layout.slot_index(peer, 1), 8)
    assert not [c for c in lib.calls if c[0] == "put" and c[4] == 11]  # the direct peer: nothing
    assert all(c[-1] == 77 for c in lib.calls)


def test_reply_sets_the_flag_by_put_with_signal_after_its_data():
    from afd_cupy.heap.nvshmem_lib import NVSHMEM_SIGNAL_SET

    layout = _layout(num_ffn=2, epr=4, top_k=2, token_cap=256, hidden=512, wire_mode="pair", num_attn=3)
    channel, lib = _channel(layout, [False, True, False])
    channel.after_reply(5, peer=1, ring=0, routed_rows=9, shared_rows=4, seq=123)
    ranges = put_transport.reply_ranges(layout, routed_rows=9, shared_rows=4)
    assert len(ranges) > 1
    assert [c[0] for c in lib.calls] == ["put"] * (len(ranges) - 1) + ["quiet", "put_signal"]
    last = lib.calls[-1]
    assert last[1] == (1 << 40) + layout.slot_offset(1, 0) + ranges[-1][0] and last[3] == ranges[-1][1]
    assert last[4:8] == ((1 << 40) + 8 * layout.slot_index(1, 0), 123, NVSHMEM_SIGNAL_SET, 11)
    lib.calls.clear()
    channel.send_signaled(5, 1, 0, put_transport.control_ranges(layout), 2**63 - 1)  # shutdown: one call
    assert [c[0] for c in lib.calls] == ["put_signal"] and lib.calls[0][5] == 2**63 - 1


class _FakeHeap:
    """What PutTransport.open uses of NvshmemHeap: the agreement and the collective alloc."""

    def __init__(self, others_need=()):
        self.rank, self.lib, self.others_need = 0, _RecordingLib(), list(others_need)
        self.topics, self.allocs = [], []

    def any_pe(self, topic, mine):
        self.topics.append(topic)
        return ([mine] if mine else []) + self.others_need

    def alloc(self, nbytes, name, *, allow_unmapped=False):
        self.allocs.append((nbytes, name, allow_unmapped))
        return type("Buffer", (), {"base_ptr": 3 << 40})()


class _FakeWindow:
    def __init__(self, ptrs, allow_unmapped=True):
        self.ptrs, self.buffer = ptrs, type("Buffer", (), {"base_ptr": 1 << 40})()
        self.allow_unmapped = allow_unmapped

    def peer_ptr(self, pe):
        return self.ptrs[pe]


def _ctx(mode, role_rank, num_attn, num_ffn, layout):
    from afd_cupy.runtime.topology import Role, Topology

    pes = [Topology(num_attn, num_ffn, 8).world_rank(Role.FFN, j) for j in range(num_ffn)]
    return type("Ctx", (), {"transport": mode, "role_rank": role_rank, "layout": layout,
                            "opposite_pes": lambda self: pes})()


@pytest.mark.parametrize("mode,ptrs,others,expect_put,expect_alloc", [
    ("direct", {1: 5, 2: 6}, [], [False, False], False),          # no exchange at all
    ("auto", {1: 5, 2: 6}, [], [False, False], False),            # one node: nothing allocated
    ("auto", {1: 5, 2: 6}, ["PE 2"], [False, False], True),       # another PE needs puts: allocate too
    ("auto", {1: 0, 2: 6}, [], [True, False], True),              # mixed job
    ("put", {1: 5, 2: 6}, [], [True, True], True)])
def test_put_open_agrees_before_the_collective_staging_alloc(mode, ptrs, others, expect_put, expect_alloc):
    layout = _layout(num_ffn=2, epr=4, top_k=2, token_cap=16, hidden=32, wire_mode="pair", num_attn=1)
    heap = _FakeHeap(others)
    link = get_transport(mode).open(heap, _FakeWindow(ptrs), _ctx(mode, 0, 1, 2, layout), instance=4)
    assert list(link.is_staged) == expect_put and link.transport is get_transport(mode)
    assert heap.topics == ([] if mode == "direct" else ["put/window4"])
    assert heap.allocs == ([(layout.window_bytes, "staging4", True)] if expect_alloc else [])
    assert isinstance(link, put_transport.PutLink) == expect_alloc
    assert link.staging_base == (3 << 40 if expect_alloc else 0)  # the kernels' staging argument
    assert link.staged_peers == [j for j, flag in enumerate(expect_put) if flag] and link.peer_pes == [1, 2]


def test_auto_on_a_window_that_maps_every_peer_is_direct_without_an_agreement():
    """The host backend: every PE's allocation mapped every peer, so no PE stages one and
    ``auto`` needs no collective step (the host heap has none); ``put`` still stages."""
    layout = _layout(num_ffn=2, epr=4, top_k=2, token_cap=16, hidden=32, wire_mode="pair", num_attn=1)
    heap = _FakeHeap(["PE 2"])  # would make any agreement allocate
    link = get_transport("auto").open(heap, _FakeWindow({1: 5, 2: 6}, allow_unmapped=False),
                                      _ctx("auto", 0, 1, 2, layout), instance=0)
    assert link.is_staged == (False, False) and link.staging_base == 0 and heap.topics == []
    link = get_transport("put").open(heap, _FakeWindow({1: 5, 2: 6}, allow_unmapped=False),
                                     _ctx("put", 0, 1, 2, layout), instance=0)
    assert link.is_staged == (True, True) and heap.allocs


def test_mixed_transport_scenario_stages_the_odd_pairs_through_put_open():
    """Scenario.mixed_transport (the GPU suite's one-node mixed job): while the connector opens,
    PutTransport.open sees peers p with role_rank + p odd as staged peers, mapped or not, and
    allocates the staging; afterwards staged_peers is the library's again."""
    import dataclasses

    from afd_cupy.config import ModelConfig
    from afd_cupy.testing.scenario import Scenario, _mixed_transport

    model = ModelConfig(hidden_size=32, num_experts=6, top_k=2, moe_intermediate_size=16)
    scenario = Scenario(model, 2, 3, backend="cuda", connector=ConnectorConfig(transport="auto"),
                        mixed_transport=True)
    layout = _layout(num_ffn=3, epr=2, top_k=2, token_cap=16, hidden=32, wire_mode="dedup", num_attn=2)
    heap = _FakeHeap()
    with _mixed_transport(scenario, role_rank=1):
        assert put_transport.staged_peers(False, [True, False, True]) == [True, True, True]
        link = get_transport("auto").open(heap, _FakeWindow({2: 5, 3: 6, 4: 7}),
                                          _ctx("auto", 1, 2, 3, layout), instance=0)
    assert link.is_staged == (True, False, True) and link.staged_peers == [0, 2]
    assert heap.allocs == [(layout.window_bytes, "staging0", True)]
    assert put_transport.staged_peers(False, [True] * 3) == [False] * 3  # restored
    with pytest.raises(ValueError, match=r"mixed_transport needs backend 'cuda' and transport 'auto', "
                                         r"got 'cuda' and 'put'"):
        with _mixed_transport(dataclasses.replace(scenario, connector=ConnectorConfig(transport="put")), 0):
            pass
