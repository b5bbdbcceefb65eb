#!/usr/bin/env python3
"""Where does a decode round trip's time go? Phase timestamps, then cProfile, on both sides
of a 1A1F run.

Pass 1 (phases, no profiler): the Attention rank runs ``--iters`` blocking round trips
(send_attn_output + recv_ffn_output); the FFN rank serves them with identity experts. Both
sides stamp ``time.monotonic_ns()`` (one clock for all processes of a host) at the API
boundaries, and on the cuda backend CUDA events around the kernels of each side, so the round
trip splits into: Attention host send, dispatch-to-arrival-seen, FFN host work, FFN reply
launch, reply-to-receive-done, and the GPU time of each kernel group. Median and p90 per
phase go to ``profile_phases.json`` and a table.

Pass 2 (cProfile): the same loop under cProfile on both sides; each side's top functions
(by own time) are written to --out and summarized.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig  # noqa: E402
from afd_cupy.launch import launch  # noqa: E402
import bench_common as bc  # noqa: E402


class _Stamps:
    """Per-round-trip host timestamps (ns) and CUDA event pairs, recorded by wrapping the
    connector's methods and, on the cuda backend, the kernel launchers (tool only)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.rows: list[dict] = []
        self.events: list[dict] = []
        self.enabled = True

    def host(self, key: str) -> None:
        if self.enabled:
            self.rows[-1][key] = time.monotonic_ns()

    def event(self, key: str) -> None:
        if self.enabled and self.cuda:
            import torch
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events[-1][key] = ev

    def new_row(self) -> None:
        if self.enabled:
            self.rows.append({})
            self.events.append({})

    def gpu_us(self, start: str, end: str) -> list:
        return [row[start].elapsed_time(row[end]) * 1e3 for row in self.events
                if start in row and end in row]


def _wrap(owner, name: str, before=None, after=None) -> None:
    inner = getattr(owner, name)

    def wrapped(*a, **kw):
        if before:
            before()
        out = inner(*a, **kw)
        if after:
            after(out)
        return out
    setattr(owner, name, wrapped)


def _instrument(conn, stamps: _Stamps, role: str) -> None:
    """Wrap the API calls (and on cuda the kernel launchers) with stamps."""
    from afd_cupy import kernels
    cuda = stamps.cuda
    if role == "attention":
        _wrap(conn, "send_attn_output", before=lambda: (stamps.new_row(), stamps.host("a_send0")),
              after=lambda _: stamps.host("a_send1"))
        _wrap(conn, "recv_ffn_output", before=lambda: stamps.host("a_recv0"),
              after=lambda _: stamps.host("a_recv1"))
        if cuda:
            _stamp_launches(kernels, stamps, {  # pair and dedup mode's kernels
                "afd_dispatch_plan": ("g_disp0", None), "afd_dispatch_scatter": (None, "g_disp1"),
                "afd_dedup_scatter": (None, "g_disp1"),
                "afd_wait_replies": ("g_wait0", None), "afd_combine": ("g_comb0", "g_comb1"),
                "afd_dedup_combine": ("g_comb0", "g_comb1")},
                host_after={"afd_combine": "a_launched", "afd_dedup_combine": "a_launched"})
        return
    # FFN: a row per item that arrived (a poll timeout returns None and is not a row)
    def arrived(arrival):
        if arrival is not None:
            stamps.new_row()
            stamps.host("f_seen")
            stamps.rows[-1]["f_wait0"] = stamps.pending_wait0
    def wait_started():
        stamps.pending_wait0 = time.monotonic_ns()
    _wrap(conn.path, "wait_any", before=wait_started, after=arrived)
    _wrap(conn, "recv_ffn_work_item", after=lambda item: item is not None and stamps.host("f_item"))
    _wrap(conn, "send_ffn_work_item_output", before=lambda: stamps.host("f_reply0"),
          after=lambda _: stamps.host("f_reply1"))
    if cuda:
        _stamp_launches(kernels, stamps, {"afd_reply": ("g_reply0", "g_reply1"),
                                          "afd_dedup_reply": ("g_reply0", "g_reply1"),
                                          "afd_dedup_expand": ("g_exp0", "g_exp1")})


def _stamp_launches(kernels, stamps: _Stamps, events: dict, host_after: dict | None = None) -> None:
    """Record CUDA events around the backend's packed launches of the named kernels (class-level
    wrap of ``PackedLaunch.launch``; a template instance's name contains the base name)."""
    inner = kernels.PackedLaunch.launch
    host_after = host_after or {}

    def launch(self, *a, **kw):
        kernel_name = str(getattr(self.spec.kernel, "name", ""))  # may be a template instance
        name = next((key for key in events if key in kernel_name), None)
        before, after = events.get(name, (None, None))
        if before:
            stamps.event(before)
        inner(self, *a, **kw)
        if after:
            stamps.event(after)
        if name in host_after:
            stamps.host(host_after[name])
    kernels.PackedLaunch.launch = launch


