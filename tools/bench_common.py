"""Helpers shared by the benchmark tools (``tools/bench_*.py``): backend detection, the
progress bar, timing, statistics, launch environment, JSON/PNG output and the summary table.

Nothing here starts a process or touches a GPU at import time.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from afd_cupy.launch import detect_backend  # noqa: F401 - re-exported for the tools

#: NVSHMEM's default symmetric heap per PE; windows above it need NVSHMEM_SYMMETRIC_SIZE
NVSHMEM_DEFAULT_HEAP = 1 << 30
_HEAP_SLACK = 512 << 20  # NVSHMEM's own symmetric objects next to our window


def num_visible_gpus() -> int:
    """Visible GPUs without creating a CUDA context in this (parent) process."""
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001
        return 0


def progress(items: Sequence, desc: str, describe: Callable[[object], str] = str) -> Iterable:
    """Iterate ``items`` with a tqdm bar when tqdm is importable, else a plain counter."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(items, desc=desc, unit="run", dynamic_ncols=True)
        for item in bar:
            bar.set_postfix_str(describe(item))
            yield item
        return
    for index, item in enumerate(items, 1):
        print(f"[{desc} {index}/{len(items)}] {describe(item)}", flush=True)
        yield item


def add_common_args(parser, quick_help: str) -> None:
    """The flags every benchmark shares: --quick, --backend, --out, --poll-mode."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--backend", choices=("cuda", "host"), default=None)
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for JSON + PNG")
    parser.add_argument("--poll-mode", choices=("device", "host"), default="device",
                        help="cuda FFN arrival detection (device needs MPS on one GPU)")


def gemm_sm_carveout_arg(text: str):
    """argparse type of ``--gemm-sm-carveout``: ``auto`` (the library's default, see
    ``moe.resolve_gemm_sm_carveout``) or an int >= 0 (0: the GEMMs untouched)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'auto' or an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def launch_env(backend: str, world_size: int, window_bytes: int, *,
               mps_percentage: int | None = None, nccl: bool = False) -> dict:
    """Environment for the launched ranks.

    cuda: ``NVSHMEM_SYMMETRIC_SIZE`` large enough for the window (NVSHMEM's default heap is
    1 GiB per PE), ``NVSHMEM_DISABLE_NCCL=1``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` when
    ``mps_percentage`` is given (several processes on one GPU under MPS), and
    ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off) when the ranks use torch's NCCL (``nccl``).
    """
    if backend != "cuda":
        return {}
    heap = max(NVSHMEM_DEFAULT_HEAP, window_bytes + _HEAP_SLACK)
    child_env = {"NVSHMEM_SYMMETRIC_SIZE": str(heap), "NVSHMEM_DISABLE_NCCL": "1"}
    if mps_percentage is not None:
        child_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(mps_percentage))
    if nccl:
        child_env["NCCL_NVLS_ENABLE"] = "0"
    return child_env


def nccl_unavailable_reason(backend: str, world_size: int) -> str | None:
    """Why ``world_size`` launched ranks cannot run torch NCCL collectives here; None if they can.

    NCCL needs the cuda backend, a torch built with it, and one GPU per process (``launch``
    puts rank r on GPU r only then; NCCL does not support several ranks on one GPU).
    """
    if backend != "cuda":
        return f"the {backend} backend has no GPU transport to compare with"
    try:
        import torch.distributed as dist

        available = dist.is_available() and dist.is_nccl_available()
    except Exception:  # noqa: BLE001
        available = False
    if not available:
        return "this torch has no torch.distributed with NCCL"
    gpus = num_visible_gpus()
    if gpus < world_size:
        return (f"{world_size} processes need one GPU each, {gpus} visible "
                "(NCCL does not support several processes on one GPU)")
    return None


@contextlib.contextmanager
def nccl_process_group(ctx, timeout_s: float):
    """``torch.distributed`` with an NCCL process group of the launched job (every rank of
    ``ctx``'s job enters it), rendezvous through the job's store; destroyed on exit."""
    import torch
    import torch.distributed as dist

    store = dist.PrefixStore(f"{ctx.job_id}/nccl", ctx.store().store)
    dist.init_process_group("nccl", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device("cuda", ctx.device_id))
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def set_device(backend: str, ctx):
    """torch device of a launched rank (sets the current CUDA device on the cuda backend)."""
    import torch

    if backend != "cuda":
        torch.set_num_threads(1)  # every rank is its own process: no oversubscription
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("cuda backend requested but torch sees no CUDA device")
    device_id = ctx.device_id or 0
    torch.cuda.set_device(device_id)
    return torch.device("cuda", device_id)


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


