"""The benchmark tools keep working: each runs with ``--quick --backend host`` (its tiniest
size) as a subprocess into a temporary folder; exit code, JSON keys and the printed summary
are checked. Numbers are not checked beyond sanity (a fraction in (0, 1], p50 <= p99):
benchmarks are tools, not tests. The arithmetic the tools report (bench_afd's ideal ratio,
bench_spans' span bookkeeping) is tested in-process on synthetic timings with known answers."""
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
import bench_overlap  # noqa: E402
import bench_spans  # noqa: E402


def _run_tool(name: str, out_dir: Path, *extra: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), AFD_BACKEND="host")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / name), "--quick", "--backend", "host",
                           "--out", str(out_dir), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.timeout(90)
def test_bench_transport_quick_host(tmp_path):
    stdout = _run_tool("bench_transport.py", tmp_path, "--tokens", "1", "4", "--prefill-tokens", "32")
    report = json.loads((tmp_path / "bench_transport.json").read_text())
    for key in ("tool", "backend", "label", "run", "decode", "prefill", "targets", "timing", "rfc_baseline"):
        assert key in report, key
    assert report["placements"] and all(p["placement"] == "host backend: CPU processes"
                                        for p in report["placements"])
    assert report["backend"] == "host" and "HOST BACKEND" in report["label"]
    assert [row["tokens"] for row in report["decode"]] == [1, 4]
    for row in report["decode"]:
        assert row["iters"] >= 200 and row["rt_median_us"] > 0 and row["rt_p99_us"] >= row["rt_median_us"]
        assert row["rfc_rt_median_us"] > 0 and row["rfc_rt_p99_us"] >= row["rfc_rt_median_us"]
        assert row["speedup_vs_rfc"] > 0
    (prefill,) = report["prefill"]
    for key in ("dispatch_ms", "combine_ms", "copy_ms", "rfc_dispatch_ms", "rfc_combine_ms",
                "dispatch_GBps", "pair_vs_copy", "speedup_vs_rfc", "bytes"):
        assert prefill[key] > 0, key
    assert {t["status"] for t in report["targets"]} <= {"PASS", "MISS", "NOT MEASURED"}
    assert "bench_transport summary" in stdout and "(c) targets" in stdout
    assert "RFC med" in stdout and "x vs RFC" in stdout and "no second process" in stdout
    assert "decode_rfc" in report["timing"]
    assert stdout.rstrip().splitlines()[-1].startswith("dispatch+combine vs plain copy")  # table last


@pytest.mark.timeout(90)
def test_bench_transport_both_wire_modes_side_by_side_host(tmp_path):
    stdout = _run_tool("bench_transport.py", tmp_path, "--tokens", "8", "--prefill-tokens", "64",
                       "--iters", "20", "--wire-mode", "both")
    report = json.loads((tmp_path / "bench_transport.json").read_text())
    assert report["wire_mode"] == "both"
    assert [row["wire_mode"] for row in report["decode"]] == ["pair", "dedup"]
    assert [row["wire_mode"] for row in report["prefill"]] == ["pair", "dedup"]
    for row in report["decode"] + report["prefill"]:
        assert row["dispatch_wire_bytes"] > 0 and row["reply_wire_bytes"] > 0 and row["dispatch_link_us"] > 0
    assert report["decode"][0]["dispatch_us"] > 0
    decode, prefill = report["side_by_side"]
    assert (decode["kind"], prefill["kind"]) == ("decode", "prefill")
    # hidden 128, top-8, F=2: a dedup row per (token, rank), pair rows per partial + shared
    assert 0 < prefill["bytes_ratio"] < 0.5 and prefill["dedup_reply_bytes"] < prefill["pair_reply_bytes"]
    assert report["prefill"][1]["bytes"] < report["prefill"][0]["bytes"]
    names = [t["name"] for t in report["targets"]]
    assert names[0].startswith("dedup / pair dispatch bytes") and names[-1].endswith("[dedup]")
    assert "(d) wire modes side by side" in stdout and "bytes dedup/pair" in stdout


@pytest.mark.timeout(90)
def test_bench_transport_nccl_baseline_skipped_on_host(tmp_path):
    stdout = _run_tool("bench_transport.py", tmp_path, "--tokens", "1", "--prefill-tokens", "32",
                       "--iters", "20", "--nccl-baseline")
    report = json.loads((tmp_path / "bench_transport.json").read_text())
    (line,) = [line for line in stdout.splitlines() if line.startswith("NCCL baseline skipped")]
    assert "host backend" in line and report["nccl_baseline"]["skipped"] == [line]
    assert not any(key.startswith("nccl") for key in report["prefill"][0])


@pytest.mark.timeout(90)
def test_bench_afd_quick_host(tmp_path):
    stdout = _run_tool("bench_afd.py", tmp_path, "--duration", "0.5", "--solo-duration", "0.2", "--timeline")
    report = json.loads((tmp_path / "bench_afd.json").read_text())
    for key in ("tool", "backend", "label", "run", "model", "topology", "mps", "workloads",
                "results", "ratios", "comparison", "targets", "method"):
        assert key in report, key
    assert report["gemm_sm_carveout"] == "auto"  # the argument; the host backend resolves it to 0
    assert {(r["workload"], r["schedule"]) for r in report["results"]} == {
        (w, s) for w in ("uniform", "skewed") for s in ("async", "lockstep")}
    for row in report["results"]:
        assert row["tokens_per_s"] > 0 and len(row["replicas"]) == 2
        if row["schedule"] == "lockstep":  # same number of batches for every replica
            assert len({rep["batches"] for rep in row["replicas"]}) == 1, row
        for rep in row["replicas"]:
            assert rep["tokens_per_s"] > 0
            assert 0 < rep["latency_p50_ms"] <= rep["latency_p90_ms"] <= rep["latency_p99_ms"], rep
            solo = rep.get("solo")
            if row["schedule"] == "async":  # each replica alone, after the phase
                assert solo["batches"] >= 3 and solo["tokens_per_s"] > 0 and solo["batch_mean_ms"] > 0
                # the FFN serving this replica alone, inside its solo window
                for run in (solo, solo["corun"]):  # the co-run solo round runs by default
                    assert 0 < run["ffn"]["busy_fraction"] <= 1 and run["ffn"]["items_per_s"] > 0, run
                    assert "window_ns" not in run and run["batches"] >= 3 and run["batch_mean_ms"] > 0
            else:
                assert solo is None
        ffn = row["ffn"]
        assert 0 < ffn["busy_fraction"] <= 1, ffn
        assert ffn["per_rank"][0]["items_taken"] > 0 and ffn["items_per_s"] > 0
        assert 0 <= ffn["items_waiting_mean"] <= ffn["items_waiting_max"], ffn
    assert set(report["ratios"]) == {"uniform", "skewed"}
    for workload, entry in report["comparison"].items():
        assert entry["ratio"] == report["ratios"][workload]
        assert entry["ideal"] > 0 and entry["achieved_fraction"] > 0
        assert math.isclose(entry["achieved_fraction"], entry["ratio"] / entry["ideal"])
    names = {t["name"] for t in report["targets"]}
    assert "async / lockstep, fraction of ideal, skewed" in names
    assert "bench_afd summary" in stdout and "async / lockstep" in stdout and "fraction of ideal" in stdout
    assert "FFN busy" in stdout and "p99 ms" in stdout

    timeline = json.loads((tmp_path / "bench_afd_timeline.json").read_text())
    assert [(p["schedule"], p["workload"]) for p in timeline["panels"]] == [
        (s, w) for s in ("async", "lockstep") for w in ("uniform", "skewed")]
    for panel in timeline["panels"]:
        rows = {row["label"]: row["spans"] for row in panel["rows"]}
        assert set(rows) == {"attn 0 stream", "attn 1 stream", "ffn 0 host", "ffn 0 stream"}
        for label, lane in rows.items():  # per rank and lane: in order, never overlapping
            bench_spans.check_lane([tuple(span) for span in lane])
            assert all(0 <= span[1] <= span[2] <= panel["window_us"] for span in lane), label
        attn0 = {span[0] for span in rows["attn 0 stream"]}
        assert {"attention", "dispatch", "combine"} <= attn0, attn0
        assert "compute" in {span[0] for span in rows["ffn 0 stream"]}
        assert {span[0] for span in rows["ffn 0 host"]} <= {"wait"}
        # the window holds --timeline-layers (4) layers of replica 0: 4 dispatches, from layer 0
        dispatches = [span for span in rows["attn 0 stream"] if span[0] == "dispatch"]
        assert [span[3][1] for span in dispatches] == [0, 1, 0, 1]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib not installed: plot bench_afd_timeline.png skipped" in stdout
    else:
        assert (tmp_path / "bench_afd_timeline.png").stat().st_size > 0


