"""A new transport is one module (``afd_cupy.transports``): this file defines a host-initiated
transport of its own, registers it, and runs the host backend over it end to end in real
processes, in both wire modes, against the fp64 reference; the configuration checks and the
backend choice go through the registry, never through the name."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from afd_cupy import wire
from afd_cupy.backends import host
from afd_cupy.backends.base import require_backend
from afd_cupy.config import ConnectorConfig, ModelConfig
from afd_cupy.errors import ConfigError
from afd_cupy.runtime.launch import launch
from afd_cupy.testing.scenario import Scenario, run_rank, tolerance
from afd_cupy.transports import (Link, Transport, get_transport, register, transport_names,
                                 transports_of, unregister)

NAME = "test-memcpy"
#: (data messages, control messages) this process sent through a MemcpyLink, by peer role rank
SENT: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])


class MemcpyLink(Link):
    """Every peer staged: a message is assembled in this rank's private staging (laid out
    like a window, slot (peer, ring)), then the host copies exactly the bytes it wrote onto
    the peer's slot (this rank's region), the flag word last."""

    def __init__(self, transport, window, peer_pes, own_region: int):
        super().__init__(transport, window, peer_pes, [True] * len(peer_pes))
        self.staging = np.zeros(window.layout.window_bytes, np.uint8)
        self.own_region = own_region

    def write_staged(self, peer, ring, header, seq, fields, *, stream=None):
        layout = self.window.layout
        src, dst = layout.slot_offset(peer, ring), layout.slot_offset(self.own_region, ring)
        ranges = []
        for name, array in {**fields, "header": np.asarray(header, np.int32)}.items():
            raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            offset = layout.field_offset(name)
            assert raw.size <= layout.field_bytes(name), (name, raw.size)
            self.staging[src + offset:src + offset + raw.size] = raw
            ranges.append((offset, raw.size))
        peer_window = self.window.peer_bytes(self.peer_pes[peer])
        for offset, nbytes in ranges:
            peer_window[dst + offset:dst + offset + nbytes] = self.staging[src + offset:src + offset + nbytes]
        flag = 8 * layout.slot_index(self.own_region, ring)
        peer_window[flag:flag + 8] = np.array([seq], np.int64).view(np.uint8)
        SENT[peer][seq == wire.SHUTDOWN_SEQ] += 1


class MemcpyTransport(Transport):
    name = NAME
    is_host_initiated = True
    backends = ("host",)

    def open(self, heap, window, ctx, *, instance):
        return MemcpyLink(self, window, ctx.opposite_pes(), own_region=ctx.role_rank)


@pytest.fixture
def memcpy_transport():
    transport = register(MemcpyTransport())
    try:
        yield transport
    finally:
        unregister(NAME)


def _rank(ctx, scenario):
    """A rank's process: the transport is registered in this process too, then the usual
    scenario; the report adds what went through the link."""
    register(MemcpyTransport(), replace=True)
    report = run_rank(ctx, scenario)
    return {**report, "sent": {peer: tuple(counts) for peer, counts in SENT.items()}}


def test_config_and_backend_choice_go_through_the_registry(memcpy_transport):
    assert transport_names()[-1] == NAME and get_transport(NAME) is memcpy_transport
    assert ConnectorConfig(transport=NAME).transport == NAME
    assert transports_of("host") == ("direct", "auto", NAME) == host.CAPABILITIES.transports
    assert NAME not in transports_of("cuda")
    require_backend("host", "dedup", NAME)
    with pytest.raises(ConfigError, match=rf"backend 'cuda' does not implement transport='{NAME}'"):
        require_backend("cuda", "pair", NAME)  # before the cuda backend's libraries are looked for
    with pytest.raises(ConfigError, match="already registered"):
        register(MemcpyTransport())


def test_an_unregistered_transport_is_a_config_error():
    assert NAME not in transport_names()
    with pytest.raises(ConfigError, match=rf"ConnectorConfig.transport must be one of "
                                          rf"\('direct', 'put', 'auto'\), got '{NAME}'"):
        ConnectorConfig(transport=NAME)


@pytest.mark.parametrize("wire_mode", ["pair", "dedup"])
def test_host_backend_runs_end_to_end_over_a_transport_defined_here(memcpy_transport, wire_mode):
    model = ModelConfig(hidden_size=64, num_experts=8, top_k=2, moe_intermediate_size=32,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=96,
                        num_layers=2)
    scenario = Scenario(model, 2, 2, backend="host", num_tokens=40,
                        connector=ConnectorConfig(wire_mode=wire_mode, transport=NAME))
    results = launch(_rank, scenario.world_size, args=(scenario,), timeout_s=180)
    attn = [r for r in results if r["role"] == "attention"]
    ffn = [r for r in results if r["role"] == "ffn"]
    for report in attn:
        assert len(report["errors"]) == scenario.num_checks
        for err in report["errors"]:
            assert err["shape_ok"] and err["num_nan"] == 0 and err["rel_err"] <= tolerance(model.dtype), err
        # 40 tokens reach every FFN rank in each layer: one dispatch per (layer, FFN rank)
        assert {peer: data for peer, (data, _) in report["sent"].items()} == {0: 2, 1: 2}
    for report in ffn:  # every reply went through the link, to the rank it answers
        assert sum(data for data, _ in report["sent"].values()) == report["served"] == 2 * 2
        assert sorted(report["sent"]) == [0, 1]
    # the shutdown headers too: every rank that announced one sent it to every peer and ring
    ring_depth = scenario.connector.ring_depth
    for report in attn + ffn:
        controls = {control for _, control in report["sent"].values()}
        assert controls <= {0, ring_depth} and len(controls) == 1, report["sent"]
    assert any(control for r in attn + ffn for _, control in r["sent"].values())
