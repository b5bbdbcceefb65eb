#!/usr/bin/env python3
"""Decode round trip with the eager FFN loop vs the graph-driven FFN (GraphFFNServer), 1A1F,
identity experts (or small random bf16 experts with --experts moe), in one run, in the pair
(default) or the dedup wire mode (``--wire-mode dedup``: the graph runs the dedup expand and the
fused reduce, the eager loop the dedup item views and reply).

For each FFN mode a 1A1F job starts (cuda backend): the Attention rank runs, per batch size,
``--warmup`` untimed and ``--iters`` timed blocking round trips (send_attn_output +
recv_ffn_output, layers cycling over --layers) and reports median / p10 / p90 in µs. After
the first size's warm-up it sleeps ``--idle-s`` seconds: the FFN process's CPU time over that
window (sampled by a thread every 20 ms) is its idle cost, in % of one core. Prints a table and
writes ``bench_graph_ffn.json`` to --out.

Runs on one GPU (both processes on GPU 0: start CUDA MPS first, as tools/gpu_suite.sh does)
or one GPU per process when there are two (--num-gpus).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.runtime.launch import launch  # noqa: E402

MODES = ("eager", "graph")


def _model(cfg: dict) -> ModelConfig:
    return ModelConfig(hidden_size=cfg["hidden"], num_experts=cfg["num_experts"], top_k=cfg["top_k"],
                       moe_intermediate_size=cfg["intermediate"], num_shared_experts=1,
                       max_num_batched_tokens=max(cfg["tokens"]), num_layers=cfg["layers"],
                       dtype="bfloat16")


def _rank(ctx, cfg: dict) -> dict:
    import torch

    from afd_cupy.connector import AFDConnector

    torch.cuda.set_device(ctx.device_id or 0)
    device = torch.device("cuda", ctx.device_id or 0)
    model = _model(cfg)
    role = "attention" if ctx.rank == 0 else "ffn"
    conn = AFDConnector(model, TopologyConfig(1, 1), ConnectorConfig(wire_mode=cfg["wire_mode"]),
                        role=role, role_rank=0, store=ctx.store(), job_id=ctx.job_id, backend="cuda",
                        device_id=ctx.device_id, recv_spin_us=cfg["recv_spin_us"])
    try:
        if role == "ffn":
            return _ffn(conn, cfg, device)
        return _attention(conn, cfg, device)
    finally:
        conn.close()


def _ffn(conn, cfg: dict, device) -> dict:
    from afd_cupy import moe
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.testing.reference import identity_experts
    from afd_cupy.testing.scenario import layer_weights

    routed = shared = None
    if cfg["experts"] == "moe":
        model, epr = conn.model, conn.topology.expert_per_rank
        pairs = [layer_weights(model, layer, 0, device) for layer in range(model.num_layers)]
        routed = [moe.local_experts(r, 0, epr) for r, _ in pairs]
        shared = [s for _, s in pairs]
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic(), time.process_time()))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    extra = {}
    try:
        if cfg["mode"] == "eager":
            worker = (FFNWorker(conn, expert_fn=identity_experts, serving="loop") if routed is None
                      else FFNWorker(conn, routed, shared, serving="loop"))  # the Python loop
            served = worker.run()
        else:
            from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer

            kwargs = {"identity": True} if routed is None else {"experts": routed, "shared": shared,
                                                                 "bucket_tokens": tuple(cfg["tokens"])}
            server = GraphFFNServer(conn, depth=cfg["depth"], idle_timeout_s=cfg["idle_timeout_s"], **kwargs)
            served = server.run()
            extra = {"eager": server.num_eager, "replays": server.num_replays}
    finally:
        stop.set()
        sampler.join()
    return {"role": "ffn", "served": served, "samples": samples, **extra}


def _attention(conn, cfg: dict, device) -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    model = conn.model
    results, idle_window = {}, None
    for num_tokens in cfg["tokens"]:
        hidden = torch.randn(num_tokens, model.hidden_size, generator=gen).to(torch.bfloat16).to(device)
        weights, ids = conn.select_experts(
            torch.randn(num_tokens, model.num_experts, generator=gen).to(device))
        times = []
        for i in range(cfg["warmup"] + cfg["iters"]):
            if i == cfg["warmup"] and idle_window is None:
                start = time.monotonic()
                time.sleep(cfg["idle_s"])
                idle_window = (start, time.monotonic())
            t0 = time.perf_counter()
            conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, i % model.num_layers))
            if i >= cfg["warmup"]:
                times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        results[num_tokens] = {"median_us": statistics.median(times), "p10_us": times[len(times) // 10],
                               "p90_us": times[(9 * len(times)) // 10], "n": len(times)}
    conn.announce_shutdown()
    return {"role": "attention", "results": results, "idle_window": idle_window}


def idle_cpu_percent(samples: list, window) -> float | None:
    """CPU time over the samples inside ``window`` (monotonic seconds), in % of one core."""
    inside = [s for s in samples if window and window[0] <= s[0] <= window[1]]
    if len(inside) < 2:
        return None
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    return 100.0 * (c1 - c0) / (t1 - t0) if t1 > t0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--experts", default="identity", choices=("identity", "moe"))
    parser.add_argument("--wire-mode", default="pair", choices=("pair", "dedup"),
                        help="the connector's wire mode (docs/design/dedup.md)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=256, help="moe_intermediate_size (--experts moe)")
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=None, help="default 400 (100 with --quick)")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--idle-s", type=float, default=1.0)
    parser.add_argument("--depth", type=int, default=4, help="graph replays kept queued")
    parser.add_argument("--idle-timeout-s", type=float, default=0.01, help="in-graph wait bound")
    parser.add_argument("--recv-spin-us", type=int, default=500,
                        help="eager FFN: spin on the doorbell this long before sleeping in the driver")
    parser.add_argument("--num-gpus", type=int, default=None, help="default: detected (1: both on GPU 0)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    iters = args.iters or (100 if args.quick else 400)
    report = {"tool": "bench_graph_ffn", "modes": {}}
    for mode in args.modes:
        cfg = {"mode": mode, "tokens": args.tokens, "experts": args.experts,
               "wire_mode": args.wire_mode, "hidden": args.hidden,
               "intermediate": args.intermediate, "num_experts": args.num_experts, "top_k": args.top_k,
               "layers": args.layers, "iters": iters, "warmup": args.warmup, "idle_s": args.idle_s,
               "depth": args.depth, "idle_timeout_s": args.idle_timeout_s,
               "recv_spin_us": args.recv_spin_us}
        attn, ffn = launch(_rank, 2, args=(cfg,), timeout_s=600, num_gpus=args.num_gpus)
        report["config"] = {k: v for k, v in cfg.items() if k != "mode"}
        report["modes"][mode] = {"round_trip": {str(t): r for t, r in attn["results"].items()},
                                 "ffn_idle_cpu_percent": idle_cpu_percent(ffn["samples"], attn["idle_window"]),
                                 "ffn_served": ffn["served"],
                                 **{k: ffn[k] for k in ("eager", "replays") if k in ffn}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_graph_ffn.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    _print_table(report, args)
    return 0


def _print_table(report: dict, args) -> None:
    modes = list(report["modes"])
    print(f"==== decode round trip, 1A1F, {args.wire_mode} wire mode, {args.experts} experts, "
          f"hidden {args.hidden}, top-k {args.top_k}, {args.layers} layers, recv_spin_us "
          f"{args.recv_spin_us} (µs: median [p10, p90]) ====")
    print(f"{'tokens':>6s} " + " ".join(f"{m:>24s}" for m in modes))
    for t in args.tokens:
        cells = []
        for m in modes:
            r = report["modes"][m]["round_trip"][str(t)]
            cells.append(f"{r['median_us']:8.1f} [{r['p10_us']:6.1f},{r['p90_us']:7.1f}]")
        print(f"{t:>6d} " + " ".join(f"{c:>24s}" for c in cells))
    for m in modes:
        rep = report["modes"][m]
        cpu = rep["ffn_idle_cpu_percent"]
        print(f"{m}: FFN idle CPU {'-' if cpu is None else f'{cpu:.1f}'} % of a core; served "
              f"{rep['ffn_served']}" + (f", eager {rep['eager']}, replays {rep['replays']}" if "eager" in rep else ""))


if __name__ == "__main__":
    sys.exit(main())