@pytest.mark.timeout(90)
def test_bench_afd_sweep_host(tmp_path):
    stdout = _run_tool("bench_afd.py", tmp_path, "--sweep", "--sweep-skews", "1", "16", "--duration", "0.3",
                       "--solo-duration", "0.1", "--warmup", "1", "--sweep-placements", "0:50,0:50,1",
                       "--solo-spinners", "1")
    report = json.loads((tmp_path / "bench_afd_sweep.json").read_text())
    assert report["solo_spinners"] == [1]
    for row in (r for r in report["results"] if r["schedule"] == "async"):  # the spinner round
        for rep in row["replicas"]:
            spin = rep["solo"]["spin1"]
            assert spin["batches"] >= 3 and 0 < spin["ffn"]["busy_fraction"] <= 1 and spin["ffn"]["items_per_s"] > 0
    from afd_cupy.capacity import item_cost, validate

    (run,) = validate.runs_from_sweep(report, "host sweep")
    costs = item_cost.item_costs([run])
    assert len(costs) == 2 and all(set(c.spin_mix_ms) == {"spin1"} and c.over_spin["spin1"] > 0 for c in costs)
    assert report["mode"] == "sweep" and report["skews"] == [1, 16]
    assert [(p["split"], p["skew"]) for p in report["points"]] == [("0:50,0:50,1", 1), ("0:50,0:50,1", 16)]
    long_len = bench_afd.QUICK_DEFAULTS["host"]["long_len"]
    assert [p["lengths"] for p in report["points"]] == [[[long_len], [long_len]], [[long_len], [long_len // 16]]]
    for point in report["points"]:
        assert point["ratio"] > 0 and point["ideal"] > 0 and point["achieved_fraction"] > 0
        assert all(0 < b <= 1 for b in point["ffn_busy_fraction"].values()), point
    assert "GPU 1" in report["splits"][0]["placement"]
    assert "bench_afd sweep" in stdout and "fraction of ideal" in stdout


def test_bench_afd_host_spinner_round_is_one_core(tmp_path, capsys):
    # the host backend's spinner round is one polling core: more is refused before anything runs
    assert bench_afd.main(["--backend", "host", "--solo-spinners", "1", "2", "--out", str(tmp_path)]) == 2
    assert "one polling core (N = 1)" in capsys.readouterr().out
    for bad in (["--solo-spinners", "0"], ["--solo-spinners", "2", "2"]):
        with pytest.raises(SystemExit):
            bench_afd.parse_args(bad)


@pytest.mark.timeout(120)
def test_bench_afd_overlap_all_host(tmp_path):
    stdout = _run_tool("bench_afd.py", tmp_path, "--overlap", "all", "--duration", "0.3", "--warmup", "1")
    report = json.loads((tmp_path / "bench_afd_overlap.json").read_text())
    for key in ("tool", "backend", "label", "run", "model", "mps", "workloads", "results", "comparison",
                "overlap_gains", "targets", "method", "variants"):
        assert key in report, key
    assert report["mode"] == "overlap" and report["overlap"] == "all"
    assert report["variants"] == ["none", "attn", "ffn", "both"]
    # --overlap all: async on the uniform workload, two requests of half the uniform length
    half = bench_afd.QUICK_DEFAULTS["host"]["uniform_len"] // 2
    assert report["workloads"] == [{"name": "uniform", "lengths": [[half, half], [half, half]]}]
    assert [(r["overlap"], r["workload"], r["schedule"]) for r in report["results"]] == [
        (v, "uniform", "async") for v in ("none", "attn", "ffn", "both")]
    for row in report["results"]:
        assert row["tokens_per_s"] > 0 and all(rep["batches"] > 0 for rep in row["replicas"])
        assert row["ffn"]["per_rank"][0]["items_taken"] > 0
    (entry,) = report["overlap_gains"]
    assert (entry["workload"], entry["schedule"]) == ("uniform", "async")
    assert entry["variants"]["none"]["gain"] == 1.0
    by_overlap = {r["overlap"]: r["tokens_per_s"] for r in report["results"]}
    for variant, v in entry["variants"].items():
        assert v["gain"] == pytest.approx(by_overlap[variant] / by_overlap["none"])
    assert [t["name"] for t in report["targets"]] == [
        f"overlap {v} / none tokens/s, uniform, async" for v in ("attn", "ffn", "both")]
    assert {t["status"] for t in report["targets"]} <= {"PASS", "MISS"}
    assert "bench_afd overlap" in stdout and "gain vs none" in stdout and "HOST BACKEND" in stdout


@pytest.mark.timeout(90)
def test_bench_afd_overlap_both_timeline_host(tmp_path):
    stdout = _run_tool("bench_afd.py", tmp_path, "--overlap", "both", "--schedules", "async", "--workloads",
                       "uniform", "--duration", "0.4", "--solo-duration", "0", "--timeline")
    report = json.loads((tmp_path / "bench_afd.json").read_text())
    assert report["overlap"] == "both" and [r["overlap"] for r in report["results"]] == ["both"]
    assert "overlap: both" in stdout
    (panel,) = json.loads((tmp_path / "bench_afd_timeline.json").read_text())["panels"]
    rows = {row["label"]: row["spans"] for row in panel["rows"]}
    # one device lane per stage on every replica; the FFN's replies on their own lane
    assert {"attn 0 stream", "attn 0 stream1", "attn 1 stream", "attn 1 stream1", "ffn 0 host",
            "ffn 0 stream", "ffn 0 stream_reply"} == set(rows)
    for label in ("attn 0 stream", "attn 0 stream1", "ffn 0 stream"):
        bench_spans.check_lane([tuple(span) for span in rows[label]])
        assert rows[label], label
    assert {span[0] for span in rows["ffn 0 stream_reply"]} == {"reply"}
    stages = {tag[2] for span in rows["ffn 0 stream"] for tag in span[3]}
    assert stages == {0, 1}  # the FFN served both micro-batch stages


# --------------------------------------------------------------------------- bench_afd overlap logic

class _ScriptedConnector:
    """Attention-side stand-in: a token-wise "FFN" (2 x + 1), at most one dispatch in flight per
    stage (the connector's rule with ring_depth = num_stages); logs every call."""

    def __init__(self):
        self.calls, self.pending = [], {}

    def select_experts(self, logits):
        weights, ids = torch.topk(torch.softmax(logits.float(), -1), 2)
        return weights, ids.to(torch.int32)

    def send_attn_output(self, hidden, ids, weights, layer_idx, stage_idx=0):
        assert stage_idx not in self.pending, f"stage {stage_idx} sent twice without a receive"
        handle = self.pending[stage_idx] = (layer_idx, stage_idx, hidden)
        self.calls.append(("send", layer_idx, stage_idx, hidden.shape[0]))
        return handle

    def recv_ffn_output(self, handle, blocking=True):
        layer_idx, stage_idx, hidden = handle
        assert self.pending.pop(stage_idx) is handle
        self.calls.append(("recv", layer_idx, stage_idx))
        return hidden * 2 + 1

    def check_errors(self):
        self.calls.append("check")


def test_two_stage_pipeline_matches_one_stage_and_ping_pongs():
    dims = bench_afd.Dims(layers=3, hidden=32, heads=4, experts=8, top_k=2, shared=0, intermediate=16)
    replica = bench_afd.AttentionReplica(dims, torch.device("cpu"), seed=3)
    lengths = (5, 7, 4)  # stage 0: requests of 5 and 7 tokens; stage 1: 4 tokens
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    (plain,) = bench_afd._batch(_ScriptedConnector(), replica, x, lengths)
    replica.stages = bench_overlap.TwoStages(torch.device("cpu"))
    conn = _ScriptedConnector()
    halves = bench_afd._batch(conn, replica, x, lengths)
    assert [h.shape[0] for h in halves] == [12, 4]
    # the same per-request attention and token-wise layers: equal up to bf16 GEMM blocking
    torch.testing.assert_close(torch.cat(halves), plain, rtol=2e-2, atol=2e-2)
    assert conn.calls == [("send", 0, 0, 12), ("send", 0, 1, 4),
                          ("recv", 0, 0), ("send", 1, 0, 12), ("recv", 0, 1), ("send", 1, 1, 4),
                          ("recv", 1, 0), ("send", 2, 0, 12), ("recv", 1, 1), ("send", 2, 1, 4),
                          ("recv", 2, 0), ("recv", 2, 1), "check"]


def test_split_requests_and_variant_configs():
    assert bench_overlap.split_requests([8, 8]) == ((8,), (8,))
    assert bench_overlap.split_requests((3, 4, 5)) == ((3, 4), (5,))
    with pytest.raises(ValueError, match="--requests >= 2"):
        bench_overlap.split_requests([2048])
    assert bench_overlap.connector_config("attn").num_stages == 2
    assert bench_overlap.connector_config("both").ring_depth == 2
    assert bench_overlap.connector_config("ffn").num_stages == 1
    assert bench_overlap.connector_config("none") == bench_overlap.connector_config("ffn")


def test_overlap_gains_and_targets_known_answers():
    def row(overlap, workload, tokens_per_s, busy=0.5):
        return {"overlap": overlap, "workload": workload, "schedule": "async", "tokens_per_s": tokens_per_s,
                "replicas": [{"batch_mean_ms": 10.0, "latency_p50_ms": 9.0}], "ffn": {"busy_fraction": busy}}

    rows = [row("none", "uniform", 100.0), row("attn", "uniform", 125.0), row("ffn", "uniform", 104.0),
            row("both", "uniform", 130.0), row("none", "skewed", 50.0), row("attn", "skewed", 40.0)]
    entries = bench_overlap.gains(rows)
    uniform = next(e for e in entries if e["workload"] == "uniform")
    assert {v: e["gain"] for v, e in uniform["variants"].items()} == pytest.approx(
        {"none": 1.0, "attn": 1.25, "ffn": 1.04, "both": 1.3})
    skewed = next(e for e in entries if e["workload"] == "skewed")
    assert set(skewed["variants"]) == {"none", "attn"} and skewed["variants"]["attn"]["gain"] == 0.8
    targets = bench_overlap.gain_targets(entries)  # uniform only
    assert [(t["name"].split(" / ")[0], t["status"]) for t in targets] == [
        ("overlap attn", "PASS"), ("overlap ffn", "MISS"), ("overlap both", "PASS")]
    assert bench_overlap.gain_targets(bench_overlap.gains(rows[:1]))[0]["status"] == "NOT MEASURED"
    table = bench_overlap.gains_table(entries)
    assert "gain vs none" in table and "1.25" in table


# --------------------------------------------------------------------------- bench_afd arithmetic

def test_ideal_ratio_known_answers():
    # every replica at its solo pace under lockstep too: nothing to gain
    assert bench_afd.ideal_ratio([32, 32], [2.0, 2.0], [2.0, 2.0]) == pytest.approx(1.0)
    # 16x skew, cost linear in tokens: the short replica could run 16 batches per lockstep batch
    assert bench_afd.ideal_ratio([16, 1], [16.0, 1.0], [16.0, 16.0]) == pytest.approx(32 / 17)
    # lockstep slower than the slowest solo pace (merged FFN batch, waits): the ideal grows
    assert bench_afd.ideal_ratio([64, 8], [4.0, 0.5], [4.2, 4.2]) == pytest.approx((16 + 16) / (72 / 4.2))
    # a replica slower alone than under lockstep (noise) counts as measured, not clamped
    assert bench_afd.ideal_ratio([10, 10], [2.0, 1.0], [1.5, 1.5]) == pytest.approx((5 + 10) / (20 / 1.5))
    for bad in (([1], [1.0, 1.0], [1.0, 1.0]), ([], [], []), ([1, 1], [1.0, 0.0], [1.0, 1.0]),
                ([1, 1], [1.0, 1.0], [1.0, -1.0]), ([0, 1], [1.0, 1.0], [1.0, 1.0])):
        with pytest.raises(ValueError):
            bench_afd.ideal_ratio(*bad)


def _replica(rank, tokens, batch_ms, solo_ms=None):
    rep = {"rank": rank, "tokens_per_batch": tokens, "batch_mean_ms": batch_ms,
           "tokens_per_s": tokens * 1e3 / batch_ms}
    if solo_ms is not None:
        rep["solo"] = {"batch_mean_ms": solo_ms}
    return rep


def test_compare_uses_the_measured_lockstep_and_solo_paces():
    fast = [_replica(0, 64, 4.4, solo_ms=4.0), _replica(1, 8, 0.8, solo_ms=0.5)]
    slow = [_replica(0, 64, 4.2), _replica(1, 8, 4.2)]
    rows = [{"schedule": "async", "workload": "skewed", "replicas": fast,
             "tokens_per_s": sum(r["tokens_per_s"] for r in fast)},
            {"schedule": "lockstep", "workload": "skewed", "replicas": slow,
             "tokens_per_s": sum(r["tokens_per_s"] for r in slow)}]
    entry = bench_afd.compare(rows)["skewed"]
    assert entry["ratio"] == pytest.approx((64 / 4.4 + 8 / 0.8) / (72 / 4.2))
    assert entry["ideal"] == pytest.approx((64 / 4.0 + 8 / 0.5) / (72 / 4.2))
    # the lockstep measurement cancels: the fraction is async tokens/s over solo-paced tokens/s
    assert entry["achieved_fraction"] == pytest.approx((64 / 4.4 + 8 / 0.8) / (64 / 4.0 + 8 / 0.5))
    assert entry["ideal_async_tokens_per_s"] == pytest.approx(1e3 * (64 / 4.0 + 8 / 0.5))
    assert entry["lockstep_vs_slowest_solo"] == pytest.approx(4.2 / 4.0)
    # without solo runs (or without a lockstep row) no ideal is claimed
    for rep in fast:
        del rep["solo"]
    assert "ideal" not in bench_afd.compare(rows)["skewed"]
    assert bench_afd.compare(rows[:1]) == {}


# --------------------------------------------------------------------------- bench_spans

def test_span_recorder_lanes_are_ordered_and_disjoint():
    recorder = bench_spans.SpanRecorder(None)  # CPU: perf_counter_ns on every lane
    for layer in range(3):
        recorder.mark(bench_spans.HOST, "wait")
        recorder.mark(bench_spans.STREAM, "attention", (0, layer))
        recorder.mark(bench_spans.HOST, None)
        recorder.mark(bench_spans.STREAM, "dispatch", (0, layer))
        recorder.mark(bench_spans.STREAM, "combine", (0, layer))
    recorder.mark(bench_spans.HOST, "wait")  # left open: finish closes it
    lanes = recorder.finish()
    stream, host = lanes[bench_spans.STREAM], lanes[bench_spans.HOST]
    assert [(name, tag) for name, _, _, tag in stream] == [
        (name, (0, layer)) for layer in range(3) for name in ("attention", "dispatch", "combine")]
    assert [name for name, *_ in host] == ["wait"] * 4
    for lane in (stream, host):
        bench_spans.check_lane(lane)
    # consecutive spans of a lane share their boundary stamp
    assert all(a[2] == b[1] for a, b in zip(stream, stream[1:]))
    assert recorder.clock_info["kind"] == "host perf_counter_ns"
    with pytest.raises(ValueError, match="before the previous span"):
        bench_spans.check_lane([("a", 0, 10, None), ("b", 5, 20, None)])
    with pytest.raises(ValueError, match="ends before it begins"):
        bench_spans.check_lane([("a", 10, 5, None)])


def test_split_waits_ends_the_wait_at_the_reply():
    attn = [("attention", 0, 10, (0, 0)), ("dispatch", 10, 12, (0, 0)), ("combine", 12, 40, (0, 0)),
            ("attention", 40, 50, (0, 1)), ("dispatch", 50, 52, (0, 1)), ("combine", 52, 60, (0, 1)),
            ("attention", 60, 70, (1, 0)), ("dispatch", 70, 72, (1, 0)), ("combine", 72, 80, (1, 0))]
    ffn0 = [("compute", 14, 25, ((0, 0),)), ("reply", 25, 30, ((0, 0),)),
            ("compute", 53, 54, ((1, 1),)), ("reply", 54, 55, ((1, 1),)),  # another replica's reply
            ("compute", 40, 45, ((0, 1),)), ("reply", 45, 51, ((0, 1),))]  # landed before the combine
    ffn1 = [("compute", 15, 30, ((0, 0), (1, 0))), ("reply", 30, 35, ((0, 0), (1, 0)))]
    out = bench_spans.split_waits(attn, 0, [ffn0, ffn1])
    assert out == [("attention", 0, 10, (0, 0)), ("dispatch", 10, 12, (0, 0)), ("wait", 12, 35, (0, 0)),
                   ("combine", 35, 40, (0, 0)), ("attention", 40, 50, (0, 1)), ("dispatch", 50, 52, (0, 1)),
                   ("combine", 52, 60, (0, 1)),  # its reply landed at 51: no wait
                   ("attention", 60, 70, (1, 0)), ("dispatch", 70, 72, (1, 0)),
                   ("combine", 72, 80, (1, 0))]  # batch 1's layer 0: the replies at 30/35 were batch 0's
    bench_spans.check_lane(out)


def test_busy_fraction_queue_stats_and_clip():
    spans = [(0, 10), (20, 30), (35, 50)]
    assert bench_spans.busy_fraction(spans, (5, 45)) == pytest.approx((5 + 10 + 10) / 40)
    assert bench_spans.busy_fraction(spans, (10, 20)) == 0.0
    assert math.isnan(bench_spans.busy_fraction(spans, (5, 5)))
    stats = bench_spans.queue_stats([1, 5, 9, 12], [4, 0, 2, 7], (5, 10))
    assert stats == {"mean": 1.0, "max": 2, "samples": 2}
    assert bench_spans.queue_stats([1], [3], (5, 10))["samples"] == 0
    assert bench_spans.common_window([(0, 100), (10, 90), (5, 95)]) == (10, 90)
    assert bench_spans.clip([("a", 0, 10, None), ("b", 10, 20, 1), ("c", 25, 30, None)], (5, 15)) == [
        ("a", 5, 10, None), ("b", 10, 15, 1)]


def test_sweep_and_timeline_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    points = [{"split": split, "skew": skew, "ratio": 1 + skew / 20 * k, "ideal": 1 + skew / 10 * k}
              for k, split in ((1, "0:50,0:50,1"), (2, "0:25,0:25,0:50")) for skew in (1, 4, 16)]
    path = bench_common.save_plot(tmp_path, "sweep.png", bench_afd.draw_sweep(points, "sweep"))
    assert path.stat().st_size > 0
    panel = {"title": "async / skewed", "window_ns": (1000, 9000),
             "rows": [("attn 0 stream", [("attention", 1000, 3000, (1, 0)), ("wait", 3000, 6000, (1, 0))]),
                      ("ffn 0 stream", [("compute", 3500, 5000, ((0, 0),)), ("reply", 5000, 6000, ((0, 0),))]),
                      ("ffn 0 host", [])]}
    path = bench_common.save_plot(tmp_path, "timeline.png", bench_spans.draw_timeline([panel, panel], "t"))
    assert path.stat().st_size > 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire_mode", ["pair", "dedup"])
def test_soak_short_host_run_checks_every_output(tmp_path, wire_mode):
    env = dict(os.environ, PYTHONPATH=str(ROOT), AFD_BACKEND="host")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--backend", "host",
                           "--round-trips", "120", "--attn", "2", "--ffn", "2", "--stall-prob", "0.05",
                           "--peer-timeout", "0.3", "--wire-mode", wire_mode, "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"soak failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "soak.json").read_text())
    assert (report["wire_mode"], report["transport"]) == (wire_mode, "direct")
    assert report["round_trips"] == 240 and report["mismatches"] == 0
    assert set(report["errors"]) <= {"PeerTimeoutError"}
    assert report["ffn_stalls"] > 0  # the stalls happened and every later layer was right
    assert "SOAK PASS backend=host" in proc.stdout
    # what the job left in /dev/shm, by name (no afd segment: the PASS line checked them)
    assert all(isinstance(name, str) for name in report["shm_new_entries"])
    assert (f"new /dev/shm entries ({len(report['shm_new_entries'])})" in proc.stdout) == bool(report["shm_new_entries"])


@pytest.mark.timeout(120)
def test_hf_generate_tool_host(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    env = dict(os.environ, PYTHONPATH=str(ROOT), AFD_BACKEND="host")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "hf_generate.py"), "--backend", "host",
                           "--families", "mixtral", "deepseek_v3", "--steps", "3", "--ffn", "1",
                           "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"hf_generate failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "hf_generate.json").read_text())
    assert [row["family"] for row in report["families"]] == ["mixtral", "deepseek_v3"]
    for row in report["families"]:
        assert row["tokens"] == row["ref_tokens"] and len(row["tokens"]) == 3
        assert row["tokens_per_s"] > 0 and row["ref_tokens_per_s"] > 0
    assert "HF_GENERATE PASS backend=host 1A1F" in proc.stdout


