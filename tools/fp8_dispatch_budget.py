#!/usr/bin/env python3
"""The error budget and the bytes of FP8 on the dispatch wire (issue #34, CPU only).

``ConnectorConfig.dispatch_dtype="fp8_e4m3"`` sends the dispatched rows as E4M3 codes with one
fp32 scale per 128 channels (afd_cupy.wire.fp8; docs/design/fp8.md). Three measurements:

- **rows**: bf16 rows [``--rows``, ``--hidden``] quantized and dequantized by the reference
  quantizer (what the FFN's experts read, rounded back to bf16), against the bf16 rows, per
  distribution: ``gaussian`` N(0, 1); ``group_spread``, every 128-channel group scaled by 2^u,
  u ~ U(-4, 4); ``outliers``, N(0, 1) with 0.5 % of the channels (the same in every row, as
  the massive activations of a trained model are) times 100.
- **e2e**: one AFD MoE layer stack on the host backend (1 Attention + 1 FFN process, random
  MLP experts, ``--e2e-hidden``), run once with bf16 and once with FP8 dispatch on the same
  inputs: each output against the fp64 per-token reference, and the FP8 output against the bf16
  one (the dispatch's own error).
- **bytes**: the bytes one routed partial and one shared row put on the wire at the decode
  shape (hidden 7168, bf16), from ``WindowLayout.message_bytes``.

Metrics: DeepEP's ``calc_diff(x, y) = 1 - 2 sum(x y) / sum(x^2 + y^2)`` (fp64; DeepEP accepts
an FP8 dispatch below 7e-4) and the relative L2 error. Prints tables, writes
``fp8_dispatch_budget.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from afd_cupy import wire  # noqa: E402
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.wire import fp8  # noqa: E402
from afd_cupy.wire.dtypes import f32_to_raw, raw_to_f32  # noqa: E402

DISTRIBUTIONS = ("gaussian", "group_spread", "outliers")
DEEPEP_CALC_DIFF = 7e-4
#: DeepEP / pplx-garden's FP8 dispatch message per token at hidden 7168 (issue #34)
DEEPEP_FP8_TOKEN_BYTES = 7408


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=7168, help="rows: hidden size (% 128 == 0)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--e2e-hidden", type=int, default=1024)
    parser.add_argument("--e2e-tokens", type=int, default=64)
    parser.add_argument("--e2e-layers", type=int, default=2)
    parser.add_argument("--no-e2e", action="store_true", help="skip the host-backend runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    return parser.parse_args(argv)


def rel_l2(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / (np.linalg.norm(y) or 1.0))


def make_rows(dist: str, rows: int, hidden: int, rng) -> np.ndarray:
    """bf16-representable fp32 rows [rows, hidden] of distribution ``dist``."""
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    if dist == "group_spread":
        x = (x.reshape(rows, -1, 128) * np.exp2(rng.uniform(-4, 4, (rows, hidden // 128, 1)))).reshape(rows, hidden)
    elif dist == "outliers":
        channels = rng.choice(hidden, max(1, hidden // 200), replace=False)
        x[:, channels] *= 100.0
    return raw_to_f32(f32_to_raw(x, "bfloat16"), "bfloat16")


def rows_budget(dist: str, rows: int, hidden: int, seed: int) -> dict:
    """The reference quantizer's error on one distribution, after the FFN's bf16 rounding."""
    x = make_rows(dist, rows, hidden, np.random.default_rng(seed))
    back = raw_to_f32(f32_to_raw(fp8.dequantize_wire_rows(fp8.quantize_wire_rows(x), hidden), "bfloat16"),
                      "bfloat16")
    return {"distribution": dist, "rows": rows, "hidden": hidden,
            "calc_diff": fp8.calc_diff(back, x), "rel_l2": rel_l2(back, x)}


def wire_bytes(hidden: int = 7168, top_k: int = 8) -> dict:
    """Bytes on the wire per routed partial, per shared row and per token (top_k partials +
    one shared row) in bf16 and in FP8 dispatch, from WindowLayout.message_bytes."""
    model = ModelConfig(hidden_size=hidden, num_experts=256, top_k=top_k, moe_intermediate_size=2048,
                        num_shared_experts=1, max_num_batched_tokens=128)
    out = {"hidden": hidden, "top_k": top_k, "deepep_fp8_token_bytes": DEEPEP_FP8_TOKEN_BYTES}
    for name in ("payload", "fp8_e4m3"):
        layout = wire.WindowLayout.from_configs(model, TopologyConfig(1, 1), ConnectorConfig(dispatch_dtype=name))
        fixed = layout.message_bytes(reply=False)  # header + flag
        routed = layout.message_bytes(reply=False, routed_tokens=1) - fixed
        shared = layout.message_bytes(reply=False, shared_tokens=1) - fixed
        out[name] = {"row_bytes": layout.dispatch_row_bytes, "routed_partial_bytes": routed,
                     "shared_row_bytes": shared, "token_bytes": top_k * routed + shared,
                     "reply_row_bytes": layout.row_bytes}
    return out


def _e2e_program(ctx, model, dispatch_dtype: str, tokens: int, seed: int):
    """1A1F on the host backend with random experts: the Attention rank returns each layer's
    (output, fp64 reference) as numpy."""
    import torch

    from afd_cupy import moe
    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.runtime.topology import Role, Topology
    from afd_cupy.testing.reference import reference_moe
    from afd_cupy.testing.scenario import layer_weights

    role, rank = Topology(1, 1, model.num_experts).role_of(ctx.rank)
    conn = AFDConnector(model, TopologyConfig(1, 1), ConnectorConfig(dispatch_dtype=dispatch_dtype),
                        role=role, role_rank=rank, store=ctx.store(), job_id=ctx.job_id, backend="host")
    try:
        weights = [layer_weights(model, layer, seed, "cpu") for layer in range(model.num_layers)]
        if role is Role.FFN:
            routed = [moe.local_experts(w, 0, conn.topology.expert_per_rank) for w, _ in weights]
            FFNWorker(conn, routed, [s for _, s in weights], serving="loop").run()
            return None
        gen, results = torch.Generator().manual_seed(seed), []
        for layer in range(model.num_layers):
            hidden = torch.randn(tokens, model.hidden_size, generator=gen).to(torch.bfloat16)
            topk_w, ids = conn.select_experts(torch.randn(tokens, model.num_experts, generator=gen))
            out = conn.recv_ffn_output(conn.send_attn_output(hidden, ids, topk_w, layer))
            ref = reference_moe(hidden, ids, topk_w, *weights[layer], model.routed_scaling_factor)
            results.append((out.float().numpy(), ref.double().numpy()))
        conn.announce_shutdown()
        return results
    finally:
        conn.close()


def e2e_budget(hidden: int, tokens: int, layers: int, seed: int) -> dict:
    """bf16 vs FP8 dispatch through the host backend on the same inputs and experts."""
    from afd_cupy.runtime.launch import launch

    model = ModelConfig(hidden_size=hidden, num_experts=16, top_k=4, moe_intermediate_size=hidden // 2,
                        num_shared_experts=1, max_num_batched_tokens=tokens, num_layers=layers)
    runs = {name: launch(_e2e_program, 2, args=(model, name, tokens, seed), timeout_s=600)[0]
            for name in ("payload", "fp8_e4m3")}
    per_layer = []
    for (bf16, ref), (fp8_out, _) in zip(runs["payload"], runs["fp8_e4m3"]):
        per_layer.append({"rel_l2_bf16_vs_ref": rel_l2(bf16, ref), "rel_l2_fp8_vs_ref": rel_l2(fp8_out, ref),
                          "calc_diff_fp8_vs_bf16": fp8.calc_diff(fp8_out, bf16),
                          "rel_l2_fp8_vs_bf16": rel_l2(fp8_out, bf16)})
    return {"hidden": hidden, "intermediate": hidden // 2, "experts": 16, "top_k": 4, "tokens": tokens,
            "layers": per_layer}


def tables(report: dict) -> str:
    lines = ["rows (reference quantizer, bf16 in and out)",
             f"{'distribution':<14} {'calc_diff':>10} {'rel L2':>8}"]
    for r in report["rows"]:
        lines.append(f"{r['distribution']:<14} {r['calc_diff']:>10.2e} {100 * r['rel_l2']:>7.2f}%")
    if report.get("e2e"):
        e2e = report["e2e"]
        lines += ["", f"host backend e2e (hidden {e2e['hidden']}, {e2e['tokens']} tokens)",
                  f"{'layer':<6} {'bf16 vs ref':>12} {'fp8 vs ref':>11} {'fp8 vs bf16 calc_diff':>22} {'rel L2':>8}"]
        for i, r in enumerate(e2e["layers"]):
            lines.append(f"{i:<6} {100 * r['rel_l2_bf16_vs_ref']:>11.2f}% {100 * r['rel_l2_fp8_vs_ref']:>10.2f}% "
                         f"{r['calc_diff_fp8_vs_bf16']:>22.2e} {100 * r['rel_l2_fp8_vs_bf16']:>7.2f}%")
    b = report["bytes"]
    lines += ["", f"bytes on the wire (hidden {b['hidden']}, top-{b['top_k']}, one shared row per token)",
              f"{'dispatch':<10} {'row':>6} {'partial':>8} {'shared':>7} {'token':>7}"]
    for name in ("payload", "fp8_e4m3"):
        r = b[name]
        lines.append(f"{name:<10} {r['row_bytes']:>6} {r['routed_partial_bytes']:>8} "
                     f"{r['shared_row_bytes']:>7} {r['token_bytes']:>7}")
    lines.append(f"(DeepEP / pplx-garden FP8 message per token: {b['deepep_fp8_token_bytes']} B)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hidden % fp8.FP8_GROUP or args.e2e_hidden % fp8.FP8_GROUP:
        raise SystemExit(f"--hidden and --e2e-hidden must be multiples of {fp8.FP8_GROUP}")
    report = {"deepep_calc_diff": DEEPEP_CALC_DIFF,
              "rows": [rows_budget(d, args.rows, args.hidden, args.seed + i) for i, d in enumerate(DISTRIBUTIONS)],
              "e2e": None if args.no_e2e else e2e_budget(args.e2e_hidden, args.e2e_tokens, args.e2e_layers, args.seed),
              "bytes": wire_bytes()}
    print(tables(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_dispatch_budget.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
