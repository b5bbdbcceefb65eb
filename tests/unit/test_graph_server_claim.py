"""GraphFFNServer.start with an unclaimed host wait (an interrupted ``recv_ffn_work_item``):
the arrival that wait's kernel took is claimed by the eager receive and served eagerly before
the graph's replays, which watch only the arrivals after it. CPU: fakes for the device parts;
the GPU run is tests/stress/test_faults.py's interrupted-wait test."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer


class _Device:
    def __init__(self, log):
        self.log = log

    def use(self):
        self.log.append("use")

    def synchronize(self):
        self.log.append("device sync")


class _Path:
    """``has_unclaimed_wait`` true until the receive claims the ticket."""

    def __init__(self, unclaimed: bool):
        self.has_unclaimed_wait = unclaimed


class _Connector:
    def __init__(self, path, item, log):
        self.path, self.item, self.log = path, item, log

    def recv_ffn_work_item(self, timeout_ms):
        self.log.append(("recv", timeout_ms))
        self.path.has_unclaimed_wait = False  # the claim: the kernel's ticket was waited for
        return self.item

    def reply_seq_counters(self):
        self.log.append("seqs taken")
        return np.arange(4, dtype=np.int64)


def _server(monkeypatch, *, unclaimed: bool, item):
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("torch sync"))
    server = GraphFFNServer.__new__(GraphFFNServer)
    seqs = SimpleNamespace(set=lambda values: log.append(("seqs set", values.tolist())))
    cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda device_id: _Device(log)))
    served = []
    server.kernels = SimpleNamespace(res=SimpleNamespace(cp=cp))
    server.connector = _Connector(_Path(unclaimed), item, log)
    server.eager_worker = SimpleNamespace(serve=lambda it: (served.append(it), log.append("eager serve")))
    server.reply_seqs, server.device, server.device_id = seqs, "cpu", 0
    server.idle_timeout_s, server.depth = 0.01, 0
    server.num_served = server.num_eager = 0
    server._started, server._inflight = False, []
    return server, log, served


def test_an_unclaimed_arrival_is_served_eagerly_before_the_graph_takes_the_seqs(monkeypatch):
    item = object()
    server, log, served = _server(monkeypatch, unclaimed=True, item=item)
    server.start()
    assert served == [item] and (server.num_served, server.num_eager) == (1, 1)
    recv = log.index(("recv", 11))  # the claim waits about the graph's idle bound (+1 ms)
    # the eager reply is ordered before the graph reads the reply seqs it advanced
    assert recv < log.index("eager serve") < log.index("torch sync") < log.index("seqs taken")


def test_an_unclaimed_wait_that_found_nothing_serves_nothing(monkeypatch):
    server, log, served = _server(monkeypatch, unclaimed=True, item=None)
    server.start()
    assert served == [] and server.num_served == 0 and ("recv", 11) in log


def test_no_unclaimed_wait_no_eager_receive(monkeypatch):
    server, log, served = _server(monkeypatch, unclaimed=False, item=object())
    server.start()
    assert served == [] and not any(isinstance(e, tuple) and e[0] == "recv" for e in log)
    assert ("seqs set", [0, 1, 2, 3]) in log and server._started
