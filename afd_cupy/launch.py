"""The one launch helper shared by tests and tools: run ``fn(ctx, *args)`` in local processes.

The parent process starts a TCPStore master on a free port (or joins a store given as
``store_addr``, for a job whose ranks several launchers start: one launch per node, each
running a contiguous block of world ranks), spawns ``nprocs`` children
("spawn" start method: no inherited CUDA state), places them on GPUs, collects their
results in rank order and turns any failure (exception, crash, timeout) into a
:class:`LaunchError` carrying every failing rank's story. Cleanup always runs: children are
terminated and joined, the store is dropped and the job's shared-memory segments unlinked.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
import uuid
from typing import Any, Callable

from afd_cupy import env as env_mod
from afd_cupy.env import THREAD_POOL_VARS  # noqa: F401 - re-exported (tests, tools)
from afd_cupy.errors import AfdError
from afd_cupy.heap.host import cleanup_job_segments
from afd_cupy.store import NamespacedStore, Store, create_store, free_port

logger = logging.getLogger("afd_cupy")

STORE_HOST = "127.0.0.1"
_PORT_ATTEMPTS = 8
_TERMINATE_GRACE_S = 2.0
_FAILURE_GRACE_S = 1.0  # after a first failure, time to collect the other ranks' reports
_POLL_S = 0.05


class LaunchError(AfdError):
    """A launched process failed, died or timed out.

    ``failures`` maps rank -> explanation (traceback text, exit code, or "did not finish").
    """

    def __init__(self, message: str, *, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = failures or {}


def device_for_rank(rank: int, nprocs: int, num_gpus: int) -> int | None:
    """GPU of ``rank``: None without GPUs, GPU ``rank`` when there is one per process,
    otherwise GPU 0 for everyone (several processes sharing one GPU)."""
    if num_gpus == 0:
        return None
    return rank if num_gpus >= nprocs else 0


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one rank runs: ``gpu`` (None: the default of :func:`device_for_rank`) and its
    CUDA MPS SM share ``sm_percent`` (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``; None: no limit)."""

    gpu: int | None = None
    sm_percent: int | None = None

    def __post_init__(self):
        if self.gpu is not None and self.gpu < 0:
            raise ValueError(f"placement gpu must be >= 0, got {self.gpu}")
        if self.sm_percent is not None and not 1 <= self.sm_percent <= 100:
            raise ValueError(f"placement sm_percent must be in [1, 100], got {self.sm_percent}")

    def __str__(self) -> str:
        where = "default GPU" if self.gpu is None else f"GPU {self.gpu}"
        return where + ("" if self.sm_percent is None else f" at {self.sm_percent}% of its SMs")


