"""Where a launched rank runs: its GPU and MPS share, how many GPUs this machine shows, which
backend a local job uses, and how many CPU threads each child's pools get.

Nothing here imports torch or CUDA (NVML is asked through ctypes), so a launcher can decide
all of this in milliseconds before its children start.
"""
from __future__ import annotations

import dataclasses
import os

from afd_cupy.runtime import env as env_mod


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


def detect_num_gpus() -> int:
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
    from afd_cupy.runtime import env

    override = env.backend_override()
    if override:
        return override
    if detect_num_gpus() == 0:
        return "host"
    try:
        import cupy  # noqa: F401

        from afd_cupy.heap.nvshmem_lib import find_library
    except Exception:  # noqa: BLE001 - no usable CuPy: the host backend
        return "host"
    return "cuda" if find_library() else "host"


def thread_limits(nprocs: int, threads_per_process: int | None = None) -> dict[str, str]:
    """The thread-pool variables (:data:`afd_cupy.runtime.env.THREAD_POOL_VARS`) each of ``nprocs``
    local children gets: all of them at ``threads_per_process`` when given, else at an equal
    share of this process's cores (:func:`afd_cupy.runtime.env.thread_share`) for each variable the
    caller's environment does not set.

    Every process of a local job would otherwise size torch's, OpenMP's and numba's pools to
    all cores of the machine; ``nprocs`` such processes oversubscribe it (and OpenMP workers
    spin between parallel regions), which made a 2-process main job on a 16-core machine burn
    25 CPU-minutes in under a minute of wall time.
    """
    if threads_per_process is not None:
        return env_mod.thread_env(threads_per_process, environ={})  # validates: int >= 1
    return env_mod.thread_env(env_mod.thread_share(nprocs))
