#!/usr/bin/env python3
"""The error budget of FP8 routed experts from a block-scaled checkpoint (issue #34, CPU only).

For each shape (``--shapes``: DeepSeek-V2-Lite 2048 x 1408, DeepSeek-V3 7168 x 2048; ``tiny``
for the test) and each weight distribution (``--weights``: ``gaussian``, N(0, 1/fan_in)
bf16; ``block_spread``, the same with every 128x128 block scaled by 2^u, u ~ U(-2, 2), so
that the block scales of a row differ as a trained checkpoint's may), fresh random bf16
weights of ``--experts`` experts and ``--rows`` bf16 rows N(0, 1) routed to them (multinomial
counts). The "checkpoint" is those weights quantized as DeepSeek-V3 stores them
(``moe.fp8.quantize_blockwise``: 128x128 blocks, gate, up, down apart). Paths, each giving the
routed output [rows, H]:

- ``bf16``: the checkpoint dequantized to bf16, ``moe.grouped_mlp`` (bf16 serving, no FP8 math);
- ``block_recipe``: DeepSeek-V3's own FP8 recipe, emulated: the block-scaled weights as stored,
  activations quantized per token per 128 columns (1x128), fp64 GEMMs, bf16 outputs (what a
  block-scaled kernel computes);
- ``rowwise_weights``: the checkpoint converted per output channel
  (``moe.fp8.blockwise_to_rowwise``), activations not quantized (fp32 math): the conversion's
  own error;
- ``afd_fp8``: what the FFN runs: the converted weights and per-row dynamic activations,
  ``moe.grouped_mlp`` with ``moe.FP8ExpertWeights`` (the emulation on the CPU, which equals
  ``torch._scaled_grouped_mm`` up to fp32 accumulation order);
- ``rowwise_direct``: per-output-channel FP8 quantized from the original bf16 weights (no
  checkpoint), per-row activations: ``fp8_rowwise`` of bench_moe_layer.

Each against two fp64 references: the checkpoint's dequantized weights (``ckpt``: the model
an FP8 checkpoint is) and the original bf16 weights (``orig``). Metrics: DeepEP's
``calc_diff(x, y) = 1 - 2 sum(x y) / sum(x^2 + y^2)`` (fp64; DeepEP accepts FP8 dispatch
below 7e-4) and the relative L2 error. Prints a table, writes ``fp8_error_budget.json`` to
``--out``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_common as bc  # noqa: E402

SHAPES = {"v2lite": (2048, 1408), "v3": (7168, 2048), "tiny": (192, 96)}  # (hidden, intermediate)
WEIGHTS = ("gaussian", "block_spread")
PATHS = ("bf16", "block_recipe", "rowwise_weights", "afd_fp8", "rowwise_direct")
DEEPEP_CALC_DIFF = 7e-4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=["v2lite", "v3"])
    parser.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS))
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    return parser.parse_args(argv)


def calc_diff(x, y) -> float:
    """DeepEP's similarity error (fp64): 0 for equal tensors, ~ rel_l2^2 / 2 when close."""
    x, y = x.double(), y.double()
    return float(1.0 - 2.0 * (x * y).sum() / (x * x + y * y).sum())


def rel_l2(x, y) -> float:
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm())


# --------------------------------------------------------------------------- the case

