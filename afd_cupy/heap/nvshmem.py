"""The cuda backend's symmetric heap: NVSHMEM through the ctypes binding of
:mod:`afd_cupy.heap.nvshmem_lib`.

``NvshmemHeap`` bootstraps NVSHMEM over the AFD world with a unique id exchanged through the
store, allocates symmetric buffers and maps every PE's copy as a cupy array
(``NvshmemBuffer``). Only one NvshmemHeap may live in a process (NVSHMEM is a per-process
runtime). Importing this module loads neither CuPy nor the library: both happen in the
constructor.

Environment: the constructor applies ``env`` (default: afd_cupy's defaults) with
:func:`~afd_cupy.heap.nvshmem_env.apply_nvshmem_env` before NVSHMEM initializes; the dict, its
validation and its precedence rules live in :mod:`afd_cupy.heap.nvshmem_env` (re-exported
here). ``NVSHMEM_SYMMETRIC_SIZE`` bounds the heap. ``AFD_NVSHMEM_LIB`` is read by the binding
through :mod:`afd_cupy.runtime.env`.
"""
from __future__ import annotations

import ctypes
import logging

from afd_cupy.errors import BackendUnavailableError, HeapError, NvshmemError, PeerTimeoutError
from afd_cupy.heap.base import SymmetricBuffer, SymmetricHeap, UNHEALTHY_CLOSE_S, closing_barrier
from afd_cupy.heap.nvshmem_env import (NVSHMEM_DEFAULTS, REMOTE_TRANSPORTS,  # noqa: F401 - re-exported
                                       apply_nvshmem_env, nvshmem_env, nvshmem_heap_bytes)
from afd_cupy.heap.nvshmem_lib import (NVSHMEMX_INIT_WITH_UNIQUEID, STATUS_NOT_INITIALIZED,
                                       SUPPORTED_MAJOR, UniqueId, check_rc, library_version,
                                       load_library, new_init_attr, new_unique_id)
from afd_cupy.runtime.store import Store, agreed_barrier, store_fetch, store_publish
from afd_cupy.runtime.timeouts import check_timeout

logger = logging.getLogger("afd_cupy")

__all__ = ["NvshmemBuffer", "NvshmemHeap", "NVSHMEM_DEFAULTS", "REMOTE_TRANSPORTS",
           "apply_nvshmem_env", "nvshmem_env", "nvshmem_heap_bytes"]


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
        """PE ``pe``'s copy through its ``nvshmem_ptr`` mapping: ``[nbytes] uint8``, cuda;
        None for a PE that is not mapped (``alloc(allow_unmapped=True)``)."""
        return self._views[pe]

    def ptr(self, pe: int) -> int:
        """Device address of PE ``pe``'s copy in this process (``nvshmem_ptr``); 0 when not
        mapped. The symmetric address NVSHMEM's puts take is ``base_ptr`` (this PE's copy)."""
        return self._peer_ptrs[pe]

    def release(self) -> None:
        """Drop the views (the heap's ``close()`` calls it, then ``nvshmem_free``s the memory)."""
        self._views = []