def test_bench_transport_puts_direct_and_put_side_by_side_with_issue_16_targets():
    """Synthetic rows (the put transport runs on a GPU only): pairs per point, the two targets."""
    import bench_transport as tool  # tools/ is on sys.path (above)
    point = dict(wire_mode="pair", hidden=7168, top_k=8, num_ffn=2)
    decode = [dict(point, tokens=128, transport="direct", rt_median_us=25.0),
              dict(point, tokens=128, transport="put", rt_median_us=49.0)]
    prefill = [dict(point, tokens=4096, transport=t, dispatch_ms=d, combine_ms=c)
               for t, d, c in (("direct", 1.0, 1.0), ("put", 1.2, 1.2))]
    pairs = tool.transport_side_by_side(decode, prefill)
    assert [(r["kind"], r["put_minus_direct"], r["put_over_direct"]) for r in pairs] == \
        [("decode", 24.0, 49.0 / 25.0), ("prefill", 2.4 - 2.0, 1.2)]
    rows = tool._transport_targets(decode, prefill)
    assert len(rows) == 2 and "decode" in rows[0]["name"] and "prefill" in rows[1]["name"]
    assert [row["status"] for row in rows] == ["MISS", "PASS"], rows
    with pytest.raises(SystemExit, match="the put transport runs on the cuda backend only"):
        tool.plan_groups(tool.parse_args(["--quick", "--transport", "both"]), "host")
    # both wire modes over both transports (dedup over puts included) on the cuda backend
    groups = tool.plan_groups(tool.parse_args(["--quick", "--transport", "both", "--wire-mode", "both"]), "cuda")
    assert {(g.wire_mode, g.transport) for g in groups} == {
        ("pair", "direct"), ("pair", "put"), ("dedup", "direct"), ("dedup", "put")}


