"""bench_decode keeps working and its parts compute what they claim.

- The tool at its tiniest size on the host backend (a subprocess into a temporary folder):
  exit code, every JSON field with sane values (tokens > 0, p99 >= p50, busy in [0, 1]), every
  layer check against the fp64 reference within tolerance, the target rows and the timeline.
- In-process: the decode batch's bookkeeping (compaction moves keep every slot's KV rows with
  its request, seeded arrivals, weighted percentiles), the decode attention against a per-request
  softmax written out, the target rows' N/A rule, and bench_afd's short-replica headline.
Numbers are never checked beyond sanity: benchmarks are tools, not tests.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, str(ROOT / "tools"))

import bench_afd  # noqa: E402
import bench_common  # noqa: E402
import bench_decode  # noqa: E402
import decode_batch  # noqa: E402
import decode_model  # noqa: E402
import graph_ffn_stats  # noqa: E402
from afd_cupy import wire  # noqa: E402
from afd_cupy.ffn import graph as ffn_graph  # noqa: E402


def _run(out_dir: Path, *extra: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), AFD_BACKEND="host")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_decode.py"), "--quick", "--backend", "host",
                           "--out", str(out_dir), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"bench_decode failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _check_run(run: dict) -> None:
    assert run["steps"] >= 1 and run["tokens"] > 0 and run["tokens_per_s"] > 0, run
    assert 0 < run["tpot_p50_ms"] <= run["tpot_p99_ms"], run
    assert run["tpot_mean_ms"] > 0 and 0 < run["mean_active"] <= run["batch"], run
    assert run["arrival_rate"] > 0 and run["arrived"] >= 0 and run["queue_end"] >= 0
    if run["requests_finished"]:
        assert 0 < run["request_tpot_p50_ms"] <= run["request_tpot_p99_ms"], run


@pytest.mark.timeout(300)
def test_bench_decode_quick_host(tmp_path):
    stdout = _run(tmp_path, "--duration", "0.5", "--solo-duration", "0.2", "--timeline")
    report = json.loads((tmp_path / "bench_decode.json").read_text())
    for key in ("tool", "backend", "label", "run", "model", "topology", "placements", "workloads", "results",
                "comparison", "targets", "verification", "method", "output_len", "arrival_rate", "wall_s"):
        assert key in report, key
    assert report["backend"] == "host" and "HOST BACKEND" in report["label"]
    assert {(r["workload"], r["schedule"]) for r in report["results"]} == {
        (w, s) for w in ("uniform", "skew16x") for s in ("async", "lockstep")}
    contexts = {w["name"]: w["contexts"] for w in report["workloads"]}
    assert contexts["skew16x"][0] == 16 * contexts["skew16x"][1] and len(set(contexts["uniform"])) == 1
    for row in report["results"]:
        assert row["tokens_per_s"] > 0 and len(row["replicas"]) == 2
        if row["schedule"] == "lockstep":  # the same number of steps for every replica
            assert len({rep["steps"] for rep in row["replicas"]}) == 1, row
        for rep in row["replicas"]:
            _check_run(rep)
            assert rep["context"] == contexts[row["workload"]][rep["rank"]] and rep["cache_bytes"] > 0
            if row["schedule"] == "async":
                solo = rep["solo"]
                assert solo["steps"] >= bench_decode.SOLO_MIN_STEPS and solo["tokens"] > 0
                assert 0 < solo["tpot_p50_ms"] <= solo["tpot_p99_ms"]
                for run in (solo, solo["corun"]):  # the FFN serving this replica alone, in its window
                    assert 0 < run["ffn"]["busy_fraction"] <= 1 and run["ffn"]["items_per_s"] > 0, run
                    assert "window_ns" not in run
                corun = solo["corun"]  # the co-run solo round runs by default
                assert corun["steps"] >= bench_decode.SOLO_MIN_STEPS and corun["tokens"] > 0
                assert 0 < corun["tpot_p50_ms"] <= corun["tpot_p99_ms"] and "corun" not in corun
            else:
                assert "solo" not in rep
        ffn = row["ffn"]
        assert ffn["served_by"] == ["loop"], ffn  # the host backend has no graph FFN
        assert 0 <= ffn["busy_fraction"] <= 1 and ffn["per_rank"][0]["items_taken"] > 0, ffn
        assert 0 <= ffn["items_waiting_mean"] <= ffn["items_waiting_max"], ffn
    # every launch checked its first step on each replica, and every check passed
    checks = report["verification"]
    assert len(checks) == 2 * 2 and all(c["ok"] and c["num_nan"] == 0 for c in checks), checks
    assert all(0 <= c["rel_err"] <= c["tolerance"] and c["num_tokens"] > 0 for c in checks)
    for entry in report["comparison"].values():
        assert entry["ratio"] > 0 and entry["ideal"] > 0 and entry["achieved_fraction"] > 0
        short = entry["short_replica"]
        assert short["vs_solo"] == pytest.approx(short["async"] / short["solo"])
        assert short["vs_lockstep"] == pytest.approx(short["async"] / short["lockstep"])
        assert short["vs_solo_corun"] == pytest.approx(short["async"] / short["solo_corun"])
        assert entry["achieved_fraction_corun"] == pytest.approx(entry["ratio"] / entry["ideal_corun"])
    assert report["solo_background"] == "attention"
    assert report["comparison"]["default / skew16x"]["short_replica"]["replica"] == 1
    names = [t["name"] for t in report["targets"]]
    assert any("short replica TPOT async / solo" in n for n in names)
    assert any("short replica TPOT async / lockstep" in n for n in names)
    assert any("uniform" in n and "tokens/s" in n for n in names)
    assert sum("fraction of ideal" in n for n in names) == 2
    assert {t["status"] for t in report["targets"]} <= {"PASS", "MISS", "N/A"}
    assert "bench_decode summary" in stdout and "headline default / skew16x: short replica 1" in stdout
    assert "verify: 4/4 layer checks within tolerance" in stdout
    panels = json.loads((tmp_path / "bench_decode_timeline.json").read_text())["panels"]
    assert len(panels) == 4
    for panel in panels:
        labels = [row["label"] for row in panel["rows"]]
        assert labels[:2] == [f"attn {a} (ctx {c})" for a, c in enumerate(contexts[panel["workload"]])]
        attn_names = {span[0] for span in panel["rows"][0]["spans"]}
        assert {"attention", "dispatch"} <= attn_names and attn_names & {"combine", "wait"}
        assert any(span[0] == "compute" for row in panel["rows"][2:] for span in row["spans"])


def _solo_rows(corun_tps):
    """An async and a lockstep row of 2 replicas; solo 100 + 50 tok/s, co-run solo ``corun_tps``."""
    def rep(a, tpot, tps, solo):
        return {"tpot_p50_ms": tpot, "tokens_per_s": tps, "solo": solo}
    solo = [{"tpot_p50_ms": 10.0, "tokens_per_s": 100.0}, {"tpot_p50_ms": 20.0, "tokens_per_s": 50.0}]
    if corun_tps is not None:
        for s, tps in zip(solo, corun_tps):
            s["corun"] = {"tpot_p50_ms": 1000.0 / tps, "tokens_per_s": tps}
    common = {"placement": "p", "workload": "skew16x", "contexts": [16, 1], "batches": [4, 4],
              "ffn": {"busy_fraction": 0.3}}
    return [dict(common, schedule="async", tokens_per_s=120.0,
                 replicas=[rep(0, 11.0, 80.0, solo[0]), rep(1, 25.0, 40.0, solo[1])]),
            dict(common, schedule="lockstep", tokens_per_s=60.0,
                 replicas=[rep(0, 40.0, 30.0, None), rep(1, 40.0, 30.0, None)])]


def test_compare_builds_the_co_run_ideal_from_the_co_run_solo_steps():
    entry = bench_decode.compare(_solo_rows((90.0, 30.0)))["p / skew16x"]
    assert entry["ideal"] == pytest.approx(150.0 / 60.0) and entry["ideal_corun"] == pytest.approx(120.0 / 60.0)
    assert entry["achieved_fraction_corun"] == pytest.approx(2.0 / 2.0)
    short = entry["short_replica"]  # replica 1 has the smaller context
    assert short["replica"] == 1 and short["solo_corun"] == pytest.approx(1000.0 / 30.0)
    assert short["vs_solo_corun"] == pytest.approx(25.0 / (1000.0 / 30.0))
    plain = bench_decode.compare(_solo_rows(None))["p / skew16x"]  # --solo-background none
    assert "ideal_corun" not in plain and "vs_solo_corun" not in plain["short_replica"]
    assert plain["achieved_fraction"] == pytest.approx(2.0 / 2.5)


# --------------------------------------------------------------------------- decode batch

def test_decode_batch_moves_keep_each_request_with_its_kv_rows():
    batch = decode_batch.DecodeBatch(context=20, batch=6, output_len=4, seed=3)
    batch.start_arrivals(rate=50.0, now_s=0.0)
    owner = [r.request_id for r in batch.active]  # which request's KV rows each slot holds
    rows = [r.kv_len for r in batch.active]  # KV rows written in each slot
    now, num_moves = 0.0, 0
    for _ in range(200):
        lengths = batch.kv_lengths()
        assert list(lengths) == rows[:batch.num_active]  # the new token goes right after its rows
        for slot in range(batch.num_active):
            rows[slot] += 1  # the step writes one K/V row per active slot
        now += 0.01
        for move in batch.advance(1.0, now):
            assert move.dst < move.src and move.length == rows[move.src]
            owner[move.dst], rows[move.dst] = owner[move.src], rows[move.src]
            num_moves += 1
        for slot, request in enumerate(batch.active):
            if owner[slot] != request.request_id:  # a joining request: its prompt KV is put there
                owner[slot], rows[slot] = request.request_id, request.kv_len
        assert owner[:batch.num_active] == [r.request_id for r in batch.active]
        assert all(r.generated < r.output_len for r in batch.active)
        assert batch.num_active <= batch.batch and max(rows) <= batch.cache_len
    assert num_moves > 0 and batch.num_finished > 0 and batch.num_arrived > 0


def test_decode_batch_is_seeded_and_counts_tokens():
    def run(seed):
        batch = decode_batch.DecodeBatch(context=100, batch=8, output_len=10, seed=seed)
        batch.start_arrivals(rate=200.0, now_s=0.0)
        batch.start_measuring()
        for step in range(60):
            batch.advance(1.0 + step % 3, 0.005 * (step + 1))
        return batch

    a, b, c = run(5), run(5), run(6)
    assert [r.prompt_len for r in a.active] == [r.prompt_len for r in b.active]
    assert a.step_tokens == b.step_tokens and a.request_tpot_ms == b.request_tpot_ms
    assert [r.prompt_len for r in a.active] != [r.prompt_len for r in c.active]
    stats = a.stats(elapsed_s=0.3)
    assert stats["tokens"] == sum(a.step_tokens) > 0 and stats["steps"] == 60
    assert 1.0 <= stats["tpot_p50_ms"] <= stats["tpot_p99_ms"] <= 3.0
    assert stats["requests_finished"] == len(a.request_tpot_ms) > 0
    for r in a.active + a.queue:
        assert 75 <= r.prompt_len <= 125 and 5 <= r.output_len <= 15


def test_poisson_arrivals_rate_and_no_arrivals():
    arrivals = decode_batch.PoissonArrivals(rate=1000.0, seed=1, start_s=10.0)
    assert arrivals.due(10.0) <= 3
    count = arrivals.due(20.0)
    assert 9_500 < count < 10_500  # 10 s at 1000/s: 4 sigma is ~400
    assert decode_batch.PoissonArrivals(rate=0.0, seed=1, start_s=0.0).due(1e9) == 0
    with pytest.raises(ValueError, match="arrival rate"):
        decode_batch.PoissonArrivals(rate=-1.0, seed=1, start_s=0.0)


def test_weighted_percentile_is_the_percentile_of_the_repeated_values():
    rng = np.random.default_rng(0)
    values = rng.random(37)
    weights = rng.integers(0, 9, 37)
    repeated = np.repeat(values, weights).tolist()
    for q in (1, 50, 90, 99, 100):
        assert decode_batch.weighted_percentile(values, weights, q) == bench_common.percentile(repeated, q)
    assert math.isnan(decode_batch.weighted_percentile([], None, 50))
    assert decode_batch.auto_rate(64, 128, 0.01, 2.0) == pytest.approx(100.0)


# --------------------------------------------------------------------------- decode attention

ATTENTION_CASES = [  # (device, hidden, heads, kv_heads, cache_len, KV lengths, mask span)
    pytest.param("cpu", 32, 4, 2, 48, (5, 30, 17), 32, id="cpu"),
    pytest.param("cuda", 2048, 16, 4, 4096, (5, 3000, 1700, 4000), 4016, id="cuda-quick-shape",
                 marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("device, hidden, heads, kv_heads, cache_len, kv_lengths, span", ATTENTION_CASES)
def test_decode_attention_matches_a_per_request_softmax(device, hidden, heads, kv_heads, cache_len, kv_lengths,
                                                        span):
    dims = decode_model.DecodeDims(layers=1, hidden=hidden, heads=heads, kv_heads=kv_heads, experts=4, top_k=2,
                                   shared=0, intermediate=8)
    replica = decode_model.DecodeReplica(dims, torch.device(device), seed=1)
    n = len(kv_lengths)
    replica.allocate(batch=n + 1, cache_len=cache_len)
    lengths = np.array(kv_lengths, np.int64)
    k_before = replica.k_cache[0].clone()
    x, positions, mask = replica.step_inputs(lengths)
    assert mask.shape == (n, 1, 1, span)  # the longest length + 1, rounded up to 16
    out = replica.attention(0, x, positions, mask)

    w, d = replica.layers[0], dims
    qkv = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (d.hidden,)), w["wqkv"]).float()
    q, k, v = qkv.split([d.heads * d.head_dim, d.kv_heads * d.head_dim, d.kv_heads * d.head_dim], dim=-1)
    heads_out = torch.empty(n, d.heads, d.head_dim, device=device)
    for t, length in enumerate(lengths.tolist()):
        assert torch.equal(replica.k_cache[0][t, :, length], k[t].view(d.kv_heads, d.head_dim).bfloat16())
        assert torch.equal(replica.k_cache[0][t, :, :length], k_before[t, :, :length])  # older rows kept
        for h in range(d.heads):
            kv = h // d.group
            keys = replica.k_cache[0][t, kv, :length + 1].float()
            values = replica.v_cache[0][t, kv, :length + 1].float()
            scores = keys @ q[t, h * d.head_dim:(h + 1) * d.head_dim] / math.sqrt(d.head_dim)
            heads_out[t, h] = torch.softmax(scores, dim=0) @ values
    expected = torch.nn.functional.linear(heads_out.reshape(n, d.hidden).bfloat16(), w["wo"]).float()
    rel_err = float((out.float() - expected).norm() / expected.norm())
    assert rel_err < 2e-2, rel_err  # bf16 rounding of the attention output; a wrong row or head is O(1)
    assert torch.equal(replica.k_cache[0][n], k_before[n])  # the slot past the batch is untouched


def test_apply_moves_copies_the_rows_of_every_layer():
    dims = decode_model.DecodeDims(layers=2, hidden=16, heads=2, kv_heads=1, experts=2, top_k=1, shared=0,
                                   intermediate=4)
    replica = decode_model.DecodeReplica(dims, torch.device("cpu"), seed=2)
    replica.allocate(batch=4, cache_len=16)
    before = [c.clone() for c in replica.k_cache + replica.v_cache]
    replica.apply_moves([decode_batch.Move(src=3, dst=1, length=7)])
    for old, new in zip(before, replica.k_cache + replica.v_cache):
        assert torch.equal(new[1, :, :7], old[3, :, :7]) and torch.equal(new[1, :, 7:], old[1, :, 7:])
        assert torch.equal(new[[0, 2, 3]], old[[0, 2, 3]])


# --------------------------------------------------------------------------- report logic

def _entry(busy: float, vs_solo: float, vs_lockstep: float, workload: str = "skew16x") -> dict:
    return {"placement": "p", "workload": workload, "ratio": 1.2, "ideal": 1.5, "achieved_fraction": 0.8,
            "ffn_busy": {"async": busy, "lockstep": busy},
            "short_replica": {"replica": 1, "async": 1.0, "lockstep": 1.0 / vs_lockstep, "solo": 1.0 / vs_solo,
                              "vs_solo": vs_solo, "vs_lockstep": vs_lockstep}}


def test_targets_are_na_where_the_ffn_is_saturated():
    workloads = (bench_decode.Workload("skew16x", (16384, 1024), (64, 64)),
                 bench_decode.Workload("uniform", (4096, 4096), (64, 64)))
    free = bench_decode.targets({"a": _entry(0.5, 1.2, 0.5), "b": _entry(0.5, 1.0, 1.0, "uniform")}, workloads)
    status = {t["name"].split(": ", 1)[1]: t["status"] for t in free}
    assert status == {"short replica TPOT async / solo": "PASS", "short replica TPOT async / lockstep": "PASS",
                      "fraction of ideal": "MISS", "async / lockstep tokens/s": "PASS"}
    bound = bench_decode.targets({"a": _entry(0.85, 1.2, 0.7)}, workloads)
    assert [t["status"] for t in bound] == ["N/A", "N/A", "N/A"]
    assert all("FFN saturated" in t["note"] and t["measured"] is not None for t in bound)
    missed = bench_decode.targets({"a": _entry(0.5, 1.4, 0.7)}, workloads)
    assert [t["status"] for t in missed[:2]] == ["MISS", "MISS"]


def _afd_row(schedule: str, batch_ms: tuple, solo_ms: tuple | None) -> dict:
    replicas = [{"rank": a, "tokens_per_batch": n, "tokens_per_s": n * 1e3 / ms, "batch_mean_ms": ms,
                 "solo": None if solo_ms is None else {"batch_mean_ms": solo_ms[a]}}
                for a, (n, ms) in enumerate(zip((4096, 256), batch_ms))]
    return {"schedule": schedule, "workload": "skewed", "replicas": replicas,
            "tokens_per_s": sum(r["tokens_per_s"] for r in replicas)}


def test_bench_afd_prefill_headline_is_the_short_replicas_batch_time(capsys):
    rows = [_afd_row("async", (30.0, 14.5), (25.0, 6.57)), _afd_row("lockstep", (26.7, 26.7), None)]
    entry = bench_afd.compare(rows)["skewed"]["short_replica"]
    assert entry["replica"] == 1 and (entry["async"], entry["lockstep"], entry["solo"]) == (14.5, 26.7, 6.57)
    assert entry["vs_solo"] == pytest.approx(14.5 / 6.57) and entry["vs_lockstep"] == pytest.approx(14.5 / 26.7)
    line = bench_common.short_replica_line("skewed", "batch time (mean)", entry)
    assert line == ("headline skewed: short replica 1 batch time (mean) async 14.5 / lockstep 26.7 / solo 6.57 ms; "
                    "async/solo 2.21x, async/lockstep 0.543x")


def test_decode_attention_never_runs_on_cudnn_sdpa_on_cuda():
    # cuDNN's SDPA builds a plan per new shape (66-70 ms on an H200): the decode span changes
    # every 16 steps, so the benchmark keeps it off on cuda, and leaves the CPU's choice alone
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with decode_model.sdpa_backends("cuda"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with decode_model.sdpa_backends("cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


# --------------------------------------------------------------------------- graph FFN busy time

def _record(replay: int, status: int, src: int = 0, layer: int = 0, stage: int = 0) -> np.ndarray:
    header_words = wire.HDR_FIXED_WORDS + 4
    record = np.zeros(ffn_graph.record_words(header_words), np.int64)
    record[ffn_graph.REC_REPLAY], record[ffn_graph.REC_STATUS] = replay, status
    words = record[ffn_graph.REC_HEADER:].view(np.int32)
    words[wire.HDR_SRC_RANK], words[wire.HDR_LAYER], words[wire.HDR_STAGE] = src, layer, stage
    return record


def test_graph_spans_take_the_served_replays_gemm_stamps():
    rng = np.random.default_rng(7)
    statuses = [ffn_graph.GS_IDLE, ffn_graph.GS_SERVED, ffn_graph.GS_SERVED, ffn_graph.GS_EAGER,
                ffn_graph.GS_SERVED, ffn_graph.GS_SERVED]
    records = [_record(r, st, src=r % 2, layer=r % 3, stage=0) for r, st in enumerate(statuses)]
    # consecutive replays on one stream: f_staged < f_gathered < f_reply0 < f_reply1 < next f_staged
    steps = rng.integers(1, 1000, size=(len(statuses), 4))
    rows = 10_000 + np.cumsum(steps.ravel()).reshape(steps.shape)
    rows[5, 2] = -1  # a point not stamped: the replay is left out
    offset = 123_456

    def to_ns(device_ns):
        return np.asarray(device_ns, np.float64) + offset

    out = graph_ffn_stats.graph_spans(rows, 0, records, to_ns, timeline=True)
    served = [1, 2, 4]
    assert out["compute_ns"] == [(rows[r, 1] + offset, rows[r, 2] + offset) for r in served]
    assert out["queue_ns"] == [rows[r, 0] + offset for r in served]
    assert len(out["queue_items"]) == 3 and all(math.isnan(v) for v in out["queue_items"])
    assert out["replays"]["SERVED"] == 3 and out["replays"]["IDLE"] == 1 and out["replays"]["EAGER"] == 1
    lanes = out["lanes"]["stream"]
    assert [name for name, *_ in lanes] == ["wait", "compute", "reply"] * 3
    # each served replay waits from the previous replay's end (f_reply1), whatever it did
    assert [(b, e) for name, b, e, _ in lanes if name == "wait"] == [
        (rows[r - 1, 3] + offset, rows[r, 0] + offset) for r in served]
    assert [tag for name, _, _, tag in lanes if name == "compute"] == [((r % 2, r % 3, 0),) for r in served]
    # rows from a later replay on (the ring kept the last ones): row i is replay first + i
    later = graph_ffn_stats.graph_spans(rows[2:], 2, records, to_ns, timeline=False)
    assert later["compute_ns"] == out["compute_ns"][1:] and later["lanes"] == {}
    with pytest.raises(ValueError, match="record 1 is of replay 2"):
        graph_ffn_stats.graph_spans(rows[:2], 0, [records[0], records[2]], to_ns, timeline=False)


def test_clock_map_removes_the_offset_and_the_drift():
    d0, h0 = 1_764_000_000_123_456_789, 1_000_000_000  # %globaltimer: ns since 1970
    drift = 1 + 2e-5
    anchors = [(d0, h0, 40), (d0 + 3_000_000_000, h0 + round(3_000_000_000 * drift), 60)]
    to_ns, info = graph_ffn_stats.clock_map(anchors)
    assert float(to_ns(d0 + 1_500_000_000)) == pytest.approx(h0 + 1_500_000_000 * drift, abs=1)
    assert info["scale"] == pytest.approx(drift) and info["anchor_error_ns"] == [40, 60]
    # anchors closer than 1 s: the offset only
    to_ns, info = graph_ffn_stats.clock_map([(d0, h0, 1), (d0 + 500_000_000, h0 + 500_100_000, 1)])
    assert info["scale"] == 1.0 and float(to_ns(d0 + 10)) == h0 + 10


@pytest.mark.cuda
@pytest.mark.timeout(420)
def test_bench_decode_on_cuda_measures_the_graph_ffn(tmp_path):
    """2A1F on one GPU under MPS (the suite starts it): async serves with the graph FFN, whose
    busy time comes from its device stamps; lockstep serves with the loop."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_decode.py"), "--quick", "--out", str(tmp_path),
                           "--presets", "uniform", "--duration", "1", "--solo-duration", "0.5",
                           "--placement", "0:50,0:50,0:50", "--timeline"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"bench_decode failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "bench_decode.json").read_text())
    by_schedule = {r["schedule"]: r for r in report["results"]}
    graph, loop = by_schedule["async"]["ffn"], by_schedule["lockstep"]["ffn"]
    assert graph["served_by"] == ["graph"] and loop["served_by"] == ["loop"], (graph, loop)
    assert 0 < graph["busy_fraction"] < 1 and graph["items_per_s"] > 0, graph
    assert math.isnan(graph["items_waiting_mean"]) and loop["items_waiting_mean"] >= 0
    assert all(c["ok"] for c in report["verification"]), report["verification"]
    panels = json.loads((tmp_path / "bench_decode_timeline.json").read_text())["panels"]
    async_panel = next(p for p in panels if p["schedule"] == "async")
    ffn_names = {span[0] for row in async_panel["rows"][2:] for span in row["spans"]}
    assert {"compute", "reply", "wait"} <= ffn_names, ffn_names
