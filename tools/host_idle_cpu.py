"""CPU use of idle host-backend ranks, and the busy round trip, with and without the idle
back-off of the host waits (``afd_cupy.backends.host_poll.Backoff``).

1A1F on the host backend, three phases per mode:

- ``ffn_idle``: the FFN rank polls for ``--seconds`` while the Attention rank sends nothing;
  the FFN's process CPU time / wall time.
- ``attn_wait``: the Attention rank waits ``--seconds`` for a reply the FFN holds back (its
  expert sleeps); the Attention's process CPU time / wall time.
- ``busy_rtt``: ``--layers`` round trips of 8 tokens through identity experts, back to back;
  mean round trip in µs (what the back-off must not slow down).

Modes: ``spin`` (the waits yield and poll again at once: the behaviour before the back-off,
measured in the same run as the baseline) and ``backoff`` (the library as it is). Prints a
table and writes JSON (``--json``); ratios are backoff / spin.

    PYTHONPATH=. python tools/host_idle_cpu.py --seconds 3 --json idle_cpu.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

MODES = ("spin", "backoff")


def _spin_instead(_self, _deadline):
    time.sleep(0)


def _program(ctx, mode, seconds, layers):
    from afd_cupy.backends import host_poll
    from afd_cupy.config import ModelConfig, TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.runtime.store import store_fetch, store_publish

    if mode == "spin" and hasattr(host_poll, "Backoff"):
        host_poll.Backoff.pause = _spin_instead
    model = ModelConfig(hidden_size=64, num_experts=4, top_k=2, moe_intermediate_size=32,
                        num_shared_experts=0, dtype="float32", max_num_batched_tokens=8,
                        num_layers=4)
    role, rank = ("attention", 0) if ctx.rank == 0 else ("ffn", 0)
    conn = AFDConnector(model, TopologyConfig(1, 1), role=role, role_rank=rank,
                        store=ctx.store(), job_id=ctx.job_id, backend="host",
                        peer_timeout_s=seconds + 30.0)
    store = ctx.store()
    try:
        if role == "ffn":
            cpu, wall = time.process_time(), time.monotonic()
            while time.monotonic() - wall < seconds:
                assert conn.recv_ffn_work_item(100) is None
            idle = (time.process_time() - cpu) / (time.monotonic() - wall)
            store_publish(store, "idle_done", b"1")

            def experts(item):
                if item.layer_idx == 1:
                    time.sleep(seconds)  # the Attention rank waits meanwhile
                return item.routed_x.clone(), None

            FFNWorker(conn, expert_fn=experts).run()
            return {"ffn_idle": idle}
        store_fetch(store, "idle_done", seconds + 60.0)
        hidden = torch.randn(8, model.hidden_size)
        weights, ids = conn.select_experts(torch.randn(8, model.num_experts))
        conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0))  # warm-up
        handle = conn.send_attn_output(hidden, ids, weights, 1)
        cpu, wall = time.process_time(), time.monotonic()
        conn.recv_ffn_output(handle)
        waiting = (time.process_time() - cpu) / (time.monotonic() - wall)
        start = time.perf_counter()
        for _ in range(layers):
            conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0))
        rtt_us = (time.perf_counter() - start) / layers * 1e6
        conn.announce_shutdown()
        return {"attn_wait": waiting, "busy_rtt_us": rtt_us}
    finally:
        conn.close()


def main(argv=None) -> dict:
    from afd_cupy.runtime.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--layers", type=int, default=300)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = {}
    for mode in MODES:
        attn, ffn = launch(_program, 2, args=(mode, args.seconds, args.layers),
                           timeout_s=4 * args.seconds + 120)
        results[mode] = {**ffn, **attn}
    rows = [("ffn_idle", "FFN idle, % of a core", 100.0), ("attn_wait", "Attention waiting, % of a core", 100.0),
            ("busy_rtt_us", "busy round trip, µs", 1.0)]
    print(f"{'metric':34s} {'spin':>10s} {'backoff':>10s} {'backoff/spin':>13s}")
    for key, label, scale in rows:
        spin, back = results["spin"][key] * scale, results["backoff"][key] * scale
        print(f"{label:34s} {spin:10.2f} {back:10.2f} {back / spin if spin else float('nan'):13.3f}")
    report = {"seconds": args.seconds, "layers": args.layers, "results": results}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
