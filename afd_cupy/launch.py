"""The one launch helper shared by tests and tools: run ``fn(ctx, *args)`` in local processes.

The parent process serves the job's store (a :class:`~afd_cupy.kvstore.KVServer` on a free
port: no torch in the parent; or joins a TCPStore given as ``store_addr``, for a job whose
ranks several launchers start: one launch per node, each running a contiguous block of world
ranks), spawns ``nprocs`` children
("spawn" start method: no inherited CUDA state), places them on GPUs, collects their
results in rank order and turns any failure (exception, crash, timeout) into a
:class:`LaunchError` carrying every failing rank's story. Cleanup always runs: children are
terminated and joined, the store is dropped and the job's shared-memory segments unlinked.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import logging
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from typing import Any, Callable

from afd_cupy import env as env_mod
from afd_cupy import rendezvous
from afd_cupy.env import IDLE_POOL_DEFAULTS, THREAD_POOL_VARS  # noqa: F401 - re-exported
from afd_cupy.errors import AfdError, ConfigError
from afd_cupy.heap.host import cleanup_job_segments
from afd_cupy.kvstore import KVServer
from afd_cupy.store import NamespacedStore, Store, bound_listener, connect_store, create_store

logger = logging.getLogger("afd_cupy")

STORE_HOST = "127.0.0.1"
_TERMINATE_GRACE_S = 2.0
_FAILURE_GRACE_S = 1.0  # after a first failure, time to collect the other ranks' reports
_DONE_GRACE_S = 5.0  # least time a store host waits for the other launches' ranks to finish
_POLL_S = 0.05
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # None where there is no SIGUSR1 (Windows)
_STACK_WAIT_S = 2.0  # how long a hung rank gets to write its stacks after the signal
_STACK_MAX_CHARS = 8000  # of each rank's dump kept in the failure text (innermost frames first)
_stack_file = None  # the child's open dump file (faulthandler writes to its descriptor)


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
    #: what serves the store: "torch" (a ``torch.distributed.TCPStore`` master) or "afd"
    #: (the :class:`~afd_cupy.kvstore.KVServer` a launch hosts for a job it runs alone)
    store_kind: str = "torch"

    def __post_init__(self):
        if self.store_kind not in ("torch", "afd"):
            raise ValueError(f"store_kind must be 'torch' or 'afd', got {self.store_kind!r}")

    @classmethod
    def from_env(cls, environ=None, *, store_timeout_s: float = 120.0) -> "ProcessContext":
        """The context of a rank started by another launcher (torchrun, SLURM, k8s...), from
        ``AFD_STORE_ADDR`` (``host:port`` of a TCPStore master the job shares),
        ``AFD_WORLD_SIZE``, ``AFD_RANK`` (world rank: Attention ranks first), ``AFD_JOB_ID``
        (the same on every rank) and optionally ``AFD_DEVICE`` (read by
        :func:`afd_cupy.env.rank_settings`). Connects nothing: call :meth:`join` next.
        Raises ValueError naming a missing or malformed variable."""
        from afd_cupy import env

        settings = env.rank_settings(environ)
        return cls(settings["rank"], settings["world_size"], settings["job_id"],
                   settings["store_host"], settings["store_port"], settings["device_id"],
                   store_timeout_s)

    def role(self, topology) -> tuple:
        """``(Role, role_rank)`` of this rank in ``topology`` (a ``TopologyConfig``): world
        ranks ``0 .. A-1`` are Attention, ``A .. A+F-1`` FFN. Raises ConfigError when the
        topology's world size is not this job's."""
        from afd_cupy.topology import Role

        num_attn, num_ffn = topology.num_attn_ranks, topology.num_ffn_ranks
        if num_attn + num_ffn != self.world_size:
            raise ConfigError(f"topology of {num_attn} Attention + {num_ffn} FFN ranks does not "
                              f"match job {self.job_id}'s world_size={self.world_size}")
        return (Role.ATTENTION, self.rank) if self.rank < num_attn else (Role.FFN, self.rank - num_attn)

    def join(self, *, host_store: bool = False, startup_timeout_s: float = 120.0) -> "ProcessContext":
        """For a rank another launcher started: join the job's launch rendezvous
        (:mod:`afd_cupy.rendezvous`) and return once every world rank joined. With
        ``host_store=True`` this process starts the store master at its address (exactly one
        process of the job does, and must call :meth:`close` last so that the store outlives
        every rank). Host-blocking. Raises ConfigError for a rank joined twice or a world-size
        disagreement, PeerTimeoutError naming the missing world ranks (``missing_ranks``)
        when the master does not answer or the job is incomplete within ``startup_timeout_s``.
        """
        key = (self.store_host, self.store_port)
        try:
            if host_store:
                _hosted_masters[key] = _start_store(self.world_size, self.store_timeout_s,
                                                    self.store_host, self.store_port)
            else:
                rendezvous.wait_for_master(self.store_host, self.store_port, startup_timeout_s,
                                           job_id=self.job_id, world_size=self.world_size,
                                           here=[self.rank])
            rendezvous.join(self.store(), [self.rank], self.world_size, self.job_id)
            rendezvous.Rendezvous(self.store(), self.world_size, self.job_id, startup_timeout_s,
                                  [self.rank], f"by pid {os.getpid()}").wait()
        except BaseException:
            _client_stores.pop((*key, self.job_id), None)
            _hosted_masters.pop(key, None)
            raise
        return self

    def close(self, timeout_s: float | None = None) -> None:
        """For a :meth:`join`-ed rank: mark it done; in the process hosting the store master
        also wait, bounded by ``timeout_s`` (default ``store_timeout_s``), until every rank is
        done, then stop serving. Call it last, after the connector's ``close()``. Idempotent;
        never raises (the launchers do this themselves for the ranks they start)."""
        key = (self.store_host, self.store_port, self.job_id)
        try:
            rendezvous.mark_done(self.store(), [self.rank])
        except Exception as exc:  # noqa: BLE001 - the store may already be gone
            logger.debug("rank %d could not mark itself done: %s", self.rank, exc)
        master = _hosted_masters.pop((self.store_host, self.store_port), None)
        if master is not None and key in _client_stores:
            rendezvous.await_done(_client_stores[key], self.world_size,
                                  self.store_timeout_s if timeout_s is None else timeout_s, self.job_id)
        _client_stores.pop(key, None)
        del master  # a hosted master stops serving when dropped

    def store(self) -> NamespacedStore:
        """This process's client of the job's store, namespaced by ``job_id``.

        Connected on the first call and reused afterwards, so every caller in the process
        shares one object (barrier generations are counted per store object, see
        :func:`afd_cupy.store.store_barrier`).
        """
        key = (self.store_host, self.store_port, self.job_id)
        if key not in _client_stores:
            client = connect_store(self.store_kind, self.store_host, self.store_port,
                                   self.world_size, self.store_timeout_s)
            _client_stores[key] = NamespacedStore(client, self.job_id)
        return _client_stores[key]


# The store client of each job this process belongs to (see ProcessContext.store).
_client_stores: dict[tuple[str, int, str], NamespacedStore] = {}
# Store masters hosted by ProcessContext.join(host_store=True), until ProcessContext.close.
_hosted_masters: dict[tuple[str, int], Store] = {}


def connect(store_addr, *, rank: int, world_size: int, job_id: str, device_id: int | None = None,
            host_store: bool = False, startup_timeout_s: float = 120.0,
            store_timeout_s: float = 120.0) -> ProcessContext:
    """The joined :class:`ProcessContext` of a rank another launcher started:
    ``ProcessContext(...).join(...)`` with ``store_addr`` as ``"host:port"`` or
    ``(host, port)``. Raises as :meth:`ProcessContext.join`; ConfigError for a bad address,
    job id, rank or world size."""
    host, port = env_mod.parse_store_addr(store_addr)
    _check_job(job_id, world_size, first_rank=rank, nprocs=1)
    ctx = ProcessContext(rank, world_size, job_id, host, port, device_id, store_timeout_s)
    return ctx.join(host_store=host_store, startup_timeout_s=startup_timeout_s)


def _check_job(job_id, world_size, *, first_rank: int, nprocs: int) -> None:
    """ConfigError for a job id that is not a plain non-empty string, a world size below 1 or
    ranks ``first_rank .. first_rank + nprocs - 1`` outside ``[0, world_size)``."""
    if not isinstance(job_id, str) or not job_id.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"job_id must be a non-empty string of letters, digits, '-' and '_', "
                          f"got {job_id!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(first_rank, bool) or not isinstance(first_rank, int) \
            or not 0 <= first_rank or first_rank + nprocs > world_size:
        raise ConfigError(f"ranks {first_rank}..{first_rank + nprocs - 1} do not fit a world of "
                          f"{world_size}")


def _detect_num_gpus() -> int:
    """Visible CUDA devices, 0 when there is no usable GPU.

    Asks NVML through ctypes (milliseconds, no CUDA context) and applies
    ``CUDA_VISIBLE_DEVICES``; 0 without an NVIDIA driver (no ``/dev/nvidiactl``); only on a
    driver host where NVML cannot be loaded, ``torch.cuda.device_count`` (importing torch
    costs a launcher 2-4 s before its children even start). Children are
    spawned, so nothing CUDA-related is inherited either way.
    """
    count = _nvml_device_count()
    if count is not None:
        return visible_gpu_count(count, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver on this machine at all
        return 0
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - any failure means "no usable GPU"
        return 0


def _nvml_device_count() -> int | None:
    """GPUs NVML sees (all of them, ``CUDA_VISIBLE_DEVICES`` not applied), or None when NVML
    (the driver's ``libnvidia-ml.so.1``) cannot be loaded or initialized."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        return int(count.value) if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
    finally:
        nvml.nvmlShutdown()


def visible_gpu_count(num_devices: int, cuda_visible_devices: str | None) -> int:
    """GPUs a CUDA process sees among ``num_devices`` under ``CUDA_VISIBLE_DEVICES``: unset,
    all of them; else its comma-separated entries up to the first invalid one (an index
    outside ``[0, num_devices)`` or a repeat; ``GPU-``/``MIG-`` UUIDs count as valid), as the
    CUDA runtime reads it."""
    if cuda_visible_devices is None:
        return num_devices
    seen: set = set()
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            key = entry
        else:
            try:
                key = int(entry)
            except ValueError:
                break
            if not 0 <= key < num_devices:
                break
        if key in seen:
            break
        seen.add(key)
    return min(len(seen), num_devices)


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
                results: Any, stack_path: str | None = None) -> None:
    """Entry point of a child: set ``env``, then unpickle and run ``fn``; report to parent.
    ``stack_path``: where the Python stacks of every thread go when the parent sends
    SIGUSR1 (a rank that does not finish in time; :func:`_collect_stacks`)."""
    global _stack_file
    os.environ.update(env)
    if stack_path is not None and _STACK_SIGNAL is not None:
        _stack_file = open(stack_path, "w")  # noqa: SIM115 - open for the process's life
        faulthandler.register(_STACK_SIGNAL, file=_stack_file, all_threads=True)
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


