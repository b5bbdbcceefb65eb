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

A Attention replicas and F FFN ranks are separate processes (``afd_cupy.runtime.launch``). One launch
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

Solo (async launch only, after each measured phase): each replica in turn runs alone for
``--solo-duration`` seconds (one warm-up batch first) while the others wait at a store barrier,
reading the stop flag once per batch like the measured phase. That is the replica's own pace
with the FFN ranks serving nobody else: the FFN is not saturated by the other replicas. Then
(``--solo-background attention``, the default) a co-run solo round: each replica in turn
through the FFN while the others run their attention batches without the transport (on one GPU:
the SMs and HBM shared as under async, the FFN serving one replica; ``solo["corun"]``, the
planner's contention input). Each solo and co-run solo row carries the FFN's busy fraction and
items/s inside its own window; each co-run row also the pace of the other replicas' background
batches inside that window (``solo["corun"]["background"]``: per replica its batches and layers
there, their durations; :func:`background_pace`), an attention's pace beside the FFN's GEMMs.
``--solo-spinners N ...``: per N one more round, ``solo["spinN"]``, in which the others keep N
one-block waits spinning instead (:func:`spin_step`): the FFN's time per item beside waiting
replicas, which the co-run round (an attention beside the GEMMs) does not load.

Reported per (workload, schedule): tokens/s = Σ over replicas of tokens / own measured wall
time; per replica its tokens/s and batch latency p50/p90/p99; per FFN rank its busy fraction
and the items waiting at it (below); the async/lockstep ratio per workload with the shared
DESIGN.md §10 targets (>= 1.9x skewed, >= 0.97x uniform), reported, never asserted.

Ideal async/lockstep ratio (per workload; :func:`ideal_ratio`). With ``n_a`` tokens per
batch of replica ``a``, ``s_a`` its mean solo batch time and ``l_a`` its mean batch time
under lockstep (all replicas run the same number of lockstep batches, so every ``l_a`` is the
slowest replica's pace plus what lockstep adds: the merged FFN batch, the waits)::

    ideal = (Σ_a n_a / s_a) / (Σ_a n_a / l_a)

The denominator IS the measured lockstep tokens/s (Σ_a tokens / own wall time), the numerator
is the tokens/s async would reach if every replica kept its solo pace. It is an upper bound
of the achieved ratio because async tokens/s = Σ_a n_a / t_a with ``t_a`` the replica's mean
async batch time, and running next to the other replicas can only add contention (queueing
at the FFN ranks, shared SMs / cores / memory bandwidth): ``t_a >= s_a`` (up to measurement
noise). ``achieved_fraction`` = achieved ratio / ideal = async tokens/s / ideal async tokens/s
(the lockstep measurement cancels). The issue's target: >= 0.9 at every skew.

FFN-side statistics (``FFNWorker(recorder=bench_spans.FFNStatsRecorder)``, taken in the
measured window = the time every replica was inside its measured batches):
- busy fraction: time the FFN rank spent computing compute batches (from before the expert
  call to before the first reply; CUDA events on its stream on cuda, ``perf_counter_ns`` on
  the host backend) / window length; mean over the FFN ranks in the table, per rank in JSON;
- items waiting: at every item the FFN rank took from its window, the items that had arrived
  and were not taken yet (``path.pending_arrivals()``) plus the items it held unserved
  (lockstep: waiting for the other replicas' same layer); mean and max. Sampling it costs a
  small device read-back per item on cuda with device polling (tens of µs).

``--timeline``: the measured batches of every Attention rank are recorded as spans (attention
= norm, QKV, attention, O, router and gate; dispatch = ``send_attn_output``; combine =
``recv_ffn_output``, split into ``wait`` until the FFN's reply of that layer landed and the
combine proper; CUDA events on the current stream on cuda, ``perf_counter_ns`` on the host
backend), and every FFN rank records wait (host: polling for an arrival), compute and reply
spans. The ranks return their spans with their results (``afd_cupy.runtime.launch``'s result
channel); the parent cuts, per (schedule, workload), a window of ``--timeline-layers`` layers of
replica 0 starting at its second measured batch and writes ``bench_afd_timeline.json`` and
``bench_afd_timeline.png``. A timeline run records more than a plain one (the Attention
marks, the FFN's wait and reply spans with their tags), so its numbers carry that small cost.

Sweep (``--sweep``): for each placement of ``--sweep-placements`` (one Attention:FFN SM split
each, ``GPU[:SM percent]`` per rank; on the host backend they are only labels) one async and
one lockstep launch, each with one phase per skew of ``--sweep-skews`` (replica 0:
``--long-len`` tokens, the others ``--long-len // skew``); writes ``bench_afd_sweep.json`` and
``bench_afd_sweep.png`` (achieved and ideal async/lockstep vs skew, one colour per split).

GPU placement: with at least A+F GPUs, one process per GPU. On fewer GPUs every process runs
on GPU 0 under CUDA MPS (start it first; tools/gpu_suite.sh does) with
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` per process: ``--mps-attn-pct`` for Attention ranks and
``--mps-ffn-pct`` for FFN ranks (default max(50, 100 // (A+F)) each; a share is a cap, so they may
sum past 100), set before the process creates its CUDA context. Every cuda rank first checks
that torch's GEMMs compute right at the model's shapes (``bench_common.require_correct_gemms``):
on one H200 they do not under a share of 45 % or less, and the launch fails naming the share.

``--gemm-sm-carveout auto|N``: the FFN ranks' ``FFNWorker(gemm_sm_carveout=...)`` (the expert
GEMMs leave N SMs free for the kernels spinning next to them; docs/design/performance-decisions.md; default auto,
the library's default: 2 on a GPU); the argument and each FFN rank's resolved value are in the
JSON report. ``0`` measures without.

On the host backend it runs at a tiny size (hidden 64, 2 layers, short sequences; labelled).

    python3 tools/bench_afd.py --quick --out OUT        # GPU (< 4 min on one H200, MPS)
    python3 tools/bench_afd.py --quick --backend host
    python3 tools/bench_afd.py --quick --timeline --out OUT
    python3 tools/bench_afd.py --quick --sweep --sweep-placements 0:50,0:50,1 0:25,0:25,0:50
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
import bench_overlap as ov  # noqa: E402
import bench_spans as spans  # noqa: E402
from afd_cupy.config import ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.runtime.launch import launch, parse_placement  # noqa: E402
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
    placement: tuple = ()  # one afd_cupy.runtime.launch.Placement per rank, or () for the default split
    solo_duration_s: float = 0.0  # async: each replica alone after each phase (0: no solo runs)
    solo_background: bool = False  # then a co-run round: the others run their attention only
    solo_spinners: tuple = ()  # then per N a round "spinN": the others keep N waits spinning
    timeline: bool = False  # record every rank's spans in the measured batches
    ffn_stats: bool = True  # FFNWorker(recorder=...): busy fraction, items waiting
    overlap: str = "none"  # bench_overlap.VARIANTS: two-stage Attention pipeline, FFN reply lane
    gemm_sm_carveout: int | str = "auto"  # FFNWorker(gemm_sm_carveout=...): SMs the GEMMs leave free

    def model(self) -> ModelConfig:
        d = self.dims
        max_tokens = max(w.tokens(a) for w in self.workloads for a in range(self.num_attn))
        return ModelConfig(hidden_size=d.hidden, num_experts=d.experts, top_k=d.top_k,
                           moe_intermediate_size=d.intermediate, num_shared_experts=d.shared,
                           dtype="bfloat16", max_num_batched_tokens=max_tokens, num_layers=d.layers)


# --------------------------------------------------------------------------- ranks

def _rank(ctx, spec: Spec) -> dict:
    is_attn = ctx.rank < spec.num_attn
    pct = spec.mps_attn_pct if is_attn else spec.mps_ffn_pct
    if spec.backend == "cuda" and pct is not None and ctx.sm_percent is None:
        # NOTE: read by the CUDA driver when this process creates its context (in serving_rank)
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
    return bc.serving_rank(ctx, spec, ov.connector_config(spec.overlap), _ffn, _attention)


def _randn(shape, fan_in: int, device, gen):
    import torch

    return (torch.randn(shape, device=device, generator=gen) * fan_in ** -0.5).to(torch.bfloat16)


def _ffn(conn, spec: Spec, ffn_rank: int, device) -> dict:
    import torch

    from afd_cupy import moe
    from afd_cupy.ffn.worker import FFNWorker

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
    overlap = ov.uses_ffn(spec.overlap)
    recorder = (spans.FFNStatsRecorder(device, timeline=spec.timeline, overlap=overlap)
                if spec.ffn_stats else None)
    worker = FFNWorker(conn, experts, shared if d.shared else None, schedule=spec.schedule,
                       recorder=recorder, overlap=overlap, gemm_sm_carveout=spec.gemm_sm_carveout)
    start = time.monotonic()
    worker.run()
    return {"role": "ffn", "rank": ffn_rank, "served": worker.num_served, "batches": worker.num_batches,
            "gemm_sm_carveout": worker.gemm_sm_carveout, "seconds": time.monotonic() - start,
            "stats": recorder.result() if recorder else None}


class AttentionReplica:
    """One replica's layers: QKV/O projections, causal attention per request, router."""

    def __init__(self, dims: Dims, device, seed: int):
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        h = dims.hidden
        self.dims = dims
        self.stages = None  # bench_overlap.TwoStages: run batches as two micro-batch stages
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


def _batch(conn, replica: AttentionReplica, x, lengths, recorder=None, batch_idx: int = 0) -> tuple:
    """All layers of one batch; one synchronization at the end (raises latched errors).
    Returns the final hidden states as a tuple of row blocks in input order (one block; two
    under ``--overlap attn``: the stages' halves).

    ``recorder`` (a ``bench_spans.SpanRecorder``, timeline runs): attention, dispatch and
    combine spans of every layer on its stream lane, tagged ``(batch_idx, layer)``. A replica
    with ``stages`` (``--overlap attn``) runs ``bench_overlap.pipelined_batch`` instead."""
    if replica.stages is not None:
        return ov.pipelined_batch(conn, replica, x, lengths, replica.stages, recorder, batch_idx)
    for layer_idx in range(replica.dims.layers):
        if recorder is not None:
            recorder.mark(spans.STREAM, "attention", (batch_idx, layer_idx))
        x = x + replica.attention(layer_idx, x, lengths)
        normed, logits = replica.router_input(layer_idx, x)
        weights, ids = conn.select_experts(logits)
        if recorder is not None:
            recorder.mark(spans.STREAM, "dispatch", (batch_idx, layer_idx))
        handle = conn.send_attn_output(normed, ids, weights, layer_idx)
        if recorder is not None:
            recorder.mark(spans.STREAM, "combine", (batch_idx, layer_idx))
        x = x + conn.recv_ffn_output(handle, blocking=False)
    if recorder is not None:
        recorder.mark(spans.STREAM, None)
    conn.check_errors()
    return (x,)


def _attention(conn, spec: Spec, attn_rank: int, device, store) -> dict:
    import torch

    replica = AttentionReplica(spec.dims, device, seed=spec.seed * 1000 + attn_rank)
    if ov.uses_attn(spec.overlap):
        replica.stages = ov.TwoStages(device)
    phases = []
    for phase_idx, workload in enumerate(spec.workloads):
        lengths = workload.lengths[attn_rank]
        gen = torch.Generator(device=device).manual_seed(spec.seed + 17 * attn_rank + phase_idx)
        x = torch.randn(sum(lengths), spec.dims.hidden, device=device, generator=gen).to(torch.bfloat16)
        phases.append(_phase(conn, spec, attn_rank, store, phase_idx, workload, replica, x, lengths, device))
    return {"role": "attention", "rank": attn_rank, "device": bc.device_name(device), "phases": phases}


def _phase(conn, spec: Spec, attn_rank: int, store, phase_idx: int, workload: Workload, replica, x,
           lengths, device) -> dict:
    from afd_cupy.runtime.store import store_barrier

    for _ in range(spec.warmup_batches):
        _batch(conn, replica, x, lengths)
    recorder = spans.SpanRecorder(device) if spec.timeline else None
    store_barrier(store, f"bench_afd/phase{phase_idx}", spec.num_attn, spec.peer_timeout_s)
    stopper = bc.PhaseStopper(spec.schedule, attn_rank, store, f"bench_afd/{phase_idx}",
                              spec.duration_s, spec.max_batches)
    latencies_ms = []
    start_ns = time.perf_counter_ns()
    while not stopper.should_stop(len(latencies_ms)):
        begin = time.perf_counter_ns()
        _batch(conn, replica, x, lengths, recorder, len(latencies_ms))
        latencies_ms.append((time.perf_counter_ns() - begin) / 1e6)
    end_ns = time.perf_counter_ns()
    elapsed = (end_ns - start_ns) / 1e9
    row = {"workload": workload.name, "lengths": list(lengths),
           **_pace(latencies_ms, elapsed, sum(lengths)), "window_ns": (start_ns, end_ns)}
    if recorder is not None:
        row["lanes"] = recorder.finish()
    if spec.schedule == "async" and spec.solo_duration_s > 0:
        row["solo"] = _solo(conn, spec, attn_rank, store, phase_idx, replica, x, lengths)
    return row


def _pace(latencies_ms: list, elapsed_s: float, tokens_per_batch: int) -> dict:
    """Batches, tokens, tokens/s and the batch-time statistics of one measured run."""
    num_tokens = len(latencies_ms) * tokens_per_batch
    return {"batches": len(latencies_ms), "tokens": num_tokens, "elapsed_s": elapsed_s,
            "tokens_per_s": num_tokens / elapsed_s if elapsed_s > 0 else float("nan"),
            "batch_mean_ms": elapsed_s * 1e3 / len(latencies_ms) if latencies_ms else float("nan"),
            "latency_median_ms": bc.median(latencies_ms), "latency_p50_ms": bc.percentile(latencies_ms, 50),
            "latency_p90_ms": bc.percentile(latencies_ms, 90), "latency_p99_ms": bc.percentile(latencies_ms, 99)}


SOLO_MIN_BATCHES = 3


def _solo(conn, spec: Spec, attn_rank: int, store, phase_idx: int, replica, x, lengths) -> dict:
    """Every replica alone in turn (module doc); returns this replica's solo pace. With
    ``spec.solo_background`` (and more than one replica) a co-run round follows: each replica
    through the FFN in turn while the others run their attention only (``_attention_batch``),
    the GPU loaded as under async with the FFN serving one replica; it goes to ``["corun"]``
    (``bench_common.solo_rounds``), and this replica's background batches, timed one by one
    (host clock, after the batch's synchronization), to ``["background_ns"]``."""
    sync = bc.Stopwatch(x.device).sync
    background_ns = []  # (begin, end) perf_counter_ns of every background batch, all turns

    def background_step():
        begin = time.perf_counter_ns()
        _attention_batch(replica, x, lengths)
        sync()
        background_ns.append((begin, time.perf_counter_ns()))
    mine = bc.solo_rounds(store, f"bench_afd/solo{phase_idx}", spec.num_attn, attn_rank, spec.peer_timeout_s,
                          lambda: _solo_run(conn, spec, store, phase_idx, replica, x, lengths),
                          background_step if spec.solo_background else None,
                          {f"spin{n}": spin_step(spec.backend, n, x.device) for n in spec.solo_spinners})
    if "corun" in mine:  # summarize cuts them into each other replica's co-run window
        mine["background_ns"] = background_ns
    return mine


#: one step of a spinner round's background load: its waits spin this long, then it checks the store
SPIN_STEP_NS = 2_000_000


def spin_step(backend: str, num_spinners: int, device):
    """The background step of a spinner round (``--solo-spinners``): what a replica waiting
    for its reply puts on the GPU, without the transport. cuda: ``num_spinners`` one-block
    kernels on streams of their own (``afd_bench_clock``, one thread reading ``%globaltimer``
    and storing it with a system fence, as a wait kernel polls its flag) for SPIN_STEP_NS,
    then synchronized; host: this process polls for as long (one core)."""
    if backend != "cuda":
        def host_step():
            deadline = time.perf_counter_ns() + SPIN_STEP_NS
            while time.perf_counter_ns() < deadline:
                pass
        return host_step
    import cupy as cp

    from afd_cupy import kernels

    with cp.cuda.Device(device.index or 0):
        kernel = kernels.get_kernel("probes/bench.cu", "afd_bench_clock")
        words = cp.zeros(num_spinners, cp.int64)
        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(num_spinners)]

    def cuda_step():
        for i, stream in enumerate(streams):
            kernel((1,), (32,), (cp.uint64(words.data.ptr + 8 * i), cp.int64(SPIN_STEP_NS)), stream=stream)
        for stream in streams:
            stream.synchronize()
    return cuda_step


def _solo_run(conn, spec: Spec, store, phase_idx: int, replica, x, lengths) -> dict:
    """One replica's solo pace: a warm-up batch, then --solo-duration s of batches."""
    flag_key = f"bench_afd/stop_flag/{phase_idx}"
    _batch(conn, replica, x, lengths)  # warm-up after the wait at the barrier
    latencies_ms = []
    start_ns = time.perf_counter_ns()
    deadline = start_ns + int(spec.solo_duration_s * 1e9)
    while len(latencies_ms) < SOLO_MIN_BATCHES or time.perf_counter_ns() < deadline:
        store.add(flag_key, 0)  # the measured phase's per-batch store read
        begin = time.perf_counter_ns()
        _batch(conn, replica, x, lengths)
        latencies_ms.append((time.perf_counter_ns() - begin) / 1e6)
    end_ns = time.perf_counter_ns()
    return {**_pace(latencies_ms, (end_ns - start_ns) / 1e9, sum(lengths)), "window_ns": (start_ns, end_ns)}


def _attention_batch(replica, x, lengths):
    """A batch's attention and router of every layer without the transport (no expert call):
    the co-run round's background load. Not synchronized."""
    for layer_idx in range(replica.dims.layers):
        x = x + replica.attention(layer_idx, x, lengths)
        replica.router_input(layer_idx, x)
    return x


# --------------------------------------------------------------------------- plan, report

def make_workloads(args, num_attn: int) -> tuple:
    requests = args.requests
    uniform = Workload("uniform", tuple((args.uniform_len,) * requests for _ in range(num_attn)))
    skewed = Workload("skewed", tuple((args.long_len if a == 0 else args.short_len,) * requests
                                      for a in range(num_attn)))
    chosen = {"uniform": uniform, "skewed": skewed}
    return tuple(chosen[name] for name in args.workloads)


def sweep_workloads(long_len: int, skews, requests: int, num_attn: int) -> tuple:
    """One workload per skew: replica 0 gets ``long_len``-token requests, the others
    ``long_len // skew`` (the token ratio between replica 0 and the others is ``skew``)."""
    out = []
    for skew in skews:
        short = long_len // skew
        if short < 1:
            raise ValueError(f"--long-len {long_len} is too short for a {skew}x skew")
        out.append(Workload(f"skew{skew}x", tuple((long_len if a == 0 else short,) * requests
                                                  for a in range(num_attn))))
    return tuple(out)


QUICK_DEFAULTS = {  # backend -> defaults applied when the flag is not given
    "cuda": dict(layers=4, duration=6.0, warmup=3, attn=2, ffn=2, long_len=4096, short_len=256,
                 uniform_len=2048, requests=1, hidden=2048, heads=16, experts=64, top_k=6, shared=2,
                 intermediate=1408, solo_duration=2.0),
    "host": dict(layers=2, duration=1.0, warmup=1, attn=2, ffn=1, long_len=64, short_len=8,
                 uniform_len=32, requests=1, hidden=64, heads=4, experts=8, top_k=2, shared=1,
                 intermediate=32, solo_duration=0.3),
}
FULL_OVERRIDES = {"cuda": dict(layers=26, duration=30.0, warmup=3, solo_duration=10.0),
                  "host": dict(duration=3.0, solo_duration=1.0)}


#: with --overlap other than none: two requests of half the uniform length (the same tokens;
#: the two-stage pipeline splits a batch by requests)
OVERLAP_DEFAULTS = {"cuda": dict(requests=2, uniform_len=1024), "host": dict(requests=2, uniform_len=16)}


def apply_defaults(args, backend: str):
    defaults = dict(QUICK_DEFAULTS[backend])
    if not args.quick:
        defaults.update(FULL_OVERRIDES[backend])
    if args.overlap != "none":
        defaults.update(OVERLAP_DEFAULTS[backend])
    if args.overlap == "all":  # the comparison: async, uniform; no solo runs (no ideal ratio)
        defaults.update(schedules=["async"], workloads=["uniform"], solo_duration=0.0)
    else:
        defaults.update(schedules=list(SCHEDULES), workloads=["uniform", "skewed"])
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def mps_split(args, backend: str, world: int) -> dict:
    """Per-role CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (only when processes share a GPU)."""
    num_gpus = bc.num_visible_gpus() if backend == "cuda" else 0
    shared_gpu = backend == "cuda" and num_gpus < world
    default = max(bc.MIN_MPS_SHARE_PCT, 100 // world)  # shares may sum past 100: each is a cap
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


def placement_split(args, backend: str, world: int, text: str | None) -> tuple[tuple, dict]:
    """(one Placement per rank or (), the ``mps`` record) for a ``--placement`` string.

    A placement replaces the per-role MPS defaults: a rank placed without an SM share runs
    unlimited (e.g. the FFN alone on GPU 1 in ``0:50,0:50,1``), not at ``100 // (A + F)``."""
    mps = mps_split(args, backend, world)
    placement = tuple(parse_placement(text, world)) if text else ()
    if placement:
        mps.update(attention_pct=None, ffn_pct=None, placement="; ".join(
            f"rank {r} ({'attention' if r < args.attn else 'ffn'}): {p}" for r, p in enumerate(placement)))
    return placement, mps


def run_schedule(spec: Spec, timeout_s: float) -> list:
    world = spec.num_attn + spec.num_ffn
    window = window_size_hint(spec.model(), TopologyConfig(spec.num_attn, spec.num_ffn),
                              ov.connector_config(spec.overlap))
    same_pct = spec.mps_attn_pct if spec.mps_attn_pct == spec.mps_ffn_pct else None
    child_env = bc.launch_env(spec.backend, world, window, mps_percentage=same_pct)
    return launch(_rank, world, args=(spec,), timeout_s=timeout_s, env=child_env,
                  num_gpus=None if spec.backend == "cuda" else 0,
                  placement=list(spec.placement) or None)


def summarize(spec: Spec, results: list) -> list:
    """One row per workload of this schedule's launch (the ranks' spans are left out)."""
    attn = sorted((r for r in results if r["role"] == "attention"), key=lambda r: r["rank"])
    ffn = sorted((r for r in results if r["role"] == "ffn"), key=lambda r: r["rank"])
    rows = []
    for phase_idx, workload in enumerate(spec.workloads):
        corun_background(attn, phase_idx, spec.dims.layers)
        replicas = []
        for r in attn:
            phase = {k: v for k, v in r["phases"][phase_idx].items() if k not in ("lanes", "window_ns")}
            solo_ffn_stats(phase.get("solo"), ffn)
            replicas.append(dict(rank=r["rank"], tokens_per_batch=sum(phase["lengths"]), **phase))
        window = spans.common_window([r["phases"][phase_idx]["window_ns"] for r in attn])
        rows.append({"schedule": spec.schedule, "workload": workload.name, "overlap": spec.overlap,
                     "tokens_per_s": sum(r["tokens_per_s"] for r in replicas), "replicas": replicas,
                     "ffn": ffn_phase_stats(ffn, window)})
    served = sum(r["served"] for r in ffn)
    batches = sum(r["batches"] for r in ffn)
    for row in rows:  # FFN counters span the whole launch (all workloads)
        row["ffn_items_served"] = served
        row["ffn_items_per_batch"] = served / batches if batches else float("nan")
    return rows


def ffn_phase_stats(ffn_results: list, window: tuple) -> dict:
    """Busy fraction and items waiting of every FFN rank inside ``window`` (module doc)."""
    length_s = (window[1] - window[0]) / 1e9
    per_rank = []
    for r in ffn_results:
        stats = r["stats"]
        if stats is None:  # --no-ffn-stats
            continue
        queue = spans.queue_stats(stats["queue_ns"], stats["queue_items"], window)
        per_rank.append({"rank": r["rank"], "busy_fraction": spans.busy_fraction(stats["compute_ns"], window),
                         "items_waiting_mean": queue["mean"], "items_waiting_max": queue["max"],
                         "items_taken": queue["samples"]})
    nan = float("nan")
    sampled = [r for r in per_rank if r["items_taken"]]
    taken = sum(r["items_taken"] for r in sampled)
    return {"window_s": length_s,
            "busy_fraction": sum(r["busy_fraction"] for r in per_rank) / len(per_rank) if per_rank else nan,
            "items_waiting_mean": sum(r["items_waiting_mean"] * r["items_taken"] for r in sampled) / taken
                                  if taken else nan,
            "items_waiting_max": max((r["items_waiting_max"] for r in sampled), default=None),
            "items_per_s": taken / length_s if per_rank and length_s > 0 else nan, "per_rank": per_rank}


def corun_background(attn_results: list, phase_idx: int, layers: int) -> None:
    """In place, for one phase: every co-run row (``solo["corun"]``) gains ``background``, one
    :func:`background_pace` per other replica over that row's window (the background batches
    each replica ran during the others' co-run turns, ``solo["background_ns"]``, which go)."""
    solos = [(r["rank"], r["phases"][phase_idx].get("solo") or {}) for r in attn_results]
    spans_ns = {rank: solo.pop("background_ns", None) for rank, solo in solos}
    for rank, solo in solos:
        corun = solo.get("corun")
        if corun and "window_ns" in corun:
            window = tuple(corun["window_ns"])
            corun["background"] = [{"rank": other, **background_pace(spans, window, layers)}
                                   for other, spans in spans_ns.items() if other != rank and spans is not None]


def background_pace(spans_ns: list, window: tuple, layers: int) -> dict:
    """A background replica's attention-only batches of ``layers`` layers that lie wholly
    inside ``window`` (ns, the co-run row's; the batches cut by its ends are dropped): their
    count, their durations (ms: median, nearest-rank p10 / p90, mean, mean / layers), the
    share of the window they cover, and where the first began and the last ended (ms from the
    window's start). NaN statistics where no batch lies inside, never a made-up number."""
    inside = [(b, e) for b, e in spans_ns if window[0] <= b and e <= window[1]]
    durations_ms = [(e - b) / 1e6 for b, e in inside]
    length_ns, nan = window[1] - window[0], float("nan")
    mean_ms = sum(durations_ms) / len(durations_ms) if durations_ms else nan
    return {"batches": len(inside), "layers": len(inside) * layers, "window_s": length_ns / 1e9,
            "batch_median_ms": bc.median(durations_ms), "batch_p10_ms": bc.percentile(durations_ms, 10),
            "batch_p90_ms": bc.percentile(durations_ms, 90), "batch_mean_ms": mean_ms,
            "layer_mean_ms": mean_ms / layers,
            "covered_fraction": sum(e - b for b, e in inside) / length_ns if length_ns > 0 else nan,
            "first_begin_ms": (inside[0][0] - window[0]) / 1e6 if inside else nan,
            "last_end_ms": (inside[-1][1] - window[0]) / 1e6 if inside else nan}


def solo_ffn_stats(solo: dict | None, ffn_results: list) -> None:
    """In place: a solo row and each of its background rounds' rows (``solo["corun"]``,
    ``solo["spinN"]``) trade their ``window_ns`` for ``ffn``, the FFN's busy fraction and
    items/s inside that window (its time per item serving one replica)."""
    rounds = [v for v in (solo or {}).values() if isinstance(v, dict)]
    for run in [solo] + rounds:
        if run and "window_ns" in run:
            stats = ffn_phase_stats(ffn_results, tuple(run.pop("window_ns")))
            run["ffn"] = {k: stats[k] for k in ("busy_fraction", "items_per_s")}


def ideal_ratio(tokens_per_batch, solo_batch_s, lockstep_batch_s) -> float:
    """The ideal async/lockstep tokens/s ratio (module doc): ``(Σ_a n_a / s_a) / (Σ_a n_a / l_a)``
    for ``n_a`` tokens per batch of replica ``a``, ``s_a`` its mean batch time alone (solo) and
    ``l_a`` its mean batch time under lockstep. Raises ValueError for mismatched or
    non-positive inputs."""
    if not len(tokens_per_batch) == len(solo_batch_s) == len(lockstep_batch_s) or not tokens_per_batch:
        raise ValueError("one tokens_per_batch, solo_batch_s and lockstep_batch_s entry per replica")
    if min(list(tokens_per_batch) + list(solo_batch_s) + list(lockstep_batch_s)) <= 0:
        raise ValueError("tokens per batch and batch times must be > 0")
    solo = sum(n / s for n, s in zip(tokens_per_batch, solo_batch_s))
    lockstep = sum(n / t for n, t in zip(tokens_per_batch, lockstep_batch_s))
    return solo / lockstep


def compare(rows: list) -> dict:
    """Per workload measured under both schedules: the achieved ratio and, when the async
    launch ran solo batches, the ideal ratio, the achieved fraction and their inputs."""
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        by_schedule = {r["schedule"]: r for r in rows if r["workload"] == workload}
        if not {"async", "lockstep"} <= by_schedule.keys() or by_schedule["lockstep"]["tokens_per_s"] <= 0:
            continue
        fast, slow = by_schedule["async"], by_schedule["lockstep"]
        entry = {"ratio": fast["tokens_per_s"] / slow["tokens_per_s"]}
        solo = [rep.get("solo") for rep in fast["replicas"]]
        if solo and all(solo):
            tokens = [rep["tokens_per_batch"] for rep in fast["replicas"]]
            solo_ms = [s["batch_mean_ms"] for s in solo]
            lockstep_ms = [rep["batch_mean_ms"] for rep in slow["replicas"]]
            ideal = ideal_ratio(tokens, [m / 1e3 for m in solo_ms], [m / 1e3 for m in lockstep_ms])
            entry.update(ideal=ideal, achieved_fraction=entry["ratio"] / ideal, tokens_per_batch=tokens,
                         solo_batch_ms=solo_ms, async_batch_ms=[rep["batch_mean_ms"] for rep in fast["replicas"]],
                         lockstep_batch_ms=lockstep_ms,
                         ideal_async_tokens_per_s=sum(n * 1e3 / m for n, m in zip(tokens, solo_ms)),
                         lockstep_vs_slowest_solo=max(lockstep_ms) / max(solo_ms))
        tokens = [rep["tokens_per_batch"] for rep in fast["replicas"]]
        if len(set(tokens)) > 1:  # under skew the headline: the short replica's batch time
            short = tokens.index(min(tokens))
            entry["short_replica"] = bc.short_replica_times(short, {
                "async": fast["replicas"][short]["batch_mean_ms"], "lockstep": slow["replicas"][short]["batch_mean_ms"],
                "solo": solo[short]["batch_mean_ms"] if solo and solo[short] else None})
        out[workload] = entry
    return out


IDEAL_FRACTION_TARGET = 0.9


def ratios_and_targets(rows: list, comparison: dict | None = None) -> tuple[dict, list]:
    comparison = compare(rows) if comparison is None else comparison
    ratios = {w: e["ratio"] for w, e in comparison.items()}
    targets = []
    for workload in sorted({r["workload"] for r in rows}):
        goal = TARGETS.get(workload)
        if goal is not None:
            targets.append(bc.target_row(f"async / lockstep tokens/s, {workload} mix", f">= {goal}x",
                                         ratios.get(workload), "x", lambda v, g=goal: v >= g))
    for workload in sorted({r["workload"] for r in rows}):
        targets.append(bc.target_row(f"async / lockstep, fraction of ideal, {workload}",
                                     f">= {IDEAL_FRACTION_TARGET}",
                                     comparison.get(workload, {}).get("achieved_fraction"), "",
                                     lambda v: v >= IDEAL_FRACTION_TARGET, note="issue #15"))
    return ratios, targets


def timeline_panels(spec: Spec, results: list, layers: int) -> list:
    """Per workload of a ``spec.timeline`` launch: the spans of every rank (Attention: stream
    lane with the combine split into wait + combine; FFN: host and stream lanes) in a window
    of ``layers`` layers of replica 0 from its second measured batch."""
    attn = sorted((r for r in results if r["role"] == "attention"), key=lambda r: r["rank"])
    ffn = sorted((r for r in results if r["role"] == "ffn"), key=lambda r: r["rank"])
    ffn_lanes = [r["stats"]["lanes"] if r["stats"] else {} for r in ffn]
    panels = []
    for phase_idx, workload in enumerate(spec.workloads):
        window = timeline_window(attn[0]["phases"][phase_idx]["lanes"].get(spans.STREAM, []), layers)
        if window is None:
            continue
        rows = []
        replies = [lanes.get(spans.STREAM, []) + lanes.get(spans.REPLY_STREAM, []) for lanes in ffn_lanes]
        for r in attn:
            for stage in range(ov.NUM_STAGES if ov.uses_attn(spec.overlap) else 1):
                name = spans.stage_lane(stage)
                lane = r["phases"][phase_idx]["lanes"].get(name, [])
                split = spans.split_waits(lane, r["rank"], replies, stage=stage)
                rows.append((f"attn {r['rank']} {name}", spans.clip(split, window)))
        for r, lanes in zip(ffn, ffn_lanes):
            names = (spans.HOST, spans.STREAM) + ((spans.REPLY_STREAM,) if spans.REPLY_STREAM in lanes else ())
            for name in names:
                rows.append((f"ffn {r['rank']} {name}", spans.clip(lanes.get(name, []), window)))
        panels.append({"title": f"{spec.schedule} / {workload.name} / overlap {spec.overlap} "
                                f"(lengths {[list(l) for l in workload.lengths]})",
                       "schedule": spec.schedule, "workload": workload.name, "window_ns": window,
                       "rows": rows})
    return panels


def timeline_window(lane: list, layers: int) -> tuple | None:
    """(begin, end) ns of ``layers`` layers of an Attention stream lane (tags ``(batch, layer)``),
    from the first layer of its second batch (of its first when it ran only one)."""
    starts = [i for i, (name, _, _, tag) in enumerate(lane) if name == "attention" and tag[1] == 0]
    if not starts:
        return None
    first = starts[1] if len(starts) > 1 else starts[0]
    begin, end, seen = lane[first][1], lane[first][2], 0
    for name, _, span_end, _ in lane[first:]:
        end = span_end
        if name == "combine":
            seen += 1
            if seen == layers:
                break
    return begin, end


def timeline_json(panels: list) -> list:
    """Panels with span times in µs from the window's start (the JSON form)."""
    out = []
    for panel in panels:
        origin = panel["window_ns"][0]
        out.append({"title": panel["title"], "schedule": panel["schedule"], "workload": panel["workload"],
                    "window_us": (panel["window_ns"][1] - origin) / 1e3,
                    "rows": [{"label": label, "spans": [[name, (b - origin) / 1e3, (e - origin) / 1e3,
                                                         list(tag) if isinstance(tag, tuple) else tag]
                                                        for name, b, e, tag in lane]}
                             for label, lane in panel["rows"]]})
    return out


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


def draw_sweep(points: list, title: str):
    """``draw(plt)``: async/lockstep achieved (solid) and ideal (dashed) vs skew, one colour
    per split."""
    def _draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for index, split in enumerate(dict.fromkeys(p["split"] for p in points)):
            mine = sorted((p for p in points if p["split"] == split), key=lambda p: p["skew"])
            color = f"C{index}"
            skews = [p["skew"] for p in mine]
            ax.plot(skews, [p["ratio"] for p in mine], "o-", color=color, label=f"{split}: achieved")
            ideal = [(p["skew"], p["ideal"]) for p in mine if p.get("ideal") is not None]
            if ideal:
                ax.plot(*zip(*ideal), "x--", color=color, label=f"{split}: ideal")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        skews = sorted({p["skew"] for p in points})
        ax.set_xticks(skews, [f"{s}x" for s in skews])
        ax.set(xlabel="token skew (replica 0 : the others)", ylabel="async / lockstep tokens/s")
        ax.legend(fontsize=7)
        ax.set_title(title, fontsize=8)
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
          f"{report['duration_s']} s per phase, solo {report['solo_duration_s']} s per replica")
    for w in report["workloads"]:
        print(f"workload {w['name']}: request lengths per replica {w['lengths']}")
    if report["overlap"] != "none":
        print(f"overlap: {report['overlap']} ({METHOD['overlap']})")
    print(results_tables(report["results"], report["comparison"]))
    print()
    headlines = [bc.short_replica_line(workload, "batch time (mean)", entry["short_replica"])
                 for workload, entry in report["comparison"].items() if "short_replica" in entry]
    if headlines:
        print("\n".join(headlines) + "\n")
    print(bc.targets_table(report["targets"]))


def results_tables(results: list, comparison: dict) -> str:
    """Per replica, per FFN side, and the ideal-ratio table."""
    rows = []
    for r in results:
        for rep in r["replicas"]:
            solo = rep.get("solo")
            rows.append((r["workload"], r["schedule"], r["tokens_per_s"], rep["rank"], rep["batches"],
                         rep["tokens_per_s"], solo["tokens_per_s"] if solo else None, rep["latency_p50_ms"],
                         rep["latency_p90_ms"], rep["latency_p99_ms"]))
    parts = [bc.format_table(("workload", "schedule", "total tok/s", "replica", "batches", "replica tok/s",
                              "solo tok/s", "p50 ms", "p90 ms", "p99 ms"), rows), ""]
    ffn_rows = [(r["workload"], r["schedule"], r["ffn"]["busy_fraction"], r["ffn"]["items_waiting_mean"],
                 r["ffn"]["items_waiting_max"], r["ffn"]["items_per_s"]) for r in results]
    parts += [bc.format_table(("workload", "schedule", "FFN busy", "waiting mean", "waiting max",
                               "FFN items/s"), ffn_rows), ""]
    ideal_rows = [(w, e["ratio"], e.get("ideal"), e.get("achieved_fraction"),
                   " / ".join(f"{m:.3g}" for m in e.get("solo_batch_ms", [])),
                   " / ".join(f"{m:.3g}" for m in e.get("async_batch_ms", [])),
                   " / ".join(f"{m:.3g}" for m in e.get("lockstep_batch_ms", [])))
                  for w, e in comparison.items()]
    parts.append(bc.format_table(("workload", "async/lockstep", "ideal", "fraction of ideal",
                                  "solo batch ms", "async batch ms", "lockstep batch ms"), ideal_rows))
    corun = corun_table(results)
    if corun:
        parts += ["", corun]
    return "\n".join(parts)


def corun_table(results: list) -> str | None:
    """The co-run solo round (None where it did not run): per replica through the FFN its mean
    batch and the FFN's busy fraction in its window, and per background replica there its
    attention-only batches (``solo["corun"]["background"]``)."""
    rows = []
    for r in results:
        for rep in r["replicas"]:
            corun = (rep.get("solo") or {}).get("corun") or {}
            for bg in corun.get("background", ()):
                rows.append((r["workload"], rep["rank"], corun["batch_mean_ms"],
                             (corun.get("ffn") or {}).get("busy_fraction"), bg["rank"], bg["batches"], bg["layers"],
                             bg["batch_p10_ms"], bg["batch_median_ms"], bg["batch_p90_ms"], bg["layer_mean_ms"],
                             bg["covered_fraction"]))
    if not rows:
        return None
    return bc.format_table(("workload", "co-run replica", "batch ms", "FFN busy", "background", "bg batches",
                            "bg layers", "bg p10 ms", "bg median ms", "bg p90 ms", "bg ms/layer",
                            "bg covered"), rows)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_common_args(parser, quick_help="4 layers, short phases (< 4 min on one H200)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=None,
                        help="default: both (--overlap all: async)")
    parser.add_argument("--workloads", nargs="+", choices=("uniform", "skewed"), default=None,
                        help="default: both (--overlap all: uniform)")
    parser.add_argument("--overlap", choices=ov.CHOICES, default="none",
                        help="attn: two micro-batch stages on two streams; ffn: FFNWorker(overlap=True); "
                             "both; all: each variant in turn, gains vs none (bench_afd_overlap.json). "
                             "Not none: --requests defaults to 2 and --uniform-len to half its default")
    for name, kind, text in (
            ("layers", int, "layers (quick: 4, full: 26)"), ("duration", float, "seconds per phase"),
            ("warmup", int, "warm-up batches per phase"), ("attn", int, "Attention replicas"),
            ("ffn", int, "FFN ranks"), ("long-len", int, "skewed: replica 0's request length"),
            ("short-len", int, "skewed: other replicas' request length"),
            ("uniform-len", int, "uniform: request length"), ("requests", int, "requests per batch"),
            ("hidden", int, None), ("heads", int, None), ("experts", int, None), ("top-k", int, None),
            ("shared", int, "shared experts"), ("intermediate", int, "expert intermediate size"),
            ("mps-attn-pct", int, "MPS SM share of each Attention process (one GPU)"),
            ("mps-ffn-pct", int, "MPS SM share of each FFN process (one GPU)"),
            ("solo-duration", float, "async: seconds each replica runs alone after each phase, for "
                                     "the ideal ratio (0: skip; quick: 2 s cuda, 0.3 s host)")):
        parser.add_argument(f"--{name}", type=kind, default=None, help=text)
    parser.add_argument("--placement", default=None,
                        help="per rank GPU[:SM percent], Attention ranks first, e.g. '0:50,0:50,1' "
                             "(both replicas on GPU 0 at half its SMs, the FFN on GPU 1); "
                             "overrides --mps-attn-pct/--mps-ffn-pct")
    parser.add_argument("--solo-background", choices=("attention", "none"), default="attention",
                        help="attention: after the solo round, a co-run solo round (each replica through the "
                             "FFN while the others run their attention without the transport); none: skip it")
    parser.add_argument("--solo-spinners", type=int, nargs="+", default=[], metavar="N",
                        help="after the solo rounds, per N a round 'spinN': each replica through the FFN while "
                             "the others keep N one-block waits spinning (no transport, no attention), what a "
                             "waiting replica puts beside the FFN's GEMMs (host backend: N = 1, a polling core)")
    parser.add_argument("--no-ffn-stats", dest="ffn_stats", action="store_false",
                        help="run the FFN ranks without the recorder (no busy fraction / items waiting)")
    parser.add_argument("--timeline", action="store_true",
                        help="record every rank's spans; write bench_afd_timeline.json/.png")
    parser.add_argument("--timeline-layers", type=int, default=4, help="layers of replica 0 in the timeline")
    parser.add_argument("--sweep", action="store_true",
                        help="skew x split sweep (--sweep-skews, --sweep-placements); bench_afd_sweep.json/.png")
    parser.add_argument("--sweep-skews", type=int, nargs="+", default=[1, 4, 16],
                        help="token ratios replica 0 : the others (replica 0 keeps --long-len)")
    parser.add_argument("--sweep-placements", nargs="+", default=None,
                        help="one --placement string per Attention:FFN split (default: --placement, "
                             "else the default split)")
    parser.add_argument("--gemm-sm-carveout", type=bc.gemm_sm_carveout_arg, default="auto", metavar="auto|N",
                        help="FFN ranks: FFNWorker(gemm_sm_carveout=...), the expert GEMMs leave N SMs "
                             "free (docs/design/performance-decisions.md; auto: the library default, 2 on a GPU; 0: "
                             "untouched; no effect on the host backend)")
    parser.add_argument("--max-batches", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=None, help="per launch, seconds")
    args = parser.parse_args(argv)
    if args.sweep and args.timeline:
        parser.error("--timeline records the plain run; run it without --sweep")
    if any(n < 1 for n in args.solo_spinners) or len(set(args.solo_spinners)) != len(args.solo_spinners):
        parser.error(f"--solo-spinners takes distinct counts >= 1, got {args.solo_spinners}")
    if args.timeline and not args.ffn_stats:
        parser.error("--timeline needs the FFN recorder (drop --no-ffn-stats)")
    if args.overlap != "none" and args.sweep:
        parser.error("--overlap runs the plain run; run it without --sweep")
    if args.overlap == "all" and args.timeline:
        parser.error("--timeline records one variant: pick --overlap none, attn, ffn or both")
    if ov.uses_attn(args.overlap) or args.overlap == "all":
        if args.requests is not None and args.requests < ov.NUM_STAGES:
            parser.error(f"--overlap {args.overlap} splits each batch by requests: --requests must be >= 2")
    return args


def run_launches(args, backend: str, dims: Dims, workloads: tuple, placement: tuple, mps: dict,
                 timeline: bool = False, overlap: str = "none") -> tuple[list, set, list]:
    """One launch per schedule, in the ``overlap`` variant: (rows, Attention devices, timeline panels)."""
    solo = args.solo_duration * args.attn * (1 + (args.solo_background == "attention") + len(args.solo_spinners))
    timeout = args.timeout or (120.0 + len(workloads) * (args.duration * 3 + solo * 2 + 60.0))
    rows, devices, panels = [], set(), []
    specs = [Spec(backend, args.poll_mode, schedule, dims, args.attn, args.ffn, workloads, args.duration,
                  args.warmup, args.max_batches, mps["attention_pct"], mps["ffn_pct"],
                  placement=placement, solo_duration_s=args.solo_duration,
                  solo_background=args.solo_background == "attention",
                  solo_spinners=tuple(args.solo_spinners), timeline=timeline,
                  ffn_stats=args.ffn_stats, overlap=overlap, gemm_sm_carveout=args.gemm_sm_carveout)
             for schedule in args.schedules]
    for spec in bc.progress(specs, "bench_afd", lambda s: f"schedule={s.schedule} overlap={s.overlap} "
                                                          f"{args.attn}A{args.ffn}F"):
        results = run_schedule(spec, timeout)
        devices.update(r["device"] for r in results if r["role"] == "attention")
        rows += summarize(spec, results)
        if timeline:
            panels += timeline_panels(spec, results, args.timeline_layers)
    return rows, devices, panels


def base_report(args, backend: str, dims: Dims, mps: dict, devices: set) -> dict:
    return {"tool": "bench_afd", "backend": backend, "quick": args.quick,
            "label": HOST_LABEL if backend == "host" else "", "device": ", ".join(sorted(devices)),
            "run": bc.run_info(backend), "poll_mode": args.poll_mode if backend == "cuda" else "host",
            "model": dataclasses.asdict(dims), "topology": f"{args.attn}A{args.ffn}F", "mps": mps,
            "duration_s": args.duration, "warmup_batches": args.warmup, "solo_duration_s": args.solo_duration,
            "solo_background": args.solo_background, "solo_spinners": list(args.solo_spinners),
            "overlap": args.overlap, "gemm_sm_carveout": args.gemm_sm_carveout, "method": METHOD}


METHOD = {"tokens_per_s": "sum over replicas of tokens / own measured wall time",
          "latency": "wall time of one batch (all layers, one sync at the end); p50/p90/p99 nearest rank",
          "stop": "async: own deadline; lockstep: same batch count, decided by replica 0",
          "solo": "async launch, after each phase: each replica alone in turn (others at a barrier), "
                  "one warm-up batch, then --solo-duration s; batch_mean_ms = wall / batches; ffn: the FFN's "
                  "busy fraction and items/s inside that window (its time per item serving one replica)",
          "corun_background": "co-run solo round: per other replica, its attention-only batches wholly "
                              "inside the co-run row's window (host perf_counter_ns, each timed to after its "
                              "synchronization): batches, layers, batch p10/median/p90/mean ms, mean / layers, "
                              "covered fraction of the window",
          "ideal": "(sum_a n_a / solo_a) / (sum_a n_a / lockstep_a), n_a tokens per batch, solo_a / "
                   "lockstep_a mean batch times; an upper bound of async/lockstep (a replica next to "
                   "the others is no faster than alone)",
          "achieved_fraction": "(async/lockstep) / ideal = async tokens/s / ideal async tokens/s",
          "short_replica": "workloads whose replicas differ in tokens per batch: the replica with the fewest; its "
                           "batch_mean_ms async / lockstep / solo and async/solo, async/lockstep (the headline)",
          "ffn_busy_fraction": "FFN compute-batch time (expert call start to first reply start; CUDA "
                               "events on cuda) inside the window every replica was measuring / window",
          "ffn_items_waiting": "per item taken: arrived-not-taken items in the window + items held "
                               "unserved (lockstep), mean/max over the items taken in the window",
          "overlap": "attn: two micro-batch stages (halves of the requests) on two streams, events only; "
                     "ffn: FFNWorker(overlap=True), replies on a reply stream (host: a reply thread); "
                     "gain = variant tokens/s / none tokens/s, same workload, one launch each"}


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = args.backend or bc.detect_backend()
    args = apply_defaults(args, backend)
    if backend != "cuda" and set(args.solo_spinners) - {1}:
        print(f"--solo-spinners {args.solo_spinners}: the host backend's spinner round is one polling core (N = 1)")
        return 2
    dims = Dims(layers=args.layers, hidden=args.hidden, heads=args.heads, experts=args.experts,
                top_k=args.top_k, shared=args.shared, intermediate=args.intermediate)
    if args.sweep:
        return run_sweep(args, backend, dims)
    workloads = make_workloads(args, args.attn)
    world = args.attn + args.ffn
    placement, mps = placement_split(args, backend, world, args.placement)
    print(f"placement: {mps['placement']}", flush=True)
    if args.overlap == "all":
        return run_overlap_all(args, backend, dims, workloads, placement, mps)
    started = time.perf_counter()
    rows, devices, panels = run_launches(args, backend, dims, workloads, placement, mps, args.timeline,
                                         overlap=args.overlap)
    comparison = compare(rows)
    ratios, targets = ratios_and_targets(rows, comparison)
    report = {**base_report(args, backend, dims, mps, devices),
              "workloads": [{"name": w.name, "lengths": [list(l) for l in w.lengths]} for w in workloads],
              "results": rows, "ratios": ratios, "comparison": comparison, "targets": targets,
              "wall_s": time.perf_counter() - started}
    json_path = bc.write_json(args.out, "bench_afd.json", report)
    title = (f"afd_cupy bench_afd ({backend}, {report['device']}, {report['run']['commit']}"
             + (f", overlap {args.overlap})" if args.overlap != "none" else ")"))
    plot_path = bc.save_plot(args.out, "bench_afd.png", draw(rows, title))
    print(f"wrote {json_path}" + (f" and {plot_path}" if plot_path else "") + f" in {report['wall_s']:.1f} s")
    if args.timeline:
        timeline_path = bc.write_json(args.out, "bench_afd_timeline.json", {
            "tool": "bench_afd", "backend": backend, "run": report["run"], "layers": args.timeline_layers,
            "clocks": "perf_counter_ns of each rank (cuda: stream events mapped onto it)",
            "panels": timeline_json(panels)})
        png = bc.save_plot(args.out, "bench_afd_timeline.png", spans.draw_timeline(panels, title + " timeline"))
        print(f"wrote {timeline_path}" + (f" and {png}" if png else ""))
    print_summary(report)
    return 0


def run_overlap_all(args, backend: str, dims: Dims, workloads: tuple, placement: tuple, mps: dict) -> int:
    """``--overlap all``: every variant of ``bench_overlap.VARIANTS`` in turn (one launch per
    schedule each), then each variant's gain over ``none``; writes bench_afd_overlap.json."""
    started = time.perf_counter()
    rows, devices = [], set()
    for variant in ov.VARIANTS:
        variant_rows, used, _ = run_launches(args, backend, dims, workloads, placement, mps, overlap=variant)
        rows += variant_rows
        devices |= used
    comparison = {v: compare([r for r in rows if r["overlap"] == v]) for v in ov.VARIANTS}
    entries = ov.gains(rows)
    targets = ov.gain_targets(entries)
    report = {**base_report(args, backend, dims, mps, devices), "mode": "overlap",
              "variants": list(ov.VARIANTS),
              "workloads": [{"name": w.name, "lengths": [list(l) for l in w.lengths]} for w in workloads],
              "results": rows, "comparison": comparison, "overlap_gains": entries, "targets": targets,
              "wall_s": time.perf_counter() - started}
    json_path = bc.write_json(args.out, "bench_afd_overlap.json", report)
    print(f"wrote {json_path} in {report['wall_s']:.1f} s")
    print()
    print(f"==== bench_afd overlap: backend={backend} commit={report['run']['commit']} "
          f"device={report['device']} ====")
    if report["label"]:
        print(report["label"])
    for w in workloads:
        print(f"workload {w.name}: request lengths per replica {[list(l) for l in w.lengths]}; "
              f"attn: stage 0 / stage 1 = {[[list(h) for h in ov.split_requests(l)] for l in w.lengths]}")
    print(ov.gains_table(entries))
    print()
    print(bc.targets_table(targets))
    return 0


def run_sweep(args, backend: str, dims: Dims) -> int:
    """The skew x split sweep (module doc)."""
    world = args.attn + args.ffn
    workloads = sweep_workloads(args.long_len, args.sweep_skews, args.requests, args.attn)
    splits = args.sweep_placements or [args.placement or ""]
    started = time.perf_counter()
    points, all_rows, devices, split_rows, mps = [], [], set(), [], None
    for split in splits:
        placement, mps = placement_split(args, backend, world, split)
        label = split or "default"
        print(f"split {label}: {mps['placement']}", flush=True)
        split_rows.append({"label": label, "placement": mps["placement"]})
        rows, used, _ = run_launches(args, backend, dims, workloads, placement, mps)
        devices |= used
        comparison = compare(rows)
        for workload, skew in zip(workloads, args.sweep_skews):
            entry = comparison.get(workload.name, {})
            busy = {r["schedule"]: r["ffn"]["busy_fraction"] for r in rows if r["workload"] == workload.name}
            waiting = {r["schedule"]: r["ffn"]["items_waiting_mean"] for r in rows
                       if r["workload"] == workload.name}
            points.append({"split": label, "skew": skew, "workload": workload.name,
                           "lengths": [list(l) for l in workload.lengths], "ratio": entry.get("ratio"),
                           "ideal": entry.get("ideal"), "achieved_fraction": entry.get("achieved_fraction"),
                           "ffn_busy_fraction": busy, "ffn_items_waiting_mean": waiting})
        all_rows += [dict(row, split=label) for row in rows]
    targets = []
    for p in points:
        targets.append(bc.target_row(f"fraction of ideal, {p['split']}, {p['skew']}x",
                                     f">= {IDEAL_FRACTION_TARGET}", p["achieved_fraction"], "",
                                     lambda v: v >= IDEAL_FRACTION_TARGET, note="issue #15"))
        if p["skew"] == 16:
            busy = p["ffn_busy_fraction"].get("async")
            targets.append(bc.target_row(f"async / lockstep, {p['split']}, 16x", ">= 1.8x", p["ratio"], "x",
                                         lambda v: v >= 1.8, note="issue #15, where the FFN is not saturated"
                                         + ("" if busy is None else f"; FFN busy {busy:.2f} (async)")))
    report = {**base_report(args, backend, dims, mps, devices), "mode": "sweep",
              "skews": list(args.sweep_skews), "splits": split_rows, "points": points,
              "results": all_rows, "targets": targets, "wall_s": time.perf_counter() - started}
    json_path = bc.write_json(args.out, "bench_afd_sweep.json", report)
    title = (f"afd_cupy bench_afd sweep ({backend}, {report['device']}, {report['run']['commit']}; "
             f"replica 0: {args.long_len} tokens/request)")
    plot_path = bc.save_plot(args.out, "bench_afd_sweep.png", draw_sweep(points, title))
    print(f"wrote {json_path}" + (f" and {plot_path}" if plot_path else "") + f" in {report['wall_s']:.1f} s")
    print()
    print(f"==== bench_afd sweep: backend={backend} commit={report['run']['commit']} "
          f"device={report['device']} ====")
    if report["label"]:
        print(report["label"])
    rows = [(p["split"], f"{p['skew']}x", p["ratio"], p["ideal"], p["achieved_fraction"],
             p["ffn_busy_fraction"].get("async"), p["ffn_busy_fraction"].get("lockstep"),
             p["ffn_items_waiting_mean"].get("async")) for p in points]
    print(bc.format_table(("split", "skew", "async/lockstep", "ideal", "fraction of ideal", "FFN busy async",
                           "FFN busy lockstep", "waiting async"), rows))
    print()
    print(bc.targets_table(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
