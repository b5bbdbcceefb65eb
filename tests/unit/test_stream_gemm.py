"""The streamed expert GEMMs (afd_cupy.moe.stream_gemm) in Triton's CPU interpreter against the
float64 numpy reference (tests/helpers/stream_gemm.py): fresh random experts, rows and counts
per test (empty experts, an expert over one row tile, strided rows), outputs prefilled with
NaN, bf16-free dtypes (the interpreter's bf16 dot is wrong; the GPU test covers bf16), FP8
weights, every activation; the argument checks. Skipped where Triton is not installed (CI
installs it); its GPU twin is tests/kernels/test_stream_gemm_cuda.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from afd_cupy.moe import stream_gemm

from helpers.rng import node_rng
from helpers.stream_gemm import (EXPERT_ACTIVATIONS, random_counts, random_experts, random_rows, rel_error,
                                 stream_reference)

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


#: the tests that do not run the kernel in the interpreter (they run wherever Triton is)
_NO_INTERPRETER = {"test_row_block_follows_the_mean_rows", "test_config_checks",
                   "test_compiles_for_sm90_pipelined", "test_the_interpreter_probe_names_what_fails"}


@pytest.fixture(autouse=True)
def _interpreter(request):
    """Skip where the interpreter cannot run (checked per test: a GPU run collects this file
    too; some Triton releases' interpreters fail on newer numpy)."""
    if request.node.originalname in _NO_INTERPRETER:
        return
    reason = stream_gemm.unavailable_reason("cpu")
    if reason is not None:
        pytest.skip(reason)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
def test_matches_reference(request, dtype, fp8):
    rng = node_rng(request)
    num_experts, hidden, inter = int(rng.integers(3, 9)), 16 * int(rng.integers(2, 5)), 16 * int(rng.integers(2, 4))
    weights = random_experts(rng, num_experts, hidden, inter, dtype, fp8=fp8)
    counts = random_counts(rng, num_experts, mean_rows=float(rng.uniform(2, 10)))
    x = random_rows(rng, counts, hidden, dtype, stride_pad=int(rng.integers(0, 3)) * 8)
    out = torch.full((x.shape[0], hidden), float("nan"), dtype=dtype)
    config = stream_gemm.StreamConfig(block_n=16, block_k=32)  # several tiles of each dimension
    got = stream_gemm.grouped_mlp_streamed(x, torch.tensor(counts), weights, config=config, out=out)
    assert got is out
    assert rel_error(got, stream_reference(x, counts, weights)) < TOLERANCE[dtype]


@pytest.mark.parametrize("activation", [a for a in EXPERT_ACTIVATIONS if a != "silu"])
def test_other_activations_run_unfused(request, activation):
    rng = node_rng(request)
    weights = random_experts(rng, 4, 32, 32, torch.float32, activation=activation)
    counts = random_counts(rng, 4, mean_rows=5.0)
    x = random_rows(rng, counts, 32, torch.float32)
    got = stream_gemm.grouped_mlp_streamed(x, torch.tensor(counts, dtype=torch.int32), weights,
                                           config=stream_gemm.StreamConfig(block_n=16, block_k=16))
    assert rel_error(got, stream_reference(x, counts, weights)) < TOLERANCE[torch.float32]


def test_agrees_with_grouped_mlp(request):
    """The library's own path on the same fp32 experts (its loop computes in fp32 too)."""
    from afd_cupy import moe

    rng = node_rng(request)
    weights = random_experts(rng, 6, 48, 32, torch.float32)
    counts = random_counts(rng, 6, mean_rows=7.0, empty=2)
    x = random_rows(rng, counts, 48, torch.float32)
    got = stream_gemm.grouped_mlp_streamed(x, torch.tensor(counts), weights)
    want = moe.grouped_mlp(x, torch.tensor(counts), weights)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("fp8", [False, True])
def test_stacked_layers_with_the_graph_ffns_offsets(request, fp8):
    """stacked_mlp_streamed on every layer's experts stacked, with the offsets the graph FFN's
    stage writes (ffn/graph.routed_offsets_reference): the arrived layer's rows match the
    reference on that layer's experts; rows past them, and every row when no layer arrived, stay
    unwritten (NaN)."""
    import dataclasses

    from afd_cupy.ffn import graph as ffn_graph

    rng = node_rng(request)
    layers, epr, hidden, inter, capacity = 3, 4, 32, 32, 128  # > 3 * 6 + 38 rows
    stacked = random_experts(rng, layers * epr, hidden, inter, torch.float32, fp8=fp8)
    x = torch.tensor(rng.standard_normal((capacity, hidden)), dtype=torch.float32)
    for layer in (0, layers - 1, None):
        counts = random_counts(rng, epr, mean_rows=6.0)
        offs = torch.tensor(ffn_graph.routed_offsets_reference(counts, layer, layers, epr))
        out = torch.full((capacity, hidden), float("nan"))
        stream_gemm.stacked_mlp_streamed(x, offs, stacked, experts_per_layer=epr, out=out,
                                         config=stream_gemm.StreamConfig(block_n=16, block_k=16))
        if layer is None:
            assert torch.isnan(out).all()
            continue
        rows = int(counts.sum())
        one_layer = slice(layer * epr, (layer + 1) * epr)
        fields = ("w13", "w2") + (("w13_scale", "w2_scale") if fp8 else ())
        view = dataclasses.replace(stacked, num_experts=epr, **{f: getattr(stacked, f)[one_layer] for f in fields})
        assert rel_error(out[:rows], stream_reference(x[:rows], counts, view)) < TOLERANCE[torch.float32]
        assert torch.isnan(out[rows:]).all()


def test_zero_rows_and_all_empty_experts(request):
    rng = node_rng(request)
    weights = random_experts(rng, 3, 16, 16, torch.float32)
    got = stream_gemm.grouped_mlp_streamed(torch.zeros(0, 16), torch.zeros(3, dtype=torch.int64), weights)
    assert got.shape == (0, 16)


def test_row_block_follows_the_mean_rows():
    assert [stream_gemm.row_block(r, 64) for r in (64, 768, 1536, 4096, 10 ** 6)] == [16, 32, 64, 64, 64]
    assert stream_gemm.row_block(1024, 256) == 16 and stream_gemm.row_block(5, 0) == 16


@pytest.mark.parametrize("bad", [dict(block_n=48), dict(block_k=8), dict(num_warps=3), dict(num_stages=0),
                                 dict(block_m=48), dict(block_m=8)])
def test_config_checks(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        stream_gemm.StreamConfig(**bad)


def test_argument_checks(request):
    rng = node_rng(request)
    weights = random_experts(rng, 3, 16, 16, torch.float32)
    counts, x = torch.tensor([1, 2, 0]), torch.zeros(3, 16)
    cases = [
        (dict(x=torch.zeros(3, 8)), "x must be"),
        (dict(x=torch.zeros(16, 3).t()), "unit column stride"),
        (dict(x=torch.zeros(3, 16, dtype=torch.float16)), "matching the weights"),
        (dict(group_counts=torch.tensor([1.0, 2.0, 0.0])), "group_counts"),
        (dict(group_counts=torch.tensor([1, 2])), "group_counts"),
        (dict(out=torch.zeros(3, 8)), "out must be"),
    ]
    for change, match in cases:
        args = dict(x=x, group_counts=counts, out=None) | change
        with pytest.raises(ValueError, match=match):
            stream_gemm.grouped_mlp_streamed(args["x"], args["group_counts"], weights, out=args["out"])
    with pytest.raises(ValueError, match="ExpertWeights"):
        stream_gemm.grouped_mlp_streamed(x, counts, object())
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    for bad in (0, 2, True, 1.0):  # 3 experts: 1 or 3 per layer
        with pytest.raises(ValueError, match="experts_per_layer"):
            stream_gemm.stacked_mlp_streamed(x, offs, weights, experts_per_layer=bad)
    with pytest.raises(ValueError, match="offs must be an int"):
        stream_gemm.stacked_mlp_streamed(x, offs[:2], weights, experts_per_layer=1)
    with pytest.raises(ValueError, match="offs must be int32"):
        stream_gemm.stacked_mlp_streamed(x, offs.long(), weights, experts_per_layer=1)


def test_runs_interpreted_after_triton_was_imported_for_the_gpu():
    """The kernel uses Triton's builtins only, so the CPU path runs even where another library
    imported Triton first (its standard functions then compiled-only); in a fresh process."""
    import subprocess
    import sys

    from helpers.paths import REPO_ROOT

    code = ("import triton, triton.language, torch; from afd_cupy import moe; "
            "from afd_cupy.moe import stream_gemm as s; "
            "w = moe.ExpertWeights(torch.randn(3, 32, 16), torch.randn(3, 16, 16), 3); "
            "c = torch.tensor([2, 0, 5]); x = torch.randn(7, 16); "
            "print(float((s.grouped_mlp_streamed(x, c, w) - moe.grouped_mlp(x, c, w)).abs().max()))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) < 1e-4


SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on an H100 / H200


@pytest.mark.timeout(300)
def test_compiles_for_sm90_pipelined():
    """Every specialization the MLP launches with the default config (each row tile that
    row_block picks) compiles for sm_90 without a GPU, with pipelined loads (cp.async) and
    tensor-core MMAs, within one block's shared memory; in a process of its own, without
    TRITON_INTERPRET. (Larger tiles can exceed it: bench_stream_gemm reports those.)"""
    import json
    import subprocess
    import sys

    from helpers.paths import REPO_ROOT

    code = ("import json; from afd_cupy.moe import stream_gemm as s; "
            "print(json.dumps([r for m in (16, 32, 64) for r in s.compile_check(90, block_m=m)]))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO_ROOT), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 24 and {(r["glu"], r["rows"], r["weights"]) for r in results} == {
        (g, x, w) for g in (True, False) for x in ("bf16", "fp16") for w in (x, "fp8e4nv")}
    for r in results:
        assert r["cp_async"] > 0 and r["mma"] > 0 and 0 < r["shared_bytes"] <= SM90_MAX_SHARED, r


def test_a_fixed_row_tile_gives_the_same_rows(request):
    """StreamConfig(block_m=...) (prefill's large tiles): the same output as the automatic tile,
    with experts both under and over one tile."""
    rng = node_rng(request)
    weights = random_experts(rng, 4, 32, 32, torch.float32)
    counts = random_counts(rng, 4, mean_rows=12.0)
    x = random_rows(rng, counts, 32, torch.float32)
    auto = stream_gemm.grouped_mlp_streamed(x, torch.tensor(counts), weights)
    fixed = stream_gemm.grouped_mlp_streamed(x, torch.tensor(counts), weights,
                                             config=stream_gemm.StreamConfig(block_m=16, block_n=16, block_k=16))
    assert torch.allclose(auto, fixed, rtol=1e-5, atol=1e-5 * float(auto.abs().max()))
    assert rel_error(fixed, stream_reference(x, counts, weights)) < TOLERANCE[torch.float32]


def test_the_interpreter_probe_names_what_fails(monkeypatch):
    """unavailable_reason("cpu") runs a tiny problem in the interpreter once: a failing
    interpreter (as Triton 3.6's with numpy 2.4) is named with both versions instead of an
    error at the first call; a wrong result is named too."""
    import numpy as np

    class Failing:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
            return run

    class Wrong:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: args[4].zero_()

    for kernel, message in ((Failing(), r"CPU interpreter cannot run the kernel with numpy "
                                        rf"{np.__version__}: TypeError: only 0-dimensional"),
                            (Wrong(), "CPU interpreter gives wrong results")):
        stream_gemm._interpreter_reason.cache_clear()
        monkeypatch.setattr(stream_gemm, "_kernel", lambda interpret, kernel=kernel: kernel)
        reason = stream_gemm._interpreter_reason()
        assert reason is not None and __import__("re").search(message, reason), reason
    monkeypatch.undo()
    stream_gemm._interpreter_reason.cache_clear()
