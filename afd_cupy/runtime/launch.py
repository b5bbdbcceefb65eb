"""The one launch helper shared by tests and tools: run ``fn(ctx, *args)`` in local processes.

The parent process serves the job's store (a :class:`~afd_cupy.runtime.kvstore.KVServer` on a free
port: no torch in the parent; or joins a TCPStore given as ``store_addr``, for a job whose
ranks several launchers start: one launch per node, each running a contiguous block of world
ranks), spawns ``nprocs`` children
("spawn" start method: no inherited CUDA state), places them on GPUs, collects their
results in rank order and turns any failure (exception, crash, timeout) into a
:class:`LaunchError` carrying every failing rank's story. Cleanup always runs: children are
terminated and joined, the store is dropped and the job's shared-memory segments unlinked.
The children die with the launcher (:mod:`afd_cupy.runtime.orphan`) when it is killed.

The parts live in their own modules, and every name is importable from here as well:
:mod:`afd_cupy.runtime.process_context` (the rank's context, the store it joins or hosts),
:mod:`afd_cupy.runtime.children` (spawned ranks: their entry point, reports, hangs, stopping),
:mod:`afd_cupy.runtime.placement` (GPUs, MPS shares, backend detection, thread pools).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import uuid
from typing import Callable

from afd_cupy.errors import ConfigError
from afd_cupy.heap.host import cleanup_job_segments
from afd_cupy.runtime import env as env_mod
from afd_cupy.runtime import rendezvous
from afd_cupy.runtime.children import (FAILURE_GRACE_S, DiedAsExpected, Job, LaunchError,  # noqa: F401
                               child_main, collect_stacks, failure_message, stop_all, wait_for_job)
from afd_cupy.runtime.env import IDLE_POOL_DEFAULTS, THREAD_POOL_VARS  # noqa: F401 - re-exported
from afd_cupy.runtime.kvstore import KVServer
from afd_cupy.runtime.placement import (Placement, detect_backend, detect_num_gpus,  # noqa: F401
                                device_for_rank, parse_placement, thread_limits, visible_gpu_count)
from afd_cupy.runtime.process_context import (STORE_HOST, ProcessContext, check_job,  # noqa: F401
                                      connect, serve_own_store, start_store)
from afd_cupy.runtime.store import NamespacedStore, create_store
from afd_cupy.runtime.timeouts import check_optional_timeout, check_timeout

logger = logging.getLogger("afd_cupy")

_DONE_GRACE_S = 5.0  # least time a store host waits for the other launches' ranks to finish


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
    ranks joined (:mod:`afd_cupy.runtime.rendezvous`): a launch that never starts is a
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
    check_timeout("timeout_s", timeout_s)
    check_optional_timeout("startup_timeout_s", startup_timeout_s)
    if isinstance(exit_grace_s, bool) or not 0 <= exit_grace_s < float("inf"):
        raise ConfigError(f"exit_grace_s must be a finite number of seconds >= 0, got {exit_grace_s!r}")
    if placement is not None and len(placement) != nprocs:
        raise ValueError(f"placement has {len(placement)} entries for {nprocs} ranks")
    world_size = nprocs if world_size is None else world_size
    if (world_size != nprocs or first_rank) and (store_addr is None or job_id is None):
        raise ValueError("a launch running part of a job (world_size != nprocs) needs the shared "
                         "store_addr=(host, port) and the job_id every node uses")
    if host_store and store_addr is None:
        raise ValueError("host_store=True needs the store_addr at which to start the master")
    job_id = job_id or uuid.uuid4().hex[:12]
    check_job(job_id, world_size, first_rank=first_rank, nprocs=nprocs)
    ranks = list(range(first_rank, first_rank + nprocs))
    start = time.monotonic()
    startup_timeout_s = timeout_s if startup_timeout_s is None else min(timeout_s, startup_timeout_s)
    num_gpus = detect_num_gpus() if num_gpus is None else num_gpus
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
            master, store_kind = serve_own_store(STORE_HOST), "afd"
            host, port = master.host, master.port
        elif host_store:
            host, port = env_mod.parse_store_addr(store_addr)
            master = start_store(world_size, timeout_s, host, port)
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
            proc = spawn.Process(target=child_main, name=f"afd-{job_id}-rank{rank}",
                                 args=(local, fn_args_blob, ctx, rank_env, results,
                                       stack_paths[local], os.getpid()))
            proc.start()
            processes.append(proc)
        job = Job(nprocs, processes, results, expected_deaths)
        wait_for_job(job, start + timeout_s, timeout_s, joining)
        if job.failures:
            collect_stacks(job, stack_paths)
            raise LaunchError(failure_message(job, job_id), failures=job.failures)
        if joining is not None:
            joining.wait()  # ranks that never needed their peers: the job must still assemble
        ok = True
        return [job.values[local] for local in range(nprocs)]
    finally:
        stop_all(processes, exit_grace_s if ok else 0.0)
        if master is not None and joining is not None and joining.abandoned:
            joining.linger()  # the other launches read the verdict before the store goes
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
    a clean run, ``FAILURE_GRACE_S`` after a failure, not at all when the job never assembled."""
    try:
        rendezvous.mark_done(store, ranks)
    except Exception as exc:  # noqa: BLE001 - the master may already be gone
        logger.debug("job %s: could not mark ranks %s done: %s", job_id, ranks, exc)
        return
    if master is not None and joined and len(ranks) < world_size:
        rendezvous.await_done(store, world_size, max(wait_s, _DONE_GRACE_S) if ok else FAILURE_GRACE_S,
                              job_id)
