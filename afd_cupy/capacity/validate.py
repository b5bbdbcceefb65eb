"""Predicted vs measured: calibrate a run's costs from its solo batches only, its one-GPU
contention terms from its co-run solo rounds (``contention``) and its service-time noise from
the spread of its solo steps (``noise``), then predict its multi-replica async and lockstep
rows with the simulator.

A :class:`MeasuredRun` is one benchmark launch pair (async + lockstep) with one
:class:`Case` per workload; :func:`run_from_report` builds one from a ``bench_afd.json``,
:func:`runs_from_sweep` one per split of a sweep, :func:`runs_from_decode_report` one per
placement of a ``bench_decode.json`` (decode cases: TPOT p50 instead of batch time),
``afd_cupy.capacity.measured`` holds the GPU runs (the shipped JSON, and older ones quoted from
docs/benchmarks.md of ca1687d and the issues). :func:`validate` returns one row per compared
quantity with its relative error.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from afd_cupy.capacity import calibrate as cal
from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.contention import BENCH_CORUN, Contention, fit_contention, predict_corun
from afd_cupy.capacity.noise import fit_noise, mean_over_seeds, spread
from afd_cupy.capacity.sim import simulate
from afd_cupy.capacity.spec import (LINK_PRESETS, Deployment, Link, ModelShape, ReplicaLoad,
                                    SimConfig, parse_placements)


#: measured steps of a simulated decode replica: its closed loop staggers the requests evenly,
#: so the batch's cached tokens barely move from step to step (by at most one token per
#: request), and a p50 over 40 steps is the p50 over a request's lifetime
DECODE_STEPS = 40


@dataclass(frozen=True)
class Case:
    """One workload of a run. ``solo_ms``: each replica's mean solo batch (None: unknown).
    ``batch_ms`` / ``tokens_per_s`` / ``ffn_busy``: measured per schedule (missing: not
    measured); ``ratio``, ``ideal``: async/lockstep tokens/s and bench_afd's ideal ratio."""

    workload: str
    lengths: tuple
    solo_ms: tuple
    batch_ms: dict = field(default_factory=dict)
    tokens_per_s: dict = field(default_factory=dict)
    ffn_busy: dict = field(default_factory=dict)
    ratio: float | None = None
    ideal: float | None = None
    kind: str = "prefill"  # decode: lengths = one (context, batch) per replica, ms = TPOT p50
    output_len: int = 0  # decode: tokens each request generates
    corun_ms: tuple = ()  # each replica's co-run solo (the others attention-only); () = not measured
    solo_ffn_item_ms: tuple = ()  # the FFN's busy ms per item in each replica's solo window; () = not measured
    corun_ffn_item_ms: tuple = ()  # the same in each replica's co-run solo window; () = not measured
    solo_spread: tuple = ()  # each replica's solo (p99 - p50) / p50 (noise.spread); () = not measured
    # per replica, in its co-run solo window: the others' attention-only pace (a tuple of
    # calibrate.BackgroundPace, None where its row has none); None = not measured. The fit
    # input of the attention-beside-GEMM term (contention.fit_contention)
    corun_background: tuple | None = None
    ffn_item_ms: dict = field(default_factory=dict)  # per schedule: the FFN's busy ms per item
    spin_ffn_item_ms: dict = field(default_factory=dict)  # per spinner round ("spinN"): as corun_ffn_item_ms
    batches: dict = field(default_factory=dict)  # per schedule: each replica's measured batches (decode: steps)

    def loads(self, only_ffn: int | None = None) -> tuple:
        """One ReplicaLoad per replica (decode: a closed loop, the batch kept full, as
        bench_decode's saturating arrivals keep it). ``only_ffn``: that replica sends to the
        FFN, the others run their attention only (the co-run solo round)."""
        def sends(a):
            return only_ffn is None or a == only_ffn
        if self.kind == "decode":
            return tuple(ReplicaLoad("decode", batch_size=b, context_len=c, output_len=self.output_len, ffn=sends(a))
                         for a, (c, b) in enumerate(self.lengths))
        return tuple(ReplicaLoad("prefill", tuple(l), ffn=sends(a)) for a, l in enumerate(self.lengths))

    def tokens(self) -> list:
        """Tokens per step of each replica (prefill: its batch; decode: its requests)."""
        return [b for _, b in self.lengths] if self.kind == "decode" else [sum(l) for l in self.lengths]

    def step_s(self, replica) -> float:
        """The step statistic the case is measured by, of a ReplicaResult (seconds): prefill
        the mean batch (bench_afd's batch_mean_ms), decode the TPOT p50 (bench_decode's)."""
        return replica.step_mean_s if self.kind == "prefill" else replica.step_p50_s

    def sim_config(self, config: SimConfig, **kw) -> SimConfig:
        """``config`` with ``kw`` replaced, at least DECODE_STEPS steps for a decode case."""
        steps = config.steps if self.kind == "prefill" else max(config.steps, DECODE_STEPS)
        return dataclasses.replace(config, steps=steps, **kw)


