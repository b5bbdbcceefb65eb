"""The expert GEMMs' SM carve-out: :func:`sm_carveout` (a context manager) makes the GEMMs
launched inside it leave SMs free for a kernel that spins next to them
(docs/design/performance-decisions.md, "SM carve-out"); :func:`resolve_gemm_sm_carveout` turns
the FFN side's ``gemm_sm_carveout`` setting into that number. Part of :mod:`afd_cupy.moe`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from dataclasses import dataclass

import torch

from afd_cupy.errors import ConfigError


def _carveout_binding():
    """(setter, getter) of torch's SM carve-out (``torch._C._set_sm_carveout_experimental`` /
    ``_get_sm_carveout_experimental``), or None when this torch has no such binding. Looked up
    at each call (cheap), so that a test can replace them."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    return None if setter is None or getter is None else (setter, getter)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def check_sm_carveout(value, *, device=None, name: str = "gemm_sm_carveout") -> int:
    """Validate an SM carve-out: an int >= 0 (not a bool), < the SM count of ``device`` when
    it is a CUDA device, and, when > 0, a torch that has the carve-out binding. Returns the
    value; ConfigError (a ValueError) naming ``name`` and the values otherwise. Reads the
    device's properties only for a value > 0 on a CUDA device (once per device)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int >= 0 (SMs left free by the expert GEMMs), got "
                          f"{type(value).__name__} {value!r}")
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")
    if value == 0:
        return 0
    if _carveout_binding() is None:
        raise ConfigError(f"{name}={value} needs torch._C._set_sm_carveout_experimental, which "
                          f"torch {torch.__version__} does not have; use 0")
    if device is not None and torch.device(device).type == "cuda":
        sm_count = _sm_count(torch.device(device))
        if value >= sm_count:
            raise ConfigError(f"{name}={value} must be < the SM count of {device} ({sm_count})")
    return value


AUTO_GEMM_SM_CARVEOUT = 2
"""What ``gemm_sm_carveout="auto"`` (the FFN side's default) leaves free on a CUDA device.
Measured on an H200 (docs/performance.md, "A spinning warp next to the expert GEMMs"): a one-warp
spinner resident next to the V2-Lite-shaped routed GEMM pair makes it 1.45x slower (615 vs
423 µs); with 1, 2 or 4 SMs carved out it runs at 0.99x of alone, and the GEMM alone with 2
SMs carved out is itself 0.99x of alone (nothing lost when no spinner is there). Two, not
one, so that two resident spinners (a peer's wait under MPS and the next item's wait) fit."""


def resolve_gemm_sm_carveout(value, *, device=None, name: str = "gemm_sm_carveout") -> int:
    """``value`` as the int the FFN side uses: ``"auto"`` is ``AUTO_GEMM_SM_CARVEOUT`` on a
    CUDA ``device`` whose torch has the carve-out binding and more than twice that many SMs,
    else 0 (the host backend, a CPU device, an older torch, a tiny GPU: nothing to do). Anything else goes
    through ``check_sm_carveout`` (an int >= 0, ConfigError otherwise)."""
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(f"{name} must be 'auto' or an int >= 0 (SMs left free by the expert "
                              f"GEMMs), got {value!r}")
        if device is None or torch.device(device).type != "cuda" or _carveout_binding() is None:
            return 0
        return AUTO_GEMM_SM_CARVEOUT if _sm_count(torch.device(device)) > 2 * AUTO_GEMM_SM_CARVEOUT else 0
    return check_sm_carveout(value, device=device, name=name)


def current_sm_carveout() -> int | None:
    """torch's current SM carve-out (None: unset, or a torch without the binding)."""
    binding = _carveout_binding()
    return None if binding is None else binding[1]()


@contextlib.contextmanager
def sm_carveout(n: int | None, *, device=None):
    """Inside the block, GEMMs launched by this process leave ``n`` SMs free; the previous
    setting comes back on exit (also on an exception).

    What it sets: torch's process-wide ``torch._C._set_sm_carveout_experimental(n)`` (torch
    itself warns once that it is experimental). torch reads it when a GEMM is *launched* (on
    the host), not when it runs: ``torch._grouped_mm``'s persistent CUTLASS kernel then gets
    ``multiProcessorCount - n`` CTAs instead of one per SM, and cuBLAS-Lt matmuls an SM count
    target; other kernels ignore it. A CUDA graph keeps the grid of its capture: capture
    inside the block to bake it in. On the CPU it changes nothing.

    ``n``: an int >= 0 (``check_sm_carveout``; with ``device`` also < its SM count). 0 or None:
    nothing at all happens (no call into torch; an outer block's setting stays). ConfigError
    for a bad value, and for n > 0 on a torch without the binding.

    Threads: the setting is global to the process (``at::globalContext()``), not to the thread
    or the stream, so every matmul any thread launches while a block is open gets it. The
    blocks themselves are kept in one process-wide list under a lock: while any is open, the
    most recently opened one's ``n`` is in force; when the last closes, the value from before
    the first comes back. So nested blocks restore in order, and blocks on two threads that
    overlap in time (two workers, a worker and a reply thread) never leave a stale value
    behind. Restoring "unset" calls the setter with None (torch 2.13's binding takes
    ``int | None``); a binding that refuses None gets 0 (no carve-out for the grouped GEMM;
    cuBLAS-Lt then targets every SM).
    """
    if n is None or (n == 0 and not isinstance(n, bool)):
        yield
        return
    n = check_sm_carveout(n, device=device, name="sm_carveout(n)")
    setter, getter = _carveout_binding()
    scope = _CarveoutScope(n)  # compared by identity: list.remove takes out this block only
    with _OPEN.lock:
        if not _OPEN.scopes:
            _OPEN.base = getter()
        _OPEN.scopes.append(scope)
        setter(n)
    try:
        yield
    finally:
        with _OPEN.lock:
            _OPEN.scopes.remove(scope)
            if _OPEN.scopes:
                setter(_OPEN.scopes[-1].n)
            else:
                _restore_carveout(setter, _OPEN.base)


@dataclass(eq=False)
class _CarveoutScope:
    n: int


@dataclass
class _OpenScopes:
    """The open ``sm_carveout`` blocks of this process, oldest first, and torch's value from
    before the oldest; guarded by ``lock``."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    scopes: list = dataclasses.field(default_factory=list)
    base: int | None = None


_OPEN = _OpenScopes()


def _restore_carveout(setter, previous: int | None) -> None:
    if previous is not None:
        setter(previous)
        return
    try:
        setter(None)
    except TypeError:  # a binding that takes an int only
        setter(0)
