#!/usr/bin/env python3
"""What one spinning warp next to it costs the routed grouped GEMM, and what an SM carve-out buys.

One process, one GPU. The routed expert compute of one FFN item of DeepSeek-V2-Lite's shape
(``afd_cupy.moe.grouped_mlp``: ``torch._grouped_mm`` gate/up, SiLU * up in fp32, ``_grouped_mm``
down; bf16, ``--num-experts`` experts of ``--hidden`` x ``--intermediate``), on the rows of a
seeded random top-k routing of ``--tokens`` tokens (each token ``--top-k`` distinct experts:
T*K rows grouped by expert; counts from :func:`routing_counts`), timed with CUDA events around
the call on its stream (after a ``torch.cuda._sleep`` head start of ``--head-start-us``, so the
host's launches are all queued when the start event fires), ``--iters`` times after ``--warmup``,
in these settings (rows):

- ``alone``: nothing else on the GPU;
- ``spin``: a one-warp kernel (1 block of 32 threads, a CuPy RawKernel) polling a device flag is
  resident on another stream during the GEMMs: launched first, the GEMMs enqueued only once it
  reported (a pinned word) that it runs, released after the GEMMs' end event by a host-to-device
  copy into the flag (a copy engine, no SM); its loop is bounded by ``%globaltimer``
  (``--spin-timeout-ms``); the library's wait kernels (``afd_wait_any``, the reply wait) are
  such one-block spinners;
- ``spin_nanosleep``: the same with ``__nanosleep(--nanosleep-ns)`` in the loop;
- ``spin_carveout<n>``: ``spin`` with the GEMMs launched inside ``moe.sm_carveout(n)`` for each n of
  ``--carveouts`` (default 1 2): the persistent grouped GEMM gets ``SMs - n`` CTAs;
- ``alone_carveout<n>``: ``alone`` with the carve-out: what leaving n SMs idle costs by itself.

Why (docs/design.md §8, "SM carve-out"): ``torch._grouped_mm`` runs a persistent CUTLASS kernel
with one CTA per SM; an SM partly taken by the spinner cannot host its CTA until another one
finishes, so that CTA's tiles run at the tail. Measured on one H200 (torch 2.11) before this
probe: ~430-455 µs alone, ~660 µs with one spinning warp.

Prints a table (median / p10 / p90 µs and each row's ratio of medians to ``alone`` of the same
run) and writes ``probe_spin_gemm.json`` to --out. Checks (``CHECK FAILED: ...``, exit code 1):
every spinner was released by its flag (not by its timeout), and every setting's last output
equals the ``alone`` output bit for bit (the carve-out changes the grid, not the math).
No MPS, no second process: ``NO_MPS=1`` in tools/gpu_suite.sh (``trace1``, step ``spin_gemm``).

    python3 tools/probe_spin_gemm.py --out OUT [--tokens 128 --top-k 6 --num-experts 64
                                                --hidden 2048 --intermediate 1408]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

ALONE = "alone"
#: spinner kinds: none, a plain polling loop, the loop with __nanosleep
SPINNERS = (None, "spin", "nanosleep")
#: the spinner's result word: released by the flag / gave up at its timeout
RELEASED, TIMED_OUT = 1, 2
#: host wait for the spinner to report it runs (it is one block: it starts at once or never)
START_TIMEOUT_S = 5.0

SPIN_SOURCE = r"""
extern "C" __global__ void probe_spin(const volatile int* flag, volatile long long* started,
                                      long long tag, unsigned long long timeout_ns,
                                      unsigned int nap_ns, int* result) {
    unsigned long long t0, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    if (threadIdx.x == 0) {
        *started = tag;  // pinned host memory: the host enqueues the GEMMs once it sees this
        __threadfence_system();
    }
    int released = 0;
    for (;;) {
        if (*flag != 0) { released = 1; break; }
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - t0 > timeout_ns) break;
        if (nap_ns) __nanosleep(nap_ns);
    }
    if (threadIdx.x == 0) result[0] = released ? 1 : 2;
}
"""


# --------------------------------------------------------------------------- pure parts

def routing_counts(tokens: int, top_k: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """Rows per expert (int64 [num_experts], sum tokens * top_k) of a seeded random top-k
    routing: each token picks ``top_k`` distinct experts uniformly."""
    if not 1 <= top_k <= num_experts or tokens < 0:
        raise ValueError(f"need 1 <= top_k <= num_experts and tokens >= 0, got tokens={tokens}, "
                         f"top_k={top_k}, num_experts={num_experts}")
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)]).reshape(-1) \
        if tokens else np.zeros(0, np.int64)
    return np.bincount(ids, minlength=num_experts).astype(np.int64)


def settings(carveouts) -> list:
    """The rows, in order: (name, spinner kind or None, carve-out)."""
    rows = [(ALONE, None, 0), ("spin", "spin", 0), ("spin_nanosleep", "nanosleep", 0)]
    rows += [(f"spin_carveout{n}", "spin", n) for n in carveouts]
    rows += [(f"alone_carveout{n}", None, n) for n in carveouts]
    return rows


def summarize(times_us: dict, kinds: dict) -> list:
    """Per setting (``times_us``: name -> µs samples, in the order to report; ``kinds``: name ->
    (spinner, carve-out)): {setting, spinner, carveout, median_us, p10_us, p90_us, n, ratio}
    with ``ratio`` = the row's median / ``alone``'s median (None without an ``alone`` row)."""
    import device_trace as dt

    stats = {name: dt.stats_us(values) for name, values in times_us.items()}
    base = stats.get(ALONE, {}).get("median_us")
    rows = []
    for name, s in stats.items():
        spinner, carveout = kinds[name]
        ratio = s["median_us"] / base if base and s["median_us"] is not None else None
        rows.append({"setting": name, "spinner": spinner, "carveout": carveout, **s, "ratio": ratio})
    return rows


def table(rows: list) -> str:
    headers = ("setting", "spinner", "carve-out", "median µs", "p10 µs", "p90 µs", "n", "x alone")
    return bc.format_table(headers, [(r["setting"], r["spinner"] or "-", r["carveout"], r["median_us"],
                                      r["p10_us"], r["p90_us"], r["n"], r["ratio"]) for r in rows])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="T: tokens routed (rows = T * K)")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--seed", type=int, default=0, help="routing and weights")
    parser.add_argument("--iters", type=int, default=200, help="timed iterations per setting")
    parser.add_argument("--warmup", type=int, default=20, help="untimed iterations per setting first")
    parser.add_argument("--carveouts", type=int, nargs="+", default=[1, 2],
                        help="SMs left free in the carve-out rows")
    parser.add_argument("--nanosleep-ns", type=int, default=100, help="spin_nanosleep's __nanosleep")
    parser.add_argument("--spin-timeout-ms", type=float, default=2000.0,
                        help="bound of one spinner's loop (%%globaltimer)")
    parser.add_argument("--head-start-us", type=float, default=200.0,
                        help="torch.cuda._sleep on the GEMM stream before the start event, so that the "
                             "host has enqueued the whole pair when it starts (0: none)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    if args.tokens < 1 or not 1 <= args.top_k <= args.num_experts or args.iters < 1 or args.warmup < 0:
        parser.error("need --tokens >= 1, 1 <= --top-k <= --num-experts, --iters >= 1, --warmup >= 0")
    if min(args.carveouts) < 1 or len(set(args.carveouts)) != len(args.carveouts):
        parser.error(f"--carveouts must be distinct values >= 1, got {args.carveouts}")
    if args.nanosleep_ns < 1 or not args.spin_timeout_ms > 0 or args.head_start_us < 0:
        parser.error("--nanosleep-ns must be >= 1, --spin-timeout-ms > 0 and --head-start-us >= 0")
    return args


# --------------------------------------------------------------------------- the GPU part

class Spinner:
    """One-warp spinner on its own stream: :meth:`start` launches it and returns once it runs,
    :meth:`release` flips its device flag by a copy and returns its result word."""

    def __init__(self, cupy, timeout_ms: float):
        from afd_cupy.kernels import PinnedInt64

        self.cupy = cupy
        self.kernel = cupy.RawKernel(SPIN_SOURCE, "probe_spin")
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.release_stream = cupy.cuda.Stream(non_blocking=True)
        self.flag = cupy.zeros(1, cupy.int32)
        self.result = cupy.zeros(1, cupy.int32)
        self.started = PinnedInt64(1)
        self.one = PinnedInt64(1)
        self.one.int32[0] = 1
        self.timeout_ns = int(timeout_ms * 1e6)
        self.tag = 0

    def start(self, nap_ns: int) -> None:
        cupy = self.cupy
        self.tag += 1
        cupy.cuda.runtime.memsetAsync(self.flag.data.ptr, 0, 4, self.stream.ptr)
        self.kernel((1,), (32,), (self.flag, np.uint64(self.started.ptr), np.int64(self.tag),
                                  np.uint64(self.timeout_ns), np.uint32(nap_ns), self.result),
                    stream=self.stream)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.started.array[0] != self.tag:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the spinner did not start within {START_TIMEOUT_S} s")

    def release(self) -> int:
        cupy = self.cupy
        cupy.cuda.runtime.memcpyAsync(self.flag.data.ptr, self.one.ptr, 4,
                                      cupy.cuda.runtime.memcpyHostToDevice, self.release_stream.ptr)
        self.release_stream.synchronize()
        self.stream.synchronize()
        return int(self.result.get(stream=self.stream)[0])


def run(args) -> tuple[dict, list]:
    import cupy
    import torch

    from afd_cupy import moe

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    counts_host = routing_counts(args.tokens, args.top_k, args.num_experts, args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    h, i, e = args.hidden, args.intermediate, args.num_experts
    weights = moe.ExpertWeights(
        w13=(torch.randn(e, 2 * i, h, device=device, generator=gen) * h ** -0.5).bfloat16(),
        w2=(torch.randn(e, h, i, device=device, generator=gen) * i ** -0.5).bfloat16(), num_experts=e)
    x = torch.randn(int(counts_host.sum()), h, device=device, generator=gen).bfloat16()
    counts = torch.tensor(counts_host, device=device)
    if not moe.grouped_mm_supported(x, weights):
        raise SystemExit("probe_spin_gemm needs torch._grouped_mm's path (SM90/SM100, bf16, aligned)")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    clock_khz = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"]
    head_start_cycles = int(args.head_start_us * 1e-3 * clock_khz)
    spinner = Spinner(cupy, args.spin_timeout_ms)
    stream = torch.cuda.Stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, kinds, outputs, failures = {}, {}, {}, []
    for name, kind, carveout in settings(args.carveouts):
        kinds[name] = (kind, carveout)
        samples, bad = [], 0
        for it in range(args.warmup + args.iters):
            if kind is not None:
                spinner.start(args.nanosleep_ns if kind == "nanosleep" else 0)
            with torch.cuda.stream(stream), moe.sm_carveout(carveout, device=device):
                if head_start_cycles:  # the stream waits while the host enqueues the pair
                    torch.cuda._sleep(head_start_cycles)
                start.record(stream)
                out = moe.grouped_mlp(x, counts, weights, group_counts_host=counts_host.tolist())
                end.record(stream)
            end.synchronize()
            if kind is not None and spinner.release() != RELEASED:
                bad += 1
            if it >= args.warmup:
                samples.append(start.elapsed_time(end) * 1e3)
        times[name], outputs[name] = samples, out
        if bad:
            failures.append(f"{name}: {bad} spinner(s) ended by their timeout, not by the flag")
    for name, out in outputs.items():
        if not torch.equal(out, outputs[ALONE]):
            diff = float((out.float() - outputs[ALONE].float()).abs().max())
            failures.append(f"{name}: output differs from {ALONE}'s (max |diff| {diff:.4g})")
    info = {"device": torch.cuda.get_device_name(device), "sm_count": sm_count,
            "rows": int(counts_host.sum()), "counts": counts_host.tolist(),
            "nonempty_experts": int((counts_host > 0).sum())}
    return {"info": info, "rows": summarize(times, kinds)}, failures


def main(argv=None) -> int:
    args = parse_args(argv)
    result, failures = run(args)
    info = result["info"]
    report = {"tool": "probe_spin_gemm", "run": bc.run_info("cuda"), "device": info["device"],
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "sm_count": info["sm_count"], "routed_rows": info["rows"], "counts": info["counts"],
              "rows": result["rows"], "check_failures": failures}
    path = bc.write_json(args.out, "probe_spin_gemm.json", report)
    print(f"==== routed grouped GEMM pair (moe.grouped_mlp: {args.num_experts} experts, hidden {args.hidden}, "
          f"intermediate {args.intermediate}, {info['rows']} rows = {args.tokens} tokens x top-{args.top_k}, "
          f"{info['nonempty_experts']} experts hit) next to a one-warp spinner; {info['device']}, "
          f"{info['sm_count']} SMs; CUDA events, {args.iters} iterations ====")
    print(table(result["rows"]))
    for failure in failures:
        print(f"CHECK FAILED: {failure}")
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
