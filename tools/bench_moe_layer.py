#!/usr/bin/env python3
"""One MoE layer in one process against the same layer through AFD (issue #34).

For each shape (``--shapes``: DeepSeek-V2-Lite, Qwen3-30B-A3B, one DeepSeek-V3 layer; ``tiny``
and ``small`` for the tests) and each batch size (``--tokens``: decode 1 8 32 128 256, prefill 2048 4096 8192):

- **one process** (this process, nothing else on the GPU): router linear, the model's gate
  (``gates.model_gate``), routing (tokens sorted by expert), ``moe.grouped_mlp`` over the
  routed rows, ``moe.shared_mlp``, ``moe.apply_routed_scaling`` and the weighted combine, all
  captured in one CUDA graph per batch size; the library's own expert code, as the FFN runs it.
- **AFD** (1A1F launched next, both on one GPU: start CUDA MPS first as tools/gpu_suite.sh
  does): the Attention rank runs the router linear, ``select_experts``, ``send_attn_output``
  and ``recv_ffn_output`` captured in one CUDA graph per batch size; the FFN rank holds the
  experts (the same seeded weights, built on its own device) and serves with
  ``GraphFFNServer`` (``--ffn-carveout``, default "auto" as the library), or an eager
  ``FFNWorker`` on the host backend. Its output is compared with the one-process output of
  the same inputs (relative L2 over the first ``--check-rows`` rows; CHECK FAILED and exit 1
  beyond ``CHECK_TOL``). FP8 end to end: ``--dispatch-dtype fp8_e4m3`` (E4M3 rows on the wire)
  and ``--ffn-fp8-experts`` (the FFN's routed experts as a block-scaled FP8 checkpoint; on
  cuda with ``--ffn-expert-gemm stream``), checked within ``FP8_CHECK_TOL`` of the bf16
  one-process output instead.
- **the routed experts alone** on the rows of that routing (``--gemm-variants``, module
  ``afd_cupy.moe.expert_gemm``; ``current`` is ``moe.grouped_mlp``), each in a CUDA graph, and
  the FP8 experts against bf16 when torch has ``_scaled_grouped_mm`` (speedup and the
  relative error against the bf16 output; otherwise skipped with the reason): ``fp8_rowwise``
  (weights quantized per output channel) and ``fp8_block`` (quantized as a DeepSeek-V3
  checkpoint, 128x128 blocks, then converted per output channel: what an FP8 checkpoint
  serves with), both through ``moe.grouped_mlp``; ``stream_fp8``: the same checkpoint weights
  through ``moe.stream_gemm``'s Triton kernels (E4M3 read, widened in registers, the rows
  unquantized). The ``stream`` variants are skipped with the reason where Triton is missing.

Floors and rates measured in the same run: the device copy rate (a large torch copy, read +
write bytes / time) and, per prefill size, a dense bf16 GEMM pair of the grouped pair's
shape ([T*k, H] x [H, 2I], [T*k, I] x [I, H]). The weight-read floor of the routed experts is
the bytes of the distinct experts the routing hit (3 * H * I * 2 bytes each) over the copy
rate; the layer's floor adds the shared experts and the router. NOTE: at decode 1-8 the
touched experts may fit the L2 cache between two replays, so a "fraction of the floor" above
1 there is the cache, not a bug.

Prints a table per shape, the variants, and the targets (PASS / MISS, never asserted):
routed experts at decode 128 >= 85 % of the floor, prefill 4096 grouped GEMM >= 70 % of the
dense rate, AFD / one process <= 1.15 at decode 128 and <= 1.05 at prefill 4096, FP8 >= 1.6x
bf16 at decode 128 (each FP8 format and path). Writes ``bench_moe_layer.json`` (and ``bench_moe_layer.png`` with
matplotlib) to ``--out``. ``--device cpu``: the host backend, the tiny shapes only (the test).
The device's dense 8192^3 bf16 matmul rate is printed and written for context.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_common as bc  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    num_experts: int
    top_k: int
    intermediate: int
    shared: int
    scoring_func: str = "softmax"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str | None = None


SHAPES = {
    "v2lite": Shape("v2lite", 2048, 64, 6, 1408, 2, renormalize=False),
    "qwen3": Shape("qwen3", 2048, 128, 8, 768, 0),
    "v3": Shape("v3", 7168, 256, 8, 2048, 1, scoring_func="sigmoid", routed_scaling_factor=2.5,
                n_group=8, topk_group=4, topk_method="noaux_tc"),
    "tiny": Shape("tiny", 64, 8, 2, 32, 1, routed_scaling_factor=2.5),
    "small": Shape("small", 256, 16, 4, 128, 1, routed_scaling_factor=2.5),  # the cuda test's
}
GPU_SHAPES = ("v2lite", "qwen3", "v3")
DECODE_TOKENS, PREFILL_TOKENS = (1, 8, 32, 128, 256), (2048, 4096, 8192)
CPU_TOKENS = (1, 4, 16, 64)
PREFILL_FROM = 1024  # batch sizes from here on are "prefill" rows
CHECK_TOL = 2e-2  # AFD vs one process: bf16 outputs, fp32 accumulation in another order
#: the same with FP8 rows on the wire and / or FP8 routed experts (docs/design/fp8.md: the
#: dispatch's budget 0.06 of a layer's output, FP8 weights a few per cent more)
FP8_CHECK_TOL = 0.1
#: the report's FP8 columns: key prefix -> expert_gemm variant
FP8_COLUMNS = {"fp8": "fp8_rowwise", "fp8_block": "fp8_block", "fp8_stream": "stream_fp8"}
TARGETS = {"floor_decode": (128, 0.85), "dense_prefill": (4096, 0.70),
           "afd_decode": (128, 1.15), "afd_prefill": (4096, 1.05), "fp8_decode": (128, 1.6)}


def parse_args(argv=None) -> argparse.Namespace:
    from afd_cupy.moe.expert_gemm import VARIANTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda (default when a GPU is there) or cpu (host backend, tiny shapes)")
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=None,
                        help=f"default {' '.join(GPU_SHAPES)} on cuda, tiny on cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="batch sizes")
    parser.add_argument("--gemm-variants", nargs="+", choices=VARIANTS + ("all", "none"), default=["all"],
                        help="routed-expert paths timed alone (afd_cupy.moe.expert_gemm); current always")
    parser.add_argument("--no-fp8", action="store_true", help="skip the FP8 weights measurement")
    parser.add_argument("--no-afd", action="store_true", help="skip the AFD launch (one process only)")
    parser.add_argument("--ffn-carveout", type=bc.gemm_sm_carveout_arg, default="auto", metavar="auto|N",
                        help="GraphFFNServer(gemm_sm_carveout=...) of the FFN rank")
    parser.add_argument("--ffn-expert-gemm", choices=("grouped_mm", "stream"), default="grouped_mm",
                        help="GraphFFNServer(expert_gemm=...) of the FFN rank: torch's grouped GEMMs or "
                             "moe.stream_gemm's Triton kernels (decision 0032)")
    parser.add_argument("--dispatch-dtype", choices=("payload", "fp8_e4m3"), default="payload",
                        help="ConnectorConfig.dispatch_dtype of the AFD launch (fp8_e4m3: E4M3 rows on the "
                             "wire, decoded by the graph FFN's gather)")
    parser.add_argument("--ffn-fp8-experts", action="store_true",
                        help="the FFN rank serves the routed experts as a block-scaled FP8 checkpoint "
                             "(moe.FP8ExpertWeights; on cuda with --ffn-expert-gemm stream)")
    parser.add_argument("--iters", type=int, default=None, help="decode iterations (default 100, quick 20)")
    parser.add_argument("--prefill-iters", type=int, default=None, help="default 20, quick 5")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check-rows", type=int, default=512, help="rows compared AFD vs one process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (~3 min on an H200)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if bc.num_visible_gpus() else "cpu"
    args.shapes = args.shapes or (list(GPU_SHAPES) if args.device == "cuda" else ["tiny"])
    if args.device == "cpu" and set(args.shapes) - {"tiny", "small"}:
        parser.error("--device cpu runs the tiny and small shapes only")
    args.tokens = sorted(set(args.tokens or (DECODE_TOKENS + PREFILL_TOKENS if args.device == "cuda"
                                             else CPU_TOKENS)))
    if min(args.tokens) < 1 or args.check_rows < 1:
        parser.error("--tokens and --check-rows must be >= 1")
    if args.ffn_fp8_experts and args.device == "cuda" and args.ffn_expert_gemm != "stream":
        parser.error("--ffn-fp8-experts on cuda needs --ffn-expert-gemm stream (the graph FFN runs FP8 "
                     "experts with the streamed kernels only)")
    variants = args.gemm_variants
    args.gemm_variants = (list(VARIANTS) if "all" in variants else
                          ["current"] + [v for v in variants if v not in ("none", "current")])
    args.iters = args.iters or (20 if args.quick else 100)
    args.prefill_iters = args.prefill_iters or (5 if args.quick else 20)
    return args


def model_config(shape: Shape, max_tokens: int):
    from afd_cupy.config import ModelConfig

    return ModelConfig(hidden_size=shape.hidden, num_experts=shape.num_experts, top_k=shape.top_k,
                       moe_intermediate_size=shape.intermediate, num_shared_experts=shape.shared,
                       dtype="bfloat16", max_num_batched_tokens=max_tokens,
                       routed_scaling_factor=shape.routed_scaling_factor, scoring_func=shape.scoring_func,
                       renormalize=shape.renormalize, n_group=shape.n_group, topk_group=shape.topk_group,
                       topk_method=shape.topk_method)


# --------------------------------------------------------------------------- the layer

def _randn(shape, scale, gen, device):
    """bf16 N(0, scale^2) drawn on ``device`` (GPU: a 22 GB layer in well under a second)."""
    import torch

    if device.type == "cuda":
        return torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).mul_(scale)
    return torch.randn(shape, generator=gen).mul_(scale).to(torch.bfloat16)


def _generator(device, seed: int):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def make_experts(shape: Shape, device, seed: int):
    """(routed ExpertWeights [E], fused shared ExpertWeights or None), bf16 on ``device``, the
    same values in every process for one (seed, device type)."""
    from afd_cupy.moe import ExpertWeights

    gen = _generator(device, seed)
    h, i, e = shape.hidden, shape.intermediate, shape.num_experts
    routed = ExpertWeights(w13=_randn((e, 2 * i, h), h ** -0.5, gen, device),
                           w2=_randn((e, h, i), i ** -0.5, gen, device), num_experts=e)
    shared = None
    if shape.shared:
        si = shape.shared * i
        shared = ExpertWeights(w13=_randn((1, 2 * si, h), h ** -0.5, gen, device),
                               w2=_randn((1, h, si), si ** -0.5, gen, device), num_experts=1)
    return routed, shared


def make_router(shape: Shape, device, seed: int):
    """The router's weight [E, H] bf16 (its own generator: the Attention rank draws no experts)."""
    return _randn((shape.num_experts, shape.hidden), shape.hidden ** -0.5,
                  _generator(device, seed * 31 + 1), device)


