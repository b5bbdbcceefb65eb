#!/usr/bin/env python3
"""Decode serving under skew: async vs lockstep FFN schedule, per-replica time per output token.

Each Attention replica runs continuous decode steps over a batch of B requests with
per-request KV-cache lengths (``decode_batch``: seeded prompt/output lengths, a seeded
open-loop Poisson arrival of new requests, a finished request leaves and a waiting one takes
its slot). A step runs every layer (``decode_model``): QKV, the new token's K/V written into
the layer's KV cache on the device, decode attention over each request's cached positions
(``scaled_dot_product_attention`` with a per-request mask, grouped-query: ``--kv-heads``), O
projection, router, ``conn.select_experts``, ``send_attn_output`` / ``recv_ffn_output`` through
the real AFD connector, residual adds; one synchronization per step (``conn.check_errors()``).
FFN ranks serve with ``FFNWorker`` (local grouped experts + shared experts) under the async or
the lockstep schedule, as bench_afd does (lockstep: ``always_send=True`` on the Attention side,
``FFNWorker(schedule="lockstep")``), and as a user's worker serves by default
(``--ffn-serving auto``): the graph FFN where it applies (async on cuda, solo runs included),
the Python loop elsewhere (lockstep: the graph FFN serves the async schedule only; the host
backend); ``--ffn-serving loop`` puts every schedule on the loop. Each row says which served
(``served_by``). The same code runs on CPU tensors on the host backend (tiny size).

Skew = context lengths and batch sizes that differ between replicas. Workloads (one phase
each inside a launch): ``--presets`` of ``uniform`` (1x), ``skew4x``, ``skew16x``: replica 0
has mean context ``base * sqrt(s)``, the others ``base / sqrt(s)`` (cuda quick: base 8192, so
16x is 32768 against 2048 and uniform 8192 each), ``--batch-size`` requests each; or one
``custom`` workload from ``--context 1024,16384 --batch 64,64`` (one value per replica, or one
for all).

Model (random bf16 weights; ``--quick`` on cuda): DeepSeek-V2-Lite's hidden size (2048), heads
(16, head dim 128), top-6 gate, 2 shared experts and expert shape (intermediate 1408), with 4
KV heads and 16 routed experts (not 64), 4 layers. Why 16: at decode an async FFN reads every
expert's weights once per replica's item, lockstep once per merged batch; with 64 experts one
FFN rank on a share of one GPU is the bottleneck at any split, and the async gain needs an FFN
with room. ``--experts 64`` measures that case.

Per (placement, schedule, workload), per replica: steps, tokens, tokens/s, time per output
token (TPOT: each token's time is the wall time of the step that produced it) p50/p99 over
tokens, each finished request's own TPOT p50/p99, mean active requests, arrivals; the FFN's
busy fraction and items waiting (the loop: bench_afd's ``FFNStatsRecorder`` and
``ffn_phase_stats``; the graph FFN: its expert GEMMs between device stamps in every replay,
``graph_ffn_stats``, four stamp nodes a replay; items waiting are not measured there: NaN).
After each phase of the async launch each replica runs alone in turn (solo, the others at a
store barrier): its pace with an FFN serving nobody else. A second round follows
(``--solo-background attention``, the default): the co-run solo, each replica through the FFN
in turn while the others run their attention steps without the transport. On one GPU the
replicas share SMs and HBM; the co-run solo is a replica's pace under that load with the FFN
serving it alone, and the co-run ideal built from it is what async can reach on the shared GPU
(reported beside the targets, which use the solo ideal). Stop rule and per-step store read
as bench_afd: async replicas stop at their own deadline, lockstep replicas run the same number
of steps (replica 0 decides).

Arrivals: ``--arrival-rate auto`` (default) gives each run a rate of ``--overload`` (2) x the
replica's service rate measured on its fastest warm-up step (``B / (output_len * step time)``), so the
batch stays full and a queue builds: a saturated open loop, the capacity each schedule reaches.
A number (requests/s, per replica with commas) sets an offered load below capacity instead.

Check: the first step of the first phase of every launch records layer 0's hidden, expert ids
and weights and the AFD output; the replica rebuilds the global experts of layer 0 from the
seed and compares with ``afd_cupy.testing.reference.reference_moe`` (fp64) at the bf16
tolerance. Any failure is reported and the tool exits with 1.

Ratios (per placement and workload): async / lockstep tokens/s; the ideal async / lockstep
ratio as bench_afd defines it, ``(Σ_a solo tokens/s) / lockstep tokens/s`` (the replicas at
their solo pace, an upper bound), and the achieved fraction of it; the short replica's (the
smallest mean context) TPOT p50 async / solo and async / lockstep. Target rows (DESIGN.md §10,
issue #36): 16x context skew, 2 replicas, FFN busy < 0.8 (async): short replica's TPOT async
<= 1.3x solo and <= 0.6x lockstep; uniform: async tokens/s >= 0.97x lockstep; fraction of the
ideal >= 0.9 where the FFN is not saturated (busy < 0.8). Where the FFN is busy >= 0.8 the
conditional rows say N/A with the busy fraction.

Placement (``--placement``, several allowed: each gets its own launches and rows): per rank
``GPU[:SM percent]``, Attention ranks first, as bench_afd (CUDA MPS shares on one GPU; start
MPS first), or a preset for 2 Attention replicas + 1 FFN rank on one GPU:
- ``ffn-free``  = ``0:50,0:50,0:50``: the FFN has room (busy well below 1 at the quick size);
- ``ffn-bound`` = ``0:50,0:50,0:50`` with every context 16x shorter and an expert intermediate
  size 8x larger: the replicas' steps are cheap and each item costs the FFN more, so the FFN
  serving both is meant to be the bottleneck (its busy fraction says whether it is).
Every share is 50 % or more: each is a cap (they may sum past 100), and under 45 % or less
torch's GEMMs are wrong on one H200; every cuda rank checks its GEMMs at the model's shapes
first (``bench_common.require_correct_gemms``) and the launch fails naming the share.

``--timeline``: bench_afd's spans (Attention: attention / dispatch / wait / combine; FFN: wait,
compute, reply) for ``--timeline-steps`` steps of replica 0 from its second measured step;
writes bench_decode_timeline.json and .png (matplotlib optional).

    python3 tools/bench_decode.py --quick --placement ffn-free ffn-bound --out OUT   # one H200, MPS
    python3 tools/bench_decode.py --quick --backend host
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_afd  # noqa: E402
import bench_common as bc  # noqa: E402
import bench_spans as spans  # noqa: E402
import decode_batch as db  # noqa: E402
import decode_model as dm  # noqa: E402
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.runtime.launch import launch  # noqa: E402
from afd_cupy.wire import window_size_hint  # noqa: E402

SCHEDULES = ("async", "lockstep")
HOST_LABEL = ("HOST BACKEND at a tiny size: measures the host protocol and CPU compute of a toy "
              "decode model (wall times), not GPU performance")
PRESET_SKEWS = {"uniform": 1, "skew4x": 4, "skew16x": 16}
@dataclasses.dataclass(frozen=True)
class Preset:
    """A placement preset: per-rank GPU:share, what every context is divided by, what the
    experts' intermediate size is multiplied by (the FFN's work per token)."""

    placement: str
    context_divisor: int = 1
    intermediate_scale: int = 1

    def describe(self) -> str:
        extra = ([f"contexts / {self.context_divisor}"] if self.context_divisor > 1 else []) + \
                ([f"expert intermediate x {self.intermediate_scale}"] if self.intermediate_scale > 1 else [])
        return ", ".join([self.placement] + extra)


#: 2 Attention + 1 FFN on one GPU
PLACEMENT_PRESETS = {"ffn-free": Preset("0:50,0:50,0:50"),
                     "ffn-bound": Preset("0:50,0:50,0:50", context_divisor=16, intermediate_scale=8)}
SATURATED_BUSY = 0.8  # async FFN busy at or above this: the FFN is saturated (targets N/A)
TARGETS = {"short_vs_solo": 1.3, "short_vs_lockstep": 0.6, "uniform_ratio": 0.97, "ideal_fraction": 0.9}
SOLO_MIN_STEPS = 3
SOLO_WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class Workload:
    """``contexts[a]`` = mean prompt length of replica ``a``'s requests, ``batches[a]`` its slots."""

    name: str
    contexts: tuple
    batches: tuple

    @property
    def skew(self) -> float:
        return max(self.contexts) / min(self.contexts)

    @property
    def is_uniform(self) -> bool:
        return len(set(self.contexts)) == 1 and len(set(self.batches)) == 1


