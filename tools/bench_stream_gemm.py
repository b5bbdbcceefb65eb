#!/usr/bin/env python3
"""The streamed expert GEMMs' tile sizes against torch's grouped GEMM and the weight-read floor
(issue #34; ``afd_cupy.moe.stream_gemm``).

For each shape (``--shapes``: bench_moe_layer's DeepSeek-V2-Lite, Qwen3-30B-A3B, one
DeepSeek-V3 layer) and each decode batch (``--tokens``), the routed experts of one FFN rank
that holds them all run on the rows of a real routing (router linear + the model's gate, as
bench_moe_layer routes), each path in a CUDA graph, median µs of replays:

- ``current``: ``moe.grouped_mlp`` (torch's grouped GEMMs), the library's path;
- ``stream``: ``grouped_mlp_streamed`` with every ``StreamConfig`` of the sweep (``--block-n``
  x ``--block-k`` x ``--warps`` x ``--stages``): the fastest per row, and how the default
  config does;
- ``stream_fp8``: the same experts quantized as a DeepSeek-V3 checkpoint (128x128 blocks,
  converted per output channel), with the best bf16 config and the default one;
- the floor: bytes of the experts the routing hit (bf16; E4M3 for FP8: half) over the copy rate
  measured in the same run (bench_moe_layer.copy_rate), and the fraction of it each path reaches;
- at prefill sizes (``--tokens`` >= 1024, e.g. ``--tokens 4096 --block-m 64 128``): TFLOP/s of
  ``current`` and of the best stream config against a dense bf16 GEMM pair of the same shape
  timed in the same run (bench_moe_layer.dense_pair_tflops).

Every stream result is checked against ``current`` (relative L2; FP8 against bf16 within the
FP8 budget of test_stream_gemm_cuda.py) before it is timed; a config that fails to compile or
to check is reported, not timed. Prints a table per shape and the targets' view (floor fraction
at decode 128 >= 0.85, FP8 >= 1.6x bf16 of the same run, prefill 4096 >= 0.70 of the dense
rate); writes ``bench_stream_gemm.json``.
Needs a GPU and Triton; ``--device cpu`` runs the tiny shapes through Triton's interpreter to
check the tool (its times say nothing).

    python3 tools/bench_stream_gemm.py --quick --out OUT
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402
import bench_moe_layer as ml  # noqa: E402

CHECK_TOL, FP8_CHECK_TOL = 2e-2, 0.1
FLOOR_GOAL, FP8_GOAL, GOAL_TOKENS = 0.85, 1.6, 128
DENSE_GOAL, PREFILL_TOKENS = 0.70, 4096


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the tiny / small shapes in Triton's interpreter (checks the tool only)")
    parser.add_argument("--shapes", nargs="+", choices=ml.GPU_SHAPES + ("tiny", "small"), default=None,
                        help=f"default {' '.join(ml.GPU_SHAPES)} (cpu: tiny)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="default 8 32 128 256 (quick: 32 128)")
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--block-m", nargs="+", default=["auto"],
                        help="rows' tiles: auto (follows the rows per expert) and/or powers of two")
    parser.add_argument("--iters", type=int, default=None, help="replays per timing (default 50, quick 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer replays")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    try:
        args.block_m = [None if m == "auto" else int(m) for m in args.block_m]
    except ValueError:
        parser.error(f"--block-m takes auto or ints, got {args.block_m}")
    args.shapes = args.shapes or (list(ml.GPU_SHAPES) if args.device == "cuda" else ["tiny"])
    if args.device == "cpu" and set(args.shapes) - {"tiny", "small"}:
        parser.error("--device cpu runs the tiny and small shapes only")
    args.iters = args.iters or (20 if args.quick else 50)
    args.tokens = args.tokens or ([32, GOAL_TOKENS] if args.quick else [8, 32, GOAL_TOKENS, 256])
    if min(args.tokens) < 1:
        parser.error("--tokens must be >= 1")
    return args


def configs(args) -> dict:
    """{label: StreamConfig} of the sweep (ValueError for a tile that is not a power of two)."""
    from afd_cupy.moe.stream_gemm import StreamConfig

    sweep = [StreamConfig(n, k, w, s, m) for n, k, w, s, m in
             itertools.product(args.block_n, args.block_k, args.warps, args.stages, args.block_m)]
    return {label(c): c for c in sweep}


def label(config) -> str:
    rows = "" if config.block_m is None else f"/m{config.block_m}"
    return f"n{config.block_n}/k{config.block_k}/w{config.num_warps}/s{config.num_stages}{rows}"


def _rel(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def _time_checked(fn, want, tol: float, args, device) -> dict:
    """Check ``fn()`` against ``want``, then time it (ml.time_us); the error instead where either fails."""
    try:
        err = _rel(fn(), want)
        if not err <= tol:
            return {"error": f"check failed: rel err {err:.3g} > {tol}", "rel_err": err}
        timing = ml.time_us(fn, device, args.iters, args.warmup)
        timing.pop("out", None)
        return {"median_us": timing["median_us"], "rel_err": err, "graph": timing["graph"]}
    except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def measure_shape(shape, args, device, copy_bps: float) -> dict:
    from afd_cupy import moe
    from afd_cupy.moe import FP8ExpertWeights
    from afd_cupy.moe.stream_gemm import DEFAULT_CONFIG, grouped_mlp_streamed

    model = ml.model_config(shape, max(args.tokens))
    routed, _ = ml.make_experts(shape, device, args.seed)
    fp8_routed = FP8ExpertWeights.quantize(routed, blockwise=True)
    router = ml.make_router(shape, device, args.seed)
    sweep_configs, rows = configs(args), []
    for tokens in args.tokens:
        x = ml.make_hidden(shape, tokens, device, args.seed)
        _, ids = ml.route(x, router, model)
        order, counts = ml.group_rows(ids, shape.num_experts)
        xs = x.index_select(0, order // shape.top_k)
        floor = ml.floors(shape, counts.tolist(), copy_bps)
        current_out = moe.grouped_mlp(xs, counts, routed)
        current = ml.time_us(lambda: moe.grouped_mlp(xs, counts, routed), device, args.iters, args.warmup)
        sweep = {}
        for name, config in sweep_configs.items():
            sweep[name] = _time_checked(lambda c=config: grouped_mlp_streamed(xs, counts, routed, config=c),
                                        current_out, CHECK_TOL, args, device)
        timed = {k: v for k, v in sweep.items() if "median_us" in v}
        best = min(timed, key=lambda k: timed[k]["median_us"]) if timed else None
        fp8 = {}
        for name, config in {"default": DEFAULT_CONFIG, "best": sweep_configs.get(best)}.items():
            if config is not None:
                fp8[name] = _time_checked(lambda c=config: grouped_mlp_streamed(xs, counts, fp8_routed, config=c),
                                          current_out, FP8_CHECK_TOL, args, device)
        dense = (ml.dense_pair_tflops(tokens * shape.top_k, shape, device, args.iters)
                 if tokens >= ml.PREFILL_FROM else None)
        rows.append(row_report(tokens, floor, current["median_us"], sweep, best, fp8,
                               flops=ml.pair_flops(tokens * shape.top_k, shape), dense_tflops=dense))
        del x, xs, current_out
        ml._free(device)
    del routed, fp8_routed
    ml._free(device)
    return {"shape": asdict(shape), "rows": rows}


def row_report(tokens: int, floor: dict, current_us: float, sweep: dict, best: str | None, fp8: dict,
               flops: float | None = None, dense_tflops: float | None = None) -> dict:
    """One batch's row: ``floor`` (bench_moe_layer.floors), the current path's µs, the sweep
    ({label: timing or error}), the fastest label, the FP8 timings ({"default"/"best": ...});
    prefill: the pair's FLOPs and the dense pair's TFLOP/s of the same run."""
    floor_us = floor["routed_floor_us"]
    row = {"tokens": tokens, **floor, "current_us": current_us, "sweep": sweep, "best_config": best, "fp8": fp8}
    frac = lambda us: floor_us / us if us else None  # noqa: E731
    row["current_floor_fraction"] = frac(row["current_us"])
    row["stream_default_us"] = sweep.get(label(_default()), {}).get("median_us")
    row["stream_best_us"] = sweep[best]["median_us"] if best else None
    row["stream_best_floor_fraction"] = frac(row["stream_best_us"])
    row["stream_over_current"] = (row["current_us"] / row["stream_best_us"]
                                  if row["current_us"] and row["stream_best_us"] else None)
    fp8_us = min((v["median_us"] for v in fp8.values() if "median_us" in v), default=None)
    row["fp8_us"], row["fp8_rel_err"] = fp8_us, min((v.get("rel_err", 1.0) for v in fp8.values()), default=None)
    row["fp8_floor_fraction"] = floor_us / 2 / fp8_us if fp8_us else None  # E4M3: half the bytes
    row["fp8_over_bf16_stream"] = row["stream_best_us"] / fp8_us if fp8_us and row["stream_best_us"] else None
    row["fp8_over_current"] = row["current_us"] / fp8_us if fp8_us and row["current_us"] else None
    rate = lambda us: flops / (us * 1e-6) / 1e12 if flops and us else None  # noqa: E731
    row["dense_tflops"], row["current_tflops"] = dense_tflops, rate(row["current_us"])
    row["stream_best_tflops"] = rate(row["stream_best_us"])
    for key in ("current", "stream_best"):
        tflops = row[f"{key}_tflops"]
        row[f"{key}_over_dense"] = tflops / dense_tflops if tflops and dense_tflops else None
    return row


def _default():
    from afd_cupy.moe.stream_gemm import DEFAULT_CONFIG

    return DEFAULT_CONFIG


def table(report: dict) -> str:
    headers = ("tokens", "hit", "floor us", "current us", "cur frac", "stream default us", "stream best us",
               "best config", "best frac", "x current", "fp8 us", "fp8 frac", "fp8 x bf16 stream", "fp8 x current",
               "fp8 err", "cur/dense", "best/dense", "dense TF/s")
    body = [(r["tokens"], r["experts_hit"], r["routed_floor_us"], r["current_us"], r["current_floor_fraction"],
             r["stream_default_us"], r["stream_best_us"], r["best_config"] or "-", r["stream_best_floor_fraction"],
             r["stream_over_current"], r["fp8_us"], r["fp8_floor_fraction"], r["fp8_over_bf16_stream"],
             r["fp8_over_current"], r["fp8_rel_err"], r.get("current_over_dense"), r.get("stream_best_over_dense"),
             r.get("dense_tflops")) for r in report["rows"]]
    return bc.format_table(headers, body)


def sweep_table(report: dict) -> str:
    labels = list(report["rows"][0]["sweep"]) if report["rows"] else []
    body = []
    for label in labels:
        cells = []
        for r in report["rows"]:
            v = r["sweep"][label]
            cells.append(f"{v['median_us']:.1f}" if "median_us" in v else "error")
        body.append((label, *cells))
    errors = sorted({f"  {label}: {r['sweep'][label]['error']}" for r in report["rows"] for label in labels
                     if "error" in r["sweep"][label]})
    text = bc.format_table(("config", *[f"{r['tokens']} tok us" for r in report["rows"]]), body)
    return text + ("\nerrors:\n" + "\n".join(errors) if errors else "")


def targets(shapes: dict) -> list:
    out = []
    for name, report in shapes.items():
        row = next((r for r in report["rows"] if r["tokens"] == GOAL_TOKENS), {})
        out.append(bc.target_row(f"{name}: stream (best config) at decode {GOAL_TOKENS} / weight-read floor",
                                 f">= {FLOOR_GOAL:.2f}", row.get("stream_best_floor_fraction"), "fraction",
                                 lambda v: v >= FLOOR_GOAL,
                                 note=f"current path {row.get('current_floor_fraction') or float('nan'):.2f}"))
        out.append(bc.target_row(f"{name}: FP8 stream vs bf16 current at decode {GOAL_TOKENS}", f">= {FP8_GOAL:.1f}",
                                 row.get("fp8_over_current"), "x", lambda v: v >= FP8_GOAL,
                                 note=f"vs bf16 stream {row.get('fp8_over_bf16_stream') or float('nan'):.2f}x"))
        prefill = next((r for r in report["rows"] if r["tokens"] == PREFILL_TOKENS), None)
        if prefill is not None:
            out.append(bc.target_row(f"{name}: stream (best config) at prefill {PREFILL_TOKENS} / dense bf16 rate",
                                     f">= {DENSE_GOAL:.2f}", prefill.get("stream_best_over_dense"), "fraction",
                                     lambda v: v >= DENSE_GOAL,
                                     note=f"current path {prefill.get('current_over_dense') or float('nan'):.2f}"))
    return out


def main(argv=None) -> int:
    import torch

    from afd_cupy.moe import stream_gemm

    args = parse_args(argv)
    if args.device == "cuda" and not bc.num_visible_gpus():
        print("bench_stream_gemm needs a GPU (--device cpu checks the tool in Triton's interpreter)")
        return 2
    device = torch.device(args.device)
    reason = stream_gemm.unavailable_reason(device)
    if reason is not None:
        print(f"bench_stream_gemm cannot run: {reason}")
        return 2
    start = time.perf_counter()
    copy_bps = ml.copy_rate(device)
    print(f"device {bc.device_name(device)}: copy {copy_bps / 1e12:.3f} TB/s (read + write); "
          f"{len(configs(args))} configs", flush=True)
    shapes = {}
    result = {"tool": "bench_stream_gemm", "run": bc.run_info("cuda" if device.type == "cuda" else "host"), "device": bc.device_name(device),
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "copy_bytes_per_s": copy_bps, "shapes": shapes}
    for name in args.shapes:  # the JSON is rewritten after each shape: a cut run keeps the done ones
        t0 = time.perf_counter()
        shapes[name] = measure_shape(ml.SHAPES[name], args, device, copy_bps)
        result["targets"], result["seconds"] = targets(shapes), time.perf_counter() - start
        path = bc.write_json(args.out, "bench_stream_gemm.json", result)
        print(f"\n==== {name}: {ml.SHAPES[name]} ({time.perf_counter() - t0:.1f} s; µs: medians) ====")
        print(table(shapes[name]))
        print(f"\n---- {name}: the sweep, bf16 (µs) ----")
        print(sweep_table(shapes[name]), flush=True)
    print()
    print(bc.targets_table(result["targets"]))
    print(f"wrote {path}; total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