def make_hidden(shape: Shape, tokens: int, device, seed: int):
    return _randn((tokens, shape.hidden), 1.0, _generator(device, seed * 7919 + tokens), device)


def route(x, router, model):
    """Router linear + the model's gate: (topk_weights fp32 [T, K], topk_ids int32 [T, K])."""
    import torch.nn.functional as F

    from afd_cupy.moe import gates

    return gates.model_gate(model, F.linear(x, router).float())


def group_rows(ids, num_experts: int):
    """(order int64 [T*K]: flat (token, slot) positions sorted by expert, stable; counts int32
    [E] on the device). No host synchronization."""
    import torch

    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, counts


def one_process_layer(x, router, routed, shared, model):
    """The whole MoE layer in this process: x [T, H] bf16 -> [T, H] bf16 (module doc)."""
    import torch

    from afd_cupy import moe

    weights, ids = route(x, router, model)
    order, counts = group_rows(ids, model.num_experts)
    token = order // model.top_k
    routed_out = moe.grouped_mlp(x.index_select(0, token), counts, routed)
    shared_out = None if shared is None else moe.shared_mlp(x, shared)
    routed_out, shared_out = moe.apply_routed_scaling(routed_out, shared_out, model.routed_scaling_factor)
    combined = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    combined.index_add_(0, token, routed_out.float() * weights.reshape(-1)[order].unsqueeze(1))
    if shared_out is not None:
        combined += shared_out.float()
    return (combined * moe.combine_scale(x.dtype, model.routed_scaling_factor)).to(x.dtype)