def parse_placement(text: str, nprocs: int) -> list[Placement]:
    """``"0:50,0:50,1"`` -> one Placement per rank (``GPU[:SM percent]``, comma separated).

    A single entry applies to every rank. Raises ValueError naming the bad entry."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if len(entries) == 1:
        entries = entries * nprocs
    if len(entries) != nprocs:
        raise ValueError(f"placement {text!r} has {len(entries)} entries for {nprocs} ranks")
    placements = []
    for entry in entries:
        gpu, _, pct = entry.partition(":")
        try:
            placements.append(Placement(int(gpu) if gpu else None, int(pct) if pct else None))
        except ValueError as exc:
            raise ValueError(f"placement entry {entry!r}: expected GPU[:SM percent] ({exc})") from None
    return placements


@dataclasses.dataclass(frozen=True)
class ProcessContext:
    """What a launched process knows about its job. Picklable; passed as ``fn``'s first arg."""

    rank: int
    world_size: int
    job_id: str
    store_host: str
    store_port: int
    device_id: int | None
    store_timeout_s: float = 120.0
    sm_percent: int | None = None  # this rank's MPS SM share, when the launch placed it

    #: environment variables of :meth:`from_env` (a rank started by another launcher)
    ENV_VARS = ("AFD_STORE_ADDR", "AFD_WORLD_SIZE", "AFD_RANK", "AFD_JOB_ID", "AFD_DEVICE")

    @classmethod
    def from_env(cls, environ=None, *, store_timeout_s: float = 120.0) -> "ProcessContext":
        """The context of a rank started by another launcher (torchrun, SLURM, k8s...):
        ``AFD_STORE_ADDR`` (``host:port`` of a TCPStore master the job shares),
        ``AFD_WORLD_SIZE``, ``AFD_RANK`` (world rank: Attention ranks first), ``AFD_JOB_ID``
        (the same on every rank) and optionally ``AFD_DEVICE`` (CUDA device index).
        Raises ValueError naming a missing or malformed variable."""
        environ = os.environ if environ is None else environ
        missing = [name for name in cls.ENV_VARS[:4] if not environ.get(name)]
        if missing:
            raise ValueError(f"{', '.join(missing)} not set (a rank started outside afd_cupy.launch "
                             f"needs {', '.join(cls.ENV_VARS[:4])})")
        host, _, port = environ["AFD_STORE_ADDR"].rpartition(":")
        try:
            port_number, world_size, rank = int(port), int(environ["AFD_WORLD_SIZE"]), int(environ["AFD_RANK"])
            device = int(environ["AFD_DEVICE"]) if environ.get("AFD_DEVICE") else None
        except ValueError as err:
            raise ValueError(f"malformed AFD_* variable: {err} (AFD_STORE_ADDR must be host:port; "
                             f"AFD_WORLD_SIZE, AFD_RANK, AFD_DEVICE integers)") from None
        if not host or not 0 <= rank < world_size:
            raise ValueError(f"AFD_STORE_ADDR={environ['AFD_STORE_ADDR']!r}, AFD_RANK={rank}, "
                             f"AFD_WORLD_SIZE={world_size}: need host:port and 0 <= rank < world size")
        return cls(rank, world_size, environ["AFD_JOB_ID"], host, port_number, device, store_timeout_s)

    def store(self) -> NamespacedStore:
        """This process's client of the job's store, namespaced by ``job_id``.

        Connected on the first call and reused afterwards, so every caller in the process
        shares one object (barrier generations are counted per store object, see
        :func:`afd_cupy.store.store_barrier`).
        """
        key = (self.store_host, self.store_port, self.job_id)
        if key not in _client_stores:
            client = create_store(self.store_host, self.store_port, self.world_size,
                                  is_master=False, timeout_s=self.store_timeout_s)
            _client_stores[key] = NamespacedStore(client, self.job_id)
        return _client_stores[key]


# The store client of each job this process belongs to (see ProcessContext.store).
_client_stores: dict[tuple[str, int, str], NamespacedStore] = {}


def _detect_num_gpus() -> int:
    """Visible CUDA devices, 0 when torch/CUDA is unavailable.

    NOTE: ``torch.cuda.device_count`` queries NVML where it can and does not create a CUDA
    context; children are spawned, so nothing CUDA-related is inherited anyway.
    """
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - any failure means "no usable GPU"
        return 0


def detect_backend() -> str:
    """Backend for a local job: ``AFD_BACKEND`` if set, else ``cuda`` when a GPU, CuPy and the
    NVSHMEM library are all present, else ``host``."""
    from afd_cupy import env

    override = env.backend_override()
    if override:
        return override
    if _detect_num_gpus() == 0:
        return "host"
    try:
        import cupy  # noqa: F401

        from afd_cupy.heap.nvshmem_lib import find_library
    except Exception:  # noqa: BLE001 - no usable CuPy: the host backend
        return "host"
    return "cuda" if find_library() else "host"


def _child_main(rank: int, fn_args_blob: bytes, ctx: ProcessContext, env: dict[str, str],
                results: Any) -> None:
    """Entry point of a child: set ``env``, then unpickle and run ``fn``; report to parent."""
    os.environ.update(env)
    try:
        # Unpickled only now so that env (CUDA_VISIBLE_DEVICES, MPS, thread pools...) is set
        # before any import that fn's module triggers.
        fn, args = pickle.loads(fn_args_blob)
        _apply_torch_threads()
        payload = pickle.dumps(fn(ctx, *args))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, payload))


