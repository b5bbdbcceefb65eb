#!/usr/bin/env python3
"""Greedy generation with a small Hugging Face MoE model disaggregated by afd_cupy.adapters:
the Attention side (the model minus its experts) in one process, F FFN ranks holding only
their experts, against the same model run in one process.

The model is built from a config with seeded random weights (no network; see
``afd_cupy.testing.hf_models``). Prints, per family, whether the tokens are identical, the
worst relative logit error over the steps, and tokens/s of both runs; writes hf_generate.json.
Exit code 0 when every family's tokens match and its logits are within tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from afd_cupy.launch import detect_backend, launch  # noqa: E402

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def _every_family(ctx, families, backend, num_ffn, steps, dtype):
    """One rank of the run: each family's generation in turn, one connector after another,
    after one untimed warm-up generation (kernel compilation, NVSHMEM and allocator start-up
    would otherwise be charged to the first family's tokens/s)."""
    from afd_cupy.testing.hf_models import generation_rank

    generation_rank(ctx, families[0], backend=backend, num_ffn=num_ffn, steps=2, dtype=dtype)
    return {family: generation_rank(ctx, family, backend=backend, num_ffn=num_ffn, steps=steps,
                                    dtype=dtype) for family in families}


def main(argv=None) -> int:
    from afd_cupy.adapters import FAMILIES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--ffn", type=int, default=2, help="FFN ranks")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    parser.add_argument("--backend", choices=("cuda", "host"), default=None)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    backend = args.backend or detect_backend()
    rows, ok = [], True
    print(f"{'family':<13}{'tokens equal':>13}{'max rel err':>13}{'AFD tok/s':>11}{'1-proc tok/s':>14}")
    # one launch for every family (a connector each): a cuda launch costs seconds of start-up
    reports = launch(_every_family, 1 + args.ffn, args=(tuple(args.families), backend, args.ffn,
                                                        args.steps, args.dtype), timeout_s=600)[0]
    for family in args.families:
        report = reports[family]
        same = report["tokens"] == report["ref_tokens"]
        worst = max(report["errors"])
        ok &= same and worst < TOLERANCE[args.dtype]
        rows.append({"family": family, **report})
        print(f"{family:<13}{str(same):>13}{worst:>13.2e}{report['tokens_per_s']:>11.1f}"
              f"{report['ref_tokens_per_s']:>14.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_generate.json").write_text(json.dumps(
        {"backend": backend, "num_ffn": args.ffn, "steps": args.steps, "dtype": args.dtype,
         "families": rows}, indent=1))
    print(f"HF_GENERATE {'PASS' if ok else 'FAIL'} backend={backend} 1A{args.ffn}F dtype={args.dtype}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