@dataclass(frozen=True)
class MeasuredRun:
    """A measured launch pair: the model, the placement (``'0:30,0:30,0:40'``, Attention
    first), its cases; ``slowdown`` = (solo, measured) time factors of every process (host
    backend: busy-polling processes over CPU cores; 1 on a GPU)."""

    name: str
    source: str
    shape: ModelShape
    placement: str
    num_attn: int
    cases: tuple
    slowdown: tuple = (1.0, 1.0)
    link: Link = Link(2000.0, 2e-6, "same_gpu")  # a pair on one GPU (host backend: every pair)
    intra_link: Link = LINK_PRESETS["nvlink"]  # a pair on two GPUs of the node
    weight_read_gbps: float | None = None  # measured one-replica weight-read rate, full GPU
    fit_attention: bool = False
    scale_floor: bool = False
    fixed_on: str = "ffn"  # where the fitted fixed cost goes (calibrate.fit_costs)
    ffn_host_overlap: bool = True  # False on the host backend (one thread takes and computes)
    attn_params: float | None = None  # attention parameters per layer (h200_costs' default: 4 H^2)
    kv_bytes_per_token: float | None = None  # KV-cache bytes per token and layer (decode)
    contention_from: str = ""  # the run (same benchmark and model) whose co-run round gives the terms this one lacks

    def deployment(self, only: int | None = None, contention: "Contention | None" = None) -> Deployment:
        """The run's placement as a Deployment (``only``: that replica alone), its one-GPU
        contention terms ``contention`` (default none)."""
        places = parse_placements(self.placement)
        attn = places[:self.num_attn] if only is None else (places[only],)
        kappa = contention or Contention()
        return Deployment(attn, places[self.num_attn:], same_gpu=self.link, intra_node=self.intra_link,
                          hbm_contention=kappa.attention, ffn_contention=kappa.ffn,
                          attn_gemm_contention=kappa.attention_beside_ffn, mps_caps=True)

    @property
    def decode(self) -> bool:
        return any(c.kind == "decode" for c in self.cases)

    @property
    def num_ffn(self) -> int:
        return len(parse_placements(self.placement)) - self.num_attn

    @property
    def ffn_share(self) -> float:
        """The first FFN rank's SM share."""
        return parse_placements(self.placement)[self.num_attn].share


def calibrated_costs(run: MeasuredRun, base: cm.Costs | None = None) -> cm.Costs:
    """``base`` (default: the H200 defaults for the run's shape) fitted to the run's solo
    batches, as a process would run them with no slowdown."""
    base = base or cm.h200_costs(run.shape, run.attn_params, run.kv_bytes_per_token)
    base = base.replace(ffn_host_overlap=run.ffn_host_overlap)
    if run.weight_read_gbps:
        base = base.replace(weight_read_gbps=run.weight_read_gbps)
    places = parse_placements(run.placement)

    def busy(c, a):
        return c.solo_ffn_item_ms[a] * 1e-3 if a < len(c.solo_ffn_item_ms) and c.solo_ffn_item_ms[a] else None
    if run.decode:
        points = [cal.DecodeSoloPoint(c.workload, a, c.lengths[a][0], c.lengths[a][1], c.output_len, ms * 1e-3,
                                      places[a].share, places[run.num_attn].share, len(places) - run.num_attn,
                                      ffn_busy_per_item_s=busy(c, a))
                  for c in run.cases for a, ms in enumerate(c.solo_ms) if ms]
        return cal.fit_decode_costs(run.shape, points, base, run.link)
    points = [cal.SoloPoint(c.workload, a, c.lengths[a], ms * 1e-3, places[a].share,
                            places[run.num_attn].share, len(places) - run.num_attn,
                            ffn_busy_per_item_s=busy(c, a))
              for c in run.cases for a, ms in enumerate(c.solo_ms) if ms]
    fitted = cal.fit_costs(run.shape, points, base.scaled(run.slowdown[0]), run.link,
                           fit_attention=run.fit_attention, scale_floor=run.scale_floor,
                           fixed_on=run.fixed_on)
    return fitted.scaled(1.0 / run.slowdown[0])


