"""What an FFN item costs in a run's async phase against its solo-type rounds, from the
measured numbers alone (no simulation): a diagnostic ``tools/plan_afd.py --validate`` prints
beside the predictions (docs/design/planner.md, "What the misses say").

bench_afd records, per window, the FFN's busy fraction and items per second, so its busy ms per
item (``calibrate.busy_per_item_s``) is known for the async phase, each replica's solo window
(that replica alone through the FFN) and its co-run solo window (the same, while the other
replicas run their attention without sending). The async phase serves both replicas' items, so
it is compared with the solo and co-run values mixed in the proportions of the async items
(each replica's batches x layers), and with the spinner rounds' (``bench_afd --solo-spinners``:
the others keep N waits spinning) where recorded. Beside the co-run mix, a ratio above 1 means an async item
costs more than one whose GEMMs ran beside an attention the whole time: something the solo-type
rounds do not have slows the FFN there; below 1, the GEMMs overlapped attention less than in
the co-run round.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ItemCost:
    """One case's async FFN busy ms per item (``async_ms``) and the solo / co-run values mixed
    in the async items' proportions (None where a round did not measure them)."""

    run: str
    workload: str
    async_ms: float
    solo_mix_ms: float | None
    corun_mix_ms: float | None
    spin_mix_ms: dict = field(default_factory=dict)  # per spinner round ("spinN"), where measured

    @property
    def over_solo(self) -> float | None:
        return None if self.solo_mix_ms is None else self.async_ms / self.solo_mix_ms

    @property
    def over_corun(self) -> float | None:
        return None if self.corun_mix_ms is None else self.async_ms / self.corun_mix_ms

    @property
    def over_spin(self) -> dict:
        return {name: self.async_ms / mix for name, mix in self.spin_mix_ms.items() if mix}


def _mix(values: tuple, weights: tuple) -> float | None:
    """The ``weights``-weighted mean of ``values`` (None if any value is missing or no weight)."""
    if not values or len(values) != len(weights) or any(v is None for v in values) or sum(weights) <= 0:
        return None
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


def item_cost(run_name: str, case) -> ItemCost | None:
    """The :class:`ItemCost` of a :class:`~afd_cupy.capacity.validate.Case` whose async phase
    recorded the FFN's busy time and each replica's batches; None otherwise (the replicas run
    the same layers, so batches weigh their items)."""
    async_ms = case.ffn_item_ms.get("async")
    batches = case.batches.get("async", ())
    if not async_ms or not batches or sum(batches) <= 0:
        return None
    spins = {name: _mix(values, batches) for name, values in case.spin_ffn_item_ms.items()}
    return ItemCost(run_name, case.workload, async_ms, _mix(case.solo_ffn_item_ms, batches),
                    _mix(case.corun_ffn_item_ms, batches), {k: v for k, v in spins.items() if v is not None})


def item_costs(runs) -> list:
    """:func:`item_cost` of every case of ``runs`` (MeasuredRun) that has one, in order."""
    return [cost for run in runs for case in run.cases if (cost := item_cost(run.name, case)) is not None]
