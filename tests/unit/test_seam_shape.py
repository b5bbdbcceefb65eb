"""The asymmetric seam's shape (issue #32): one next-seq rule in Python (``afd_cupy.wire.seq``), the
declared ``Capabilities`` that callers read instead of backend names, and role paths that
hold one role's steps on a shared rank context."""
from __future__ import annotations

import ast
from types import SimpleNamespace

import numpy as np
import pytest

from afd_cupy.backends import cuda, host, host_ffn
from afd_cupy.backends.base import Capabilities
from afd_cupy.errors import ProtocolError
from afd_cupy.ffn.endpoint import FFNEndpoint
from afd_cupy.transports import transports_of
from afd_cupy.wire.seq import SeqCounter, next_seq
from helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "afd_cupy"
#: the loops and the connector that decide on what a data path can do
CALLERS = ["connector.py", "attention/endpoint.py", "ffn/endpoint.py", "attention/step_graph.py",
           "attention/step_schedule.py", "ffn/worker.py", "backends/cuda_ffn_graph.py"]


def test_seq_counter_is_the_next_seq_rule_per_slot():
    counter = SeqCounter((2, 3))
    assert [counter.advance((1, 2)) for _ in range(3)] == [1, 2, 3]
    assert counter.last((1, 2)) == 3 and counter.last((0, 0)) == 0
    counter.set_last((0, 1), 41)
    assert counter.advance((0, 1)) == 42 == next_seq(41)
    copy = counter.copy()
    copy[:] = 0
    assert counter.last((0, 1)) == 42  # a copy
    counter.load(np.arange(6))
    assert counter.values.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="5 counters for 6 slots"):
        counter.load(np.arange(5))


def test_graph_capture_needs_a_nonblocking_receive_waiting_on_the_device():
    base = dict(backend="x", wire_modes=("pair",))
    assert Capabilities(**base, supports_nonblocking=True, device_polling=True).supports_graph_capture
    assert not Capabilities(**base, supports_nonblocking=True).supports_graph_capture
    assert not Capabilities(**base, device_polling=True).supports_graph_capture
    assert host.CAPABILITIES == Capabilities("host", host.WIRE_MODES)
    # the transports are the registry's (each transport lists its backends), not a second list
    assert host.CAPABILITIES.transports == transports_of("host") == ("direct", "auto")
    assert cuda.CAPABILITIES.transports == transports_of("cuda") == ("direct", "put", "auto")


def test_host_ffn_endpoint_refuses_the_reply_seq_hand_over_from_the_capability():
    path = host_ffn.HostFFNPath.__new__(host_ffn.HostFFNPath)
    endpoint = FFNEndpoint(path, model=None, config=None, topology=SimpleNamespace(num_attn_ranks=1),
                           role_rank=0, torch_dtype=None, attn_processes={}, store=None, instance=0)
    for call in (endpoint.reply_seq_counters, lambda: endpoint.set_reply_seq_counters([0])):
        with pytest.raises(ProtocolError, match="backend 'host' keeps no host reply-seq counters"):
            call()


def test_callers_decide_on_capabilities_not_on_backend_names():
    """No comparison with a backend name (``backend == "cuda"``, ``"host" != x.backend``) in
    the connector, its endpoints and the loops built on it."""
    found = []
    for rel in CALLERS:
        tree = ast.parse((PACKAGE / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                names = [o for o in operands if isinstance(o, ast.Constant) and o.value in ("cuda", "host")]
                backend = [o for o in operands if (isinstance(o, ast.Attribute) and o.attr == "backend")
                           or (isinstance(o, ast.Name) and o.id == "backend")]
                if names and backend:
                    found.append(f"{rel}:{node.lineno}")
    assert found == []
