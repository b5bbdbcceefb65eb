#!/usr/bin/env python3
"""Capacity planner for AFD serving (afd_cupy.capacity; no GPU needed; docs/design/planner.md).

Three modes; each prints tables and writes ``plan_afd.json`` into ``--out``:

- ``--example deepseek-v3`` (default): the worked example. DeepSeek-V3 (61 layers, hidden 7168,
  256 experts top-8 + 1 shared, intermediate 2048, fp8 weights and rows) decoding on H200s:
  8 GPUs (one node, NVLink), 16 (two nodes, RDMA between them) and 64 (eight nodes). Every
  Attention replica runs a decode batch of ``--batch`` requests at ``--context`` tokens of
  KV cache (``--skew``: per-replica context multipliers, cycled); the search tries every F
  (powers of two, multiples of 8, the fewest that hold the experts) with A = GPUs - F, under
  async, async_merge (a what-if) and lockstep, and picks the most tokens/s per GPU whose
  worst time per output token p99 <= ``--sla-ms``. ``--example tiny``: the same at a toy size.
- ``--validate``: predicted vs measured (afd_cupy.capacity.validate): the shipped GPU runs
  (afd_cupy/capacity/data/), the ones quoted in
  docs/benchmarks.md of ca1687d (git history) and issue #36, and each ``--bench-afd JSON`` (a plain run's
  ``bench_afd.json`` or a ``--sweep``'s ``bench_afd_sweep.json``, one run per split; host-backend
  runs need ``--cores``: busy-polling processes share that many CPU cores).
- ``--simulate``: one deployment: ``--placement`` (``GPU:share%`` per rank, Attention first,
  ``node/GPU`` for several nodes), ``--attn``, ``--prefill`` lengths or ``--decode B:CTX`` per
  replica (comma separated), ``--schedule``.

Costs: the H200 defaults (afd_cupy.capacity.costs.h200_costs), ``--costs-from
bench_transport.json`` replaces the transport's fixed costs by measured ones.

    python3 tools/plan_afd.py --out OUT
    python3 tools/plan_afd.py --validate --bench-afd OUT/bench_afd.json --cores 2 --out OUT
    python3 tools/plan_afd.py --simulate --placement 0:30,0:30,0:40 --attn 2 --prefill 4096,256
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402
from afd_cupy.capacity import (  # noqa: E402
    Deployment, ModelShape, ReplicaLoad, SimConfig, h200_costs, parse_placements, simulate,
)
from afd_cupy.capacity import calibrate as cal  # noqa: E402
from afd_cupy.capacity import item_cost, measured, validate  # noqa: E402
from afd_cupy.capacity.contention import Contention  # noqa: E402
from afd_cupy.capacity.search import Target, search  # noqa: E402
from afd_cupy.capacity.spec import FFN_PICKS  # noqa: E402

DEEPSEEK_V3 = ModelShape(layers=61, hidden=7168, experts=256, top_k=8, intermediate=2048, shared_experts=1,
                         dtype_bytes=1)
#: MLA: q_a 7168x1536, q_b 1536x(128x192), kv_a 7168x576, kv_b 512x(128x256), o (128x128)x7168
MLA_PARAMS = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
MLA_KV_BYTES = 576 * 2  # the latent KV cache per token and layer, bf16
MLA_PAIR_FLOPS = 4 * 128 * 160  # prefill QK^T + PV per (query, key), 128 heads
EXAMPLES = {  # name -> (shape, cost kwargs, [(label, GPUs)])
    "deepseek-v3": (DEEPSEEK_V3, dict(attn_params=MLA_PARAMS, kv_bytes_per_token=MLA_KV_BYTES,
                                      pair_flops=MLA_PAIR_FLOPS),
                    [("8 H200, one node (NVLink)", 8), ("16 H200, two nodes (RDMA)", 16),
                     ("64 H200, eight nodes (RDMA)", 64)]),
    "tiny": (ModelShape(layers=4, hidden=256, experts=16, top_k=2, intermediate=128, shared_experts=1),
             {}, [("4 GPUs", 4)]),
}
SCHEDULES = ("async", "async_merge", "lockstep")


def base_costs(args, shape: ModelShape, cost_kw: dict):
    costs = h200_costs(shape, **cost_kw)
    if args.costs_from:
        costs, _ = cal.transport_costs(args.costs_from, costs)
    overrides = {name: getattr(args, name.replace("_s", "_us")) * 1e-6 for name in ("ffn_item_s", "attn_fixed_s")
                 if getattr(args, name.replace("_s", "_us")) is not None}
    return costs.replace(**overrides) if overrides else costs


def run_example(args) -> dict:
    shape, cost_kw, cases = EXAMPLES[args.example]
    costs = base_costs(args, shape, cost_kw)
    load = ReplicaLoad("decode", batch_size=args.batch, context_len=args.context, output_len=args.output_len)
    target = Target(step_p99_sla_s=args.sla_ms * 1e-3)
    out = []
    for label, gpus in cases:
        if args.gpus and gpus not in args.gpus:
            continue
        started = time.perf_counter()
        rows, best = search(shape, costs, load, gpus, target=target, schedules=SCHEDULES,
                            wire_mode=args.wire_mode, skew=tuple(args.skew), steps=args.steps)
        print(f"\n== {label}: decode batch {args.batch} x {args.context} tokens of context, skew {args.skew}, "
              f"TPOT p99 SLA {args.sla_ms} ms, min F {target.min_ffn(shape)} "
              f"({time.perf_counter() - started:.1f} s)")
        print(bc.format_table(("A", "F", "schedule", "tok/s", "tok/s/GPU", "TPOT p50 ms", "TPOT p99 ms",
                               "FFN busy", "SLA"),
                              [(r.num_attn, r.num_ffn, r.schedule, r.tokens_per_s, r.tokens_per_s_per_gpu,
                                r.step_p50_s * 1e3, r.step_p99_s * 1e3, r.ffn_busy, "ok" if r.meets_sla else "miss")
                               for r in rows]))
        print("best: " + (f"{best.num_attn}A:{best.num_ffn}F {best.schedule}, {best.tokens_per_s_per_gpu:.0f} "
                          f"tok/s/GPU, TPOT p99 {best.step_p99_s * 1e3:.1f} ms" if best else "none meets the SLA"))
        out.append({"label": label, "num_gpus": gpus, "rows": [dataclasses.asdict(r) for r in rows],
                    "best": dataclasses.asdict(best) if best else None})
    return {"mode": "example", "example": args.example, "model": dataclasses.asdict(shape),
            "costs": dataclasses.asdict(costs), "load": dataclasses.asdict(load), "skew": args.skew,
            "sla_ms": args.sla_ms, "cases": out}


def quantity_group(quantity: str) -> str:
    """The kind of a validation row: step time (batch ms, TPOT), tokens/s, FFN busy or ratio
    (async / lockstep, ideal, fraction): the target speaks of the first two."""
    if "tokens/s" in quantity:
        return "tokens/s"
    if "batch ms" in quantity or "TPOT" in quantity:
        return "step time"
    return "FFN busy" if "busy" in quantity else "ratio"


#: the planner's target: predicted step time and tokens/s within 15 % of the measured ones
TARGET = 0.15


def cells_within(rows: list, target: float = TARGET) -> dict:
    """{kind of run: (cells within ``target``, cells)} over the step-time and tokens/s rows
    that are no fit input; kinds: the shipped decode runs, the shipped prefill runs, the
    quoted runs and other (the runs given on the command line)."""
    out: dict = {}
    for r in rows:
        if "fit input" in r["quantity"] or quantity_group(r["quantity"]) not in ("step time", "tokens/s") \
                or not math.isfinite(r["error"]):
            continue
        if any(r["run"] == g.name for g in measured.QUOTED_RUNS):
            kind = "gpu, quoted"
        elif any(r["run"] == g.name for g in measured.GPU_RUNS):
            kind = "gpu, shipped JSON, " + ("decode" if "decode" in r["run"] else "prefill")
        else:
            kind = "other"
        inside, total = out.get(kind, (0, 0))
        out[kind] = (inside + (abs(r["error"]) <= target), total + 1)
    return out


def contention_arg(args) -> Contention | None:
    """The one-GPU contention terms the command line imposes (None: validate fits them)."""
    if args.hbm_contention is None and args.ffn_contention is None and args.attn_gemm_contention is None:
        return None
    attention = args.hbm_contention or 0.0
    return Contention(attention, attention if args.ffn_contention is None else args.ffn_contention,
                      args.attn_gemm_contention)


def run_validate(args) -> dict:
    runs = [(run, None) for run in measured.GPU_RUNS]
    for i, path in enumerate(args.bench_afd or []):
        report = cal.read_json(path, "bench_afd")
        label = f"{report.get('backend')} run {i} ({report.get('run', {}).get('commit')})"
        found = (validate.runs_from_sweep(report, label, cores=args.cores) if report.get("mode") == "sweep"
                 else [validate.run_from_report(report, label, cores=args.cores)])
        runs += [(run, base_costs(args, run.shape, {})) for run in found]  # --costs-from: that backend's
    for i, path in enumerate(args.bench_decode or []):
        report = cal.read_json(path, "bench_decode")
        runs += [(run, None) for run in validate.runs_from_decode_report(
            report, f"{report.get('backend')} decode {i} ({report.get('run', {}).get('commit')})")]
    out, all_rows = [], []
    config = dataclasses.replace(cal.SIM_FOR_BENCH, ffn_pick=args.ffn_pick, merge_copies=not args.no_merge_copies)
    for run, costs, rows in validate.validate_runs(runs, contention_arg(args), args.noise_cv, config):
        all_rows += rows
        kappa = {k: rows[0][k] if rows else None
                 for k in ("hbm_contention", "ffn_contention", "attn_gemm_contention", "noise_cv")}
        out.append({"run": run.name, "source": run.source, "placement": run.placement,
                    "costs": dataclasses.asdict(costs), **kappa, "rows": rows})
    print(bc.format_table(("run", "workload", "quantity", "predicted", "measured", "error %"),
                          [(r["run"], r["workload"], r["quantity"], r["predicted"], r["measured"],
                            r["error"] * 100) for r in all_rows]))
    worst = {}
    for r in all_rows:
        if "fit input" in r["quantity"] or not math.isfinite(r["error"]):
            continue
        runs_of = ("gpu, quoted" if any(r["run"] == g.name for g in measured.QUOTED_RUNS)
                   else "gpu, shipped JSON" if any(r["run"] == g.name for g in measured.GPU_RUNS) else "other")
        key = f"{runs_of}, {quantity_group(r['quantity'])}"
        if key not in worst or abs(r["error"]) > abs(worst[key]["error"]):
            worst[key] = r
    for key, r in sorted(worst.items()):
        print(f"worst {key} error: {r['error'] * 100:+.1f} % ({r['run']}, {r['workload']}, {r['quantity']})")
    within = cells_within(all_rows)
    for key, (inside, total) in sorted(within.items()):
        print(f"{key}: {inside} of {total} step-time and tokens/s cells within {TARGET:.0%}")
    costs = item_cost.item_costs(run for run, _ in runs)
    if costs:  # measured only: what an async item costs the FFN against its solo-type rounds
        print("\nFFN busy ms per item, async phase against the solo / co-run rounds' values mixed in "
              "the async items' proportions (measured, not predicted):")
        print(bc.format_table(("run", "workload", "async", "solo mix", "co-run mix", "x solo", "x co-run", "x spin"),
                              [(c.run, c.workload, c.async_ms, c.solo_mix_ms, c.corun_mix_ms, c.over_solo,
                                c.over_corun, " ".join(f"{k} {v:.3g}" for k, v in c.over_spin.items()) or "-")
                               for c in costs]))
    print("not measured yet: " + "; ".join(measured.NOT_MEASURED))
    return {"mode": "validate", "runs": out, "worst": worst, "within": within,
            "item_costs": [{**dataclasses.asdict(c), "over_solo": c.over_solo, "over_corun": c.over_corun,
                            "over_spin": c.over_spin}
                           for c in costs],
            "not_measured": list(measured.NOT_MEASURED)}


def run_simulate(args) -> dict:
    places = parse_placements(args.placement)
    kappa = contention_arg(args) or Contention()
    dep = Deployment(places[:args.attn], places[args.attn:], hbm_contention=kappa.attention,
                     ffn_contention=kappa.ffn, attn_gemm_contention=kappa.attention_beside_ffn,
                     mps_caps=args.mps_caps)
    if args.decode:
        loads = tuple(ReplicaLoad("decode", batch_size=int(b), context_len=int(c), output_len=args.output_len)
                      for b, c in (item.split(":") for item in args.decode.split(",")))
    else:
        loads = tuple(ReplicaLoad("prefill", (int(n),)) for n in args.prefill.split(","))
    shape = ModelShape(layers=args.layers, hidden=args.hidden, experts=args.experts, top_k=args.top_k,
                       intermediate=args.intermediate, shared_experts=args.shared)
    cost_kw = {k: v for k, v in (("attn_params", args.attn_params), ("kv_bytes_per_token", args.kv_bytes))
               if v is not None}
    costs = base_costs(args, shape, cost_kw)
    if args.costs_run:  # a measured GPU run's fitted host and GEMM costs on this shape
        runs = {run.name.split()[0]: run for run in measured.QUOTED_RUNS}
        if args.costs_run not in runs:
            raise SystemExit(f"--costs-run must be one of {sorted(runs)}, got {args.costs_run!r}")
        fitted = validate.calibrated_costs(runs[args.costs_run])
        costs = costs.replace(ffn_item_s=fitted.ffn_item_s, gemm_tflops=fitted.gemm_tflops,
                              weight_read_gbps=fitted.weight_read_gbps,
                              source=f"{costs.source}; FFN host and GEMM fitted on {args.costs_run}")
    results = []
    for schedule in args.schedule:
        res = simulate(shape, dep, loads, costs, SimConfig(schedule, args.wire_mode, 2, args.steps))
        results.append(res.to_dict())
        print(f"\n{schedule}: {res.tokens_per_s:.4g} tok/s, FFN busy {res.ffn_busy:.3f}")
        print(bc.format_table(("replica", "tok/s", "step mean ms", "p50 ms", "p99 ms"),
                              [(r.idx, r.tokens_per_s, r.step_mean_s * 1e3, r.step_p50_s * 1e3, r.step_p99_s * 1e3)
                               for r in res.replicas]))
    return {"mode": "simulate", "model": dataclasses.asdict(shape), "costs": dataclasses.asdict(costs),
            "placement": args.placement, "results": results}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--example", choices=sorted(EXAMPLES), default="deepseek-v3")
    mode.add_argument("--validate", action="store_true")
    mode.add_argument("--simulate", action="store_true")
    p.add_argument("--out", type=Path, default=Path("plan_out"))
    p.add_argument("--gpus", type=int, nargs="+", help="example: only these GPU counts")
    p.add_argument("--batch", type=int, default=128, help="decode requests per replica")
    p.add_argument("--context", type=int, default=4096, help="decode context tokens per request")
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--skew", type=int, nargs="+", default=[1, 4], help="per-replica context multipliers")
    p.add_argument("--sla-ms", type=float, default=100.0, help="time per output token p99")
    p.add_argument("--steps", type=int, default=6, help="measured steps per replica")
    p.add_argument("--wire-mode", choices=("pair", "dedup"), default="pair")
    p.add_argument("--costs-from", help="a bench_transport.json for the transport's fixed costs")
    p.add_argument("--ffn-item-us", type=float, default=None,
                   help="FFN host cost per item (default 65 us, the eager FFNWorker; a CUDA-graph FFN: ~10)")
    p.add_argument("--attn-fixed-us", type=float, default=None, help="Attention fixed cost per layer (default 100 us)")
    p.add_argument("--bench-afd", nargs="+", help="validate: bench_afd.json files")
    p.add_argument("--bench-decode", nargs="+", help="validate: bench_decode.json files (cuda)")
    p.add_argument("--cores", type=int, default=None, help="validate: CPU cores of host-backend runs")
    p.add_argument("--placement", default="0:30,0:30,0:40")
    p.add_argument("--mps-caps", action="store_true",
                   help="simulate: the shares are MPS caps that may sum past 1 on a GPU, as the benchmarks' "
                        "0:50,0:50,0:100 (Deployment.mps_caps); default: partitions")
    p.add_argument("--attn", type=int, default=2)
    p.add_argument("--prefill", default="4096,256", help="simulate: one request length per replica")
    p.add_argument("--decode", default=None, help="simulate: B:CTX per replica, e.g. 64:1024,64:16384")
    p.add_argument("--schedule", nargs="+", default=["async", "lockstep"])
    p.add_argument("--hbm-contention", type=float, default=None,
                   help="the one-GPU contention term κ of every phase (Deployment.hbm_contention); validate: "
                        "default fitted to each run's co-run solo rounds, what they do not measure from the run "
                        "its contention_from names or bench_corun (docs/design/planner.md); simulate: 0")
    p.add_argument("--noise-cv", type=float, default=None,
                   help="validate: the multi-replica runs' service-time noise (SimConfig.noise_cv); default "
                        "fitted to each run's solo step spread where it has one, else 0")
    p.add_argument("--ffn-pick", choices=FFN_PICKS, default="rotate",
                   help="validate: the order an FFN rank takes waiting arrivals (SimConfig.ffn_pick; default "
                        "rotate, the library's round robin over Attention ranks; fifo: by arrival)")
    p.add_argument("--no-merge-copies", action="store_true",
                   help="validate: leave out the device copies that merge a lockstep batch (SimConfig.merge_copies)")
    p.add_argument("--ffn-contention", type=float, default=None,
                   help="the FFN expert GEMMs' own κ (Deployment.ffn_contention; default: --hbm-contention's)")
    p.add_argument("--attn-gemm-contention", type=float, default=None,
                   help="the attention's κ beside the FFN's expert GEMMs (Deployment.attn_gemm_contention; "
                        "default: fitted where a co-run round recorded the background pace, else --hbm-contention's)")
    p.add_argument("--costs-run", default=None, help="simulate: FFN host + GEMM costs fitted on a measured GPU "
                                                    "run (measured.GPU_RUNS, e.g. ca1687d)")
    p.add_argument("--attn-params", type=float, default=None, help="simulate: attention parameters per layer")
    p.add_argument("--kv-bytes", type=float, default=None, help="simulate: KV-cache bytes per token and layer")
    for name, default in (("layers", 4), ("hidden", 2048), ("experts", 64), ("top-k", 6),
                          ("intermediate", 1408), ("shared", 2)):
        p.add_argument(f"--{name}", type=int, default=default, help="simulate: model shape")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    report = run_validate(args) if args.validate else run_simulate(args) if args.simulate else run_example(args)
    report = {"tool": "plan_afd", "commit": bc.commit(), **report, "wall_s": time.perf_counter() - started}
    path = bc.write_json(args.out, "plan_afd.json", report)
    print(f"\nwrote {path} in {report['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
