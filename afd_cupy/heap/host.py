"""The host backend's symmetric heap: POSIX shared memory in ``/dev/shm``, numpy views.

Every rank creates its own segment per allocation and maps every peer's segment, so rank r
can write one-sided into ``buf.peer(s)`` exactly as on the cuda backend. Segment files are
named ``afd_{job_id}_{name}_{rank}_{token}`` (sanitized; ``token``: the creating process's
pid and a random suffix, so that two jobs on one host never collide, even with the same
``job_id``: peers learn the path through the store). The owner unlinks them once every peer
mapped them, in ``close()``, at interpreter exit, when its launcher dies
(:func:`unlink_own_segments`), or the launcher does it (:func:`cleanup_job_segments`)
after a kill.

NOTE: multiprocessing.shared_memory is not used: its resource tracker unlinks segments that
another process still maps (and warns about "leaks") when several processes share them.
"""
from __future__ import annotations

import glob
import logging
import mmap
import os
import re
import secrets
import time
import weakref

import numpy as np

from afd_cupy.errors import HeapError, PeerTimeoutError
from afd_cupy.heap.base import SymmetricBuffer, SymmetricHeap, UNHEALTHY_CLOSE_S, closing_barrier
from afd_cupy.runtime.store import Store, agreed_barrier, store_barrier, store_fetch, store_publish
from afd_cupy.runtime.timeouts import check_timeout

logger = logging.getLogger("afd_cupy")

SHM_DIR = "/dev/shm"
_SEGMENT_PREFIX = "afd_"
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")

# Heap instances per job in this process, in creation order: every rank creates its heaps in
# the same order, so the counter is a key prefix that all ranks agree on.
_heap_counts: dict[str, int] = {}
# Every segment this process created and has not unlinked yet (unlink_own_segments).
_live_segments: set[str] = set()
_process_token: list = [None, ""]  # [pid it was made for, token]


def _sanitize(text: str) -> str:
    return _UNSAFE_CHARS.sub("_", text)


def process_token() -> str:
    """This process's part of its segment names: its pid and a random suffix (made anew in a
    forked child), without ``_``."""
    if _process_token[0] != os.getpid():
        _process_token[:] = [os.getpid(), f"{os.getpid()}x{secrets.token_hex(3)}"]
    return _process_token[1]


def segment_path(job_id: str, name: str, rank: int, token: str | None = None) -> str:
    """Path of rank ``rank``'s segment of allocation ``name`` in job ``job_id``, created by
    the process of ``token`` (default: this process, :func:`process_token`)."""
    token = process_token() if token is None else token
    return os.path.join(SHM_DIR, f"{_SEGMENT_PREFIX}{_sanitize(job_id)}_{_sanitize(name)}_{rank}_"
                                 f"{_sanitize(token)}")


def segment_glob(job_id: str) -> str:
    """glob pattern of every segment of job ``job_id``."""
    return os.path.join(SHM_DIR, f"{_SEGMENT_PREFIX}{glob.escape(_sanitize(job_id))}_*")


def cleanup_job_segments(job_id: str, ranks=None) -> list[str]:
    """Unlink every ``/dev/shm/afd_{job_id}_*`` left behind (e.g. by killed processes), or
    only those of world ranks ``ranks`` (a launch that started part of the job must not
    unlink a segment another launch's live rank still has to map).

    Not collective; meant for the launcher's ``finally``. Returns the paths removed.
    NOTE: job ids must not be prefixes of one another (the launcher uses random hex ids).
    """
    pattern = segment_glob(job_id)
    wanted = None if ranks is None else {int(rank) for rank in ranks}
    removed = []
    for path in glob.glob(pattern):
        if wanted is not None and _segment_rank(path) not in wanted:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    if removed:
        logger.info("removed %d leftover shared-memory segment(s) of job %s", len(removed), job_id)
    return removed


