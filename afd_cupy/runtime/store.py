"""The rendezvous store: a small key-value service every rank of a job can reach.

Ranks use it only at start-up and teardown (unique ids, segment names, barriers), never on
the hot path. ``torch.distributed.TCPStore`` and :class:`afd_cupy.runtime.kvstore.KVClient` satisfy the
:class:`Store` protocol; the launcher (``afd_cupy.runtime.launch``) serves the store from the parent
process (a :class:`~afd_cupy.runtime.kvstore.KVServer`, or a TCPStore master for a job several
launchers start).

Every wait here is bounded: a missing peer becomes a :class:`~afd_cupy.errors.PeerTimeoutError`
naming how many ranks arrived, never a hang.
"""
from __future__ import annotations

import math
import socket
import threading
import time
import weakref
from typing import Protocol, runtime_checkable

from afd_cupy.errors import ConfigError, PeerTimeoutError
from afd_cupy.runtime.timeouts import check_timeout

# Polling interval bounds of the bounded waits (seconds): start short for latency, back off
# so that a long wait does not burn a core.
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.02


@runtime_checkable
class Store(Protocol):
    """What afd_cupy needs from a rendezvous store (``torch.distributed.TCPStore`` fits)."""

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwrites)."""

    def get(self, key: str) -> bytes:
        """Value of ``key``; blocks until it is present, bounded by the store's timeout."""

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if absent); return the sum."""


def create_store(host: str, port: int, world_size: int, is_master: bool,
                 timeout_s: float) -> Store:
    """A ``torch.distributed.TCPStore`` (master or client) with a ``timeout_s`` bound: the
    store of a job whose ranks several launchers start (a launch running a job alone hosts
    the torch-free :class:`afd_cupy.runtime.kvstore.KVServer` instead).

    The master does not wait for workers (``wait_for_workers=False``) so that it can be
    started before the processes that connect to it. torch is imported here, lazily.
    """
    check_timeout("timeout_s", timeout_s)
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(host, port, world_size, is_master,
                    timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False if is_master else True)


def connect_store(kind: str, host: str, port: int, world_size: int, timeout_s: float) -> Store:
    """A client of the store at ``host:port``: ``kind`` "afd" for a
    :class:`~afd_cupy.runtime.kvstore.KVServer` (what :func:`afd_cupy.runtime.launch.launch` hosts for a job it
    runs alone), "torch" for a ``torch.distributed.TCPStore`` master."""
    if kind == "afd":
        from afd_cupy.runtime.kvstore import KVClient

        return KVClient(host, port, timeout_s)
    if kind == "torch":
        return create_store(host, port, world_size, is_master=False, timeout_s=timeout_s)
    raise ValueError(f"store kind must be 'afd' or 'torch', got {kind!r}")


def bound_listener(host: str, port: int = 0, backlog: int = 1024) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port, read it back with
    ``getsockname()[1]``) and listening: processes may connect to the address at once, and
    a store server started later on the socket (:class:`afd_cupy.runtime.kvstore.KVServer`) serves
    them. No race with another process taking the port, unlike :func:`free_port`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class NamespacedStore:
    """A view of ``store`` whose keys are prefixed with ``f"{namespace}/"``.

    Two jobs sharing one store never see each other's keys.
    """

    def __init__(self, store: Store, namespace: str):
        if not namespace:
            raise ValueError("namespace must be a non-empty string")
        self.store = store
        self.namespace = namespace

    def _key(self, key: str) -> str:
        return f"{self.namespace}/{key}"

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self.store.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._key(key), amount)

    def __repr__(self) -> str:
        return f"NamespacedStore({self.store!r}, namespace={self.namespace!r})"


def poll_until(predicate, timeout_s: float) -> bool:
    """Call ``predicate()`` with backing-off sleeps until it is true or ``timeout_s`` passed.

    ConfigError for a ``timeout_s`` that is NaN, infinite or negative (the wait would never
    end, or end at once by accident)."""
    if not 0 <= timeout_s < math.inf:
        raise ConfigError(f"a store wait needs a finite timeout >= 0 s, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    sleep_s = _POLL_MIN_S
    while True:
        if predicate():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(sleep_s, remaining))
        sleep_s = min(sleep_s * 2, _POLL_MAX_S)


# Barrier generations, per (store object, barrier name). Weak keys: a dropped store forgets
# its counters. Every rank calls barriers in the same order, so counters agree across ranks.
_barrier_generations: "weakref.WeakKeyDictionary[object, dict[str, int]]" = (
    weakref.WeakKeyDictionary())
_barrier_lock = threading.Lock()


def _next_generation(store: Store, name: str) -> int:
    with _barrier_lock:
        per_store = _barrier_generations.setdefault(store, {})
        generation = per_store.get(name, 0)
        per_store[name] = generation + 1
        return generation


def store_barrier(store: Store, name: str, world_size: int, timeout_s: float) -> None:
    """Collective, host-blocking barrier of ``world_size`` ranks through ``store``.

    A name may be reused: the n-th barrier called ``name`` on this store object uses the key
    ``f"{name}/{n}"``. Raises PeerTimeoutError naming the arrived count after ``timeout_s``.
    """
    key = f"{name}/{_next_generation(store, name)}"
    store.add(key, 1)
    arrived = [0]

    def all_arrived() -> bool:
        arrived[0] = store.add(key, 0)
        return arrived[0] >= world_size

    if not poll_until(all_arrived, timeout_s):
        raise PeerTimeoutError(
            f"store barrier {key!r}: {arrived[0]} of {world_size} ranks arrived "
            f"within {timeout_s:.1f} s")


def store_publish(store: Store, key: str, value: bytes) -> None:
    """Set ``key`` and mark it ready, so that :func:`store_fetch` can wait for it boundedly."""
    store.set(key, value)
    store.add(f"{key}/ready", 1)


def store_fetch(store: Store, key: str, timeout_s: float, *, peer: int | None = None) -> bytes:
    """Wait (bounded by ``timeout_s``) for a :func:`store_publish`-ed ``key``; return its value.

    Raises PeerTimeoutError naming the key (and ``peer``, when given) on timeout.
    """
    if not poll_until(lambda: store.add(f"{key}/ready", 0) >= 1, timeout_s):
        who = f" from peer {peer}" if peer is not None else ""
        raise PeerTimeoutError(
            f"store key {key!r}{who} was not published within {timeout_s:.1f} s", peer=peer)
    return store.get(key)


def free_port() -> int:
    """A TCP port that was free on this host a moment ago (callers retry on races)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


