"""Shared pytest set-up: missing hardware becomes a skip with a reason.

Tests marked ``cuda`` need CuPy and at least one visible GPU; tests marked ``multigpu``
need at least two. The GPU probe runs once, only when such a test is collected.
"""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def _gpu_probe() -> tuple[int, str]:
    """(number of visible GPUs, reason when 0)."""
    try:
        import cupy
    except Exception as err:  # noqa: BLE001 - ImportError or a broken CUDA install
        return 0, f"cupy cannot be imported ({type(err).__name__}: {err})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as err:  # noqa: BLE001 - no driver, no device
        return 0, f"no CUDA device ({type(err).__name__}: {err})"
    return count, "" if count else "no CUDA device visible"


@pytest.fixture(autouse=True)
def _skip_without_hardware(request):
    """Skip ``cuda`` tests without a GPU and ``multigpu`` tests with fewer than two."""
    needs_cuda = request.node.get_closest_marker("cuda") is not None
    needs_multi = request.node.get_closest_marker("multigpu") is not None
    if not (needs_cuda or needs_multi):
        return
    num_gpus, reason = _gpu_probe()
    if num_gpus == 0:
        pytest.skip(reason)
    if needs_multi and num_gpus < 2:
        pytest.skip(f"needs at least 2 GPUs, {num_gpus} visible")
