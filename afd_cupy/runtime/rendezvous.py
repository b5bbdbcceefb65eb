"""The launch rendezvous of a job whose ranks several launchers start (one per node, or
torchrun / SLURM / k8s processes): who joined, who is missing, who is done.

Every launcher publishes the world ranks it started under ``launch/joined/{rank}`` of the
job's (namespaced) store, with its world size, host and pid, and waits, bounded, until all
``world_size`` ranks joined: a launcher that never starts is one
:class:`~afd_cupy.errors.PeerTimeoutError` naming the missing world ranks
(``err.missing_ranks``), instead of a handshake timeout naming the first peer key. A rank
joined twice (overlapping rank blocks, a reused job id) or launchers that disagree on the
world size are a :class:`~afd_cupy.errors.ConfigError`. When a launcher's ranks are done it
adds ``launch/done/{rank}``; the process that hosts the store master waits (bounded) for
every rank to be done before it drops the master, so that no rank of another node loses the
store inside its collective ``close()``. Not collective in the NVSHMEM sense; host-blocking.

The first launcher whose rendezvous deadline passes gives the job up for everyone
(``launch/abandoned``, with the missing ranks): every launcher still waiting raises the same
PeerTimeoutError at once, and the store's host lingers (bounded) until they have read it
before it drops the store. A launcher that loses the store while it waits (its host gave up
without that record, or died) raises a PeerTimeoutError naming the ranks it still missed,
not the store's connection error.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

from afd_cupy.errors import AfdError, ConfigError, PeerTimeoutError
from afd_cupy.runtime.store import Store, poll_until, store_publish

logger = logging.getLogger("afd_cupy")

JOINED = "launch/joined"
DONE = "launch/done"
ABANDONED = "launch/abandoned"
_MASTER_PROBE_S = 0.1
#: how long the store's host waits for the other launchers to read that it gave the job up
LINGER_S = 2.0


def _missing_error(message: str, missing: list[int]) -> PeerTimeoutError:
    err = PeerTimeoutError(message, peer=missing[0] if missing else None)
    err.missing_ranks = missing
    return err


def wait_for_master(host: str, port: int, timeout_s: float, *, job_id: str, world_size: int,
                    here: list[int]) -> None:
    """Wait (bounded) until something listens at ``host:port``; else PeerTimeoutError naming
    the world ranks not started here (``missing_ranks``).

    NOTE: a torch TCPStore client retries its connection for up to about twice its timeout;
    probing with a plain socket first keeps the bound at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, remaining))):
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if r not in here]
            raise _missing_error(
                f"job {job_id}: no store master answered at {host}:{port} within {timeout_s:.1f} s; "
                f"world ranks {missing} of {world_size} are not started here (ranks {here}): is "
                f"the launcher that hosts the store running?", missing)
        time.sleep(min(_MASTER_PROBE_S, max(0.0, deadline - time.monotonic())))


def join(store: Store, ranks: list[int], world_size: int, job_id: str) -> None:
    """Publish that world ranks ``ranks`` of ``job_id`` are started (by this launcher).

    Raises ConfigError when one of them already joined."""
    record = json.dumps({"world_size": world_size, "host": socket.gethostname(),
                         "pid": os.getpid()}).encode()
    for rank in ranks:
        store.set(f"{JOINED}/{rank}/record", record)
        if store.add(f"{JOINED}/{rank}", 1) > 1:
            raise ConfigError(f"job {job_id}: world rank {rank} was started twice (two launchers "
                              f"with overlapping ranks, or a reused job id)")


def _missing(store: Store, prefix: str, ranks) -> list[int]:
    return [r for r in ranks if store.add(f"{prefix}/{r}", 0) < 1]


