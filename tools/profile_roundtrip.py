#!/usr/bin/env python3
"""Where does a decode round trip's host time go? cProfile on both sides of a 1A1F run.

The Attention rank runs ``--iters`` blocking round trips (send_attn_output +
recv_ffn_output) under cProfile; the FFN rank serves them with identity experts under
cProfile. Each side's top functions (by own time) are written to --out and summarized last,
with the median round trip, so the per-message host cost can be split into its parts.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.launch import launch  # noqa: E402


def _identity(item):
    return item.routed_x, item.shared_x


def _rank(ctx, args) -> dict:
    import torch

    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn_worker import FFNWorker

    backend = args["backend"]
    device = torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(ctx.device_id or 0)
        device = torch.device("cuda", ctx.device_id or 0)
    model = ModelConfig(hidden_size=args["hidden"], num_experts=64, top_k=args["top_k"],
                        moe_intermediate_size=256, num_shared_experts=1,
                        max_num_batched_tokens=max(args["tokens"], 1))
    role = "attention" if ctx.rank == 0 else "ffn"
    conn = AFDConnector(model, TopologyConfig(1, 1), ConnectorConfig(), role=role, role_rank=0,
                        store=ctx.store(), job_id=ctx.job_id, backend=backend,
                        device_id=ctx.device_id)
    profiler = cProfile.Profile()
    try:
        if role == "ffn":
            worker = FFNWorker(conn, expert_fn=_identity)
            profiler.enable()
            worker.run()
            profiler.disable()
            return {"role": "ffn", "stats": _stats(profiler), "served": worker.num_served}
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(args["tokens"], model.hidden_size, generator=gen).to(torch.bfloat16).to(device)
        weights, ids = conn.select_experts(torch.randn(args["tokens"], 64, generator=gen).to(device))
        for _ in range(20):  # warm-up
            conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0))
        times = []
        profiler.enable()
        for _ in range(args["iters"]):
            start = time.perf_counter()
            conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0))
            times.append((time.perf_counter() - start) * 1e6)
        profiler.disable()
        conn.announce_shutdown()
        return {"role": "attention", "stats": _stats(profiler), "median_us": statistics.median(times),
                "min_us": min(times)}
    finally:
        conn.close()


def _stats(profiler, limit: int = 30) -> str:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(limit)
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="150 round trips")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    if args.quick:
        args.iters = 150
    cfg = {"backend": args.backend, "tokens": args.tokens, "hidden": args.hidden,
           "top_k": args.top_k, "iters": args.iters}
    attn, ffn = launch(_rank, 2, args=(cfg,), timeout_s=300)
    os.makedirs(args.out, exist_ok=True)
    for rep in (attn, ffn):
        with open(os.path.join(args.out, f"profile_{rep['role']}.txt"), "w") as fh:
            fh.write(rep["stats"])
    for rep in (attn, ffn):
        print(f"==== {rep['role']} (top functions by own time, {args.iters} round trips) ====")
        print("\n".join(rep["stats"].splitlines()[:22]))
    print(f"profile_roundtrip: backend={args.backend} tokens={args.tokens} hidden={args.hidden} "
          f"top_k={args.top_k}: round trip median {attn['median_us']:.1f} us (min {attn['min_us']:.1f} us) "
          f"under cProfile; FFN served {ffn['served']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