def predict(run: MeasuredRun, costs: cm.Costs, case: Case, config: SimConfig = cal.SIM_FOR_BENCH,
            contention: Contention | None = None, noise_cv: float = 0.0) -> dict:
    """Simulated solo batch per replica, and per schedule batch ms per replica, tokens/s, FFN
    busy; plus ratio, ideal and fraction computed as bench_afd computes them. ``contention``:
    the one-GPU terms of the multi-replica runs (none by default); ``noise_cv``: their
    service-time noise (SimConfig.noise_cv), averaged over noise.NOISE_SEEDS seeds. The solo
    batches are the deterministic ones the fit reproduced."""
    loads = case.loads()
    config = case.sim_config(config)
    solo_costs, run_costs = costs.scaled(run.slowdown[0]), costs.scaled(run.slowdown[1])
    solo = [case.step_s(simulate(run.shape, run.deployment(only=a), (loads[a],), solo_costs, config).replicas[0])
            for a in range(run.num_attn)]
    out = {"solo_ms": [s * 1e3 for s in solo]}

    def once(cfg: SimConfig) -> dict:
        res = simulate(run.shape, run.deployment(contention=contention), loads, run_costs, cfg)
        return {"batch_ms": [case.step_s(r) * 1e3 for r in res.replicas],
                "tokens_per_s": res.tokens_per_s, "ffn_busy": res.ffn_busy}
    for schedule in ("async", "lockstep"):
        out[schedule] = mean_over_seeds(once, dataclasses.replace(config, schedule=schedule, noise_cv=noise_cv))
    tokens = case.tokens()
    ideal_num = sum(n / s for n, s in zip(tokens, out["solo_ms"]))
    lock = sum(n / b for n, b in zip(tokens, out["lockstep"]["batch_ms"]))
    out["ratio"] = out["async"]["tokens_per_s"] / out["lockstep"]["tokens_per_s"]
    out["ideal"] = ideal_num / lock
    out["fraction"] = out["ratio"] / out["ideal"]
    return out


def _row(run, case, quantity, predicted, measured) -> dict:
    err = (predicted - measured) / measured if measured else float("nan")
    return {"run": run.name, "workload": case.workload, "quantity": quantity, "predicted": predicted,
            "measured": measured, "error": err}


