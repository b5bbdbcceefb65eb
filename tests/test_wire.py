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
