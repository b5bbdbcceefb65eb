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
"""
from __future__ import annotations

import os
from typing import Mapping


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
        raise ValueError(f"{', '.join(missing)} not set (a rank started outside afd_cupy.launch "
                         f"needs {', '.join(RANK_VARS[:4])})")
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
    return {"store_host": host, "store_port": port_number, "world_size": world_size, "rank": rank,
            "job_id": environ["AFD_JOB_ID"], "device_id": device}
