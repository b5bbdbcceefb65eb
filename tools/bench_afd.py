#!/usr/bin/env python3
"""End-to-end AFD benchmark: async vs lockstep FFN schedule on a synthetic DeepSeek-V2-Lite MoE.

Model (random weights, bf16): hidden 2048, 16 heads (head dim 128), 64 routed experts,
top-6 softmax gate, 2 shared experts, expert intermediate 1408, ``--layers`` layers (4 with
--quick, 26 otherwise). Per layer an Attention replica runs RMSNorm, the QKV projection, real
causal attention (``scaled_dot_product_attention(is_causal=True)`` once per request of its
variable-length prefill batch, so the cost grows with the square of the request length), the
O projection and the residual add; then RMSNorm, the router, ``conn.select_experts``,
``send_attn_output`` / ``recv_ffn_output(blocking=False)`` and the residual add. The batch
ends with one synchronization (``conn.check_errors()``). FFN ranks run ``FFNWorker`` with
their local experts (grouped GEMM) and the shared experts.

A Attention replicas and F FFN ranks are separate processes (``afd_cupy.launch``). One launch
per schedule:
- ``async``: ``FFNWorker(schedule="async")`` (serve every item as it arrives);
- ``lockstep``: ``FFNWorker(schedule="lockstep")`` and Attention connectors built with
  ``always_send=True``: a layer is served once every replica sent it, as one batch.
Inside a launch the workloads run one after the other (phases):
- ``uniform``: every replica's batch is ``--requests`` requests of ``--uniform-len`` tokens;
- ``skewed``: replica 0 gets ``--requests`` requests of ``--long-len`` tokens, every other
  replica ``--requests`` requests of ``--short-len`` tokens (same NUMBER of requests, very
  different lengths, so very different batch costs).
A phase: ``--warmup`` batches, a barrier of the Attention ranks, then each replica runs
batches of its own stream for ``--duration`` seconds of wall time. Under async each replica
stops at its own deadline; under lockstep every replica must run the same number of batches,
so replica 0 decides the stop (the batch after the one it starts past the deadline) and
publishes it through the store; every replica reads that flag once per batch under both
schedules (equal overhead).

Reported per (workload, schedule): tokens/s = Σ over replicas of tokens / own measured wall
time; per-replica median (and p90) batch latency; the async/lockstep ratio per workload with
the shared DESIGN.md §10 targets (>= 1.9x skewed, >= 0.97x uniform), reported, never asserted.

GPU placement: with at least A+F GPUs, one process per GPU. On fewer GPUs every process runs
on GPU 0 under CUDA MPS (start it first; tools/gpu_suite.sh does) with
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` per process: ``--mps-attn-pct`` for Attention ranks and
``--mps-ffn-pct`` for FFN ranks (default 100 // (A+F) each: 25% for 2A2F), set before the
process creates its CUDA context.

On the host backend it runs at a tiny size (hidden 64, 2 layers, short sequences; labelled).

    python3 tools/bench_afd.py --quick --out OUT        # GPU (< 4 min on one H200, MPS)
    python3 tools/bench_afd.py --quick --backend host
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.launch import launch, parse_placement  # noqa: E402
from afd_cupy.wire import window_size_hint  # noqa: E402

SCHEDULES = ("async", "lockstep")
HOST_LABEL = ("HOST BACKEND at a tiny size: measures the host protocol and CPU compute of a toy "
              "model (wall times), not GPU performance")
TARGETS = {"skewed": 1.9, "uniform": 0.97}


@dataclasses.dataclass(frozen=True)
class Dims:
    """The synthetic model's dimensions (DeepSeek-V2-Lite-shaped by default)."""

    layers: int = 26
    hidden: int = 2048
    heads: int = 16
    experts: int = 64
    top_k: int = 6
    shared: int = 2
    intermediate: int = 1408

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclasses.dataclass(frozen=True)
class Workload:
    """``lengths[a]`` = request lengths of one batch of Attention replica ``a``."""

    name: str
    lengths: tuple

    def tokens(self, replica: int) -> int:
        return sum(self.lengths[replica])


