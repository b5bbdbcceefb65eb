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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from afd_cupy.runtime.launch import detect_backend  # noqa: F401 - re-exported for the tools

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


def serving_rank(ctx, spec, connector_config, serve_ffn: Callable, serve_attention: Callable) -> dict:
    """One rank of an A Attention + F FFN serving job (bench_afd, bench_decode): its device, its
    connector (``spec``: num_attn, num_ffn, backend, poll_mode, peer_timeout_s, schedule,
    model(); lockstep Attention connectors send always), then ``serve_ffn(conn, spec, ffn_rank,
    device)`` or ``serve_attention(conn, spec, attn_rank, device, store)``; the Attention rank
    announces shutdown, every rank closes its connector."""
    from afd_cupy.config import TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn.worker import attention_connector_kwargs

    is_attn = ctx.rank < spec.num_attn
    device = set_device(spec.backend, ctx)
    if spec.backend == "cuda":
        require_correct_gemms(spec.model(), device)
    role, role_rank = ("attention", ctx.rank) if is_attn else ("ffn", ctx.rank - spec.num_attn)
    extra = attention_connector_kwargs(spec.schedule) if is_attn else {}
    conn = AFDConnector(spec.model(), TopologyConfig(spec.num_attn, spec.num_ffn), connector_config,
                        role=role, role_rank=role_rank, store=ctx.store(), job_id=ctx.job_id,
                        backend=spec.backend, device_id=ctx.device_id, poll_mode=spec.poll_mode,
                        peer_timeout_s=spec.peer_timeout_s, **extra)
    try:
        if not is_attn:
            return serve_ffn(conn, spec, role_rank, device)
        try:
            return serve_attention(conn, spec, role_rank, device, ctx.store())
        finally:
            conn.announce_shutdown()
    finally:
        conn.close()


#: The smallest CUDA MPS SM share (percent) a benchmark rank gets by default: at 45 % and
#: below torch's GEMMs are wrong on one H200 (docs/performance.md, Known issues).
MIN_MPS_SHARE_PCT = 50


class GemmCheckError(RuntimeError):
    """torch's own GEMMs compute wrong results in this process (afd_cupy.testing.gemm_check)."""


def gemm_shapes(model) -> list[tuple[int, int, int]]:
    """(m, n, k) of the dense products a serving rank of ``model`` runs at decode: the
    projections of its hidden size and the expert's gate/up and down products, 64 rows."""
    hidden, inter = model.hidden_size, model.moe_intermediate_size
    return [(64, hidden, hidden), (64, 2 * inter, hidden), (64, hidden, inter)]


def require_correct_gemms(model, device, *, linear=None) -> dict:
    """Check this process's GEMMs at ``model``'s shapes before any number is taken; raise
    GemmCheckError naming the shapes and the MPS share when they are wrong (on one H200 with
    torch 2.11+cu130 they are under an MPS share of 45 % or less). Returns the check's report.
    ``linear``: the product under test (default torch's), for tests."""
    from afd_cupy.testing.gemm_check import check_gemms, describe_failure

    report = check_gemms(gemm_shapes(model), device, dtype=model.dtype, linear=linear)
    if not report["ok"]:
        raise GemmCheckError(describe_failure(report) + "; give every process an MPS share of at least "
                             f"{MIN_MPS_SHARE_PCT} % (--placement GPU:share)")
    return report


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


def solo_rounds(store, key: str, num_attn: int, attn_rank: int, timeout_s: float, solo: Callable[[], dict],
                background_step: Callable[[], object] | None = None,
                more_backgrounds: dict | None = None) -> dict:
    """The solo rounds of bench_afd and bench_decode, on every Attention replica at once.

    Every replica alone in turn, the others at a store barrier: ``solo()`` (one replica's
    measurement, a dict) runs on this replica's turn. With ``background_step`` and more than one
    replica a co-run round follows: ``solo()`` in turn again while the others repeat
    ``background_step()`` (one synchronized step of their own load without the transport) until
    the measuring replica finished. ``more_backgrounds`` (name -> step): one more such round per
    entry, in order, with that step as the others' load. Returns this replica's solo row, its
    co-run row under ``"corun"`` and each further round's row under its name. A background loop
    still running ``timeout_s`` after its round began raises RuntimeError (never hangs)."""
    from afd_cupy.runtime.store import store_barrier

    mine = None
    for turn in range(num_attn):
        store_barrier(store, key, num_attn, timeout_s)
        if turn == attn_rank:
            mine = solo()
    store_barrier(store, key, num_attn, timeout_s)
    rounds = {**({"corun": background_step} if background_step is not None else {}), **(more_backgrounds or {})}
    if num_attn < 2:
        return mine
    for name, step in rounds.items():
        mine[name] = _background_round(store, f"{key}/{name}", num_attn, attn_rank, timeout_s, solo, step)
    return mine


