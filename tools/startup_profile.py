#!/usr/bin/env python3
"""Where the main job's time goes: the smoke run (tools/smoke.py) with a per-phase breakdown.

Every launched rank times, wall (``time.perf_counter``) and CPU (``time.process_time``):
its boot (interpreter start and spawn, from the launch call to the rank function), the
imports one by one (torch, numba, cupy when present, afd_cupy.connector, the scenario), the
numba planners' load (with their on-disk cache hits and misses), the connector's
construction (handshake, heap, window), inputs, the first round trip, the other round
trips, the reference check, the FFN's weights and serving loop, and shutdown. The parent
adds its own imports, the backend detection and the launch, with its children's CPU time
(``resource.getrusage(RUSAGE_CHILDREN)``). Prints a table; ``--out DIR`` writes
``DIR/startup_profile.json``. Takes smoke.py's arguments (``--2a2f``, ``--backend``, ...).
"""
from __future__ import annotations

# NOTE: only the standard library at the top: a spawned rank re-imports this file before it
# runs profiled_rank, and its imports are what the rank measures.
import argparse
import importlib
import json
import os
import pickle
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RANK_IMPORTS = ("torch", "numba", "cupy", "afd_cupy.connector", "afd_cupy.testing.scenario")


def _timed_import(timer, name: str) -> str:
    """Import ``name`` inside phase ``import <name>``; "absent" (no phase) when not installed."""
    try:
        with timer.phase(f"import {name}"):
            importlib.import_module(name)
        return "ok"
    except ImportError:
        timer.phases.pop(f"import {name}", None)
        return "absent"


def _load_numba_steps(timer, scenario, role: str) -> dict:
    """The numba steps this rank's backend runs (host: the Attention side's planners in pair
    mode, every rank's dedup steps in dedup mode; cuda: none), loaded as the connector's
    warm-up does, inside phase "numba steps load"; their on-disk cache hits and misses."""
    from afd_cupy import dedup, planner

    if scenario.backend != "host":
        return {}
    if scenario.connector.wire_mode == "dedup":
        module = dedup
    elif role == "attention":
        module = planner
    else:
        return {}
    with timer.phase("numba steps load"):
        module.warm_up()
    functions = [f for f in vars(module).values() if hasattr(f, "stats") and hasattr(f, "py_func")]
    return {f.py_func.__name__: {"cache_hits": sum(f.stats.cache_hits.values()),
                                 "cache_misses": sum(f.stats.cache_misses.values()),
                                 "cache_path": f.stats.cache_path} for f in functions}


def profiled_rank(ctx, scenario_blob: bytes, launch_time: float) -> dict:
    """A launched rank: boot, imports, numba, then the smoke scenario under a PhaseTimer."""
    boot_wall, boot_cpu = time.time() - launch_time, time.process_time()
    from afd_cupy.testing.phases import PhaseTimer

    timer = PhaseTimer()
    timer.add("boot (spawn, interpreter, afd_cupy.launch)", boot_wall, boot_cpu)
    imports = {name: _timed_import(timer, name) for name in RANK_IMPORTS}
    from afd_cupy.testing.scenario import run_rank
    from afd_cupy.topology import Role, Topology

    scenario = pickle.loads(scenario_blob)
    role = Topology(scenario.num_attn, scenario.num_ffn, scenario.model.num_experts).role_of(ctx.rank)[0]
    numba_stats = _load_numba_steps(timer, scenario, "attention" if role is Role.ATTENTION else "ffn")
    with timer.phase("run_rank (total)"):
        report = run_rank(ctx, scenario, timer)
    import torch

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"rank": ctx.rank, "role": report["role"], "phases": timer.phases,
            "imports": imports, "numba": numba_stats, "torch_threads": torch.get_num_threads(),
            "thread_env": {v: os.environ.get(v) for v in
                           ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                            "NUMBA_NUM_THREADS")},
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "ok": _rank_ok(report, scenario)}


def _rank_ok(report: dict, scenario) -> bool:
    if report["role"] != "attention":
        return True
    from afd_cupy.testing.scenario import tolerance

    tol = tolerance(scenario.model.dtype)
    return all(e["num_nan"] == 0 and e["rel_err"] <= tol for e in report["errors"])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def profile(argv=None) -> dict:
    """Run the profiled smoke job; returns the JSON-ready result."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--out", default=None)
    own, rest = parser.parse_known_args(argv)
    parent = {}
    wall, cpu = time.perf_counter(), time.process_time()
    import smoke  # afd_cupy.launch, afd_cupy.testing.scenario (torch), afd_cupy.config
    parent["import smoke (afd_cupy, torch)"] = (time.perf_counter() - wall, time.process_time() - cpu)
    args = smoke.parse_args(rest)
    wall, cpu = time.perf_counter(), time.process_time()
    backend = args.backend or smoke.detect_backend()
    parent["detect backend"] = (time.perf_counter() - wall, time.process_time() - cpu)
    scenario = smoke.build_scenario(args, backend)
    wall, cpu, child_cpu = time.perf_counter(), time.process_time(), _children_cpu()
    ranks = smoke.launch(profiled_rank, scenario.world_size, timeout_s=args.timeout,
                         args=(pickle.dumps(scenario), time.time()))
    launch_wall = time.perf_counter() - wall
    parent["launch (parent side)"] = (launch_wall, time.process_time() - cpu)
    return {"backend": backend, "world": f"{scenario.num_attn}A{scenario.num_ffn}F",
            "args": vars(args), "cpu_cores": len(os.sched_getaffinity(0)),
            "parent": {k: {"wall_s": w, "cpu_s": c} for k, (w, c) in parent.items()},
            "launch_wall_s": launch_wall, "children_cpu_s": _children_cpu() - child_cpu,
            "ranks": ranks, "ok": all(r["ok"] for r in ranks), "out": own.out}


def print_table(result: dict) -> None:
    ranks = result["ranks"]
    names = list(dict.fromkeys(name for r in ranks for name in r["phases"]))
    heads = [f"{r['role'][:4]}{r['rank']} wall / cpu s" for r in ranks]
    print(f"startup profile: {result['world']} backend={result['backend']} "
          f"cores={result['cpu_cores']} torch threads per rank "
          f"{[r['torch_threads'] for r in ranks]}")
    print(f"{'phase':46s}" + "".join(f"{h:>22s}" for h in heads))
    for name in names:
        cells = []
        for r in ranks:
            p = r["phases"].get(name)
            cells.append(f"{p['wall_s']:9.3f} / {p['cpu_s']:7.3f}" if p else f"{'-':>19s}")
        print(f"{name:46s}" + "".join(f"{c:>22s}" for c in cells))
    for name, p in result["parent"].items():
        print(f"parent: {name:38s}{p['wall_s']:9.3f} / {p['cpu_s']:7.3f}")
    for r in ranks:
        hits = {k: (v["cache_hits"], v["cache_misses"]) for k, v in r["numba"].items()}
        print(f"rank {r['rank']} numba cache (hits, misses): {hits}")
    print(f"launch wall {result['launch_wall_s']:.2f} s, children CPU "
          f"{result['children_cpu_s']:.2f} s (ratio {result['children_cpu_s'] / result['launch_wall_s']:.2f})"
          f"  {'PASS' if result['ok'] else 'FAIL'}")


def main(argv=None) -> int:
    result = profile(argv)
    print_table(result)
    if result["out"]:
        os.makedirs(result["out"], exist_ok=True)
        path = os.path.join(result["out"], "startup_profile.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
