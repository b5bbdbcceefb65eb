"""tools/bench_moe_layer.py keeps working: run at its tiny size on the CPU (host backend, 1A1F
launched for real) as a subprocess; the JSON's fields are checked, and the AFD output must
equal the one-process output of the same inputs (bf16 outputs, fp32 accumulation). Timings
are not checked beyond sanity: benchmarks are tools, not tests. The report arithmetic
(floors, ratios, targets) is checked in-process on synthetic numbers with known answers."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, str(ROOT / "tools"))

import bench_moe_layer  # noqa: E402

from afd_cupy.moe import stream_gemm  # noqa: E402

#: the stream kernels run here (Triton installed and its CPU interpreter able to run them)
HAS_TRITON = importlib.util.find_spec("triton") is not None and stream_gemm.unavailable_reason("cpu") is None


@pytest.mark.timeout(300)
def test_bench_moe_layer_tiny_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), AFD_BACKEND="host")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_moe_layer.py"), "--device", "cpu",
                           "--quick", "--tokens", "1", "8", "--iters", "2", "--prefill-iters", "2",
                           "--warmup", "1", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "bench_moe_layer.json").read_text())
    for key in ("tool", "run", "device", "config", "copy_bytes_per_s", "shapes", "ffn", "targets"):
        assert key in report, key
    assert report["copy_bytes_per_s"] > 0
    (tiny,) = report["shapes"].values()
    assert [row["tokens"] for row in tiny["rows"]] == [1, 8]
    for row in tiny["rows"]:
        for key in ("one_process_us", "afd_us", "afd_over_one_process", "routed_us", "routed_floor_us",
                    "layer_floor_us", "routed_floor_fraction", "experts_hit", "fp8_us", "fp8_rel_err",
                    "fp8_block_us", "fp8_block_rel_err"):
            assert row[key] is not None and row[key] > 0, key
        assert 1 <= row["experts_hit"] <= min(8, row["tokens"] * 2)
        assert row["afd_rel_err"] <= 1e-2, row["afd_rel_err"]  # AFD == one process
        assert 1e-3 < row["fp8_rel_err"] < 0.15 and row["fp8_native"] is False  # emulated on the CPU
        assert 1e-3 < row["fp8_block_rel_err"] < 0.15 and row["fp8_block_native"] is False
        if HAS_TRITON:  # the stream kernels in Triton's CPU interpreter
            assert row["fp8_stream_us"] > 0 and 1e-3 < row["fp8_stream_rel_err"] < 0.15
    from afd_cupy.moe.expert_gemm import ALL_VARIANTS, STREAM_VARIANTS

    assert {v["variant"] for v in tiny["variants"]} == set(ALL_VARIANTS)
    for v in tiny["variants"]:
        if v["variant"] in STREAM_VARIANTS and not HAS_TRITON:
            assert "triton" in v["skipped"].lower(), v
        else:
            assert "median_us" in v, v
    assert report["ffn"]["tiny"]["served"] > 0
    assert {t["status"] for t in report["targets"]} == {"NOT MEASURED"}  # tiny: no 128 / 4096 rows
    assert "routed experts alone by variant" in proc.stdout and "AFD / one process" in proc.stdout


def test_floors_and_targets_arithmetic():
    shape = bench_moe_layer.SHAPES["v2lite"]
    counts = [0] * 64
    counts[3], counts[10] = 5, 1
    f = bench_moe_layer.floors(shape, counts, copy_bps=4e12)
    expert_bytes = 3 * 2048 * 1408 * 2
    assert f["experts_hit"] == 2 and f["routed_bytes"] == 2 * expert_bytes
    assert f["layer_bytes"] == 4 * expert_bytes + 64 * 2048 * 2
    assert f["routed_floor_us"] == pytest.approx(2 * expert_bytes / 4e12 * 1e6)
    report = {"shape": bench_moe_layer.asdict(shape),
              "rows": [{"tokens": 128, "one_process": {"median_us": 500.0}, **f},
                       {"tokens": 4096, "one_process": {"median_us": 2000.0}, "dense_tflops": 800.0, **f}],
              "variants": [{"variant": "current", "tokens": 128, "median_us": 100.0},
                           {"variant": "kn_layout", "tokens": 128, "median_us": 80.0},
                           {"variant": "fp8_rowwise", "tokens": 128, "median_us": 50.0, "native": True,
                            "rel_err_vs_bf16": 0.05},
                           {"variant": "fp8_block", "tokens": 128, "median_us": 80.0, "native": True,
                            "rel_err_vs_bf16": 0.07},
                           {"variant": "current", "tokens": 4096, "median_us": 1000.0}]}
    afd = {128: {"afd": {"median_us": 600.0}, "afd_rel_err": 1e-3},
           4096: {"afd": {"median_us": 2200.0}, "afd_rel_err": 1e-3}}
    bench_moe_layer.enrich(report, afd)
    r128, r4096 = report["rows"]
    assert r128["routed_floor_fraction"] == pytest.approx(f["routed_floor_us"] / 100.0)
    assert r128["best_variant"] == "kn_layout" and r128["fp8_speedup"] == pytest.approx(2.0)
    assert r128["fp8_block_speedup"] == pytest.approx(1.25) and r128["fp8_block_rel_err"] == 0.07
    assert r128["afd_over_one_process"] == pytest.approx(1.2)
    flops = 6.0 * 4096 * 6 * 2048 * 1408
    assert r4096["grouped_tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    assert r4096["grouped_over_dense"] == pytest.approx(r4096["grouped_tflops"] / 800.0)
    status = {t["name"].split(": ", 1)[1]: t["status"] for t in bench_moe_layer.targets({"v2lite": report})}
    assert status["AFD / one process at decode 128"] == "MISS"  # 1.2 > 1.15
    assert status["AFD / one process at prefill 4096"] == "MISS"  # 1.1 > 1.05
    assert status["FP8 weights speedup vs bf16 at decode 128"] == "PASS"  # 2.0 >= 1.6
    assert status["FP8 block-scaled checkpoint weights speedup vs bf16 at decode 128"] == "MISS"  # 1.25
    expected = "PASS" if f["routed_floor_us"] / 100.0 >= 0.85 else "MISS"
    assert status["routed experts at decode 128 / weight-read floor"] == expected


@pytest.mark.cuda
@pytest.mark.timeout(200)
def test_bench_moe_layer_small_cuda(tmp_path):
    """The GPU paths (CUDA graphs of the one-process layer and of the Attention step, the graph
    FFN, every variant, native FP8) at a small shape; on one GPU this needs CUDA MPS running
    (the FFN's device polling), as tools/gpu_suite.sh provides."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_moe_layer.py"), "--device", "cuda",
                           "--shapes", "small", "--tokens", "1", "128", "2048", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, f"failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "bench_moe_layer.json").read_text())
    (small,) = report["shapes"].values()
    for row in small["rows"]:
        assert row["afd_rel_err"] <= 1e-2 and row["one_process"]["graph"] and row["afd_timing"]["graph"]
        assert row["routed_us"] > 0 and row["afd_us"] > 0
    errors = [v for v in small["variants"] if "error" in v or "capture_error" in v]
    assert not errors, errors
    assert small["rows"][-1]["grouped_over_dense"] > 0 and report["dense_peak_tflops"] > 0
    from afd_cupy.moe.expert_gemm import fp8_unavailable_reason

    if fp8_unavailable_reason("cuda") is None:
        assert all(r["fp8_native"] and r["fp8_rel_err"] < 0.15 for r in small["rows"])
        assert all(r["fp8_block_native"] and r["fp8_block_rel_err"] < 0.15 for r in small["rows"])


def test_gpu_suite_moe1_runs_the_quick_benchmark_and_its_arguments_parse():
    import re
    import shlex

    script = (ROOT / "tools" / "gpu_suite.sh").read_text()
    (line,) = re.findall(r"run_step moe_layer (\d+) python3 tools/bench_moe_layer.py (.+)$", script, re.M)
    limit, argv = int(line[0]), shlex.split(line[1].replace('"$OUT/moe_layer"', "out").rstrip("; "))
    assert limit <= 300  # with the tests before it, one device call of about 4-5 minutes
    args = bench_moe_layer.parse_args(argv + ["--device", "cuda"])
    assert args.quick and args.shapes == ["v2lite", "qwen3", "v3"]
    assert args.tokens == [1, 8, 32, 128, 256, 2048, 4096, 8192] and (args.iters, args.prefill_iters) == (20, 5)
    for bad in (["--device", "cpu", "--shapes", "v3"], ["--tokens", "0"]):
        with pytest.raises(SystemExit):
            bench_moe_layer.parse_args(bad)


@pytest.mark.timeout(300)
def test_bench_moe_layer_fp8_end_to_end_cpu(tmp_path):
    """--dispatch-dtype fp8_e4m3 --ffn-fp8-experts on the host backend (the small shape: H =
    256, a multiple of the 128-channel FP8 groups): the AFD output is within the FP8 bound of
    the bf16 one-process output and clearly not equal to it (the rows and weights were
    quantized); the settings are in the JSON."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), AFD_BACKEND="host")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_moe_layer.py"), "--device", "cpu",
                           "--shapes", "small", "--tokens", "4", "16", "--iters", "2", "--prefill-iters", "2",
                           "--warmup", "1", "--gemm-variants", "none", "--no-fp8", "--dispatch-dtype", "fp8_e4m3",
                           "--ffn-fp8-experts", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((tmp_path / "bench_moe_layer.json").read_text())
    assert report["config"]["dispatch_dtype"] == "fp8_e4m3" and report["config"]["ffn_fp8_experts"] is True
    (small,) = report["shapes"].values()
    for row in small["rows"]:
        assert 2e-3 < row["afd_rel_err"] <= bench_moe_layer.FP8_CHECK_TOL, row["afd_rel_err"]


def test_fp8_settings_parse_and_pick_the_fp8_bound():
    args = bench_moe_layer.parse_args(["--device", "cuda", "--dispatch-dtype", "fp8_e4m3"])
    assert bench_moe_layer.check_tolerance(args) == bench_moe_layer.FP8_CHECK_TOL
    assert bench_moe_layer.check_tolerance(bench_moe_layer.parse_args(["--device", "cuda"])) == \
        bench_moe_layer.CHECK_TOL
    args = bench_moe_layer.parse_args(["--device", "cuda", "--ffn-fp8-experts", "--ffn-expert-gemm", "stream"])
    assert args.ffn_fp8_experts and bench_moe_layer.check_tolerance(args) == bench_moe_layer.FP8_CHECK_TOL
    with pytest.raises(SystemExit):  # the graph FFN runs FP8 experts with the streamed kernels only
        bench_moe_layer.parse_args(["--device", "cuda", "--ffn-fp8-experts"])