@dataclasses.dataclass(frozen=True)
class Spec:
    """One launch: everything a rank needs (picklable)."""

    backend: str
    poll_mode: str
    schedule: str
    dims: dm.DecodeDims
    num_attn: int
    num_ffn: int
    workloads: tuple
    duration_s: float
    warmup_steps: int
    max_steps: int
    output_len: int
    arrival_rates: tuple  # per replica: requests/s, or None (auto)
    overload: float
    jitter: float
    solo_duration_s: float = 0.0
    solo_background: bool = False
    placement: tuple = ()
    timeline: bool = False
    gemm_sm_carveout: int | str = "auto"
    ffn_serving: str = "auto"
    peer_timeout_s: float = 120.0
    seed: int = 0

    def model(self) -> ModelConfig:
        return self.dims.model_config(max(b for w in self.workloads for b in w.batches))


# --------------------------------------------------------------------------- ranks

def _rank(ctx, spec: Spec) -> dict:
    return bc.serving_rank(ctx, spec, ConnectorConfig(), _ffn, _attention)


def _ffn(conn, spec: Spec, ffn_rank: int, device) -> dict:
    """One FFN rank: ``FFNWorker`` as a user runs it (``--ffn-serving``): the graph FFN where it
    applies (async on cuda; its busy time from device stamps, ``graph_ffn_stats``), else the
    Python loop with bench_afd's recorder."""
    from afd_cupy.ffn import serving as ffn_serving
    from afd_cupy.ffn.worker import FFNWorker

    experts, shared = dm.ffn_weights(spec.dims, ffn_rank, conn.topology.expert_per_rank, spec.seed, device)
    worker = FFNWorker(conn, experts, shared, schedule=spec.schedule, gemm_sm_carveout=spec.gemm_sm_carveout,
                       serving=spec.ffn_serving)
    start = time.monotonic()
    weights_nan = dm.count_nan(experts, shared)
    if worker.serving_plan().mode == "graph":
        import graph_ffn_stats

        stats = graph_ffn_stats.GraphFFNStats(device, timeline=spec.timeline)  # before the capture
        try:
            try:
                server = ffn_serving.open_graph_server(worker, ffn_serving.graph_idle_timeout_s(None))
            except Exception as exc:  # the Attention ranks fail at once instead of timing out
                conn.announce_failure(exc)
                raise
            stats.attach(server)
            worker.graph_server = server  # run() serves with it (same wait bound)
            worker.run()
        finally:
            stats.trace.uninstall()
        result = stats.result()
        if worker.served_by != "graph" or worker.graph_server is not server:
            raise RuntimeError(f"FFN rank {ffn_rank} did not serve with the graph it measured "
                               f"(served_by={worker.served_by}: {worker.serving_reason})")
    else:
        recorder = worker.recorder = spans.FFNStatsRecorder(device, timeline=spec.timeline)
        worker.run()
        result = recorder.result()
    return {"role": "ffn", "rank": ffn_rank, "served": worker.num_served, "batches": worker.num_batches,
            "served_by": worker.served_by, "weights_nan": weights_nan,
            "weights_nan_after": dm.count_nan(experts, shared), "gemm_sm_carveout": worker.gemm_sm_carveout,
            "seconds": time.monotonic() - start, "stats": result}


