"""``FFNWorker(recorder=...)``: the opt-in instrumentation hooks are called in order, around
the right work, under both schedules; and ``HostPolling.num_pending`` (what the benchmark's
recorder samples as items waiting) counts arrivals not taken yet."""
from types import SimpleNamespace

import numpy as np
import torch

from afd_cupy import wire
from afd_cupy.backends.base import Arrival
from afd_cupy.backends.host_poll import HostPolling
from afd_cupy.connector import FFNWorkItem
from afd_cupy.errors import ConnectorShutdown
from afd_cupy.ffn_worker import FFNWorker

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
