"""The one-GPU contention terms of a measured run, fitted to its co-run solo rounds only.

bench_afd's and bench_decode's co-run solo round runs each replica through the FFN while the
other replicas run their attention steps and send nothing. The simulator runs that round too
(:func:`predict_corun`, ``ReplicaLoad(ffn=False)``), and :func:`fit_contention` picks the
terms that reproduce it:

- where the round recorded the FFN's busy time per item (its ``ffn`` stats) next to the solo
  window's, the FFN's κ reproduces their ratio (the expert GEMMs' slowdown next to the other
  replicas' attention), then the attention's κ the co-run steps;
- otherwise the FFN's κ comes from the ``fallback`` terms (another run's co-run round of the
  same benchmark and model, or bench_corun's :data:`BENCH_CORUN_FFN_KAPPA`) and the
  attention's reproduces the co-run steps. A run without a co-run round takes both from
  ``fallback``;
- where the round recorded the other replicas' attention-only pace (bench_afd's
  ``solo.corun.background``: an attention beside the measuring replica's expert GEMMs for the
  FFN's busy part of the window), the attention's κ beside the GEMMs
  (``Deployment.attn_gemm_contention``) reproduces that pace, with the other two terms fixed.
  Without it the attention has one κ whatever runs beside it.

The multi-replica rows of the run never enter: they validate.
"""
from __future__ import annotations

from dataclasses import dataclass

from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.sim import simulate
from afd_cupy.capacity.spec import SimConfig, check_float


@dataclass(frozen=True)
class Contention:
    """The one-GPU contention terms (``Deployment.hbm_contention``, ``.ffn_contention`` and
    ``.attn_gemm_contention``): κ per unit of the other running processes' share, of the
    attention phases, of the FFN's expert GEMMs, and of the attention beside the GEMMs (None:
    ``attention``)."""

    attention: float = 0.0
    ffn: float = 0.0
    attention_beside_ffn: float | None = None

    def __post_init__(self):
        check_float("Contention", "attention", self.attention, inclusive=True)
        check_float("Contention", "ffn", self.ffn, inclusive=True)
        if self.attention_beside_ffn is not None:
            check_float("Contention", "attention_beside_ffn", self.attention_beside_ffn, inclusive=True)

    @classmethod
    def of(cls, value: "Contention | float | None") -> "Contention | None":
        """``value`` as a Contention: one κ for every phase (a number), as given, or None."""
        if value is None or isinstance(value, Contention):
            return value
        return cls(float(value), float(value))


@dataclass(frozen=True)
class CoRun:
    """One replica's simulated co-run solo: its step (ms, the case's statistic), the FFN's
    mean device time per item in that window (ms) and the other replicas' attention-only
    steps (ms, mean; None at this replica's own index)."""

    step_ms: float
    ffn_item_ms: float
    background_ms: tuple = ()


def predict_corun(run, costs: cm.Costs, case, contention: Contention, config: SimConfig) -> list:
    """One :class:`CoRun` per replica of ``case`` (a validate.Case of the MeasuredRun ``run``):
    it sends to the FFN, the others run their attention only on the same GPU."""
    config = case.sim_config(config)
    costs = costs.scaled(run.slowdown[1])
    out = []
    for a in range(run.num_attn):
        res = simulate(run.shape, run.deployment(contention=contention), case.loads(only_ffn=a), costs, config)
        background = tuple(None if b == a else res.replicas[b].step_mean_s * 1e3 for b in range(run.num_attn))
        out.append(CoRun(case.step_s(res.replicas[a]) * 1e3, res.ffn[0].busy_per_batch_s * 1e3, background))
    return out


#: the FFN's κ measured by bench_corun (docs/performance.md, "bench_corun", 9103b75, one H200,
#: every rank at 50 %): the expert GEMMs ran 1.19x next to the 32k-context attention, 1.20x next
#: to the 2k-context one (the others' shares 0.5) and 1.33x next to both (1.0): κ = (slowdown
#: − 1) / shares = 0.38, 0.40, 0.33, their mean. Used where a run's own co-run round did not
#: record the FFN's busy time.
BENCH_CORUN_FFN_KAPPA = ((1.19 - 1) / 0.5 + (1.20 - 1) / 0.5 + (1.33 - 1) / 1.0) / 3

#: the κ values :func:`fit_scalar` tries before it refines around the best
CONTENTION_GRID = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


#: the terms of a run that measured neither: bench_corun's FFN term, no attention term
BENCH_CORUN = Contention(0.0, BENCH_CORUN_FFN_KAPPA)


