"""The symmetric-heap interface shared by the NVSHMEM heap and the POSIX shared-memory heap.

A heap spans the whole AFD world (Attention ranks first, then FFN ranks; PE == world rank).
Allocation is collective: every rank calls ``alloc`` in the same order with the same size,
and rank r's buffer k is "the same" symmetric object as rank s's buffer k, so a sender can
write into ``buf.peer(s)`` one-sided.
"""
from __future__ import annotations

import abc
import logging
from typing import Any

from afd_cupy.errors import HeapError

logger = logging.getLogger("afd_cupy")


#: bound of a closing barrier once a peer is known to have failed (seconds)
UNHEALTHY_CLOSE_S = 0.5


def closing_barrier(barrier, store, name: str, world_size: int, timeout_s: float) -> bool:
    """``barrier(store, name, world_size, timeout_s)`` (the heap's
    :func:`afd_cupy.runtime.store.agreed_barrier`) for a heap's ``close()``, which never raises: a
    store that fails (its host is gone: torch's ``DistNetworkError``, a
    :class:`~afd_cupy.runtime.kvstore.StoreLostError`) is logged and counts as "not every rank
    arrived" (False), the verdict a rank gets when its peers give up on the barrier."""
    try:
        return barrier(store, name, world_size, timeout_s)
    except Exception as exc:  # noqa: BLE001 - close problems are logged, not raised
        logger.warning("closing barrier %r: the store is unusable (%s: %s); closing without the "
                       "peers", name, type(exc).__name__, exc)
        return False


class SymmetricBuffer(abc.ABC):
    """One symmetric allocation of ``nbytes`` bytes on every rank."""

    nbytes: int

    @abc.abstractmethod
    def local(self) -> Any:
        """This rank's copy: 1-D uint8 array of ``nbytes`` (numpy for host, cupy for cuda)."""

    @abc.abstractmethod
    def peer(self, pe: int) -> Any:
        """Rank ``pe``'s copy mapped into this process: 1-D uint8 array of ``nbytes``.

        ``peer(self_rank)`` is the local copy. Views are created once at allocation, so this
        call is cheap and safe on the hot path.
        """

    @abc.abstractmethod
    def ptr(self, pe: int) -> int:
        """Address of rank ``pe``'s copy in this process (device pointer for cuda)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Drop this process's views of the buffer; called once by the heap's collective
        ``close()`` (not collective itself); the buffer is unusable after."""


class SymmetricHeap(abc.ABC):
    """A symmetric heap over the AFD world. ``close()`` is collective.

    Subclasses set ``self._closed`` (False once open, True after ``close()``), call
    ``_check_open()`` at the top of every collective call, and name themselves in errors and
    in the unclosed-heap warning through ``_label`` and ``_unclosed_note``.
    """

    backend: str  # "cuda" or "host"
    rank: int
    world_size: int
    _closed: bool
    _label: str  # e.g. "host heap": "<label> of rank r is closed"
    _unclosed_note: str  # what garbage collection without close() leaves behind

    @property
    @abc.abstractmethod
    def xp(self) -> Any:
        """Array module of the buffers: numpy (host) or cupy (cuda)."""

    @abc.abstractmethod
    def alloc(self, nbytes: int, name: str) -> SymmetricBuffer:
        """Collective: allocate ``nbytes`` on every rank, zero-filled, and map all peers."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective host-blocking barrier over the whole world."""

    @abc.abstractmethod
    def close(self, *, peers_healthy: bool = True) -> None:
        """Collective: free every buffer and tear the heap down. Idempotent.

        ``peers_healthy=False`` (a peer timed out or died): do not wait for the peers longer
        than a short bound; return promptly, leaving what cannot be freed safely."""

    def _check_open(self) -> None:
        """Raise HeapError when the heap is closed."""
        if self._closed:
            raise HeapError(f"{self._label} of rank {self.rank} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # NOTE: close() is collective, so garbage collection must not call it: warn only.
        if not getattr(self, "_closed", True):
            logger.warning("%s of rank %d garbage-collected without close(): %s",
                           type(self).__name__, self.rank, self._unclosed_note)