class NvshmemHeap(SymmetricHeap):
    """NVSHMEM symmetric heap over the AFD world (PE == world rank). Peers must be load/store
    reachable unless a buffer is allocated with ``allow_unmapped`` (the put transport).

    Constructor (collective): writes ``env`` (a :func:`nvshmem_env` dict; None: the defaults)
    into ``os.environ`` with :func:`apply_nvshmem_env` (process-wide; a conflicting explicit
    value raises ConfigError before any CUDA call), selects CUDA device ``device_id``,
    exchanges the unique id through
    ``store`` (rank 0 creates it; ``timeout_s`` bounds the wait) and initializes NVSHMEM with
    ``nvshmemx_hostlib_init_attr``. ``alloc``, ``barrier`` and ``close`` are
    collective and host-blocking; none is safe inside CUDA graph capture.
    """

    backend = "cuda"
    _label = "NVSHMEM heap"
    _unclosed_note = "NVSHMEM resources are released only at process exit"

    def __init__(self, rank: int, world_size: int, store: Store, job_id: str,
                 device_id: int, timeout_s: float = 60.0, env: dict[str, str] | None = None):
        global _heap_alive, _heap_count
        if _heap_alive:
            raise HeapError("an NvshmemHeap is already open in this process (one per process)")
        timeout_s = check_timeout("NVSHMEM heap timeout_s", timeout_s)
        # NOTE: first, so that a conflicting environment fails before any CUDA or NVSHMEM work;
        # NVSHMEM reads these variables in nvshmemx_hostlib_init_attr (_init_runtime).
        self.nvshmem_env = apply_nvshmem_env(env)
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
        self._store = store
        self._barrier_name = f"nvshmem/{_heap_count}/barrier"
        self._init_runtime(store, f"nvshmem/{_heap_count}/uniqueid")
        self._closed = False
        _heap_alive = True

    @property
    def xp(self):
        return self._cupy

    @property
    def lib(self):
        """The bound NVSHMEM host library (:func:`~afd_cupy.heap.nvshmem_lib.load_library`):
        the put transport's on-stream puts and quiet (docs/design/put-transport.md)."""
        return self._lib

    # -- start-up --------------------------------------------------------------------------

    def _select_device(self) -> None:
        self._cupy.cuda.Device(self.device_id).use()
        # NOTE: NVSHMEM adopts the current CUDA context; cudaFree(0) makes sure it exists.
        self._cupy.cuda.runtime.free(0)

    def _check_library(self) -> None:
        version = library_version(self._lib)
        if version[0] != SUPPORTED_MAJOR:
            raise BackendUnavailableError(
                f"NVSHMEM {version} found, afd_cupy's binding is pinned to {SUPPORTED_MAJOR}.x")
        if self._lib.nvshmemx_init_status() != STATUS_NOT_INITIALIZED:
            raise HeapError("NVSHMEM is already initialized in this process")
        logger.debug("rank %d: NVSHMEM %d.%d.%d on device %d", self.rank, *version,
                     self.device_id)

    def _init_runtime(self, store: Store, uid_key: str) -> None:
        uid = self._exchange_unique_id(store, uid_key)
        # NVSHMEM's bootstrap waits for every PE: enter it only when all PEs hold the unique
        # id, with the same verdict on every PE (a PE late past timeout_s: all raise here)
        if not agreed_barrier(store, f"{uid_key}/init", self.world_size, self.timeout_s):
            raise PeerTimeoutError(f"NVSHMEM PE {self.rank}: not every one of the {self.world_size} "
                                   f"PEs was ready to initialize within {self.timeout_s:.1f} s")
        attr = new_init_attr()
        check_rc(self._lib.nvshmemx_set_attr_uniqueid_args(
            self.rank, self.world_size, ctypes.byref(uid), ctypes.byref(attr)),
            "nvshmemx_set_attr_uniqueid_args")
        check_rc(self._lib.nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID,
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
            check_rc(self._lib.nvshmemx_get_uniqueid(ctypes.byref(uid)), "nvshmemx_get_uniqueid")
            store_publish(store, key, ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid)))
            return uid
        raw = store_fetch(store, key, self.timeout_s, peer=0)
        if len(raw) != ctypes.sizeof(UniqueId):
            raise NvshmemError(f"unique id from rank 0 has {len(raw)} bytes, expected "
                               f"{ctypes.sizeof(UniqueId)}", call="nvshmemx_get_uniqueid")
        ctypes.memmove(ctypes.addressof(uid), raw, len(raw))
        return uid

    # -- allocation ------------------------------------------------------------------------

    def alloc(self, nbytes: int, name: str, *, allow_unmapped: bool = False) -> NvshmemBuffer:
        """Collective: ``nvshmem_malloc(nbytes)``, zeroed, every PE mapped, then a barrier.

        Every rank must call with the same ``nbytes`` and ``name``, in the same order.
        Raises NvshmemError when the symmetric heap is exhausted, HeapError when a PE is not
        reachable by load/store (``nvshmem_ptr`` NULL), unless ``allow_unmapped`` (the put
        transport, docs/design/put-transport.md): then such a PE's ``ptr`` is 0 and its ``peer`` view
        None, and only NVSHMEM puts reach it.
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
        peer_ptrs = [self._lib.nvshmem_ptr(base_ptr, pe) or 0 for pe in range(self.world_size)]
        if not allow_unmapped:
            self._agree_reachable(name, [pe for pe, ptr in enumerate(peer_ptrs) if not ptr], base_ptr)
        views = [self._wrap(ptr, nbytes) if ptr else None for ptr in peer_ptrs]
        self._zero(views[self.rank])
        buffer = NvshmemBuffer(name, nbytes, self.rank, base_ptr, peer_ptrs, views)
        self._buffers[name] = buffer
        # No peer may write into this buffer before every PE zeroed its copy.
        self._bounded_barrier()
        return buffer

    def _check_fits_device(self, nbytes: int, name: str) -> None:
        """Collective: refuse a request larger than the free memory of any PE's device
        before NVSHMEM sees it, with the same NvshmemError on every PE.

        NOTE: NVSHMEM 3.4 does not return NULL when it cannot back the heap with physical
        memory: it fails inside nvshmem_malloc's barrier and exits the process (observed on
        H200). Free memory differs between PEs, so the verdict is exchanged (``_every_pe_says``)
        and every PE raises or none does. PEs sharing one GPU each see the memory free before
        any of them allocates: their sum can still exceed it (then NVSHMEM's own failure).
        """
        free_bytes, total_bytes = self._cupy.cuda.runtime.memGetInfo()
        mine = ""
        if nbytes > free_bytes:
            mine = (f"PE {self.rank} (device {self.device_id}): {nbytes} bytes requested, "
                    f"{free_bytes} free of {total_bytes}")
        problems = self._every_pe_says(f"fits/{name}", mine)
        if problems:
            raise NvshmemError(f"alloc({name!r}) does not fit: {'; '.join(problems)}; lower "
                               f"max_num_batched_tokens or routed_cap_multiplier, or free device "
                               f"memory", call="nvshmem_malloc")

    def _agree_reachable(self, name: str, unreachable: list[int], base_ptr: int) -> None:
        """Collective: every PE publishes which PEs its ``nvshmem_ptr`` could not map, and
        every PE raises the same HeapError if any PE found one (a NULL mapping on one PE must
        not leave the others inside a barrier). The buffer is then freed collectively and the
        heap stays healthy: ``close()`` finalizes NVSHMEM as usual.
        """
        problems = self._every_pe_says(f"reach/{name}", "; ".join(
            f"PE {other} on PE {self.rank}" for other in unreachable))
        if not problems:
            return
        self._lib.nvshmem_free(base_ptr)  # collective: every PE is here, on the same verdict
        raise HeapError(
            f"nvshmem_ptr returned NULL for {'; '.join(problems)}: not reachable by load/store; "
            f"the cuda backend supports peers on one node with NVLink/P2P only")

    def any_pe(self, topic: str, mine: str) -> list[str]:
        """Collective (bounded by ``timeout_s``): every PE's non-empty ``mine``, in PE order,
        the same list on every PE (e.g. which PEs need a put staging buffer)."""
        self._check_open()
        return self._every_pe_says(topic, mine)

    def _every_pe_says(self, topic: str, problem: str) -> list[str]:
        """Collective (bounded by ``timeout_s``): publish this PE's ``problem`` ("" = none)
        and return every PE's non-empty one, in PE order: the same list on every PE, so
        every PE takes the same branch before the next NVSHMEM collective. A PE that is late
        past ``timeout_s`` makes every PE raise PeerTimeoutError (one verdict through
        :func:`agreed_barrier`), never some PEs raise while the others go on into a
        collective the raising ones will not join."""
        key = f"{self._barrier_name}/{topic}"
        store_publish(self._store, f"{key}/{self.rank}", problem.encode())
        if not agreed_barrier(self._store, f"{key}/published", self.world_size, self.timeout_s):
            raise PeerTimeoutError(f"NVSHMEM PE {self.rank}: not every one of the {self.world_size} "
                                   f"PEs published {topic!r} within {self.timeout_s:.1f} s")
        # every PE published before it arrived at the barrier: these return at once
        said = [store_fetch(self._store, f"{key}/{pe}", self.timeout_s, peer=pe).decode()
                for pe in range(self.world_size)]
        return [text for text in said if text]

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
        """Collective: synchronize this device, then a bounded barrier (host-blocking)."""
        self._check_open()
        self._cupy.cuda.runtime.deviceSynchronize()
        self._bounded_barrier()

    def _bounded_barrier(self) -> None:
        """``nvshmem_barrier_all`` once every PE has arrived at a store barrier bounded by
        ``timeout_s``: NVSHMEM's own barrier has no timeout, a dead peer would hang it. The
        store barrier's verdict is the same on every PE (:func:`agreed_barrier`): all enter
        ``nvshmem_barrier_all``, or all raise PeerTimeoutError."""
        if not agreed_barrier(self._store, self._barrier_name, self.world_size, self.timeout_s):
            raise PeerTimeoutError(f"NVSHMEM barrier of rank {self.rank}: not every one of the "
                                   f"{self.world_size} PEs arrived within {self.timeout_s:.1f} s")
        self._lib.nvshmem_barrier_all()

    def close(self, *, peers_healthy: bool = True) -> None:
        """Collective: barrier, ``nvshmem_free`` every buffer, ``nvshmemx_hostlib_finalize``.

        Idempotent. Every view handed out becomes invalid. The closing barrier waits
        ``timeout_s``, or ``UNHEALTHY_CLOSE_S`` with ``peers_healthy=False``; when the job gives
        up on it (:func:`~afd_cupy.runtime.store.agreed_barrier`: the same verdict on every rank) the
        heap is abandoned instead: NVSHMEM's teardown is collective and would hang on a peer
        that is gone, so nothing is freed and this process cannot start NVSHMEM again
        (restart it).
        """
        global _heap_alive
        if self._closed:
            return
        self._closed = True
        self._cupy.cuda.runtime.deviceSynchronize()
        timeout_s = self.timeout_s if peers_healthy else min(UNHEALTHY_CLOSE_S, self.timeout_s)
        # every rank learns the same verdict: all of them free and finalize, or none does
        if not closing_barrier(agreed_barrier, self._store, f"{self._barrier_name}/close",
                               self.world_size, timeout_s):
            logger.warning("NVSHMEM heap of rank %d abandoned: not every rank reached the closing "
                           "barrier (this rank waited %.1f s)", self.rank, timeout_s)
            self._buffers.clear()
            return
        try:
            self._lib.nvshmem_barrier_all()
            for buffer in self._buffers.values():
                buffer.release()
                self._lib.nvshmem_free(buffer.base_ptr)
            self._buffers.clear()
        finally:
            self._lib.nvshmemx_hostlib_finalize()  # pairs with nvshmemx_hostlib_init_attr
            _heap_alive = False