def make_weights(hidden: int, inter: int, experts: int, spread: bool, gen):
    """bf16 ExpertWeights N(0, 1/fan_in), every 128x128 block scaled by 2^U(-2, 2) if ``spread``."""
    import torch

    from afd_cupy import moe

    def draw(rows, cols):
        w = torch.randn(experts, rows, cols, generator=gen) / cols ** 0.5
        if spread:
            blocks = 2.0 ** (torch.rand(experts, -(-rows // 128), -(-cols // 128), generator=gen) * 4 - 2)
            w *= blocks.repeat_interleave(128, 1)[:, :rows].repeat_interleave(128, 2)[:, :, :cols]
        return w.to(torch.bfloat16)

    return moe.ExpertWeights(w13=draw(2 * inter, hidden), w2=draw(hidden, inter), num_experts=experts)


def checkpoint(weights):
    """(the checkpoint dequantized: fp32 ExpertWeights, the stored blocks per expert
    {proj: (q, scale_inv)}): gate, up and down quantized apart, as DeepSeek-V3 stores them."""
    import torch

    from afd_cupy import moe
    from afd_cupy.moe import fp8

    inter, stored, w13, w2 = weights.intermediate_size, [], [], []
    for expert in range(weights.num_experts):
        parts = {"gate": weights.w13[expert, :inter], "up": weights.w13[expert, inter:], "down": weights.w2[expert]}
        blocks = {name: fp8.quantize_blockwise(w) for name, w in parts.items()}
        stored.append(blocks)
        deq = {name: fp8.dequantize_blockwise(*qs) for name, qs in blocks.items()}
        w13.append(torch.cat([deq["gate"], deq["up"]]))
        w2.append(deq["down"])
    return moe.ExpertWeights(torch.stack(w13), torch.stack(w2), weights.num_experts), stored


def reference(x, counts, weights):
    """fp64 routed output of fp32/bf16 ``weights`` (SiLU), one expert at a time."""
    import torch

    out, start = torch.empty(x.shape, dtype=torch.float64), 0
    for expert, num_rows in enumerate(counts):
        rows = x[start:start + num_rows].double()
        gate_up = rows @ weights.w13[expert].double().T
        gate, up = gate_up.chunk(2, dim=-1)
        out[start:start + num_rows] = (gate * torch.sigmoid(gate) * up) @ weights.w2[expert].double().T
        start += num_rows
    return out


def _groupwise(t, group: int = 128):
    """t [n, K] -> fp64 after E4M3 quantization with one scale per row and ``group`` columns."""
    import torch
    import torch.nn.functional as F

    from afd_cupy.moe import fp8

    cols = t.shape[1]
    padded = F.pad(t.double(), (0, -cols % group)).view(t.shape[0], -1, group)
    scale = padded.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / fp8.FP8_MAX
    q = (padded / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
    return (q.double() * scale).view(t.shape[0], -1)[:, :cols].to(torch.float64)


def block_recipe(x, counts, stored):
    """DeepSeek-V3's FP8 recipe emulated (module doc): 128x128 weights, 1x128 activations."""
    import torch

    from afd_cupy.moe import fp8

    out, start = torch.empty(x.shape, dtype=torch.bfloat16), 0
    for expert, num_rows in enumerate(counts):
        deq = {name: fp8.dequantize_blockwise(*qs).double() for name, qs in stored[expert].items()}
        a = _groupwise(x[start:start + num_rows])
        gate = (a @ deq["gate"].T).to(torch.bfloat16).double()
        up = (a @ deq["up"].T).to(torch.bfloat16).double()
        hidden = _groupwise(gate * torch.sigmoid(gate) * up)
        out[start:start + num_rows] = (hidden @ deq["down"].T).to(torch.bfloat16)
        start += num_rows
    return out


def measure_case(hidden: int, inter: int, spread: bool, args) -> dict:
    """Every path's calc_diff and rel L2 against both references, for one fresh case."""
    import torch

    from afd_cupy import moe

    gen = torch.Generator().manual_seed(args.seed * 1009 + hidden + int(spread))
    weights = make_weights(hidden, inter, args.experts, spread, gen)
    x = torch.randn(args.rows, hidden, generator=gen).to(torch.bfloat16)
    routing = torch.multinomial(torch.ones(args.experts), args.rows, replacement=True, generator=gen)
    counts = torch.bincount(routing, minlength=args.experts).tolist()
    group_counts = torch.tensor(counts)
    ckpt, stored = checkpoint(weights)
    converted = moe.FP8ExpertWeights.quantize(weights)  # the same codes as converting ``stored``
    outputs = {
        "bf16": moe.grouped_mlp(x, group_counts, moe.ExpertWeights(ckpt.w13.to(torch.bfloat16),
                                                                   ckpt.w2.to(torch.bfloat16), args.experts)),
        "block_recipe": block_recipe(x, counts, stored),
        "rowwise_weights": moe.grouped_mlp(x.float(), group_counts, converted.dequantize(torch.float32)),
        "afd_fp8": moe.grouped_mlp(x, group_counts, converted),
        "rowwise_direct": moe.grouped_mlp(x, group_counts, moe.FP8ExpertWeights.quantize(weights, blockwise=False)),
    }
    refs = {"ckpt": reference(x, counts, ckpt), "orig": reference(x, counts, weights)}
    return {path: {f"{metric.__name__}_{name}": metric(out, ref) for name, ref in refs.items()
                   for metric in (calc_diff, rel_l2)} for path, out in outputs.items()} | {"counts": counts}


def table(results: list) -> str:
    headers = ("shape", "weights", "path", "calc_diff ckpt", "rel L2 ckpt", "calc_diff orig", "rel L2 orig")
    body = [(r["shape"], r["weights"], path, *(r["paths"][path][k] for k in
                                              ("calc_diff_ckpt", "rel_l2_ckpt", "calc_diff_orig", "rel_l2_orig")))
            for r in results for path in PATHS]
    return bc.format_table(headers, body)


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    start, results = time.perf_counter(), []
    for name in args.shapes:
        hidden, inter = SHAPES[name]
        for kind in args.weights:
            paths = measure_case(hidden, inter, kind == "block_spread", args)
            results.append({"shape": name, "hidden": hidden, "intermediate": inter, "weights": kind,
                            "counts": paths.pop("counts"), "paths": paths})
            print(f"[{name} {kind}] {time.perf_counter() - start:.1f} s", flush=True)
    report = {"tool": "fp8_error_budget", "run": bc.run_info("cpu"), "config": {k: str(v) if isinstance(v, Path)
              else v for k, v in vars(args).items()}, "deepep_calc_diff": DEEPEP_CALC_DIFF, "results": results}
    path = bc.write_json(args.out, "fp8_error_budget.json", report)
    print(table(results))
    print(f"DeepEP accepts FP8 dispatch at calc_diff < {DEEPEP_CALC_DIFF:g}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
