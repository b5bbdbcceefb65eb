"""The cuda backend's symmetric heap: NVSHMEM (``libnvshmem_host.so.3``) through ctypes.

Why ctypes: the handful of host calls we need (unique-id bootstrap, malloc/free, ptr,
barrier, finalize) are plain C functions, so a ctypes table avoids shipping a compiled
extension per CUDA/Python version. The ABI risk is in the two structs passed by pointer;
NVSHMEM pins those itself with version stamps (``(major << 16) + sizeof``) and static_asserts
on their sizes, which this module mirrors and asserts at import. Checked against the 3.4.5
and 3.8.0 headers: sizes are identical; 3.8 adds an ``init_args`` v2 (a ``cuda_device_id``
field carved out of the padding) but still accepts the v1 stamps used here, which are the
only ones 3.4.5 knows.

Importing this module loads neither CuPy nor the library: both happen in the constructor.
Only one NvshmemHeap may live in a process (NVSHMEM is a per-process runtime).

Environment read here (besides ``AFD_NVSHMEM_LIB`` via :mod:`afd_cupy.env`):
``NVSHMEM_DISABLE_NCCL`` is set to ``1`` unless the user set it: afd_cupy uses no NVSHMEM
collectives that need NCCL, and loading NCCL into several PEs sharing one GPU only costs
start-up time and memory. ``NVSHMEM_DISABLE_NVLS`` is set to ``1`` likewise: afd_cupy never
uses NVLink multicast, and on shared multi-GPU hosts it must stay off.
``NVSHMEM_SYMMETRIC_SIZE`` (NVSHMEM's own) bounds the heap.
"""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from ctypes import POINTER, c_char, c_int, c_size_t, c_void_p

from afd_cupy import env
from afd_cupy.errors import BackendUnavailableError, HeapError, NvshmemError
from afd_cupy.heap.base import SymmetricBuffer, SymmetricHeap
from afd_cupy.store import Store, store_fetch, store_publish

logger = logging.getLogger("afd_cupy")

LIB_SONAME = "libnvshmem_host.so.3"
NVSHMEMX_INIT_WITH_UNIQUEID = 1 << 3  # enum flags, host/nvshmemx_api.h
_SUPPORTED_MAJOR = 3

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
}

# enum nvshmemx_status (non_abi/nvshmemx_error.h), same in 3.4.5 and 3.8.0.
_STATUS_NAMES = ("NVSHMEMX_SUCCESS", "NVSHMEMX_ERROR_INVALID_VALUE",
                 "NVSHMEMX_ERROR_OUT_OF_MEMORY", "NVSHMEMX_ERROR_NOT_SUPPORTED",
                 "NVSHMEMX_ERROR_SYMMETRY", "NVSHMEMX_ERROR_GPU_NOT_SELECTED",
                 "NVSHMEMX_ERROR_COLLECTIVE_LAUNCH_FAILED", "NVSHMEMX_ERROR_INTERNAL")
_STATUS_NOT_INITIALIZED = 0  # nvshmemx_init_status_t


def _check(rc: int, what: str) -> None:
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


# ---------------------------------------------------------------------------------------------
# The heap
# ---------------------------------------------------------------------------------------------

_heap_alive = False  # one NVSHMEM runtime per process
_heap_count = 0      # heaps created in this process (keys of the unique-id exchange)


class NvshmemBuffer(SymmetricBuffer):
    """One ``nvshmem_malloc`` allocation, every PE's copy mapped as a cupy array.

    Views are 1-D cupy uint8 arrays of ``nbytes`` on the heap's device, created once at
    allocation; they do not own memory and are invalid after the heap's ``close()``.
    """

    def __init__(self, name: str, nbytes: int, rank: int, base_ptr: int,
                 peer_ptrs: list[int], views: list):
        self.name = name
        self.nbytes = nbytes
        self.base_ptr = base_ptr
        self._rank = rank
        self._peer_ptrs = peer_ptrs
        self._views = views

    def local(self):
        """This PE's copy: ``[nbytes] uint8``, cuda."""
        return self._views[self._rank]

    def peer(self, pe: int):
        """PE ``pe``'s copy through its ``nvshmem_ptr`` mapping: ``[nbytes] uint8``, cuda."""
        return self._views[pe]

    def ptr(self, pe: int) -> int:
        """Device address of PE ``pe``'s copy in this process (``nvshmem_ptr``)."""
        return self._peer_ptrs[pe]


