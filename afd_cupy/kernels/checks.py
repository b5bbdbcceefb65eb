"""The argument checks of the spec builders (:mod:`afd_cupy.kernels.specs`): each converts one
kernel argument to the numpy scalar of its C type (or checks a CuPy array or the window
geometry) and raises ``ValueError`` naming the argument and its value. Only
:func:`device_array` imports CuPy (it is handed CuPy arrays).
"""
from __future__ import annotations

import numpy as np

from afd_cupy import wire
from afd_cupy.wire.dtypes import PAYLOAD_DTYPES

_DTYPE_CODES = sorted(payload.kernel_code for payload in PAYLOAD_DTYPES.values())


def count(name: str, value, *, low: int = 0, high: int = 2**31 - 1) -> np.int32:
    """A count or index: int32 in [low, high]."""
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
    return np.int32(value)


def int64(name: str, value, *, low: int = -(2**63)) -> np.int64:
    """An int64 >= low (timeouts in ns, seqs)."""
    value = int(value)
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return np.int64(value)


def address(name: str, value, *, allow_null: bool = False) -> np.uint64:
    """A raw device-visible address as uint64; 0 only with ``allow_null``."""
    value = int(value)
    if value < 0 or value >= 2**64 or (value == 0 and not allow_null):
        raise ValueError(f"{name} must be a non-null device-visible address, got {value:#x}")
    return np.uint64(value)


def device_array(name: str, arr, dtype, min_size: int):
    """A C-contiguous ``cupy.ndarray`` of ``dtype`` with at least ``min_size`` elements."""
    import cupy

    if not isinstance(arr, cupy.ndarray):
        raise ValueError(f"{name} must be a cupy.ndarray, got {type(arr).__name__}")
    if arr.dtype != dtype or not arr.flags.c_contiguous or arr.size < min_size:
        raise ValueError(f"{name} must be a contiguous {np.dtype(dtype).name} array of at least "
                         f"{min_size} elements, got {arr.dtype} shape {arr.shape} "
                         f"contiguous={arr.flags.c_contiguous}")
    return arr


def dtype_code(value) -> int:
    """A payload dtype code of the templated kernels (``DT_*`` of wire.cuh, the
    ``kernel_code`` of :data:`afd_cupy.wire.dtypes.PAYLOAD_DTYPES`)."""
    if value not in _DTYPE_CODES:
        raise ValueError(f"dtype_code must be one of {_DTYPE_CODES}, got {value!r}")
    return int(value)


def geometry(name: str, geo, *, header_words: int | None = None) -> np.void:
    """Check a ``WindowLayout.kernel_geometry()`` value (``header_words`` if given)."""
    dtype = wire.WindowLayout.KERNEL_GEOMETRY_DTYPE
    if not isinstance(geo, np.void) or geo.dtype != dtype:
        raise ValueError(f"{name} must be a WindowLayout.kernel_geometry() value, "
                         f"got {type(geo).__name__} {getattr(geo, 'dtype', '')}")
    if min(int(geo[field]) for field in dtype.names) < 0 or int(geo["ring_depth"]) < 1 \
            or int(geo["num_regions"]) < 1 or int(geo["header_words"]) < wire.HDR_FIXED_WORDS:
        raise ValueError(f"{name} holds an impossible geometry: {geo}")
    if header_words is not None and int(geo["header_words"]) != header_words:
        raise ValueError(f"{name}.header_words = {int(geo['header_words'])}, expected "
                         f"{header_words} (HDR_FIXED_WORDS + expert_per_rank)")
    return geo