class Rendezvous:
    """The bounded wait until every world rank of the job has joined (see :func:`join`)."""

    def __init__(self, store: Store, world_size: int, job_id: str, timeout_s: float,
                 here: list[int], where: str):
        self.store, self.world_size, self.job_id = store, world_size, job_id
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.here, self.where = here, where
        self.waiting = list(range(world_size))
        self.complete = False
        self.abandoned = False  # this launcher gave the job up (error())

    def poll(self) -> bool:
        """True once every rank joined (then checks that every launcher has this world size).
        Raises PeerTimeoutError naming the missing ranks when another launcher gave the job
        up, or the store is lost."""
        if self.complete:
            return True
        try:
            self._check_abandoned()
            self.waiting = _missing(self.store, JOINED, self.waiting)
            if not self.waiting:
                self._check_world_size()
                self.complete = True
        except AfdError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch's DistNetworkError, StoreLostError...
            raise self._lost_error(exc) from exc
        return self.complete

    def _check_abandoned(self) -> None:
        if self.store.add(f"{ABANDONED}/ready", 0) < 1:
            return
        verdict = json.loads(bytes(self.store.get(ABANDONED)).decode())
        self.store.add(f"{ABANDONED}/seen", len(self.here))
        missing = [int(r) for r in verdict["missing"]]
        self.waiting = missing
        raise _missing_error(
            f"job {self.job_id}: world ranks {missing} of {self.world_size} did not join: the "
            f"launcher of ranks {verdict['by']} gave the job up after {verdict['waited_s']:.1f} s "
            f"(ranks {self.here} started {self.where}, bound {self.timeout_s:.1f} s): is the "
            f"launcher of the missing ranks running, with the same store address and job id?",
            missing)

    def _lost_error(self, exc: Exception) -> PeerTimeoutError:
        missing = list(self.waiting)
        return _missing_error(
            f"job {self.job_id}: world ranks {missing} of {self.world_size} had not joined when "
            f"the job's store went away ({type(exc).__name__}: {exc}); its host gave up on them or "
            f"died (ranks {self.here} started {self.where}, bound {self.timeout_s:.1f} s)", missing)

    def _check_world_size(self) -> None:
        for rank in range(self.world_size):
            theirs = json.loads(bytes(self.store.get(f"{JOINED}/{rank}/record")).decode())
            if theirs["world_size"] != self.world_size:
                raise ConfigError(
                    f"job {self.job_id}: world rank {rank} was started (on {theirs['host']}, pid "
                    f"{theirs['pid']}) with world_size={theirs['world_size']}, ranks {self.here} "
                    f"here with world_size={self.world_size}")

    def error(self) -> PeerTimeoutError:
        """The PeerTimeoutError naming the missing ranks; it also tells every other launcher
        of the job (``launch/abandoned``, best effort) so that they raise it at once."""
        missing = list(self.waiting)
        self.abandoned = True
        try:
            verdict = {"missing": missing, "by": self.here, "waited_s": self.timeout_s}
            store_publish(self.store, ABANDONED, json.dumps(verdict).encode())
        except Exception as exc:  # noqa: BLE001 - the store may be gone: this rank raises anyway
            logger.debug("job %s: could not publish that the job was given up: %s", self.job_id, exc)
        return _missing_error(
            f"job {self.job_id}: world ranks {missing} of {self.world_size} did not join within "
            f"{self.timeout_s:.1f} s (ranks {self.here} started {self.where}): is the launcher "
            f"of the missing ranks running, with the same store address and job id?", missing)

    def wait(self) -> None:
        """Block until complete; raise :meth:`error` at the deadline."""
        if not poll_until(self.poll, max(0.0, self.deadline - time.monotonic())):
            raise self.error()

    def linger(self, timeout_s: float = LINGER_S) -> None:
        """For the store's host after the job was given up: wait (bounded) until every rank
        that joined elsewhere has read that (:meth:`poll`), so that it gets the
        PeerTimeoutError and not a lost store."""
        expected = self.world_size - len(self.waiting) - len(self.here)
        try:
            poll_until(lambda: self.store.add(f"{ABANDONED}/seen", 0) >= expected, timeout_s)
        except Exception as exc:  # noqa: BLE001 - nothing more to do for them
            logger.debug("job %s: store failed while lingering: %s", self.job_id, exc)


def mark_done(store: Store, ranks) -> None:
    for rank in ranks:
        store.add(f"{DONE}/{rank}", 1)


def await_done(store: Store, world_size: int, timeout_s: float, job_id: str) -> bool:
    """Wait (bounded) until every rank of the job is done; log and return False otherwise."""
    waiting = [list(range(world_size))]

    def all_done() -> bool:
        waiting[0] = _missing(store, DONE, waiting[0])
        return not waiting[0]

    try:
        if poll_until(all_done, timeout_s):
            return True
    except Exception as exc:  # noqa: BLE001 - the store is going away anyway
        logger.warning("job %s: store unusable while waiting for the ranks to finish: %s", job_id, exc)
        return False
    logger.warning("job %s: world ranks %s not done within %.1f s; the store master stops now",
                   job_id, waiting[0], timeout_s)
    return False