def _attention(conn, spec: Spec, attn_rank: int, device, store) -> dict:
    replica = dm.DecodeReplica(spec.dims, device, seed=spec.seed * 1000 + attn_rank)
    phases = [_phase(conn, spec, attn_rank, store, phase_idx, workload, replica)
              for phase_idx, workload in enumerate(spec.workloads)]
    return {"role": "attention", "rank": attn_rank, "device": bc.device_name(device), "phases": phases}


def _new_batch(spec: Spec, workload: Workload, attn_rank: int, phase_idx: int) -> db.DecodeBatch:
    return db.DecodeBatch(workload.contexts[attn_rank], workload.batches[attn_rank], spec.output_len,
                          seed=spec.seed * 7919 + 101 * attn_rank + phase_idx, jitter=spec.jitter)


def _warmup(conn, spec: Spec, replica, batch: db.DecodeBatch, steps: int, check: bool) -> tuple:
    """``steps`` steps on ``batch``; (step seconds of the last ones, layer 0's check or None)."""
    times, verify, checks = [], None, []
    for step_idx in range(max(1, steps) + (1 if check else 0)):  # check steps 0 and 1 untimed
        begin = time.perf_counter()
        if check and step_idx < 2:  # step 0: the timed (non-blocking) receive; step 1: a blocking one
            _, record = dm.decode_step(conn, replica, batch.kv_lengths(), record_layer=0,
                                       record_blocking=step_idx == 1)
            result = dm.check_layer(spec.dims, 0, spec.seed, record, conn.model.routed_scaling_factor)
            result["blocking"] = step_idx == 1
            checks.append(result)
            verify = next((c for c in checks if not c["ok"]), result) | {"checks": list(checks)}
        else:
            dm.decode_step(conn, replica, batch.kv_lengths())
            times.append(time.perf_counter() - begin)
        replica.apply_moves(batch.advance((time.perf_counter() - begin) * 1e3, time.perf_counter()))
    return times, verify


def _arrival_rate(spec: Spec, attn_rank: int, batch: db.DecodeBatch, warm_times: list) -> float:
    rate = spec.arrival_rates[attn_rank]
    if rate is not None:
        return rate
    step_s = min(warm_times) if warm_times else float("nan")  # the fastest: warm-up steps run slow, not fast
    if not step_s > 0:
        raise RuntimeError(f"replica {attn_rank}: no warm-up step time to derive the auto arrival rate from")
    return db.auto_rate(batch.batch, spec.output_len, step_s, spec.overload)


def _measure(conn, spec: Spec, replica, batch: db.DecodeBatch, should_stop, recorder=None) -> dict:
    """Decode steps until ``should_stop(steps)``; the batch's statistics and the window."""
    batch.start_measuring()
    steps, start_ns = 0, time.perf_counter_ns()
    while not should_stop(steps):
        if batch.num_active == 0:  # below capacity: wait for the next arrival
            time.sleep(max(0.0, min(batch.next_arrival_s() - time.perf_counter(), 1.0)))
            batch.admit(time.perf_counter())
            continue
        begin = time.perf_counter_ns()
        dm.decode_step(conn, replica, batch.kv_lengths(), recorder, steps)
        end = time.perf_counter_ns()
        replica.apply_moves(batch.advance((end - begin) / 1e6, end / 1e9))
        steps += 1
    end_ns = time.perf_counter_ns()
    return {**batch.stats((end_ns - start_ns) / 1e9), "window_ns": (start_ns, end_ns)}


def _phase(conn, spec: Spec, attn_rank: int, store, phase_idx: int, workload: Workload, replica) -> dict:
    from afd_cupy.runtime.store import store_barrier

    warm = _new_batch(spec, workload, attn_rank, phase_idx)
    replica.allocate(workload.batches[attn_rank], warm.cache_len)
    warm_times, verify = _warmup(conn, spec, replica, warm, spec.warmup_steps, check=phase_idx == 0)
    batch = _new_batch(spec, workload, attn_rank, phase_idx)
    rate = _arrival_rate(spec, attn_rank, batch, warm_times)
    recorder = spans.SpanRecorder(replica.device) if spec.timeline else None
    store_barrier(store, f"bench_decode/phase{phase_idx}", spec.num_attn, spec.peer_timeout_s)
    stopper = bc.PhaseStopper(spec.schedule, attn_rank, store, f"bench_decode/{phase_idx}",
                              spec.duration_s, spec.max_steps)
    batch.start_arrivals(rate, time.perf_counter())
    row = {"workload": workload.name, "context": workload.contexts[attn_rank],
           "batch": workload.batches[attn_rank], "arrival_rate": rate, "cache_bytes": replica.cache_bytes(),
           **_measure(conn, spec, replica, batch, stopper.should_stop, recorder), "verify": verify}
    if recorder is not None:
        row["lanes"] = recorder.finish()
    if spec.schedule == "async" and spec.solo_duration_s > 0:
        row["solo"] = _solo(conn, spec, attn_rank, store, phase_idx, workload, replica)
    return row


