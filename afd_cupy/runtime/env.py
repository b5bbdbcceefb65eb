"""The one place that reads ``AFD_*`` environment variables.

| variable | meaning | default |
|---|---|---|
| ``AFD_NVSHMEM_LIB`` | path of ``libnvshmem_host.so.3`` (overrides the wheel search) | unset |
| ``AFD_BACKEND`` | backend the tools pick when none is given: ``cuda`` or ``host`` | ``cuda`` if a GPU is visible, else ``host`` |
| ``AFD_KERNEL_CACHE`` | ``0`` disables the in-process RawModule cache (debugging) | ``1`` |
| ``AFD_STORE_ADDR`` | ``host:port`` of the job's TCPStore master (``ProcessContext.from_env``) | required there |
| ``AFD_WORLD_SIZE`` | ranks in the job (Attention + FFN) | required there |
| ``AFD_RANK`` | this process's world rank (Attention ranks first) | required there |
| ``AFD_JOB_ID`` | the job's id: the same on every rank, new for every run | required there |
| ``AFD_DEVICE`` | CUDA device index of this process | unset: none |

Library code calls these functions; nothing reads ``os.environ`` at import time.

Thread pools (not ``AFD_*``, read here too): every process of a job would size torch's
intra-op pool, OpenMP, MKL, OpenBLAS and numba to all cores of the machine, and N processes
oversubscribe it N-fold (idle OpenMP workers spin). :func:`thread_share` is one process's
share of the cores, :func:`thread_env` the variables that give it before the libraries load
(what ``afd_cupy.runtime.launch`` puts in each child), :func:`limit_threads` the same for a process
started elsewhere (docs/design/startup.md, "Threads").
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Mapping

from afd_cupy.errors import ConfigError

logger = logging.getLogger("afd_cupy")

#: thread-pool sizes of the libraries a rank loads; read once, when each library loads
THREAD_POOL_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
#: what every launched child gets unless the caller's environment or ``env=`` sets it (idle
#: pools must not spin on cores a rank's GPU work does not need): OpenMP workers sleep
#: between parallel regions; OpenBLAS workers (numpy) sleep after 2^4 cycles instead of
#: 2^28 (each spins ~0.1 s at numpy's import and after each call: ~1 CPU-s per process at
#: start-up on a 16-core machine). Read when each library loads.
IDLE_POOL_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}


def idle_pool_env(environ=None) -> dict[str, str]:
    """The :data:`IDLE_POOL_DEFAULTS` that ``environ`` (default ``os.environ``) leaves unset
    or empty: what a process that wants sleeping idle pools adds to its environment."""
    environ = os.environ if environ is None else environ
    return {var: value for var, value in IDLE_POOL_DEFAULTS.items() if not environ.get(var)}


def nvshmem_lib_override() -> str | None:
    """Path from ``AFD_NVSHMEM_LIB`` or None."""
    value = os.environ.get("AFD_NVSHMEM_LIB", "").strip()
    return value or None


def backend_override() -> str | None:
    """``cuda`` / ``host`` from ``AFD_BACKEND`` or None. Other values raise ValueError."""
    value = os.environ.get("AFD_BACKEND", "").strip().lower()
    if not value:
        return None
    if value not in ("cuda", "host"):
        raise ValueError(f"AFD_BACKEND must be 'cuda' or 'host', got {value!r}")
    return value


def kernel_cache_enabled() -> bool:
    """False when ``AFD_KERNEL_CACHE=0``."""
    return os.environ.get("AFD_KERNEL_CACHE", "1").strip() != "0"


def usable_cores() -> int:
    """Cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where the
    platform has no affinity call)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_share(num_local_procs: int) -> int:
    """One process's share of :func:`usable_cores` when ``num_local_procs`` share them, >= 1."""
    return max(1, usable_cores() // max(1, int(num_local_procs)))


def user_thread_vars(environ=None) -> dict[str, str]:
    """The :data:`THREAD_POOL_VARS` set (non-empty) in ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    return {var: environ[var] for var in THREAD_POOL_VARS if environ.get(var, "").strip()}


def thread_env(num_threads: int, environ=None) -> dict[str, str]:
    """``{var: str(num_threads)}`` for each :data:`THREAD_POOL_VARS` entry that ``environ``
    (default ``os.environ``) does not set: the user's setting wins, per variable."""
    _check_threads(num_threads)
    user = user_thread_vars(environ)
    return {var: str(int(num_threads)) for var in THREAD_POOL_VARS if var not in user}


def limit_threads(num_threads: int, *, keep_user_settings: bool = True) -> dict[str, int]:
    """Cap this process's CPU thread pools at ``num_threads``; returns what was set.

    For a rank started outside ``afd_cupy.runtime.launch`` (a serving stack's own process), ideally
    before torch/numpy/numba are imported: sets the :data:`THREAD_POOL_VARS` (only those not
    already set when ``keep_user_settings``), read by OpenMP, MKL, OpenBLAS and numba when
    they load, and calls ``torch.set_num_threads`` when torch is already imported (torch
    reads ``OMP_NUM_THREADS`` itself when imported later). With ``keep_user_settings`` and
    ``OMP_NUM_THREADS`` set, torch keeps its count. Not collective; process-global.
    NOTE: numba's pool starts only for ``parallel=True`` functions, which afd_cupy has none
    of; a pool already started keeps its size.
    """
    _check_threads(num_threads)
    env = thread_env(num_threads) if keep_user_settings else {v: str(int(num_threads))
                                                                 for v in THREAD_POOL_VARS}
    os.environ.update(env)
    applied = {var: int(value) for var, value in env.items()}
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(num_threads))
        applied["torch"] = int(num_threads)
    if applied:
        logger.debug("afd_cupy: thread pools limited to %d (%s)", num_threads, ", ".join(applied))
    return applied