class NvshmemHeap(SymmetricHeap):
    """NVSHMEM symmetric heap over the AFD world (PE == world rank), single node only.

    Constructor (collective): selects CUDA device ``device_id``, exchanges the unique id
    through ``store`` (rank 0 creates it; ``timeout_s`` bounds the wait) and initializes
    NVSHMEM with ``nvshmemx_hostlib_init_attr``. ``alloc``, ``barrier`` and ``close`` are
    collective and host-blocking; none is safe inside CUDA graph capture.
    """

    backend = "cuda"

    def __init__(self, rank: int, world_size: int, store: Store, job_id: str,
                 device_id: int, timeout_s: float = 60.0):
        global _heap_alive, _heap_count
        if _heap_alive:
            raise HeapError("an NvshmemHeap is already open in this process (one per process)")
        import cupy

        self._cupy = cupy
        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id
        self.device_id = device_id
        self.timeout_s = timeout_s
        self._buffers: dict[str, NvshmemBuffer] = {}
        self._closed = True  # until init succeeds: __del__ and close() do nothing
        self._select_device()
        self._lib = load_library()
        self._check_library()
        _heap_count += 1
        self._init_runtime(store, f"nvshmem/{_heap_count}/uniqueid")
        self._closed = False
        _heap_alive = True

    @property
    def xp(self):
        return self._cupy

    # -- start-up --------------------------------------------------------------------------

    def _select_device(self) -> None:
        self._cupy.cuda.Device(self.device_id).use()
        # NOTE: NVSHMEM adopts the current CUDA context; cudaFree(0) makes sure it exists.
        self._cupy.cuda.runtime.free(0)
        os.environ.setdefault("NVSHMEM_DISABLE_NCCL", "1")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

    def _check_library(self) -> None:
        version = library_version(self._lib)
        if version[0] != _SUPPORTED_MAJOR:
            raise BackendUnavailableError(
                f"NVSHMEM {version} found, afd_cupy's binding is pinned to {_SUPPORTED_MAJOR}.x")
        if self._lib.nvshmemx_init_status() != _STATUS_NOT_INITIALIZED:
            raise HeapError("NVSHMEM is already initialized in this process")
        logger.debug("rank %d: NVSHMEM %d.%d.%d on device %d", self.rank, *version,
                     self.device_id)

    def _init_runtime(self, store: Store, uid_key: str) -> None:
        uid = self._exchange_unique_id(store, uid_key)
        attr = new_init_attr()
        _check(self._lib.nvshmemx_set_attr_uniqueid_args(
            self.rank, self.world_size, ctypes.byref(uid), ctypes.byref(attr)),
            "nvshmemx_set_attr_uniqueid_args")
        _check(self._lib.nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID,
                                                    ctypes.byref(attr)),
               "nvshmemx_hostlib_init_attr")
        my_pe, n_pes = self._lib.nvshmem_my_pe(), self._lib.nvshmem_n_pes()
        if (my_pe, n_pes) != (self.rank, self.world_size):
            raise NvshmemError(
                f"NVSHMEM initialized as PE {my_pe} of {n_pes}, expected rank {self.rank} "
                f"of {self.world_size}", call="nvshmem_my_pe/nvshmem_n_pes")

    def _exchange_unique_id(self, store: Store, key: str) -> UniqueId:
        uid = new_unique_id()
        if self.rank == 0:
            _check(self._lib.nvshmemx_get_uniqueid(ctypes.byref(uid)), "nvshmemx_get_uniqueid")
            store_publish(store, key, ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid)))
            return uid
        raw = store_fetch(store, key, self.timeout_s, peer=0)
        if len(raw) != ctypes.sizeof(UniqueId):
            raise NvshmemError(f"unique id from rank 0 has {len(raw)} bytes, expected "
                               f"{ctypes.sizeof(UniqueId)}", call="nvshmemx_get_uniqueid")
        ctypes.memmove(ctypes.addressof(uid), raw, len(raw))
        return uid

    # -- allocation ------------------------------------------------------------------------

    def alloc(self, nbytes: int, name: str) -> NvshmemBuffer:
        """Collective: ``nvshmem_malloc(nbytes)``, zeroed, every PE mapped, then a barrier.

        Every rank must call with the same ``nbytes`` and ``name``, in the same order.
        Raises NvshmemError when the symmetric heap is exhausted, HeapError when a PE is not
        reachable by load/store (``nvshmem_ptr`` NULL).
        """
        self._check_open()
        if nbytes <= 0:
            raise ValueError(f"alloc({name!r}): nbytes must be positive, got {nbytes}")
        if name in self._buffers:
            raise ValueError(f"alloc({name!r}): name already allocated on this heap")
        self._check_fits_device(nbytes, name)
        base_ptr = self._lib.nvshmem_malloc(nbytes)
        if not base_ptr:
            raise NvshmemError(
                f"nvshmem_malloc({nbytes}) for {name!r} returned NULL: symmetric heap exhausted; "
                f"raise NVSHMEM_SYMMETRIC_SIZE (bytes per PE; with CUDA VMM the heap grows up "
                f"to NVSHMEM_MAX_MEMORY_PER_GPU)", call="nvshmem_malloc")
        peer_ptrs = [self._peer_ptr(base_ptr, pe) for pe in range(self.world_size)]
        views = [self._wrap(ptr, nbytes) for ptr in peer_ptrs]
        self._zero(views[self.rank])
        buffer = NvshmemBuffer(name, nbytes, self.rank, base_ptr, peer_ptrs, views)
        self._buffers[name] = buffer
        # No peer may write into this buffer before every PE zeroed its copy.
        self._lib.nvshmem_barrier_all()
        return buffer

    def _check_fits_device(self, nbytes: int, name: str) -> None:
        """Refuse a request larger than the whole device before NVSHMEM sees it.

        NOTE: NVSHMEM 3.4 does not return NULL when it cannot back the heap with physical
        memory: it fails inside nvshmem_malloc's barrier and exits the process (observed on
        H200). Every PE sees the same total, so this check agrees across ranks.
        """
        _, total_bytes = self._cupy.cuda.runtime.memGetInfo()
        if nbytes > total_bytes:
            raise NvshmemError(
                f"alloc({name!r}) of {nbytes} bytes exceeds device {self.device_id}'s "
                f"{total_bytes} bytes", call="nvshmem_malloc")

    def _peer_ptr(self, base_ptr: int, pe: int) -> int:
        ptr = self._lib.nvshmem_ptr(base_ptr, pe)
        if not ptr:
            raise HeapError(
                f"nvshmem_ptr returned NULL for PE {pe} on PE {self.rank}: PE {pe} is not "
                f"reachable by load/store; the cuda backend supports a single node with "
                f"NVLink/P2P only")
        return ptr

    def _wrap(self, ptr: int, nbytes: int):
        cupy = self._cupy
        memory = cupy.cuda.UnownedMemory(ptr, nbytes, self, device_id=self.device_id)
        return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))

    def _zero(self, view) -> None:
        stream = self._cupy.cuda.get_current_stream()
        self._cupy.cuda.runtime.memsetAsync(view.data.ptr, 0, view.nbytes, stream.ptr)
        stream.synchronize()

    # -- collective sync and teardown -------------------------------------------------------

    def barrier(self) -> None:
        """Collective: synchronize this device, then ``nvshmem_barrier_all`` (host-blocking)."""
        self._check_open()
        self._cupy.cuda.runtime.deviceSynchronize()
        self._lib.nvshmem_barrier_all()

    def close(self) -> None:
        """Collective: barrier, ``nvshmem_free`` every buffer, ``nvshmemx_hostlib_finalize``.

        Idempotent. Every view handed out becomes invalid.
        """
        global _heap_alive
        if self._closed:
            return
        self._closed = True
        try:
            self._cupy.cuda.runtime.deviceSynchronize()
            self._lib.nvshmem_barrier_all()
            for buffer in self._buffers.values():
                buffer._views = []
                self._lib.nvshmem_free(buffer.base_ptr)
            self._buffers.clear()
        finally:
            self._lib.nvshmemx_hostlib_finalize()  # pairs with nvshmemx_hostlib_init_attr
            _heap_alive = False

    def _check_open(self) -> None:
        if self._closed:
            raise HeapError(f"NVSHMEM heap of rank {self.rank} is closed")

    def __del__(self):
        if not getattr(self, "_closed", True):
            logger.warning("NvshmemHeap of rank %d garbage-collected without close(): "
                           "NVSHMEM resources are released only at process exit", self.rank)