def _background_round(store, key: str, num_attn: int, attn_rank: int, timeout_s: float,
                      solo: Callable[[], dict], step: Callable[[], object]) -> dict:
    """One round of :func:`solo_rounds` with a background load: ``solo()`` on this replica's
    turn, ``step()`` repeated on the others' turns until the measuring replica is done."""
    from afd_cupy.runtime.store import store_barrier

    row = None
    for turn in range(num_attn):
        store_barrier(store, key, num_attn, timeout_s)
        done_key = f"{key}_done/{turn}"
        if turn == attn_rank:
            try:
                row = solo()
            finally:
                store.add(done_key, 1)  # the others stop their background load
            continue
        give_up = time.monotonic() + timeout_s
        while store.add(done_key, 0) < 1:
            if time.monotonic() > give_up:
                raise RuntimeError(f"co-run solo: {done_key} not set within {timeout_s} s")
            step()
    store_barrier(store, key, num_attn, timeout_s)
    return row


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


# --------------------------------------------------------------------------- kernel floors
# A kernel's floor on the GPU that ran it: the cost of one kernel node in a CUDA graph plus the
# bytes it must read and write at the rate a large device-to-device copy reaches, both measured
# in the same run (measure_node_us, measure_copy_gbps). Floors are lower bounds: only the bytes
# the layout says a kernel moves are counted (payload rows, route entries, headers, flags), not
# the plan's scratch or the caches' traffic.

@dataclass(frozen=True)
class KernelBytes:
    """Bytes (read + written) of each kernel of one round trip of one Attention rank to F FFN
    ranks, from the window layout (:meth:`afd_cupy.wire.layout.WindowLayout.message_bytes`).

    - ``dispatch``: the source rows read + every dispatch message written (rows, route entries,
      header, flag); the plan moves no payload.
    - ``stage``: the FFN stage reads each message's header words.
    - ``expand``: pair: the gather copies the arrived rows into the staging rows (read +
      write); dedup: the expand reads the token rows and writes one row per routed partial.
    - ``reply``: the output rows read (pair: routed + shared rows; dedup: the routed partials
      the fused reduce sums) + every reply message written (rows, header, flag).
    - ``combine``: every reply row read + the ``[T, hidden]`` output written.
    """

    dispatch: int
    stage: int
    expand: int
    reply: int
    combine: int

    def as_dict(self) -> dict:
        return asdict(self)