def test_bench_step_graph_arguments_rows_and_table(capsys):
    """bench_step_graph needs a GPU to measure: its argument parsing, row arithmetic, target and
    table run here on synthetic timings with known answers."""
    import bench_step_graph as tool  # tools/ is on sys.path (above)
    args = tool.parse_args([])
    assert (args.layers, args.tokens, args.stages, args.ffn, args.num_ffn, args.hidden, args.top_k, args.iters) == \
        ([1, 10, 50], [32], [1, 2], "graph", 1, 7168, 8, 200)
    assert tool.connector_config(args).num_stages == 2 and tool.connector_config(args).ring_depth == 2
    quick = tool.parse_args(["--quick", "--layers", "2", "50", "--ffn", "eager", "--num-ffn", "2",
                             "--stages", "1", "2", "4"])
    assert (quick.iters, quick.layers, quick.ffn, quick.num_ffn, quick.stages) == (30, [2, 50], "eager", 2, [1, 2, 4])
    assert tool.connector_config(quick).num_stages == 4
    assert tool.connector_config(tool.parse_args(["--stages", "1"])).num_stages == 1
    assert tool.connector_config(tool.parse_args([])).wire_mode == "pair"
    assert tool.connector_config(tool.parse_args(["--wire-mode", "dedup"])).wire_mode == "dedup"
    assert tool.connector_config(tool.parse_args([])).fused_dispatch
    assert not tool.connector_config(tool.parse_args(["--dispatch", "two-kernel"])).fused_dispatch
    assert tool.parse_args([]).stand_in == "linear" and tool.parse_args(["--stand-in", "elementwise"]).stand_in == "elementwise"
    model = tool.model_config(quick)
    assert (model.num_layers, model.max_num_batched_tokens, model.hidden_size) == (50, 32, 7168)
    for bad in (["--layers", "0"], ["--stages", "0"], ["--tokens", "2", "--stages", "1", "4"]):
        with pytest.raises(SystemExit):
            tool.parse_args(bad)
    eager, graph = [float(v) for v in range(100, 200)], [float(v) for v in range(50, 150)]
    row = tool.summarize(32, 50, eager, graph, 0.0)
    assert row["stages"] == 1 and row["eager_step_median_us"] == 149.5 and row["graph_step_median_us"] == 99.5
    assert row["graph_layer_median_us"] == 99.5 / 50 and row["graph_step_p10_us"] == 59.0
    assert row["graph_step_p90_us"] == 139.0 and row["graph_over_eager"] == 99.5 / 149.5
    small = tool.summarize(32, 1, [10.0], [20.0], 0.0)
    (target,) = tool.targets([small, row])
    assert target["status"] == "PASS" and target["measured"] == 99.5 / 50 and target["note"] == "32 tokens, 1 stage(s)"
    assert tool.targets([small])[0]["status"] == "NOT MEASURED"
    slow = tool.summarize(8, 50, eager, [v * 30 for v in graph], 1e-3)
    assert tool.targets([slow])[0]["status"] == "MISS"
    # stages: the ratio to S = 1 of the same (tokens, L); the target takes the best S
    two = tool.summarize(32, 50, eager, [v * 0.5 for v in graph], 0.0, stages=2)
    four = tool.summarize(32, 50, eager, [v * 0.8 for v in graph], 0.0, stages=4)
    other = tool.summarize(16, 50, eager, graph, 0.0, stages=2)  # no S = 1 row at 16 tokens
    rows = tool.add_stage_ratios([small, row, two, four, other])
    assert row["graph_over_s1"] == 1.0 and two["graph_over_s1"] == 0.5 and four["graph_over_s1"] == pytest.approx(0.8)
    assert other["graph_over_s1"] is None and small["graph_over_s1"] == 1.0
    (best,) = tool.targets(rows)
    assert best["measured"] == 49.75 / 50 and best["note"] == "32 tokens, 2 stage(s), one stream"
    report = {"config": {"num_ffn": 1, "ffn": "graph", "wire_mode": "pair", "hidden": 7168, "top_k": 8},
              "device": "test", "rows": rows, "targets": [best]}
    tool.print_report(report)
    out = capsys.readouterr().out
    assert "eager loop vs one captured graph" in out and "graph/eager" in out and "graph/S=1" in out
    assert "149.5 [109.0, 189.0]" in out and "99.5 [59.0, 139.0]" in out and "PASS" in out
    assert "49.8 [29.5, 69.5]" in out  # S = 2's captured step
    assert "a stream per stage vs one stream" not in out  # no per-stage rows: no such table
    json.dumps(report)  # the report is plain JSON