def _segment_rank(path: str) -> int | None:
    """The rank field of a segment path (``..._{rank}_{token}``), None when it has none."""
    parts = os.path.basename(path).rsplit("_", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def unlink_own_segments() -> list[str]:
    """Unlink every segment this process created and still owns (peers that mapped one keep
    their mapping). For a rank about to die without its ``close()`` (its launcher is gone:
    :mod:`afd_cupy.runtime.orphan`). Not collective; returns the paths removed."""
    paths = sorted(_live_segments)
    _unlink_all(list(paths))
    return paths


def _unlink_all(paths: list[str]) -> None:
    """Finalizer: unlink own segments (no collective work, safe at interpreter exit)."""
    while paths:
        path = paths.pop()
        _live_segments.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _create_segment(path: str, nbytes: int) -> mmap.mmap:
    """Create, size (zero-filled by the kernel) and map a new segment; fails if it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        raise HeapError(f"shared-memory segment {path} already exists: allocation name "
                        f"reused in this job, or a previous run of the job was not cleaned"
                        ) from None
    _live_segments.add(path)  # from here on a dying rank unlinks it (unlink_own_segments)
    try:
        os.ftruncate(fd, nbytes)
        _reserve(fd, path, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        _unlink_all([path])
        raise
    finally:
        os.close(fd)


def _reserve(fd: int, path: str, nbytes: int) -> None:
    """Reserve the segment's pages now, so that a full /dev/shm is a HeapError here and not
    a SIGBUS on the first large batch (a sparse segment's pages are allocated on first touch)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        stat = os.statvfs(os.path.dirname(path))
        free = stat.f_bavail * stat.f_frsize
        raise HeapError(
            f"cannot reserve {nbytes} B ({nbytes / 2**20:.1f} MiB) of shared memory for {path}: "
            f"{exc.strerror}; {os.path.dirname(path)} has {free / 2**20:.1f} MiB free of "
            f"{stat.f_blocks * stat.f_frsize / 2**20:.1f} MiB. Every rank on this host needs one "
            "window (afd_cupy.wire.window_size_hint): enlarge /dev/shm (docker run --shm-size=..., "
            "or mount -o remount,size=... /dev/shm) or lower max_num_batched_tokens / "
            "routed_cap_multiplier") from None


def _map_peer_segment(path: str, nbytes: int, peer: int) -> mmap.mmap:
    """Map peer ``peer``'s segment, checking that it holds exactly ``nbytes``."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise HeapError(f"segment {path} of peer {peer} is missing (peer died or closed?)"
                        ) from None
    try:
        peer_nbytes = os.fstat(fd).st_size
        if peer_nbytes != nbytes:
            raise HeapError(f"peer {peer}'s segment {path} has {peer_nbytes} bytes, "
                            f"this rank allocated {nbytes}: alloc sizes differ across ranks")
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class HostBuffer(SymmetricBuffer):
    """One symmetric allocation: ``nbytes`` of shared memory per rank, all mapped here.

    Views are 1-D numpy uint8 arrays of ``nbytes``, created once at allocation and owned by
    the heap: they become invalid after the heap's ``close()``.
    """

    def __init__(self, name: str, nbytes: int, rank: int, maps: list[mmap.mmap]):
        self.name = name
        self.nbytes = nbytes
        self._rank = rank
        self._maps = maps
        self._views = [np.frombuffer(m, dtype=np.uint8) for m in maps]

    def local(self) -> np.ndarray:
        """This rank's copy: ``[nbytes] uint8``, host."""
        return self._views[self._rank]

    def peer(self, pe: int) -> np.ndarray:
        """Rank ``pe``'s copy mapped here: ``[nbytes] uint8``, host."""
        return self._views[pe]

    def ptr(self, pe: int) -> int:
        """Address of rank ``pe``'s copy in this process."""
        return self._views[pe].ctypes.data

    def release(self) -> None:
        """Drop the views and unmap (the heap's ``close()`` calls it); a view still held
        elsewhere keeps its map alive."""
        self._views = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                logger.debug("buffer %s: a view is still referenced; unmapped when released",
                             self.name)
        self._maps = []


class HostHeap(SymmetricHeap):
    """Symmetric heap over POSIX shared memory for ``world_size`` processes on one host.

    ``store`` is this job's rendezvous store (namespaced per job); ``timeout_s`` bounds every
    wait for a peer. ``alloc``, ``barrier`` and ``close`` are collective.
    """

    backend = "host"
    _label = "host heap"
    _unclosed_note = "own segments unlinked, peers may still map them"

    def __init__(self, rank: int, world_size: int, store: Store, job_id: str,
                 timeout_s: float = 60.0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.timeout_s = check_timeout("host heap timeout_s", timeout_s)
        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id
        self._store = store
        heap_idx = _heap_counts.get(job_id, 0)
        _heap_counts[job_id] = heap_idx + 1
        self._key_prefix = f"hostheap/{heap_idx}"
        self._buffers: dict[str, HostBuffer] = {}
        self._own_paths: list[str] = []
        self._finalizer = weakref.finalize(self, _unlink_all, self._own_paths)
        self._peer_failed = False  # an alloc failed waiting on a peer
        self._closed = False

    @property
    def xp(self):
        return np

    def alloc(self, nbytes: int, name: str) -> HostBuffer:
        """Collective: ``nbytes`` zero-filled bytes on every rank, every peer mapped here.

        Every rank must call with the same ``nbytes`` and ``name``, in the same order.
        Raises ValueError for a non-positive size or a reused name, HeapError when a peer's
        segment has another size, PeerTimeoutError when a peer does not publish in time.
        """
        self._check_open()
        if nbytes <= 0:
            raise ValueError(f"alloc({name!r}): nbytes must be positive, got {nbytes}")
        if name in self._buffers:
            raise ValueError(f"alloc({name!r}): name already allocated on this heap")
        own_path = segment_path(self.job_id, name, self.rank)
        own_map = _create_segment(own_path, nbytes)
        self._own_paths.append(own_path)
        try:
            maps = self._exchange_segments(name, nbytes, own_path, own_map)
        except BaseException:
            self._peer_failed = True  # close() must not wait the full bound for a lost peer
            raise
        self._buffers[name] = HostBuffer(name, nbytes, self.rank, maps)
        _unlink_all([own_path])
        self._own_paths.remove(own_path)
        return self._buffers[name]

    def _exchange_segments(self, name: str, nbytes: int, own_path: str, own_map) -> list:
        """Publish this rank's segment, map every peer's, and wait until every rank mapped
        every segment: one ``timeout_s`` deadline for all of it (not one per peer)."""
        deadline = time.monotonic() + self.timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        store_publish(self._store, self._segment_key(name, self.rank), own_path.encode())
        maps = []
        try:
            for pe in range(self.world_size):
                if pe == self.rank:
                    maps.append(own_map)
                    continue
                path = store_fetch(self._store, self._segment_key(name, pe), left(), peer=pe).decode()
                maps.append(_map_peer_segment(path, nbytes, pe))
            # Once every rank mapped every segment, the names are no longer needed: unlinking
            # them now means a kill -9 of any rank leaves nothing behind in /dev/shm.
            store_barrier(self._store, f"{self._key_prefix}/mapped/{name}", self.world_size, left())
        except PeerTimeoutError as err:
            raise PeerTimeoutError(f"host heap of rank {self.rank}, alloc({name!r}): {err} (the "
                                   f"alloc's bound is {self.timeout_s:.1f} s in all)",
                                   peer=err.peer) from None
        return maps

    def _segment_key(self, name: str, pe: int) -> str:
        return f"{self._key_prefix}/{name}/{pe}"

    def barrier(self) -> None:
        """Collective host-blocking barrier over the world, bounded by ``timeout_s``."""
        self._check_open()
        store_barrier(self._store, f"{self._key_prefix}/barrier", self.world_size, self.timeout_s)

    def close(self, *, peers_healthy: bool = True) -> None:
        """Collective: barrier, unmap every buffer, unlink own segments. Idempotent.

        The barrier waits ``timeout_s``, or at most ``UNHEALTHY_CLOSE_S`` with
        ``peers_healthy=False`` (a peer died) or after an ``alloc`` that failed on a peer;
        when the job gives up on it, or the store is gone (its host died), the ranks close
        without each other (logged, never raised).
        """
        if self._closed:
            return
        self._closed = True
        try:
            healthy = peers_healthy and not self._peer_failed
            timeout_s = self.timeout_s if healthy else min(UNHEALTHY_CLOSE_S, self.timeout_s)
            if not closing_barrier(agreed_barrier, self._store, f"{self._key_prefix}/close",
                                   self.world_size, timeout_s):
                logger.warning("host heap of rank %d closed without its peers: not every rank reached "
                               "the closing barrier (this rank waited %.1f s)", self.rank, timeout_s)
        finally:
            for buffer in self._buffers.values():
                buffer.release()
            self._buffers.clear()
            self._finalizer()
