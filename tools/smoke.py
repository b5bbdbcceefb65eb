#!/usr/bin/env python3
"""The main job: a 1A1F (or 2A2F with --2a2f) AFD MoE run through the real connector,
checked against a single-process MoE reference.

Picks the cuda backend when a GPU with CuPy and NVSHMEM is present (all processes on one GPU
when there are fewer GPUs than processes; on one GPU start CUDA MPS first for device
polling, or pass --poll-mode host), the host backend otherwise. The FFN ranks serve as
``FFNWorker`` does by default (the graph FFN where it applies). Prints PASS/FAIL, timings,
the backend and each FFN rank's serving (graph FFN or Python loop, and why); exit code 0 on
PASS.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from afd_cupy.runtime.env import idle_pool_env  # noqa: E402 - no numpy yet

# this process only starts ranks: numpy's OpenBLAS workers, started by the next imports,
# must not spin (the ranks get the same from the launcher)
os.environ.update(idle_pool_env())

from afd_cupy.config import ModelConfig  # noqa: E402
from afd_cupy.runtime.launch import detect_backend, launch  # noqa: E402
# the light half of the scenario: the parent only starts ranks, it never imports torch
from afd_cupy.testing.scenario_spec import Scenario, run_scenario_rank, tolerance  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--2a2f", dest="two", action="store_true", help="2 Attention + 2 FFN ranks")
    parser.add_argument("--backend", choices=("cuda", "host"), default=None)
    parser.add_argument("--poll-mode", choices=("device", "host"), default="device")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def build_scenario(args, backend: str) -> Scenario:
    """The smoke run's Scenario from the parsed arguments (shared with startup_profile.py)."""
    num_attn = num_ffn = 2 if args.two else 1
    model = ModelConfig(hidden_size=args.hidden, num_experts=args.experts, top_k=args.top_k,
                        moe_intermediate_size=args.hidden // 2, num_shared_experts=1,
                        dtype=args.dtype, max_num_batched_tokens=max(args.tokens, 1),
                        routed_scaling_factor=2.5, num_layers=args.layers)
    return Scenario(model, num_attn, num_ffn, backend=backend, poll_mode=args.poll_mode,
                    num_tokens=args.tokens, ffn_serving="auto")  # FFNWorker's default serving


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = args.backend or detect_backend()
    scenario = build_scenario(args, backend)
    num_attn, num_ffn = scenario.num_attn, scenario.num_ffn
    poll = f" poll={args.poll_mode}" if backend == "cuda" else ""
    print(f"afd_cupy smoke: {num_attn}A{num_ffn}F backend={backend}{poll} "
          f"layers={args.layers} tokens={args.tokens} hidden={args.hidden} experts={args.experts} "
          f"top_k={args.top_k} dtype={args.dtype}", flush=True)
    start = time.perf_counter()
    results = launch(run_scenario_rank, scenario.world_size, args=(scenario,), timeout_s=args.timeout)
    wall = time.perf_counter() - start
    ok = True
    tol = tolerance(args.dtype)
    for rep in results:
        if rep["role"] == "ffn":
            serving = (f"graph FFN, {rep['eager']} of them eager" if rep["serving"] == "graph"
                       else f"Python loop: {rep['serving_reason']}")
            print(f"  ffn  rank {rep['rank']}: served {rep['served']} items ({serving})")
            continue
        worst = max(e["rel_err"] for e in rep["errors"])
        nans = sum(e["num_nan"] for e in rep["errors"])
        steady = rep["times"][1:] or rep["times"]
        rank_ok = worst <= tol and nans == 0
        ok &= rank_ok
        print(f"  attn rank {rep['rank']}: max rel err {worst:.2e} (tol {tol:.0e}), NaN {nans}, "
              f"layer round trip median {statistics.median(steady) * 1e3:.3f} ms "
              f"(first {rep['times'][0] * 1e3:.1f} ms)")
    print(f"{'PASS' if ok else 'FAIL'} backend={backend} {num_attn}A{num_ffn}F wall {wall:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