def _solo(conn, spec: Spec, attn_rank: int, store, phase_idx: int, workload: Workload, replica) -> dict:
    """Every replica alone in turn, the others at a store barrier: this replica's solo run.
    With ``spec.solo_background`` (and more than one replica) a second round follows, the
    co-run solo: every replica decodes through the FFN in turn while the others run their own
    attention steps without the transport (``decode_model.attention_step``), i.e. the shared
    GPU loaded as under async but the FFN serving only one replica. It goes to
    ``solo["corun"]`` (``bench_common.solo_rounds``)."""
    kv_lengths = _new_batch(spec, workload, attn_rank, phase_idx).kv_lengths()
    sync = bc.Stopwatch(replica.device).sync

    def background_step():  # one attention-only decode step, synchronized as a decode step is
        dm.attention_step(replica, kv_lengths)
        sync()
    return bc.solo_rounds(store, f"bench_decode/solo{phase_idx}", spec.num_attn, attn_rank, spec.peer_timeout_s,
                          lambda: _solo_run(conn, spec, attn_rank, store, phase_idx, workload, replica),
                          background_step if spec.solo_background else None)


def _solo_run(conn, spec: Spec, attn_rank: int, store, phase_idx: int, workload: Workload, replica) -> dict:
    """One replica's solo measurement: warm-up steps, then --solo-duration s of decode steps."""
    flag_key = f"bench_decode/stop_flag/{phase_idx}"
    warm_times, _ = _warmup(conn, spec, replica, _new_batch(spec, workload, attn_rank, phase_idx),
                            SOLO_WARMUP_STEPS, check=False)
    batch = _new_batch(spec, workload, attn_rank, phase_idx)
    rate = _arrival_rate(spec, attn_rank, batch, warm_times)
    deadline = time.monotonic() + spec.solo_duration_s

    def should_stop(steps: int) -> bool:
        store.add(flag_key, 0)  # the measured phase's per-step store read
        return steps >= SOLO_MIN_STEPS and time.monotonic() >= deadline

    batch.start_arrivals(rate, time.perf_counter())
    return {"arrival_rate": rate, **_measure(conn, spec, replica, batch, should_stop)}  # window_ns: summarize


# --------------------------------------------------------------------------- launches, rows

def run_schedule(spec: Spec, timeout_s: float) -> list:
    world = spec.num_attn + spec.num_ffn
    window = window_size_hint(spec.model(), TopologyConfig(spec.num_attn, spec.num_ffn), ConnectorConfig())
    child_env = bc.launch_env(spec.backend, world, window)
    on_gpu = spec.backend == "cuda"
    return launch(_rank, world, args=(spec,), timeout_s=timeout_s, env=child_env, num_gpus=None if on_gpu else 0,
                  placement=(list(spec.placement) or None) if on_gpu else None)


def summarize(spec: Spec, results: list, label: str) -> list:
    """One row per workload of this launch (spans left out)."""
    attn = sorted((r for r in results if r["role"] == "attention"), key=lambda r: r["rank"])
    ffn = sorted((r for r in results if r["role"] == "ffn"), key=lambda r: r["rank"])
    rows = []
    for phase_idx, workload in enumerate(spec.workloads):
        replicas = [dict(rank=r["rank"], **{k: v for k, v in r["phases"][phase_idx].items()
                                            if k not in ("lanes", "window_ns")}) for r in attn]
        window = spans.common_window([r["phases"][phase_idx]["window_ns"] for r in attn])
        for rep in replicas:  # the FFN inside each solo window: its service time with one sender
            bench_afd.solo_ffn_stats(rep.get("solo"), ffn)
        rows.append({"placement": label, "schedule": spec.schedule, "workload": workload.name,
                     "contexts": list(workload.contexts), "batches": list(workload.batches),
                     "tokens_per_s": sum(r["tokens_per_s"] for r in replicas), "replicas": replicas,
                     "ffn": dict(bench_afd.ffn_phase_stats(ffn, window),
                                 served_by=sorted({r.get("served_by") or "loop" for r in ffn}))})
    return rows


def short_replica(workload_row: dict) -> int:
    """The replica with the smallest mean context (then the smallest batch)."""
    return min(range(len(workload_row["contexts"])),
               key=lambda a: (workload_row["contexts"][a], workload_row["batches"][a], a))


def compare(rows: list) -> dict:
    """Per (placement, workload) measured under both schedules: ratios, ideal, short replica."""
    out = {}
    for key in dict.fromkeys((r["placement"], r["workload"]) for r in rows):
        by_schedule = {r["schedule"]: r for r in rows if (r["placement"], r["workload"]) == key}
        if not {"async", "lockstep"} <= by_schedule.keys() or not by_schedule["lockstep"]["tokens_per_s"] > 0:
            continue
        fast, slow = by_schedule["async"], by_schedule["lockstep"]
        entry = {"placement": key[0], "workload": key[1], "ratio": fast["tokens_per_s"] / slow["tokens_per_s"],
                 "ffn_busy": {s: by_schedule[s]["ffn"]["busy_fraction"] for s in SCHEDULES},
                 "tpot_p50_ms": {s: [rep["tpot_p50_ms"] for rep in by_schedule[s]["replicas"]] for s in SCHEDULES}}
        solo = [rep.get("solo") for rep in fast["replicas"]]
        if solo and all(solo):
            entry["tpot_p50_ms"]["solo"] = [s["tpot_p50_ms"] for s in solo]
            entry["ideal_async_tokens_per_s"] = sum(s["tokens_per_s"] for s in solo)
            entry["ideal"] = entry["ideal_async_tokens_per_s"] / slow["tokens_per_s"]
            entry["achieved_fraction"] = entry["ratio"] / entry["ideal"]
            corun = [s.get("corun") for s in solo]
            if all(corun):
                entry["tpot_p50_ms"]["solo_corun"] = [c["tpot_p50_ms"] for c in corun]
                entry["ideal_corun"] = sum(c["tokens_per_s"] for c in corun) / slow["tokens_per_s"]
                entry["achieved_fraction_corun"] = entry["ratio"] / entry["ideal_corun"]
        short = short_replica(fast)
        times = {s: entry["tpot_p50_ms"][s][short] for s in entry["tpot_p50_ms"]}
        entry["short_replica"] = bc.short_replica_times(short, times)
        if "solo_corun" in times:
            base = times["solo_corun"]
            entry["short_replica"]["solo_corun"] = base
            entry["short_replica"]["vs_solo_corun"] = times["async"] / base if base and base > 0 else None
        out[f"{key[0]} / {key[1]}"] = entry
    return out


