"""Stand-ins shared across test layers: the SM carve-out binding, FFN work items outside any
window, and a connector with just what ``FFNWorker`` reads and a scripted receive."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from afd_cupy import wire
from afd_cupy.backends.base import Arrival
from afd_cupy.connector import FFNWorkItem
from afd_cupy.errors import ConnectorShutdown

#: hidden size of :func:`work_item` rows and :func:`scripted_connector`'s model
FAKE_HIDDEN = 32


class FakeCarveout:
    """Stands in for torch._C's SM carve-out binding: ``install(monkeypatch)`` replaces the
    setter and getter with recording fakes (``calls``: every value set, in order; ``value``:
    the current one). ``accepts_none=False``: a binding that refuses None (TypeError)."""

    def __init__(self, value=None, accepts_none=True):
        self.value, self.accepts_none, self.calls, self.reads = value, accepts_none, [], 0

    def set(self, value):
        if value is None and not self.accepts_none:
            raise TypeError("incompatible function arguments")
        self.calls.append(value)
        self.value = value

    def get(self):
        self.reads += 1
        return self.value

    def install(self, monkeypatch) -> "FakeCarveout":
        monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", self.set)
        monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", self.get)
        return self


def work_item(src_rank, counts, num_shared, layer_idx=0, stage_idx=0, *, dtype=torch.float32,
              seed=0) -> FFNWorkItem:
    """A work item with random rows [*, FAKE_HIDDEN] (stamped by source rank) outside any window."""
    gen = torch.Generator().manual_seed(seed * 131 + src_rank)
    num_routed = int(sum(counts))
    routed = (torch.randn(num_routed, FAKE_HIDDEN, generator=gen) + src_rank).to(dtype)
    shared = (torch.randn(num_shared, FAKE_HIDDEN, generator=gen) - src_rank).to(dtype) if num_shared else None
    header = wire.Header(seq=1, src_rank=src_rank, layer_idx=layer_idx, stage_idx=stage_idx,
                         num_tokens=max(num_routed, num_shared), routed_tokens=num_routed,
                         shared_tokens=num_shared, top_k=2, flags=0, echo_seq=0,
                         expert_counts=tuple(int(c) for c in counts))
    return FFNWorkItem(arrival=Arrival(src_rank, 0, header), routed_x=routed,
                       group_counts=torch.tensor(counts, dtype=torch.int32), shared_x=shared,
                       route_table=torch.zeros(num_routed, 2, dtype=torch.int32))


def scripted_connector(num_attn=2, num_layers=2, routed_scaling_factor=1.0, items=(), *,
                       dtype=torch.float32, experts_per_rank=4, intermediate=16, num_shared=2):
    """Just what FFNWorker reads: model, layout, dtype, topology, role_rank, a scripted receive
    (``items`` in order, the string "shutdown" raises ConnectorShutdown, then None); ``sent``
    collects every ``send_ffn_work_item_output(item, routed, shared)``."""
    script = list(items)
    sent = []

    def recv_ffn_work_item(timeout_ms=None):
        if not script:
            return None
        nxt = script.pop(0)
        if nxt == "shutdown":
            raise ConnectorShutdown("scripted")
        return nxt

    return SimpleNamespace(
        model=SimpleNamespace(num_layers=num_layers, routed_scaling_factor=routed_scaling_factor,
                              hidden_size=FAKE_HIDDEN, moe_intermediate_size=intermediate,
                              num_shared_experts=num_shared),
        layout=SimpleNamespace(expert_per_rank=experts_per_rank), torch_dtype=dtype,
        topology=SimpleNamespace(num_attn_ranks=num_attn), role_rank=0,
        recv_ffn_work_item=recv_ffn_work_item,
        send_ffn_work_item_output=lambda item, routed, shared: sent.append((item, routed, shared)),
        sent=sent)