def test_bench_step_graph_stage_streams_variants_ratios_and_target(capsys):
    """--stage-streams: which variants run per S, the per-(T, L, S) table of the per-stage
    variant against one stream and S = 1 (captured per-layer medians of made-up rows, known
    answers), old rows without the key counted as one stream, and the issue #13 target
    naming the winning variant."""
    import bench_step_graph as tool
    assert tool.parse_args([]).stage_streams == "one"
    assert tool.parse_args(["--stage-streams", "both"]).stage_streams == "both"
    with pytest.raises(SystemExit):
        tool.parse_args(["--stage-streams", "two"])
    assert tool.stream_variants("one", 2) == ("one",) and tool.stream_variants("per-stage", 4) == ("per-stage",)
    assert tool.stream_variants("both", 2) == ("one", "per-stage")
    assert all(tool.stream_variants(mode, 1) == ("one",) for mode in tool.STREAM_MODES)  # S = 1: one stream

    def row(tokens, layers, stages, per_layer_us, streams="one"):
        return tool.summarize(tokens, layers, [2.0 * per_layer_us * layers], [per_layer_us * layers], 0.0,
                              stages=stages, stage_streams=streams)

    assert row(128, 50, 2, 1.0)["stage_streams"] == "one"
    old = {k: v for k, v in row(32, 50, 2, 200.0).items() if k != "stage_streams"}  # an older run's row
    rows = tool.add_stage_ratios([
        row(128, 50, 1, 160.0), row(128, 50, 2, 280.0), row(128, 50, 2, 120.0, "per-stage"),
        row(128, 50, 4, 520.0), row(128, 50, 4, 100.0, "per-stage"),
        row(32, 50, 1, 150.0), old, row(32, 50, 2, 90.0, "per-stage"),
        row(32, 10, 2, 50.0, "per-stage")])  # no S = 1 nor one-stream row at L = 10
    ratios = tool.stream_ratios(rows)
    assert [(r["tokens"], r["layers"], r["stages"]) for r in ratios] == [(32, 10, 2), (32, 50, 2), (128, 50, 2),
                                                                        (128, 50, 4)]
    lone, small, two, four = ratios
    assert (lone["s1_layer_us"], lone["one_layer_us"], lone["per_stage_layer_us"]) == (None, None, 50.0)
    assert lone["per_stage_over_one"] is None and lone["per_stage_over_s1"] is None and lone["one_over_s1"] is None
    assert (small["one_layer_us"], small["per_stage_over_one"]) == (200.0, 0.45)  # the keyless row is one stream
    assert small["per_stage_over_s1"] == pytest.approx(0.6) and small["one_over_s1"] == pytest.approx(4 / 3)
    assert (two["s1_layer_us"], two["one_layer_us"], two["per_stage_layer_us"]) == (160.0, 280.0, 120.0)
    assert two["per_stage_over_one"] == pytest.approx(3 / 7) and two["per_stage_over_s1"] == 0.75
    assert two["one_over_s1"] == 1.75
    assert four["per_stage_over_one"] == pytest.approx(100 / 520) and four["per_stage_over_s1"] == 0.625
    assert four["one_over_s1"] == 3.25
    assert tool.stream_ratios([r for r in rows if r.get("stage_streams") != "per-stage"]) == []
    per_stage_two = next(r for r in rows if (r["tokens"], r["stages"], r.get("stage_streams")) == (128, 2, "per-stage"))
    assert per_stage_two["graph_over_s1"] == 0.75  # the ratio to S = 1 covers both variants
    (target,) = tool.targets(rows)  # 128 tokens (the largest at L = 50): S = 4 with a stream per stage
    assert target["measured"] == 100.0 and target["status"] == "MISS"
    assert target["note"] == "128 tokens, 4 stage(s), a stream per stage"
    (one_wins,) = tool.targets([row(128, 50, 1, 39.0), row(128, 50, 2, 41.0, "per-stage")])
    assert one_wins["status"] == "PASS" and one_wins["note"] == "128 tokens, 1 stage(s)"
    report = {"config": {"num_ffn": 1, "ffn": "graph", "wire_mode": "pair", "hidden": 7168, "top_k": 8},
              "device": "test", "rows": rows, "stream_ratios": ratios, "targets": [target]}
    tool.print_report(report)
    out = capsys.readouterr().out
    assert "a stream per stage vs one stream" in out and "per-stage/one" in out and "per-stage/S=1" in out
    table = out.split("a stream per stage vs one stream")[1]
    assert "0.429" in table and "0.75" in table and "1.75" in table and "0.192" in table and "0.625" in table
    assert "per-stage" in out.split("a stream per stage")[0]  # the rows' streams column
    json.dumps(report)