@dataclasses.dataclass(frozen=True)
class Spec:
    """One launch: everything a rank needs (picklable)."""

    backend: str
    poll_mode: str
    schedule: str
    dims: Dims
    num_attn: int
    num_ffn: int
    workloads: tuple
    duration_s: float
    warmup_batches: int
    max_batches: int
    mps_attn_pct: int | None
    mps_ffn_pct: int | None
    peer_timeout_s: float = 120.0
    seed: int = 0
    placement: tuple = ()  # one afd_cupy.launch.Placement per rank, or () for the default split

    def model(self) -> ModelConfig:
        d = self.dims
        max_tokens = max(w.tokens(a) for w in self.workloads for a in range(self.num_attn))
        return ModelConfig(hidden_size=d.hidden, num_experts=d.experts, top_k=d.top_k,
                           moe_intermediate_size=d.intermediate, num_shared_experts=d.shared,
                           dtype="bfloat16", max_num_batched_tokens=max_tokens, num_layers=d.layers)


# --------------------------------------------------------------------------- ranks

def _rank(ctx, spec: Spec) -> dict:
    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn_worker import attention_connector_kwargs

    is_attn = ctx.rank < spec.num_attn
    pct = spec.mps_attn_pct if is_attn else spec.mps_ffn_pct
    if spec.backend == "cuda" and pct is not None and ctx.sm_percent is None:
        # NOTE: read by the CUDA driver when this process creates its context (just below)
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
    device = bc.set_device(spec.backend, ctx)
    role, role_rank = ("attention", ctx.rank) if is_attn else ("ffn", ctx.rank - spec.num_attn)
    extra = attention_connector_kwargs(spec.schedule) if is_attn else {}
    conn = AFDConnector(spec.model(), TopologyConfig(spec.num_attn, spec.num_ffn), ConnectorConfig(),
                        role=role, role_rank=role_rank, store=ctx.store(), job_id=ctx.job_id,
                        backend=spec.backend, device_id=ctx.device_id, poll_mode=spec.poll_mode,
                        peer_timeout_s=spec.peer_timeout_s, **extra)
    try:
        if not is_attn:
            return _ffn(conn, spec, role_rank, device)
        try:
            return _attention(conn, spec, role_rank, device, ctx.store())
        finally:
            conn.announce_shutdown()
    finally:
        conn.close()


def _randn(shape, fan_in: int, device, gen):
    import torch

    return (torch.randn(shape, device=device, generator=gen) * fan_in ** -0.5).to(torch.bfloat16)


def _ffn(conn, spec: Spec, ffn_rank: int, device) -> dict:
    import torch

    from afd_cupy import moe
    from afd_cupy.ffn_worker import FFNWorker

    d, epr = spec.dims, conn.topology.expert_per_rank
    gen = torch.Generator(device=device).manual_seed(spec.seed * 1000 + 500 + ffn_rank)
    experts, shared = [], []
    for _ in range(d.layers):
        experts.append(moe.ExpertWeights(
            w13=_randn((epr, 2 * d.intermediate, d.hidden), d.hidden, device, gen),
            w2=_randn((epr, d.hidden, d.intermediate), d.intermediate, device, gen),
            num_experts=epr, first_expert=ffn_rank * epr))
        inter = d.shared * d.intermediate
        shared.append(moe.ExpertWeights(w13=_randn((1, 2 * inter, d.hidden), d.hidden, device, gen),
                                        w2=_randn((1, d.hidden, inter), inter, device, gen), num_experts=1)
                      if d.shared else None)
    worker = FFNWorker(conn, experts, shared if d.shared else None, schedule=spec.schedule)
    start = time.monotonic()
    worker.run()
    return {"role": "ffn", "rank": ffn_rank, "served": worker.num_served, "batches": worker.num_batches,
            "seconds": time.monotonic() - start}


