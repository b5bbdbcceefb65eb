"""CPU tests of how the planner's FFN rank serves (afd_cupy.capacity.sim): the order its host
loop takes waiting arrivals (the library's rotating slot scan) and the device copies of a
merged compute batch (FFNWorker's merge_items / split_outputs), against hand-computed values."""
from __future__ import annotations

from collections import deque

import pytest

from afd_cupy.capacity import Deployment, Link, ModelShape, ReplicaLoad, SimConfig, simulate
from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.sim import Simulator
from afd_cupy.errors import ConfigError

from helpers.capacity import small_costs

SHAPE = ModelShape(layers=4, hidden=256, experts=16, top_k=2, intermediate=128, shared_experts=1)
LINK = Link(100.0, 3e-6)


def deployment(num_attn: int, num_ffn: int = 1) -> Deployment:
    return Deployment.one_per_gpu(num_attn, num_ffn, intra_node=LINK)


def prefill(n: int) -> ReplicaLoad:
    return ReplicaLoad("prefill", (n,))


def test_merge_copy_bytes_follow_the_merge_code():
    # 100 tokens, top-2, one FFN rank: 200 routed rows (concatenated, gathered, scattered back:
    # three copies) and 100 shared rows (concatenated: one copy), 256 x 2 bytes a row
    assert cm.merge_copy_bytes(SHAPE, 100, 1) == (3 * 200 + 100) * 256 * 2
    assert cm.merge_copy_bytes(SHAPE, 100, 2) == (3 * 100 + 50) * 256 * 2  # balanced over two ranks
    c = small_costs(copy_gbps=1.0, bandwidth_sat=0.5)
    assert cm.merge_copy_time(c, SHAPE, 100, 1, 1.0) == pytest.approx(358400e-9)
    assert cm.merge_copy_time(c, SHAPE, 100, 1, 0.5) == pytest.approx(358400e-9)  # saturated at 0.5
    assert cm.merge_copy_time(c, SHAPE, 100, 1, 0.25) == pytest.approx(2 * 358400e-9)


def test_lockstep_step_of_two_equal_replicas_is_hand_computable():
    # both replicas' items arrive together; the host loop takes one, then the other, then the
    # device runs the merged batch: its GEMMs and its copies; the replies go back, the next layer
    c = small_costs(copy_gbps=0.5)
    n = 100
    nbytes = cm.wire_rows(SHAPE, n, 1, "pair") * SHAPE.row_bytes
    base = (cm.attention_time(c, n, n * (n + 1) / 2, 0, 1.0) + c.dispatch_fixed_s + LINK.time_s(nbytes)
            + c.ffn_poll_s + 2 * c.ffn_item_s + cm.expert_gemm_time(c, SHAPE, 2 * n, 1, 1.0)
            + LINK.time_s(nbytes) + c.combine_fixed_s)
    copies = cm.merge_copy_time(c, SHAPE, 2 * n, 1, 1.0)
    assert copies > 0.1 * base  # visible
    for merge, per_layer in ((True, base + copies), (False, base)):
        res = simulate(SHAPE, deployment(2), (prefill(n), prefill(n)), c,
                       SimConfig("lockstep", steps=3, merge_copies=merge))
        for rep in res.replicas:
            assert rep.step_p50_s == pytest.approx(SHAPE.layers * per_layer, rel=1e-12)
    # async never merges: the copies do not touch it
    one = [simulate(SHAPE, deployment(2), (prefill(n), prefill(n)), c, SimConfig("async", steps=3, merge_copies=m))
           for m in (True, False)]
    assert one[0].to_dict() == one[1].to_dict()


def _queued(sim: Simulator, replicas: tuple):
    cls = sim.classes[0]
    cls.queue = deque((a, 10, float(i), 0, 0) for i, a in enumerate(replicas))  # (replica, tokens, arrival, layer, step)
    return cls


def test_rotating_pick_takes_the_waiting_replicas_round_robin():
    loads = tuple(prefill(10) for _ in range(3))
    rotate = Simulator(SHAPE, deployment(3), loads, small_costs(), SimConfig(ffn_pick="rotate"))
    cls = _queued(rotate, (2, 0, 1))  # arrived in this order
    cls.scan_start = 1  # the last slot taken was replica 0's
    assert [rotate._pick(cls)[0] for _ in range(3)] == [1, 2, 0]
    assert cls.scan_start == 1
    fifo = Simulator(SHAPE, deployment(3), loads, small_costs(), SimConfig(ffn_pick="fifo"))
    cls = _queued(fifo, (2, 0, 1))
    assert [fifo._pick(cls)[0] for _ in range(3)] == [2, 0, 1]


def test_rotation_wraps_over_the_window_regions():
    # 2 Attention ranks, 3 FFN ranks: the window has max(A, F) = 3 regions, region 2 unused
    sim = Simulator(SHAPE, deployment(2, 3), (prefill(10), prefill(10)), small_costs(), SimConfig())
    cls = _queued(sim, (0, 1))
    cls.scan_start = 2
    assert sim._pick(cls)[0] == 0  # 2 is empty, wraps to 0
    assert cls.scan_start == 1
    assert sim._pick(cls)[0] == 1


def test_ffn_pick_is_checked():
    with pytest.raises(ConfigError, match="ffn_pick"):
        SimConfig(ffn_pick="lifo")
