"""The ctypes binding of NVSHMEM's host library (``libnvshmem_host.so.3``).

Why ctypes: the handful of host calls we need (unique-id bootstrap, malloc/free, ptr,
barrier, finalize, and the put transport's on-stream puts) are plain C functions, so a ctypes table avoids shipping a compiled
extension per CUDA/Python version. The ABI risk is in the two structs passed by pointer;
NVSHMEM pins those itself with version stamps (``(major << 16) + sizeof``) and static_asserts
on their sizes, which this module mirrors and asserts at import. Checked against the 3.4.5
and 3.8.0 headers: sizes are identical; 3.8 adds an ``init_args`` v2 (a ``cuda_device_id``
field carved out of the padding) but still accepts the v1 stamps used here, which are the
only ones 3.4.5 knows.

Contents: the structs and their version stamps, the ``PROTOTYPES`` table (one entry per C
function, its prototype as a comment), ``check_rc`` (return code -> NvshmemError), and the
library lookup (``AFD_NVSHMEM_LIB`` via :mod:`afd_cupy.runtime.env`, then the nvidia-nvshmem wheel,
then the system loader) with ``load_library``. The heap that uses them is
:mod:`afd_cupy.heap.nvshmem`.

Importing this module loads neither CuPy nor the library: ``load_library`` does, once.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from ctypes import POINTER, c_char, c_int, c_size_t, c_uint64, c_void_p

from afd_cupy.errors import BackendUnavailableError, NvshmemError
from afd_cupy.runtime import env

LIB_SONAME = "libnvshmem_host.so.3"
NVSHMEMX_INIT_WITH_UNIQUEID = 1 << 3  # enum flags, host/nvshmemx_api.h
SUPPORTED_MAJOR = 3  # the major version whose ABI this binding mirrors

# ---------------------------------------------------------------------------------------------
# Structs (bootstrap_device_host/nvshmem_uniqueid.h, device_host/nvshmem_types.h)
# ---------------------------------------------------------------------------------------------


class UniqueId(ctypes.Structure):
    """``nvshmemx_uniqueid_v1``: ``{int version; char internal[124];}``, 128 bytes."""

    _fields_ = [("version", c_int), ("internal", c_char * 124)]


class UniqueIdArgs(ctypes.Structure):
    """``nvshmemx_uniqueid_args_v1``: ``{int version; uniqueid *id; int myrank, nranks;}``."""

    _fields_ = [("version", c_int), ("id", POINTER(UniqueId)),
                ("myrank", c_int), ("nranks", c_int)]


class InitArgs(ctypes.Structure):
    """``nvshmemx_init_args_v1``: ``{int version; uniqueid_args uid_args; char content[96];}``."""

    _fields_ = [("version", c_int), ("uid_args", UniqueIdArgs), ("content", c_char * 96)]


class InitAttr(ctypes.Structure):
    """``nvshmemx_init_attr_v1``: ``{int version; void *mpi_comm; init_args args;}``."""

    _fields_ = [("version", c_int), ("mpi_comm", c_void_p), ("args", InitArgs)]


def _v1_stamp(struct_type) -> int:
    """NVSHMEM's version stamp: ``(1 << 16) + sizeof(T)`` (e.g. NVSHMEMX_UNIQUEID_INITIALIZER)."""
    return (1 << 16) + ctypes.sizeof(struct_type)


# The static_asserts of the headers (identical in 3.4.5 and 3.8.0).
assert ctypes.sizeof(UniqueId) == 128
assert ctypes.sizeof(UniqueIdArgs) == 24
assert ctypes.sizeof(InitArgs) == 128
assert ctypes.sizeof(InitAttr) == 144
UNIQUEID_VERSION = _v1_stamp(UniqueId)          # 65664
UNIQUEID_ARGS_VERSION = _v1_stamp(UniqueIdArgs)  # 65560
INIT_ARGS_VERSION = _v1_stamp(InitArgs)          # 65664
INIT_ATTR_VERSION = _v1_stamp(InitAttr)          # 65680 == NVSHMEM_INIT_ATTR_V1_IDENTIFIER


def new_unique_id() -> UniqueId:
    """A zeroed unique id carrying its version stamp (NVSHMEMX_UNIQUEID_INITIALIZER)."""
    return UniqueId(version=UNIQUEID_VERSION)


