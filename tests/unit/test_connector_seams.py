"""The connector's public seams for the loops built on it (issue #32), on the CPU.

The graph FFN server (``backends/cuda_ffn_graph.py``) and the step graph used to call the
connector's private bookkeeping (``_check_attention_alive``, ``_note_shutdown``,
``_work_item``, ``_pending``) and to rewrite ``path.reply_seqs``. Here the server's host-side
record handling runs against a stand-in connector that has the public calls only, and the
public calls themselves run on a bare :class:`AFDConnector` (no world: the attributes they
read are set by hand).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from afd_cupy import wire
from afd_cupy.attention.endpoint import AttentionEndpoint
from afd_cupy.backends import cuda_ffn
from afd_cupy.backends.base import Arrival, Capabilities, ItemViews
from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer
from afd_cupy.connector import AFDConnector
from afd_cupy.errors import ConnectorShutdown, ProtocolError
from afd_cupy.ffn import graph as ffn_graph
from afd_cupy.ffn.endpoint import FFNEndpoint
from afd_cupy.runtime.topology import Role
from afd_cupy.wire.seq import SeqCounter

from helpers.layouts import small_layout

LAYOUT = small_layout()


class _PublicConnector:
    """An FFN connector with the public seams only; records every call."""

    role_rank = 0

    def __init__(self):
        self.calls = []

    def check_attention_alive(self):
        self.calls.append(("check_attention_alive",))

    def note_shutdown(self, src_rank):
        self.calls.append(("note_shutdown", src_rank))

    def accept_arrival(self, arrival):
        self.calls.append(("accept_arrival", arrival.region, arrival.ring, arrival.header.seq))
        return SimpleNamespace(arrival=arrival)

    def set_reply_seq_counters(self, counters, *, slot=None):
        self.calls.append(("set_reply_seq_counters", np.asarray(counters).tolist(), slot))


def _server(conn) -> GraphFFNServer:
    """The host-side state of a server (constructing one needs a GPU)."""
    server = GraphFFNServer.__new__(GraphFFNServer)
    server.connector, server.layout = conn, LAYOUT
    server.policy = SimpleNamespace(observe=lambda routed, shared: None)
    server._idle_sleep_s, server._last_liveness = 0.0, float("-inf")
    server.num_served = server.num_eager = 0
    served = []
    server.eager_worker = SimpleNamespace(serve=served.append)
    server.eager_stream = None  # torch.cuda.stream(None) is a no-op
    return server, served


def _record(status, *, slot=0, seq=0, header=None) -> np.ndarray:
    record = np.zeros(ffn_graph.record_words(LAYOUT.header_words), np.int64)
    record[ffn_graph.REC_STATUS], record[ffn_graph.REC_SLOT], record[ffn_graph.REC_SEQ] = status, slot, seq
    if header is not None:
        words = record[ffn_graph.REC_HEADER:].view(np.int32)
        words[:LAYOUT.header_words] = wire.encode_header(header, LAYOUT.expert_per_rank)
    return record


def test_graph_server_records_go_through_the_public_connector_calls():
    conn = _PublicConnector()
    server, served = _server(conn)
    assert server._handle(_record(ffn_graph.GS_IDLE), raising=True) == 0
    shutdown = wire.shutdown_header(src_rank=1, top_k=LAYOUT.top_k, expert_per_rank=LAYOUT.expert_per_rank)
    assert server._handle(_record(ffn_graph.GS_SHUTDOWN, header=shutdown), raising=True) == 0
    # an item for the eager path: slot 3 = region 1, ring 1; the stage reserved seq 42
    dispatch = wire.dispatch_header(seq=9, src_rank=1, layer_idx=0, stage_idx=0, num_tokens=3,
                                    shared_tokens=0, top_k=LAYOUT.top_k, expert_counts=[1, 0, 2, 0])
    assert server._handle(_record(ffn_graph.GS_EAGER, slot=3, seq=42, header=dispatch), raising=True) == 1
    assert conn.calls == [("check_attention_alive",), ("note_shutdown", 1),
                          ("set_reply_seq_counters", 41, 3), ("accept_arrival", 1, 1, 9)]
    assert len(served) == 1 and served[0].arrival.region == 1
    assert (server.num_served, server.num_eager) == (1, 1)


@pytest.mark.parametrize("receiver", ["payload", "fp8_e4m3"])
def test_graph_server_rejected_row_format_raises_the_eager_paths_wire_error(receiver):
    """A REJECTED record whose header's FLAG_FP8 disagrees with the connector (the stage's
    is_fp8 check; the host's decode accepts such a header) raises wire.check_dispatch_rows'
    WireError naming both formats, as the eager receive does, not a generic ProtocolError."""
    import dataclasses

    from afd_cupy.errors import WireError

    conn = _PublicConnector()
    server, served = _server(conn)
    server.layout = dataclasses.replace(LAYOUT, dispatch_dtype=receiver, hidden_size=128)
    sent = "payload" if receiver == "fp8_e4m3" else "fp8_e4m3"
    dispatch = wire.dispatch_header(seq=9, src_rank=1, layer_idx=0, stage_idx=0, num_tokens=3,
                                    shared_tokens=0, top_k=LAYOUT.top_k, expert_counts=[1, 0, 2, 0],
                                    fp8=sent == "fp8_e4m3")
    record = _record(ffn_graph.GS_REJECTED, slot=3, header=dispatch)
    record[ffn_graph.REC_DETAIL] = wire.HDR_FLAGS
    with pytest.raises(WireError, match=f"mark dispatch_dtype='{sent}' rows; this FFN rank reads "
                                        f"dispatch_dtype='{receiver}'"):
        server._handle(record, raising=True)
    assert served == [] and conn.calls == [] and server.num_served == 0


def test_graph_server_close_hands_the_reply_seqs_back_through_the_connector():
    conn = _PublicConnector()
    server, _ = _server(conn)
    server._started, server._inflight = True, []
    server.reply_seqs = SimpleNamespace(get=lambda: np.array([5, 0, 7, 2], np.int64))
    server.close()
    assert conn.calls == [("set_reply_seq_counters", [5, 0, 7, 2], None)] and not server._started


# --- the public calls on a bare connector ----------------------------------------------------
def _bare(role=Role.FFN, **path) -> AFDConnector:
    conn = AFDConnector.__new__(AFDConnector)
    conn.role, conn.role_rank, conn.backend = role, 0, "cuda"
    conn.topology = SimpleNamespace(num_attn_ranks=2)
    path.setdefault("capabilities", Capabilities(backend="cuda", wire_modes=("pair",),
                                                 supports_nonblocking=True,
                                                 host_reply_seqs="reply_seqs" in path))
    if "reply_seqs" in path:  # the cuda FFN path's own hand-over of its SeqCounter
        counters = SeqCounter(len(path["reply_seqs"]))
        counters.values = path.pop("reply_seqs")
        fake = cuda_ffn.CudaFFNPath.__new__(cuda_ffn.CudaFFNPath)
        fake.reply_seqs, fake.layout = counters, SimpleNamespace(num_slots=len(counters.values))
        path.update(reply_seq_counters=fake.reply_seq_counters,
                    set_reply_seq_counters=fake.set_reply_seq_counters)
    conn.path = SimpleNamespace(**path)
    conn._closed = True  # closed: no "not closed" warning from __del__
    if role is Role.ATTENTION:
        conn.endpoint = AttentionEndpoint.__new__(AttentionEndpoint)
        conn.endpoint._pending = {}
    else:
        conn.endpoint = FFNEndpoint(conn.path, model=None, config=None, topology=conn.topology,
                                    role_rank=0, torch_dtype=None, attn_processes={}, store=None,
                                    instance=0)
    return conn


def test_pending_rings_and_the_nonblocking_capability():
    conn = _bare(Role.ATTENTION)
    conn.endpoint._pending.update({3: None, 1: object()})  # a reserved ring counts too
    assert conn.pending_rings() == (1, 3)
    assert conn.supports_nonblocking is True
    host_caps = Capabilities(backend="host", wire_modes=("pair",))
    assert _bare(capabilities=host_caps).supports_nonblocking is False


def test_note_shutdown_counts_each_attention_rank_once():
    conn = _bare()
    conn.note_shutdown(0)
    conn.note_shutdown(0)  # the same announcement on another ring
    with pytest.raises(ConnectorShutdown, match="every Attention rank announced shutdown"):
        conn.note_shutdown(1)


def test_accept_arrival_records_the_item_as_received():
    views = ItemViews(routed_x="rx", shared_x="sx", route_table=None, group_counts="gc")
    conn = _bare(item_views=lambda arrival: views)
    header = wire.dispatch_header(seq=11, src_rank=1, layer_idx=2, stage_idx=0, num_tokens=2,
                                  shared_tokens=1, top_k=4, expert_counts=[1, 0, 0, 1])
    item = conn.accept_arrival(Arrival(1, 0, header))
    assert (item.routed_x, item.shared_x, item.seq) == ("rx", "sx", 11)
    assert conn.endpoint._received == {(1, 0): 11}
    with pytest.raises(ProtocolError, match="message in region 0 claims source rank 1"):
        conn.accept_arrival(Arrival(0, 0, header))


def test_reply_seq_counters_copy_and_set():
    seqs = np.array([3, 4, 5, 6], np.int64)
    conn = _bare(reply_seqs=seqs)
    copy = conn.reply_seq_counters()
    copy[0] = 99
    assert seqs[0] == 3  # a copy
    conn.set_reply_seq_counters(np.array([7, 8, 9, 10]))
    conn.set_reply_seq_counters(41, slot=2)
    assert seqs.tolist() == [7, 8, 41, 10]
    with pytest.raises(ValueError, match="3 counters for 4 slots"):
        conn.set_reply_seq_counters([1, 2, 3])
    with pytest.raises(ValueError, match=r"slot=4 outside \[0, 4\)"):
        conn.set_reply_seq_counters(1, slot=4)
    with pytest.raises(ProtocolError, match="backend 'cuda' keeps no host reply-seq counters"):
        _bare().reply_seq_counters()


@pytest.mark.parametrize("call", [lambda c: c.note_shutdown(0), lambda c: c.check_attention_alive(),
                                  lambda c: c.accept_arrival(None), lambda c: c.reply_seq_counters()])
def test_ffn_seams_refuse_an_attention_connector(call):
    with pytest.raises(ProtocolError, match="is an ffn-side call; this connector is attention"):
        call(_bare(Role.ATTENTION))