# --------------------------------------------------------------------------- timing

def time_us(fn, device, iters: int, warmup: int) -> dict:
    """Median / p10 / p90 µs of ``fn()``: on cuda one CUDA graph replayed ``iters`` times (an
    event between replays; eager with events when the capture fails: ``graph`` False), on the
    CPU wall time per call. ``out``: fn's last result."""
    import torch

    if device.type != "cuda":
        out, times = None, []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            out = fn()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e6)
        return _stats(times) | {"graph": False, "out": out}
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph, out, reason = torch.cuda.CUDAGraph(), None, None
    try:
        with torch.cuda.graph(graph):
            out = fn()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - measured eagerly instead, said so in the report
        torch.cuda.synchronize(device)
        graph, reason, run = None, f"{type(exc).__name__}: {str(exc)[:120]}", fn
    for _ in range(warmup):
        res = run()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        res = run()
        events[i + 1].record()
    events[-1].synchronize()
    times = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(iters)]
    result = _stats(times) | {"graph": graph is not None, "out": out if graph is not None else res}
    if reason:
        result["capture_error"] = reason
    result["_graph"] = graph  # keeps the graph's memory alive while ``out`` is read
    return result


def _stats(times) -> dict:
    return {"median_us": bc.median(times), "p10_us": bc.percentile(times, 10),
            "p90_us": bc.percentile(times, 90), "iters": len(times)}