def _start_store(world_size: int, timeout_s: float, host: str, port: int) -> Store:
    """Start a TCPStore master at ``host:port`` (a job several launchers start). Raises
    LaunchError when it cannot start."""
    try:
        return create_store(host, port, world_size, is_master=True, timeout_s=timeout_s)
    except Exception as err:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError
        raise LaunchError(f"could not start the store master at {host}:{port}: {err}") from err


def _serve_own_store(host: str) -> KVServer:
    """The store of a job this launch runs alone: a KVServer on a free port of ``host``.
    Raises LaunchError when it cannot listen."""
    try:
        return KVServer(bound_listener(host))
    except OSError as err:
        raise LaunchError(f"could not listen for the job's store on {host}: {err}") from err


class _Job:
    """Bookkeeping of one launch: children, reports, failures."""

    def __init__(self, nprocs: int, processes: list, results: Any, expected_deaths=()):
        self.nprocs = nprocs
        self.processes = processes
        self.results = results
        self.expected_deaths = frozenset(expected_deaths)
        self.values: dict[int, Any] = {}
        self.failures: dict[int, str] = {}
        self.timed_out: list[int] = []  # ranks still running at the deadline

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


def _wait(job: _Job, deadline: float, timeout_s: float,
          joining: "rendezvous.Rendezvous | None" = None) -> None:
    """Wait for every rank, stopping shortly after the first failure or at ``deadline``
    (``time.monotonic()``; the job's ``timeout_s`` is what a rank that misses it is told).

    Until ``joining`` is complete (every world rank of the job joined) its deadline applies
    too: past it, its PeerTimeoutError naming the missing world ranks is raised, unless a
    local rank failed first (then that failure is reported as usual)."""
    failure_deadline = None
    while job.pending():
        now = time.monotonic()
        if now >= deadline:
            job.timed_out = job.pending()
            for rank in job.timed_out:
                job.failures[rank] = f"rank {rank} did not finish within {timeout_s:.1f} s"
            return
        if job.failures and failure_deadline is None:
            failure_deadline = now + _FAILURE_GRACE_S
        if failure_deadline is not None and now >= failure_deadline:
            return
        if joining is not None and failure_deadline is None and now >= joining.deadline \
                and not joining.poll():
            raise joining.error()
        job.drain(min(_POLL_S, deadline - now))
        job.note_silent_deaths()