#: how long a rank waits for the decision of an agreed barrier once someone has taken it (s):
#: the decider publishes it right after winning, so only a decider that dies in between
#: makes this wait run out
_DECISION_WAIT_S = 10.0


def agreed_barrier(store: Store, name: str, world_size: int, timeout_s: float) -> bool:
    """Collective and bounded: True when every one of ``world_size`` ranks arrived (all of
    them may now enter a collective that waits for every rank: NVSHMEM's init, barrier,
    malloc, free, finalize), False when the job gave up on it.

    The answer is the same on every rank that returns: the first rank to see either all
    arrivals or its own ``timeout_s`` run out takes the decision ("go" or "abandon") by an
    atomic add and publishes it; every rank, a late one included, returns that decision.
    With a plain barrier a rank that timed out would leave while a later one, seeing the
    count complete, entered a collective teardown (``nvshmem_barrier_all``) that the gone rank
    never joins: a hang. A decider that dies before publishing counts as "abandon".
    """
    generation = _next_generation(store, name)
    key = f"{name}/{generation}"
    decided_key = f"{name}/{generation}/decided"
    decision_key = f"{name}/{generation}/decision"
    store.add(key, 1)
    seen = {"arrived": 0, "decided": 0}

    def done() -> bool:
        seen["decided"] = store.add(decided_key, 0)
        if seen["decided"]:
            return True
        seen["arrived"] = store.add(key, 0)
        return seen["arrived"] >= world_size

    poll_until(done, timeout_s)
    if not seen["decided"] and store.add(decided_key, 1) == 1:  # this rank decides
        go = store.add(key, 0) >= world_size
        store_publish(store, decision_key, b"go" if go else b"abandon")
        return go
    try:
        return store_fetch(store, decision_key, _DECISION_WAIT_S) == b"go"
    except PeerTimeoutError:
        return False
