#!/usr/bin/env python3
"""The greedy gate: torch's ops vs the one-kernel gate (``raw_kernels/model/gate.cu``), same run.

For each (tokens, experts, top_k, scoring) case, ``gates.select_experts`` with ``impl="torch"``
and with ``impl="kernel"`` on the same bf16 logits, timed two ways:

- ``graph``: ``--calls`` gate calls captured in one CUDA graph, the graph replayed ``--iters``
  times between CUDA events: device time per call, launch overhead excluded (how a captured
  decode step pays it);
- ``eager``: ``--calls`` calls issued from Python between CUDA events, ``--iters`` times: host
  launch cost included (how an eager loop pays it; whichever of host and device is slower).

Prints µs per gate call (median over iterations) and the ratio torch / kernel per case, and
checks that both paths chose the same experts (``CHECK FAILED``, exit code 1, if not: the
logits are drawn without near-ties, see tests/helpers/gates.py). Writes ``bench_gate.json`` to
``--out``. Needs a CUDA GPU with CuPy; without one it says so and writes a report marked
``skipped`` (exit code 0).

    python3 tools/bench_gate.py --out OUT [--tokens 1 32 128 512] [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

#: (experts, top_k, scoring): V2-Lite, Qwen3-30B-A3B, OLMoE, a sigmoid gate
CASES = ((64, 6, "softmax"), (128, 8, "softmax"), (64, 8, "softmax"), (256, 8, "sigmoid"))
IMPLS = ("torch", "kernel")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 512])
    parser.add_argument("--calls", type=int, default=50, help="gate calls per graph / timed loop")
    parser.add_argument("--iters", type=int, default=None, help="default 50 (10 with --quick)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.calls < 1 or (args.iters is not None and args.iters < 1):
        parser.error("--tokens, --calls and --iters must be >= 1")
    args.iters = args.iters or (10 if args.quick else 50)
    return args


def ladder_logits(rng, num_tokens: int, num_experts: int) -> np.ndarray:
    """Rows of evenly spaced shuffled logits in [-4, 4): no near-ties in bf16 (the two paths
    then agree exactly on the ids)."""
    spacing = min(0.05, 8.0 / num_experts)
    ladder = np.arange(num_experts, dtype=np.float32) * spacing - spacing * num_experts / 2
    return np.stack([rng.permutation(ladder) for _ in range(num_tokens)]).astype(np.float32)


def time_case(logits, top_k: int, scoring: str, impl: str, calls: int, iters: int) -> dict:
    """µs per gate call, captured (graph) and issued from Python (eager); the last ids."""
    import torch

    from afd_cupy.moe import gates

    def gate():
        return gates.select_experts(logits, top_k, scoring_func=scoring, impl=impl)

    for _ in range(3):  # compile, pack, warm the allocator
        gate()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = gate()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph_us, eager_us = [], []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        graph_us.append(start.elapsed_time(end) * 1e3 / calls)
    for _ in range(iters):
        start.record()
        for _ in range(calls):
            gate()
        end.record()
        end.synchronize()
        eager_us.append(start.elapsed_time(end) * 1e3 / calls)
    return {"graph_us": bc.median(graph_us), "eager_us": bc.median(eager_us),
            "graph_p90_us": bc.percentile(graph_us, 90), "eager_p90_us": bc.percentile(eager_us, 90),
            "ids": out[1].cpu().numpy()}


def run(args) -> dict:
    import torch

    rng = np.random.default_rng(args.seed)
    rows, failures = [], []
    for num_tokens in args.tokens:
        for num_experts, top_k, scoring in CASES:
            logits = torch.from_numpy(ladder_logits(rng, num_tokens, num_experts)).to("cuda", torch.bfloat16)
            by_impl = {impl: time_case(logits, top_k, scoring, impl, args.calls, args.iters) for impl in IMPLS}
            same = bool(np.array_equal(by_impl["torch"]["ids"], by_impl["kernel"]["ids"]))
            if not same:
                failures.append(f"T={num_tokens} E={num_experts} K={top_k} {scoring}: ids differ")
            row = {"tokens": num_tokens, "experts": num_experts, "top_k": top_k, "scoring": scoring,
                   "same_ids": same}
            for impl in IMPLS:
                row.update({f"{impl}_{k}": v for k, v in by_impl[impl].items() if k != "ids"})
            row["graph_ratio"] = row["torch_graph_us"] / row["kernel_graph_us"]
            row["eager_ratio"] = row["torch_eager_us"] / row["kernel_eager_us"]
            rows.append(row)
    return {"rows": rows, "failures": failures}


def table(rows) -> str:
    headers = ("tokens", "E", "K", "scoring", "torch graph µs", "kernel graph µs", "graph ratio",
               "torch eager µs", "kernel eager µs", "eager ratio", "same ids")
    return bc.format_table(headers, [
        (r["tokens"], r["experts"], r["top_k"], r["scoring"], f"{r['torch_graph_us']:.2f}",
         f"{r['kernel_graph_us']:.2f}", f"{r['graph_ratio']:.2f}", f"{r['torch_eager_us']:.1f}",
         f"{r['kernel_eager_us']:.1f}", f"{r['eager_ratio']:.2f}", r["same_ids"]) for r in rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    report = {"tool": "bench_gate", "config": {"tokens": args.tokens, "calls": args.calls,
                                               "iters": args.iters, "cases": CASES, "seed": args.seed}}
    reason = None
    try:
        import torch
        if not torch.cuda.is_available():
            reason = "no CUDA GPU"
        else:
            import cupy  # noqa: F401
    except ImportError as exc:
        reason = f"{exc}"
    if reason is not None:
        print(f"bench_gate needs a CUDA GPU with CuPy ({reason}); skipped")
        report.update({"skipped": reason, "run": bc.run_info("host")})
        bc.write_json(args.out, "bench_gate.json", report)
        return 0
    report.update({"run": bc.run_info("cuda"), "device": bc.device_name(torch.device("cuda", 0))})
    report.update(run(args))
    print(f"==== greedy gate, bf16 logits, {report['device']}: torch's ops vs one kernel "
          f"(µs per call, median of {args.iters}; graph: {args.calls} calls captured) ====")
    print(table(report["rows"]))
    print(f"wrote {bc.write_json(args.out, 'bench_gate.json', report)}")
    for failure in report["failures"]:
        print(f"CHECK FAILED: {failure}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
