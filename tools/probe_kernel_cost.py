#!/usr/bin/env python3
"""What one small kernel costs on one stream: device timestamps around it (issue #13).

The device trace of the decode round trip (tools/device_trace.py, ``bench_step_graph --trace``)
shows every AFD kernel between two stamps taking 7-17 µs, the one-block FFN stage included,
also at hidden 1024 where it touches almost nothing, while two stamps back to back are 1.5 µs
apart. This probe separates the candidates in one process on one GPU: each row is

    s0 -> s1 -> tiny kernel -> s2 -> afd_dispatch_plan (T tokens, top-k, E experts, F = 1) -> s3
       -> the same plan again -> s4     (its code, parameters and data now warm)
       -> afd_graph_stage -> s5        (the graph FFN's one-block stage, serving an item of
                                        T tokens at layer 1 of 50, its record into pinned memory)

(``afd_trace_stamp`` at every sN, tools/device_trace.py's ring), repeated ``--rows`` times, in
each of these settings:

- ``eager``: launched one by one on a stream;
- ``graph``: the same rows captured once into a CUDA graph (cupy stream capture) and replayed;
- ``graph+flush``: as ``graph``, with a ``--flush-mb`` MiB memset between rows (evicts L2:
  code, constants and data of the next row start cold), the way a model layer's weights do;
- ``graph+busy``: as ``graph``, while another stream of the same process runs 256 MiB copies
  the whole time (a partner process's kernels under MPS competing for SMs and memory).

Phases (median µs, p10, p90): ``stamp -> stamp`` (the stamp's own cost), ``tiny kernel``
(one more stamp into a scratch ring: a kernel with the stamp's few parameters) and
``afd_dispatch_plan``, its second launch and ``afd_graph_stage``. Prints a table, writes ``probe_kernel_cost.json`` to --out.
Runs on the cuda backend only (one GPU, no MPS needed, nothing spins).

    python3 tools/probe_kernel_cost.py --out OUT
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_common as bc  # noqa: E402

POINTS = ("s0", "s1", "s2", "s3", "s4", "s5")
PHASES = (("stamp -> stamp", "s0", "s1"), ("tiny kernel (a stamp into a scratch ring)", "s1", "s2"),
          ("afd_dispatch_plan", "s2", "s3"), ("afd_dispatch_plan again, right after", "s3", "s4"),
          ("afd_graph_stage (served item)", "s4", "s5"))
SETTINGS = ("eager", "graph", "graph+flush", "graph+busy")


def phase_stats(rows: np.ndarray, points=POINTS, phases=PHASES) -> dict:
    """Rows int64 [n, len(points)] of ns stamps (-1: not stamped) -> phase name -> {median_us,
    p10_us, p90_us, n} over the complete rows (device_trace.stats_us)."""
    import device_trace as dt

    rows = np.asarray(rows, np.int64).reshape(-1, len(points))
    complete = rows[(rows >= 0).all(axis=1)]
    index = {p: i for i, p in enumerate(points)}
    return {name: dt.stats_us((complete[:, index[end]] - complete[:, index[start]]) / 1000.0)
            for name, start, end in phases}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=200, help="rows per setting (after 20 warm-up rows)")
    parser.add_argument("--flush-mb", type=int, default=256, help="graph+flush: memset MiB between rows")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    return parser.parse_args(argv)


def _plan_launch(args, cupy, kernels, np_rng):
    from afd_cupy import wire
    from afd_cupy.kernels.specs import dispatch_num_chunks

    nk = args.tokens * args.top_k
    ids = cupy.asarray(np.stack([np_rng.choice(args.num_experts, args.top_k, replace=False)
                                 for _ in range(args.tokens)]).astype(np.int32).ravel())
    chunks = dispatch_num_chunks(nk)
    bufs = {"chunk_hist": cupy.zeros(max(1, chunks) * args.num_experts, cupy.int32),
            "local_rank": cupy.zeros(nk, cupy.int32), "expert_counts": cupy.zeros(args.num_experts, cupy.int32),
            "expert_start": cupy.zeros(args.num_experts, cupy.int32), "rank_offsets": cupy.zeros(2, cupy.int32),
            "verdict": cupy.zeros(1, cupy.int32), "done_counter": cupy.zeros(1, cupy.uint32),
            "status": cupy.zeros(wire.STATUS_WORDS, cupy.int64)}
    spec = kernels.dispatch_plan_spec(topk_ids=ids, num_partials=nk, num_ffn_ranks=1,
                                      expert_per_rank=args.num_experts, routed_cap=nk, layer_idx=0,
                                      chunk_hist=bufs["chunk_hist"], local_rank=bufs["local_rank"],
                                      expert_counts=bufs["expert_counts"], expert_start=bufs["expert_start"],
                                      rank_offsets=bufs["rank_offsets"], verdict=bufs["verdict"],
                                      done_counter=bufs["done_counter"], status=bufs["status"].data.ptr)
    return kernels.PackedLaunch(spec), ids, bufs


def _stage_launch(args, cupy, kernels, np_rng):
    """afd_graph_stage as GraphFFNServer runs it (1A1F, E experts on the one FFN rank, 50
    stacked layers), on a device doorbell holding a valid arrival at slot 0 (layer 1)."""
    from afd_cupy import ffn_graph, wire
    from afd_cupy.kernels import specs
    from afd_cupy.layout import WindowLayout

    epr, layers, tokens = args.num_experts, 50, args.tokens
    nk = tokens * args.top_k
    layout = WindowLayout(num_regions=1, ring_depth=2, expert_per_rank=epr, hidden_size=1024, itemsize=2,
                          top_k=args.top_k, token_cap=tokens, routed_cap=nk, shared_cap=tokens)
    counts = np.bincount(np_rng.integers(0, epr, nk), minlength=epr)
    words = wire.encode_header(wire.dispatch_header(seq=1, src_rank=0, layer_idx=1, stage_idx=0,
                                                    num_tokens=tokens, shared_tokens=tokens,
                                                    top_k=args.top_k, expert_counts=counts), epr)
    hw = layout.header_words
    bell = np.zeros(wire.DB_HEADER + -(-hw // 2), np.int64)
    bell[wire.DB_STATUS], bell[wire.DB_SLOT], bell[wire.DB_FLAG] = wire.STATUS_OK, 0, 1
    bell[wire.DB_HEADER:].view(np.int32)[:len(words)] = words
    record_words = ffn_graph.record_words(hw, dedup=False)
    bufs = {"doorbell": cupy.asarray(bell), "routed_offs": cupy.zeros(layers * epr, cupy.int32),
            "shared_offs": cupy.zeros(layers, cupy.int32), "reply_seqs": cupy.zeros(layout.num_slots, cupy.int64),
            "state": cupy.zeros(ffn_graph.state_words(hw), cupy.int64),
            "replay_counter": cupy.zeros(1, cupy.int64), "records": kernels.PinnedInt64(64 * record_words)}
    spec = specs.graph_stage_spec(
        doorbell=bufs["doorbell"].data.ptr, geo=layout.kernel_geometry(), expert_per_rank=epr, is_dedup=0,
        src_rank=1, num_attn_ranks=1, token_cap=tokens, routed_cap=nk, shared_cap=tokens, routed_bucket=nk,
        shared_bucket=tokens, num_layers=layers, layers_per_chunk=ffn_graph.layers_per_chunk(layers, epr),
        routed_offs=bufs["routed_offs"], shared_offs=bufs["shared_offs"].data.ptr,
        reply_seqs=bufs["reply_seqs"], state=bufs["state"], replay_counter=bufs["replay_counter"],
        records=bufs["records"].ptr, num_records=64, record_words=record_words)
    return kernels.PackedLaunch(spec), bufs


def run(args) -> dict:
    import cupy

    import device_trace as dt
    from afd_cupy import kernels

    rng = np.random.default_rng(0)
    plan, ids, bufs = _plan_launch(args, cupy, kernels, rng)
    stage, stage_bufs = _stage_launch(args, cupy, kernels, rng)
    scratch = dt.DeviceTrace(("x",), capacity=1024)  # the tiny kernel: a stamp into its own ring
    flush = cupy.empty(args.flush_mb << 20, cupy.uint8)
    busy_src = cupy.zeros(1 << 28, cupy.uint8)
    busy_dst = cupy.empty_like(busy_src)
    results = {}
    for setting in args.settings:
        trace = dt.DeviceTrace(POINTS, capacity=args.rows + 64)
        stream = cupy.cuda.Stream(non_blocking=True)

        def one_row():
            trace.stamp(stream.ptr, "s0")
            trace.stamp(stream.ptr, "s1")
            scratch.stamp(stream.ptr, "x")
            trace.stamp(stream.ptr, "s2")
            plan.launch(stream.ptr)
            trace.stamp(stream.ptr, "s3")
            plan.launch(stream.ptr)
            trace.stamp(stream.ptr, "s4")
            stage.launch(stream.ptr)
            trace.stamp(stream.ptr, "s5")
            if setting == "graph+flush":
                with stream:
                    flush.fill(1)

        busy_stream = cupy.cuda.Stream(non_blocking=True) if setting == "graph+busy" else None
        if setting == "eager":
            for _ in range(20):
                one_row()
            stream.synchronize()
            trace.reset()
            for _ in range(args.rows):
                one_row()
        else:
            stream.begin_capture()
            one_row()
            graph = stream.end_capture()
            for _ in range(20):
                graph.launch(stream)
            stream.synchronize()
            trace.reset()
            if busy_stream is not None:
                with busy_stream:  # long copies on the side, started before the rows and kept going
                    for _ in range(max(1, args.rows // 10)):
                        cupy.copyto(busy_dst, busy_src)
            for _ in range(args.rows):
                graph.launch(stream)
        stream.synchronize()
        if busy_stream is not None:
            busy_stream.synchronize()
        rows = trace.rows()
        results[setting] = {"phases": phase_stats(rows), "rows": int(len(rows))}
    failures = []  # checks that the probed kernels did their work (reported after the table)
    if int(bufs["verdict"].get()[0]) != 0:
        failures.append(f"afd_dispatch_plan verdict {int(bufs['verdict'].get()[0])}, expected STATUS_OK (0)")
    from afd_cupy import ffn_graph
    status = int(stage_bufs["records"].array[ffn_graph.REC_STATUS])  # the first record's
    if status != ffn_graph.GS_SERVED:
        failures.append(f"afd_graph_stage record status {status}, expected GS_SERVED ({ffn_graph.GS_SERVED})")
    return results, failures


def main(argv=None) -> int:
    args = parse_args(argv)
    import cupy

    results, failures = run(args)
    report = {"tool": "probe_kernel_cost", "run": bc.run_info("cuda"),
              "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "config": {"tokens": args.tokens, "top_k": args.top_k, "num_experts": args.num_experts,
                         "rows": args.rows, "flush_mb": args.flush_mb},
              "results": results, "check_failures": failures}
    path = bc.write_json(args.out, "probe_kernel_cost.json", report)
    headers = ("phase (median µs [p10, p90])",) + tuple(results)
    table = []
    for name, _, _ in PHASES:
        cells = []
        for setting in results:
            s = results[setting]["phases"][name]
            cells.append("-" if s["median_us"] is None else
                         f"{s['median_us']:.2f} [{s['p10_us']:.2f}, {s['p90_us']:.2f}]")
        table.append((name,) + tuple(cells))
    print(f"==== one small kernel on one stream, {report['device']}, {report['run'].get('commit', '')} ====")
    print(bc.format_table(headers, table))
    print(f"wrote {path}")
    for failure in failures:
        print(f"CHECK FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