def validate(run: MeasuredRun, base: cm.Costs | None = None, contention: Contention | float | None = None,
             noise_cv: float | None = None, fallback: Contention = BENCH_CORUN,
             config: SimConfig = cal.SIM_FOR_BENCH) -> tuple[cm.Costs, list]:
    """(the calibrated costs, one row per measured quantity: predicted, measured, error; each
    row also names the κ it was predicted with: ``hbm_contention`` (the attention's) and
    ``ffn_contention``).

    ``contention``: the one-GPU terms of the multi-replica runs (a number: one κ for every
    phase). None: fitted to the run's co-run solo rounds where it measured them, ``fallback``
    for the terms they do not measure (contention.fit_contention). It does not touch the solo
    fit (a replica alone overlaps nothing).
    ``noise_cv``: the multi-replica runs' service-time noise; None: fitted to the spread of
    the run's solo steps (noise.fit_noise) where it recorded them, else 0.
    ``config``: the multi-replica predictions' SimConfig (its ``ffn_pick`` and ``merge_copies``
    matter; the schedule, the noise and, for decode, the steps are set per prediction)."""
    costs = calibrated_costs(run, base)
    kappa = Contention.of(contention) or fit_contention(run, costs, cal.SIM_FOR_BENCH, fallback)
    noise_cv = (fit_noise(run, costs) or 0.0) if noise_cv is None else noise_cv
    rows = []
    for case in run.cases:
        pred = predict(run, costs, case, config, contention=kappa, noise_cv=noise_cv)
        what = "TPOT p50 ms" if case.kind == "decode" else "batch ms"
        for a, ms in enumerate(case.solo_ms):
            if ms:
                rows.append(_row(run, case, f"solo {what}, replica {a} (fit input)", pred["solo_ms"][a], ms))
        if any(case.corun_ms):
            corun = predict_corun(run, costs, case, kappa, cal.SIM_FOR_BENCH)
            rows += [_row(run, case, f"co-run solo {what}, replica {a} (fit input)", corun[a].step_ms, ms)
                     for a, ms in enumerate(case.corun_ms) if ms]
            rows += [_row(run, case, f"co-run solo FFN busy ms per item, replica {a} (fit input)",
                          corun[a].ffn_item_ms, ms) for a, ms in enumerate(case.corun_ffn_item_ms) if ms]
        for schedule in ("async", "lockstep"):
            for a, ms in enumerate(case.batch_ms.get(schedule, ())):
                if ms:
                    rows.append(_row(run, case, f"{schedule} {what}, replica {a}", pred[schedule]["batch_ms"][a], ms))
            if case.tokens_per_s.get(schedule):
                rows.append(_row(run, case, f"{schedule} tokens/s", pred[schedule]["tokens_per_s"],
                                 case.tokens_per_s[schedule]))
            if case.ffn_busy.get(schedule) is not None:
                rows.append(_row(run, case, f"{schedule} FFN busy", pred[schedule]["ffn_busy"],
                                 case.ffn_busy[schedule]))
        if case.ratio:
            rows.append(_row(run, case, "async / lockstep", pred["ratio"], case.ratio))
        if case.ideal:
            rows.append(_row(run, case, "ideal ratio", pred["ideal"], case.ideal))
            rows.append(_row(run, case, "fraction of ideal", pred["fraction"], case.ratio / case.ideal))
    for row in rows:
        row["hbm_contention"], row["ffn_contention"], row["noise_cv"] = kappa.attention, kappa.ffn, noise_cv
        row["attn_gemm_contention"] = kappa.attention_beside_ffn
    return costs, rows


def validate_runs(runs: list, contention: Contention | float | None = None,
                  noise_cv: float | None = None, config: SimConfig = cal.SIM_FOR_BENCH) -> list:
    """:func:`validate` of every (MeasuredRun, base costs or None) of ``runs``: [(run, costs,
    rows)], each predicted with ``config`` (:func:`validate`). A run's ``contention_from`` names the run of the list whose fitted terms fill in
    what its own co-run round does not measure (fitted first where it comes later)."""
    by_name = {run.name: (run, base) for run, base in runs}
    fitted: dict = {}

    def terms(name: str, seen: tuple = ()) -> Contention:
        if name not in fitted:
            run, base = by_name[name]
            source = run.contention_from
            fallback = terms(source, seen + (name,)) if source in by_name and source not in seen + (name,) \
                else BENCH_CORUN
            fitted[name] = fit_contention(run, calibrated_costs(run, base), cal.SIM_FOR_BENCH, fallback)
        return fitted[name]
    out = []
    for run, base in runs:
        costs, rows = validate(run, base, Contention.of(contention) or terms(run.name), noise_cv, config=config)
        out.append((run, costs, rows))
    return out


