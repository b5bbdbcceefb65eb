"""The streamed expert GEMMs (afd_cupy.moe.stream_gemm) on the GPU against the float64 numpy
reference (tests/helpers/stream_gemm.py): bf16 and fp16 rows, bf16 and FP8 weights, fresh
random experts and counts per test (empty experts, an expert over one row tile, strided
rows), outputs prefilled with NaN; a CUDA graph replay with new rows and counts; a
DeepSeek-V2-Lite-sized expert set against ``moe.grouped_mlp``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from afd_cupy import moe
from afd_cupy.moe import stream_gemm

from helpers.rng import node_rng
from helpers.stream_gemm import random_counts, random_experts, random_rows, rel_error, stream_reference

pytestmark = pytest.mark.cuda

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True)
def _triton():
    reason = stream_gemm.unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_matches_reference(request, dtype, fp8, activation):
    rng = node_rng(request)
    num_experts, hidden, inter = int(rng.integers(5, 40)), 64 * int(rng.integers(2, 9)), 32 * int(rng.integers(2, 9))
    weights = random_experts(rng, num_experts, hidden, inter, dtype, "cuda", activation=activation, fp8=fp8)
    counts = random_counts(rng, num_experts, mean_rows=float(rng.uniform(1, 40)), empty=2)
    x = random_rows(rng, counts, hidden, dtype, "cuda", stride_pad=8 * int(rng.integers(0, 3)))
    out = torch.full((x.shape[0], hidden), float("nan"), dtype=dtype, device="cuda")
    got = stream_gemm.grouped_mlp_streamed(x, torch.tensor(counts, device="cuda"), weights, out=out)
    torch.cuda.synchronize()
    assert rel_error(got, stream_reference(x, counts, weights)) < TOLERANCE[dtype]


def test_graph_replay_with_new_rows_and_counts(request):
    rng = node_rng(request)
    weights = random_experts(rng, 16, 256, 128, torch.bfloat16, "cuda")
    rows = 200
    x = torch.empty(rows, 256, dtype=torch.bfloat16, device="cuda")
    counts = torch.empty(16, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, 256, dtype=torch.bfloat16, device="cuda")

    def fill():
        """New rows and counts in place (3 empty experts; the counts sum to the rows)."""
        live = rng.permutation(16)[3:]
        c = np.bincount(rng.choice(live, rows), minlength=16)
        x.copy_(torch.tensor(rng.standard_normal((rows, 256)), dtype=torch.bfloat16))
        counts.copy_(torch.tensor(c, dtype=torch.int32))
        return c

    fill()
    stream_gemm.grouped_mlp_streamed(x, counts, weights, out=out)  # compiles before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream_gemm.grouped_mlp_streamed(x, counts, weights, out=out)
    for _ in range(3):
        c = fill()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(out, stream_reference(x, c, weights)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("fp8", [False, True])
def test_v2_lite_experts_agree_with_grouped_mlp(request, fp8):
    """64 experts, hidden 2048, intermediate 1408, 768 rows (128 tokens x top-6): against the
    library's path on the same weights (FP8: its scaled GEMM, which also quantizes the rows,
    so only within the FP8 budget)."""
    rng = node_rng(request)
    weights = random_experts(rng, 64, 2048, 1408, torch.bfloat16, "cuda", fp8=fp8)
    counts = np.bincount(rng.integers(0, 64, 768), minlength=64)
    x = random_rows(rng, counts, 2048, torch.bfloat16, "cuda")
    group_counts = torch.tensor(counts, device="cuda")
    got = stream_gemm.grouped_mlp_streamed(x, group_counts, weights)
    want = moe.grouped_mlp(x, group_counts, weights)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < (0.1 if fp8 else 1e-2), err
