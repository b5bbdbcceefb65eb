"""The async-vs-solo FFN item cost the planner's validation prints (afd_cupy.capacity.item_cost):
hand-computed mixes on synthetic cases, and the shipped 7a386e3 sweep recomputed from its JSON
by another path (the report's own fields, not the MeasuredRun)."""
from __future__ import annotations

import json

import pytest

from afd_cupy.capacity import item_cost, measured
from afd_cupy.capacity.validate import Case


def _case(**kw):
    base = dict(workload="w", lengths=((4096,), (1024,)), solo_ms=(10.0, 4.0))
    return Case(**{**base, **kw})


def test_the_mix_weighs_each_replica_by_its_async_batches():
    case = _case(ffn_item_ms={"async": 2.0, "lockstep": 9.0}, batches={"async": (3, 1), "lockstep": (5, 5)},
                 solo_ffn_item_ms=(1.0, 2.0), corun_ffn_item_ms=(1.6, 2.4),
                 spin_ffn_item_ms={"spin1": (2.0, 2.0), "spin2": (1.0, None)})
    cost = item_cost.item_cost("r", case)
    assert cost.spin_mix_ms == {"spin1": pytest.approx(2.0)} and cost.over_spin == {"spin1": pytest.approx(1.0)}
    assert cost.solo_mix_ms == pytest.approx((3 * 1.0 + 1 * 2.0) / 4)
    assert cost.corun_mix_ms == pytest.approx((3 * 1.6 + 1 * 2.4) / 4)
    assert cost.over_solo == pytest.approx(2.0 / 1.25) and cost.over_corun == pytest.approx(2.0 / 1.8)


@pytest.mark.parametrize("change", [dict(ffn_item_ms={}), dict(batches={"async": (0, 0)}), dict(batches={})])
def test_no_cost_without_the_async_busy_time_or_batches(change):
    case = _case(**{**dict(ffn_item_ms={"async": 2.0}, batches={"async": (3, 1)}, solo_ffn_item_ms=(1.0, 2.0)),
                    **change})
    assert item_cost.item_cost("r", case) is None


def test_a_round_not_measured_for_every_replica_gives_no_mix():
    case = _case(ffn_item_ms={"async": 2.0}, batches={"async": (3, 1)}, solo_ffn_item_ms=(1.0, None))
    cost = item_cost.item_cost("r", case)
    assert cost.solo_mix_ms is None and cost.over_solo is None and cost.corun_mix_ms is None


def test_the_shipped_sweep_recomputed_from_its_json():
    report = json.loads(measured.SWEEP_7A386E3.read_text())
    layers = report["model"]["layers"]
    costs = {c.workload: c for c in item_cost.item_costs(measured.GPU_RUNS) if c.run.startswith("7a386e3")}
    assert set(costs) == {"skew1x", "skew4x", "skew16x"}
    for row in (r for r in report["results"] if r["schedule"] == "async"):
        ffn = row["ffn"]
        want_async = ffn["busy_fraction"] / ffn["items_per_s"] * 1e3
        items = [rep["batches"] * layers for rep in row["replicas"]]
        solo = [rep["solo"]["ffn"]["busy_fraction"] / rep["solo"]["ffn"]["items_per_s"] * 1e3 for rep in row["replicas"]]
        corun = [rep["solo"]["corun"]["ffn"]["busy_fraction"] / rep["solo"]["corun"]["ffn"]["items_per_s"] * 1e3
                 for rep in row["replicas"]]
        got = costs[row["workload"]]
        assert got.async_ms == pytest.approx(want_async)
        assert got.solo_mix_ms == pytest.approx(sum(s * n for s, n in zip(solo, items)) / sum(items))
        assert got.corun_mix_ms == pytest.approx(sum(c * n for c, n in zip(corun, items)) / sum(items))
    assert costs["skew4x"].over_corun > 1.05 > costs["skew1x"].over_corun  # what planner.md reports
