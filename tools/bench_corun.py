#!/usr/bin/env python3
"""Co-run slowdown on one GPU: what processes sharing a GPU under MPS shares cost each other.

bench_decode's solo baseline runs a replica with the other replicas idle; under async the
others run at the same time, and on one GPU their kernels compete for SMs and HBM (every share
is a cap, and three ranks at 50 % ask for 150 % of the SMs). This tool measures that cost
without the AFD transport, so the planner's contention term and bench_decode's gap to the ideal
can be checked against it.

Each rank of a case is a process (``--share`` % of GPU 0's SMs under MPS; start MPS first)
running one workload in a loop, one iteration = one decode layer's worth of it:

- ``attn:CTX``: bench_decode's decode attention of one layer (``decode_model.DecodeReplica``:
  QKV, the new K/V written, SDPA over a KV cache of ``CTX`` tokens per request, O projection,
  router) for ``--batch`` requests;
- ``experts``: one FFN item of that batch: the routed experts' grouped GEMMs over
  ``--batch x top-k`` rows (seeded routing over every expert) and the shared experts, as
  ``FFNWorker`` computes them (``moe.grouped_mlp``, ``moe.shared_mlp``).

Phases per case (one launch): warm-up; **alone**, every rank in turn for ``--alone-duration``
s (at least ``--min-iters`` iterations) while the others wait at a store barrier; **together**,
every rank at once for ``--duration`` s. An iteration is timed from its first enqueue to the
synchronize after it (host ``perf_counter_ns``; cuda work is synchronized every iteration, as a
decode step is); together counts only the iterations inside the window every rank was running.
Per rank: mean and p50 ms alone and together, slowdown = together mean / alone mean.

Cases (``--cases``, each a comma-separated list of workloads, one rank each): by default on
cuda the ranks of bench_decode's ``ffn-free`` 16x-skew row without the transport
(``attn:32768,attn:2048,experts``), each attention with the experts, and the two attentions.

    python3 tools/bench_corun.py --quick --out OUT            # one H200, MPS started
    python3 tools/bench_corun.py --quick --backend host --out OUT

Writes ``bench_corun.json``. Not timed tests: a benchmark.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402
import decode_model as dm  # noqa: E402
from afd_cupy.config import ModelConfig  # noqa: E402
from afd_cupy.runtime.launch import launch  # noqa: E402
from afd_cupy.runtime.placement import Placement  # noqa: E402

CUDA_CASES = ("attn:32768,attn:2048,experts", "attn:32768,experts", "attn:2048,experts", "attn:32768,attn:2048")
HOST_CASES = ("attn:256,attn:16,experts",)
WARMUP_ITERS = 3
HOST_LABEL = ("HOST BACKEND at a toy size: CPU processes sharing this machine's cores, not a GPU; "
              "checks the tool, measures nothing about GPUs")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One case: a workload per rank, and how long each phase runs (picklable)."""

    backend: str
    dims: dm.DecodeDims
    workloads: tuple  # per rank: "attn:CTX" or "experts"
    batch: int
    share: int | None
    alone_s: float
    together_s: float
    min_iters: int
    peer_timeout_s: float = 120.0
    seed: int = 0

    def model(self) -> ModelConfig:
        return self.dims.model_config(self.batch)


def parse_workload(text: str) -> tuple[str, int]:
    """``"attn:CTX"`` -> ("attn", CTX), ``"experts"`` -> ("experts", 0); ValueError otherwise."""
    kind, _, arg = text.partition(":")
    if kind == "experts" and not arg:
        return kind, 0
    if kind == "attn" and arg.isdigit() and int(arg) > 0:
        return kind, int(arg)
    raise ValueError(f"workload {text!r}: expected attn:CTX (CTX > 0 tokens) or experts")


# --------------------------------------------------------------------------- one rank