def fit_contention(run, costs: cm.Costs, config: SimConfig, fallback: Contention = BENCH_CORUN) -> Contention:
    """The :class:`Contention` that best reproduces ``run``'s co-run solo rounds (module doc;
    least squares on relative errors, each κ by :func:`fit_scalar`); ``fallback`` gives the
    terms its rounds do not measure."""
    cases = [case for case in run.cases if any(case.corun_ms)]
    if not cases:
        return fallback
    memo: dict = {}

    def corun(kappa: Contention) -> list:
        if kappa not in memo:
            memo[kappa] = [predict_corun(run, costs, case, kappa, config) for case in cases]
        return memo[kappa]

    def step_err(kappa: Contention) -> float:
        return sum(((pred.step_ms - ms) / ms) ** 2 for case, preds in zip(cases, corun(kappa))
                   for pred, ms in zip(preds, case.corun_ms) if ms)

    busy = [case for case in cases if any(case.corun_ffn_item_ms) and any(case.solo_ffn_item_ms)]

    def busy_err(kappa: Contention) -> float:
        """The slowdown of the FFN's items, co-run over solo: simulated against measured."""
        total = 0.0
        for case, preds in zip(cases, corun(kappa)):
            if case not in busy:
                continue
            solo_ms = [cm.expert_gemm_time(costs, run.shape, n, run.num_ffn, run.ffn_share) * 1e3
                       for n in case.tokens()]
            for pred, model_solo, co, alone in zip(preds, solo_ms, case.corun_ffn_item_ms, case.solo_ffn_item_ms):
                if co and alone:
                    total += (pred.ffn_item_ms / model_solo - co / alone) ** 2
        return total

    pace_err = _pace_err(run, cases, corun)
    if not busy and not pace_err:  # the attention's κ alone
        return Contention(fit_scalar(lambda k: step_err(Contention(k, fallback.ffn))), fallback.ffn)
    # the FFN's slowdown rests mostly on its own κ, the co-run steps on the attention's, the
    # background's pace on the attention's beside the GEMMs: each in turn with the others' last
    # values (from 0, the FFN's first), later rounds near the first's values. Without the FFN's
    # busy time its κ is the fallback's; without a background pace the attention has one κ.
    attention, ffn, beside, grid = 0.0, (0.0 if busy else fallback.ffn), None, CONTENTION_GRID
    for _ in range(3 if pace_err else 2):
        if busy:
            ffn = fit_scalar(lambda k: busy_err(Contention(attention, k, beside)), grid or _near(ffn))
        attention = fit_scalar(lambda k: step_err(Contention(k, ffn, beside)), grid or _near(attention))
        if pace_err:
            beside = fit_scalar(lambda k: pace_err(Contention(attention, ffn, k)), grid or _near(beside))
        grid = None
    return Contention(attention, ffn, beside)


def _pace_err(run, cases: list, corun):
    """The background replicas' pace in the co-run rounds (mean batch = layer mean x layers),
    simulated against measured, as a function of the terms; None where no round recorded it."""
    paced = [(c, a, pace) for c, case in enumerate(cases) for a, paces in enumerate(case.corun_background or ())
             for pace in paces or () if pace.layer_mean_ms and pace.layers]
    if not paced:
        return None

    def err(kappa: Contention) -> float:
        preds = corun(kappa)
        total = 0.0
        for c, a, pace in paced:
            measured = pace.layer_mean_ms * run.shape.layers
            total += ((preds[c][a].background_ms[pace.replica] - measured) / measured) ** 2
        return total
    return err


def _near(kappa: float) -> tuple:
    """A grid around an earlier fit's ``kappa`` for :func:`fit_scalar`'s second round."""
    return (0.0, kappa / 1.5, kappa, kappa * 1.5) if kappa > 0 else (0.0, 0.05)


def fit_scalar(err, grid: tuple = CONTENTION_GRID, rounds: int = 7) -> float:
    """The argument of ``err`` (a function of one κ >= 0) that minimizes it: the best point of
    ``grid``, then a golden-section search between its neighbours (the bracket shrinks to
    0.618^rounds of its width)."""
    scored = [(err(k), k) for k in grid]
    best = min(range(len(scored)), key=lambda i: scored[i][0])
    lo, hi = grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)]
    golden = (5 ** 0.5 - 1) / 2
    x1, x2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
    f1, f2 = err(x1), err(x2)
    for _ in range(rounds):
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - golden * (hi - lo)
            f1 = err(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + golden * (hi - lo)
            f2 = err(x2)
    return min([scored[best], (f1, x1), (f2, x2)])[1]