def new_init_attr() -> InitAttr:
    """A zeroed v1 init attr with every stamp set, as ``nvshmemx_init_init_attr_ver_only``."""
    attr = InitAttr(version=INIT_ATTR_VERSION, mpi_comm=None)
    attr.args.version = INIT_ARGS_VERSION
    attr.args.uid_args.version = UNIQUEID_ARGS_VERSION
    attr.args.uid_args.myrank = -1
    attr.args.uid_args.nranks = -1
    return attr


# ---------------------------------------------------------------------------------------------
# The binding table: symbol -> (restype, argtypes). One entry per C function used.
# ---------------------------------------------------------------------------------------------

_c_int_p = POINTER(c_int)

PROTOTYPES: dict[str, tuple] = {
    # int nvshmemx_init_status(void);
    "nvshmemx_init_status": (c_int, []),
    # void nvshmemx_vendor_get_version_info(int *major, int *minor, int *patch);
    "nvshmemx_vendor_get_version_info": (None, [_c_int_p, _c_int_p, _c_int_p]),
    # int nvshmemx_get_uniqueid(nvshmemx_uniqueid_t *uniqueid);
    "nvshmemx_get_uniqueid": (c_int, [POINTER(UniqueId)]),
    # int nvshmemx_set_attr_uniqueid_args(const int myrank, const int nranks,
    #                                     const nvshmemx_uniqueid_t *uniqueid,
    #                                     nvshmemx_init_attr_t *attr);
    "nvshmemx_set_attr_uniqueid_args": (c_int, [c_int, c_int, POINTER(UniqueId),
                                                POINTER(InitAttr)]),
    # int nvshmemx_hostlib_init_attr(unsigned int flags, nvshmemx_init_attr_t *attr);
    "nvshmemx_hostlib_init_attr": (c_int, [ctypes.c_uint, POINTER(InitAttr)]),
    # void nvshmemx_hostlib_finalize(void);
    "nvshmemx_hostlib_finalize": (None, []),
    # int nvshmem_my_pe(void);
    "nvshmem_my_pe": (c_int, []),
    # int nvshmem_n_pes(void);
    "nvshmem_n_pes": (c_int, []),
    # void *nvshmem_malloc(size_t size);
    "nvshmem_malloc": (c_void_p, [c_size_t]),
    # void nvshmem_free(void *ptr);
    "nvshmem_free": (None, [c_void_p]),
    # void *nvshmem_ptr(const void *dest, int pe);
    "nvshmem_ptr": (c_void_p, [c_void_p, c_int]),
    # void nvshmem_barrier_all(void);
    "nvshmem_barrier_all": (None, []),
    # The put transport (docs/design/put-transport.md); host/nvshmemx_api.h. All return void: NVSHMEM
    # reports a failure of an on-stream operation through the stream / its own abort.
    # void nvshmemx_putmem_on_stream(void *dest, const void *source, size_t bytes, int pe,
    #                                cudaStream_t cstrm);
    "nvshmemx_putmem_on_stream": (None, [c_void_p, c_void_p, c_size_t, c_int, c_void_p]),
    # void nvshmemx_putmem_signal_on_stream(void *dest, const void *source, size_t bytes,
    #                                       uint64_t *sig_addr, uint64_t signal, int sig_op,
    #                                       int pe, cudaStream_t cstrm);
    "nvshmemx_putmem_signal_on_stream": (None, [c_void_p, c_void_p, c_size_t, c_void_p,
                                                c_uint64, c_int, c_int, c_void_p]),
    # void nvshmemx_quiet_on_stream(cudaStream_t cstrm);
    "nvshmemx_quiet_on_stream": (None, [c_void_p]),
    # void nvshmemx_signal_op_on_stream(uint64_t *sig_addr, uint64_t signal, int sig_op, int pe,
    #                                   cudaStream_t cstrm);
    "nvshmemx_signal_op_on_stream": (None, [c_void_p, c_uint64, c_int, c_int, c_void_p]),
}

# nvshmemx_signal_op_t (device_host_transport/nvshmem_common_transport.h, 3.4.5 and 3.8.0:
# ``typedef enum { NVSHMEM_SIGNAL_SET = 9, NVSHMEM_SIGNAL_ADD = 10 } nvshmemx_signal_op_t``).
# Signal words are ``uint64_t`` symmetric objects, 8-byte aligned: afd_cupy's flag words
# (int64, at 8-byte offsets of a 256-B aligned window) qualify.
NVSHMEM_SIGNAL_SET = 9
NVSHMEM_SIGNAL_ADD = 10