def _apply_torch_threads() -> None:
    """torch imported by fn's module has read ``OMP_NUM_THREADS`` already; set it explicitly
    anyway (a torch build that ignores the variable still gets the count). A torch imported
    later reads the variable itself."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) >= 1:
        torch.set_num_threads(int(value))


def _start_store(nprocs: int, timeout_s: float) -> tuple[Store, int]:
    """Start the store master on a free port, retrying when another process took the port."""
    last_error: Exception | None = None
    for _ in range(_PORT_ATTEMPTS):
        port = free_port()
        try:
            return create_store(STORE_HOST, port, nprocs, is_master=True,
                                timeout_s=timeout_s), port
        except Exception as err:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError
            last_error = err
            logger.debug("store master on port %d failed (%s); retrying", port, err)
    raise LaunchError(f"could not start the store master after {_PORT_ATTEMPTS} attempts: "
                      f"{last_error}")


class _Job:
    """Bookkeeping of one launch: children, reports, failures."""

    def __init__(self, nprocs: int, processes: list, results: Any, expected_deaths=()):
        self.nprocs = nprocs
        self.processes = processes
        self.results = results
        self.expected_deaths = frozenset(expected_deaths)
        self.values: dict[int, Any] = {}
        self.failures: dict[int, str] = {}

    def pending(self) -> list[int]:
        return [r for r in range(self.nprocs) if r not in self.values and r not in self.failures]

    def drain(self, timeout_s: float) -> None:
        """Collect the reports that arrive within ``timeout_s`` (returns after the first)."""
        try:
            self._record(*self.results.get(timeout=timeout_s))
            while True:
                self._record(*self.results.get_nowait())
        except queue.Empty:
            return

    def _record(self, rank: int, ok: bool, payload) -> None:
        if ok:
            self.values[rank] = pickle.loads(payload)
        else:
            self.failures[rank] = f"rank {rank} raised:\n{payload}"

    def note_silent_deaths(self) -> None:
        """Ranks whose process ended without a report: drain once more, then record them."""
        dead = [r for r in self.pending() if self.processes[r].exitcode is not None]
        if not dead:
            return
        self.drain(0.5)  # a report written just before exit may still be in the pipe
        for rank in dead:
            if rank in self.pending():
                code = self.processes[rank].exitcode
                if rank in self.expected_deaths:
                    self.values[rank] = DiedAsExpected(rank, code)
                else:
                    self.failures[rank] = f"rank {rank} died without reporting (exit code {code})"


def _wait(job: _Job, timeout_s: float) -> None:
    """Wait for every rank, stopping shortly after the first failure or at the timeout."""
    deadline = time.monotonic() + timeout_s
    failure_deadline = None
    while job.pending():
        now = time.monotonic()
        if now >= deadline:
            for rank in job.pending():
                job.failures[rank] = f"rank {rank} did not finish within {timeout_s:.1f} s"
            return
        if job.failures and failure_deadline is None:
            failure_deadline = now + _FAILURE_GRACE_S
        if failure_deadline is not None and now >= failure_deadline:
            return
        job.drain(min(_POLL_S, deadline - now))
        job.note_silent_deaths()


def _failure_message(job: _Job, job_id: str) -> str:
    lines = [f"launch of {job.nprocs} processes (job {job_id}) failed on ranks "
             f"{sorted(job.failures)}"]
    for rank in sorted(job.failures):
        lines.append(f"--- {job.failures[rank]}")
    unfinished = job.pending()
    if unfinished:
        lines.append(f"--- ranks {unfinished} were terminated before finishing")
    return "\n".join(lines)


def _stop_all(processes: list) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def thread_limits(nprocs: int, threads_per_process: int | None = None) -> dict[str, str]:
    """The thread-pool variables (:data:`afd_cupy.env.THREAD_POOL_VARS`) each of ``nprocs``
    local children gets: all of them at ``threads_per_process`` when given, else at an equal
    share of this process's cores (:func:`afd_cupy.env.thread_share`) for each variable the
    caller's environment does not set.

    Every process of a local job would otherwise size torch's, OpenMP's and numba's pools to
    all cores of the machine; ``nprocs`` such processes oversubscribe it (and OpenMP workers
    spin between parallel regions), which made a 2-process main job on a 16-core machine burn
    25 CPU-minutes in under a minute of wall time.
    """
    if threads_per_process is not None:
        return env_mod.thread_env(threads_per_process, environ={})  # validates: int >= 1
    return env_mod.thread_env(env_mod.thread_share(nprocs))


@dataclasses.dataclass(frozen=True)
class DiedAsExpected:
    """The result of a rank named in ``launch(expected_deaths=...)`` that died unreported."""

    rank: int
    exit_code: int


def launch(fn: Callable, nprocs: int, *, args: tuple = (), timeout_s: float = 120.0,
           num_gpus: int | None = None, env: dict[str, str] | None = None,
           job_id: str | None = None, expected_deaths=(),
           placement: "list[Placement] | None" = None, world_size: int | None = None,
           first_rank: int = 0, store_addr: "tuple[str, int] | None" = None,
           threads_per_process: int | None = None) -> list:
    """Run ``fn(ctx, *args)`` in ``nprocs`` spawned processes; return results by rank.

    One node of a larger job: ``world_size`` (default ``nprocs``) ranks in all, this launch
    running world ranks ``first_rank .. first_rank + nprocs - 1`` and joining the TCPStore
    master at ``store_addr`` (host, port) that every node's launch shares (``job_id``
    must then be given, the same on every node). Without ``store_addr`` the launch starts
    its own master and must run the whole job. Results (and ``expected_deaths``) are by
    local index; GPUs are placed by local index too.

    ``fn``, ``args`` and results must be picklable (``fn`` a top-level function). ``env``
    entries are set in each child before ``fn`` (and its module) are loaded. ``num_gpus``
    None detects the visible GPUs; placement follows :func:`device_for_rank`. ``job_id``
    (default: random) namespaces store keys and shared-memory segments. Thread pools: each
    child's OpenMP/MKL/OpenBLAS/numba variables and torch's intra-op pool get an equal share
    of this process's cores (``os.sched_getaffinity`` // ``nprocs``, at least 1) unless set;
    precedence, highest first: ``env``, ``threads_per_process`` (every pool of every child),
    the caller's environment (per variable), the share (:func:`thread_limits`).
    ``placement`` (one :class:`Placement` per rank) puts each rank on a GPU and gives it an
    MPS SM share (start MPS first for shares to apply). Ranks in ``expected_deaths`` may die
    without reporting (fault-injection tests): their result is a :class:`DiedAsExpected`,
    and the other ranks run on to their own end.

    Raises LaunchError when any rank raises (with every failing rank's traceback), dies
    without reporting (with its exit code) or does not finish within ``timeout_s``.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if placement is not None and len(placement) != nprocs:
        raise ValueError(f"placement has {len(placement)} entries for {nprocs} ranks")
    world_size = nprocs if world_size is None else world_size
    if not 0 <= first_rank or first_rank + nprocs > world_size:
        raise ValueError(f"ranks {first_rank}..{first_rank + nprocs - 1} do not fit a world of "
                         f"{world_size}")
    if (world_size != nprocs or first_rank) and (store_addr is None or job_id is None):
        raise ValueError("a launch running part of a job (world_size != nprocs) needs the shared "
                         "store_addr=(host, port) and the job_id every node uses")
    job_id = job_id or uuid.uuid4().hex[:12]
    num_gpus = _detect_num_gpus() if num_gpus is None else num_gpus
    fn_args_blob = pickle.dumps((fn, tuple(args)))
    child_env = {**thread_limits(nprocs, threads_per_process),
                 **{str(k): str(v) for k, v in (env or {}).items()}}
    # OpenMP workers (torch's CPU ops) otherwise spin between parallel regions and burn the
    # cores a rank's GPU work does not need; the caller's or env='s setting wins
    if not os.environ.get("OMP_WAIT_POLICY"):
        child_env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    processes: list = []
    store = None
    try:
        if store_addr is None:
            store, port = _start_store(nprocs, timeout_s)
            host = STORE_HOST
        else:
            host, port = store_addr
        for rank in range(nprocs):
            where = placement[rank] if placement is not None else Placement()
            device = device_for_rank(rank, nprocs, num_gpus) if where.gpu is None else where.gpu
            rank_env = dict(child_env)
            if where.sm_percent is not None:
                rank_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(where.sm_percent)
            ctx = ProcessContext(first_rank + rank, world_size, job_id, host, port, device,
                                 timeout_s, where.sm_percent)
            proc = spawn.Process(target=_child_main, name=f"afd-{job_id}-rank{rank}",
                                 args=(rank, fn_args_blob, ctx, rank_env, results))
            proc.start()
            processes.append(proc)
        job = _Job(nprocs, processes, results, expected_deaths)
        _wait(job, timeout_s)
        if job.failures:
            raise LaunchError(_failure_message(job, job_id), failures=job.failures)
        return [job.values[rank] for rank in range(nprocs)]
    finally:
        _stop_all(processes)
        results.close()
        results.join_thread()
        del store  # the master stops serving when dropped
        cleanup_job_segments(job_id)