def _timing(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("out", "_graph")}


def copy_rate(device) -> float:
    """Bytes/s a large device copy moves (read + write)."""
    import torch

    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    # NOTE: the faster of a memcpy (in a graph: a memcpy node) and an elementwise copy kernel,
    # after ~0.1 s of warm-up: one graph-captured memcpy after 3 warm-ups measured 2.76 TB/s,
    # where the GPU copies at ~4.1 TB/s (read + write) with its SMs
    copies = (lambda: dst.copy_(src), lambda: torch.mul(src, 1, out=dst))
    best_us = min(time_us(fn, device, 20, 200)["median_us"] for fn in copies)
    return 2 * nbytes / (best_us * 1e-6)


def dense_pair_tflops(rows: int, shape: Shape, device, iters: int) -> float:
    """TFLOP/s of the dense bf16 GEMM pair of the grouped pair's shape (module doc)."""
    import torch.nn.functional as F

    gen = _generator(device, 99)
    a = _randn((rows, shape.hidden), 1.0, gen, device)
    w13 = _randn((2 * shape.intermediate, shape.hidden), 0.02, gen, device)
    h = _randn((rows, shape.intermediate), 1.0, gen, device)
    w2 = _randn((shape.hidden, shape.intermediate), 0.02, gen, device)
    result = time_us(lambda: (F.linear(a, w13), F.linear(h, w2)), device, iters, 2)
    del a, h, w13, w2
    _free(device)
    return pair_flops(rows, shape) / (result["median_us"] * 1e-6) / 1e12


def dense_peak_tflops(device) -> float | None:
    """TFLOP/s of one 8192^3 bf16 matmul (cuda only: the device's dense rate, for context)."""
    import torch

    if device.type != "cuda":
        return None
    gen = _generator(device, 98)
    a, b = _randn((8192, 8192), 1.0, gen, device), _randn((8192, 8192), 0.01, gen, device)
    result = time_us(lambda: torch.matmul(a, b), device, 10, 2)
    return 2.0 * 8192 ** 3 / (result["median_us"] * 1e-6) / 1e12


def pair_flops(rows: int, shape: Shape) -> float:
    return 6.0 * rows * shape.hidden * shape.intermediate