def test_device_trace_matches_round_trips_and_splits_them_into_phases(tmp_path):
    """tools/device_trace.py's pure part on synthetic stamps (ns) with known answers: each
    Attention row finds the FFN replay that served it (not the idle replays around it), the
    phases telescope to the round trip, gaps between layers come from consecutive rows of a
    step, and a rank on another GPU (another clock) gets only its own side's phases."""
    import device_trace as dt
    us = 1000
    attention, ffn = [], []
    t = 1_000_000
    for step in range(2):
        for layer in range(3):  # a_send0, a_planned, a_sent, a_wait0, a_seen, a_done
            a0 = t
            attention.append([a0, a0 + 4 * us, a0 + 10 * us, a0 + 12 * us, a0 + 60 * us, a0 + 65 * us])
            # an idle replay that timed out before this dispatch, then the one that served it
            ffn.append([a0 - 5 * us, a0 - 4 * us, -1, a0 - 3 * us, a0 - 2 * us])
            ffn.append([a0 + 15 * us, a0 + 18 * us, -1, a0 + 20 * us, a0 + 50 * us])
            t = a0 + 65 * us + 7 * us  # 7 µs of attention + gate + residual before the next layer
        t += 1000 * us  # between steps
    attention = np.array(attention, np.int64)
    unmatched_row = [t, t + 3 * us, t + 10 * us, t + 11 * us, t + 30 * us, t + 31 * us]  # no FFN replay served it
    attention = np.vstack([attention, unmatched_row])
    ffn = np.array(ffn, np.int64)[::-1].copy()  # any order
    points, unmatched = dt.match_round_trips(attention, ffn)
    assert unmatched == 1 and len(points["a_send0"]) == 6
    assert np.all(points["f_seen"] - points["a_send0"] == 15 * us)
    assert np.all(points["f_gathered"] == points["f_staged"])  # the identity pair graph has no gather
    durations = dt.phase_durations_us(points)
    want = {"dispatch plan": 4, "dispatch scatter (dedup: rows + scatter; fused: plan + scatter)": 6, "doorbell -> FFN wait returns (fused: + stage)": 5, "FFN stage": 3,
            "FFN gather / expand": 0, "FFN experts": 2, "FFN reply": 30,
            "reply -> Attention wait returns": 10, "combine": 5}
    assert {name: set(v.tolist()) for name, v in durations.items()} == {k: {float(v)} for k, v in want.items()}
    summary = dt.phase_summary(attention, ffn, same_clock=True, layers=3)
    assert summary["matched"] == 6 and summary["unmatched"] == 1 and summary["rows"] == 7
    assert summary["phase_medians_sum_us"] == 65.0 == summary["matched_round_trip"]["median_us"]
    assert summary["beyond_experts"]["median_us"] == 63.0 and summary["beyond_experts"]["n"] == 6
    assert summary["phases"]["between layers (attention, gate, residual)"]["median_us"] == 7.0
    assert summary["phases"]["between layers (attention, gate, residual)"]["n"] == 4  # 2 per 3-layer step
    assert summary["phases"][dt.WAIT_PHASE[0]]["median_us"] == 48.0
    other_gpu = dt.phase_summary(attention, ffn, same_clock=False, layers=3)
    assert "round_trip_phases" not in other_gpu and other_gpu["phases"]["round trip"]["median_us"] == 65.0
    # a fused dispatch (afd_dispatch_fused) stamps no a_planned: a zero plan phase, the whole
    # dispatch in the scatter phase, the rows still complete and matched
    fused = attention.copy()
    fused[:, dt.ATTENTION_POINTS.index("a_planned")] = -1
    fused_summary = dt.phase_summary(fused, ffn, same_clock=True, layers=3)
    assert fused_summary["matched"] == 6 and fused_summary["complete_rows"] == 7
    assert fused_summary["round_trip_phases"]["dispatch plan"]["median_us"] == 0.0
    assert fused_summary["round_trip_phases"][
        "dispatch scatter (dedup: rows + scatter; fused: plan + scatter)"]["median_us"] == 10.0
    # an incomplete Attention row (a stamp missing) is neither matched nor counted as complete
    broken = attention.copy()
    broken[0, 3] = -1
    assert dt.phase_summary(broken, ffn, same_clock=True)["complete_rows"] == 6
    headers, rows = dt.phase_table({"T=32 graph": summary, "other": other_gpu})
    assert headers == ("phase (median µs)", "T=32 graph", "other")
    table = dict((r[0], r[1:]) for r in rows)
    assert table["FFN reply"] == (30.0, None) and table["sum of the phase medians"] == (65.0, None)
    assert table["matched / unmatched rows"] == ("6 / 1", "- / -")
    assert table[dt.BEYOND_EXPERTS] == (63.0, None)
    import bench_common as bc
    path = bc.save_plot(tmp_path, "phases.png", dt.draw_phases({"T=32 graph": summary}, "test"))
    assert path is None or path.stat().st_size > 0
    with pytest.raises(ValueError):
        dt.DeviceTrace(("a", "a"))  # refused before touching CuPy
    # CuPy names a template instance by its mangled name: the stamps key on the function name
    assert [dt.base_name(n) for n in ("afd_dispatch_plan", "afd_combine<2>", "_Z11afd_combineILi2EEvPv",
                                      "_Z21afd_graph_dedup_replyILi0EEvPKvy", "_ZN3afd8afd_stepILi1EEEvv")] == \
        ["afd_dispatch_plan", "afd_combine", "afd_combine", "afd_graph_dedup_reply", "afd_step"]


