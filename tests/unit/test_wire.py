import numpy as np
import pytest

from afd_cupy import wire
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.errors import (CapacityError, ConnectorShutdown, GeometryMismatchError, ProtocolError,
                             WireError)


def _layout(num_attn=2, num_ffn=3, dtype="bfloat16", shared=1, ring_depth=None, hidden=72, experts=10):
    model = ModelConfig(hidden_size=hidden, num_experts=experts, top_k=3, moe_intermediate_size=16,
                        num_shared_experts=shared, dtype=dtype, max_num_batched_tokens=37)
    conn = ConnectorConfig(ring_depth=ring_depth)
    return model, TopologyConfig(num_attn, num_ffn), conn, wire.WindowLayout.from_configs(
        model, TopologyConfig(num_attn, num_ffn), conn)


@pytest.mark.parametrize("num_attn,num_ffn", [(1, 1), (2, 3), (3, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shared", [0, 2])
def test_fields_disjoint_aligned_in_slot(num_attn, num_ffn, dtype, shared):
    model, topo, conn, layout = _layout(num_attn, num_ffn, dtype, shared)
    assert layout.num_regions == max(num_attn, num_ffn)
    spans = []
    for name in wire.FIELD_NAMES:
        off, size = layout.field_offset(name), layout.field_bytes(name)
        assert off % wire.ALIGN == 0
        assert off % 8 == 0 and off % layout.itemsize == 0
        assert off + size <= layout.slot_bytes
        spans.append((off, off + size))
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert layout.slot_bytes % wire.ALIGN == 0
    assert layout.flags_bytes >= layout.num_slots * 8 and layout.flags_bytes % wire.ALIGN == 0
    assert layout.window_bytes == layout.flags_bytes + layout.num_slots * layout.slot_bytes
    assert wire.window_size_hint(model, topo, conn) == layout.window_bytes
    if shared == 0:
        assert layout.field_bytes("shared_x") == 0 and layout.shared_cap == 0


def test_slots_disjoint_and_indexing():
    _, _, _, layout = _layout(2, 3, ring_depth=2)
    offsets = sorted(layout.slot_offset(r, q) for r in range(3) for q in range(2))
    assert offsets[0] == layout.flags_bytes
    assert all(b - a == layout.slot_bytes for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] + layout.slot_bytes == layout.window_bytes
    assert layout.slot_index(1, 1) == 3
    with pytest.raises(IndexError, match=r"slot \(region=3, ring=0\)"):
        layout.slot_offset(3, 0)


def test_capacity_formulas():
    assert wire.routed_capacity(100, 8, 4, 2.0) == 400
    assert wire.routed_capacity(10, 3, 4, 1.0) == 8  # ceil(30/4)
    assert wire.routed_capacity(10, 3, 1, 2.0) == 30  # clipped at T*K
    assert wire.shared_capacity(37, 3, 1) == 13 and wire.shared_capacity(37, 3, 0) == 0


def test_geometry_mismatch_names_field_and_ranks():
    _, _, _, a = _layout(2, 3)
    _, _, _, b = _layout(2, 3, hidden=80)
    a.check_same(a.as_dict(), my_rank=0, other_rank=1)
    with pytest.raises(GeometryMismatchError, match=r"'hidden_size': rank 0 has 72, rank 4 has 80"):
        a.check_same(b.as_dict(), my_rank=0, other_rank=4)


def _header(epr, rng, flags=0):
    counts = tuple(int(c) for c in rng.integers(0, 50, epr))
    return wire.Header(seq=int(rng.integers(0, 2**40)), src_rank=int(rng.integers(0, 8)),
                       layer_idx=int(rng.integers(0, 60)), stage_idx=int(rng.integers(0, 2)),
                       num_tokens=int(rng.integers(1, 4096)), routed_tokens=sum(counts),
                       shared_tokens=int(rng.integers(0, 100)), top_k=8, flags=flags,
                       echo_seq=int(rng.integers(0, 2**32)), expert_counts=counts)


@pytest.mark.parametrize("epr", [1, 4, 33])
def test_header_round_trip(epr):
    rng = np.random.default_rng(epr)
    for _ in range(20):
        h = _header(epr, rng)
        words = wire.encode_header(h, epr)
        assert words.dtype == np.int32 and words.shape == (wire.HDR_FIXED_WORDS + epr,)
        d = wire.decode_header(words, epr)
        assert d == wire.Header(**{**h.__dict__, "seq": h.seq & 0xFFFFFFFF})
        assert words[wire.HDR_MAGIC].view(np.uint32) == wire.MAGIC
        assert not d.is_shutdown


def test_shutdown_bit_round_trip():
    h = _header(2, np.random.default_rng(1), flags=wire.FLAG_SHUTDOWN)
    assert wire.decode_header(wire.encode_header(h, 2), 2).is_shutdown


def test_header_validation_reports_values():
    rng = np.random.default_rng(2)
    good = wire.encode_header(_header(3, rng), 3)
    bad = good.copy(); bad[wire.HDR_MAGIC] = 0x12345678
    with pytest.raises(WireError, match=r"bad header magic 0x12345678, expected 0x41464447"):
        wire.decode_header(bad, 3)
    bad = good.copy(); bad[wire.HDR_VERSION] = 7
    with pytest.raises(WireError, match=r"unsupported wire version 7, expected 1"):
        wire.decode_header(bad, 3)
    with pytest.raises(WireError, match=r"header has shape \(15,\), expected \(16,\)"):
        wire.decode_header(good, 4)
    bad = good.copy(); bad[wire.HDR_ROUTED_TOKENS] += 1
    total = int(good[wire.HDR_FIXED_WORDS:].sum())
    with pytest.raises(WireError, match=rf"sum to {total} but routed_tokens={total + 1}"):
        wire.decode_header(bad, 3)
    bad = good.copy(); bad[wire.HDR_FIXED_WORDS] = -1; bad[wire.HDR_ROUTED_TOKENS] = int(bad[wire.HDR_FIXED_WORDS:].sum())
    with pytest.raises(WireError, match="negative sizes"):
        wire.decode_header(bad, 3)
    with pytest.raises(WireError, match=r"expert_counts has 3 entries, expected expert_per_rank=2"):
        wire.encode_header(_header(3, rng), 2)


def test_check_capacity_messages():
    _, _, _, layout = _layout(2, 3)
    wire.check_capacity(layout, num_tokens=37, routed_tokens=layout.routed_cap, shared_tokens=13, peer=0)
    with pytest.raises(CapacityError, match=rf"{layout.routed_cap + 1} routed partials for FFN rank 2 > routed_cap={layout.routed_cap}") as info:
        wire.check_capacity(layout, num_tokens=5, routed_tokens=layout.routed_cap + 1, shared_tokens=0, peer=2)
    assert info.value.cap == layout.routed_cap
    with pytest.raises(CapacityError, match=r"num_tokens=38 > token_cap=37"):
        wire.check_capacity(layout, num_tokens=38, routed_tokens=0, shared_tokens=0, peer=0)
    with pytest.raises(CapacityError, match=r"14 shared rows for FFN rank 1 > shared_cap=13"):
        wire.check_capacity(layout, num_tokens=5, routed_tokens=0, shared_tokens=14, peer=1)


# --- the protocol's messages and reply rules ---------------------------------------------------
def _dispatch(seq=7, layer=3, stage=1):
    return wire.dispatch_header(seq=seq, src_rank=1, layer_idx=layer, stage_idx=stage, num_tokens=5,
                                shared_tokens=2, top_k=2, expert_counts=(3, 0, 1))


def test_builders_round_trip_and_reply_echoes_the_dispatch():
    dispatch = _dispatch()
    assert dispatch.routed_tokens == 4 and not dispatch.is_shutdown
    reply = wire.reply_header(dispatch, seq=11, src_rank=2)
    decoded = wire.decode_header(wire.encode_header(reply, 3), 3)
    assert decoded == reply and reply.echo_seq == 7 and reply.src_rank == 2
    assert (reply.layer_idx, reply.stage_idx, reply.routed_tokens, reply.shared_tokens) == (3, 1, 4, 2)
    down = wire.shutdown_header(src_rank=0, top_k=2, expert_per_rank=3)
    assert down.is_shutdown and down.seq == wire.SHUTDOWN_SEQ and down.expert_counts == (0, 0, 0)


def _want(**overrides):
    fields = dict(peer=2, seq=7, layer_idx=3, stage_idx=1, routed_tokens=4, shared_tokens=2)
    fields.update(overrides)
    return wire.ReplyExpectation(**fields)


@pytest.mark.parametrize("field,value", [("seq", 8), ("layer_idx", 4), ("stage_idx", 0),
                                         ("routed_tokens", 5), ("shared_tokens", 1)])
def test_check_reply_names_the_first_differing_field(field, value):
    reply = wire.reply_header(_dispatch(), seq=11, src_rank=2)
    wire.check_reply(reply, _want())  # the right reply passes
    name = "echo_seq" if field == "seq" else field
    with pytest.raises(ProtocolError, match=f"FFN rank 2 for layer .* echoes {name}=") as info:
        wire.check_reply(reply, _want(**{field: value}))
    assert info.value.field == name and info.value.peer == 2


def test_check_reply_shutdown_is_connector_shutdown():
    down = wire.shutdown_header(src_rank=2, top_k=2, expert_per_rank=3)
    with pytest.raises(ConnectorShutdown, match="FFN rank 2 announced shutdown while a reply for layer 3"):
        wire.check_reply(down, _want())


@pytest.mark.parametrize("want,echo,late", [(7, 6, True), (7, 7, False), (7, 8, False),
                                            (1, 0xFFFFFFFF, True), (2**32 + 3, 2, True),
                                            (7, (7 - 2**31) & 0xFFFFFFFF, False)])
def test_late_reply_is_an_earlier_seq_modulo_2_32(want, echo, late):
    reply = wire.Header(seq=1, src_rank=0, layer_idx=0, stage_idx=0, num_tokens=0, routed_tokens=0,
                        shared_tokens=0, top_k=1, flags=0, echo_seq=echo, expert_counts=(0,))
    assert wire.is_late_reply(reply, want) is late
    down = wire.shutdown_header(src_rank=0, top_k=1, expert_per_rank=1)
    assert not wire.is_late_reply(down, want)


def test_status_record_errors_match_the_host_types():
    record = wire.StatusRecord(wire.STATUS_REPLY_MISMATCH, 1, 3, 1, 7, 6, wire.HDR_LAYER, -1)
    err = record.error(layer_idx=6)
    assert isinstance(err, ProtocolError) and err.field == "layer_idx" and "FFN rank 1 for layer 6" in str(err)
    assert isinstance(wire.StatusRecord(wire.STATUS_SHUTDOWN, 1, 3, 1, 7, 9, -1, -1).error(), ConnectorShutdown)


@pytest.mark.parametrize("field,cap_name", [("num_tokens", "token_cap"), ("routed_tokens", "routed_cap"),
                                            ("shared_tokens", "shared_cap")])
def test_decode_header_bounds_sizes_by_the_window_capacities(field, cap_name):
    layout = wire.WindowLayout(num_regions=2, ring_depth=1, expert_per_rank=3, hidden_size=8,
                               itemsize=2, top_k=2, token_cap=5, routed_cap=6, shared_cap=3)
    cap = getattr(layout, cap_name)
    fields = dict(seq=1, src_rank=0, layer_idx=0, stage_idx=0, num_tokens=5, routed_tokens=6,
                  shared_tokens=3, top_k=2, flags=0, echo_seq=0, expert_counts=(2, 2, 2))
    at_cap = wire.encode_header(wire.Header(**fields), 3)
    assert wire.decode_header(at_cap, 3, layout).routed_tokens == 6  # at the cap is fine
    fields[field] = cap + 1
    if field == "routed_tokens":
        fields["expert_counts"] = (3, 2, 2)
    over = wire.encode_header(wire.Header(**fields), 3)
    wire.decode_header(over, 3)  # without a layout only self-consistency is checked
    with pytest.raises(WireError, match=f"header {field}={cap + 1} exceeds this window's capacity {cap}"):
        wire.decode_header(over, 3, layout)


# --- dedup wire mode (docs/design/dedup.md) ------------------------------------------------------
def _dedup_layout(**overrides):
    fields = dict(num_regions=2, ring_depth=1, expert_per_rank=3, hidden_size=8, itemsize=2,
                  top_k=2, token_cap=5, routed_cap=6, shared_cap=5, wire_mode="dedup")
    fields.update(overrides)
    return wire.WindowLayout(**fields)


@pytest.mark.parametrize("num_attn,num_ffn", [(1, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shared", [0, 2])
def test_dedup_slot_holds_token_cap_rows_and_a_wide_route_table(num_attn, num_ffn, dtype, shared):
    model = ModelConfig(hidden_size=72, num_experts=10, top_k=3, moe_intermediate_size=16,
                        num_shared_experts=shared, dtype=dtype, max_num_batched_tokens=37)
    topo, conn = TopologyConfig(num_attn, num_ffn), ConnectorConfig(wire_mode="dedup")
    layout = wire.WindowLayout.from_configs(model, topo, conn)
    pair = wire.WindowLayout.from_configs(model, topo, ConnectorConfig())
    epr = -(-10 // num_ffn)
    assert layout.wire_mode == "dedup" and layout.header_words == 12 + epr + 1 == pair.header_words + 1
    assert layout.num_rows_word == 12 + epr and layout.route_width == 2 + 2 * 3 and pair.route_width == 2
    assert layout.field_bytes("route_table") == 37 * 8 * 4
    assert layout.field_bytes("routed_x") == 37 * 72 * model.itemsize
    assert layout.field_bytes("shared_idx") == layout.field_bytes("shared_x") == 0
    assert layout.shared_cap == (37 if shared else 0)  # one rank may run every shared row
    assert layout.routed_cap == pair.routed_cap  # the same staging cap as pair's wire cap
    offsets = [layout.field_offset(name) for name in wire.FIELD_NAMES]
    assert all(o % wire.ALIGN == 0 for o in offsets) and offsets == sorted(offsets)
    assert wire.window_size_hint(model, topo, conn) == layout.window_bytes
    expected_staging = layout.num_slots * (wire.align_up(layout.routed_cap * 72 * model.itemsize)
                                           + wire.align_up(37 * 8 * 4))
    assert wire.ffn_staging_size_hint(model, topo, conn) == expected_staging == layout.ffn_staging_bytes
    assert pair.ffn_staging_bytes == 0
    geo = layout.kernel_geometry()
    assert geo["off_route"] == layout.field_offset("route_table") and geo["header_words"] == 13 + epr


def test_deepseek_example_sizes_of_design_doc():
    """The numbers of docs/design/wire-format.md (hidden 7168, bf16, 256 experts, top-8, one shared
    expert, T_cap 4096, 4A4F, ring depth 1)."""
    model = ModelConfig(hidden_size=7168, num_experts=256, top_k=8, moe_intermediate_size=2048,
                        num_shared_experts=1, max_num_batched_tokens=4096)
    topo = TopologyConfig(4, 4)
    pair = wire.window_size_hint(model, topo, ConnectorConfig())
    dedup = wire.window_size_hint(model, topo, ConnectorConfig(wire_mode="dedup"))
    staging = wire.ffn_staging_size_hint(model, topo, ConnectorConfig(wire_mode="dedup"))
    assert (round(pair / 2**20, 1), round(dedup / 2**20, 1), round(staging / 2**20, 1)) == (952.5, 225.1, 897.1)


def test_wire_mode_is_part_of_the_geometry_check():
    a, b = _dedup_layout(), _dedup_layout(wire_mode="pair")
    with pytest.raises(GeometryMismatchError, match=r"'wire_mode': rank 0 has 'dedup', rank 1 has 'pair'"):
        a.check_same(b.as_dict(), my_rank=0, other_rank=1)
    with pytest.raises(WireError, match="wire_mode must be one of"):
        _dedup_layout(wire_mode="both")


def _dedup_dispatch(**overrides):
    fields = dict(seq=2**32 + 9, src_rank=1, layer_idx=3, stage_idx=1, num_tokens=5, shared_tokens=2,
                  top_k=2, expert_counts=(3, 0, 2), wire_mode="dedup", num_rows=4)
    fields.update(overrides)
    return wire.dispatch_header(**fields)


def test_dedup_header_round_trip_reply_and_shutdown():
    dispatch = _dedup_dispatch()
    assert dispatch.is_dedup and dispatch.wire_mode == "dedup" and dispatch.flags == wire.FLAG_DEDUP
    words = wire.encode_header(dispatch, 3)
    assert words.shape == (16,) and words[15] == 4 and words[wire.HDR_FLAGS] == wire.FLAG_DEDUP
    as_pair = wire.encode_header(_dedup_dispatch(wire_mode="pair", num_rows=0), 3)
    differ = np.flatnonzero(words[:15] != as_pair)
    assert differ.tolist() == [wire.HDR_FLAGS]  # same words as pair mode, plus the flag bit
    decoded = wire.decode_header(words, 3, _dedup_layout())
    assert decoded == wire.Header(**{**dispatch.__dict__, "seq": 9})
    reply = wire.reply_header(decoded, seq=4, src_rank=0)
    assert reply.is_dedup and reply.num_rows == 4 and reply.echo_seq == 9
    assert wire.decode_header(wire.encode_header(reply, 3), 3, wire_mode="dedup") == reply
    wire.check_reply(reply, _want(seq=9, routed_tokens=5, num_rows=4))
    with pytest.raises(ProtocolError, match="echoes num_rows=4, the pending dispatch has num_rows=3"):
        wire.check_reply(reply, _want(seq=9, routed_tokens=5, num_rows=3))
    down = wire.shutdown_header(src_rank=0, top_k=2, expert_per_rank=3, wire_mode="dedup")
    decoded = wire.decode_header(wire.encode_header(down, 3), 3, _dedup_layout())
    assert decoded.is_shutdown and decoded.is_dedup and decoded.num_rows == 0


def test_pair_header_bytes_are_unchanged_by_dedup():
    words = wire.encode_header(_dispatch(), 3)
    assert words.shape == (15,) and words[wire.HDR_FLAGS] == 0 and words[wire.HDR_VERSION] == 1
    assert wire.VERSION == 1
    with pytest.raises(WireError, match="num_rows=2 in a pair-mode header"):
        wire.encode_header(wire.Header(**{**_dispatch().__dict__, "num_rows": 2}), 3)
    with pytest.raises(WireError, match="wire_mode='pair' with num_rows=3"):
        wire.dispatch_header(seq=1, src_rank=0, layer_idx=0, stage_idx=0, num_tokens=5, shared_tokens=0,
                             top_k=2, expert_counts=(1, 0, 0), num_rows=3)


def test_a_message_of_the_other_mode_is_a_wire_error():
    dedup_words = wire.encode_header(_dedup_dispatch(), 3)
    pair_words = wire.encode_header(_dispatch(), 3)
    # a pair receiver reads its own header length (15 words) of a dedup message
    with pytest.raises(WireError, match=r"flags 0x4 mark a dedup-mode message; this receiver runs "
                                        r"wire_mode='pair'"):
        wire.decode_header(dedup_words[:15], 3)
    # a dedup receiver reads 16 words: the pair header and one word past it
    with pytest.raises(WireError, match=r"flags 0x0 mark a pair-mode message; this receiver runs "
                                        r"wire_mode='dedup'"):
        wire.decode_header(np.append(pair_words, 0), 3, _dedup_layout())
    with pytest.raises(WireError, match=r"header has shape \(15,\), expected \(16,\) .*'dedup'"):
        wire.decode_header(pair_words, 3, wire_mode="dedup")


@pytest.mark.parametrize("word,value,pattern", [
    (15, -1, "negative sizes"),
    (15, 1, r"routed_tokens=5 \(must lie in \[num_rows, num_rows \* top_k=2\]\)"),  # 5 > 1 * 2
    (15, 6, r"num_rows=6, routed_tokens=5 \(must lie"),  # fewer partials than rows
    (wire.HDR_SHARED_TOKENS, 5, r"shared_tokens=5 \(must be <= num_rows\)"),
])
def test_dedup_header_sizes_are_checked(word, value, pattern):
    words = wire.encode_header(_dedup_dispatch(), 3)
    words[word] = value
    with pytest.raises(WireError, match=pattern):
        wire.decode_header(words, 3, wire_mode="dedup")


def test_dedup_rows_bounded_by_token_cap():
    words = wire.encode_header(_dedup_dispatch(num_rows=6, expert_counts=(3, 3, 0), num_tokens=5), 3)
    wire.decode_header(words, 3, wire_mode="dedup")
    with pytest.raises(WireError, match="header num_rows=6 exceeds this window's capacity 5"):
        wire.decode_header(words, 3, _dedup_layout(routed_cap=8))


def test_message_bytes_by_hand():
    """hidden 8 x bf16 = 16 B rows, top-2, epr 3: pair header 15 words, dedup 16 words and a
    route-table row of 2 + 2*2 = 6 words; + 8 B of flag per message."""
    pair, dedup = _dedup_layout(wire_mode="pair"), _dedup_layout()
    assert pair.message_bytes(reply=False, routed_tokens=7, shared_tokens=3) == 60 + 8 + 7 * (16 + 8) + 3 * (16 + 4)
    assert pair.message_bytes(reply=True, routed_tokens=7, shared_tokens=3) == 60 + 8 + 10 * 16
    assert dedup.message_bytes(reply=False, num_rows=4) == 64 + 8 + 4 * (16 + 24)
    assert dedup.message_bytes(reply=True, num_rows=4) == 64 + 8 + 4 * 16
    assert dedup.message_bytes(reply=True) == 72  # a header-only (always_send) message


def _table(rows, top_k=2):
    """Route table from (token, shared, [staging rows]) with unit weights."""
    table = np.zeros((len(rows), 2 + 2 * top_k), np.int32)
    for r, (token, shared, slots) in enumerate(rows):
        table[r, :2] = token, shared
        table[r, 2:2 + top_k] = list(slots) + [-1] * (top_k - len(slots))
        table[r, 2 + top_k:2 + top_k + len(slots)] = np.ones(len(slots), np.float32).view(np.int32)
    return table


@pytest.mark.parametrize("rows,pattern", [
    ([(0, 1, [1]), (7, 0, [0, 2])], r"row 1: token 7 outside \[0, 5\)"),
    ([(0, 0, [1]), (3, 0, [0, 2])], r"row 0: shared flag 0, expected 1 \(shared_tokens=1\)"),
    ([(0, 1, [1]), (3, 1, [0, 2])], r"row 1: shared flag 1, expected 0"),
    ([(0, 1, []), (3, 0, [0, 1, 2][:2])], r"row 0: staging rows \[-1, -1\] are not 1..top_k rows"),
    ([(0, 1, [1]), (3, 0, [0, 1])], r"not a permutation of \[0, 3\) .* 3 slots, range \[0, 1\]"),
    ([(0, 1, [1]), (3, 0, [0])], r"not a permutation of \[0, 3\) .* 2 slots"),
    ([(0, 1, [3]), (3, 0, [0, 2])], r"not a permutation .* range \[0, 3\]"),
])
def test_route_table_checks_name_the_bad_row(rows, pattern):
    good = _table([(0, 1, [1]), (3, 0, [0, 2])])
    wire.check_route_table(good, num_tokens=5, routed_tokens=3, shared_tokens=1, top_k=2)
    with pytest.raises(WireError, match=pattern):
        wire.check_route_table(_table(rows), num_tokens=5, routed_tokens=3, shared_tokens=1, top_k=2)
    gap = good.copy()
    gap[1, 2:4] = -1, 0
    with pytest.raises(WireError, match=r"row 1: staging rows \[-1, 0\]"):
        wire.check_route_table(gap, num_tokens=5, routed_tokens=3, shared_tokens=1, top_k=2)


# --- a shutdown written over a reply keeps it (issue 35, item 13) -----------------------
@pytest.mark.parametrize("epr", [1, 4])
def test_shutdown_over_a_reply_keeps_it_deliverable_and_nothing_else(epr):
    rng = np.random.default_rng(35 + epr)
    dispatch = _header(epr, rng)
    reply = wire.reply_header(dispatch, seq=7, src_rank=1)
    words = wire.encode_header(reply, epr)
    fresh = wire.encode_header(wire.shutdown_header(src_rank=1, top_k=8, expert_per_rank=epr), epr)
    kept = wire.shutdown_over_reply(words, 7, fresh)
    header = wire.decode_header(kept, epr)
    assert header.is_shutdown and header.keeps_reply
    assert np.array_equal(np.delete(kept, wire.HDR_FLAGS), np.delete(words, wire.HDR_FLAGS))
    want = wire.ReplyExpectation(peer=1, seq=dispatch.seq, layer_idx=dispatch.layer_idx,
                                 stage_idx=dispatch.stage_idx, routed_tokens=dispatch.routed_tokens,
                                 shared_tokens=dispatch.shared_tokens)
    wire.check_reply(header, want)  # the kept reply answers its dispatch...
    assert wire.answers(header, dispatch.seq) and not wire.is_late_reply(header, dispatch.seq)
    newer = wire.ReplyExpectation(**{**want.__dict__, "seq": dispatch.seq + 1})
    with pytest.raises(ConnectorShutdown):  # ...and is a shutdown for any later dispatch
        wire.check_reply(header, newer)
    # an empty slot gets the plain shutdown, an announced one stays as it is
    assert np.array_equal(wire.shutdown_over_reply(words, 0, fresh), fresh)
    assert np.array_equal(wire.shutdown_over_reply(kept, wire.SHUTDOWN_SEQ, fresh), kept)
    plain = wire.decode_header(fresh, epr)
    assert plain.is_shutdown and not plain.keeps_reply and not wire.answers(plain, 0)
    with pytest.raises(ConnectorShutdown):
        wire.check_reply(plain, wire.ReplyExpectation(**{**want.__dict__, "seq": 1 << 32}))


def test_timeout_status_on_a_consumed_shutdown_names_the_shutdown_not_the_sentinel():
    record = wire.StatusRecord(wire.STATUS_TIMEOUT, 0, 0, 0, 5, wire.SHUTDOWN_SEQ, -1, -1, 3)
    error = record.error(timeout_s=1.0)
    assert isinstance(error, ConnectorShutdown) and error.src_rank == 0
    assert str(wire.SHUTDOWN_SEQ) not in str(error)