def _collect_stacks(job: _Job, stack_paths: list) -> None:
    """Append the Python stacks of every thread of each rank that timed out to its failure
    text: signal the live ones (faulthandler, registered by :func:`_child_main`), wait until
    each dump stops growing (at most ``_STACK_WAIT_S``), keep its first ``_STACK_MAX_CHARS``.
    A rank blocked in C (a CUDA synchronize, a lock) is dumped too: faulthandler writes from
    the signal handler without the GIL."""
    if _STACK_SIGNAL is None:
        return
    hung = []
    for rank in job.timed_out:
        if not job.processes[rank].is_alive():
            continue
        try:
            os.kill(job.processes[rank].pid, _STACK_SIGNAL)
        except OSError:  # it exited just now
            continue
        hung.append(rank)
    sizes: dict[int, int] = {}
    settled: set[int] = set()
    deadline = time.monotonic() + _STACK_WAIT_S
    while len(settled) < len(hung) and time.monotonic() < deadline:
        time.sleep(2 * _POLL_S)
        for rank in hung:
            size = _file_size(stack_paths[rank])
            if size > 0 and sizes.get(rank) == size:
                settled.add(rank)
            sizes[rank] = size
    for rank in hung:
        text = _read_text(stack_paths[rank])
        if len(text) > _STACK_MAX_CHARS:
            text = text[:_STACK_MAX_CHARS] + "\n..."
        job.failures[rank] += (f"; the Python stacks of its threads then:\n{text.rstrip()}" if text.strip()
                               else "; it wrote no stack dump on SIGUSR1")


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as dump:
            return dump.read()
    except OSError:
        return ""