def test_bench_step_graph_trace_arguments_and_summaries():
    """--trace is refused where a round trip's stamps cannot come from one stream per side;
    trace_summaries labels each traced case and knows when the ranks share a clock."""
    import bench_step_graph as tool
    assert tool.parse_args(["--trace"]).trace_iters == 20
    for bad in (["--trace", "--ffn", "eager"], ["--trace", "--num-ffn", "2"], ["--trace", "--trace-iters", "0"]):
        with pytest.raises(SystemExit):
            tool.parse_args(bad)
    a = np.array([[0, 4, 10, 12, 60, 65]], np.int64) * 1000
    f = np.array([[15, 18, -1, 20, 50]], np.int64) * 1000
    kernel_bytes = {field: 4000 for field in tool.dt.PHASE_BYTES.values() if isinstance(field, str)}
    attn = {"device_id": 0, "node_us": 1.0, "copy_gbps": 4000.0,
            "traces": [{"tokens": 32, "layers": 1, "mode": "graph", "attention_rows": a, "kernel_bytes": kernel_bytes}]}
    (one,) = tool.trace_summaries(attn, {"device_id": 0, "trace_rows": f})
    assert one["label"] == "T=32 L=1 graph" and one["matched"] == 1 and one["phase_medians_sum_us"] == 65.0
    assert one["floors"][-1]["name"].startswith("round trip") and one["floors"][-1]["time_us"] == 65.0
    (two_gpus,) = tool.trace_summaries(attn, {"device_id": 1, "trace_rows": f})
    assert not two_gpus["same_clock"] and "round_trip_phases" not in two_gpus
    json.dumps([one, two_gpus])
    # real experts: the round trip beyond the "FFN experts" phase (f_gathered -> f_reply0 = 2 µs)
    assert one["beyond_experts"]["median_us"] == 63.0
    (row,) = tool.beyond_experts_target([one, two_gpus])
    assert row["measured"] == 63.0 and row["status"] == "MISS" and row["note"].startswith("32 tokens, L=1")
    fast = dict(one, beyond_experts={"median_us": 25.0})
    bigger = dict(one, tokens=128, beyond_experts={"median_us": 29.0})
    assert tool.beyond_experts_target([fast, bigger])[0]["measured"] == 29.0  # the largest batch
    assert tool.beyond_experts_target([dict(fast, mode="eager")])[0]["status"] == "NOT MEASURED"
    assert tool.beyond_experts_target(None) == []
    rows = [tool.summarize(32, 50, [100.0], [60.0], 0.0)]
    assert [t["name"] for t in tool.targets(rows, [fast])][1].startswith("round trip beyond")
    assert len(tool.targets(rows)) == 1
    moe = tool.parse_args(["--experts", "moe", "--hidden", "2048", "--top-k", "6", "--intermediate", "1408",
                           "--shared-experts", "2"])
    model = tool.model_config(moe)
    assert (model.moe_intermediate_size, model.num_shared_experts, model.top_k) == (1408, 2, 6)
    assert tool.parse_args([]).experts == "identity" and tool.model_config(tool.parse_args([])).moe_intermediate_size == 256
    for bad in (["--intermediate", "0"], ["--shared-experts", "-1"], ["--experts", "dense"]):
        with pytest.raises(SystemExit):
            tool.parse_args(bad)


def test_bench_transport_cross_gpu_placement():
    # fewer GPUs than processes: the Attention rank alone on GPU 0, FFN ranks spread over the rest
    import bench_transport
    place = bench_transport.cross_gpu_placement
    assert place(3, 2) is not None and [p.gpu for p in place(3, 2)] == [0, 1, 1]
    assert [p.gpu for p in place(5, 3)] == [0, 1, 2, 1, 2]
    assert place(2, 2) is None and place(3, 1) is None and place(3, 0) is None  # launch's default
    assert bench_transport.describe_placement(3, place(3, 2), "cuda", 2) == "0:0 1:1 2:1"


def test_gemm_sm_carveout_arguments_of_the_benchmarks():
    # bench_step_graph and bench_afd pass --gemm-sm-carveout to their FFN ranks (and record it):
    # "auto" by default, the library's default; an int >= 0; anything else is a usage error
    import bench_step_graph as tool
    for parse in (tool.parse_args, bench_afd.parse_args):
        assert parse([]).gemm_sm_carveout == "auto"
        assert parse(["--gemm-sm-carveout", "auto"]).gemm_sm_carveout == "auto"
        assert parse(["--gemm-sm-carveout", "0"]).gemm_sm_carveout == 0
        assert parse(["--gemm-sm-carveout", "3"]).gemm_sm_carveout == 3
        for bad in ("-1", "two", "2.0", "AUTO"):
            with pytest.raises(SystemExit):
                parse(["--gemm-sm-carveout", bad])
    spec_fields = {f.name: f.default for f in bench_afd.dataclasses.fields(bench_afd.Spec)}
    assert spec_fields["gemm_sm_carveout"] == "auto"


def test_gpu_suite_parts_cover_every_cuda_test_file_once():
    # tools/gpu_suite.sh part1..part3 are how the GPU sessions run the cuda tests within the
    # device's per-call limit: every test file with a cuda-marked test must be in exactly one
    # part's default list (a new file left out would never run on a GPU)
    import re

    script = (ROOT / "tools" / "gpu_suite.sh").read_text()
    parts = dict(re.findall(r'^\s*(part[123])\) SUITE_TESTS=\$\{SUITE_TESTS:-"([^"]+)"\}', script, re.M))
    assert sorted(parts) == ["part1", "part2", "part3"], parts
    listed = [name for files in parts.values() for name in files.split()]
    assert len(listed) == len(set(listed)), listed  # none in two parts
    cuda_files = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").glob("*/test_*.py")
                        # cuda marks in the file, or the backend lists of tests/helpers/backends.py
                        if re.search(r"mark\.cuda\b|pytestmark\s*=.*cuda|from helpers\.backends import",
                                     path.read_text()))
    assert "tests/integration/test_e2e.py" in cuda_files and len(cuda_files) >= 10
    assert sorted(listed) == cuda_files
    assert parts["part3"].split()[-1] == "tests/stress/test_faults.py"  # it kills processes: last
    # each part runs its tests on pytest-xdist workers by default (part2 alone takes ~7 minutes
    # serially), with room for a caller's PYTEST_ARGS
    workers = dict(re.findall(r'^\s*(part[123])\).*?PYTEST_ARGS=\$\{PYTEST_ARGS:-"-n (\d)"\}', script, re.M | re.S))
    assert workers == {"part1": "4", "part2": "3", "part3": "2"}, workers
    # part2 runs the jobs whose NVSHMEM start-ups collide under xdist one at a time: the -k
    # expression must still name tests of its files
    [serial] = re.findall(r'SERIAL_K=\$\{SERIAL_K-(\w+)\}', script)
    assert any(f"def test_{serial}" in (ROOT / f).read_text() for f in parts["part2"].split()), serial


