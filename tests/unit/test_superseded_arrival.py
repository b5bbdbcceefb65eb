"""A dedup message rewritten while the FFN reads it (its sender timed out and sent the next
message on the slot): the route table read mixes two messages. The host FFN path tells that
apart from a corrupt table by the slot's flag (ArrivalSuperseded, not a WireError), and the FFN
endpoint skips it and returns the newer message. Seen in tools/soak.py (2A2F dedup, stalls,
0.3 s peer timeout) under load: "route table row 33: shared flag 1, expected 0" ended the FFN."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from afd_cupy import wire
from afd_cupy.backends import host_dedup
from afd_cupy.backends.base import Arrival, ArrivalSuperseded, superseded
from afd_cupy.errors import WireError
from afd_cupy.ffn.endpoint import FFNEndpoint

from helpers.layouts import small_layout

LAYOUT = small_layout(wire_mode="dedup", shared_cap=16)
SEQ = 5


def _arrival(num_tokens=4, shared_tokens=2):
    epr = LAYOUT.expert_per_rank
    header = wire.dispatch_header(seq=SEQ, src_rank=1, layer_idx=0, stage_idx=0, num_tokens=num_tokens,
                                  shared_tokens=shared_tokens, top_k=LAYOUT.top_k,
                                  expert_counts=(num_tokens,) + (0,) * (epr - 1), wire_mode="dedup",
                                  num_rows=num_tokens)
    return Arrival(region=1, ring=0, header=header)


class _Window:
    """The slot's route table (every row claims "shared": wrong past shared_tokens) and flag."""

    own_pe = 0

    def __init__(self, flag: int):
        self.flag = np.array([flag], np.int64)

    def field(self, pe, region, ring, name, dtype, shape):
        assert name == "route_table"
        table = np.zeros(shape, dtype)
        table[:, wire.ROUTE_SHARED] = 1
        return table

    def flag_view(self, pe, region, ring):
        return self.flag


def _rank(flag: int):
    return SimpleNamespace(layout=LAYOUT, window=_Window(flag), raw=np.uint16,
                           ctx=SimpleNamespace(dtype="bfloat16"))


def test_a_bad_table_under_its_own_flag_is_a_wire_error():
    with pytest.raises(WireError, match="shared flag 1, expected 0"):
        host_dedup.item_views(_rank(SEQ), {}, _arrival())


def test_a_bad_table_whose_slot_moved_on_is_superseded():
    with pytest.raises(ArrivalSuperseded, match=r"seq 5 .* rewritten \(flag 6\)"):
        host_dedup.item_views(_rank(SEQ + 1), {}, _arrival())


class _Path:
    """wait_any gives the torn arrival, then the newer one; item_views of the first raises."""

    def __init__(self):
        self.arrivals = [_arrival(), Arrival(region=1, ring=0, header=_arrival().header)]
        self.calls = 0

    def wait_any(self, timeout_s):
        return self.arrivals.pop(0) if self.arrivals else None

    def item_views(self, arrival):
        self.calls += 1
        if self.calls == 1:
            raise ArrivalSuperseded("rewritten while read")
        return SimpleNamespace(routed_x="rows", group_counts="counts", shared_x="shared", route_table="table")


def test_the_endpoint_skips_a_superseded_arrival_and_returns_the_next(caplog):
    path = _Path()
    endpoint = FFNEndpoint(path, model=None, config=SimpleNamespace(recv_poll_timeout_ms=100), topology=None,
                           role_rank=0, torch_dtype=None, attn_processes={}, store=None, instance=0)
    with caplog.at_level(logging.WARNING, logger="afd_cupy"):
        item = endpoint.recv(100)
    assert path.calls == 2 and item.routed_x == "rows" and item.seq == SEQ
    assert "not served: rewritten while read" in caplog.text


@pytest.mark.parametrize("flag,moved", [(SEQ, False), (SEQ + 1, True), (SEQ + (1 << 32), False),
                                        (wire.SHUTDOWN_SEQ, True), (0, True)])
def test_slot_moved_on_compares_the_low_32_bits_of_the_flag_with_the_header_seq(flag, moved):
    assert wire.slot_moved_on(flag, _arrival().header) is moved


def test_superseded_names_the_message_or_lets_the_cause_stand():
    cause = WireError("route table row 0: duplicate")
    assert superseded(_arrival(), SEQ, cause) is None
    error = superseded(_arrival(), SEQ + 3, cause)
    assert isinstance(error, ArrivalSuperseded)
    assert str(error) == ("dedup message seq 5 from attention rank 1 (ring 0) was rewritten (flag 8) "
                          "while its route table was read (route table row 0: duplicate)")