def targets(comparison: dict, workloads: tuple) -> list:
    """The issue's target rows per placement (module doc)."""
    by_name = {w.name: w for w in workloads}
    out = []
    for entry in comparison.values():
        workload, where = by_name[entry["workload"]], entry["placement"]
        busy = entry["ffn_busy"]["async"]
        saturated = not busy < SATURATED_BUSY  # NaN counts as saturated: the condition is unmet
        note = f"FFN busy {busy:.2f} async"
        short = entry["short_replica"]
        if len(workload.contexts) == 2 and round(workload.skew) == 16:
            for key, name, measured in (("short_vs_solo", "short replica TPOT async / solo", short.get("vs_solo")),
                                        ("short_vs_lockstep", "short replica TPOT async / lockstep",
                                         short.get("vs_lockstep"))):
                goal = TARGETS[key]
                out.append(_conditional(bc.target_row(f"decode 16x, {where}: {name}", f"<= {goal}x", measured, "x",
                                                      lambda v, g=goal: v <= g, note=note), saturated))
        if workload.is_uniform:
            goal = TARGETS["uniform_ratio"]
            out.append(bc.target_row(f"decode uniform, {where}: async / lockstep tokens/s", f">= {goal}x",
                                     entry["ratio"], "x", lambda v: v >= goal, note=note))
        goal = TARGETS["ideal_fraction"]
        out.append(_conditional(bc.target_row(f"decode {workload.name}, {where}: fraction of ideal", f">= {goal}",
                                              entry.get("achieved_fraction"), "", lambda v: v >= goal, note=note),
                                saturated))
    return out


def _conditional(row: dict, saturated: bool) -> dict:
    """A target that applies only where the FFN is not saturated: N/A (the measurement kept)."""
    if saturated:
        row = dict(row, status="N/A", note=row["note"] + f" >= {SATURATED_BUSY}: FFN saturated")
    return row


def verification(rows: list) -> list:
    """Every layer check the ranks made: (placement, schedule, workload, replica, result)."""
    return [{"placement": r["placement"], "schedule": r["schedule"], "workload": r["workload"],
             "replica": rep["rank"], **rep["verify"]} for r in rows for rep in r["replicas"] if rep["verify"]]


# --------------------------------------------------------------------------- timeline

def timeline_panels(spec: Spec, results: list, steps: int, label: str) -> list:
    """Per workload: every rank's spans in a window of ``steps`` steps of replica 0 from its
    second measured step (bench_afd's panels; the Attention combine split into wait + combine)."""
    attn = sorted((r for r in results if r["role"] == "attention"), key=lambda r: r["rank"])
    ffn_lanes = [r["stats"]["lanes"] for r in sorted((r for r in results if r["role"] == "ffn"),
                                                     key=lambda r: r["rank"])]
    replies = [lanes.get(spans.STREAM, []) for lanes in ffn_lanes]
    panels = []
    for phase_idx, workload in enumerate(spec.workloads):
        window = bench_afd.timeline_window(attn[0]["phases"][phase_idx]["lanes"].get(spans.STREAM, []),
                                           steps * spec.dims.layers)
        if window is None:
            continue
        rows = [(f"attn {r['rank']} (ctx {workload.contexts[r['rank']]})",
                 spans.clip(spans.split_waits(r["phases"][phase_idx]["lanes"].get(spans.STREAM, []),
                                              r["rank"], replies), window)) for r in attn]
        for ffn_rank, lanes in enumerate(ffn_lanes):
            rows += [(f"ffn {ffn_rank} {name}", spans.clip(lanes.get(name, []), window))
                     for name in (spans.HOST, spans.STREAM)]
        panels.append({"title": f"{label} / {spec.schedule} / {workload.name} (contexts {list(workload.contexts)}, "
                                f"batches {list(workload.batches)})", "schedule": spec.schedule,
                       "workload": workload.name, "window_ns": window, "rows": rows})
    return panels


# --------------------------------------------------------------------------- plan

QUICK_DEFAULTS = {  # backend -> defaults applied when the flag is not given
    "cuda": dict(layers=4, duration=3.0, warmup=5, attn=2, ffn=1, hidden=2048, heads=16, kv_heads=4,
                 experts=16, top_k=6, shared=2, intermediate=1408, base_context=8192, batch_size=64,
                 output_len=128, solo_duration=1.5),
    "host": dict(layers=2, duration=1.0, warmup=2, attn=2, ffn=1, hidden=64, heads=4, kv_heads=2,
                 experts=8, top_k=2, shared=1, intermediate=32, base_context=64, batch_size=4,
                 output_len=16, solo_duration=0.3),
}
FULL_OVERRIDES = {"cuda": dict(layers=8, duration=15.0, solo_duration=5.0),
                  "host": dict(duration=3.0, solo_duration=1.0)}


def apply_defaults(args, backend: str):
    defaults = dict(QUICK_DEFAULTS[backend])
    if not args.quick:
        defaults.update(FULL_OVERRIDES[backend])
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def per_replica(text: str, num_attn: int, name: str, kind=int) -> tuple:
    """``"a,b"`` (one per replica) or ``"a"`` (every replica) -> tuple of ``num_attn`` values."""
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"--{name} {text!r}: expected numbers separated by commas") from None
    if len(values) == 1:
        values *= num_attn
    if len(values) != num_attn:
        raise SystemExit(f"--{name} {text!r}: {len(values)} values for {num_attn} replicas")
    return tuple(values)


