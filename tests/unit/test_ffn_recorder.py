"""``FFNWorker(recorder=...)``: the opt-in instrumentation hooks are called in order, around
the right work, under both schedules; ``HostPolling.num_pending`` (what the benchmark's
recorder samples as items waiting) counts arrivals not taken yet; and ``FFNWorker(overlap=True)``
on a device-less connector (the host lane: a reply thread) computes the next item while a
reply is pending, keeps the reply order, keeps a reply error's type and bounds its waits."""
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from afd_cupy import wire
from afd_cupy.backends.base import Arrival
from afd_cupy.backends.host_poll import HostPolling
from afd_cupy.connector import FFNWorkItem
from afd_cupy.errors import ConnectorShutdown, PeerTimeoutError, ProtocolError
from afd_cupy.ffn.overlap import ThreadReplies
from afd_cupy.ffn.worker import FFNWorker

HIDDEN = 8


def _item(src_rank, layer_idx):
    header = wire.Header(seq=1, src_rank=src_rank, layer_idx=layer_idx, stage_idx=0, num_tokens=2,
                         routed_tokens=2, shared_tokens=0, top_k=1, flags=0, echo_seq=0,
                         expert_counts=(2,))
    return FFNWorkItem(arrival=Arrival(src_rank, 0, header), routed_x=torch.ones(2, HIDDEN),
                       group_counts=torch.tensor([2], dtype=torch.int32), shared_x=None,
                       route_table=torch.zeros(2, 2, dtype=torch.int32))


class _Log:
    """A recorder that logs every hook, and the events the worker caused, in one list."""

    def __init__(self):
        self.events = []

    def polling(self):
        self.events.append("polling")

    def received(self, worker, item):
        self.events.append(("received", item.src_rank, item.layer_idx, worker.num_waiting))

    def computing(self, items):
        self.events.append(("computing", [i.src_rank for i in items]))

    def replying(self, items):
        self.events.append(("replying", [i.src_rank for i in items]))

    def served(self, items):
        self.events.append(("served", [i.src_rank for i in items]))


def _worker(items, schedule, recorder):
    script = list(items) + ["shutdown"]
    log = recorder.events if recorder else []

    def recv(timeout_ms=None):
        nxt = script.pop(0)
        if nxt == "shutdown":
            raise ConnectorShutdown("scripted")
        return nxt

    def expert_fn(item):
        log.append(("experts", item.src_rank))
        return item.routed_x * 2, None

    def reply(item, routed, shared):
        log.append(("reply", item.src_rank))

    conn = SimpleNamespace(model=SimpleNamespace(num_layers=2), topology=SimpleNamespace(num_attn_ranks=2),
                           role_rank=0, recv_ffn_work_item=recv, send_ffn_work_item_output=reply)
    return FFNWorker(conn, expert_fn=expert_fn, schedule=schedule, recorder=recorder)


def test_async_hooks_bracket_each_item():
    log = _Log()
    worker = _worker([_item(0, 0), _item(1, 0)], "async", log)
    assert worker.run() == 2
    per_item = lambda r: ["polling", ("received", r, 0, 0), ("computing", [r]), ("experts", r),
                          ("replying", [r]), ("reply", r), ("served", [r])]
    assert log.events == per_item(0) + per_item(1) + ["polling"]  # the last poll meets the shutdown


def test_lockstep_hooks_bracket_the_merged_batch():
    log = _Log()
    worker = _worker([_item(0, 0), _item(1, 0)], "lockstep", log)
    assert worker.run() == 2
    assert log.events == ["polling", ("received", 0, 0, 0), "polling", ("received", 1, 0, 1),
                          ("computing", [0, 1]), ("experts", 0), ("experts", 1), ("replying", [0, 1]),
                          ("reply", 0), ("reply", 1), ("served", [0, 1]), "polling"]


def test_no_recorder_serves_the_same():
    worker = _worker([_item(0, 0), _item(1, 1)], "async", None)
    assert worker.recorder is None and worker.run() == 2


