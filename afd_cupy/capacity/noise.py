"""Service-time noise of a measured run, fitted to the spread of its solo steps only.

The simulator's costs are means; a GPU's are not constant (launch jitter, clocks, the
Python host), and two replicas sharing an FFN can phase-lock under constant costs (the
short replica's items each arrive just after a long item started and wait for all of it)
where a little jitter would break the lock now and then. ``SimConfig.noise_cv`` draws an
independent lognormal factor of mean 1 for every attention layer, FFN host take and expert
GEMM batch; :func:`fit_noise` picks the coefficient of variation that makes a lone replica's
simulated step spread, (p99 − p50) / p50, the mean of the measured solo steps' (bench_afd's
latency p50 / p99, bench_decode's TPOT p50 / p99). A multi-replica prediction then averages
:data:`NOISE_SEEDS` seeded runs (:func:`mean_over_seeds`), so it stays deterministic.
"""
from __future__ import annotations

import dataclasses
import statistics

from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.sim import simulate
from afd_cupy.capacity.spec import SimConfig

#: seeded runs a noisy prediction averages (seeds 0 .. NOISE_SEEDS - 1)
NOISE_SEEDS = 8
#: the steps of one simulated solo run whose spread :func:`fit_noise` reads (a p99 needs ~100s)
SPREAD_STEPS = 200
#: the largest coefficient of variation :func:`fit_noise` considers
CV_MAX = 1.0


def spread(p50: float, p99: float) -> float:
    """The relative spread of a step-time distribution: (p99 − p50) / p50."""
    return (p99 - p50) / p50


def solo_spread(run, costs: cm.Costs, case, replica: int, noise_cv: float) -> float:
    """The simulated spread of ``replica`` of ``case`` (a validate.Case of MeasuredRun ``run``)
    running alone with service-time noise ``noise_cv`` (seed 0, SPREAD_STEPS steps)."""
    config = case.sim_config(SimConfig(warmup_steps=2, steps=SPREAD_STEPS), noise_cv=noise_cv)
    res = simulate(run.shape, run.deployment(only=replica), (case.loads()[replica],),
                   costs.scaled(run.slowdown[0]), config)
    return spread(res.replicas[0].step_p50_s, res.replicas[0].step_p99_s)


def fit_noise(run, costs: cm.Costs, rounds: int = 10) -> float | None:
    """The noise CV whose simulated solo spreads average the measured ones (bisection on
    [0, CV_MAX]: the same seed for every CV, so the simulated spread grows with it); None
    where no case recorded its solo p50 and p99."""
    points = [(case, a, s) for case in run.cases for a, s in enumerate(case.solo_spread) if s is not None]
    if not points:
        return None
    target = statistics.mean(max(0.0, s) for _, _, s in points)

    def simulated(cv: float) -> float:
        return statistics.mean(solo_spread(run, costs, case, a, cv) for case, a, _ in points)

    if simulated(CV_MAX) <= target:
        return CV_MAX
    lo, hi = 0.0, CV_MAX
    for _ in range(rounds):  # the bracket shrinks to CV_MAX / 2^rounds
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulated(mid) < target else (lo, mid)
    return (lo + hi) / 2


def mean_over_seeds(run_once, config: SimConfig, seeds: int = NOISE_SEEDS) -> dict:
    """``run_once(config)`` -> {name: number or list of numbers}, averaged over ``seeds``
    seeded runs of ``config`` (one run where ``config.noise_cv`` is 0: nothing to average)."""
    seeds = seeds if config.noise_cv > 0 else 1
    outs = [run_once(dataclasses.replace(config, seed=seed)) for seed in range(seeds)]
    mean = {}
    for key, value in outs[0].items():
        if isinstance(value, list):
            mean[key] = [statistics.mean(out[key][i] for out in outs) for i in range(len(value))]
        else:
            mean[key] = statistics.mean(out[key] for out in outs)
    return mean
