"""The one place that reads ``AFD_*`` environment variables.

| variable | meaning | default |
|---|---|---|
| ``AFD_NVSHMEM_LIB`` | path of ``libnvshmem_host.so.3`` (overrides the wheel search) | unset |
| ``AFD_BACKEND`` | backend the tools pick when none is given: ``cuda`` or ``host`` | ``cuda`` if a GPU is visible, else ``host`` |
| ``AFD_KERNEL_CACHE`` | ``0`` disables the in-process RawModule cache (debugging) | ``1`` |

Library code calls these functions; nothing reads ``os.environ`` at import time.
"""
from __future__ import annotations

import os


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
