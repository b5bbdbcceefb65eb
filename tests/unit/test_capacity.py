"""CPU tests of the capacity planner (afd_cupy.capacity): the simulator against hand-computed
bounds, the cost model, the calibration from benchmark JSON, the search and the CLI."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from afd_cupy.capacity import (Costs, Deployment, Link, ModelShape, Placement, ReplicaLoad,
                               SimConfig, parse_placements, simulate)
from afd_cupy.capacity import calibrate as cal
from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.search import Target, search
from afd_cupy.capacity.validate import (Case, MeasuredRun, calibrated_costs, run_from_report,
                                        runs_from_sweep)
from afd_cupy.errors import ConfigError

from helpers.capacity import small_costs
from helpers.paths import REPO_ROOT

SHAPE = ModelShape(layers=4, hidden=256, experts=16, top_k=2, intermediate=128, shared_experts=1)
LINK = Link(100.0, 3e-6)
ROOT = str(REPO_ROOT)


def deployment(num_attn: int, num_ffn: int = 1, **kw) -> Deployment:
    return Deployment.one_per_gpu(num_attn, num_ffn, intra_node=LINK, **kw)


def prefill(*lengths) -> ReplicaLoad:
    return ReplicaLoad("prefill", tuple(lengths))


def test_one_replica_step_is_the_sum_of_its_phases():
    c = small_costs()
    res = simulate(SHAPE, deployment(1), (prefill(100),), c, SimConfig(steps=3))
    nbytes = cm.wire_rows(SHAPE, 100, 1, "pair") * SHAPE.row_bytes
    per_layer = (cm.attention_time(c, 100, 100 * 101 / 2, 0, 1.0) + c.dispatch_fixed_s + LINK.time_s(nbytes)
                 + c.ffn_poll_s + cm.ffn_batch_time(c, SHAPE, 100, 1, 1.0) + LINK.time_s(nbytes) + c.combine_fixed_s)
    assert res.replicas[0].step_p50_s == pytest.approx(SHAPE.layers * per_layer, rel=1e-12)
    assert res.tokens_per_s == pytest.approx(100 / (SHAPE.layers * per_layer), rel=1e-9)


def test_saturated_ffn_caps_throughput_at_its_service_rate():
    c = small_costs(gemm_tflops=0.002)  # the FFN is ~100x slower than attention
    loads = tuple(prefill(64) for _ in range(4))
    res = simulate(SHAPE, deployment(4), loads, c, SimConfig(steps=8))
    # the host loop takes an item while the device computes the previous one: one item per
    # max(host, device) time
    service = max(c.ffn_item_s, cm.expert_gemm_time(c, SHAPE, 64, 1, 1.0))
    cap = 64 / (SHAPE.layers * service)  # tokens/s the FFN can serve, one item per batch
    assert res.tokens_per_s <= cap * (1 + 1e-6)
    assert res.tokens_per_s >= 0.95 * cap
    assert res.ffn_busy > 0.99


def test_lockstep_never_beats_async_when_the_ffn_is_idle_half_the_time():
    c = small_costs(weight_read_gbps=1e9, gemm_tflops=100.0, attn_fixed_s=150e-6)  # compute-bound FFN: merging items saves nothing
    for lengths in ((256, 256), (512, 32), (400, 100, 25), (300, 300, 300, 10)):
        loads = tuple(prefill(n) for n in lengths)
        fast = simulate(SHAPE, deployment(len(lengths)), loads, c, SimConfig("async", steps=10))
        slow = simulate(SHAPE, deployment(len(lengths)), loads, c, SimConfig("lockstep", steps=10))
        assert fast.ffn_busy <= 0.5, lengths
        assert fast.tokens_per_s >= slow.tokens_per_s * (1 - 1e-9), lengths


def test_with_one_replica_async_equals_lockstep():
    for load in (prefill(300, 20), ReplicaLoad("decode", batch_size=16, context_len=500, output_len=7)):
        runs = [simulate(SHAPE, deployment(1, 2), (load,), small_costs(), SimConfig(s, steps=9)) for s in ("async", "lockstep")]
        assert runs[0].tokens_per_s == runs[1].tokens_per_s
        assert runs[0].replicas[0].step_p99_s == runs[1].replicas[0].step_p99_s


def test_littles_law_on_items_waiting():
    c = small_costs(gemm_tflops=0.005)
    loads = (prefill(128), prefill(16), ReplicaLoad("decode", batch_size=8, context_len=64, arrival_rate=4000.0))
    for schedule in ("async", "lockstep", "async_merge"):
        res = simulate(SHAPE, deployment(3), loads, c, SimConfig(schedule, steps=12, seed=3))
        for f in res.ffn:
            rate = f.arrivals / f.run_s
            assert f.items_waiting_mean == pytest.approx(rate * f.mean_wait_s, rel=1e-9), schedule
            assert f.items_waiting_mean > 0.0
    assert res.ffn[0].arrivals > 100
    serial = c.replace(ffn_host_overlap=False)  # one thread takes and computes: items wait untaken
    busy = simulate(SHAPE, deployment(3), loads, serial, SimConfig("async", steps=12, seed=3)).ffn[0]
    assert busy.items_waiting_mean > 1.0 and busy.items_waiting_max >= 1  # a saturated FIFO holds items


def test_seeded_runs_are_deterministic():
    loads = tuple(ReplicaLoad("decode", batch_size=8, context_len=200 * (a + 1), output_len=5, arrival_rate=3000.0)
                  for a in range(3))
    runs = [simulate(SHAPE, deployment(3), loads, small_costs(), SimConfig(steps=10, seed=s)).to_dict() for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_share_scales_compute_and_saturates_bandwidth():
    c = small_costs(attn_fixed_s=0.0, attn_per_ctx_token_s=0.0, bandwidth_sat=0.5)
    assert cm.attention_time(c, 1000, 0, 0, 0.25) == pytest.approx(4 * cm.attention_time(c, 1000, 0, 0, 1.0))
    floor = small_costs(gemm_tflops=1e9, weight_read_gbps=100.0, bandwidth_sat=0.5)
    assert cm.expert_gemm_time(floor, SHAPE, 4, 1, 0.5) == pytest.approx(cm.expert_gemm_time(floor, SHAPE, 4, 1, 1.0))
    assert cm.expert_gemm_time(floor, SHAPE, 4, 1, 0.25) == pytest.approx(2 * cm.expert_gemm_time(floor, SHAPE, 4, 1, 1.0))


def test_wire_rows_and_experts_touched():
    assert cm.wire_rows(SHAPE, 100, 2, "pair") == pytest.approx(100 * 2 / 2 + 50)
    dedup = cm.wire_rows(SHAPE, 100, 2, "dedup")
    assert 50 + 50 < dedup < 100 * 2 / 2 + 50  # some tokens hit both of a rank's experts
    assert cm.experts_touched(0, 2, 16, 8) == 0.0
    assert cm.experts_touched(10_000, 2, 16, 8) == pytest.approx(8.0)


def test_async_merge_reads_the_weights_once_per_layer():
    floor_bound = small_costs(weight_read_gbps=2.0, gemm_tflops=1e6)
    loads = tuple(prefill(8) for _ in range(4))
    plain = simulate(SHAPE, deployment(4), loads, floor_bound, SimConfig("async", steps=6))
    merged = simulate(SHAPE, deployment(4), loads, floor_bound, SimConfig("async_merge", steps=6))
    assert merged.tokens_per_s > 1.5 * plain.tokens_per_s


@pytest.mark.parametrize("make, field", [
    (lambda: ModelShape(layers=0, hidden=8, experts=4, top_k=2, intermediate=8), "ModelShape.layers"),
    (lambda: ModelShape(layers=1, hidden=8, experts=4, top_k=5, intermediate=8), "ModelShape.top_k"),
    (lambda: Link(-1.0, 0.0), "Link.bandwidth_gbps"),
    (lambda: Link(1.0, -1e-6), "Link.latency_s"),
    (lambda: Placement(0, 1.5), "Placement.share"),
    (lambda: ReplicaLoad("train"), "ReplicaLoad.kind"),
    (lambda: ReplicaLoad("prefill", (10, 0)), "ReplicaLoad.lengths"),
    (lambda: ReplicaLoad("decode", arrival_rate=0.0), "ReplicaLoad.arrival_rate"),
    (lambda: SimConfig(schedule="sync"), "SimConfig.schedule"),
    (lambda: SimConfig(wire_mode="raw"), "SimConfig.wire_mode"),
    (lambda: Costs(gemm_tflops=0.0), "Costs.gemm_tflops"),
    (lambda: Costs(bandwidth_sat=1.5), "Costs.bandwidth_sat"),
    (lambda: Deployment(parse_placements("0:60,0:60"), parse_placements("1")), "GPU 0 sum to 1.20"),
    (lambda: parse_placements("0:30,,1"), "empty placement"),
    (lambda: Target(weight_fraction=2.0), "Target.weight_fraction"),
    (lambda: simulate(SHAPE, deployment(2), (prefill(4),), small_costs()), "one ReplicaLoad per Attention replica"),
])
def test_invalid_inputs_raise_config_error_naming_the_field(make, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace("(", r"\(")):
        make()


def test_fit_recovers_known_costs_from_solo_batches():
    truth = small_costs(ffn_item_s=300e-6, attn_per_token_s=2e-7, gemm_tflops=0.5, weight_read_gbps=50.0)
    base = small_costs(ffn_item_s=20e-6, attn_per_token_s=2e-7, gemm_tflops=1.0, weight_read_gbps=50.0)
    places = "0:30,0:30,0:40"
    dep = Deployment(parse_placements(places)[:1], parse_placements(places)[2:], same_gpu=LINK)
    solo = {n: simulate(SHAPE, dep, (prefill(n),), truth, SimConfig(steps=3)).replicas[0].step_mean_s * 1e3
            for n in (16, 512, 2048)}
    run = MeasuredRun("synthetic", "test", SHAPE, places, 2,
                      (Case("a", ((16,), (512,)), (solo[16], solo[512])), Case("b", ((2048,), (16,)), (solo[2048], None))),
                      link=LINK)
    fitted = calibrated_costs(run, base)
    assert fitted.ffn_item_s == pytest.approx(truth.ffn_item_s, rel=0.05)
    assert fitted.gemm_tflops == pytest.approx(truth.gemm_tflops, rel=0.05)


def test_transport_costs_from_bench_transport_json(tmp_path):
    rows = [{"tokens": t, "dispatch_wire_bytes": b, "reply_wire_bytes": b, "dispatch_ms": (20e-6 + b / 400e9) * 1e3,
             "combine_ms": (10e-6 + b / 500e9) * 1e3} for t, b in ((1024, 2e7), (4096, 8e7))]
    path = tmp_path / "bench_transport.json"
    path.write_text(json.dumps({"tool": "bench_transport", "run": {"commit": "x"}, "prefill": rows,
                                "decode": [{"tokens": 1, "rt_median_us": 100.0}, {"tokens": 32, "rt_median_us": 120.0}]}))
    got, link = cal.transport_costs(str(path), small_costs())
    assert got.dispatch_fixed_s == pytest.approx(20e-6, rel=1e-6)
    assert got.combine_fixed_s == pytest.approx(10e-6, rel=1e-6)
    assert got.ffn_item_s == pytest.approx(70e-6, rel=1e-6)
    assert link.bandwidth_gbps == pytest.approx(400.0, rel=1e-6)
    (tmp_path / "other.json").write_text(json.dumps({"tool": "bench_afd"}))
    with pytest.raises(ConfigError, match="expected 'bench_transport'"):
        cal.transport_costs(str(tmp_path / "other.json"), small_costs())


def _bench_afd_report() -> dict:
    def row(schedule, solo):
        reps = []
        for rank, (n, ms) in enumerate(((64, 4.0), (8, 3.0))):
            rep = {"rank": rank, "lengths": [n], "batch_mean_ms": ms * 1.3}
            if solo:
                rep["solo"] = {"batch_mean_ms": ms}
            reps.append(rep)
        return {"schedule": schedule, "workload": "skewed", "tokens_per_s": 1.0, "replicas": reps,
                "ffn": {"busy_fraction": 0.3}}
    return {"tool": "bench_afd", "backend": "host", "run": {"commit": "x"}, "topology": "2A1F",
            "model": {"layers": 2, "hidden": 64, "heads": 4, "experts": 8, "top_k": 2, "shared": 1,
                      "intermediate": 32},
            "mps": {"placement": "rank 0 (attention): GPU 0 at 30% of its SMs; rank 1 (attention): GPU 0 "
                                 "at 30% of its SMs; rank 2 (ffn): GPU 0 at 40% of its SMs", "shared_gpu": True},
            "workloads": [{"name": "skewed", "lengths": [[64], [8]]}],
            "results": [row("async", True), row("lockstep", False)], "comparison": {"skewed": {"ratio": 1.1}}}


def test_run_from_a_bench_afd_report():
    report = _bench_afd_report()
    assert [p.share for p in cal.report_placements(report, 2, 1)] == [0.3, 0.3, 0.4]
    points = cal.solo_points(report)
    assert [(p.lengths, p.solo_batch_s) for p in points] == [((64,), 4e-3), ((8,), 3e-3)]
    run = run_from_report(report, "r", cores=2)
    assert run.slowdown == (1.0, 1.5) and run.placement == "0:30,0:30,0:40"
    assert run.cases[0].batch_ms["lockstep"] == (4.0 * 1.3, 3.0 * 1.3)


def _background(rank: int, batches: int, layer_ms: float, covered: float) -> dict:
    """One entry of bench_afd's ``solo["corun"]["background"]`` (2 layers a batch)."""
    return {"rank": rank, "batches": batches, "layers": 2 * batches, "window_s": 0.1, "layer_mean_ms": layer_ms,
            "batch_mean_ms": 2 * layer_ms, "batch_p10_ms": 1.5 * layer_ms, "batch_median_ms": 2 * layer_ms,
            "batch_p90_ms": 3 * layer_ms, "covered_fraction": covered, "first_begin_ms": 1.0, "last_end_ms": 99.0}