def test_bench_gate_arguments_table_and_the_cpu_skip(tmp_path):
    import bench_gate

    args = bench_gate.parse_args([])
    assert (args.tokens, args.calls, args.iters) == ([1, 32, 128, 512], 50, 50)
    assert bench_gate.parse_args(["--quick"]).iters == 10
    for bad in (["--tokens", "0"], ["--calls", "0"], ["--iters", "0"]):
        with pytest.raises(SystemExit):
            bench_gate.parse_args(bad)
    row = {"tokens": 128, "experts": 64, "top_k": 6, "scoring": "softmax", "same_ids": True,
           "torch_graph_us": 21.0, "kernel_graph_us": 3.5, "graph_ratio": 6.0,
           "torch_eager_us": 80.0, "kernel_eager_us": 40.0, "eager_ratio": 2.0}
    text = bench_gate.table([row])
    assert "6.00" in text and "21.00" in text and "3.50" in text and "2.00" in text
    # ladder logits: distinct after bf16 rounding in every row
    logits = bench_gate.ladder_logits(np.random.default_rng(0), 16, 256)
    rounded = torch.from_numpy(logits).to(torch.bfloat16).float().numpy()
    assert all(len(np.unique(r)) == 256 for r in rounded)
    if not torch.cuda.is_available():
        assert bench_gate.main(["--out", str(tmp_path)]) == 0
        report = json.loads((tmp_path / "bench_gate.json").read_text())
        assert report["skipped"] and "rows" not in report


def test_gpu_suite_soak1_arguments_parse_and_fit_the_device_call():
    # soak1 is a whole device call: every soak it runs must parse, stop itself (--timeout, so
    # that a hang comes back with the ranks' stacks) before its step limit, and all of them
    # together must fit one 600 s call
    import re

    import soak

    script = (ROOT / "tools" / "gpu_suite.sh").read_text()
    block = script[script.index("  soak1)"):script.index("  trace1)")]
    base = re.search(r'SOAK="python3 tools/soak.py ([^"]*)"', block).group(1).split()
    steps = re.findall(r"run_step (\S+) (\d+) \$SOAK (.*)", block)
    assert len(steps) >= 4, steps
    covered = set()
    for name, limit, rest in steps:
        argv = base + [a for a in rest.split() if not a.startswith(("\"$OUT", ";;"))]
        argv = [a for a in argv if a != "--out"]
        args = soak.parse_args(argv)
        assert args.timeout + 10 <= int(limit), (name, args.timeout, limit)
        covered.add((args.wire_mode, args.transport))
    assert covered >= {("pair", "direct"), ("dedup", "direct"), ("pair", "put"), ("dedup", "put")}
    assert sum(int(limit) for _, limit, _ in steps) + 10 * len(steps) <= 600


def test_bench_kernels_configs_and_the_loopback_the_stage_serves():
    """tools/bench_kernels.py (a loopback round trip in one process, GPU only): its configs parse,
    bad ones name themselves, and every config's dispatch is one the FFN stage serves
    (GS_SERVED by ffn_graph.stage_reference), at one token and at the decode batch; a layer
    outside the stage's layers would be served eagerly and the loopback would hang on it."""
    import types

    import bench_kernels
    from afd_cupy.ffn import graph as ffn_graph
    from afd_cupy.wire.layout import WindowLayout, shared_capacity

    assert bench_kernels.parse_config("dedup:ll:staging") == bench_kernels.Config("dedup", "ll", "staging")
    for bad in ("pair:ll:identity", "pair:fused:staging", "dedup:fused", "x:fused:identity"):
        with pytest.raises(ValueError, match=bad):
            bench_kernels.parse_config(bad)
    args = bench_kernels.parse_args(["--configs", *bench_kernels.DEFAULT_CONFIGS])
    assert args.tokens == [1, 128] and args.num_experts == 256 and args.hidden == 7168
    rng = np.random.default_rng(5)
    for mode in ("pair", "dedup"):
        for tokens in (1, 128):
            layout = WindowLayout(num_regions=1, ring_depth=1, expert_per_rank=256, hidden_size=7168,
                                  itemsize=2, top_k=8, token_cap=tokens, routed_cap=8 * tokens,
                                  shared_cap=shared_capacity(tokens, 1, 1, mode), wire_mode=mode)
            ids = np.stack([rng.choice(256, 8, replace=False) for _ in range(tokens)]).astype(np.int32)
            loop = types.SimpleNamespace(layout=layout, ids=ids, tokens=tokens, top_k=8, stage_args=dict(
                routed_bucket=layout.routed_cap, shared_bucket=layout.shared_cap))
            assert bench_kernels.Loopback.expected_stage(loop) == ffn_graph.GS_SERVED, (mode, tokens)
    assert 0 <= bench_kernels.LAYER < bench_kernels.NUM_LAYERS


def test_gpu_suite_mps1_fits_the_device_call_and_the_spinner_stops_in_time():
    # mps1 times bench_kernels four ways in one call: the steps' limits fit 600 s, the
    # neighbor spins for less than its step's limit, and it refuses to run without a GPU
    import re

    import spin_neighbor

    script = (ROOT / "tools" / "gpu_suite.sh").read_text()
    block = script[script.index("  mps1)"):script.index("  trace1)")]
    steps = re.findall(r"run_step (\S+) (\d+) ", block)
    assert [name for name, _ in steps] == ["mps_none", "mps_full", "mps_half", "mps_half_spin"]
    assert sum(int(limit) for _, limit in steps) + 10 * len(steps) <= 600
    spin_limit = dict(steps)["mps_half_spin"]
    assert float(re.search(r"--seconds (\d+)", block).group(1)) + 5 < int(spin_limit)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in block and "NO_MPS=1 run_step mps_none" in block
    with pytest.raises(SystemExit):
        spin_neighbor.main(["--seconds", "0"])
    if not torch.cuda.is_available():
        assert spin_neighbor.main(["--seconds", "1"]) == 2


@pytest.mark.parametrize("mode", ["stream1", "stream2", "stream3", "fp8e2e"])
def test_gpu_suite_stream_modes_parse_and_fit_the_device_call(mode):
    # every benchmark a stream mode runs parses with its tool's own parser, and the steps'
    # limits fit one 600 s call
    import re
    import shlex

    script = (ROOT / "tools" / "gpu_suite.sh").read_text()
    start = script.index(f"  {mode})")
    block = script[start:script.index(";;", start)]
    variables = dict(re.findall(r'^\s*(\w+)="([^"]*)"', block, re.M))  # MOE="...", FP8L="..."
    steps = re.findall(r"run_step (\S+) (\d+) (python3 .*?)(?=\n\s*run_step|\n\s*\w+=|\Z)",
                       block.replace("\\\n", " "), re.S)
    assert steps and sum(int(limit) for _, limit, _ in steps) + 10 * len(steps) <= 600
    for name, _, command in steps:
        for variable, value in variables.items():
            command = command.replace(f"${variable}", value)
        argv = shlex.split(command)
        if argv[1] == "-m":  # the pytest step: its files exist
            assert all((ROOT / f).is_file() for f in argv if f.startswith("tests/")), argv
            continue
        tool = __import__(Path(argv[1]).stem)
        args = [a for a in argv[2:] if "$" not in a and not a.startswith("${")]
        args = [a for a in args if a != "--out"]
        if name.startswith("moe_layer"):  # its parser picks the CPU here, which runs tiny shapes only
            args += ["--device", "cuda"]
        tool.parse_args(args)