def kernel_bytes(layout, topk_ids, *, num_ffn_ranks: int, has_shared: bool,
                 always_send: bool = False) -> KernelBytes:
    """:class:`KernelBytes` of one dispatch of ``topk_ids`` (int [T, K], host) in
    ``layout.wire_mode``; an FFN rank sent nothing (no rows, no ``always_send``) adds nothing."""
    import numpy as np

    from afd_cupy.routing import dedup

    from afd_cupy.routing import planner

    ids = np.asarray(topk_ids, dtype=np.int64)
    num_tokens, row = ids.shape[0], layout.row_bytes
    routed = np.bincount(ids.reshape(-1) // layout.expert_per_rank, minlength=num_ffn_ranks)
    if layout.is_dedup:
        plan = dedup.plan_dedup(ids.astype(np.int32), num_ffn_ranks, layout.expert_per_rank,
                                has_shared=has_shared)
        sizes = [dict(num_rows=int(plan.num_rows[j])) for j in range(num_ffn_ranks)]
    else:
        sizes = [dict(routed_tokens=int(routed[j]),
                      shared_tokens=planner.shared_count(num_tokens, num_ffn_ranks, j) if has_shared else 0)
                 for j in range(num_ffn_ranks)]
    total = dict(dispatch=0, stage=0, expand=0, reply=0, combine=0)
    for j, size in enumerate(sizes):
        if not any(size.values()) and not always_send:
            continue
        rows = sum(size.values())  # rows on the wire, each direction
        total["dispatch"] += rows * row + layout.message_bytes(reply=False, **size)
        total["stage"] += layout.header_words * 4
        total["expand"] += (rows + int(routed[j])) * row if layout.is_dedup else 2 * rows * row
        reduced = int(routed[j]) if layout.is_dedup else rows
        total["reply"] += reduced * row + layout.message_bytes(reply=True, **size)
        total["combine"] += rows * row
    if any(total.values()):
        total["combine"] += num_tokens * row
    return KernelBytes(**total)


def floor_us(num_bytes: int | None, node_us: float, copy_gbps: float) -> float | None:
    """One kernel node + ``num_bytes`` (read + written) at ``copy_gbps`` (a device copy's read +
    written bytes per ns, i.e. GB/s); None when ``num_bytes`` is None (no floor known)."""
    if num_bytes is None:
        return None
    if not node_us >= 0 or not copy_gbps > 0:
        raise ValueError(f"need node_us >= 0 and copy_gbps > 0, got {node_us}, {copy_gbps}")
    return node_us + num_bytes / (copy_gbps * 1e3)


def floor_row(name: str, time_us: float | None, num_bytes: int | None, node_us: float,
              copy_gbps: float) -> dict:
    """{name, time_us, bytes, floor_us, x_floor}: ``x_floor`` = time / floor (None without a
    time or a floor)."""
    floor = floor_us(num_bytes, node_us, copy_gbps)
    ratio = time_us / floor if time_us is not None and floor else None
    return {"name": name, "time_us": time_us, "bytes": num_bytes, "floor_us": floor, "x_floor": ratio}


def floor_table(rows: Sequence[dict], node_us: float, copy_gbps: float) -> str:
    """The :func:`floor_row` rows as a table, the floor's two measured terms in its title."""
    title = (f"kernel floor = {node_us:.2f} µs per graph node + bytes / {copy_gbps:.0f} GB/s "
             "(a device copy's read + written bytes, same run)")
    body = format_table(("kernel / phase", "time µs", "KB", "floor µs", "time / floor"),
                        [(r["name"], r["time_us"], None if r["bytes"] is None else r["bytes"] / 1e3,
                          r["floor_us"], r["x_floor"]) for r in rows])
    return title + "\n" + body


def measure_copy_gbps(device, num_bytes: int = 1 << 28, iters: int = 20) -> float:
    """Read + written bytes per ns (GB/s) of a ``num_bytes`` device-to-device copy on ``device``
    (cuda), median of ``iters`` after one warm-up, CUDA events."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    watch, times_ms = Stopwatch(device), []
    for i in range(iters + 1):
        start = watch.mark()
        dst.copy_(src)
        elapsed = watch.elapsed_ms(start, watch.mark())
        if i:
            times_ms.append(elapsed)
    return 2 * num_bytes / (median(times_ms) * 1e6)


def measure_node_us(launch_node: Callable[[int], None], device, num_nodes: int = 64,
                    replays: int = 50) -> float:
    """µs per kernel node of a CUDA graph on ``device``: ``launch_node(stream_ptr)`` enqueues one
    (near-)empty kernel; graphs of 1 and ``num_nodes`` such nodes are captured and replayed
    ``replays`` times each between CUDA events; the median difference / (num_nodes - 1)."""
    import torch

    def replay_ms(count: int) -> float:
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            launch_node(stream.cuda_stream)  # warm-up outside the capture
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(count):
                    launch_node(stream.cuda_stream)
        watch, times = Stopwatch(device), []
        for i in range(replays + 1):
            start = watch.mark()
            graph.replay()
            elapsed = watch.elapsed_ms(start, watch.mark())
            if i:
                times.append(elapsed)
        return median(times)

    return max(0.0, (replay_ms(num_nodes) - replay_ms(1)) * 1e3 / (num_nodes - 1))