class AttentionReplica:
    """One replica's layers: QKV/O projections, causal attention per request, router."""

    def __init__(self, dims: Dims, device, seed: int):
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        h = dims.hidden
        self.dims = dims
        self.layers = [{"wqkv": _randn((3 * h, h), h, device, gen), "wo": _randn((h, h), h, device, gen),
                        "wgate": _randn((dims.experts, h), h, device, gen)} for _ in range(dims.layers)]

    def attention(self, layer_idx: int, x, lengths):
        """x: [T, H] bf16 -> attention output [T, H] (requests attend only to themselves)."""
        import torch
        import torch.nn.functional as F

        d, w = self.dims, self.layers[layer_idx]
        q, k, v = F.linear(F.rms_norm(x, (d.hidden,)), w["wqkv"]).split(d.hidden, dim=-1)
        out = torch.empty_like(q)
        start = 0
        for length in lengths:
            rows = slice(start, start + length)
            heads = [t[rows].view(length, d.heads, d.head_dim).transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            attn = F.scaled_dot_product_attention(*heads, is_causal=True)  # [1, heads, len, hd]
            out[rows] = attn[0].transpose(0, 1).reshape(length, d.hidden)
            start += length
        return F.linear(out, w["wo"])

    def router_input(self, layer_idx: int, x):
        """(normalized hidden to send, router logits [T, E])."""
        import torch.nn.functional as F

        normed = F.rms_norm(x, (self.dims.hidden,))
        return normed, F.linear(normed, self.layers[layer_idx]["wgate"])


def _batch(conn, replica: AttentionReplica, x, lengths) -> None:
    """All layers of one batch; one synchronization at the end (raises latched errors)."""
    for layer_idx in range(replica.dims.layers):
        x = x + replica.attention(layer_idx, x, lengths)
        normed, logits = replica.router_input(layer_idx, x)
        weights, ids = conn.select_experts(logits)
        handle = conn.send_attn_output(normed, ids, weights, layer_idx)
        x = x + conn.recv_ffn_output(handle, blocking=False)
    conn.check_errors()


def _attention(conn, spec: Spec, attn_rank: int, device, store) -> dict:
    import torch

    replica = AttentionReplica(spec.dims, device, seed=spec.seed * 1000 + attn_rank)
    phases = []
    for phase_idx, workload in enumerate(spec.workloads):
        lengths = workload.lengths[attn_rank]
        gen = torch.Generator(device=device).manual_seed(spec.seed + 17 * attn_rank + phase_idx)
        x = torch.randn(sum(lengths), spec.dims.hidden, device=device, generator=gen).to(torch.bfloat16)
        phases.append(_phase(conn, spec, attn_rank, store, phase_idx, workload, replica, x, lengths))
    return {"role": "attention", "rank": attn_rank, "device": bc.device_name(device), "phases": phases}


def _phase(conn, spec: Spec, attn_rank: int, store, phase_idx: int, workload: Workload, replica, x,
           lengths) -> dict:
    from afd_cupy.store import store_barrier

    for _ in range(spec.warmup_batches):
        _batch(conn, replica, x, lengths)
    store_barrier(store, f"bench_afd/phase{phase_idx}", spec.num_attn, spec.peer_timeout_s)
    stopper = _Stopper(spec, attn_rank, store, phase_idx)
    latencies_ms = []
    start = time.monotonic()
    while not stopper.should_stop(len(latencies_ms)):
        begin = time.monotonic()
        _batch(conn, replica, x, lengths)
        latencies_ms.append((time.monotonic() - begin) * 1e3)
    elapsed = time.monotonic() - start
    num_tokens = len(latencies_ms) * sum(lengths)
    return {"workload": workload.name, "lengths": list(lengths), "batches": len(latencies_ms),
            "tokens": num_tokens, "elapsed_s": elapsed,
            "tokens_per_s": num_tokens / elapsed if elapsed > 0 else float("nan"),
            "latency_median_ms": bc.median(latencies_ms), "latency_p90_ms": bc.percentile(latencies_ms, 90)}


class _Stopper:
    """When a replica stops its measured batches (see the module doc).

    async: at its own deadline. lockstep: every replica runs the same number of batches:
    replica 0, at the start of the first batch b past its deadline, publishes stop = b + 1
    (nobody can have started b + 1 yet: that needs replica 0's batch b). Every replica reads
    the flag once per batch under both schedules, so both pay the same store round trip.
    """

    def __init__(self, spec: Spec, attn_rank: int, store, phase_idx: int):
        self.spec, self.attn_rank, self.store = spec, attn_rank, store
        self.flag_key = f"bench_afd/stop_flag/{phase_idx}"
        self.value_key = f"bench_afd/stop_at/{phase_idx}"
        self.deadline = time.monotonic() + spec.duration_s
        self.stop_at: int | None = None

    def should_stop(self, batch_idx: int) -> bool:
        if batch_idx >= self.spec.max_batches:
            return True
        past_deadline = time.monotonic() >= self.deadline
        if self.spec.schedule == "lockstep" and self.attn_rank == 0 and past_deadline and self.stop_at is None:
            self.stop_at = batch_idx + 1
            self.store.set(self.value_key, str(self.stop_at).encode())
            self.store.add(self.flag_key, 1)
        published = self.store.add(self.flag_key, 0) >= 1
        if self.spec.schedule == "async":
            return past_deadline
        if self.stop_at is None and published:
            self.stop_at = int(bytes(self.store.get(self.value_key)).decode())
        return self.stop_at is not None and batch_idx >= self.stop_at


# --------------------------------------------------------------------------- plan, report

def make_workloads(args, num_attn: int) -> tuple:
    requests = args.requests
    uniform = Workload("uniform", tuple((args.uniform_len,) * requests for _ in range(num_attn)))
    skewed = Workload("skewed", tuple((args.long_len if a == 0 else args.short_len,) * requests
                                      for a in range(num_attn)))
    chosen = {"uniform": uniform, "skewed": skewed}
    return tuple(chosen[name] for name in args.workloads)


QUICK_DEFAULTS = {  # backend -> defaults applied when the flag is not given
    "cuda": dict(layers=4, duration=6.0, warmup=3, attn=2, ffn=2, long_len=4096, short_len=256,
                 uniform_len=2048, requests=1, hidden=2048, heads=16, experts=64, top_k=6, shared=2,
                 intermediate=1408),
    "host": dict(layers=2, duration=1.0, warmup=1, attn=2, ffn=1, long_len=64, short_len=8,
                 uniform_len=32, requests=1, hidden=64, heads=4, experts=8, top_k=2, shared=1,
                 intermediate=32),
}
FULL_OVERRIDES = {"cuda": dict(layers=26, duration=30.0, warmup=3), "host": dict(duration=3.0)}


def apply_defaults(args, backend: str):
    defaults = dict(QUICK_DEFAULTS[backend])
    if not args.quick:
        defaults.update(FULL_OVERRIDES[backend])
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def mps_split(args, backend: str, world: int) -> dict:
    """Per-role CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (only when processes share a GPU)."""
    num_gpus = bc.num_visible_gpus() if backend == "cuda" else 0
    shared_gpu = backend == "cuda" and num_gpus < world
    default = max(1, 100 // world)
    attn_pct = (args.mps_attn_pct or default) if shared_gpu else None
    ffn_pct = (args.mps_ffn_pct or default) if shared_gpu else None
    if backend != "cuda":
        placement = "host backend: CPU processes"
    elif shared_gpu:
        placement = (f"{world} processes on GPU 0 under CUDA MPS; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "
                     f"attention={attn_pct}% each, ffn={ffn_pct}% each")
    else:
        placement = f"one process per GPU ({num_gpus} visible)"
    return {"num_gpus": num_gpus, "shared_gpu": shared_gpu, "attention_pct": attn_pct,
            "ffn_pct": ffn_pct, "placement": placement}


def run_schedule(spec: Spec, timeout_s: float) -> list:
    world = spec.num_attn + spec.num_ffn
    window = window_size_hint(spec.model(), TopologyConfig(spec.num_attn, spec.num_ffn), ConnectorConfig())
    same_pct = spec.mps_attn_pct if spec.mps_attn_pct == spec.mps_ffn_pct else None
    child_env = bc.launch_env(spec.backend, world, window, mps_percentage=same_pct)
    return launch(_rank, world, args=(spec,), timeout_s=timeout_s, env=child_env,
                  num_gpus=None if spec.backend == "cuda" else 0,
                  placement=list(spec.placement) or None)


def summarize(spec: Spec, results: list) -> list:
    """One row per workload of this schedule's launch."""
    attn = [r for r in results if r["role"] == "attention"]
    ffn = [r for r in results if r["role"] == "ffn"]
    rows = []
    for phase_idx, workload in enumerate(spec.workloads):
        replicas = [dict(rank=r["rank"], **r["phases"][phase_idx]) for r in attn]
        rows.append({"schedule": spec.schedule, "workload": workload.name,
                     "tokens_per_s": sum(r["tokens_per_s"] for r in replicas), "replicas": replicas})
    served = sum(r["served"] for r in ffn)
    batches = sum(r["batches"] for r in ffn)
    for row in rows:  # FFN counters span the whole launch (all workloads)
        row["ffn_items_served"] = served
        row["ffn_items_per_batch"] = served / batches if batches else float("nan")
    return rows


def ratios_and_targets(rows: list) -> tuple[dict, list]:
    ratios, targets = {}, []
    for workload in sorted({r["workload"] for r in rows}):
        by_schedule = {r["schedule"]: r["tokens_per_s"] for r in rows if r["workload"] == workload}
        if {"async", "lockstep"} <= by_schedule.keys() and by_schedule["lockstep"] > 0:
            ratios[workload] = by_schedule["async"] / by_schedule["lockstep"]
        goal = TARGETS.get(workload)
        if goal is not None:
            targets.append(bc.target_row(f"async / lockstep tokens/s, {workload} mix", f">= {goal}x",
                                         ratios.get(workload), "x", lambda v, g=goal: v >= g))
    return ratios, targets


def draw(rows: list, title: str):
    def _draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        workloads = sorted({r["workload"] for r in rows})
        for offset, schedule in enumerate(SCHEDULES):
            values = [next((r["tokens_per_s"] for r in rows if r["workload"] == w and r["schedule"] == schedule), 0)
                      for w in workloads]
            axes[0].bar([i + 0.4 * offset for i in range(len(workloads))], values, width=0.4, label=schedule)
        axes[0].set_xticks([i + 0.2 for i in range(len(workloads))], workloads)
        axes[0].set(ylabel="tokens/s (all replicas)", title="throughput")
        axes[0].legend(loc="lower center")
        labels, values = [], []
        for r in rows:
            for rep in r["replicas"]:
                labels.append(f"{r['workload'][:4]}/{r['schedule'][:4]}/a{rep['rank']}")
                values.append(rep["latency_median_ms"])
        axes[1].bar(range(len(values)), values)
        axes[1].set_xticks(range(len(values)), labels, rotation=60, fontsize=7)
        axes[1].set(ylabel="median batch latency (ms)", title="per-replica latency")
        fig.suptitle(title, fontsize=9)
    return _draw


def print_summary(report: dict) -> None:
    model = report["model"]
    print()
    print(f"==== bench_afd summary: backend={report['backend']} commit={report['run']['commit']} "
          f"device={report['device']} ====")
    if report["label"]:
        print(report["label"])
    print(f"model: {model['layers']} layers, hidden {model['hidden']}, {model['heads']} heads, "
          f"{model['experts']} experts top-{model['top_k']}, {model['shared']} shared, inter "
          f"{model['intermediate']}; {report['topology']}; {report['mps']['placement']}; "
          f"{report['duration_s']} s per phase")
    for w in report["workloads"]:
        print(f"workload {w['name']}: request lengths per replica {w['lengths']}")
    rows = []
    for r in report["results"]:
        for rep in r["replicas"]:
            rows.append((r["workload"], r["schedule"], r["tokens_per_s"], rep["rank"], rep["batches"],
                         rep["tokens_per_s"], rep["latency_median_ms"], rep["latency_p90_ms"]))
    print(bc.format_table(("workload", "schedule", "total tok/s", "replica", "batches", "replica tok/s",
                           "median ms", "p90 ms"), rows))
    print()
    print(bc.targets_table(report["targets"]))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_common_args(parser, quick_help="4 layers, short phases (< 4 min on one H200)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--workloads", nargs="+", choices=("uniform", "skewed"), default=["uniform", "skewed"])
    for name, kind, text in (
            ("layers", int, "layers (quick: 4, full: 26)"), ("duration", float, "seconds per phase"),
            ("warmup", int, "warm-up batches per phase"), ("attn", int, "Attention replicas"),
            ("ffn", int, "FFN ranks"), ("long-len", int, "skewed: replica 0's request length"),
            ("short-len", int, "skewed: other replicas' request length"),
            ("uniform-len", int, "uniform: request length"), ("requests", int, "requests per batch"),
            ("hidden", int, None), ("heads", int, None), ("experts", int, None), ("top-k", int, None),
            ("shared", int, "shared experts"), ("intermediate", int, "expert intermediate size"),
            ("mps-attn-pct", int, "MPS SM share of each Attention process (one GPU)"),
            ("mps-ffn-pct", int, "MPS SM share of each FFN process (one GPU)")):
        parser.add_argument(f"--{name}", type=kind, default=None, help=text)
    parser.add_argument("--placement", default=None,
                        help="per rank GPU[:SM percent], Attention ranks first, e.g. '0:50,0:50,1' "
                             "(both replicas on GPU 0 at half its SMs, the FFN on GPU 1); "
                             "overrides --mps-attn-pct/--mps-ffn-pct")
    parser.add_argument("--max-batches", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=None, help="per launch, seconds")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = args.backend or bc.detect_backend()
    args = apply_defaults(args, backend)
    dims = Dims(layers=args.layers, hidden=args.hidden, heads=args.heads, experts=args.experts,
                top_k=args.top_k, shared=args.shared, intermediate=args.intermediate)
    workloads = make_workloads(args, args.attn)
    world = args.attn + args.ffn
    mps = mps_split(args, backend, world)
    placement = tuple(parse_placement(args.placement, world)) if args.placement else ()
    if placement:
        mps["placement"] = "; ".join(f"rank {r} ({'attention' if r < args.attn else 'ffn'}): {p}"
                                     for r, p in enumerate(placement))
    print(f"placement: {mps['placement']}", flush=True)
    timeout = args.timeout or (120.0 + len(workloads) * (args.duration * 3 + 60.0))
    started = time.perf_counter()
    rows, devices = [], set()
    specs = [Spec(backend, args.poll_mode, schedule, dims, args.attn, args.ffn, workloads, args.duration,
                  args.warmup, args.max_batches, mps["attention_pct"], mps["ffn_pct"],
                  placement=placement)
             for schedule in args.schedules]
    for spec in bc.progress(specs, "bench_afd", lambda s: f"schedule={s.schedule} {args.attn}A{args.ffn}F"):
        results = run_schedule(spec, timeout)
        devices.update(r["device"] for r in results if r["role"] == "attention")
        rows += summarize(spec, results)
    ratios, targets = ratios_and_targets(rows)
    report = {"tool": "bench_afd", "backend": backend, "quick": args.quick,
              "label": HOST_LABEL if backend == "host" else "", "device": ", ".join(sorted(devices)),
              "run": bc.run_info(backend), "poll_mode": args.poll_mode if backend == "cuda" else "host",
              "model": dataclasses.asdict(dims), "topology": f"{args.attn}A{args.ffn}F", "mps": mps,
              "workloads": [{"name": w.name, "lengths": [list(l) for l in w.lengths]} for w in workloads],
              "duration_s": args.duration, "warmup_batches": args.warmup,
              "method": {"tokens_per_s": "sum over replicas of tokens / own measured wall time",
                         "latency": "wall time of one batch (all layers, one sync at the end)",
                         "stop": "async: own deadline; lockstep: same batch count, decided by replica 0"},
              "results": rows, "ratios": ratios, "targets": targets,
              "wall_s": time.perf_counter() - started}
    json_path = bc.write_json(args.out, "bench_afd.json", report)
    title = f"afd_cupy bench_afd ({backend}, {report['device']}, {report['run']['commit']})"
    plot_path = bc.save_plot(args.out, "bench_afd.png", draw(rows, title))
    print(f"wrote {json_path}" + (f" and {plot_path}" if plot_path else "") + f" in {report['wall_s']:.1f} s")
    print_summary(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