def test_host_polling_counts_arrivals_not_taken():
    flags = np.zeros(4, np.int64)
    window = SimpleNamespace(layout=SimpleNamespace(num_slots=4, ring_depth=2), read_flags=lambda: flags.copy())
    polling = HostPolling(window)
    assert polling.num_pending() == 0
    flags[[1, 3]] = [7, 2]
    assert polling.num_pending() == 2
    assert polling.poll() is not None
    assert polling.num_pending() == 1
    assert polling.poll() is not None and polling.poll() is None
    assert polling.num_pending() == 0
    flags[1] = 8  # a new message on a consumed slot
    assert polling.num_pending() == 1


# --------------------------------------------------------------------------- overlap=True (reply thread)

def _overlap_worker(items, schedule, recorder, reply):
    script = list(items) + ["shutdown"]

    def recv(timeout_ms=None):
        nxt = script.pop(0)
        if nxt == "shutdown":
            raise ConnectorShutdown("scripted")
        return nxt

    conn = SimpleNamespace(model=SimpleNamespace(num_layers=2), topology=SimpleNamespace(num_attn_ranks=2),
                           role_rank=0, peer_timeout_s=5.0, recv_ffn_work_item=recv,
                           send_ffn_work_item_output=reply)
    return FFNWorker(conn, expert_fn=lambda item: (item.routed_x * (item.src_rank + 2), None),
                     schedule=schedule, recorder=recorder, overlap=True)


def test_overlap_computes_the_next_item_while_a_reply_is_pending():
    # the reply of item 0 cannot finish before the experts of item 1 ran: only a worker that
    # hands replies off (the reply thread of the host backend) gets through
    item1_computed, replies = threading.Event(), []

    def reply(item, routed, shared):
        if item.src_rank == 0:
            assert item1_computed.wait(5.0), "the worker waited for reply 0 before computing item 1"
        replies.append((item.src_rank, float(routed[0, 0])))

    worker = _overlap_worker([_item(0, 0), _item(1, 0)], "async", None, reply)
    compute = worker.expert_fn

    def marking(item):
        if item.src_rank == 1:
            item1_computed.set()
        return compute(item)

    worker.expert_fn = marking
    assert worker.run() == 2
    assert replies == [(0, 2.0), (1, 3.0)]  # submission order, each with its own outputs
    assert worker._replies._thread is None  # run() stopped the reply thread


def test_overlap_hooks_and_reply_order():
    log, replies = _Log(), []
    worker = _overlap_worker([_item(0, 0), _item(1, 0), _item(0, 1)], "async", log,
                             lambda item, routed, shared: replies.append((item.src_rank, item.layer_idx)))
    assert worker.run() == 3
    per_item = lambda r, layer: ["polling", ("received", r, layer, 0), ("computing", [r]),
                                 ("replying", [r]), ("served", [r])]
    assert log.events == per_item(0, 0) + per_item(1, 0) + per_item(0, 1) + ["polling"]
    assert replies == [(0, 0), (1, 0), (0, 1)]


def test_overlap_lockstep_answers_the_merged_batch_in_rank_order():
    replies = []
    worker = _overlap_worker([_item(1, 0), _item(0, 0)], "lockstep", None,
                             lambda item, routed, shared: replies.append(item.src_rank))
    assert worker.run() == 2 and worker.num_batches == 1
    assert replies == [0, 1]


def test_overlap_reply_error_keeps_its_type_and_later_replies_still_go():
    item1_handed_off, replies = threading.Event(), []

    class HandOff(_Log):
        def served(self, items):
            if items[0].src_rank == 1:
                item1_handed_off.set()

    def reply(item, routed, shared):
        if item.src_rank == 0:
            assert item1_handed_off.wait(5.0)
            raise ProtocolError("scripted: already answered", peer=0)
        replies.append(item.src_rank)

    worker = _overlap_worker([_item(0, 0), _item(1, 0)], "async", HandOff(), reply)
    with pytest.raises(ProtocolError, match="scripted: already answered"):
        worker.run()  # raised on the worker thread by the final drain
    assert replies == [1]  # the reply handed off before the failure was still written
    worker.flush()  # the error was raised once


def test_overlap_drain_is_bounded():
    release = threading.Event()
    lane = ThreadReplies(lambda item, routed, shared: release.wait(5.0), timeout_s=0.2)
    lane.submit([_item(0, 0)], [(torch.ones(1), None)])
    with pytest.raises(PeerTimeoutError, match="1 replies unwritten after 0.2 s"):
        lane.drain()
    release.set()
    lane.close()
