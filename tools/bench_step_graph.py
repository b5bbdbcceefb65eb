#!/usr/bin/env python3
"""Decode step of L layers, Attention side: eager loop vs one captured CUDA graph (issue #13).

The same step run eagerly and captured once (afd_cupy.attention.step_graph.DecodeStepGraph), in one run,
for each number of micro-batch stages S in ``--stages`` (default 1 2): S > 1 splits the T rows
into S micro-batches issued as a software pipeline on one stream (the attention of one
micro-batch runs while the others' FFN round trips are in flight; every rank's ConnectorConfig
then has max(--stages) stages, and S = 1 runs on that connector as the plain step).
``--stage-streams`` picks where the S micro-batches are issued: ``one`` (default) all on one
stream, ``per-stage`` each on its own stream (``DecodeStepGraph(stage_streams=True)``: S
independent chains, parallel branches of the captured graph), ``both`` each S > 1 both ways in
the same run (rows carry ``stage_streams``: ``one`` / ``per-stage``; rows without the key, from
older runs, are ``one``). S = 1 is one stream either way (run once). With per-stage rows the
report adds a table per (T, L, S > 1): the captured per-layer median of each variant and
the ratios per-stage / one stream and each / S = 1 (ratios within one run: machines are noisy).

1AnF (default 1A1F), cuda backend, hidden 7168, top-8 of 64 experts, bf16. Attention side:
per layer a fixed bf16 linear (one [H, H] weight shared by the layers), the gate, send,
``recv_ffn_output(blocking=False)``, the residual add (afd_cupy.testing.step_model). FFN side:
``GraphFFNServer(identity=True)`` (``--ffn graph``, default) or an eager ``FFNWorker`` with
identity experts (``--ffn eager``); ``--experts moe``: real bf16 experts instead (random weights
of ``--intermediate`` width and ``--shared-experts`` shared experts; one layer's weights serve
every layer, so L = 50 costs one layer's memory on the source side; the graph FFN stacks its own
copies, one per layer), e.g. DeepSeek-V2-Lite's shape with ``--hidden 2048 --top-k 6
--intermediate 1408 --shared-experts 2``. For each batch size, each L and each S: one DecodeStepGraph,
then ``--warmup`` + ``--iters`` iterations, each timing one eager step (``run_eager`` +
``check_errors()``) and one replay (``replay`` + ``check_errors()``), host wall time; the
last outputs of both are compared. Reports per-step and per-layer median / p10 / p90 µs, the
ratio captured / eager and the captured step's ratio to S = 1 (same T and L); prints a
table, writes ``bench_step_graph.json`` to --out; exits 1 when the outputs differ. (With
identity experts each layer about doubles the values; bf16's range holds them at L = 50, the
comparison is relative and in fp64.)

``--gemm-sm-carveout auto|N`` (default auto, the library's default: 2 on a GPU): the FFN ranks'
expert GEMMs leave N SMs free (``GraphFFNServer`` / ``FFNWorker(gemm_sm_carveout=...)``,
docs/design/performance-decisions.md "SM carve-out"), so that the wait kernel spinning next to them does not push
a CTA's tiles to the tail; the argument is in the JSON config, each FFN rank's resolved value
in its "ffn" entry and the report's title. ``0`` measures without (one launch each).

``--gate-impl auto|torch|kernel`` (default auto): the gate of every layer
(``DecodeStepGraph(gate_impl=...)``): the one-kernel greedy gate (``raw_kernels/model/gate.cu``) or
torch's ops; in the JSON config and the report's title. Run both to compare (one launch each).

``--trace`` (graph FFN, one FFN rank): device timestamps at the kernel boundaries of both sides
(tools/device_trace.py). After the timed iterations of each one-stage case, ``--trace-iters``
eager steps and as many replays run with the trace rows reset before each; each Attention round
trip is matched with the FFN replay that served it and split into telescoping phases (dispatch,
doorbell to FFN, stage, gather, experts, reply, reply to Attention, combine) on the GPU's
``%globaltimer``. Printed as a table, written to the JSON (``traces``) and drawn as
``step_phases.png``; beside each phase its floor (one graph node + the bytes its kernel moves,
``bench_common.kernel_bytes``, at the device copy rate; both measured in the same run) and
time / floor (JSON: ``node_us``, ``copy_gbps``, per trace ``kernel_bytes`` and ``floors``). The stamps are extra kernels on both sides: a traced run's timing table is
slower than an untraced one. With ``--experts moe`` the "FFN experts" phase is the expert GEMMs
(plus one stamp hop, ~1.3 µs) and the row "round trip - FFN experts" is what the round trip
costs beyond them (issue #13: <= 30 µs; a target row when traced). Phases across ranks need both on one GPU (one clock).

Runs on one GPU (all processes on GPU 0: start CUDA MPS first, as tools/gpu_suite.sh does)
or one GPU per process when there are enough (--num-gpus).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_common as bc  # noqa: E402
import device_trace as dt  # noqa: E402
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.moe.gates import GATE_IMPLS  # noqa: E402

FFN_MODES = ("graph", "eager")
#: where the micro-batches of a step are issued: one stream, a stream per stage (--stage-streams)
ONE_STREAM, PER_STAGE = "one", "per-stage"
STREAM_MODES = (ONE_STREAM, PER_STAGE, "both")
#: issue #13: pipelined per-layer cost of a 50-layer captured step
TARGET_US_PER_LAYER, TARGET_LAYERS = 40.0, 50
#: issue #13: with real experts the round trip <= the expert GEMMs' time + 30 µs
TARGET_BEYOND_EXPERTS_US = 30.0
#: the captured step's output must match the eager step's (the same kernels on the same inputs)
OUT_CHECK_TOL = 2e-2
#: FFN trace ring rows (a row per replay, idle ones too; the last this many are kept)
FFN_TRACE_ROWS = 1 << 18


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 10, 50], help="L values")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32], help="batch sizes T")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2],
                        help="micro-batch stages S per step (each <= every T)")
    parser.add_argument("--stage-streams", choices=STREAM_MODES, default=ONE_STREAM,
                        help="S > 1: every micro-batch on one stream, each on its own stream "
                             "(DecodeStepGraph(stage_streams=True)), or both in the same run")
    parser.add_argument("--ffn", choices=FFN_MODES, default="graph",
                        help="FFN side: GraphFFNServer(identity) or an eager FFNWorker (identity)")
    parser.add_argument("--num-ffn", type=int, default=1)
    parser.add_argument("--stand-in", choices=("linear", "elementwise"), default="linear",
                        help="Attention stand-in per layer: x + x W^T with one [H, H] weight (streams "
                             "H*H*2 bytes through L2 every layer, as a model's attention does) or x * 1")
    parser.add_argument("--wire-mode", choices=("pair", "dedup"), default="pair",
                        help="ConnectorConfig.wire_mode of every rank (docs/design/dedup.md)")
    parser.add_argument("--dispatch", choices=("fused", "two-kernel"), default="fused",
                        help="ConnectorConfig.fused_dispatch: one kernel (afd_dispatch_fused; dedup: "
                             "afd_dedup_dispatch_fused) or plan + scatter (dedup: plan + rows + scatter)")
    parser.add_argument("--dedup-dispatch", choices=("plan", "ll", "both"), default="plan",
                        help="ConnectorConfig.dedup_dispatch (with --wire-mode dedup): "
                             "afd_dedup_dispatch_fused / the separate kernels (plan), "
                             "afd_dedup_dispatch_ll (ll), or both one after the other in this run "
                             "with an A/B table (their JSON: bench_step_graph_{plan,ll}.json)")
    parser.add_argument("--ffn-stage", choices=("fused", "two-kernel"), default="fused",
                        help="graph FFN: afd_graph_wait_stage (GraphFFNServer(fused_wait_stage=True)) "
                             "or afd_wait_any + afd_graph_stage")
    parser.add_argument("--experts", choices=("identity", "moe"), default="identity",
                        help="FFN experts: identity (no GEMMs) or real random bf16 experts (module doc)")
    parser.add_argument("--intermediate", type=int, default=256, help="moe_intermediate_size")
    parser.add_argument("--shared-experts", type=int, default=1, help="num_shared_experts")
    parser.add_argument("--gemm-sm-carveout", type=bc.gemm_sm_carveout_arg, default="auto", metavar="auto|N",
                        help="FFN ranks: gemm_sm_carveout of GraphFFNServer / FFNWorker (the expert "
                             "GEMMs leave N SMs free; auto: the library default, 2 on a GPU; 0: "
                             "untouched). Only GEMMs: --experts moe")
    parser.add_argument("--ffn-expert-gemm", choices=("grouped_mm", "stream"), default="grouped_mm",
                        help="graph FFN: GraphFFNServer(expert_gemm=...), torch's grouped GEMMs or "
                             "moe.stream_gemm's Triton kernels (decision 0032). Only GEMMs: --experts moe")
    parser.add_argument("--gate-impl", choices=GATE_IMPLS, default="auto",
                        help="the Attention side's gate: DecodeStepGraph(gate_impl=...) (auto: the "
                             "one-kernel greedy gate, raw_kernels/model/gate.cu; torch: torch's ops)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=None, help="default 200 (30 with --quick)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-gpus", type=int, default=None, help="default: detected (1: all on GPU 0)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trace", action="store_true",
                        help="device timestamps per phase of each round trip (tools/device_trace.py)")
    parser.add_argument("--trace-iters", type=int, default=20, help="traced steps per case and path")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    if args.trace and (args.ffn != "graph" or args.num_ffn != 1 or args.trace_iters < 1):
        parser.error("--trace needs --ffn graph, --num-ffn 1 and --trace-iters >= 1 (one stream per "
                     "side and one FFN replay per round trip)")
    if min(args.layers) < 1 or min(args.tokens) < 1 or args.num_ffn < 1 or min(args.stages) < 1:
        parser.error("--layers, --tokens, --stages and --num-ffn must be >= 1")
    if args.intermediate < 1 or args.shared_experts < 0:
        parser.error("--intermediate must be >= 1 and --shared-experts >= 0")
    if max(args.stages) > min(args.tokens):
        parser.error(f"--stages {max(args.stages)} > --tokens {min(args.tokens)}: every micro-batch needs a row")
    if args.dedup_dispatch != "plan" and args.wire_mode != "dedup":
        parser.error("--dedup-dispatch ll|both needs --wire-mode dedup")
    args.iters = args.iters or (30 if args.quick else 200)
    return args


def stream_variants(mode: str, stages: int) -> tuple:
    """The stream variants run for S = ``stages`` under ``--stage-streams mode``: S = 1 is one
    stream whatever the mode (a stream per stage is the same step there)."""
    if stages == 1 or mode == ONE_STREAM:
        return (ONE_STREAM,)
    return (PER_STAGE,) if mode == PER_STAGE else (ONE_STREAM, PER_STAGE)


def connector_config(args) -> ConnectorConfig:
    """Every rank's config: max(--stages) micro-batch stages (ring_depth follows), so that one
    connector serves every S of the run (a step may use fewer stages than its connector)."""
    most = max(args.stages)
    return ConnectorConfig(async_moe_ubatching=most > 1, async_moe_num_ubatches=max(most, 2),
                           wire_mode=args.wire_mode, fused_dispatch=args.dispatch == "fused",
                           dedup_dispatch="plan" if args.dedup_dispatch == "both" else args.dedup_dispatch)


def model_config(args) -> ModelConfig:
    return ModelConfig(hidden_size=args.hidden, num_experts=args.num_experts, top_k=args.top_k,
                       moe_intermediate_size=args.intermediate, num_shared_experts=args.shared_experts,
                       dtype="bfloat16",
                       max_num_batched_tokens=max(args.tokens), num_layers=max(args.layers))


# --------------------------------------------------------------------------- ranks

def _rank(ctx, args) -> dict:
    import torch

    from afd_cupy.connector import AFDConnector

    torch.cuda.set_device(ctx.device_id or 0)
    device = torch.device("cuda", ctx.device_id or 0)
    role, role_rank = ("attention", 0) if ctx.rank == 0 else ("ffn", ctx.rank - 1)
    conn = AFDConnector(model_config(args), TopologyConfig(1, args.num_ffn), connector_config(args), role=role,
                        role_rank=role_rank, store=ctx.store(), job_id=ctx.job_id, backend="cuda",
                        device_id=ctx.device_id)
    try:
        if role == "ffn":
            return _ffn(conn, args)
        try:
            return _attention(conn, args, device)
        finally:
            conn.announce_shutdown()
    finally:
        conn.close()


def ffn_experts(conn, args):
    """(routed, shared) per layer for ``--experts moe`` (one layer's random weights, the same
    tensors for every layer: this rank's local experts and the fused shared experts or None),
    or (None, None) for identity experts."""
    if args.experts != "moe":
        return None, None
    from afd_cupy import moe
    from afd_cupy.testing.scenario import layer_weights

    model, epr = conn.model, conn.topology.expert_per_rank
    routed, shared = layer_weights(model, 0, 0, conn.path.device)
    local = moe.local_experts(routed, conn.role_rank, epr)
    return [local] * model.num_layers, [shared] * model.num_layers


def _ffn(conn, args) -> dict:
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.testing.reference import identity_experts

    routed, shared = ffn_experts(conn, args)
    if args.ffn == "graph":
        from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer

        trace = None
        if args.trace:  # installed before the capture: the stamps become graph nodes
            trace = dt.DeviceTrace(dt.FFN_POINTS, capacity=FFN_TRACE_ROWS)
            trace.install(dt.FFN_STAMPS)
        experts = ({"identity": True} if routed is None else
                   {"experts": routed, "shared": shared, "bucket_tokens": tuple(sorted(set(args.tokens)))})
        server = GraphFFNServer(conn, fused_wait_stage=args.ffn_stage == "fused",
                                gemm_sm_carveout=args.gemm_sm_carveout, expert_gemm=args.ffn_expert_gemm,
                                **experts)
        result = {"role": "ffn", "served": server.run(), "eager": server.num_eager,
                  "device_id": conn.path.device_id, "gemm_sm_carveout": server.gemm_sm_carveout,
                  "expert_gemm": server.expert_gemm}
        if trace is not None:
            result["trace_rows"] = trace.rows()
        return result
    carveout = {"gemm_sm_carveout": args.gemm_sm_carveout}
    worker = (FFNWorker(conn, expert_fn=identity_experts, **carveout) if routed is None
              else FFNWorker(conn, routed, shared, **carveout))
    return {"role": "ffn", "served": worker.run(), "gemm_sm_carveout": worker.gemm_sm_carveout}


def _attention(conn, args, device) -> dict:
    import torch

    from afd_cupy.attention.step_graph import DecodeStepGraph
    from afd_cupy.testing.step_model import LinearStandIn

    model = conn.model
    stand_in = LinearStandIn(model.num_layers, model.hidden_size, model.num_experts,
                             dtype=torch.bfloat16, device=device, seed=0, shared_weights=True,
                             linear=args.stand_in == "linear", normalize=args.experts == "moe")
    gen = torch.Generator().manual_seed(1)
    rows, traces = [], []
    trace = None
    if args.trace:  # before any capture: every step graph holds its stamps
        trace = dt.DeviceTrace(dt.ATTENTION_POINTS, capacity=args.trace_iters * max(args.layers))
        trace.install(dt.ATTENTION_STAMPS)
    for num_tokens in args.tokens:
        hidden = torch.randn(num_tokens, model.hidden_size, generator=gen).to(torch.bfloat16).to(device)
        for layers in args.layers:
            for stages in args.stages:
                for variant in stream_variants(args.stage_streams, stages):
                    step = DecodeStepGraph(conn, stand_in.attention_fns()[:layers], stand_in.router_fns()[:layers],
                                           num_tokens=num_tokens, stages=stages, warmup=2,
                                           stage_streams=variant == PER_STAGE, gate_impl=args.gate_impl)
                    eager_us, graph_us = [], []
                    for i in range(args.warmup + args.iters):
                        t0 = time.perf_counter()
                        eager = step.run_eager(hidden)
                        conn.check_errors()
                        t1 = time.perf_counter()
                        captured = step.replay(hidden)
                        conn.check_errors()
                        t2 = time.perf_counter()
                        if i >= args.warmup:
                            eager_us.append((t1 - t0) * 1e6)
                            graph_us.append((t2 - t1) * 1e6)
                    rows.append(summarize(num_tokens, layers, eager_us, graph_us, _rel_diff(captured, eager),
                                          stages=stages, stage_streams=variant))
                    if trace is not None and stages == 1:  # S > 1: the stages' rows interleave
                        for mode, run in (("eager", step.run_eager), ("graph", step.replay)):
                            torch.cuda.synchronize()
                            trace.reset()
                            for _ in range(args.trace_iters):
                                run(hidden)
                                conn.check_errors()
                            traces.append({"tokens": num_tokens, "layers": layers, "mode": mode,
                                           "attention_rows": trace.rows(),
                                           "kernel_bytes": traced_kernel_bytes(conn, stand_in, hidden)})
                    del step, eager, captured
                    torch.cuda.synchronize()
    result = {"role": "attention", "device": bc.device_name(device), "rows": add_stage_ratios(rows),
              "device_id": conn.path.device_id, "traces": traces}
    if trace is not None:  # the floors' two terms, measured on this GPU in this run
        result["node_us"], result["copy_gbps"] = dt.measure_node_us(device), bc.measure_copy_gbps(device)
    return result


def traced_kernel_bytes(conn, stand_in, hidden) -> dict:
    """bench_common.KernelBytes (as a dict) of one round trip of ``hidden`` routed as layer 0
    routes it (with one FFN rank, as --trace runs, every route moves the same bytes)."""
    _, ids = conn.select_experts(stand_in.router(0, stand_in.attention(0, hidden)[1]))
    return bc.kernel_bytes(conn.layout, ids.cpu().numpy(), num_ffn_ranks=conn.topology.num_ffn_ranks,
                           has_shared=conn.model.num_shared_experts > 0).as_dict()


def _rel_diff(captured, eager) -> float:
    """Relative L2 difference of the captured and the eager step's outputs (inf with a NaN)."""
    got, want = captured.double(), eager.double()  # fp64: identity experts grow the values per layer
    if bool(got.isnan().any()) or bool(want.isnan().any()):
        return float("inf")
    return float((got - want).norm()) / (float(want.norm()) or 1.0)


# --------------------------------------------------------------------------- report

def summarize(num_tokens: int, layers: int, eager_us: list, graph_us: list, out_rel_diff: float,
              stages: int = 1, stage_streams: str = ONE_STREAM) -> dict:
    """One table row: per-step and per-layer median / p10 / p90 of both paths (µs), the
    ratio of the medians captured / eager, and the outputs' relative difference;
    ``stage_streams``: the variant (``one`` / ``per-stage``)."""
    row = {"tokens": num_tokens, "layers": layers, "stages": stages, "stage_streams": stage_streams,
           "iters": len(graph_us), "out_rel_diff": out_rel_diff}
    for name, times in (("eager", eager_us), ("graph", graph_us)):
        for stat, value in (("median", bc.median(times)), ("p10", bc.percentile(times, 10)),
                            ("p90", bc.percentile(times, 90))):
            row[f"{name}_step_{stat}_us"] = value
            row[f"{name}_layer_{stat}_us"] = value / layers
    row["graph_over_eager"] = row["graph_step_median_us"] / row["eager_step_median_us"]
    return row


def add_stage_ratios(rows: list) -> list:
    """Each row's ``graph_over_s1``: its captured step median / the S = 1 row's of the same
    (tokens, layers); None without an S = 1 row. Returns ``rows``."""
    base = {(r["tokens"], r["layers"]): r["graph_step_median_us"] for r in rows if r.get("stages", 1) == 1}
    for r in rows:
        one = base.get((r["tokens"], r["layers"]))
        r["graph_over_s1"] = r["graph_step_median_us"] / one if one else None
    return rows


def stream_ratios(rows: list) -> list:
    """Per (tokens, layers, S > 1) with a per-stage-streams row: the captured step's per-layer
    median of S = 1 (``s1_layer_us``), of the one-stream variant (``one_layer_us``) and of the
    per-stage one (``per_stage_layer_us``), and the ratios ``per_stage_over_one``,
    ``per_stage_over_s1``, ``one_over_s1`` (None where a row is missing). Rows without
    ``stage_streams`` are one-stream rows. Sorted by (tokens, layers, S)."""
    by_key = {(r["tokens"], r["layers"], r.get("stages", 1), r.get("stage_streams", ONE_STREAM)):
              r["graph_layer_median_us"] for r in rows}

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = []
    for tokens, layers, stages in sorted({key[:3] for key in by_key if key[3] == PER_STAGE and key[2] > 1}):
        s1 = by_key.get((tokens, layers, 1, ONE_STREAM))
        one = by_key.get((tokens, layers, stages, ONE_STREAM))
        per_stage = by_key[(tokens, layers, stages, PER_STAGE)]
        out.append({"tokens": tokens, "layers": layers, "stages": stages, "s1_layer_us": s1,
                    "one_layer_us": one, "per_stage_layer_us": per_stage,
                    "per_stage_over_one": ratio(per_stage, one), "per_stage_over_s1": ratio(per_stage, s1),
                    "one_over_s1": ratio(one, s1)})
    return out


def stream_table(ratios: list) -> str:
    headers = ("tokens", "L", "S", "S=1 /layer", "one stream /layer", "per-stage /layer",
               "per-stage/one", "per-stage/S=1", "one/S=1")
    return bc.format_table(headers, [(r["tokens"], r["layers"], r["stages"], r["s1_layer_us"], r["one_layer_us"],
                                      r["per_stage_layer_us"], r["per_stage_over_one"], r["per_stage_over_s1"],
                                      r["one_over_s1"]) for r in ratios])


def _variant_note(row: dict) -> str:
    stages = row.get("stages", 1)
    note = f"{row['tokens']} tokens, {stages} stage(s)"
    if stages > 1:
        note += ", a stream per stage" if row.get("stage_streams", ONE_STREAM) == PER_STAGE else ", one stream"
    return note


def targets(rows: list, moe_traces: list | None = None) -> list:
    """Issue #13's per-layer target at the 50-layer step: the largest batch measured there,
    its best number of stages and stream variant (the pipelined step), named in the note; with
    ``moe_traces`` (real experts, traced on one clock) also the round trip beyond the expert
    GEMMs of the captured step at the largest traced batch."""
    at = [r for r in rows if r["layers"] == TARGET_LAYERS]
    most = max(r["tokens"] for r in at) if at else None
    best = min((r for r in at if r["tokens"] == most), key=lambda r: r["graph_layer_median_us"]) if at else None
    return [bc.target_row(f"captured {TARGET_LAYERS}-layer step, per layer (issue #13)",
                          f"<= {TARGET_US_PER_LAYER:.0f}", best and best["graph_layer_median_us"], "us",
                          lambda v: v <= TARGET_US_PER_LAYER,
                          note=_variant_note(best) if best else f"not run (--layers {TARGET_LAYERS})")] \
        + beyond_experts_target(moe_traces)


def beyond_experts_target(traces: list | None) -> list:
    """[] without traces; else one target row: the captured step's matched round trip less
    its "FFN experts" phase (median over round trips) at the largest traced batch."""
    if traces is None:
        return []
    traced = [t for t in traces if t.get("mode") == "graph" and t.get("beyond_experts")]
    best = max(traced, key=lambda t: (t["tokens"], t["layers"])) if traced else None
    value = best["beyond_experts"]["median_us"] if best else None
    note = (f"{best['tokens']} tokens, L={best['layers']}; FFN experts phase "
            f"{best['round_trip_phases']['FFN experts']['median_us']:.1f} us" if best
            else "no matched round trips (needs --trace on one GPU)")
    return [bc.target_row("round trip beyond the expert GEMMs (issue #13)", f"<= {TARGET_BEYOND_EXPERTS_US:.0f}",
                          value, "us", lambda v: v <= TARGET_BEYOND_EXPERTS_US, note=note)]


def table(rows: list) -> str:
    def cell(r, name, kind):
        return f"{r[f'{name}_{kind}_median_us']:.1f} [{r[f'{name}_{kind}_p10_us']:.1f}, {r[f'{name}_{kind}_p90_us']:.1f}]"

    headers = ("tokens", "L", "S", "streams", "eager step", "graph step", "eager /layer", "graph /layer",
               "graph/eager", "graph/S=1", "out diff")
    body = [(r["tokens"], r["layers"], r.get("stages", 1), r.get("stage_streams", ONE_STREAM),
             cell(r, "eager", "step"), cell(r, "graph", "step"),
             cell(r, "eager", "layer"), cell(r, "graph", "layer"), r["graph_over_eager"],
             r.get("graph_over_s1"), r["out_rel_diff"])
            for r in rows]
    return bc.format_table(headers, body)


def main(argv=None) -> int:
    args = parse_args(argv)
    if bc.detect_backend() != "cuda":
        print("bench_step_graph needs the cuda backend (a GPU, CuPy and NVSHMEM): a CUDA graph "
              "cannot capture the host backend", file=sys.stderr)
        return 2
    if args.dedup_dispatch != "both":
        return run(args)[1]
    reports, codes = {}, []
    for variant in ("plan", "ll"):  # the same run, one launch each
        reports[variant], code = run(argparse.Namespace(**{**vars(args), "dedup_dispatch": variant}),
                                     json_name=f"bench_step_graph_{variant}.json")
        codes.append(code)
    print()
    print(ab_table(reports["plan"], reports["ll"]))
    return max(codes)


def ab_table(plan: dict, ll: dict) -> str:
    """--dedup-dispatch both: captured per-layer median and (with --trace) each traced phase's
    median, plan vs ll, in µs, with ll / plan."""
    headers = ["what", "plan µs", "ll µs", "ll / plan"]
    body = []
    for a, b in zip(plan["rows"], ll["rows"]):
        body.append((f"T={a['tokens']} L={a['layers']} S={a.get('stages', 1)} graph per layer",
                     a["graph_layer_median_us"], b["graph_layer_median_us"]))
    for a, b in zip(plan.get("traces", ()), ll.get("traces", ())):
        phases_a = {**a["phases"], **a.get("round_trip_phases", {})}
        phases_b = {**b["phases"], **b.get("round_trip_phases", {})}
        for name in phases_a:
            if name in phases_b:
                body.append((f"{a['label']}: {name}", phases_a[name]["median_us"], phases_b[name]["median_us"]))
    rows = [[what, f"{x:.1f}" if x is not None else "-", f"{y:.1f}" if y is not None else "-",
             f"{y / x:.2f}" if x and y is not None else "-"] for what, x, y in body]
    return ("==== A/B: ConnectorConfig(dedup_dispatch='plan') vs 'll', same run ====\n"
            + bc.format_table(headers, rows))


def run(args, json_name: str = "bench_step_graph.json") -> tuple:
    """One launch of every rank with ``args``: (report, exit code)."""
    from afd_cupy.runtime.launch import launch
    from afd_cupy.wire import window_size_hint

    model, world = model_config(args), 1 + args.num_ffn
    env = bc.launch_env("cuda", world, window_size_hint(model, TopologyConfig(1, args.num_ffn), connector_config(args)))
    attn, *ffn = launch(_rank, world, args=(args,), timeout_s=600, num_gpus=args.num_gpus, env=env)
    report = {"tool": "bench_step_graph", "run": bc.run_info("cuda"), "device": attn["device"],
              "config": {"ffn": args.ffn, "num_ffn": args.num_ffn, "wire_mode": args.wire_mode, "dispatch": args.dispatch, "dedup_dispatch": args.dedup_dispatch, "ffn_stage": args.ffn_stage, "stand_in": args.stand_in, "experts": args.experts,
                         "intermediate": args.intermediate, "shared_experts": args.shared_experts, "hidden": args.hidden,
                         "num_experts": args.num_experts, "top_k": args.top_k, "iters": args.iters,
                         "warmup": args.warmup, "layers": args.layers, "tokens": args.tokens,
                         "stages": args.stages, "stage_streams": args.stage_streams,
                         "gemm_sm_carveout": args.gemm_sm_carveout, "gate_impl": args.gate_impl},
              "rows": attn["rows"], "stream_ratios": stream_ratios(attn["rows"]),
              "ffn": [{k: v for k, v in r.items() if k not in ("role", "trace_rows")} for r in ffn]}
    if args.trace:
        report["config"]["trace_iters"] = args.trace_iters
        report["node_us"], report["copy_gbps"] = attn["node_us"], attn["copy_gbps"]
        report["traces"] = trace_summaries(attn, ffn[0])
    report["targets"] = targets(attn["rows"], report.get("traces") if args.experts == "moe" else None)
    path = bc.write_json(args.out, json_name, report)
    print_report(report)
    if args.trace:
        summaries = {t["label"]: t for t in report["traces"]}
        plot = bc.save_plot(args.out, "step_phases.png", dt.draw_phases(
            summaries, f"decode round trip by phase, 1A1F, {args.wire_mode}, {report['device']}, {report['run'].get('commit', '')}"))
        if plot:
            print(f"wrote {plot}")
    print(f"wrote {path}")
    bad = [(r["tokens"], r["layers"], r.get("stages", 1), r.get("stage_streams", ONE_STREAM), r["out_rel_diff"])
           for r in report["rows"] if not r["out_rel_diff"] <= OUT_CHECK_TOL]
    if bad:
        print(f"CHECK FAILED: captured and eager outputs differ (tokens, L, S, streams, relative diff): {bad}")
        return report, 1
    return report, 0


def trace_summaries(attn: dict, ffn: dict) -> list:
    """One :func:`device_trace.phase_summary` per traced case (label ``T=.. L=.. eager|graph``);
    the FFN rows are shared (matched by time). Phases across ranks only on one GPU."""
    same_clock = attn.get("device_id") == ffn.get("device_id")
    out = []
    for t in attn["traces"]:
        summary = dt.phase_summary(t["attention_rows"], ffn.get("trace_rows"), same_clock=same_clock,
                                   layers=t["layers"])
        summary.update({"label": f"T={t['tokens']} L={t['layers']} {t['mode']}", "tokens": t["tokens"],
                        "layers": t["layers"], "mode": t["mode"], "kernel_bytes": t["kernel_bytes"]})
        summary["floors"] = dt.floor_rows(summary, t["kernel_bytes"], attn["node_us"], attn["copy_gbps"])
        out.append(summary)
    return out


def print_report(report: dict) -> None:
    cfg = report["config"]
    resolved = sorted({str(r.get("gemm_sm_carveout")) for r in report.get("ffn", ())})
    carveout = (f", GEMM SM carve-out {cfg.get('gemm_sm_carveout', 0)} = {'/'.join(resolved)}"
                if cfg.get("experts") == "moe" and resolved else "")
    mode = cfg["wire_mode"] + (f" (dedup_dispatch={cfg.get('dedup_dispatch', 'plan')})" if cfg["wire_mode"] == "dedup" else "")
    print(f"==== decode step, 1A{cfg['num_ffn']}F, {mode}, FFN {cfg['ffn']} ({cfg.get('experts', 'identity')}{carveout}), hidden {cfg['hidden']}, "
          f"top-{cfg['top_k']}, gate {cfg.get('gate_impl', 'torch')}, {report['device']}: eager loop vs one captured graph, S stages "
          "(µs: median [p10, p90]) ====")
    print(table(report["rows"]))
    if report.get("stream_ratios"):
        print()
        print("==== a stream per stage vs one stream: captured step, per layer (median µs) and ratios "
              "in this run ====")
        print(stream_table(report["stream_ratios"]))
    print()
    print(bc.targets_table(report["targets"]))
    if report.get("traces"):
        print()
        print("==== device trace: one round trip by phase (median µs, %globaltimer; stamps add a kernel "
              "per point) ====")
        headers, rows = dt.phase_table({t["label"]: t for t in report["traces"]})
        print(bc.format_table(headers, rows))
        print_floors(report)


def print_floors(report: dict) -> None:
    """Each traced case's phases beside their floors (the stamp closing a phase is one more
    node: a byte-free phase near 2x its floor is the stamp)."""
    for t in report.get("traces", ()):
        if t.get("floors"):
            print()
            print(f"==== {t['label']}: each phase against its floor ====")
            print(bc.floor_table(t["floors"], report["node_us"], report["copy_gbps"]))


if __name__ == "__main__":
    sys.exit(main())
