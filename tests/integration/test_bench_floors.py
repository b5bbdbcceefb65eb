"""The kernel floors of the benchmarks (tools/bench_common.py, device_trace.floor_rows,
bench_transport.add_floors, bench_step_graph's floor table): the bytes each kernel moves, from a
small layout by hand, and the floor math and tables on synthetic numbers. CPU only; the two
measured terms (graph node cost, device copy rate) need a GPU (``bench_step_graph --trace``)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from helpers.paths import TOOLS_DIR

sys.path.insert(0, str(TOOLS_DIR))

import bench_common as bc  # noqa: E402
import device_trace as dt  # noqa: E402
from afd_cupy.routing import dedup  # noqa: E402
from afd_cupy.wire.layout import WindowLayout  # noqa: E402

# 3 tokens, top-2 over 2 FFN ranks of 4 experts: rank 0 gets experts 0, 1, 2, rank 1 5, 7, 6
IDS = np.array([[0, 5], [1, 2], [7, 6]], np.int32)


def _layout(wire_mode: str) -> WindowLayout:
    return WindowLayout(num_regions=1, ring_depth=2, expert_per_rank=4, hidden_size=8, itemsize=2,
                        top_k=2, token_cap=4, routed_cap=8, shared_cap=4, wire_mode=wire_mode)


def test_kernel_bytes_pair_by_hand():
    lay = _layout("pair")
    row, fixed = 8 * 2, lay.header_words * 4 + 8
    # rank 0: 3 routed partials + 2 shared rows (tokens 0, 2); rank 1: 3 routed + 1 shared
    rows = (5, 4)
    routed, shared = (3, 3), (2, 1)
    want_dispatch = sum(r * row + fixed + p * (row + 8) + s * (row + 4) for r, p, s in zip(rows, routed, shared))
    got = bc.kernel_bytes(lay, IDS, num_ffn_ranks=2, has_shared=True)
    assert got.dispatch == want_dispatch == 492
    assert got.stage == 2 * lay.header_words * 4
    assert got.expand == sum(2 * r * row for r in rows)  # the gather reads and writes each row
    assert got.reply == sum(r * row + fixed + r * row for r in rows)
    assert got.combine == sum(rows) * row + 3 * row  # every reply row read, [T, H] written
    # what the dispatch writes is the wire's dispatch bytes
    wire = dedup.wire_bytes(lay, IDS, num_ffn_ranks=2, has_shared=True)
    assert got.dispatch - sum(rows) * row == wire.dispatch
    assert got.reply - sum(rows) * row == wire.reply


def test_kernel_bytes_dedup_by_hand():
    lay = _layout("dedup")
    row, fixed, route = 8 * 2, lay.header_words * 4 + 8, lay.route_width * 4
    # one row per (token, rank it goes to): rank 0 tokens 0, 1; rank 1 tokens 0, 2 (the shared
    # expert runs on a rank the token goes to already)
    got = bc.kernel_bytes(lay, IDS, num_ffn_ranks=2, has_shared=True)
    assert got.dispatch == 2 * (2 * row + fixed + 2 * (row + route))
    assert got.expand == 2 * (2 + 3) * row  # 2 token rows read, 3 routed partials written
    assert got.reply == 2 * (3 * row + fixed + 2 * row)  # partials reduced, 2 rows sent back
    assert got.combine == 4 * row + 3 * row
    wire = dedup.wire_bytes(lay, IDS, num_ffn_ranks=2, has_shared=True)
    assert got.dispatch - 4 * row == wire.dispatch


def test_kernel_bytes_skip_ranks_sent_nothing():
    lay = _layout("pair")
    ids = np.array([[0, 1], [2, 3]], np.int32)  # rank 1 gets nothing (no shared experts)
    one = bc.kernel_bytes(lay, ids, num_ffn_ranks=2, has_shared=False)
    assert one.stage == lay.header_words * 4
    both = bc.kernel_bytes(lay, ids, num_ffn_ranks=2, has_shared=False, always_send=True)
    assert both.stage == 2 * one.stage and both.dispatch == one.dispatch + lay.header_words * 4 + 8
    assert set(one.as_dict()) == {"dispatch", "stage", "expand", "reply", "combine"}


def test_floor_math():
    # 1 µs node + 4e6 bytes at 4000 GB/s (4e6 bytes per ms) = 1 µs + 1 µs
    assert bc.floor_us(4_000_000, 1.0, 4000.0) == pytest.approx(2.0)
    assert bc.floor_us(0, 1.25, 4000.0) == 1.25 and bc.floor_us(None, 1.0, 1.0) is None
    with pytest.raises(ValueError, match="copy_gbps > 0, got 1.0, 0.0"):
        bc.floor_us(10, 1.0, 0.0)
    row = bc.floor_row("combine", 6.0, 4_000_000, 1.0, 4000.0)
    assert row == {"name": "combine", "time_us": 6.0, "bytes": 4_000_000, "floor_us": 2.0, "x_floor": 3.0}
    assert bc.floor_row("x", None, 10, 1.0, 1.0)["x_floor"] is None


def _summary(medians: dict) -> dict:
    phases = {name: {"median_us": medians.get(name, 0.0), "p10_us": 0.0, "p90_us": 0.0, "n": 5}
              for name, _, _ in dt.PHASES}
    return {"round_trip_phases": phases, "matched_round_trip": {"median_us": 40.0}}


def test_floor_rows_per_phase():
    kb = {"dispatch": 8_000_000, "stage": 100, "expand": 0, "reply": 4_000_000, "combine": 2_000_000}
    medians = {"dispatch scatter (dedup: rows + scatter; fused: plan + scatter)": 12.0,
               "doorbell -> FFN wait returns (fused: + stage)": 3.0, "FFN experts": 1.5,
               "FFN reply": 4.0, "reply -> Attention wait returns": 2.0, "combine": 5.0}
    rows = dt.floor_rows(_summary(medians), kb, 1.0, 4000.0)
    by_name = {r["name"]: r for r in rows}
    assert len(rows) == len(dt.PHASES) + 1
    scatter = by_name["dispatch scatter (dedup: rows + scatter; fused: plan + scatter)"]
    assert scatter["floor_us"] == pytest.approx(3.0) and scatter["x_floor"] == pytest.approx(4.0)
    assert by_name["doorbell -> FFN wait returns (fused: + stage)"]["floor_us"] == 1.0  # a node, no bytes
    assert by_name["FFN reply"]["floor_us"] == pytest.approx(2.0)
    assert by_name["combine"]["x_floor"] == pytest.approx(5.0 / 1.5)
    # no kernel ran (zero median: the fused dispatch's plan) and the GEMMs: no floor
    assert by_name["dispatch plan"]["floor_us"] is None and by_name["FFN stage"]["floor_us"] is None
    assert by_name["FFN experts"]["floor_us"] is None and by_name["FFN experts"]["time_us"] == 1.5
    total = rows[-1]
    assert total["floor_us"] == pytest.approx(3.0 + 1.0 + 2.0 + 1.0 + 1.5)
    assert total["x_floor"] == pytest.approx(40.0 / total["floor_us"])
    assert dt.floor_rows({"phases": {}}, kb, 1.0, 4000.0) == []
    table = bc.floor_table(rows, 1.0, 4000.0)
    assert "1.00 µs per graph node" in table and "4000 GB/s" in table and "time / floor" in table
    assert "8000" in table  # the scatter's KB


def test_bench_transport_add_floors():
    import bench_transport

    kb = {"dispatch": 4_000_000, "stage": 0, "expand": 0, "reply": 0, "combine": 8_000_000}
    decode = bench_transport.add_floors({"dispatch_us": 6.0, "kernel_bytes": kb}, node_us=1.0, copy_gbps=4000.0)
    assert decode["dispatch_floor_us"] == pytest.approx(2.0) and decode["dispatch_x_floor"] == pytest.approx(3.0)
    prefill = bench_transport.add_floors({"dispatch_ms": 0.004, "combine_ms": 0.009, "kernel_bytes": kb},
                                         node_us=1.0, copy_gbps=4000.0)
    assert prefill["dispatch_floor_ms"] == pytest.approx(0.002) and prefill["combine_floor_ms"] == pytest.approx(0.003)
    assert prefill["combine_x_floor"] == pytest.approx(3.0)
    note = bench_transport.floor_note([{"group": "h7168", "node_us": 1.04, "copy_gbps": 3950.0}])
    assert "h7168: 1.04 us, 3950 GB/s" in note
    assert "not measured" in bench_transport.floor_note([])


def test_bench_step_graph_prints_floors(capsys):
    import bench_step_graph as tool

    args = tool.parse_args(["--quick", "--trace"])
    assert args.trace and args.trace_iters >= 1
    rows = dt.floor_rows(_summary({"combine": 5.0}), {"dispatch": 0, "stage": 0, "expand": 0, "reply": 0,
                                                      "combine": 4_000_000}, 1.0, 4000.0)
    tool.print_floors({"node_us": 1.0, "copy_gbps": 4000.0,
                       "traces": [{"label": "T=128 L=1 graph", "floors": rows}, {"label": "none", "floors": []}]})
    out = capsys.readouterr().out
    assert "T=128 L=1 graph: each phase against its floor" in out and "none:" not in out
    combine = next(line for line in out.splitlines() if line.startswith("combine"))
    assert combine.split()[-2:] == ["2", "2.5"]  # 5.0 µs against a 2.0 µs floor
