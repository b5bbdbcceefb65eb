#!/usr/bin/env python3
"""Soak: N Attention round trips with random sizes, layers and stages, random FFN stalls
longer than the peer timeout, every output checked against its expected value
(docs/design/fault-model.md).

Identity experts make the expected output exact to compute on the Attention side:
``out = (hidden * sum_k w[t,k] + hidden) * out_scale`` (routed rows plus the shared row).
Token counts are drawn from [0, max], both ends included; a step uses 1 or 2 micro-batch
stages, sent together and received in random order. The FFN stalls an item with probability
``--stall-prob`` for ``1.5 * --peer-timeout``: the Attention side must raise PeerTimeoutError
for that layer and get every later layer right (late replies dropped by seq).

Prints a table (round trips, mismatches, errors by type, RSS and /dev/shm before/after) and
writes ``soak.json`` under ``--out``. Exit code 0 when there was no mismatch and no error other
than the stalls' timeouts.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.runtime.launch import detect_backend, launch  # noqa: E402
from afd_cupy.transports import transport_names  # noqa: E402
from afd_cupy.wire import WIRE_MODES  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=1000, help="layers sent per Attention rank")
    parser.add_argument("--attn", type=int, default=1)
    parser.add_argument("--ffn", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--stall-prob", type=float, default=0.002)
    parser.add_argument("--peer-timeout", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("cuda", "host"), default=None)
    parser.add_argument("--poll-mode", choices=("device", "host"), default="device")
    parser.add_argument("--wire-mode", choices=WIRE_MODES, default="pair",
                        help="ConnectorConfig.wire_mode (dedup: one row per token and FFN rank)")
    parser.add_argument("--transport", choices=transport_names(), default="direct",
                        help="ConnectorConfig.transport (put: every peer by NVSHMEM put-with-signal; cuda only)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="whole-job bound (s); a rank still running then is reported with its stacks")
    parser.add_argument("--progress-s", type=float, default=10.0,
                        help="each Attention rank prints its progress this often (s; 0: never)")
    parser.add_argument("--exit-grace-s", type=float, default=0.0,
                        help="launch(exit_grace_s=): let the ranks exit on their own after a "
                             "clean run before they are terminated (does CUDA then remove "
                             "its per-process /dev/shm files?)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    return parser.parse_args(argv)


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def _shm_names() -> set[str] | None:
    """Names in /dev/shm (all owners: NVSHMEM, MPS and multiprocessing keep some too); None
    without /dev/shm."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else None


def _shm_entries(names: set[str] | None) -> int:
    """How many entries ``names`` (:func:`_shm_names`) has, -1 without /dev/shm."""
    return -1 if names is None else len(names)


def _afd_segments(job_id: str) -> list[str]:
    """This job's own shared-memory segments (host backend); none may outlive the run."""
    from afd_cupy.heap.host import segment_glob

    return sorted(glob.glob(segment_glob(job_id)))


def _connect(ctx, args, model):
    import torch

    from afd_cupy.connector import AFDConnector
    from afd_cupy.runtime.topology import Topology

    role, role_rank = Topology(args.attn, args.ffn, model.num_experts).role_of(ctx.rank)
    if args.backend == "cuda":
        torch.cuda.set_device(ctx.device_id or 0)
    config = ConnectorConfig(async_moe_ubatching=True, async_moe_num_ubatches=2,
                             routed_cap_multiplier=float(args.ffn), wire_mode=args.wire_mode,
                             transport=args.transport)
    return AFDConnector(model, TopologyConfig(args.attn, args.ffn), config, role=role,
                        role_rank=role_rank, store=ctx.store(), job_id=ctx.job_id,
                        backend=args.backend, device_id=ctx.device_id, poll_mode=args.poll_mode,
                        peer_timeout_s=args.peer_timeout), role, role_rank


def _ffn(conn, args, rank_seed):
    from afd_cupy.ffn.worker import FFNWorker

    rng = random.Random(rank_seed)
    stalls = []

    def identity(item):
        if rng.random() < args.stall_prob:
            stalls.append(item.layer_idx)
            time.sleep(1.5 * args.peer_timeout)
        shared = None if item.shared_x is None else item.shared_x.clone()
        return item.routed_x.clone(), shared

    served = FFNWorker(conn, expert_fn=identity).run()
    return {"served": served, "stalls": len(stalls)}


def _attention(conn, args, rank_seed):
    import torch

    from afd_cupy.errors import AfdError

    rng = random.Random(rank_seed)
    gen = torch.Generator().manual_seed(rank_seed)
    model, device = conn.model, conn.device
    errors, mismatches, worst = collections.Counter(), 0, 0.0
    done = 0
    rss_warm = None
    start = next_progress = time.monotonic()
    while done < args.round_trips:
        if args.progress_s > 0 and time.monotonic() >= next_progress + args.progress_s:
            next_progress = time.monotonic()
            print(f"soak attention {conn.role_rank}: {done}/{args.round_trips} round trips in "
                  f"{next_progress - start:.1f} s, mismatches {mismatches}, errors {dict(errors)}",
                  flush=True)
        if rss_warm is None and done >= args.round_trips // 10:
            rss_warm = _rss_kib()  # after the warm-up: the flat-memory baseline
        layer = rng.randrange(model.num_layers)
        stages = list(range(min(rng.choice((1, 2)), args.round_trips - done)))
        sent = []
        for stage in stages:
            num_tokens = rng.choice((0, model.max_num_batched_tokens, rng.randrange(model.max_num_batched_tokens + 1)))
            hidden = torch.randn(num_tokens, model.hidden_size, generator=gen).to(conn.torch_dtype).to(device)
            logits = torch.randn(num_tokens, model.num_experts, generator=gen).to(device)
            weights, ids = conn.select_experts(logits)
            sent.append((conn.send_attn_output(hidden, ids, weights, layer, stage), hidden, weights))
        rng.shuffle(sent)
        for handle, hidden, weights in sent:
            done += 1
            try:
                out = conn.recv_ffn_output(handle).float()
            except AfdError as err:
                errors[type(err).__name__] += 1
                continue
            expect = (hidden.float() * (weights.float().sum(dim=1, keepdim=True) + 1.0)) * conn.out_scale
            err = (out - expect).abs() - (2e-2 * expect.abs() + 2e-2)
            if out.numel() and (not bool(torch.isfinite(out).all()) or float(err.max()) > 0):
                mismatches += 1
            if out.numel():
                worst = max(worst, float((out - expect).abs().max()))
    conn.announce_shutdown()
    return {"round_trips": done, "mismatches": mismatches, "errors": dict(errors), "max_abs_err": worst,
            "rss_kib_warm": rss_warm if rss_warm is not None else _rss_kib()}