def _failure_message(job: _Job, job_id: str) -> str:
    lines = [f"launch of {job.nprocs} processes (job {job_id}) failed on ranks "
             f"{sorted(job.failures)}"]
    for rank in sorted(job.failures):
        lines.append(f"--- {job.failures[rank]}")
    unfinished = job.pending()
    if unfinished:
        lines.append(f"--- ranks {unfinished} were terminated before finishing")
    return "\n".join(lines)


def _stop_all(processes: list, exit_grace_s: float = 0.0) -> None:
    """Give the children ``exit_grace_s`` to exit on their own (after a clean run a rank
    that reported still tears its interpreter and libraries down: atexit handlers, CUDA),
    then terminate the rest, and kill the ones that ignore it within ``_TERMINATE_GRACE_S``."""
    deadline = time.monotonic() + exit_grace_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
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
           first_rank: int = 0, store_addr=None, host_store: bool = False,
           startup_timeout_s: float | None = None, threads_per_process: int | None = None,
           exit_grace_s: float = 0.0) -> list:
    """Run ``fn(ctx, *args)`` in ``nprocs`` spawned processes; return results by rank.

    One node of a larger job: ``world_size`` (default ``nprocs``) ranks in all, this launch
    running world ranks ``first_rank .. first_rank + nprocs - 1`` and meeting the other
    launches at the TCPStore master at ``store_addr`` (``"host:port"`` or ``(host, port)``,
    reachable from every node; ``job_id`` must then be given, the same on every node and new
    for every run). Exactly one launch of such a job either passes ``host_store=True`` (it
    starts the master there and keeps it until every rank of the job is done, bounded by
    ``timeout_s``) or the master is started by something else that outlives the job. Every
    launch waits, bounded by ``startup_timeout_s`` (default ``timeout_s``), until all world
    ranks joined (:mod:`afd_cupy.rendezvous`): a launch that never starts is a
    PeerTimeoutError naming the missing world ranks, overlapping rank blocks or different
    world sizes a ConfigError. Each launch unlinks only its own ranks' leftover shared-memory
    segments. Without ``store_addr`` the launch starts its own master on a free port and must
    run the whole job. Results (and ``expected_deaths``) are by local index; GPUs are placed by
    local index too.

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
    and the other ranks run on to their own end. ``exit_grace_s``: after a clean run, how long
    the ranks may take to exit on their own (interpreter and library teardown: atexit
    handlers, CUDA removing its per-process ``/dev/shm/cuda.shm.*`` file) before the ones
    left are terminated; 0 (the default) terminates them as soon as every result is in, which
    saves each launch the 0.5-2.5 s a rank with torch loaded takes to exit (measured on the
    CPU) but kills ranks inside that teardown. A failed run terminates at once either way.

    Raises LaunchError when any rank raises (with every failing rank's traceback), dies
    without reporting (with its exit code) or does not finish within ``timeout_s`` (with the
    Python stacks of all its threads at that moment, taken by faulthandler on SIGUSR1 before
    the rank is terminated: where a hung rank waits, even inside a CUDA call).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if not exit_grace_s >= 0:
        raise ValueError(f"exit_grace_s must be >= 0, got {exit_grace_s}")
    if placement is not None and len(placement) != nprocs:
        raise ValueError(f"placement has {len(placement)} entries for {nprocs} ranks")
    world_size = nprocs if world_size is None else world_size
    if (world_size != nprocs or first_rank) and (store_addr is None or job_id is None):
        raise ValueError("a launch running part of a job (world_size != nprocs) needs the shared "
                         "store_addr=(host, port) and the job_id every node uses")
    if host_store and store_addr is None:
        raise ValueError("host_store=True needs the store_addr at which to start the master")
    job_id = job_id or uuid.uuid4().hex[:12]
    _check_job(job_id, world_size, first_rank=first_rank, nprocs=nprocs)
    ranks = list(range(first_rank, first_rank + nprocs))
    start = time.monotonic()
    startup_timeout_s = min(timeout_s, startup_timeout_s or timeout_s)
    num_gpus = _detect_num_gpus() if num_gpus is None else num_gpus
    fn_args_blob = pickle.dumps((fn, tuple(args)))
    child_env = {**thread_limits(nprocs, threads_per_process),
                 **{str(k): str(v) for k, v in (env or {}).items()}}
    # idle thread pools must not spin on the cores a rank's GPU work does not need: OpenMP
    # workers (torch's CPU ops) between parallel regions, OpenBLAS's (numpy) after numpy's
    # import and after each call; the caller's or env='s setting wins
    for var, value in env_mod.idle_pool_env().items():
        child_env.setdefault(var, value)
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    processes: list = []
    stack_dir = tempfile.mkdtemp(prefix=f"afd-{job_id}-stacks-")
    stack_paths = [os.path.join(stack_dir, f"rank{local}.txt") for local in range(nprocs)]
    master = store = joining = None
    store_kind = "torch"
    ok = False
    try:
        if store_addr is None:
            # torch-free and up at once (a TCPStore master cost the parent a torch import)
            master, store_kind = _serve_own_store(STORE_HOST), "afd"
            host, port = master.host, master.port
        elif host_store:
            host, port = env_mod.parse_store_addr(store_addr)
            master = _start_store(world_size, timeout_s, host, port)
        else:
            host, port = env_mod.parse_store_addr(store_addr)
        if store_addr is not None:
            joining = _join_job(host, port, master, ranks, world_size, job_id, startup_timeout_s,
                                timeout_s)
            store = joining.store
        for local, rank in enumerate(ranks):
            where = placement[local] if placement is not None else Placement()
            device = device_for_rank(local, nprocs, num_gpus) if where.gpu is None else where.gpu
            rank_env = dict(child_env)
            if where.sm_percent is not None:
                rank_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(where.sm_percent)
            ctx = ProcessContext(rank, world_size, job_id, host, port, device, timeout_s,
                                 where.sm_percent, store_kind)
            proc = spawn.Process(target=_child_main, name=f"afd-{job_id}-rank{rank}",
                                 args=(local, fn_args_blob, ctx, rank_env, results,
                                       stack_paths[local]))
            proc.start()
            processes.append(proc)
        job = _Job(nprocs, processes, results, expected_deaths)
        _wait(job, start + timeout_s, timeout_s, joining)
        if job.failures:
            _collect_stacks(job, stack_paths)
            raise LaunchError(_failure_message(job, job_id), failures=job.failures)
        if joining is not None:
            joining.wait()  # ranks that never needed their peers: the job must still assemble
        ok = True
        return [job.values[local] for local in range(nprocs)]
    finally:
        _stop_all(processes, exit_grace_s if ok else 0.0)
        if isinstance(master, KVServer):
            master.close()
        results.close()
        results.join_thread()
        if store is not None:
            _finish_node(store, master, ranks, world_size, job_id, ok=ok, joined=joining.complete,
                         wait_s=max(0.0, timeout_s - (time.monotonic() - start)))
        del store, master  # a hosted master stops serving when dropped
        cleanup_job_segments(job_id, ranks=None if world_size == nprocs else ranks)
        shutil.rmtree(stack_dir, ignore_errors=True)


def _join_job(host: str, port: int, master, ranks: list[int], world_size: int, job_id: str,
              startup_timeout_s: float, timeout_s: float) -> "rendezvous.Rendezvous":
    """Connect to the job's store (waiting, bounded, for a master hosted elsewhere), publish
    this launch's ranks and return the (not yet waited) rendezvous; its ``store`` attribute is
    the launcher's namespaced client."""
    if master is None:
        rendezvous.wait_for_master(host, port, startup_timeout_s, job_id=job_id,
                                   world_size=world_size, here=ranks)
        client = create_store(host, port, world_size, is_master=False, timeout_s=timeout_s)
    else:
        client = master
    store = NamespacedStore(client, job_id)
    rendezvous.join(store, ranks, world_size, job_id)
    return rendezvous.Rendezvous(store, world_size, job_id, startup_timeout_s, ranks,
                                 f"by the launcher with pid {os.getpid()}")


def _finish_node(store, master, ranks: list[int], world_size: int, job_id: str, *, ok: bool,
                 joined: bool, wait_s: float) -> None:
    """Mark this launch's ranks done; the host of the store master waits (bounded) for the
    other launches' ranks: the rest of the launch's timeout (at least ``_DONE_GRACE_S``) after
    a clean run, ``_FAILURE_GRACE_S`` after a failure, not at all when the job never assembled."""
    try:
        rendezvous.mark_done(store, ranks)
    except Exception as exc:  # noqa: BLE001 - the master may already be gone
        logger.debug("job %s: could not mark ranks %s done: %s", job_id, ranks, exc)
        return
    if master is not None and joined and len(ranks) < world_size:
        rendezvous.await_done(store, world_size, max(wait_s, _DONE_GRACE_S) if ok else _FAILURE_GRACE_S,
                              job_id)
