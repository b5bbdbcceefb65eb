"""GraphFFNServer.run announces its own failure like FFNWorker.run (issue #35, defect 9): an
exception that ends the graph loop reaches the Attention ranks as a PeerFailedError (through
``AFDConnector.announce_failure``) instead of a timeout per layer. On the CPU: the server's
host-side state with a stand-in connector; the real ``run`` / ``step`` / ``_handle`` run, only
the replay collection (a GPU event and a pinned record) is replaced by a canned record."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from afd_cupy import wire
from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer
from afd_cupy.errors import PeerLostError, WireError
from afd_cupy.ffn import graph as ffn_graph

LAYOUT = wire.WindowLayout(num_regions=2, ring_depth=2, expert_per_rank=4, hidden_size=64,
                           itemsize=2, top_k=4, token_cap=16, routed_cap=40, shared_cap=8)


class _Connector:
    role_rank = 0

    def __init__(self):
        self.calls = []

    def check_attention_alive(self):
        self.calls.append(("check_attention_alive",))

    def announce_failure(self, exc):
        self.calls.append(("announce_failure", exc))

    def set_reply_seq_counters(self, counters, *, slot=None):
        self.calls.append(("set_reply_seq_counters",))


def _server(conn, records):
    """A started server whose replays complete with ``records`` (then GS_IDLE ones)."""
    server = GraphFFNServer.__new__(GraphFFNServer)
    server.connector, server.layout = conn, LAYOUT
    server.policy = SimpleNamespace(observe=lambda routed, shared: None)
    server._idle_sleep_s, server._last_liveness = 0.0, float("-inf")
    server.num_served = server.num_eager = server.num_replays = 0
    server._started, server._inflight = True, []  # start() returns at once
    server.reply_seqs = SimpleNamespace(get=lambda: np.zeros(LAYOUT.num_slots, np.int64))
    pending = list(records)
    server._collect_oldest = lambda: pending.pop(0) if pending else _record(ffn_graph.GS_IDLE)
    server._launch_replay = lambda: None
    return server


def _record(status, words=None):
    record = np.zeros(ffn_graph.record_words(LAYOUT.header_words), np.int64)
    record[ffn_graph.REC_STATUS] = status
    if words is not None:
        record[ffn_graph.REC_HEADER:].view(np.int32)[:LAYOUT.header_words] = words
    return record


def test_a_failing_graph_loop_announces_its_failure_before_it_raises():
    conn = _Connector()
    garbage = np.full(LAYOUT.header_words, 7, np.int32)  # no valid header: the host's decode raises
    server = _server(conn, [_record(ffn_graph.GS_IDLE), _record(ffn_graph.GS_REJECTED, garbage)])
    with pytest.raises(WireError) as raised:
        server.run()
    assert [call[0] for call in conn.calls] == ["check_attention_alive", "announce_failure"]
    assert conn.calls[-1][1] is raised.value  # the exception the loop died with, announced


def test_a_lost_peer_is_not_announced():
    conn = _Connector()
    server = _server(conn, [])

    def lost():
        raise PeerLostError("attention rank(s) [0] died", peers=[0])

    conn.check_attention_alive = lost  # the idle liveness check finds every sender gone
    with pytest.raises(PeerLostError):
        server.run()
    assert conn.calls == []  # nobody is left to tell


def test_a_stop_event_ends_the_loop_without_a_failure():
    conn = _Connector()
    server = _server(conn, [_record(ffn_graph.GS_IDLE)] * 3)
    stop = SimpleNamespace(calls=0)
    stop.is_set = lambda: (setattr(stop, "calls", stop.calls + 1) or stop.calls > 2)
    assert server.run(stop) == 0
    assert ("announce_failure",) not in [call[:1] for call in conn.calls]
    assert conn.calls[-1] == ("set_reply_seq_counters",)  # close() handed the seqs back