def test_the_corun_background_pace_is_read_where_recorded():
    report = _bench_afd_report()
    assert run_from_report(report, "r").cases[0].corun_background is None  # reports before the field
    (row,) = [r for r in report["results"] if r["schedule"] == "async"]
    # replica 0's co-run window held 3 of replica 1's batches; replica 1's none of replica 0's
    row["replicas"][0]["solo"]["corun"] = {"batch_mean_ms": 5.0, "background": [_background(1, 3, 0.75, 0.9)]}
    row["replicas"][1]["solo"]["corun"] = {"batch_mean_ms": 6.0,
                                           "background": [_background(0, 0, float("nan"), 0.0)]}
    case = run_from_report(report, "r").cases[0]
    first, second = case.corun_background
    assert first == (cal.BackgroundPace(1, 6, 0.75, 1.125, 1.5, 2.25, 0.9),)
    assert second == (cal.BackgroundPace(0, 0, None, None, None, None, 0.0),)  # no pace, never NaN
    assert case.corun_ms == (5.0, 6.0)  # the fields read before are unchanged
    # one replica's row without the field: None for it, the other's kept
    del row["replicas"][1]["solo"]["corun"]["background"]
    assert run_from_report(report, "r").cases[0].corun_background == (first, None)
    assert cal.background_paces(None) is None and cal.background_paces({"background": []}) == ()