def _free(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _rel(got, want) -> float:
    """Relative L2 difference (fp64; inf with a NaN)."""
    got, want = got.double().cpu(), want.double().cpu()
    if bool(got.isnan().any()):
        return float("inf")
    return float((got - want).norm()) / (float(want.norm()) or 1.0)


# --------------------------------------------------------------------------- one process

def iters_for(tokens: int, args) -> int:
    return args.prefill_iters if tokens >= PREFILL_FROM else args.iters


def measure_shape(shape: Shape, args, device, copy_bps: float) -> tuple[dict, dict]:
    """One process: the layer, the routing's floors, the dense rate, the variants and FP8.
    Returns (the shape's report, {tokens: first check_rows rows of the output, fp32 CPU})."""
    model = model_config(shape, max(args.tokens))
    routed, shared = make_experts(shape, device, args.seed)
    router = make_router(shape, device, args.seed)
    rows, inputs, refs = [], {}, {}
    for tokens in args.tokens:
        iters = iters_for(tokens, args)
        x = make_hidden(shape, tokens, device, args.seed)
        layer = time_us(lambda: one_process_layer(x, router, routed, shared, model), device, iters, args.warmup)
        refs[tokens] = layer["out"][:args.check_rows].float().cpu()
        del layer["out"]
        layer.pop("_graph", None)  # the graph and its pool go
        _, ids = route(x, router, model)
        order, counts = group_rows(ids, shape.num_experts)
        counts_host = counts.tolist()
        inputs[tokens] = (x.index_select(0, order // shape.top_k), counts, counts_host)
        row = {"tokens": tokens, "phase": "prefill" if tokens >= PREFILL_FROM else "decode",
               "one_process": _timing(layer), **floors(shape, counts_host, copy_bps)}
        if tokens >= PREFILL_FROM:
            row["dense_tflops"] = dense_pair_tflops(tokens * shape.top_k, shape, device, iters)
        rows.append(row)
    variants = measure_variants(routed, inputs, args, device)
    del routed, shared, router, inputs
    _free(device)
    return {"shape": asdict(shape), "rows": rows, "variants": variants}, refs


def floors(shape: Shape, counts_host: list, copy_bps: float) -> dict:
    """Distinct experts hit, their bytes and the weight-read floors (µs) at ``copy_bps``."""
    expert_bytes = 3 * shape.hidden * shape.intermediate * 2
    hit = sum(1 for c in counts_host if c)
    routed_bytes = hit * expert_bytes
    layer_bytes = routed_bytes + shape.shared * expert_bytes + shape.num_experts * shape.hidden * 2
    return {"experts_hit": hit, "routed_bytes": routed_bytes, "layer_bytes": layer_bytes,
            "routed_floor_us": routed_bytes / copy_bps * 1e6, "layer_floor_us": layer_bytes / copy_bps * 1e6}


def measure_variants(routed, inputs: dict, args, device) -> list:
    """Each variant (and FP8) on each batch's grouped rows: timing, or the error it raised."""
    from afd_cupy.moe import expert_gemm

    names = list(args.gemm_variants)
    fp8_reason = expert_gemm.fp8_unavailable_reason(device) if not args.no_fp8 else "--no-fp8"
    if fp8_reason is None or device.type == "cpu" and not args.no_fp8:
        names += expert_gemm.FP8_VARIANTS  # the CPU runs them emulated (numerics only)
    current = expert_gemm.prepare(routed, "current")
    out = []
    for name in names:
        reason = expert_gemm.unavailable_reason(name, device)
        if reason is not None:  # e.g. the stream variants without Triton: said, not an error
            print(f"variant {name}: skipped: {reason}")
            out += [{"variant": name, "tokens": t, "skipped": reason} for t in inputs]
            continue
        try:
            prepared = expert_gemm.prepare(routed, name)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for a weight copy: reported
            out += [{"variant": name, "tokens": t, "error": f"{type(exc).__name__}: {exc}"[:200]} for t in inputs]
            continue
        for tokens, (xs, counts, counts_host) in inputs.items():
            out.append(_one_variant(prepared, current, name, tokens, xs, counts, counts_host, args, device))
        del prepared
        _free(device)
    if fp8_reason is not None:
        print(f"FP8 weights: measured only emulated or skipped: {fp8_reason}")
    return out


def _one_variant(prepared, current, name, tokens, xs, counts, counts_host, args, device) -> dict:
    from afd_cupy.moe import expert_gemm

    row = {"variant": name, "tokens": tokens}
    try:
        row_plan = expert_gemm.plan(prepared, counts, counts_host)
        result = time_us(lambda: expert_gemm.run(prepared, xs, row_plan), device,
                         iters_for(tokens, args), args.warmup)
        row.update(_timing(result))
        if name in expert_gemm.FP8_VARIANTS:
            want = expert_gemm.run(current, xs, expert_gemm.plan(current, counts, counts_host))
            row["rel_err_vs_bf16"] = _rel(result["out"], want)
            row["native"] = expert_gemm.fp8_unavailable_reason(device) is None
        del result
    except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the run
        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return row


# --------------------------------------------------------------------------- AFD (1A1F)

def afd_spec(shape: Shape, args, backend: str, ref_path: str) -> dict:
    return {"shape": asdict(shape), "tokens": list(args.tokens), "seed": args.seed, "iters": args.iters,
            "prefill_iters": args.prefill_iters, "warmup": args.warmup, "check_rows": args.check_rows,
            "backend": backend, "ffn_carveout": args.ffn_carveout, "ffn_expert_gemm": args.ffn_expert_gemm,
            "dispatch_dtype": args.dispatch_dtype, "ffn_fp8_experts": args.ffn_fp8_experts, "ref_path": ref_path}


def check_tolerance(args) -> float:
    """The AFD-vs-one-process bound of the run's settings (FP8 anywhere: FP8_CHECK_TOL)."""
    return FP8_CHECK_TOL if args.dispatch_dtype != "payload" or args.ffn_fp8_experts else CHECK_TOL


def _afd_rank(ctx, spec: dict) -> dict:
    from afd_cupy.config import ConnectorConfig, TopologyConfig
    from afd_cupy.connector import AFDConnector

    shape = Shape(**spec["shape"])
    device = bc.set_device(spec["backend"], ctx)
    model = model_config(shape, max(spec["tokens"]))
    role = "attention" if ctx.rank == 0 else "ffn"
    conn = AFDConnector(model, TopologyConfig(1, 1), ConnectorConfig(dispatch_dtype=spec["dispatch_dtype"]),
                        role=role, role_rank=0, store=ctx.store(), job_id=ctx.job_id,
                        backend=spec["backend"], device_id=ctx.device_id)
    try:
        if role == "ffn":
            return _serve(conn, shape, spec, device)
        try:
            return _attend(conn, shape, spec, device)
        finally:
            conn.announce_shutdown()
    finally:
        conn.close()


def _serve(conn, shape: Shape, spec: dict, device) -> dict:
    routed, shared = make_experts(shape, device, spec["seed"])
    if spec["ffn_fp8_experts"]:  # as an FP8 checkpoint would load (128x128 blocks)
        from afd_cupy.moe import FP8ExpertWeights

        routed = FP8ExpertWeights.quantize(routed, blockwise=True)
    if spec["backend"] != "cuda":
        from afd_cupy.ffn.worker import FFNWorker

        return {"role": "ffn", "served": FFNWorker(conn, routed, shared).run()}
    from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer

    server = GraphFFNServer(conn, routed, shared, bucket_tokens=tuple(spec["tokens"]),
                            gemm_sm_carveout=spec["ffn_carveout"], expert_gemm=spec["ffn_expert_gemm"])
    del routed, shared  # the server stacked its own copies
    _free(device)
    return {"role": "ffn", "served": server.run(), "eager": server.num_eager,
            "gemm_sm_carveout": server.gemm_sm_carveout, "expert_gemm": server.expert_gemm}


def _attend(conn, shape: Shape, spec: dict, device) -> dict:
    import torch
    import torch.nn.functional as F

    refs = torch.load(spec["ref_path"])
    router = make_router(shape, device, spec["seed"])
    blocking = device.type != "cuda"  # cuda: the wait and the combine enqueued, capturable
    rows = []
    for tokens in spec["tokens"]:
        x = make_hidden(shape, tokens, device, spec["seed"])

        def step(wait: bool = blocking):
            weights, ids = conn.select_experts(F.linear(x, router).float())
            return conn.recv_ffn_output(conn.send_attn_output(x, ids, weights, 0), blocking=wait)

        step(True)  # one blocking round trip first: the FFN picks this size's bucket
        iters = spec["prefill_iters"] if tokens >= PREFILL_FROM else spec["iters"]
        result = time_us(step, device, iters, spec["warmup"])
        conn.check_errors()
        got = result["out"][:spec["check_rows"]]
        rows.append({"tokens": tokens, "afd": _timing(result), "afd_rel_err": _rel(got, refs[tokens])})
        del result, got
        _free(device)
    return {"role": "attention", "rows": rows}


def run_afd(shape: Shape, args, backend: str, refs: dict) -> tuple[dict, dict]:
    """Launch 1A1F for ``shape``; ({tokens: Attention row}, the FFN rank's summary)."""
    import torch

    from afd_cupy.config import ConnectorConfig, TopologyConfig
    from afd_cupy.runtime.launch import launch
    from afd_cupy.wire import window_size_hint

    model = model_config(shape, max(args.tokens))
    window = window_size_hint(model, TopologyConfig(1, 1), ConnectorConfig(dispatch_dtype=args.dispatch_dtype))
    with tempfile.TemporaryDirectory(prefix="afd_moe_layer_") as tmp:
        ref_path = os.path.join(tmp, "refs.pt")
        torch.save(refs, ref_path)
        attn, ffn = launch(_afd_rank, 2, args=(afd_spec(shape, args, backend, ref_path),),
                           timeout_s=540, env=bc.launch_env(backend, 2, window))
    return {row["tokens"]: row for row in attn["rows"]}, {k: v for k, v in ffn.items() if k != "role"}


# --------------------------------------------------------------------------- report

def enrich(report: dict, afd_rows: dict | None) -> None:
    """Per row: the current path's routed µs and floor fraction, the best variant, grouped vs
    dense TFLOP/s, FP8 speedup / error, AFD µs and AFD / one process."""
    from afd_cupy.moe.expert_gemm import FP8_VARIANTS

    shape = Shape(**report["shape"])
    by_key = {(v["variant"], v["tokens"]): v for v in report["variants"]}
    for row in report["rows"]:
        tokens = row["tokens"]
        current = by_key.get(("current", tokens), {}).get("median_us")
        row["routed_us"] = current
        row["routed_floor_fraction"] = row["routed_floor_us"] / current if current else None
        timed = [v for (name, t), v in by_key.items() if t == tokens and name not in FP8_VARIANTS and "median_us" in v]
        best = min(timed, key=lambda v: v["median_us"]) if timed else None
        row["best_variant"] = best and best["variant"]
        row["best_variant_us"] = best and best["median_us"]
        if current and row.get("dense_tflops"):
            row["grouped_tflops"] = pair_flops(tokens * shape.top_k, shape) / (current * 1e-6) / 1e12
            row["grouped_over_dense"] = row["grouped_tflops"] / row["dense_tflops"]
        for key, variant in FP8_COLUMNS.items():
            fp8 = by_key.get((variant, tokens), {})
            if current and fp8.get("median_us"):
                row[f"{key}_us"], row[f"{key}_speedup"] = fp8["median_us"], current / fp8["median_us"]
                row[f"{key}_rel_err"], row[f"{key}_native"] = fp8.get("rel_err_vs_bf16"), fp8.get("native")
        one = row["one_process"]["median_us"]
        row["one_process_us"] = one
        row["one_process_floor_fraction"] = row["layer_floor_us"] / one if one else None
        afd = (afd_rows or {}).get(tokens)
        if afd:
            row["afd_us"], row["afd_rel_err"] = afd["afd"]["median_us"], afd["afd_rel_err"]
            row["afd_timing"] = afd["afd"]
            row["afd_over_one_process"] = row["afd_us"] / one if one else None


def targets(shapes: dict) -> list:
    out = []
    for name, report in shapes.items():
        rows = {r["tokens"]: r for r in report["rows"]}

        def get(tokens, key):
            return rows.get(tokens, {}).get(key)

        t, goal = TARGETS["floor_decode"]
        best_us, floor_us = get(t, "best_variant_us"), get(t, "routed_floor_us")
        best = f"{get(t, 'best_variant')} {floor_us / best_us:.2f}" if best_us else "-"
        out.append(bc.target_row(f"{name}: routed experts at decode {t} / weight-read floor",
                                 f">= {goal:.2f}", get(t, "routed_floor_fraction"), "fraction",
                                 lambda v, g=goal: v >= g, note=f"current path, alone; best variant {best}"))
        t, goal = TARGETS["dense_prefill"]
        out.append(bc.target_row(f"{name}: prefill {t} grouped GEMM / dense bf16 rate", f">= {goal:.2f}",
                                 get(t, "grouped_over_dense"), "fraction", lambda v, g=goal: v >= g))
        for key, phase in (("afd_decode", "decode"), ("afd_prefill", "prefill")):
            t, goal = TARGETS[key]
            out.append(bc.target_row(f"{name}: AFD / one process at {phase} {t}", f"<= {goal:.2f}",
                                     get(t, "afd_over_one_process"), "ratio", lambda v, g=goal: v <= g))
        t, goal = TARGETS["fp8_decode"]
        for key, what in (("fp8", "FP8 weights"), ("fp8_block", "FP8 block-scaled checkpoint weights"),
                          ("fp8_stream", "FP8 checkpoint weights, stream kernels")):
            out.append(bc.target_row(f"{name}: {what} speedup vs bf16 at decode {t}", f">= {goal:.1f}",
                                     get(t, f"{key}_speedup") if get(t, f"{key}_native") else None, "x",
                                     lambda v, g=goal: v >= g,
                                     note=f"rel err {get(t, f'{key}_rel_err'):.2e}"
                                     if get(t, f"{key}_rel_err") is not None else "no native FP8 grouped GEMM"))
    return out


def shape_table(report: dict) -> str:
    headers = ("tokens", "hit", "one proc us", "AFD us", "AFD/one", "layer floor us", "routed us",
               "routed floor us", "floor frac", "best variant", "best us", "grouped TF/s", "dense TF/s",
               "grp/dense", "fp8 us", "fp8 x", "fp8 err", "fp8 blk us", "fp8 blk x", "fp8 blk err",
               "fp8 strm us", "fp8 strm x", "fp8 strm err", "AFD err")
    body = [(r["tokens"], r["experts_hit"], r["one_process_us"], r.get("afd_us"), r.get("afd_over_one_process"),
             r["layer_floor_us"], r.get("routed_us"), r["routed_floor_us"], r.get("routed_floor_fraction"),
             r.get("best_variant") or "-", r.get("best_variant_us"), r.get("grouped_tflops"), r.get("dense_tflops"),
             r.get("grouped_over_dense"), r.get("fp8_us"), r.get("fp8_speedup"), r.get("fp8_rel_err"),
             r.get("fp8_block_us"), r.get("fp8_block_speedup"), r.get("fp8_block_rel_err"),
             r.get("fp8_stream_us"), r.get("fp8_stream_speedup"), r.get("fp8_stream_rel_err"),
             r.get("afd_rel_err")) for r in report["rows"]]
    return bc.format_table(headers, body)


def variant_table(report: dict) -> str:
    names = list(dict.fromkeys(v["variant"] for v in report["variants"]))
    tokens = sorted({v["tokens"] for v in report["variants"]})
    by_key = {(v["variant"], v["tokens"]): v for v in report["variants"]}
    body = []
    for t in tokens:
        base = by_key.get(("current", t), {}).get("median_us")
        cells = []
        for name in names:
            v = by_key.get((name, t), {})
            if "median_us" not in v:
                cells.append("error" if "error" in v else "skipped" if "skipped" in v else "-")
            else:
                ratio = f" ({v['median_us'] / base:.2f}x)" if base and name != "current" else ""
                cells.append(f"{v['median_us']:.1f}{ratio}{' eager' if 'capture_error' in v else ''}")
        body.append((t, *cells))
    errors = [f"  {v['variant']} at {v['tokens']} tokens: {v['error']}" for v in report["variants"] if "error" in v]
    errors += [f"  {v['variant']} at {v['tokens']} tokens: timed eagerly, capture failed: {v['capture_error']}"
               for v in report["variants"] if "capture_error" in v]
    table = bc.format_table(("tokens", *[f"{n} us" for n in names]), body)
    return table + ("\n" + "\n".join(errors) if errors else "")


def draw(shapes: dict, title: str):
    def plot(plt):
        fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
        for ax, (name, report) in zip(axes[0], shapes.items()):
            rows = report["rows"]
            tokens = [r["tokens"] for r in rows]
            for key, label in (("one_process_us", "one process"), ("afd_us", "AFD 1A1F"),
                               ("routed_us", "routed experts"), ("fp8_us", "routed experts FP8"),
                               ("fp8_block_us", "routed experts FP8 (block-scaled checkpoint)"),
                               ("routed_floor_us", "routed weight-read floor")):
                values = [r.get(key) for r in rows]
                if any(v is not None for v in values):
                    ax.plot(tokens, [float("nan") if v is None else v for v in values], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens")
            ax.set_ylabel("µs")
            ax.set_title(name)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
    return plot


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    device = torch.device(args.device)
    backend = "cuda" if device.type == "cuda" else "host"
    if device.type == "cpu":
        torch.set_num_threads(1)  # timings on the CPU only keep the tool working
    start = time.perf_counter()
    copy_bps, peak = copy_rate(device), dense_peak_tflops(device)
    print(f"device {bc.device_name(device)}: copy {copy_bps / 1e12:.3f} TB/s (read + write), dense bf16 "
          f"8192^3 {peak or float('nan'):.0f} TFLOP/s", flush=True)
    shapes, ffn_info, failed = {}, {}, []
    result = {"tool": "bench_moe_layer", "run": bc.run_info(backend), "device": bc.device_name(device),
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "copy_bytes_per_s": copy_bps, "dense_peak_tflops": peak, "shapes": shapes, "ffn": ffn_info}
    for name in args.shapes:  # the JSON is rewritten after each shape: a cut run keeps the done ones
        shape = SHAPES[name]
        t0 = time.perf_counter()
        report, refs = measure_shape(shape, args, device, copy_bps)
        print(f"[{name}] one process + variants: {time.perf_counter() - t0:.1f} s", flush=True)
        afd_rows = None
        if not args.no_afd:
            t0 = time.perf_counter()
            try:
                afd_rows, ffn_info[name] = run_afd(shape, args, backend, refs)
            except Exception as exc:  # noqa: BLE001 - the other shapes still run; reported, exit 1
                traceback.print_exc()
                ffn_info[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                failed.append((name, "AFD launch", ffn_info[name]["error"]))
            print(f"[{name}] AFD 1A1F: {time.perf_counter() - t0:.1f} s", flush=True)
        enrich(report, afd_rows)
        shapes[name] = report
        failed += [(name, r["tokens"], r["afd_rel_err"]) for r in report["rows"]
                   if "afd_rel_err" in r and not r["afd_rel_err"] <= check_tolerance(args)]
        result["targets"], result["seconds"] = targets(shapes), time.perf_counter() - start
        path = bc.write_json(args.out, "bench_moe_layer.json", result)
        print(f"\n==== {name}: {shape} on {result['device']} (µs: medians) ====")
        print(shape_table(report))
        print(f"\n---- {name}: routed experts alone by variant (µs, x of current) ----")
        print(variant_table(report), flush=True)
    print()
    print(bc.targets_table(result["targets"]))
    plot = bc.save_plot(args.out, "bench_moe_layer.png",
                        draw(shapes, f"MoE layer: one process vs AFD 1A1F, {result['device']}, {result['run']['commit']}"))
    print(f"wrote {path}" + (f" and {plot}" if plot else ""))
    print(f"total {result['seconds']:.1f} s")
    if failed:
        print(f"CHECK FAILED: AFD output differs from the one-process output or the launch failed "
              f"(shape, tokens, rel err or error): {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