# enum nvshmemx_status (non_abi/nvshmemx_error.h), same in 3.4.5 and 3.8.0.
_STATUS_NAMES = ("NVSHMEMX_SUCCESS", "NVSHMEMX_ERROR_INVALID_VALUE",
                 "NVSHMEMX_ERROR_OUT_OF_MEMORY", "NVSHMEMX_ERROR_NOT_SUPPORTED",
                 "NVSHMEMX_ERROR_SYMMETRY", "NVSHMEMX_ERROR_GPU_NOT_SELECTED",
                 "NVSHMEMX_ERROR_COLLECTIVE_LAUNCH_FAILED", "NVSHMEMX_ERROR_INTERNAL")
STATUS_NOT_INITIALIZED = 0  # nvshmemx_init_status_t


def check_rc(rc: int, what: str) -> None:
    """Raise NvshmemError naming ``what`` and the return code when ``rc != 0``."""
    if rc != 0:
        name = _STATUS_NAMES[rc] if 0 <= rc < len(_STATUS_NAMES) else "unknown status"
        raise NvshmemError(f"{what} failed with code {rc} ({name})", call=what, code=rc)


# ---------------------------------------------------------------------------------------------
# Library lookup
# ---------------------------------------------------------------------------------------------

_INSTALL_HINT = ("pip install nvidia-nvshmem-cu13 (or nvidia-nvshmem-cu12 for CUDA 12), "
                 f"or set AFD_NVSHMEM_LIB to the path of {LIB_SONAME}")


def _package_library_paths() -> list[str]:
    """``nvidia/nvshmem/lib/libnvshmem_host.so.3`` in every ``nvidia`` namespace dir.

    Uses find_spec on the top-level namespace only, which imports nothing.
    """
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    locations = list(spec.submodule_search_locations or []) if spec else []
    candidates = [os.path.join(loc, "nvshmem", "lib", LIB_SONAME) for loc in locations]
    return [path for path in candidates if os.path.isfile(path)]


def find_library() -> str | None:
    """Path of the NVSHMEM host library, or None to leave it to the system loader.

    Order: ``AFD_NVSHMEM_LIB`` (must exist), then the nvidia-nvshmem-cu13/-cu12 wheel.
    """
    override = env.nvshmem_lib_override()
    if override is not None:
        if not os.path.isfile(override):
            raise BackendUnavailableError(
                f"AFD_NVSHMEM_LIB={override!r} does not exist; unset it to search the "
                f"nvidia-nvshmem wheel, or {_INSTALL_HINT}")
        return override
    paths = _package_library_paths()
    return paths[0] if paths else None


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def load_library() -> ctypes.CDLL:
    """The NVSHMEM host library with every PROTOTYPES entry typed (loaded once, cached).

    Raises BackendUnavailableError when the library or one of its symbols is missing.
    """
    global _lib
    with _lib_lock:
        if _lib is None:
            _lib = _bind(_open_library())
        return _lib


def _open_library() -> ctypes.CDLL:
    path = find_library()
    try:
        # RTLD_GLOBAL: NVSHMEM's bootstrap/transport plugins resolve host-lib symbols.
        return ctypes.CDLL(path or LIB_SONAME, mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise BackendUnavailableError(
            f"cannot load the NVSHMEM host library ({path or LIB_SONAME}): {err}. "
            f"{_INSTALL_HINT}") from None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for symbol, (restype, argtypes) in PROTOTYPES.items():
        try:
            func = getattr(lib, symbol)
        except AttributeError:
            raise BackendUnavailableError(
                f"{lib._name} has no symbol {symbol}: NVSHMEM too old? {_INSTALL_HINT}") from None
        func.restype = restype
        func.argtypes = argtypes
    return lib


def library_version(lib: ctypes.CDLL | None = None) -> tuple[int, int, int]:
    """(major, minor, patch) of the loaded NVSHMEM host library; needs no GPU or init."""
    lib = lib or load_library()
    major, minor, patch = c_int(), c_int(), c_int()
    lib.nvshmemx_vendor_get_version_info(ctypes.byref(major), ctypes.byref(minor),
                                         ctypes.byref(patch))
    return major.value, minor.value, patch.value