def make_workloads(args, context_divisor: int = 1) -> tuple:
    """The ``custom`` workload of --context/--batch, else one per preset (module doc); every
    context divided by ``context_divisor`` (the ffn-bound placement)."""
    n = args.attn
    if args.context is not None or args.batch is not None:
        contexts = tuple(max(1, c // context_divisor)
                         for c in per_replica(args.context or str(args.base_context), n, "context"))
        batches = per_replica(args.batch or str(args.batch_size), n, "batch")
        if min(contexts) < 1 or min(batches) < 1:
            raise SystemExit(f"--context {contexts} and --batch {batches} must be >= 1")
        return (Workload("custom", contexts, batches),)
    out = []
    for name in args.presets:
        root = math.sqrt(PRESET_SKEWS[name])
        base = args.base_context / context_divisor
        contexts = tuple(max(1, round(base * (root if a == 0 else 1 / root))) for a in range(n))
        out.append(Workload(name, contexts, (args.batch_size,) * n))
    return tuple(out)


def resolve_placement(text: str, args, backend: str) -> tuple[str, tuple, dict]:
    """(label, one Placement per rank, the mps record) for a preset name or a GPU:share list."""
    world = args.attn + args.ffn
    spelled = PLACEMENT_PRESETS[text].placement if text in PLACEMENT_PRESETS else text
    if text in PLACEMENT_PRESETS and (args.attn, args.ffn) != (2, 1):
        raise SystemExit(f"--placement {text} is for 2 Attention replicas + 1 FFN rank, got {args.attn}A{args.ffn}F")
    placement, mps = bench_afd.placement_split(args, backend, world, spelled or None)
    if not placement and mps["shared_gpu"]:  # the per-role MPS defaults, as placements on GPU 0
        spelled = ",".join([f"0:{mps['attention_pct']}"] * args.attn + [f"0:{mps['ffn_pct']}"] * args.ffn)
        placement, mps = bench_afd.placement_split(args, backend, world, spelled)
    label = text if text in PLACEMENT_PRESETS else (spelled or "default")
    return label, placement, dict(mps, label=label, spec=spelled)


def arrival_rates(text: str, num_attn: int) -> tuple:
    if text == "auto":
        return (None,) * num_attn
    rates = per_replica(text, num_attn, "arrival-rate", float)
    if min(rates) <= 0:
        raise SystemExit(f"--arrival-rate {text!r}: rates must be > 0 requests/s (or auto)")
    return rates


# --------------------------------------------------------------------------- report

METHOD = {"tpot": "each output token's time = the wall time of the step that produced it (all layers, one "
                  "sync); p50/p99 nearest rank over tokens; request_tpot: a finished request's mean over its "
                  "measured steps",
          "tokens_per_s": "sum over replicas of tokens / own measured wall time",
          "stop": "async: own deadline; lockstep: same step count, decided by replica 0",
          "solo": "async launch, after each phase: each replica alone in turn (others at a barrier), "
                  f"{SOLO_WARMUP_STEPS} warm-up steps, then --solo-duration s",
          "arrivals": "seeded Poisson in wall time; auto = --overload x B / (output_len x fastest warm-up step)",
          "solo_ffn": "solo and co-run solo rows: the FFN's busy fraction and items/s inside that replica's "
                      "window (the FFN serving one replica: its service time per item = busy / items/s)",
          "solo_corun": "--solo-background attention: a second solo round, each replica through the FFN while "
                        "the others run attention-only decode steps (decode_model.attention_step): the shared "
                        "GPU's load without the FFN coupling",
          "ideal": "(sum_a solo tokens/s) / lockstep tokens/s (bench_afd's ideal with n_a tokens per step)",
          "ideal_corun": "(sum_a co-run solo tokens/s) / lockstep tokens/s: the ideal on one shared GPU "
                         "(informational; the targets use the solo ideal)",
          "achieved_fraction": "(async/lockstep) / ideal",
          "short_replica": "smallest mean context; its TPOT p50 async / solo and async / lockstep",
          "ffn_serving": "FFNWorker(serving=--ffn-serving); auto: the graph FFN where it applies (async on cuda: "
                         "solo runs too), the Python loop otherwise (lockstep, host); per row: served_by",
          "ffn_busy_fraction": "loop: " + bench_afd.METHOD["ffn_busy_fraction"] + "; graph: the expert GEMMs of "
                               "every served replay (%globaltimer stamps after the gather and before the reply, "
                               "tools/graph_ffn_stats.py) inside the window / window",
          "ffn_items_waiting": "loop: " + bench_afd.METHOD["ffn_items_waiting"] + "; graph: not measured (NaN)",
          "saturated": f"async FFN busy >= {SATURATED_BUSY}: conditional targets N/A",
          "verify": "first step of the first phase per launch: layer 0's AFD output vs the fp64 reference"}


def results_tables(rows: list, comparison: dict) -> str:
    per_rep = []
    for r in rows:
        for rep in r["replicas"]:
            solo = rep.get("solo") or {}
            per_rep.append((r["placement"], r["workload"], r["schedule"], rep["rank"], rep["context"], rep["batch"],
                            rep["steps"], rep["tokens_per_s"], rep["tpot_p50_ms"], rep["tpot_p99_ms"],
                            solo.get("tpot_p50_ms"), (solo.get("corun") or {}).get("tpot_p50_ms"),
                            rep["mean_active"], rep["request_tpot_p50_ms"]))
    parts = [bc.format_table(("placement", "workload", "schedule", "replica", "context", "batch", "steps",
                              "tok/s", "TPOT p50 ms", "TPOT p99 ms", "solo p50 ms", "co-run solo p50 ms", "active",
                              "req TPOT p50"),
                             per_rep), ""]
    parts += [bc.format_table(("placement", "workload", "schedule", "FFN serving", "total tok/s", "FFN busy",
                               "waiting mean", "waiting max", "FFN items/s"),
                              [(r["placement"], r["workload"], r["schedule"], "/".join(r["ffn"].get("served_by", ())),
                                r["tokens_per_s"], r["ffn"]["busy_fraction"], r["ffn"]["items_waiting_mean"],
                                r["ffn"]["items_waiting_max"], r["ffn"]["items_per_s"]) for r in rows]), ""]
    parts.append(bc.format_table(
        ("placement / workload", "async/lockstep", "ideal", "fraction of ideal", "short", "short async/solo",
         "short async/lockstep", "co-run ideal", "fraction of co-run ideal", "short async/co-run solo"),
        [(k, e["ratio"], e.get("ideal"), e.get("achieved_fraction"), e["short_replica"]["replica"],
          e["short_replica"].get("vs_solo"), e["short_replica"].get("vs_lockstep"), e.get("ideal_corun"),
          e.get("achieved_fraction_corun"), e["short_replica"].get("vs_solo_corun")) for k, e in comparison.items()]))
    return "\n".join(parts)


def print_summary(report: dict) -> None:
    m = report["model"]
    print()
    print(f"==== bench_decode summary: backend={report['backend']} commit={report['run']['commit']} "
          f"device={report['device']} ====")
    if report["label"]:
        print(report["label"])
    print(f"model: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads / {m['kv_heads']} KV heads, "
          f"{m['experts']} experts top-{m['top_k']}, {m['shared']} shared, inter {m['intermediate']}; "
          f"{report['topology']}; output len {report['output_len']}; arrivals {report['arrival_rate']}; "
          f"{report['duration_s']} s per phase, solo {report['solo_duration_s']} s per replica")
    for p in report["placements"]:
        print(f"placement {p['label']}: {p['placement']}")
        if p["model"]["intermediate"] != m["intermediate"]:
            print(f"  expert intermediate {p['model']['intermediate']}")
        for w in p["workloads"]:
            print(f"  workload {w['name']}: mean context per replica {w['contexts']}, batch {w['batches']}")
    print(results_tables(report["results"], report["comparison"]))
    print()
    if report["arrival_rate"] == "auto":
        short_of = [f"{r['placement']}/{r['workload']}/{r['schedule']} replica {rep['rank']}: {rep['mean_active']:.3g}"
                    for r in report["results"] for rep in r["replicas"] if rep["mean_active"] < 0.95 * rep["batch"]]
        if short_of:
            print("NOTE auto arrivals did not keep the batch full (mean active < 95% of B): " + "; ".join(short_of))
    skewed = {w["name"] for w in report["workloads"] if len(set(w["contexts"])) > 1 or len(set(w["batches"])) > 1}
    for key, entry in report["comparison"].items():
        if entry["workload"] in skewed:
            print(bc.short_replica_line(key, "TPOT p50", entry["short_replica"]))
    checks = report["verification"]
    print(f"verify: {sum(c['ok'] for c in checks)}/{len(checks)} layer checks within tolerance "
          f"(max rel err {max((c['rel_err'] for c in checks), default=float('nan')):.3g})")
    print()
    print(bc.targets_table(report["targets"]))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="placement presets (2 Attention + 1 FFN on one GPU, MPS): "
                                            + "; ".join(f"{k} = {v.describe()}" for k, v in PLACEMENT_PRESETS.items())
                                            + " (ffn-free: the FFN is not the bottleneck; ffn-bound: it is)")
    bc.add_common_args(parser, quick_help="4 layers, 3 s phases (cuda: two placements < 4 min on one H200)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--presets", nargs="+", choices=tuple(PRESET_SKEWS), default=["uniform", "skew16x"],
                        help="workloads: replica 0 at base*sqrt(s), the others at base/sqrt(s) mean context")
    parser.add_argument("--context", default=None, help="custom workload: mean context per replica, e.g. 1024,16384")
    parser.add_argument("--batch", default=None, help="custom workload: batch size per replica, e.g. 64,64")
    parser.add_argument("--placement", nargs="+", default=None,
                        help="one or more: a preset (ffn-free, ffn-bound) or per rank GPU[:SM percent], Attention "
                             "ranks first, e.g. 0:30,0:30,0:40 (default: ffn-free on cuda with 2A1F)")
    parser.add_argument("--arrival-rate", default="auto",
                        help="requests/s per replica (commas) or auto (saturating, --overload x capacity)")
    parser.add_argument("--overload", type=float, default=2.0, help="auto arrival rate / measured capacity")
    parser.add_argument("--jitter", type=float, default=db.DEFAULT_JITTER,
                        help="prompt lengths uniform in context * [1 - j, 1 + j]")
    for name, kind, text in (
            ("layers", int, "layers (quick: 4, full: 8)"), ("duration", float, "seconds per phase"),
            ("warmup", int, "warm-up steps per phase"), ("attn", int, "Attention replicas"),
            ("ffn", int, "FFN ranks"), ("hidden", int, None), ("heads", int, None),
            ("kv-heads", int, "key/value heads (grouped-query attention)"), ("experts", int, None),
            ("top-k", int, None), ("shared", int, "shared experts"), ("intermediate", int, "expert intermediate"),
            ("base-context", int, "presets: geometric mean of the replicas' mean contexts"),
            ("batch-size", int, "presets: requests per replica batch"), ("output-len", int, "mean output tokens"),
            ("mps-attn-pct", int, "MPS SM share of each Attention process without --placement (one GPU)"),
            ("mps-ffn-pct", int, "MPS SM share of each FFN process without --placement (one GPU)"),
            ("solo-duration", float, "async: seconds each replica runs alone after each phase (0: skip)")):
        parser.add_argument(f"--{name}", type=kind, default=None, help=text)
    parser.add_argument("--timeline", action="store_true", help="write bench_decode_timeline.json/.png")
    parser.add_argument("--timeline-steps", type=int, default=2, help="steps of replica 0 in the timeline")
    parser.add_argument("--gemm-sm-carveout", type=bc.gemm_sm_carveout_arg, default="auto", metavar="auto|N",
                        help="FFN ranks: FFNWorker(gemm_sm_carveout=...) (as bench_afd)")
    parser.add_argument("--ffn-serving", choices=("auto", "loop"), default="auto",
                        help="FFNWorker(serving=...): auto = the graph FFN where it applies (async on cuda), "
                             "else the Python loop; loop = the loop for every schedule")
    parser.add_argument("--solo-background", choices=("attention", "none"), default="attention",
                        help="attention: after the solo round, a co-run solo round (each replica through the "
                             "FFN while the others run their attention without the transport); none: skip it")
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    parser.add_argument("--timeout", type=float, default=None, help="per launch, seconds")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = args.backend or bc.detect_backend()
    args = apply_defaults(args, backend)
    dims = dm.DecodeDims(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                         experts=args.experts, top_k=args.top_k, shared=args.shared, intermediate=args.intermediate)
    workloads = make_workloads(args)
    texts = args.placement or ["ffn-free" if backend == "cuda" and (args.attn, args.ffn) == (2, 1) else ""]
    presets = [PLACEMENT_PRESETS.get(text, Preset(text)) for text in texts]
    placements = [resolve_placement(text, args, backend)
                  + (make_workloads(args, preset.context_divisor),
                     dataclasses.replace(dims, intermediate=dims.intermediate * preset.intermediate_scale))
                  for text, preset in zip(texts, presets)]
    rates = arrival_rates(args.arrival_rate, args.attn)
    solo = args.solo_duration * args.attn * (2 if args.solo_background == "attention" else 1)
    timeout = args.timeout or (180.0 + len(workloads) * (args.duration * 3 + solo * 2 + 60.0))
    started = time.perf_counter()
    rows, panels, devices = [], [], set()
    specs = [(label, mps, Spec(backend, args.poll_mode, schedule, placed_dims, args.attn, args.ffn, placed,
                               args.duration, args.warmup, args.max_steps, args.output_len, rates, args.overload,
                               args.jitter, solo_duration_s=args.solo_duration,
                               solo_background=args.solo_background == "attention", placement=placement,
                               timeline=args.timeline, gemm_sm_carveout=args.gemm_sm_carveout,
                               ffn_serving=args.ffn_serving))
             for label, placement, mps, placed, placed_dims in placements for schedule in args.schedules]
    for label, _, spec in bc.progress(specs, "bench_decode", lambda s: f"{s[0]} schedule={s[2].schedule}"):
        results = run_schedule(spec, timeout)
        devices.update(r["device"] for r in results if r["role"] == "attention")
        rows += summarize(spec, results, label)
        if args.timeline:
            panels += timeline_panels(spec, results, args.timeline_steps, label)
    comparison = compare(rows)
    checks = verification(rows)
    report = {"tool": "bench_decode", "backend": backend, "quick": args.quick,
              "label": HOST_LABEL if backend == "host" else "", "device": ", ".join(sorted(devices)),
              "run": bc.run_info(backend), "poll_mode": args.poll_mode if backend == "cuda" else "host",
              "model": dataclasses.asdict(dims), "topology": f"{args.attn}A{args.ffn}F",
              "placements": [{"label": label, "spec": mps["spec"], "placement": mps["placement"],
                              "workloads": [dataclasses.asdict(w) for w in placed],
                              "model": dataclasses.asdict(placed_dims)}
                             for label, _, mps, placed, placed_dims in placements],
              "workloads": [dataclasses.asdict(w) for w in workloads], "output_len": args.output_len,
              "arrival_rate": args.arrival_rate, "overload": args.overload, "jitter": args.jitter,
              "duration_s": args.duration, "warmup_steps": args.warmup, "solo_duration_s": args.solo_duration,
              "solo_background": args.solo_background,
              "gemm_sm_carveout": args.gemm_sm_carveout, "method": METHOD, "results": rows,
              "comparison": comparison, "targets": targets(comparison, workloads), "verification": checks,
              "wall_s": time.perf_counter() - started}
    json_path = bc.write_json(args.out, "bench_decode.json", report)
    print(f"wrote {json_path} in {report['wall_s']:.1f} s")
    if args.timeline:
        title = f"afd_cupy bench_decode ({backend}, {report['device']}, {report['run']['commit']}) timeline"
        path = bc.write_json(args.out, "bench_decode_timeline.json", {
            "tool": "bench_decode", "backend": backend, "run": report["run"], "steps": args.timeline_steps,
            "clocks": "perf_counter_ns of each rank (cuda: stream events mapped onto it)",
            "panels": bench_afd.timeline_json(panels)})
        png = bc.save_plot(args.out, "bench_decode_timeline.png", spans.draw_timeline(panels, title))
        print(f"wrote {path}" + (f" and {png}" if png else ""))
    print_summary(report)
    if not all(c["ok"] for c in checks):
        print("VERIFY FAILED: " + "; ".join(f"{c['placement']} {c['schedule']} {c['workload']} replica "
                                            f"{c['replica']}: rel err {c['rel_err']:.3g} > {c['tolerance']}"
                                            for c in checks if not c["ok"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
