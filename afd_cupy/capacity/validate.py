"""Predicted vs measured: calibrate a run's costs from its solo batches only, then predict
its multi-replica async and lockstep rows with the simulator.

A :class:`MeasuredRun` is one benchmark launch pair (async + lockstep) with one
:class:`Case` per workload; :func:`run_from_report` builds one from a ``bench_afd.json``,
:func:`runs_from_sweep` one per split of a sweep, :func:`runs_from_decode_report` one per
placement of a ``bench_decode.json`` (decode cases: TPOT p50 instead of batch time),
``afd_cupy.capacity.measured`` holds the GPU runs (the shipped JSON, and older ones quoted from
docs/benchmarks.md of ca1687d and the issues). :func:`validate` returns one row per compared
quantity with its relative error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from afd_cupy.capacity import calibrate as cal
from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.sim import simulate
from afd_cupy.capacity.spec import (LINK_PRESETS, Deployment, Link, ModelShape, ReplicaLoad,
                                    SimConfig, parse_placements)


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

    def deployment(self, only: int | None = None, hbm_contention: float = 0.0) -> Deployment:
        places = parse_placements(self.placement)
        attn = places[:self.num_attn] if only is None else (places[only],)
        return Deployment(attn, places[self.num_attn:], same_gpu=self.link, intra_node=self.intra_link,
                          hbm_contention=hbm_contention, mps_caps=True)

    @property
    def decode(self) -> bool:
        return any(c.kind == "decode" for c in self.cases)


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
            hbm_contention: float = 0.0) -> dict:
    """Simulated solo batch per replica, and per schedule batch ms per replica, tokens/s, FFN
    busy; plus ratio, ideal and fraction computed as bench_afd computes them."""
    loads = case.loads()
    config = _config(case, config)
    step_s = _step_s(case)
    solo_costs, run_costs = costs.scaled(run.slowdown[0]), costs.scaled(run.slowdown[1])
    solo = [step_s(simulate(run.shape, run.deployment(only=a), (loads[a],), solo_costs, config).replicas[0])
            for a in range(run.num_attn)]
    out = {"solo_ms": [s * 1e3 for s in solo]}
    for schedule in ("async", "lockstep"):
        res = simulate(run.shape, run.deployment(hbm_contention=hbm_contention), loads, run_costs,
                       SimConfig(schedule=schedule, warmup_steps=config.warmup_steps, steps=config.steps))
        out[schedule] = {"batch_ms": [step_s(r) * 1e3 for r in res.replicas],
                         "tokens_per_s": res.tokens_per_s, "ffn_busy": res.ffn_busy}
    tokens = case.tokens()
    ideal_num = sum(n / s for n, s in zip(tokens, out["solo_ms"]))
    lock = sum(n / b for n, b in zip(tokens, out["lockstep"]["batch_ms"]))
    out["ratio"] = out["async"]["tokens_per_s"] / out["lockstep"]["tokens_per_s"]
    out["ideal"] = ideal_num / lock
    out["fraction"] = out["ratio"] / out["ideal"]
    return out


def _step_s(case: Case):
    """The step statistic a case is measured by: prefill the mean batch, decode the TPOT p50."""
    return (lambda r: r.step_mean_s) if case.kind == "prefill" else (lambda r: r.step_p50_s)


def _config(case: Case, config: SimConfig) -> SimConfig:
    steps = config.steps if case.kind == "prefill" else max(config.steps, 2 * case.output_len)
    return SimConfig(warmup_steps=config.warmup_steps, steps=steps)


def predict_corun(run: MeasuredRun, costs: cm.Costs, case: Case, hbm_contention: float,
                  config: SimConfig = cal.SIM_FOR_BENCH) -> list:
    """Each replica's simulated co-run solo (ms): it sends to the FFN, the others run their
    attention only on the same GPU (bench_decode's second solo round)."""
    config = _config(case, config)
    step_s = _step_s(case)
    costs = costs.scaled(run.slowdown[1])
    return [step_s(simulate(run.shape, run.deployment(hbm_contention=hbm_contention), case.loads(only_ffn=a),
                            costs, config).replicas[a]) * 1e3 for a in range(run.num_attn)]


#: the contention terms :func:`fit_contention` tries before it refines around the best
CONTENTION_GRID = (0.0, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0, 2.0, 4.0)


def fit_contention(run: MeasuredRun, costs: cm.Costs, config: SimConfig = cal.SIM_FOR_BENCH) -> float | None:
    """The ``hbm_contention`` (Deployment) that best reproduces the run's co-run solo steps
    (least squares on relative errors: a coarse grid, then a golden-section search around the
    best point); None when no case measured them. Only solo-type rounds enter: the
    multi-replica rows stay out of the fit."""
    cases = [case for case in run.cases if any(case.corun_ms)]
    if not cases:
        return None

    def err(kappa: float) -> float:
        return sum(((pred - ms) / ms) ** 2 for case in cases
                   for pred, ms in zip(predict_corun(run, costs, case, kappa, config), case.corun_ms) if ms)

    scored = [(err(k), k) for k in CONTENTION_GRID]
    best = min(range(len(scored)), key=lambda i: scored[i][0])
    lo = CONTENTION_GRID[max(0, best - 1)]
    hi = CONTENTION_GRID[min(len(CONTENTION_GRID) - 1, best + 1)]
    golden = (5 ** 0.5 - 1) / 2
    x1, x2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
    f1, f2 = err(x1), err(x2)
    for _ in range(9):  # the bracket shrinks to 0.618^9 ~ 1.3 % of its width
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - golden * (hi - lo)
            f1 = err(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + golden * (hi - lo)
            f2 = err(x2)
    return min([scored[best], (f1, x1), (f2, x2)])[1]


def _row(run, case, quantity, predicted, measured) -> dict:
    err = (predicted - measured) / measured if measured else float("nan")
    return {"run": run.name, "workload": case.workload, "quantity": quantity, "predicted": predicted,
            "measured": measured, "error": err}


def validate(run: MeasuredRun, base: cm.Costs | None = None,
             hbm_contention: float | None = None) -> tuple[cm.Costs, list]:
    """(the calibrated costs, one row per measured quantity: predicted, measured, error; each
    row also names the ``hbm_contention`` it was predicted with).

    ``hbm_contention``: the one-GPU contention term of the multi-replica runs (Deployment).
    None: fitted to the run's co-run solo steps (:func:`fit_contention`) where it measured
    them, else 0. It does not touch the solo fit (a replica alone overlaps nothing)."""
    costs = calibrated_costs(run, base)
    if hbm_contention is None:
        hbm_contention = fit_contention(run, costs) or 0.0
    rows = []
    for case in run.cases:
        pred = predict(run, costs, case, hbm_contention=hbm_contention)
        what = "TPOT p50 ms" if case.kind == "decode" else "batch ms"
        for a, ms in enumerate(case.solo_ms):
            if ms:
                rows.append(_row(run, case, f"solo {what}, replica {a} (fit input)", pred["solo_ms"][a], ms))
        if any(case.corun_ms):
            corun = predict_corun(run, costs, case, hbm_contention)
            rows += [_row(run, case, f"co-run solo {what}, replica {a} (fit input)", corun[a], ms)
                     for a, ms in enumerate(case.corun_ms) if ms]
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
        row["hbm_contention"] = hbm_contention
    return costs, rows


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
                          **_solo_fields(by["async"]["replicas"], "batch_mean_ms"),
                          batch_ms={s: tuple(rep["batch_mean_ms"] for rep in r["replicas"]) for s, r in by.items()},
                          tokens_per_s={s: r["tokens_per_s"] for s, r in by.items()},
                          ffn_busy={s: r["ffn"]["busy_fraction"] for s, r in by.items()},
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


def _solo_fields(replicas: list, key: str) -> dict:
    """The solo inputs of a report's async replicas (``key``: the step time, ``batch_mean_ms``
    or ``tpot_p50_ms``): Case's solo_ms and, where measured, corun_ms and solo_ffn_item_ms."""
    solos = [rep.get("solo") or {} for rep in replicas]
    corun = tuple((s.get("corun") or {}).get(key) for s in solos)
    busy = [cal.busy_per_item_s(s.get("ffn")) for s in solos]
    item_ms = tuple(b * 1e3 if b else None for b in busy)
    return {"solo_ms": tuple(s.get(key) for s in solos), "corun_ms": corun if any(corun) else (),
            "solo_ffn_item_ms": item_ms if any(item_ms) else ()}


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
                              **_solo_fields(by["async"]["replicas"], "tpot_p50_ms"),
                              batch_ms={s: tuple(rep["tpot_p50_ms"] for rep in r["replicas"]) for s, r in by.items()},
                              tokens_per_s={s: r["tokens_per_s"] for s, r in by.items()},
                              ffn_busy={s: r["ffn"]["busy_fraction"] for s, r in by.items()},
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