def run_from_report(report: dict, name: str, placement: str | None = None, cores: int | None = None) -> MeasuredRun:
    """A MeasuredRun from a bench_afd report. ``placement`` overrides the report's;
    ``cores``: the host backend's CPU cores (slowdown = busy processes / cores, at least 1:
    solo = one replica + the FFN ranks, measured = every process)."""
    num_attn, num_ffn = cal.bench_topology(report)
    places = cal.report_placements(report, num_attn, num_ffn)
    placement = placement or ",".join(f"{p.gpu}:{round(p.share * 100)}" for p in places)
    slowdown = (1.0, 1.0)
    if cores:
        slowdown = (max(1.0, (1 + num_ffn) / cores), max(1.0, (num_attn + num_ffn) / cores))
    cases = []
    rows = report.get("results", [])
    for w in report.get("workloads", []):
        by = {r["schedule"]: r for r in rows if r["workload"] == w["name"]}
        if "async" not in by:
            continue
        cmp_ = report.get("comparison", {}).get(w["name"], {})
        cases.append(Case(w["name"], tuple(tuple(l) for l in w["lengths"]),
                          **_solo_fields(by["async"]["replicas"], "batch_mean_ms",
                                       ("latency_p50_ms", "latency_p99_ms")),
                          batch_ms={s: tuple(rep["batch_mean_ms"] for rep in r["replicas"]) for s, r in by.items()},
                          tokens_per_s={s: r["tokens_per_s"] for s, r in by.items()},
                          ffn_busy={s: r["ffn"]["busy_fraction"] for s, r in by.items()},
                          **_item_fields(by, "batches"),
                          ratio=cmp_.get("ratio"), ideal=cmp_.get("ideal")))
    link = Link(1000.0, 0.0, "host") if cores else Link(2000.0, 2e-6, "same_gpu")
    return MeasuredRun(name, f"bench_afd {report.get('run', {}).get('commit')} {report.get('backend')}",
                       cal.bench_shape(report), placement, num_attn, tuple(cases), slowdown, link,
                       intra_link=link if cores else LINK_PRESETS["nvlink"],
                       fit_attention=bool(cores), scale_floor=bool(cores),
                       fixed_on="attention" if cores else "ffn", ffn_host_overlap=not cores)


def runs_from_sweep(report: dict, name: str, cores: int | None = None) -> list:
    """One MeasuredRun per split of a ``bench_afd_sweep.json`` (``--sweep``): the split's
    label is its ``--placement`` string (``"default"``: the report's MPS split)."""
    out = []
    for split in report.get("splits", []):
        label = split["label"]
        rows = [r for r in report.get("results", []) if r.get("split") == label]
        names = list(dict.fromkeys(r["workload"] for r in rows))
        lengths = {p["workload"]: p["lengths"] for p in report.get("points", []) if p.get("split") == label}
        ratios = {p["workload"]: p for p in report.get("points", []) if p.get("split") == label}
        sub = {**report, "mps": {**report.get("mps", {}), "placement": split.get("placement", "")},
               "results": rows, "workloads": [{"name": n, "lengths": lengths[n]} for n in names if n in lengths],
               "comparison": {n: {"ratio": ratios[n].get("ratio"), "ideal": ratios[n].get("ideal")}
                              for n in ratios}}
        placement = label if label != "default" else None
        out.append(run_from_report(sub, f"{name} {label}", placement=placement, cores=cores))
    return out


def _item_fields(by_schedule: dict, count_key: str) -> dict:
    """Case's ``ffn_item_ms`` and ``batches`` (each replica's ``count_key``) per schedule."""
    item_s = {s: cal.busy_per_item_s(r["ffn"]) for s, r in by_schedule.items()}
    return {"ffn_item_ms": {s: b * 1e3 for s, b in item_s.items() if b},
            "batches": {s: tuple(rep.get(count_key, 0) for rep in r["replicas"]) for s, r in by_schedule.items()}}


def _solo_fields(replicas: list, key: str, quantiles: tuple) -> dict:
    """The solo inputs of a report's async replicas (``key``: the step time, ``batch_mean_ms``
    or ``tpot_p50_ms``; ``quantiles``: the keys of its p50 and p99): Case's solo_ms and, where
    measured, corun_ms, solo_ffn_item_ms, corun_ffn_item_ms, solo_spread and corun_background."""
    solos = [rep.get("solo") or {} for rep in replicas]
    corun = tuple((s.get("corun") or {}).get(key) for s in solos)

    def item_ms(ffn_stats) -> tuple:
        busy = tuple(cal.busy_per_item_s(ffn) for ffn in ffn_stats)
        return tuple(b * 1e3 if b else None for b in busy) if any(busy) else ()
    p50, p99 = quantiles
    spreads = tuple(spread(s[p50], s[p99]) if s.get(p50) and s.get(p99) else None for s in solos)
    background = tuple(cal.background_paces(s.get("corun")) for s in solos)
    return {"solo_ms": tuple(s.get(key) for s in solos), "corun_ms": corun if any(corun) else (),
            "solo_ffn_item_ms": item_ms(s.get("ffn") for s in solos),
            "corun_ffn_item_ms": item_ms((s.get("corun") or {}).get("ffn") for s in solos),
            "spin_ffn_item_ms": {name: item_ms((s.get(name) or {}).get("ffn") for s in solos)
                                 for name in sorted({k for s in solos for k in s if k.startswith("spin")})},
            "solo_spread": spreads if any(x is not None for x in spreads) else (),
            "corun_background": background if any(b is not None for b in background) else None}