def _iteration(spec: Spec, workload: str, device):
    """A zero-argument callable running one iteration of ``workload`` on ``device``."""
    import torch

    from afd_cupy import moe

    kind, ctx = parse_workload(workload)
    dims = spec.dims
    if kind == "attn":
        replica = dm.DecodeReplica(dims, device, seed=spec.seed)
        replica.allocate(spec.batch, -(-(ctx + 1) // 16) * 16)
        x, positions, mask = replica.step_inputs(np.full(spec.batch, ctx, np.int64))
        return lambda: replica.router_input(0, replica.attention(0, x, positions, mask))
    experts, shared = dm.ffn_weights(dims, 0, dims.experts, spec.seed, device)
    routed, fused = experts[0], (shared[0] if shared else None)
    gen = np.random.default_rng(spec.seed)
    ids = np.stack([gen.choice(dims.experts, dims.top_k, replace=False) for _ in range(spec.batch)])
    counts = np.bincount(ids.ravel(), minlength=dims.experts).tolist()
    rows = torch.randn((sum(counts), dims.hidden), device=device).to(torch.bfloat16)
    counts_dev = torch.tensor(counts, dtype=torch.int32, device=device)
    shared_rows = torch.randn((spec.batch, dims.hidden), device=device).to(torch.bfloat16)

    def run():
        moe.grouped_mlp(rows, counts_dev, routed, group_counts_host=counts)
        if fused is not None:
            moe.shared_mlp(shared_rows, fused)
    return run


def _timed(run, sync, *, until_ns: int, min_iters: int) -> list:
    """[(start ns, end ns)] of iterations until ``until_ns`` and at least ``min_iters``."""
    out = []
    while len(out) < min_iters or time.perf_counter_ns() < until_ns:
        begin = time.perf_counter_ns()
        run()
        sync()
        out.append((begin, time.perf_counter_ns()))
    return out


def _rank(ctx, spec: Spec) -> dict:
    import torch

    from afd_cupy.runtime.store import store_barrier

    device = bc.set_device(spec.backend, ctx)
    if spec.backend == "cuda":
        bc.require_correct_gemms(spec.model(), device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    workload = spec.workloads[ctx.rank]
    run = _iteration(spec, workload, device)
    for _ in range(WARMUP_ITERS):
        run()
    sync()
    store, world = ctx.store(), len(spec.workloads)

    def barrier(name):
        store_barrier(store, f"bench_corun/{name}", world, spec.peer_timeout_s)

    alone = None
    for turn in range(world):
        barrier("alone")
        if turn == ctx.rank:
            alone = _timed(run, sync, until_ns=time.perf_counter_ns() + int(spec.alone_s * 1e9),
                           min_iters=spec.min_iters)
    barrier("together")
    together = _timed(run, sync, until_ns=time.perf_counter_ns() + int(spec.together_s * 1e9),
                      min_iters=spec.min_iters)
    barrier("done")
    return {"rank": ctx.rank, "workload": workload, "device": bc.device_name(device),
            "alone": alone, "together": together}


# --------------------------------------------------------------------------- rows

def durations_ms(spans: list, window: tuple | None = None) -> np.ndarray:
    """Iteration times in ms of ``(start ns, end ns)`` spans (only those inside ``window``)."""
    kept = [(b, e) for b, e in spans if window is None or (b >= window[0] and e <= window[1])]
    return np.array([(e - b) / 1e6 for b, e in kept], dtype=np.float64)


def case_rows(results: list) -> list:
    """Per rank of one case: alone / together mean and p50 ms, iterations, slowdown. Together
    keeps the iterations inside the window every rank was running (first start to last end of
    each rank's together spans: the latest start, the earliest end)."""
    window = (max(r["together"][0][0] for r in results), min(r["together"][-1][1] for r in results))
    rows = []
    for r in sorted(results, key=lambda r: r["rank"]):
        alone, together = durations_ms(r["alone"]), durations_ms(r["together"], window)
        row = {"rank": r["rank"], "workload": r["workload"], "alone_iters": len(alone),
               "together_iters": len(together), "alone_mean_ms": float(alone.mean()),
               "alone_p50_ms": float(np.median(alone)), "together_mean_ms": float("nan"),
               "together_p50_ms": float("nan"), "slowdown": float("nan")}
        if len(together):
            row.update(together_mean_ms=float(together.mean()), together_p50_ms=float(np.median(together)),
                       slowdown=float(together.mean() / alone.mean()))
        rows.append(row)
    return rows


def run_case(spec: Spec, timeout_s: float) -> list:
    world = len(spec.workloads)
    on_gpu = spec.backend == "cuda"
    placement = [Placement(gpu=0, sm_percent=spec.share)] * world if on_gpu else None
    return launch(_rank, world, args=(spec,), timeout_s=timeout_s, num_gpus=None if on_gpu else 0,
                  placement=placement)


def defaults(args, backend: str):
    """The model and the cases: bench_decode's quick model on cuda, a toy one on the host."""
    if backend == "cuda":
        dims = dm.DecodeDims(layers=1, hidden=2048, heads=16, kv_heads=4, experts=16, top_k=6, shared=2,
                             intermediate=1408)
        cases = args.cases or list(CUDA_CASES)
    else:
        dims = dm.DecodeDims(layers=1, hidden=64, heads=4, kv_heads=2, experts=4, top_k=2, shared=1,
                             intermediate=32)
        cases = args.cases or list(HOST_CASES)
    for case in cases:
        for text in case.split(","):
            try:
                parse_workload(text)
            except ValueError as exc:
                raise SystemExit(f"--cases {case!r}: {exc}") from None
    return dims, cases


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(parser, quick_help="1 s phases")
    parser.add_argument("--cases", nargs="+", default=None,
                        help="each a comma-separated workload per rank: attn:CTX or experts")
    parser.add_argument("--batch", type=int, default=None, help="requests per attention iteration (cuda 64)")
    parser.add_argument("--share", type=int, default=bc.MIN_MPS_SHARE_PCT,
                        help="MPS SM share of every rank in percent (cuda; torch's GEMMs are wrong below 50 on one H200)")
    parser.add_argument("--duration", type=float, default=None, help="together phase, seconds (quick 1, else 3)")
    parser.add_argument("--alone-duration", type=float, default=None, help="alone phase per rank (quick 0.5, else 1.5)")
    parser.add_argument("--min-iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=240.0, help="per case, seconds")
    args = parser.parse_args(argv)
    if args.batch is not None and args.batch < 1 or args.min_iters < 1 or not 1 <= args.share <= 100:
        parser.error("need --batch >= 1, --min-iters >= 1 and --share in [1, 100]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = args.backend or bc.detect_backend()
    dims, cases = defaults(args, backend)
    batch = args.batch or (64 if backend == "cuda" else 4)
    together_s = args.duration or (1.0 if args.quick else 3.0)
    alone_s = args.alone_duration or (0.5 if args.quick else 1.5)
    started = time.perf_counter()
    report = {"tool": "bench_corun", "backend": backend, "label": HOST_LABEL if backend == "host" else "",
              "run": bc.run_info(backend), "model": dataclasses.asdict(dims),
              "batch": batch, "share_pct": args.share if backend == "cuda" else None,
              "together_s": together_s, "alone_s": alone_s, "cases": [],
              "method": {"iteration": "first enqueue to the synchronize after it (host perf_counter_ns)",
                         "together": "iterations inside the window every rank was running",
                         "slowdown": "together mean / alone mean"}}
    for case in bc.progress(cases, "bench_corun", str):
        spec = Spec(backend, dims, tuple(case.split(",")), batch, args.share if backend == "cuda" else None,
                    alone_s, together_s, args.min_iters)
        results = run_case(spec, args.timeout)
        report["device"] = results[0]["device"]
        report["cases"].append({"case": case, "rows": case_rows(results)})
    report["wall_s"] = time.perf_counter() - started
    path = bc.write_json(args.out, "bench_corun.json", report)
    share = f"MPS share {args.share} % each" if backend == "cuda" else "no MPS"
    print(f"\n==== bench_corun summary: backend={backend} commit={report['run']['commit']} "
          f"device={report.get('device')}, {share}, batch {batch} ====")
    if report["label"]:
        print(report["label"])
    print(bc.format_table(("case", "rank", "workload", "alone mean ms", "alone p50 ms", "together mean ms",
                           "together p50 ms", "slowdown", "iters alone / together"),
                          [(c["case"], r["rank"], r["workload"], r["alone_mean_ms"], r["alone_p50_ms"],
                            r["together_mean_ms"], r["together_p50_ms"], r["slowdown"],
                            f"{r['alone_iters']} / {r['together_iters']}") for c in report["cases"] for r in c["rows"]]))
    print(f"wrote {path} in {report['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