#: (name, start stamp, end stamp, side) of the host-clock phases, in round-trip order
PHASES = (
    ("attn send_attn_output (host)", "a_send0", "a_send1", "attention"),
    ("send returned -> FFN sees arrival", "a_send1", "f_seen", "both"),
    ("FFN arrival -> work item built", "f_seen", "f_item", "ffn"),
    ("FFN item -> reply called (experts)", "f_item", "f_reply0", "ffn"),
    ("FFN send_ffn_work_item_output (host)", "f_reply0", "f_reply1", "ffn"),
    ("FFN reply returned -> attn recv done", "f_reply1", "a_recv1", "both"),
    ("attn recv launches (host)", "a_recv0", "a_launched", "attention"),
    ("round trip (attn send start -> recv done)", "a_send0", "a_recv1", "both"),
)
GPU_PHASES = (
    ("GPU dispatch plan+scatter", "g_disp0", "g_disp1", "attention"),
    ("GPU wait_replies (incl. waiting)", "g_wait0", "g_comb0", "attention"),
    ("GPU combine", "g_comb0", "g_comb1", "attention"),
    ("GPU expand (dedup)", "g_exp0", "g_exp1", "ffn"),
    ("GPU reply", "g_reply0", "g_reply1", "ffn"),
)


def _quantiles(values: list) -> dict:
    if not values:
        return {"median_us": None, "p90_us": None, "n": 0}
    ordered = sorted(values)
    return {"median_us": statistics.median(ordered), "p90_us": ordered[int(0.9 * (len(ordered) - 1))],
            "n": len(ordered)}


def phase_table(attn: dict, ffn: dict, warmup: int) -> list:
    """Join both sides' rows by round-trip index (1A1F: the FFN serves them in order)."""
    a_rows, f_rows = attn["rows"][warmup:], ffn["rows"][warmup:]
    count = min(len(a_rows), len(f_rows))
    joined = [{**a, **f} for a, f in zip(a_rows[:count], f_rows[:count])]
    table = []
    for name, start, end, _side in PHASES:
        values = [(row[end] - row[start]) / 1e3 for row in joined if start in row and end in row]
        table.append({"phase": name, **_quantiles(values)})
    for name, start, end, side in GPU_PHASES:
        table.append({"phase": name, **_quantiles((attn if side == "attention" else ffn)["gpu"].get(name, [])[warmup:])})
    return table


def _rank(ctx, args) -> dict:
    import torch

    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn_worker import FFNWorker
    from afd_cupy.testing.reference import identity_experts

    backend = args["backend"]
    device = torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(ctx.device_id or 0)
        device = torch.device("cuda", ctx.device_id or 0)
    model = ModelConfig(hidden_size=args["hidden"], num_experts=64, top_k=args["top_k"],
                        moe_intermediate_size=256, num_shared_experts=1,
                        max_num_batched_tokens=max(args["tokens"], 1))
    role = "attention" if ctx.rank == 0 else "ffn"
    conn = AFDConnector(model, TopologyConfig(1, 1), ConnectorConfig(wire_mode=args["wire_mode"]),
                        role=role, role_rank=0,
                        store=ctx.store(), job_id=ctx.job_id, backend=backend,
                        device_id=ctx.device_id)
    profiler = cProfile.Profile()
    stamps = _Stamps(cuda=backend == "cuda")
    _instrument(conn, stamps, role)
    warmup, iters = args["warmup"], args["iters"]
    try:
        if role == "ffn":
            worker = FFNWorker(conn, expert_fn=identity_experts, serving="loop")  # profiles the loop
            while len(stamps.rows) < warmup + iters:  # pass 1: phases
                worker.step()
            stamps.enabled = False
            profiler.enable()  # pass 2: cProfile until shutdown
            worker.run()
            profiler.disable()
            return {"role": "ffn", "stats": _stats(profiler), "served": worker.num_served,
                    "rows": stamps.rows, "gpu": _gpu_phases(stamps, "ffn")}
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(args["tokens"], model.hidden_size, generator=gen).to(torch.bfloat16).to(device)
        weights, ids = conn.select_experts(torch.randn(args["tokens"], 64, generator=gen).to(device))
        for _ in range(warmup + iters):  # pass 1: phases (the first `warmup` are dropped)
            conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0))
        stamps.enabled = False
        gpu = _gpu_phases(stamps, "attention")
        times = []
        profiler.enable()  # pass 2: cProfile
        for _ in range(iters):
            start = time.perf_counter()
            conn.recv_ffn_output(conn.send_attn_output(hidden, ids, weights, 0))
            times.append((time.perf_counter() - start) * 1e6)
        profiler.disable()
        conn.announce_shutdown()
        return {"role": "attention", "stats": _stats(profiler), "median_us": statistics.median(times),
                "min_us": min(times), "rows": stamps.rows, "gpu": gpu}
    finally:
        conn.close()


