"""The benchmark tools keep working: each runs with ``--quick --backend host`` (its tiniest
size) as a subprocess into a temporary folder; exit code, JSON keys and the printed summary
are checked. Numbers are not checked: benchmarks are tools, not tests."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    stdout = _run_tool("bench_afd.py", tmp_path, "--duration", "0.5")
    report = json.loads((tmp_path / "bench_afd.json").read_text())
    for key in ("tool", "backend", "label", "run", "model", "topology", "mps", "workloads",
                "results", "ratios", "targets"):
        assert key in report, key
    assert {(r["workload"], r["schedule"]) for r in report["results"]} == {
        (w, s) for w in ("uniform", "skewed") for s in ("async", "lockstep")}
    for row in report["results"]:
        assert row["tokens_per_s"] > 0 and len(row["replicas"]) == 2
        if row["schedule"] == "lockstep":  # same number of batches for every replica
            assert len({rep["batches"] for rep in row["replicas"]}) == 1, row
    assert set(report["ratios"]) == {"uniform", "skewed"}
    assert "bench_afd summary" in stdout and "async / lockstep" in stdout


@pytest.mark.timeout(90)
def test_profile_roundtrip_quick_host(tmp_path):
    stdout = _run_tool("profile_roundtrip.py", tmp_path, "--tokens", "2", "--hidden", "128",
                       "--iters", "40", "--warmup", "5")
    report = json.loads((tmp_path / "profile_phases.json").read_text())
    phases = {row["phase"]: row for row in report["phases"]}
    total = phases["round trip (attn send start -> recv done)"]
    assert total["n"] == 40 and total["median_us"] > 0
    # the host-clock phases that exist on the host backend tile the round trip
    parts = ("attn send_attn_output (host)", "send returned -> FFN sees arrival",
             "FFN arrival -> work item built", "FFN item -> reply called (experts)",
             "FFN send_ffn_work_item_output (host)", "FFN reply returned -> attn recv done")
    for name in parts:
        assert phases[name]["n"] == 40 and phases[name]["median_us"] >= 0, name
    assert phases["GPU combine"]["n"] == 0  # no CUDA events on the host backend
    assert "round-trip phases" in stdout and (tmp_path / "profile_attention.txt").exists()


@pytest.mark.timeout(120)
def test_soak_short_host_run_checks_every_output(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), AFD_BACKEND="host")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--backend", "host",
                           "--round-trips", "120", "--attn", "2", "--ffn", "2", "--stall-prob", "0.05",
                           "--peer-timeout", "0.3", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"soak failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["round_trips"] == 240 and report["mismatches"] == 0
    assert set(report["errors"]) <= {"PeerTimeoutError"}
    assert report["ffn_stalls"] > 0  # the stalls happened and every later layer was right
    assert "SOAK PASS backend=host" in proc.stdout


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