def _check_threads(num_threads) -> None:
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"number of threads must be an int >= 1, got {num_threads!r}")


RANK_VARS = ("AFD_STORE_ADDR", "AFD_WORLD_SIZE", "AFD_RANK", "AFD_JOB_ID", "AFD_DEVICE")


def rank_settings(environ: Mapping[str, str] | None = None) -> dict:
    """The place in a job of a rank another launcher started (torchrun, SLURM, k8s...), from
    ``AFD_STORE_ADDR``, ``AFD_WORLD_SIZE``, ``AFD_RANK``, ``AFD_JOB_ID`` and optionally
    ``AFD_DEVICE`` of ``environ`` (default ``os.environ``): ``{"store_host": str,
    "store_port": int, "world_size": int, "rank": int, "job_id": str, "device_id": int | None}``.
    Raises ValueError naming a missing or malformed variable."""
    environ = os.environ if environ is None else environ
    missing = [name for name in RANK_VARS[:4] if not environ.get(name)]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set (a rank started outside afd_cupy.runtime.launch "
                         f"needs {', '.join(RANK_VARS[:4])})")
    try:
        host, port_number = parse_store_addr(environ["AFD_STORE_ADDR"])
        world_size, rank = int(environ["AFD_WORLD_SIZE"]), int(environ["AFD_RANK"])
        device = int(environ["AFD_DEVICE"]) if environ.get("AFD_DEVICE") else None
    except ValueError as err:  # ConfigError included
        raise ValueError(f"malformed AFD_* variable: {err} (AFD_STORE_ADDR must be host:port; "
                         f"AFD_WORLD_SIZE, AFD_RANK, AFD_DEVICE integers)") from None
    if not 0 <= rank < world_size:
        raise ValueError(f"AFD_RANK={rank}, AFD_WORLD_SIZE={world_size}: need 0 <= rank < world size")
    return {"store_host": host, "store_port": port_number, "world_size": world_size, "rank": rank,
            "job_id": environ["AFD_JOB_ID"], "device_id": device}


def parse_store_addr(addr) -> tuple[str, int]:
    """``"host:port"``, ``"[v6 address]:port"`` or ``(host, port)`` -> ``(host, port)``.

    Raises ConfigError naming the address when it has no host, an IPv6 host without brackets
    (``"fe80::1"`` would read as host ``fe80:``, port 1), or no integer port in [1, 65535]."""
    if isinstance(addr, (tuple, list)) and len(addr) == 2:
        host, port = addr
    elif isinstance(addr, str) and ":" in addr:
        host, _, port = addr.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif ":" in host or "[" in host or "]" in host:
            raise ConfigError(f"store address {addr!r}: write an IPv6 host in brackets, '[host]:port'")
    else:
        raise ConfigError(f"store address must be 'host:port' or (host, port), got {addr!r}")
    if isinstance(port, (bool, float)):
        raise ConfigError(f"store address {addr!r}: port {port!r} is not an integer")
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise ConfigError(f"store address {addr!r}: port {port!r} is not an integer") from None
    if not isinstance(host, str) or not host or not 0 < port < 65536:
        raise ConfigError(f"store address {addr!r}: needs a host and a port in [1, 65535]")
    return host, port