def _rank(ctx, args):
    model = ModelConfig(hidden_size=args.hidden, num_experts=args.experts, top_k=args.top_k,
                        moe_intermediate_size=args.hidden, num_shared_experts=1, dtype="bfloat16",
                        max_num_batched_tokens=args.max_tokens, num_layers=args.layers)
    shm0 = _shm_entries(_shm_names())
    conn, role, role_rank = _connect(ctx, args, model)
    rss0 = _rss_kib()
    start = time.perf_counter()
    try:
        seed = args.seed * 1000 + ctx.rank
        report = _ffn(conn, args, seed) if role.value == "ffn" else _attention(conn, args, seed)
    finally:
        conn.close()
    report.update(role=role.value, role_rank=role_rank, wall_s=time.perf_counter() - start,
                  rss_kib_before=rss0, rss_kib_after=_rss_kib(), shm_before=shm0,
                  shm_after=_shm_entries(_shm_names()),
                  afd_segments_after_close=_afd_segments(ctx.job_id), returned_at=time.time())
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    args.backend = args.backend or detect_backend()
    print(f"afd_cupy soak: {args.attn}A{args.ffn}F backend={args.backend} wire_mode={args.wire_mode} "
          f"transport={args.transport} round_trips={args.round_trips} per attention rank, "
          f"max_tokens={args.max_tokens} stall_prob={args.stall_prob}", flush=True)
    names_before = _shm_names()
    reports = launch(_rank, args.attn + args.ffn, args=(args,), timeout_s=args.timeout,
                     exit_grace_s=args.exit_grace_s)
    # from the last rank's return to the launch's: the ranks' exit, with --exit-grace-s
    exit_s = time.time() - max(r["returned_at"] for r in reports)
    names_after = _shm_names()
    shm_before, shm_after = _shm_entries(names_before), _shm_entries(names_after)
    shm_new = sorted((names_after or set()) - (names_before or set()))
    attn = [r for r in reports if r["role"] == "attention"]
    ffn = [r for r in reports if r["role"] == "ffn"]
    errors = collections.Counter()
    for r in attn:
        errors.update(r["errors"])
    stalls = sum(r["stalls"] for r in ffn)
    summary = {"backend": args.backend, "wire_mode": args.wire_mode, "transport": args.transport,
               "round_trips": sum(r["round_trips"] for r in attn),
               "mismatches": sum(r["mismatches"] for r in attn), "errors": dict(errors),
               "ffn_stalls": stalls, "max_abs_err": max(r["max_abs_err"] for r in attn),
               "shm_entries_before": shm_before, "shm_entries_after": shm_after,
               "shm_new_entries": shm_new, "exit_grace_s": args.exit_grace_s,
               "launch_return_after_last_rank_s": exit_s, "ranks": reports}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"{'rank':<14}{'round trips':>12}{'mismatch':>10}{'errors':>28}{'RSS KiB start':>15}"
          f"{'warm':>10}{'end':>10}{'wall s':>9}")
    for r in reports:
        trips = r.get("round_trips", r.get("served"))
        print(f"{r['role'] + ' ' + str(r['role_rank']):<14}{trips:>12}{r.get('mismatches', '-'):>10}"
              f"{json.dumps(r.get('errors', {'stalls': r.get('stalls')})):>28}{r['rss_kib_before']:>15}"
              f"{r.get('rss_kib_warm', '-'):>10}{r['rss_kib_after']:>10}{r['wall_s']:>9.1f}")
    unexpected = {k: v for k, v in errors.items() if k != "PeerTimeoutError"}
    timeouts = errors.get("PeerTimeoutError", 0)
    # A stall delays what waits behind it at that FFN rank: at most one item per (Attention
    # rank, stage) can be caught, so every timeout must be explained by a stall.
    leaked = sorted({path for r in reports for path in r["afd_segments_after_close"]})
    summary["afd_segments_left"] = leaked
    ok = (summary["mismatches"] == 0 and not unexpected and timeouts <= stalls * args.attn * 2
          and not leaked)
    print(f"SOAK {'PASS' if ok else 'FAIL'} backend={args.backend} wire_mode={args.wire_mode} "
          f"transport={args.transport} round_trips={summary['round_trips']} "
          f"mismatches={summary['mismatches']} errors={dict(errors)} stalls={stalls} "
          f"afd segments left {len(leaked)}, /dev/shm entries (all owners) {shm_before}->{shm_after}, "
          f"launch returned {exit_s:.2f} s after the last rank (exit grace {args.exit_grace_s:g} s)")
    if shm_new:  # not this job's segments (checked above): whose they are is worth knowing
        print(f"new /dev/shm entries ({len(shm_new)}): {', '.join(shm_new[:8])}"
              f"{', ...' if len(shm_new) > 8 else ''}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
