#!/usr/bin/env python3
"""What one small kernel costs on one stream: device timestamps around it (issue #13).

The device trace of the decode round trip (tools/device_trace.py, ``bench_step_graph --trace``)
shows every AFD kernel between two stamps taking 7-17 µs, the one-block FFN stage included,
also at hidden 1024 where it touches almost nothing, while two stamps back to back are 1.5 µs
apart. This probe separates the candidates in one process on one GPU: each row is

    restore (two device copies, before s0: seq_counters and last_seen back to their start values)
    s0 -> s1 -> tiny kernel -> s2 -> afd_dispatch_plan (T tokens, top-k, E experts, F = 1) -> s3
       -> the same plan again -> s4     (its code, parameters and data now warm)
       -> afd_graph_stage -> s5        (the graph FFN's one-block stage, serving an item of
                                        T tokens at layer 1 of 50, its record into pinned memory)
       -> afd_dispatch_scatter -> s6   (from the second plan's outputs, which the stage does not
                                        touch: T*K routed + T shared bf16 rows of --hidden, route
                                        table, header and flag into the "FFN window")
       -> afd_reply -> s7              (identity experts: those T*K + T rows of the FFN window
                                        back into the "Attention window", header from pinned
                                        memory, flag)
       -> afd_wait_replies -> s8       (the reply is there: returns after one look)
       -> afd_combine -> s9            (out[t] = sum_k w[t,k] * routed row + shared row: bf16
                                        [T, --hidden]; its last block records last_seen)
       -> afd_dispatch_fused -> s10    (plan + scatter of the same dispatch in one kernel, into
                                        a window of its own: the scatter's row minus the plan's
                                        shows what planning in every block costs)
       -> afd_dedup_dispatch_fused -> s11  (dedup mode's plan + rows + scatter of the same ids,
                                        hidden rows and weights: T rows, into a dedup window)

(``afd_trace_stamp`` at every sN, tools/device_trace.py's ring), repeated ``--rows`` times, in
each of these settings:

- ``eager``: launched one by one on a stream;
- ``graph``: the same rows captured once into a CUDA graph (cupy stream capture) and replayed;
- ``graph+flush``: as ``graph``, with a ``--flush-mb`` MiB memset between rows (evicts L2:
  code, constants and data of the next row start cold), the way a model layer's weights do;
- ``graph+busy``: as ``graph``, while another stream of the same process runs 256 MiB copies
  the whole time (a partner process's kernels under MPS competing for SMs and memory);
- ``graph+spin``: as ``graph``, while a one-warp kernel spins on another stream the whole time
  (``probe_spin_gemm.Spinner``: started before the rows, released by its flag after them), as
  a peer's wait kernel does on a shared GPU: whether a resident spinner delays our kernels'
  blocks the way it delays a persistent GEMM's CTAs (docs/design.md §8).

The two windows are plain device buffers of ``WindowLayout.window_bytes`` (1A1F: one region,
one ring slot); the scatter's ``peer_windows`` is ``[the FFN window's address]``. Every row
must see the same state, also on replay: the scatter increments ``seq_counters`` (the reply's
header, written once into pinned memory, echoes seq 1) and the combine's last block sets
``last_seen`` to the flag it consumed (left so, the next row's wait would take the reply for
consumed and spin until its timeout), so both are copied back from saved start values at the
start of every row (captured as memcpy nodes, outside every stamp pair). The reply writes the
same rows, header and flag every row and its done counter resets itself: nothing to restore.
The two fused dispatches increment their own ``seq_counters``, restored the same way.
The wait's timeout (1 s) bounds a reply that did not land: the first timeout is latched in the
status block (its own, not the plan's) and every later wait returns at once.

Phases (median µs, p10, p90): ``stamp -> stamp`` (the stamp's own cost), ``tiny kernel``
(one more stamp into a scratch ring: a kernel with the stamp's few parameters),
``afd_dispatch_plan``, its second launch, ``afd_graph_stage``, ``afd_dispatch_scatter``,
``afd_reply``, ``afd_wait_replies``, ``afd_combine``, ``afd_dispatch_fused`` and
``afd_dedup_dispatch_fused``. Prints a table, writes
``probe_kernel_cost.json`` to --out; then checks what the kernels left after the last row
(plan verdict and status, stage record, the scatter's message and expected seq, the reply's
header and flag, wait/combine status, last_seen and the combine's output against numpy) and
prints ``CHECK FAILED: ...`` for each mismatch (exit code 1).
Runs on the cuda backend only (one GPU, no MPS needed, no second process; the one wait finds
its reply at once).

    python3 tools/probe_kernel_cost.py --out OUT [--hidden 7168]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_common as bc  # noqa: E402

POINTS = ("s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9", "s10", "s11")
PHASES = (("stamp -> stamp", "s0", "s1"), ("tiny kernel (a stamp into a scratch ring)", "s1", "s2"),
          ("afd_dispatch_plan", "s2", "s3"), ("afd_dispatch_plan again, right after", "s3", "s4"),
          ("afd_graph_stage (served item)", "s4", "s5"),
          ("afd_dispatch_scatter (T*K + T rows)", "s5", "s6"),
          ("afd_reply (T*K + T rows back)", "s6", "s7"),
          ("afd_wait_replies (reply already there)", "s7", "s8"),
          ("afd_combine", "s8", "s9"),
          ("afd_dispatch_fused (plan + T*K + T rows)", "s9", "s10"),
          ("afd_dedup_dispatch_fused (plan + T rows)", "s10", "s11"))
SETTINGS = ("eager", "graph", "graph+flush", "graph+busy", "graph+spin")
#: the round trip's layer and stage (the reply echoes them) and the reply's flag value
RT_LAYER, RT_STAGE, REPLY_FLAG = 1, 0, 1
#: bounds the only wait that could spin (a reply that did not land); see the module docstring
WAIT_TIMEOUT_NS = 1_000_000_000


def phase_stats(rows: np.ndarray, points=POINTS, phases=PHASES) -> dict:
    """Rows int64 [n, len(points)] of ns stamps (-1: not stamped) -> phase name -> {median_us,
    p10_us, p90_us, n} over the complete rows (device_trace.stats_us)."""
    import device_trace as dt

    rows = np.asarray(rows, np.int64).reshape(-1, len(points))
    complete = rows[(rows >= 0).all(axis=1)]
    durations = dt.phase_durations_us({p: complete[:, i] for i, p in enumerate(points)}, phases)
    return {name: dt.stats_us(values) for name, values in durations.items()}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=7168,
                        help="bf16 row length of the scatter, reply and combine")
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


def _round_trip_launches(args, cupy, kernels, np_rng, ids, plan_bufs):
    """One 1A1F round trip after the plan (pair mode, bf16 [T, --hidden] rows, a shared expert,
    identity experts), all in this process: afd_dispatch_scatter from the plan's outputs into
    the FFN window (slot (0, 0): route table, T*K routed rows, T shared rows, header, flag =
    seq 1), afd_reply copying those rows back into the Attention window (slot (0, 0), header
    ``wire.reply_header`` of that dispatch from pinned memory, flag REPLY_FLAG), then
    afd_wait_replies and afd_combine over that reply (weights float32 [T*K]).

    Returns (name -> PackedLaunch for "scatter", "reply", "wait", "combine"; device buffers;
    ``restore``: (array, saved start value) pairs to copy back at the start of every row;
    ``want``: what the last row must leave, for :func:`_round_trip_failures`)."""
    from afd_cupy import wire
    from afd_cupy.layout import WindowLayout

    tokens, top_k, epr, hidden = args.tokens, args.top_k, args.num_experts, args.hidden
    nk, ring = tokens * top_k, 0
    layout = WindowLayout(num_regions=1, ring_depth=1, expert_per_rank=epr, hidden_size=hidden, itemsize=2,
                          top_k=top_k, token_cap=tokens, routed_cap=nk, shared_cap=tokens)
    geo, bf16 = layout.kernel_geometry(), kernels.DTYPE_CODES["bfloat16"]
    x = np_rng.standard_normal((tokens, hidden)).astype(np.float32)
    x_bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: exact values
    weights = (np_rng.random(nk) + 0.1).astype(np.float32)
    dispatch = wire.dispatch_header(seq=1, src_rank=0, layer_idx=RT_LAYER, stage_idx=RT_STAGE,
                                    num_tokens=tokens, shared_tokens=tokens, top_k=top_k,
                                    expert_counts=np.bincount(ids.get(), minlength=epr))
    reply_words = wire.encode_header(wire.reply_header(dispatch, seq=REPLY_FLAG, src_rank=0), epr)
    header_src = kernels.PinnedInt64(-(-layout.header_words // 2))
    header_src.int32[:layout.header_words] = reply_words
    bufs = {"hidden": cupy.asarray(x_bits), "weights": cupy.asarray(weights),
            "ffn_window": cupy.zeros(layout.window_bytes, cupy.uint8),
            "attn_window": cupy.zeros(layout.window_bytes, cupy.uint8),
            "pos": cupy.zeros(nk, cupy.int32), "seq_counters": cupy.zeros(1, cupy.int64),
            "expected": cupy.zeros(1, cupy.int64), "expected_counts": cupy.zeros(2, cupy.int32),
            "last_seen": cupy.zeros(layout.num_slots, cupy.int64), "reply_flags": cupy.zeros(2, cupy.int64),
            "out": cupy.full((tokens, hidden), 0xFFFF, cupy.uint16),  # bf16 NaN until combined
            "status": cupy.zeros(wire.STATUS_WORDS, cupy.int64), "header_src": header_src,
            "scatter_done": cupy.zeros(1, cupy.uint32), "reply_done": cupy.zeros(1, cupy.uint32),
            "combine_done": cupy.zeros(1, cupy.uint32)}
    bufs["peer_windows"] = cupy.asarray([bufs["ffn_window"].data.ptr], dtype=cupy.uint64)
    restore = [(bufs["seq_counters"], cupy.zeros(1, cupy.int64)),
               (bufs["last_seen"], cupy.zeros(layout.num_slots, cupy.int64))]
    ffn_slot = bufs["ffn_window"].data.ptr + layout.slot_offset(0, ring)
    replies = dict(window=bufs["attn_window"].data.ptr, geo=geo, num_ffn_ranks=1, ring=ring,
                   expected=bufs["expected"], expected_counts=bufs["expected_counts"], layer_idx=RT_LAYER,
                   stage_idx=RT_STAGE, last_seen=bufs["last_seen"], reply_flags=bufs["reply_flags"],
                   timeout_ns=WAIT_TIMEOUT_NS, status=bufs["status"].data.ptr)
    specs = {
        "scatter": kernels.dispatch_scatter_spec(
            dtype_code=bf16, hidden=bufs["hidden"].data.ptr, num_tokens=tokens, hidden_size=hidden,
            topk_ids=ids, num_partials=nk, top_k=top_k, expert_per_rank=epr, num_ffn_ranks=1,
            chunk_hist=plan_bufs["chunk_hist"], local_rank=plan_bufs["local_rank"],
            expert_start=plan_bufs["expert_start"], rank_offsets=plan_bufs["rank_offsets"],
            expert_counts=plan_bufs["expert_counts"], verdict=plan_bufs["verdict"],
            peer_windows=bufs["peer_windows"], geo=geo, ring=ring, has_shared=1, pos_out=bufs["pos"],
            src_rank=0, layer_idx=RT_LAYER, stage_idx=RT_STAGE, hdr_flags=0,
            seq_counters=bufs["seq_counters"], expected=bufs["expected"],
            expected_counts=bufs["expected_counts"], done_counter=bufs["scatter_done"]),
        "reply": kernels.reply_spec(
            dtype_code=bf16, dst_window=bufs["attn_window"].data.ptr, geo=geo, src_rank=0, ring=ring,
            routed_out=ffn_slot + layout.field_offset("routed_x"), num_routed=nk,
            shared_out=ffn_slot + layout.field_offset("shared_x"), num_shared=tokens, hidden_size=hidden,
            header_src=header_src.ptr, seq=REPLY_FLAG, done_counter=bufs["reply_done"]),
        "wait": kernels.wait_replies_spec(**replies),
        "combine": kernels.combine_spec(
            dtype_code=bf16, out=bufs["out"].data.ptr, num_tokens=tokens, hidden_size=hidden, topk_ids=ids,
            topk_weights=bufs["weights"], pos=bufs["pos"], top_k=top_k, expert_per_rank=epr, has_shared=1,
            out_scale=1.0, done_counter=bufs["combine_done"], **replies)}
    want = {"layout": layout, "ring": ring, "counts": [nk, tokens],
            "dispatch_words": wire.encode_header(dispatch, epr),
            "reply_words": reply_words, "x": (x_bits.astype(np.uint32) << 16).view(np.float32),
            "weights": weights.reshape(tokens, top_k)}
    return {name: kernels.PackedLaunch(spec) for name, spec in specs.items()}, bufs, restore, want


def _fused_launches(args, cupy, kernels, ids, trip_bufs):
    """afd_dispatch_fused (pair) and afd_dedup_dispatch_fused over the round trip's ids, bf16
    hidden rows and weights (1A1F, a shared expert, slot (0, 0) of a window each).

    Returns (name -> PackedLaunch for "pair_fused", "dedup_fused"; device buffers; ``restore``
    pairs (their seq_counters); ``want`` for :func:`_fused_failures`)."""
    from afd_cupy import wire
    from afd_cupy.backends.cuda_attention import DedupRowsScratch, DispatchScratch
    from afd_cupy.layout import WindowLayout

    tokens, top_k, epr, hidden = args.tokens, args.top_k, args.num_experts, args.hidden
    nk, bf16 = tokens * top_k, kernels.DTYPE_CODES["bfloat16"]
    common = dict(num_regions=1, ring_depth=1, expert_per_rank=epr, hidden_size=hidden, itemsize=2,
                  top_k=top_k, token_cap=tokens, routed_cap=nk, shared_cap=tokens)
    layouts = {"pair_fused": WindowLayout(**common), "dedup_fused": WindowLayout(**common, wire_mode="dedup")}
    bufs, launches, restore = {}, {}, []
    for name, layout in layouts.items():
        window = cupy.zeros(layout.window_bytes, cupy.uint8)
        b = {"window": window, "peer_windows": cupy.asarray([window.data.ptr], dtype=cupy.uint64),
             "scratch": DispatchScratch.allocate(nk, 1, epr), "seq_counters": cupy.zeros(1, cupy.int64),
             "expected": cupy.zeros(1, cupy.int64),
             "expected_counts": cupy.zeros(3 if layout.is_dedup else 2, cupy.int32),
             "status": cupy.zeros(wire.STATUS_WORDS, cupy.int64)}
        sc = b["scratch"]
        head = dict(dtype_code=bf16, hidden=trip_bufs["hidden"].data.ptr, num_tokens=tokens, hidden_size=hidden,
                    topk_ids=ids, top_k=top_k, expert_per_rank=epr, num_ffn_ranks=1, routed_cap=nk,
                    expert_counts=sc.expert_counts, expert_start=sc.expert_start,
                    rank_offsets=sc.rank_offsets, verdict=sc.verdict, skipped=sc.skipped,
                    peer_windows=b["peer_windows"], geo=layout.kernel_geometry(), ring=0, src_rank=0,
                    layer_idx=RT_LAYER, stage_idx=RT_STAGE, seq_counters=b["seq_counters"],
                    expected=b["expected"], expected_counts=b["expected_counts"],
                    done_counter=sc.scatter_done, status=b["status"].data.ptr)
        if layout.is_dedup:
            b["rows"] = DedupRowsScratch.allocate(tokens, top_k, 1)
            spec = kernels.dedup_dispatch_fused_spec(
                topk_weights=trip_bufs["weights"], has_shared=1, row_map=b["rows"].row_map,
                shared_rank=b["rows"].shared_rank, num_rows=b["rows"].num_rows,
                shared_rows=b["rows"].shared_rows, **head)
        else:
            spec = kernels.dispatch_fused_spec(num_partials=nk, has_shared=1, pos_out=sc.pos, hdr_flags=0,
                                               **head)
        launches[name] = kernels.PackedLaunch(spec)
        restore.append((b["seq_counters"], cupy.zeros(1, cupy.int64)))
        bufs[name] = b
    want = {"layouts": layouts, "counts": {"pair_fused": [nk, tokens], "dedup_fused": [nk, tokens, tokens]}}
    return launches, bufs, restore, want


def _fused_failures(bufs, want) -> list:
    """What the last row's two fused dispatches left against ``want`` (:func:`_fused_launches`):
    one line per mismatch (sent once, with seq 1, the routed / shared / row counts of the
    dispatch: T*K routed rows and, with one FFN rank, T shared and T message rows)."""
    from afd_cupy import wire

    failures = []
    for name, b in bufs.items():
        layout = want["layouts"][name]
        status = wire.StatusRecord.decode(b["status"].get())
        if not status.ok:
            failures.append(f"{name}: status {status.name}: {status}")
        if int(b["scratch"].verdict.get()[0]) != 0:
            failures.append(f"{name}: verdict {int(b['scratch'].verdict.get()[0])}, want STATUS_OK (0)")
        if int(b["expected"].get()[0]) != 1:
            failures.append(f"{name}: expected seq {int(b['expected'].get()[0])}, want 1")
        counts = b["expected_counts"].get().tolist()
        if counts != want["counts"][name]:
            failures.append(f"{name}: expected_counts {counts}, want {want['counts'][name]}")
        slot = layout.slot_index(0, 0)
        flag = int(b["window"][slot * 8:slot * 8 + 8].get().view(np.int64)[0])
        if flag != 1:
            failures.append(f"{name}: flag {flag} in its window, want 1")
    return failures


def _restore(cupy, restore, stream_ptr: int) -> None:
    """Enqueue the device copies of :func:`_round_trip_launches`'s ``restore`` pairs on
    ``stream_ptr`` (memcpy nodes when captured)."""
    rt = cupy.cuda.runtime
    for array, saved in restore:
        rt.memcpyAsync(array.data.ptr, saved.data.ptr, saved.nbytes, rt.memcpyDeviceToDevice, stream_ptr)


def _round_trip_failures(bufs, want) -> list:
    """What the last row's scatter, reply, wait and combine left against ``want``
    (:func:`_round_trip_launches`): one line per mismatch."""
    from afd_cupy import wire

    layout, ring = want["layout"], want["ring"]
    slot, hw = layout.slot_index(0, ring), layout.header_words
    header = layout.slot_offset(0, ring) + layout.field_offset("header")
    failures = []
    expected, counts = int(bufs["expected"].get()[0]), bufs["expected_counts"].get().tolist()
    if expected != 1:  # 0: nothing sent (verdict not OK); > 1: seq_counters not restored
        failures.append(f"afd_dispatch_scatter expected seq {expected}, want 1")
    if counts != want["counts"]:
        failures.append(f"afd_dispatch_scatter expected_counts {counts}, want {want['counts']} (routed, shared)")
    for what, name, flag, words in (("afd_dispatch_scatter", "ffn_window", 1, want["dispatch_words"]),
                                    ("afd_reply", "attn_window", REPLY_FLAG, want["reply_words"])):
        window = bufs[name][:header + 4 * hw].get()
        got_flag = int(window[slot * 8:slot * 8 + 8].view(np.int64)[0])
        if got_flag != flag:
            failures.append(f"{what}: flag {got_flag} in {name}, want {flag}")
        if not np.array_equal(window[header:header + 4 * hw].view(np.int32), words):
            failures.append(f"{what}: header words in {name} differ from the wire's")
    status = wire.StatusRecord.decode(bufs["status"].get())
    if not status.ok:
        failures.append(f"afd_wait_replies / afd_combine status {status.name}: {status}")
    last_seen = int(bufs["last_seen"].get()[slot])
    if last_seen != REPLY_FLAG:
        failures.append(f"afd_combine left last_seen {last_seen}, want the reply's flag {REPLY_FLAG}")
    out = (bufs["out"].get().astype(np.uint32) << 16).view(np.float32)
    ref = (want["weights"].sum(axis=1, dtype=np.float32) + 1.0)[:, None] * want["x"]  # identity experts
    if not np.isfinite(out).all():
        failures.append(f"afd_combine output: {int((~np.isfinite(out)).sum())} non-finite values")
    elif not np.allclose(out, ref, rtol=1e-2, atol=1e-2):
        failures.append(f"afd_combine output differs from numpy: max |diff| {float(np.abs(out - ref).max()):.4g}")
    return failures


def run(args) -> dict:
    import cupy

    import device_trace as dt
    from afd_cupy import kernels

    rng = np.random.default_rng(0)
    plan, ids, bufs = _plan_launch(args, cupy, kernels, rng)
    stage, stage_bufs = _stage_launch(args, cupy, kernels, rng)
    trip, trip_bufs, restore, trip_want = _round_trip_launches(args, cupy, kernels, rng, ids, bufs)
    fused, fused_bufs, fused_restore, fused_want = _fused_launches(args, cupy, kernels, ids, trip_bufs)
    restore = restore + fused_restore
    scratch = dt.DeviceTrace(("x",), capacity=1024)  # the tiny kernel: a stamp into its own ring
    flush = cupy.empty(args.flush_mb << 20, cupy.uint8)
    busy_src = cupy.zeros(1 << 28, cupy.uint8)
    busy_dst = cupy.empty_like(busy_src)
    spinner = None
    if "graph+spin" in args.settings:
        from probe_spin_gemm import RELEASED, Spinner

        spinner = Spinner(cupy, timeout_ms=60_000.0)
    spin_failures = []
    results = {}
    for setting in args.settings:
        trace = dt.DeviceTrace(POINTS, capacity=args.rows + 64)
        stream = cupy.cuda.Stream(non_blocking=True)

        def one_row():
            _restore(cupy, restore, stream.ptr)
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
            for name, point in (("scatter", "s6"), ("reply", "s7"), ("wait", "s8"), ("combine", "s9")):
                trip[name].launch(stream.ptr)
                trace.stamp(stream.ptr, point)
            for name, point in (("pair_fused", "s10"), ("dedup_fused", "s11")):
                fused[name].launch(stream.ptr)
                trace.stamp(stream.ptr, point)
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
            if setting == "graph+spin":
                spinner.start(0)  # returns once the spinner runs: resident before the first row
            for _ in range(args.rows):
                graph.launch(stream)
        stream.synchronize()
        if setting == "graph+spin" and spinner.release() != RELEASED:
            spin_failures.append("graph+spin: the spinner gave up at its timeout before the rows ended")
        if busy_stream is not None:
            busy_stream.synchronize()
        rows = trace.rows()
        results[setting] = {"phases": phase_stats(rows), "rows": int(len(rows))}
    failures = list(spin_failures)  # checks that the probed kernels did their work (reported after the table)
    if int(bufs["verdict"].get()[0]) != 0:
        failures.append(f"afd_dispatch_plan verdict {int(bufs['verdict'].get()[0])}, expected STATUS_OK (0)")
    from afd_cupy import ffn_graph, wire
    plan_status = wire.StatusRecord.decode(bufs["status"].get())
    if not plan_status.ok:
        failures.append(f"afd_dispatch_plan status {plan_status.name}: {plan_status}")
    status = int(stage_bufs["records"].array[ffn_graph.REC_STATUS])  # the first record's
    if status != ffn_graph.GS_SERVED:
        failures.append(f"afd_graph_stage record status {status}, expected GS_SERVED ({ffn_graph.GS_SERVED})")
    failures.extend(_round_trip_failures(trip_bufs, trip_want))
    failures.extend(_fused_failures(fused_bufs, fused_want))
    return results, failures


def main(argv=None) -> int:
    args = parse_args(argv)
    import cupy

    results, failures = run(args)
    report = {"tool": "probe_kernel_cost", "run": bc.run_info("cuda"),
              "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "config": {"tokens": args.tokens, "top_k": args.top_k, "num_experts": args.num_experts,
                         "hidden": args.hidden, "rows": args.rows, "flush_mb": args.flush_mb},
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
