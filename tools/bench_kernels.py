#!/usr/bin/env python3
"""The decode round trip's kernels one by one, in one process on one GPU (issue #33).

A loopback 1A1F round trip: the Attention rank's dispatch writes into a plain device buffer
that stands for the FFN rank's window, the graph FFN's kernels serve it from there (identity
experts: no GEMM) and reply into a buffer that stands for the Attention window, and the
Attention side's wait and combine finish it, all on one stream:

    pair:   dispatch -> FFN wait + stage -> FFN reply -> Attention wait -> combine
    dedup:  dispatch -> FFN wait + stage -> FFN expand -> FFN reply -> Attention wait -> combine

(a combine of few blocks waits for its replies itself, as the cuda backend runs it: one phase
"Attention wait + combine", no wait kernel)

Every kernel is the library's own, launched through its spec builder with the arguments the
backends give it (``kernels.*_spec``); the state that carries a round trip to the next (seq
counters, ``last_seen`` on both sides, reply seqs, replay counter) lives in device memory as in
a real job, so the rows repeat with nothing restored. Device stamps (``afd_trace_stamp``,
tools/device_trace.py) between the kernels split each row into phases; the rows are captured
once into a CUDA graph and replayed ``--rows`` times. Nothing waits across processes here: a
wait kernel finds its flag already stored, so each phase is the kernel's own critical path (the
cross-process flag under MPS adds ~0.7 µs per direction, DESIGN.md §8).

A second timing runs the same rows with no stamps (``no stamps``: ``CHAIN_ROWS`` rows back to
back in one graph, timed by events): the round trip as a captured step runs it.

Beside each phase its floor: one graph node (a stamp kernel's node cost, measured here) plus the
bytes the kernel must move (``bench_common.kernel_bytes``) at the rate of a large device copy
measured in the same run. After the timed rows, the output is poisoned with NaN, one more row
runs, and its combine output is checked against numpy (identity experts: ``(1 + sum_k w) * x``),
with every status OK and the last replay served; ``CHECK FAILED`` lines and exit code 1 otherwise.

Variants (``--configs``, each ``MODE:DISPATCH:FFN``): MODE ``pair`` | ``dedup``; DISPATCH the
dispatch kernel (``fused``: afd_dispatch_fused / afd_dedup_dispatch_fused; ``ll``:
afd_dedup_dispatch_ll); FFN ``identity`` (no staging: the reply reads the received rows) or
``staging`` (dedup: the expand scatters every partial into the grouped staging rows the GEMMs
would read, and the reply reduces from there: the data path of real experts minus the GEMMs).

``--eager --no-stamps`` launches the rows one kernel after another with no stamps and no graph:
the form to run under Nsight Compute (``ncu --kernel-name regex:afd_ ...``).

    PYTHONPATH=$PWD python3 tools/bench_kernels.py --out OUT [--tokens 1 128] [--configs ...]
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

DEFAULT_CONFIGS = ("pair:fused:identity", "dedup:fused:identity", "dedup:ll:identity",
                   "dedup:fused:staging")
#: launch name -> its phase (the stamps split the row after every launch)
PHASE_OF = {"dispatch": "dispatch", "stage": "FFN wait + stage", "expand": "FFN expand",
            "reply": "FFN reply", "wait": "Attention wait", "combine": "combine"}
#: the combine's phase when it waits for the replies itself (no wait kernel: a small batch)
SELF_WAITING_COMBINE = "Attention wait + combine"
#: which bench_common.kernel_bytes term floors each phase
FLOOR_TERM = {"dispatch": "dispatch", "FFN wait + stage": "stage", "FFN expand": "expand",
              "FFN reply": "reply", "Attention wait": None, "combine": "combine",
              SELF_WAITING_COMBINE: "combine"}
NUM_LAYERS, LAYER, STAGE = 1, 0, 0  # the FFN stage serves layers [0, NUM_LAYERS)
#: a wait that finds nothing latches TIMEOUT after this: every wait of a working row finds its
#: flag at once (one stream), so a broken row costs 2 x 0.1 s, not a hang
WAIT_TIMEOUT_NS = 100_000_000
NUM_RECORDS = 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                        help="MODE:DISPATCH:FFN, e.g. pair:fused:identity dedup:ll:staging")
    parser.add_argument("--rows", type=int, default=200, help="timed rows (after --warmup rows)")
    parser.add_argument("--warmup", type=int, default=20, help="rows run before the timed ones")
    parser.add_argument("--eager", action="store_true", help="launch the rows one by one (no graph)")
    parser.add_argument("--no-stamps", action="store_true", help="no trace stamps (for ncu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    for config in args.configs:
        parse_config(config)
    return args


@dataclass(frozen=True)
class Config:
    mode: str
    dispatch: str
    ffn: str

    @property
    def name(self) -> str:
        return f"{self.mode}:{self.dispatch}:{self.ffn}"


def parse_config(text: str) -> Config:
    """``MODE:DISPATCH:FFN`` -> Config; ValueError naming the text otherwise."""
    parts = text.split(":")
    ok = (len(parts) == 3 and parts[0] in ("pair", "dedup") and parts[1] in ("fused", "ll")
          and parts[2] in ("identity", "staging") and not (parts[0] == "pair" and parts[1] == "ll")
          and not (parts[0] == "pair" and parts[2] == "staging"))
    if not ok:
        raise ValueError(f"config {text!r}: want pair:fused:identity or dedup:{{fused,ll}}:{{identity,staging}}")
    return Config(*parts)


def points_of(phases: tuple) -> tuple:
    """Stamp points: s0, s1 (two stamps back to back: the stamp's own cost), then one after
    every kernel (``phases``: one per kernel)."""
    return ("s0", "s1") + tuple(f"p{i}" for i in range(len(phases)))


class Loopback:
    """One 1A1F round trip of ``config`` in this process: buffers, packed launches, checks."""

    def __init__(self, cp, config: Config, *, tokens: int, top_k: int, num_experts: int,
                 hidden: int, rng):
        from afd_cupy import kernels, wire
        from afd_cupy.backends.cuda_scratch import DedupRowsScratch, DispatchScratch
        from afd_cupy.backends.cuda_ffn_dedup import UNCLAIMED
        from afd_cupy.ffn import graph as ffn_graph
        from afd_cupy.kernels import specs
        from afd_cupy.wire.layout import WindowLayout, shared_capacity

        self.cp, self.config = cp, config
        self.tokens, self.top_k, self.hidden = tokens, top_k, hidden
        dedup = config.mode == "dedup"
        nk, epr = tokens * top_k, num_experts
        self.layout = layout = WindowLayout(
            num_regions=1, ring_depth=1, expert_per_rank=epr, hidden_size=hidden, itemsize=2,
            top_k=top_k, token_cap=tokens, routed_cap=nk,
            shared_cap=shared_capacity(tokens, 1, 1, config.mode), wire_mode=config.mode)
        geo, bf16 = layout.kernel_geometry(), kernels.DTYPE_CODES["bfloat16"]
        self.record_words = ffn_graph.record_words(layout.header_words, dedup=dedup)
        self.ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        self.x_bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: exact
        self.weights = (rng.random((tokens, top_k)) + 0.1).astype(np.float32)
        b = self.bufs = {
            "hidden": cp.asarray(self.x_bits), "ids": cp.asarray(self.ids.reshape(-1)),
            "weights": cp.asarray(self.weights.reshape(-1)),
            "ffn_window": cp.zeros(layout.window_bytes, cp.uint8),
            "attn_window": cp.zeros(layout.window_bytes, cp.uint8),
            "out": cp.zeros((tokens, hidden), cp.uint16),
            "seq_counters": cp.zeros(1, cp.int64), "expected": cp.zeros(1, cp.int64),
            "expected_counts": cp.zeros(3 if dedup else 2, cp.int32),
            "attn_last_seen": cp.zeros(layout.num_slots, cp.int64),
            "reply_flags": cp.zeros(2, cp.int64), "combine_done": cp.zeros(1, cp.uint32),
            "attn_status": cp.zeros(wire.STATUS_WORDS, cp.int64), "pos": cp.zeros(max(1, nk), cp.int32),
            "scratch": DispatchScratch.allocate(max(1, nk), 1, epr),
            # FFN side
            "ffn_last_seen": cp.zeros(layout.num_slots, cp.int64), "scan_start": cp.zeros(1, cp.int32),
            "counts_snapshot": cp.zeros(layout.num_slots * (layout.header_words - wire.HDR_FIXED_WORDS), cp.int32),
            "routed_offs": cp.zeros(epr, cp.int32), "reply_seqs": cp.zeros(layout.num_slots, cp.int64),
            "state": cp.zeros(ffn_graph.state_words(layout.header_words), cp.int64),
            "replay_counter": cp.zeros(1, cp.int64),
            "records": kernels.PinnedInt64(NUM_RECORDS * self.record_words),
            "reply_done": cp.zeros(1, cp.uint32), "routed_outs": cp.zeros(1, cp.uint64)}
        b["to_ffn"] = cp.asarray([b["ffn_window"].data.ptr], dtype=cp.uint64)
        b["to_attn"] = cp.asarray([b["attn_window"].data.ptr], dtype=cp.uint64)
        status_ptr = b["attn_status"].data.ptr
        sc = b["scratch"]
        head = dict(dtype_code=bf16, hidden=b["hidden"].data.ptr, num_tokens=tokens, hidden_size=hidden,
                    topk_ids=b["ids"], top_k=top_k, expert_per_rank=epr, num_ffn_ranks=1,
                    routed_cap=layout.routed_cap, expert_counts=sc.expert_counts,
                    expert_start=sc.expert_start, rank_offsets=sc.rank_offsets, verdict=sc.verdict,
                    skipped=sc.skipped, peer_windows=b["to_ffn"], geo=geo, ring=0, src_rank=0,
                    layer_idx=LAYER, stage_idx=STAGE, seq_counters=b["seq_counters"],
                    expected=b["expected"], expected_counts=b["expected_counts"],
                    done_counter=sc.scatter_done, status=status_ptr)
        launches = {}  # in the round trip's kernel order
        if dedup:
            b["rows"] = rows = DedupRowsScratch.allocate(tokens, top_k, 1)
            dedup_args = dict(topk_weights=b["weights"], has_shared=1, row_map=rows.row_map,
                              shared_rank=rows.shared_rank, num_rows=rows.num_rows,
                              shared_rows=rows.shared_rows, **head)
            build = kernels.dedup_dispatch_ll_spec if config.dispatch == "ll" else kernels.dedup_dispatch_fused_spec
            launches["dispatch"] = build(**dedup_args)
        else:
            launches["dispatch"] = kernels.dispatch_fused_spec(num_partials=nk, has_shared=1, pos_out=b["pos"],
                                                               hdr_flags=0, **head)
        stage = dict(geo=geo, expert_per_rank=epr, is_dedup=int(dedup), src_rank=0, num_attn_ranks=1,
                     token_cap=layout.token_cap, routed_cap=layout.routed_cap, shared_cap=layout.shared_cap,
                     routed_bucket=layout.routed_cap, shared_bucket=layout.shared_cap, num_layers=NUM_LAYERS,
                     layers_per_chunk=1, routed_offs=b["routed_offs"], shared_offs=0,
                     reply_seqs=b["reply_seqs"], state=b["state"], replay_counter=b["replay_counter"],
                     records=b["records"].ptr, num_records=NUM_RECORDS, record_words=self.record_words)
        launches["stage"] = specs.graph_wait_stage_spec(
            window=b["ffn_window"].data.ptr, last_seen=b["ffn_last_seen"], scan_start=b["scan_start"],
            counts_snapshot=b["counts_snapshot"], timeout_ns=WAIT_TIMEOUT_NS, **stage)
        if dedup:
            staging = 0
            if config.ffn == "staging":
                b["staging"] = cp.zeros((max(1, layout.routed_cap), hidden), cp.uint16)
                staging = b["staging"].data.ptr
                b["routed_outs"].set(np.array([staging], np.uint64))
            b["route_copy"] = cp.zeros((max(1, layout.token_cap), layout.route_width), cp.int32)
            b["claims"] = cp.full(max(1, layout.routed_cap), UNCLAIMED, cp.int32)
            b["fault"] = cp.full(1, np.iinfo(np.uint64).max, cp.uint64)
            b["claimed"], b["expand_done"] = cp.zeros(1, cp.uint32), cp.zeros(1, cp.uint32)
            launches["expand"] = specs.graph_dedup_expand_spec(
                dtype_code=bf16, window=b["ffn_window"].data.ptr, geo=geo, state=b["state"], top_k=top_k,
                hidden_size=hidden, routed_staging=staging, shared_staging=0, route_copy=b["route_copy"],
                claims=b["claims"], fault=b["fault"], num_claimed=b["claimed"], reply_seqs=b["reply_seqs"],
                done_counter=b["expand_done"], token_cap=layout.token_cap, routed_cap=layout.routed_cap,
                rows_bucket=layout.token_cap)
            launches["reply"] = specs.graph_dedup_reply_spec(
                dtype_code=bf16, own_window=b["ffn_window"].data.ptr, peer_windows=b["to_attn"], geo=geo,
                src_rank=0, state=b["state"], route_copy=b["route_copy"], top_k=top_k,
                routed_outs=b["routed_outs"], shared_out=0, hidden_size=hidden, done_counter=b["reply_done"],
                token_cap=layout.token_cap, rows_bucket=layout.token_cap)
        else:
            launches["reply"] = specs.graph_reply_spec(
                dtype_code=bf16, own_window=b["ffn_window"].data.ptr, peer_windows=b["to_attn"], geo=geo,
                src_rank=0, state=b["state"], routed_outs=b["routed_outs"], shared_out=0, hidden_size=hidden,
                done_counter=b["reply_done"], routed_bucket=layout.routed_cap, shared_bucket=layout.shared_cap)
        wait = dict(window=b["attn_window"].data.ptr, geo=geo, num_ffn_ranks=1, ring=0,
                    expected=b["expected"], expected_counts=b["expected_counts"], layer_idx=LAYER,
                    stage_idx=STAGE, last_seen=b["attn_last_seen"], reply_flags=b["reply_flags"],
                    timeout_ns=WAIT_TIMEOUT_NS, status=status_ptr)
        launches["wait"] = kernels.wait_replies_spec(dedup=int(dedup), **wait)
        if dedup:
            launches["combine"] = kernels.dedup_combine_spec(
                dtype_code=bf16, out=b["out"].data.ptr, num_tokens=tokens, hidden_size=hidden,
                row_map=b["rows"].row_map, out_scale=1.0, done_counter=b["combine_done"], **wait)
        else:
            launches["combine"] = kernels.combine_spec(
                dtype_code=bf16, out=b["out"].data.ptr, num_tokens=tokens, hidden_size=hidden,
                topk_ids=b["ids"], topk_weights=b["weights"], pos=b["pos"], top_k=top_k,
                expert_per_rank=epr, has_shared=1, out_scale=1.0, done_counter=b["combine_done"], **wait)
        # as the cuda backend launches them: a small combine waits for its replies itself (an
        # older tree, with no such rule, always launches the wait kernel)
        waits_itself = getattr(kernels, "combine_waits_itself", lambda grid: False)
        if waits_itself(launches["combine"].grid):
            del launches["wait"]
        self.phases = tuple(SELF_WAITING_COMBINE if name == "combine" and "wait" not in launches
                            else PHASE_OF[name] for name in launches)
        self.stage_args = stage
        self.launches = [(name, kernels.PackedLaunch(spec)) for name, spec in launches.items()]
        self.kernel_bytes = bc.kernel_bytes(layout, self.ids, num_ffn_ranks=1, has_shared=True).as_dict()
        cp.cuda.Device().synchronize()

    def expected_stage(self) -> int:
        """What the FFN stage must decide for this dispatch, from the protocol's own rules
        (``ffn_graph.stage_reference`` on the header ``wire.dispatch_header`` builds): GS_SERVED
        for a loopback that works, checked before anything runs on the GPU."""
        from afd_cupy import wire
        from afd_cupy.ffn import graph as ffn_graph
        from afd_cupy.testing import dedup_reference

        layout, epr = self.layout, self.layout.expert_per_rank
        counts = np.bincount(self.ids.reshape(-1), minlength=epr)
        if layout.is_dedup:
            plan = dedup_reference.plan_reference(self.ids, 1, epr, has_shared=True, num_experts=epr)
            sizes = dict(shared_tokens=int(plan.shared_rows[0]), wire_mode="dedup", num_rows=int(plan.num_rows[0]))
        else:
            sizes = dict(shared_tokens=self.tokens)
        header = wire.dispatch_header(seq=1, src_rank=0, layer_idx=LAYER, stage_idx=STAGE,
                                      num_tokens=self.tokens, top_k=self.top_k, expert_counts=counts, **sizes)
        result = ffn_graph.stage_reference(
            wire.encode_header(header, epr), region=0, layout=layout, src_rank=0, num_attn_ranks=1,
            num_layers=NUM_LAYERS, routed_bucket=self.stage_args["routed_bucket"],
            shared_bucket=self.stage_args["shared_bucket"], prev_seq=0)
        return result.status

    def one_row(self, stream_ptr: int, trace=None) -> None:
        """Enqueue one round trip (and its stamps, with a trace) on ``stream_ptr``."""
        if trace is not None:
            trace.stamp(stream_ptr, "s0")
            trace.stamp(stream_ptr, "s1")
        for i, (_, launch) in enumerate(self.launches):
            launch.launch(stream_ptr)
            if trace is not None:
                trace.stamp(stream_ptr, f"p{i}")

    def failures(self) -> list:
        """What the last row left, against numpy and the protocol: one line per mismatch."""
        from afd_cupy import wire
        from afd_cupy.ffn import graph as ffn_graph

        b, name, failures = self.bufs, self.config.name, []
        status = wire.StatusRecord.decode(b["attn_status"].get())
        if not status.ok:
            failures.append(f"{name}: Attention status {status.name}: {status}")
        replay = int(b["replay_counter"].get()[0]) - 1
        rec = b["records"].array[(replay % NUM_RECORDS) * self.record_words:][:self.record_words]
        if int(rec[ffn_graph.REC_STATUS]) != ffn_graph.GS_SERVED:
            failures.append(f"{name}: the last FFN replay's status {int(rec[ffn_graph.REC_STATUS])}, "
                            f"want GS_SERVED ({ffn_graph.GS_SERVED})")
        out = (b["out"].get().astype(np.uint32) << 16).view(np.float32)
        x = (self.x_bits.astype(np.uint32) << 16).view(np.float32)
        ref = (1.0 + self.weights.sum(axis=1, dtype=np.float64))[:, None] * x
        bad = ~np.isfinite(out)
        if bad.any():
            failures.append(f"{name}: {int(bad.sum())} of {out.size} outputs not finite (unwritten)")
        elif not np.allclose(out, ref, rtol=2e-2, atol=1e-2):
            failures.append(f"{name}: combine output differs from numpy, max |diff| {float(np.abs(out - ref).max()):.4g}")
        return failures


def run_config(cp, config: Config, args, tokens: int, rng) -> dict:
    """Time one config at ``tokens``: phases (median, p10, p90 µs), their floors' bytes and the
    check of the last row."""
    import device_trace as dt

    from afd_cupy.ffn import graph as ffn_graph

    loop = Loopback(cp, config, tokens=tokens, top_k=args.top_k, num_experts=args.num_experts,
                    hidden=args.hidden, rng=rng)
    result = {"config": config.name, "tokens": tokens, "rows": args.rows, "kernel_bytes": loop.kernel_bytes}
    status = loop.expected_stage()
    if status != ffn_graph.GS_SERVED:  # a bench bug: nothing would be served
        result["check_failures"] = [f"the FFN stage would not serve this dispatch (status {status})"]
        return result
    # one eager row first: a row that does not work fails here, before any capture
    stream = cp.cuda.Stream(non_blocking=True)
    loop.one_row(stream.ptr)
    stream.synchronize()
    first = loop.failures()
    if first:
        result["check_failures"] = ["first row: " + f for f in first]
        return result
    points = points_of(loop.phases)
    trace = None if args.no_stamps else dt.DeviceTrace(points, capacity=args.rows + 64)
    if args.eager:
        run = lambda: loop.one_row(stream.ptr, trace)  # noqa: E731
    else:
        stream.begin_capture()
        loop.one_row(stream.ptr, trace)
        graph = stream.end_capture()
        run = lambda: graph.launch(stream)  # noqa: E731
    for _ in range(args.warmup):
        run()
    stream.synchronize()
    if trace is not None:
        trace.reset()
    for _ in range(args.rows):
        run()
    stream.synchronize()
    if trace is not None:
        rows = trace.rows()
        complete = rows[(rows >= 0).all(axis=1)]
        stamps = {p: complete[:, i] for i, p in enumerate(points)}
        result["stamp_us"] = dt.stats_us((stamps["s1"] - stamps["s0"]) / 1e3)
        phases, prev = {}, "s1"
        for i, phase in enumerate(loop.phases):
            phases[phase] = dt.stats_us((stamps[f"p{i}"] - stamps[prev]) / 1e3)
            prev = f"p{i}"
        phases["round trip"] = dt.stats_us((stamps[prev] - stamps["s1"]) / 1e3)
        result["phases"] = phases
    if not args.eager:
        result["chained_us"] = chained_row_us(cp, loop, stream, args.rows)
    loop.bufs["out"].fill(0xFFFF)  # bf16 NaN: the next row must write every element
    cp.cuda.Device().synchronize()
    run()
    stream.synchronize()
    result["check_failures"] = loop.failures()
    return result


#: rows per graph of the unstamped timing (chained_row_us)
CHAIN_ROWS = 10


def chained_row_us(cp, loop: "Loopback", stream, rows: int) -> float:
    """µs per round trip with no stamps between the kernels: CHAIN_ROWS rows back to back in one
    graph, replayed until ``rows`` rows ran, timed by events around the replays (the graph's own
    launch is amortized over its rows). The stamps' nodes are in the phase rows; not here."""
    stream.begin_capture()
    for _ in range(CHAIN_ROWS):
        loop.one_row(stream.ptr)
    graph = stream.end_capture()
    for _ in range(3):
        graph.launch(stream)
    replays = max(1, rows // CHAIN_ROWS)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(replays):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / (replays * CHAIN_ROWS)


def floor_rows(result: dict, node_us: float, copy_gbps: float) -> list:
    """bench_common.floor_row for every phase of ``result`` (round trip: the sum of the floors)."""
    rows, total_bytes, total_floor = [], 0, 0.0
    for phase, stats in result["phases"].items():
        if phase == "round trip":
            continue
        term = FLOOR_TERM[phase]
        num_bytes = result["kernel_bytes"][term] if term else 0
        row = bc.floor_row(phase, stats["median_us"], num_bytes, node_us, copy_gbps)
        rows.append(row)
        total_bytes += num_bytes
        total_floor += row["floor_us"]
    trip = result["phases"]["round trip"]["median_us"]
    rows.append({"name": "round trip / sum of floors", "time_us": trip, "bytes": total_bytes,
                 "floor_us": total_floor, "x_floor": trip / total_floor if trip and total_floor else None})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import cupy as cp
    import torch

    import device_trace as dt

    device = torch.device("cuda", 0)
    rng = np.random.default_rng(args.seed)
    results, failures = [], []
    for config_text in args.configs:
        config = parse_config(config_text)
        for tokens in args.tokens:
            result = run_config(cp, config, args, tokens, rng)
            results.append(result)
            failures.extend(f"{config.name} T={tokens}: {f}" for f in result["check_failures"])
    report = {"tool": "bench_kernels", "run": bc.run_info("cuda"), "device": bc.device_name(device),
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "results": results, "check_failures": failures}
    if not args.no_stamps:
        node_us, copy_gbps = dt.measure_node_us(device), bc.measure_copy_gbps(device)
        report.update(node_us=node_us, copy_gbps=copy_gbps)
        for result in results:
            result["floors"] = floor_rows(result, node_us, copy_gbps)
            print(f"==== {result['config']}, T={result['tokens']}: stamp -> stamp "
                  f"{result['stamp_us']['median_us']:.2f} µs (in every phase) ====")
            print(bc.floor_table(result["floors"], node_us, copy_gbps))
        summary = [(r["config"], r["tokens"], r["phases"]["round trip"]["median_us"],
                    r.get("chained_us"), r["floors"][-1]["floor_us"], r["floors"][-1]["x_floor"])
                   for r in results]
        print("==== round trips (one process, loopback, graph replays; stamped: median µs; "
              f"no stamps: mean of {CHAIN_ROWS}-row graphs) ====")
        print(bc.format_table(("config", "tokens", "round trip µs", "no stamps µs", "sum of floors µs",
                               "x floor"), summary))
    path = bc.write_json(args.out, "bench_kernels.json", report)
    print(f"wrote {path}")
    for failure in failures:
        print(f"CHECK FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
