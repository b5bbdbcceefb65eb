#!/usr/bin/env python3
"""Greedy generation with a small Hugging Face MoE model disaggregated by afd_cupy.adapters:
the Attention side (the model minus its experts) in one process, F FFN ranks holding only
their experts, against the same model run in one process.

The model is built from a config with seeded random weights (no network; see
``afd_cupy.testing.hf_models``). The comparison is teacher-forced: the one-process run
generates greedily, the disaggregated run is fed the same tokens, and every step's logits
must be within the dtype's tolerance (``afd_cupy.testing.logit_check``: max |logit error| /
rms(logits) <= 1e-4 in fp32, 0.2 in bf16). A step whose greedy token differs passes when the
flip is a near-tie (margin <= 2 tol); a bf16 step above tolerance passes when a router
near-tie explains it (the first sparse-MoE layer routing a token elsewhere saw router logits
within tolerance). Prints per family the worst step error, the flips and their margins, the
routing near-ties, bf16's own deviation from the same model in fp32 ("bf16 noise"), and
tokens/s of both runs; writes hf_generate.json. Exit code 0 when every step of every family
passes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from afd_cupy.runtime.launch import detect_backend, launch  # noqa: E402
from afd_cupy.testing.logit_check import LOGIT_TOLERANCE  # noqa: E402


def _every_family(ctx, families, backend, num_ffn, steps, dtype, seed):
    """One rank of the run: each family's generation in turn, one connector after another,
    after one untimed warm-up generation (kernel compilation, NVSHMEM and allocator start-up
    would otherwise be charged to the first family's tokens/s)."""
    from afd_cupy.testing.hf_models import generation_rank

    generation_rank(ctx, families[0], backend=backend, num_ffn=num_ffn, steps=2, dtype=dtype)
    return {family: generation_rank(ctx, family, backend=backend, num_ffn=num_ffn, steps=steps,
                                    dtype=dtype, seed=seed) for family in families}


def main(argv=None) -> int:
    from afd_cupy.adapters import FAMILIES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--ffn", type=int, default=2, help="FFN ranks")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=sorted(LOGIT_TOLERANCE))
    parser.add_argument("--seed", type=int, default=0, help="the models' weights and the prompt")
    parser.add_argument("--backend", choices=("cuda", "host"), default=None)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    backend = args.backend or detect_backend()
    rows, ok = [], True
    print(f"{'family':<13}{'max err':>9}{'tol':>7}{'flips (margin)':>22}{'routing ties':>13}"
          f"{'bf16 noise':>11}{'AFD tok/s':>11}{'1-proc tok/s':>14}  verdict")
    # one launch for every family (a connector each): a cuda launch costs seconds of start-up
    reports = launch(_every_family, 1 + args.ffn, args=(tuple(args.families), backend, args.ffn,
                                                        args.steps, args.dtype, args.seed), timeout_s=600)[0]
    for family in args.families:
        report = reports[family]
        check = report["check"]
        ok &= check["ok"]
        rows.append({"family": family, **report})
        flips = ", ".join(f"{s['margin']:.3f}" for s in check["steps"] if s["margin"] is not None) or "-"
        ties = sum(s["error"] > check["tolerance"] and s["ok"] for s in check["steps"])
        noise = f"{max(report['ref_noise']):.3f}" if "ref_noise" in report else "-"
        print(f"{family:<13}{max(report['errors']):>9.2e}{check['tolerance']:>7g}{flips:>22}{ties:>13}"
              f"{noise:>11}{report['tokens_per_s']:>11.1f}{report['ref_tokens_per_s']:>14.1f}  "
              f"{'PASS' if check['ok'] else 'FAIL'}")
        for i, step in enumerate(check["steps"]):
            if not step["ok"] or step["margin"] is not None or step["error"] > check["tolerance"]:
                print(f"    step {i}: {step['why']} (error {step['error']:.3g})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_generate.json").write_text(json.dumps(
        {"backend": backend, "num_ffn": args.ffn, "steps": args.steps, "dtype": args.dtype,
         "seed": args.seed, "tolerance": LOGIT_TOLERANCE[args.dtype], "families": rows}, indent=1))
    print(f"HF_GENERATE {'PASS' if ok else 'FAIL'} backend={backend} 1A{args.ffn}F dtype={args.dtype}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