def _gpu_phases(stamps: _Stamps, side: str) -> dict:
    if not stamps.cuda:
        return {}
    import torch
    torch.cuda.synchronize()
    return {name: stamps.gpu_us(start, end) for name, start, end, owner in GPU_PHASES if owner == side}


def _stats(profiler, limit: int = 30) -> str:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(limit)
    return text.getvalue()


def draw_phases(runs: list) -> callable:
    """A ``bench_common.save_plot`` drawer: one horizontal bar per phase and run (median, with a
    line to the p90), phases in round-trip order, runs side by side. ``runs``: ``[(label,
    phases)]`` with ``phases`` the ``phase_table`` rows; phases nobody measured are left out."""
    names = [name for name, *_ in PHASES + GPU_PHASES
             if any(row["phase"] == name and row["n"] for _, phases in runs for row in phases)]

    def draw(plt):
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) * max(1, len(runs)) + 1.2))
        height = 0.8 / max(1, len(runs))
        for i, (label, phases) in enumerate(runs):
            by_name = {row["phase"]: row for row in phases}
            ys = [k + i * height for k in range(len(names))]
            med = [by_name.get(n, {}).get("median_us") or 0.0 for n in names]
            p90 = [by_name.get(n, {}).get("p90_us") or 0.0 for n in names]
            ax.barh(ys, med, height=height, label=label)
            ax.hlines(ys, med, p90, colors="black", linewidth=1)
        ax.set_yticks([k + 0.4 - height / 2 for k in range(len(names))], names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("µs (bar: median, line: to p90)")
        ax.set_title("decode round trip by phase (profile_roundtrip)", fontsize=10)
        ax.legend(fontsize=8)
    return draw


def _label(report: dict) -> str:
    cfg = report.get("config", {})
    return (f"{cfg.get('backend', '?')} {cfg.get('wire_mode', 'pair')} {cfg.get('tokens', '?')} tok"
            + (f" {report['commit']}" if report.get("commit") else ""))


def plot_saved(paths: list, out_dir: str) -> int:
    """``--plot``: draw saved ``profile_phases.json`` files side by side, no run."""
    runs = []
    for path in paths:
        with open(path) as fh:
            report = json.load(fh)
        runs.append((_label(report), report["phases"]))
    saved = bc.save_plot(Path(out_dir), "profile_phases.png", draw_phases(runs))
    print(f"wrote {saved}" if saved else "no plot written")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=None, help="default 300 (150 with --quick)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="150 round trips")
    parser.add_argument("--wire-mode", default="pair", choices=("pair", "dedup"))
    parser.add_argument("--out", default=".")
    parser.add_argument("--plot", nargs="+", metavar="JSON", default=None,
                        help="only draw these saved profile_phases.json files side by side "
                             "(OUT/profile_phases.png); runs nothing")
    args = parser.parse_args(argv)
    if args.plot:
        return plot_saved(args.plot, args.out)
    if args.iters is None:
        args.iters = 150 if args.quick else 300
    cfg = {"backend": args.backend, "tokens": args.tokens, "hidden": args.hidden,
           "top_k": args.top_k, "iters": args.iters, "warmup": args.warmup,
           "wire_mode": args.wire_mode}
    attn, ffn = launch(_rank, 2, args=(cfg,), timeout_s=300)
    os.makedirs(args.out, exist_ok=True)
    for rep in (attn, ffn):
        with open(os.path.join(args.out, f"profile_{rep['role']}.txt"), "w") as fh:
            fh.write(rep["stats"])
    table = phase_table(attn, ffn, args.warmup)
    commit = os.environ.get("AFD_COMMIT", "")
    with open(os.path.join(args.out, "profile_phases.json"), "w") as fh:
        json.dump({"tool": "profile_roundtrip", "config": cfg, "commit": commit, "phases": table},
                  fh, indent=1)
    bc.save_plot(Path(args.out), "profile_phases.png",
                 draw_phases([(_label({"config": cfg, "commit": commit}), table)]))
    for rep in (attn, ffn):
        print(f"==== {rep['role']} (top functions by own time, {args.iters} round trips) ====")
        print("\n".join(rep["stats"].splitlines()[:22]))
    print(f"\n==== round-trip phases, {args.iters} round trips, no profiler (us; host clock "
          "CLOCK_MONOTONIC shared by both processes, GPU rows from CUDA events) ====")
    print(f"{'phase':44s} {'median':>9s} {'p90':>9s} {'n':>5s}")
    for row in table:
        med = "-" if row["median_us"] is None else f"{row['median_us']:.1f}"
        p90 = "-" if row["p90_us"] is None else f"{row['p90_us']:.1f}"
        print(f"{row['phase']:44s} {med:>9s} {p90:>9s} {row['n']:>5d}")
    print(f"profile_roundtrip: backend={args.backend} wire_mode={args.wire_mode} tokens={args.tokens} hidden={args.hidden} "
          f"top_k={args.top_k}: round trip median {attn['median_us']:.1f} us (min {attn['min_us']:.1f} us) "
          f"under cProfile; FFN served {ffn['served']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