def test_no_shipped_run_records_the_background_pace():
    """The shipped JSON predates the field: the reader gives None, so no prediction can use it."""
    from afd_cupy.capacity import measured
    assert {case.corun_background for run in measured.GPU_RUNS for case in run.cases} == {None}


def test_runs_from_a_bench_afd_sweep_report():
    plain = _bench_afd_report()
    rows = [dict(r, split=label) for label in ("0:50,0:50,1", "0:25,0:25,0:50") for r in plain["results"]]
    sweep = {**plain, "mode": "sweep", "results": rows,
             "splits": [{"label": "0:50,0:50,1", "placement": "x"}, {"label": "0:25,0:25,0:50", "placement": "y"}],
             "points": [{"split": label, "workload": "skewed", "lengths": [[64], [8]], "ratio": 1.2, "ideal": 1.5}
                        for label in ("0:50,0:50,1", "0:25,0:25,0:50")]}
    runs = runs_from_sweep(sweep, "s")
    assert [r.placement for r in runs] == ["0:50,0:50,1", "0:25,0:25,0:50"]
    assert runs[0].cases[0].ratio == 1.2 and runs[0].cases[0].solo_ms == (4.0, 3.0)
    assert parse_placements(runs[0].placement)[2].gpu == 1


def test_hbm_contention_slows_only_overlapping_phases():
    dep = dict(attention=parse_placements("0:50,0:50"), ffn=parse_placements("1"), same_gpu=LINK, intra_node=LINK)
    loads = (prefill(256), prefill(256))
    fast_ffn = small_costs(gemm_tflops=1000.0)  # attention-bound: the two replicas' attention overlaps
    plain = simulate(SHAPE, Deployment(**dep), loads, fast_ffn, SimConfig(steps=4))
    slowed = simulate(SHAPE, Deployment(**dep, hbm_contention=1.0), loads, fast_ffn, SimConfig(steps=4))
    assert slowed.replicas[1].step_mean_s > 1.1 * plain.replicas[1].step_mean_s
    solo = [simulate(SHAPE, Deployment(dep["attention"][:1], dep["ffn"], same_gpu=LINK, intra_node=LINK,
                                       hbm_contention=k), loads[:1], small_costs(), SimConfig(steps=4)) for k in (0.0, 1.0)]
    assert solo[0].replicas[0].step_mean_s == solo[1].replicas[0].step_mean_s  # nothing runs beside it