def runs_from_decode_report(report: dict, name: str) -> list:
    """One MeasuredRun per placement of a ``bench_decode.json`` (cuda, one GPU under MPS):
    its workloads as decode cases; solo = each replica's solo TPOT p50 (the fit input), the
    co-run solo TPOT p50 where measured (the contention term's fit input), the FFN's busy ms
    per item in each solo window where measured (the expert GEMM time's fit input),
    measured = TPOT p50 per replica, total tokens/s and FFN busy per schedule, the
    async/lockstep ratio and bench_decode's ideal (Σ solo tokens/s / lockstep tokens/s). Where
    the schedules ran on different FFN serving paths (``served_by``: bench_decode's default,
    the graph FFN for async and the solo rounds, the loop for lockstep), only the async rows
    are kept: the costs fitted to the solo steps are the graph's."""
    num_attn, num_ffn = cal.bench_topology(report)
    out = []
    for placed in report.get("placements", []):
        label = placed["label"]
        m = placed["model"]
        head_dim = m["hidden"] // m["heads"]
        attn_params = float((m["heads"] + 2 * m["kv_heads"]) * head_dim * m["hidden"] + m["hidden"] ** 2)
        rows = [r for r in report.get("results", []) if r["placement"] == label]
        cases = []
        for w in placed["workloads"]:
            by = {r["schedule"]: r for r in rows if r["workload"] == w["name"]}
            if "async" not in by:
                continue
            cmp_ = report.get("comparison", {}).get(f"{label} / {w['name']}", {})
            path = {s: tuple((r.get("ffn") or {}).get("served_by") or ["loop"]) for s, r in by.items()}
            if len(set(path.values())) > 1:
                # the solo steps (the fit) ran on the async row's serving path (the graph FFN
                # serves async and solo, the loop lockstep): predict only what ran on it
                by = {"async": by["async"]}
                cmp_ = {}
            cases.append(Case(w["name"], tuple(zip(w["contexts"], w["batches"])),
                              **_solo_fields(by["async"]["replicas"], "tpot_p50_ms", ("tpot_p50_ms", "tpot_p99_ms")),
                              batch_ms={s: tuple(rep["tpot_p50_ms"] for rep in r["replicas"]) for s, r in by.items()},
                              tokens_per_s={s: r["tokens_per_s"] for s, r in by.items()},
                              ffn_busy={s: r["ffn"]["busy_fraction"] for s, r in by.items()},
                              **_item_fields(by, "steps"),
                              ratio=cmp_.get("ratio"), ideal=cmp_.get("ideal"), kind="decode",
                              output_len=int(report["output_len"])))
        places = cal.report_placements({"mps": {"placement": placed.get("placement", "")}}, num_attn, num_ffn)
        placement = ",".join(f"{p.gpu}:{round(p.share * 100)}" for p in places)
        served = sorted({p for r in rows if r["schedule"] == "async" for p in (r.get("ffn") or {}).get("served_by") or ["loop"]})
        out.append(MeasuredRun(f"{name} {label}", f"bench_decode {report.get('run', {}).get('commit')} "
                               f"{report.get('backend')}, async served by {'/'.join(served)}",
                               cal.bench_shape(report, m), placement, num_attn,
                               tuple(cases), attn_params=attn_params,
                               kv_bytes_per_token=2.0 * m["kv_heads"] * head_dim * 2))
    return out