class Stopwatch:
    """Marks on the device's timeline: CUDA events on cuda (device time of the current
    stream), ``perf_counter`` on the CPU. ``elapsed_ms`` synchronizes on the end mark."""

    def __init__(self, device):
        self.is_cuda = device.type == "cuda"

    def mark(self):
        if not self.is_cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        if not self.is_cuda:
            return (end - start) * 1e3
        end.synchronize()
        return float(start.elapsed_time(end))

    def sync(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.synchronize()


class PhaseStopper:
    """When a replica stops its measured batches or steps (bench_afd, bench_decode).

    async: at its own deadline. lockstep: every replica runs the same number of them: replica
    0, at the start of the first one (index i) past its deadline, publishes stop = i + 1
    (nobody can have started i + 1 yet: that needs replica 0's i). Every replica reads the
    flag once per batch or step under both schedules, so both pay the same store round trip.
    """

    def __init__(self, schedule: str, attn_rank: int, store, key: str, duration_s: float, max_count: int):
        self.schedule, self.attn_rank, self.store, self.max_count = schedule, attn_rank, store, max_count
        self.flag_key, self.value_key = f"{key}/stop_flag", f"{key}/stop_at"
        self.deadline = time.monotonic() + duration_s
        self.stop_at: int | None = None

    def should_stop(self, index: int) -> bool:
        if index >= self.max_count:
            return True
        past_deadline = time.monotonic() >= self.deadline
        if self.schedule == "lockstep" and self.attn_rank == 0 and past_deadline and self.stop_at is None:
            self.stop_at = index + 1
            self.store.set(self.value_key, str(self.stop_at).encode())
            self.store.add(self.flag_key, 1)
        published = self.store.add(self.flag_key, 0) >= 1
        if self.schedule == "async":
            return past_deadline
        if self.stop_at is None and published:
            self.stop_at = int(bytes(self.store.get(self.value_key)).decode())
        return self.stop_at is not None and index >= self.stop_at


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def commit() -> str:
    """``AFD_COMMIT`` if set, else ``git rev-parse --short HEAD`` of this checkout."""
    if os.environ.get("AFD_COMMIT"):
        return os.environ["AFD_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except Exception:  # noqa: BLE001 - no git on the machine: still write the report
        return "unknown"


def run_info(backend: str) -> dict:
    """Who, where and what ran (goes into every JSON report)."""
    import torch

    info = {"commit": commit(), "host": socket.gethostname(), "backend": backend,
            "python": platform.python_version(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception:  # noqa: BLE001
        info["cupy"] = None
    return info


def write_json(out_dir: Path, name: str, report: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    return path


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def save_plot(out_dir: Path, name: str, draw: Callable) -> Path | None:
    """Call ``draw(plt)`` and save the current figure as ``out_dir/name``; None (with a
    message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: plot {name} skipped")
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    draw(plt)
    plt.tight_layout()
    plt.savefig(path, dpi=120)
    plt.close("all")
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A plain fixed-width table (floats with 3 significant digits, NaN as '-')."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    is_text = [bool(rows) and all(isinstance(row[i], str) for row in rows) for i in range(len(headers))]

    def justify(text, width, left):
        return text.ljust(width) if left else text.rjust(width)

    line = "  ".join(justify(h, w, t) for h, w, t in zip(headers, widths, is_text)).rstrip()
    out = [line, "-" * len(line)]
    out += ["  ".join(justify(c, w, t) for c, w, t in zip(row, widths, is_text)).rstrip() for row in cells]
    return "\n".join(out)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-2):
            return f"{value:.3g}"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def target_row(name: str, target: str, measured: float | None, unit: str,
               passed: Callable[[float], bool], note: str = "") -> dict:
    """One shared DESIGN.md §10 target next to its measurement: PASS / MISS, or NOT MEASURED.
    Reported, never asserted."""
    if measured is None or (isinstance(measured, float) and math.isnan(measured)):
        status = "NOT MEASURED"
    else:
        status = "PASS" if passed(measured) else "MISS"
    return {"name": name, "target": target, "measured": measured, "unit": unit,
            "status": status, "note": note}


def targets_table(targets: Sequence[dict]) -> str:
    rows = [(t["name"], t["target"], t["measured"], t["unit"], t["status"], t["note"]) for t in targets]
    return format_table(("target (shared DESIGN.md §10)", "goal", "measured", "unit", "status", "note"), rows)


def short_replica_times(replica: int, times: dict) -> dict:
    """The short replica's time under each schedule (``times``: ``{"async": ms, "lockstep": ms,
    "solo": ms}``, any subset) and its async / solo and async / lockstep ratios (None where a
    time is missing or not > 0): the number the short replica's users feel under skew."""
    out = {"replica": replica, **{k: times.get(k) for k in ("async", "lockstep", "solo")}}
    fast = out["async"]
    for other in ("solo", "lockstep"):
        base = out[other]
        ok = fast is not None and base is not None and base > 0 and not math.isnan(base) and not math.isnan(fast)
        out[f"vs_{other}"] = fast / base if ok else None
    return out


def short_replica_line(workload: str, what: str, entry: dict, unit: str = "ms") -> str:
    """One headline line of :func:`short_replica_times`' ``entry``."""
    def show(value):
        return "-" if value is None or math.isnan(value) else f"{value:.3g}"

    return (f"headline {workload}: short replica {entry['replica']} {what} async {show(entry['async'])} / "
            f"lockstep {show(entry['lockstep'])} / solo {show(entry['solo'])} {unit}; async/solo "
            f"{show(entry['vs_solo'])}x, async/lockstep {show(entry['vs_lockstep'])}x")