def test_search_respects_the_sla_and_the_expert_memory():
    load = ReplicaLoad("decode", batch_size=32, context_len=256, output_len=16)
    rows, best = search(SHAPE, small_costs(), load, 6, target=Target(step_p99_sla_s=1.0), steps=3)
    assert {(r.num_attn, r.num_ffn) for r in rows} == {(5, 1), (4, 2), (2, 4)}
    assert best is not None and best.tokens_per_s_per_gpu == max(r.tokens_per_s_per_gpu for r in rows)
    _, none = search(SHAPE, small_costs(), load, 6, target=Target(step_p99_sla_s=1e-9), steps=3)
    assert none is None
    with pytest.raises(ConfigError, match="FFN GPUs"):
        search(SHAPE, small_costs(), load, 4, target=Target(hbm_gb=1e-4))


def test_plan_afd_tool_writes_json(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_afd.py"), "--example", "tiny",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "plan_afd.json").read_text())
    assert report["tool"] == "plan_afd" and report["cases"] and math.isfinite(report["cases"][0]["best"]["tokens_per_s"])


def test_fit_costs_takes_the_gemm_scale_from_the_solo_ffn_busy():
    base, link = small_costs(gemm_tflops=50.0, weight_read_gbps=5000.0), Link(100.0, 0.0)
    k_true, extra = 3.0, 150e-6  # expert compute 3x slower than base, +150 us fixed per layer on the FFN host
    points = []
    for i, lengths in enumerate(((64,), (512,), (2048,))):
        p = cal.SoloPoint("w", i, lengths, 1.0, 1.0, 1.0, 1)
        fixed, attn, floor, compute = cal._parts(SHAPE, base, link, p)
        gemm = max(floor, compute * k_true)
        points.append(cal.SoloPoint("w", i, lengths, fixed + attn + gemm + SHAPE.layers * extra, 1.0, 1.0, 1,
                                    ffn_busy_per_item_s=gemm / SHAPE.layers))
    fitted = cal.fit_costs(SHAPE, points, base, link)
    assert fitted.gemm_tflops == pytest.approx(base.gemm_tflops / k_true, rel=0.01)
    assert fitted.ffn_item_s == pytest.approx(base.ffn_item_s + extra, rel=0.02)
    assert "from the FFN busy per item" in fitted.source
    # a busy time that disagrees with the batch times still wins: the GEMM scale is measured, not fitted
    halved = [dataclasses.replace(p, ffn_busy_per_item_s=p.ffn_busy_per_item_s / 2) for p in points]
    assert cal.fit_costs(SHAPE, halved, base, link).gemm_tflops == pytest.approx(2 * fitted.gemm_tflops, rel=0.02)


def test_plan_afd_simulates_mps_caps_and_the_attention_beside_gemm_term(tmp_path):
    """--simulate on the benchmarks' MPS split (shares summing past 1) needs --mps-caps; the
    attention's κ beside the GEMMs reaches the simulated deployment."""
    base = [sys.executable, os.path.join(ROOT, "tools", "plan_afd.py"), "--simulate", "--placement",
            "0:50,0:50,0:100", "--attn", "2", "--prefill", "1024,256", "--schedule", "async", "--out", str(tmp_path)]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "mps_caps" in refused.stderr
    steps = []
    for beside in ("0", "3"):
        run = subprocess.run(base + ["--mps-caps", "--hbm-contention", "0.2", "--attn-gemm-contention", beside],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        (result,) = json.loads((tmp_path / "plan_afd.json").read_text())["results"]
        steps.append(result["replicas"][0]["step_mean_s"])
    assert steps[1] > 1.05 * steps[0]  # the long replica's attention runs beside the GEMMs: slower
