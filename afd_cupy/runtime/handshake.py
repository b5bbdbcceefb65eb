"""Start-up handshake: every rank checks that every other rank runs the same configuration.

Before anything is allocated, each rank publishes a record of every configuration value that
changes the wire or the numerics (model, topology, connector config, backend, wire version)
and compares it with every other rank's. A difference raises GeometryMismatchError naming the
first differing field and both values, on every rank: a bf16 rank paired with an fp16 rank,
or two ranks with different ``routed_scaling_factor``, would otherwise produce garbage.

Records are keyed by an instance number: the n-th connector a rank creates in a store pairs
with the n-th connector of every other rank, so connectors created one after another in the
same job never read each other's records. Each record also carries the process id, host name
and PID namespace of its rank, which the FFN side uses to notice that an Attention rank died.
A rank's local knobs (``afd_cupy.config.RANK_LOCAL_FIELDS``) are not compared. A second
process claiming a world rank (it gets the next instance number) is a ConfigError naming
both processes: at once when the first claimant still runs on this host, else when its
peers do not answer within the bound.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass

from afd_cupy import wire
from afd_cupy.config import RANK_LOCAL_FIELDS
from afd_cupy.errors import ConfigError, GeometryMismatchError, PeerTimeoutError
from afd_cupy.runtime.store import store_fetch, store_publish


def _pid_namespace() -> str:
    """This process's PID namespace ("" where /proc does not tell): pids are comparable only
    inside one namespace (two containers of one pod can share a host name but not pids)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class PeerProcess:
    """Where a peer rank runs: enough to ask the OS whether it is alive (same host and PID
    namespace only)."""

    world_rank: int
    pid: int
    host: str
    pid_namespace: str

    def is_alive(self) -> bool | None:
        """True/False for a process whose pid this process can see; None otherwise (unknown)."""
        if (self.host != socket.gethostname() or not self.pid_namespace
                or self.pid_namespace != _pid_namespace()):
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not _is_zombie(self.pid)


def _is_zombie(pid: int) -> bool:
    """True when ``pid`` has exited but its parent has not reaped it yet (Linux ``/proc``; a
    launcher polls its children only now and then, and ``kill(pid, 0)`` succeeds on a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def config_record(model, topology, connector, *, backend: str) -> dict:
    """Flat ``{"model.hidden_size": 2048, ...}`` of every value that must agree across ranks
    (a rank's local knobs, :data:`afd_cupy.config.RANK_LOCAL_FIELDS`, are left out)."""
    record = {"wire.version": wire.VERSION, "backend": backend}
    for prefix, config in (("model", model), ("topology", topology), ("connector", connector)):
        for f in dataclasses.fields(config):
            if prefix == "connector" and f.name in RANK_LOCAL_FIELDS:
                continue
            record[f"{prefix}.{f.name}"] = getattr(config, f.name)
    return record


def _next_instance(store, world_rank: int) -> int:
    return int(store.add(f"handshake/instances/{world_rank}", 1)) - 1


def exchange(store, *, world_rank: int, world_size: int, record: dict,
             timeout_s: float) -> tuple[int, list[PeerProcess]]:
    """Publish ``record``, check every peer's against it; return (instance, peer processes).

    Collective over the world. Raises GeometryMismatchError naming the first differing field
    and both values, PeerTimeoutError when a peer does not publish within ``timeout_s``.
    """
    record = json.loads(json.dumps(record))  # compare what a peer sees after the round trip
    instance = _next_instance(store, world_rank)
    mine = {"config": record, "pid": os.getpid(), "host": socket.gethostname(),
            "pid_namespace": _pid_namespace()}
    store_publish(store, f"handshake/{instance}/{world_rank}", json.dumps(mine).encode())
    rival = _rival_claim(store, world_rank, instance, mine)
    if rival is not None and rival.is_alive():
        raise _claimed_twice_error(world_rank, rival, mine)
    peers = []
    for other in range(world_size):
        if other == world_rank:
            continue
        try:
            raw = store_fetch(store, f"handshake/{instance}/{other}", timeout_s, peer=other)
        except PeerTimeoutError:
            if rival is not None:  # its peers paired with the other claimant
                raise _claimed_twice_error(world_rank, rival, mine) from None
            raise
        theirs = json.loads(bytes(raw).decode())
        _compare(record, theirs["config"], world_rank, other)
        peers.append(PeerProcess(other, int(theirs["pid"]), str(theirs["host"]),
                                 str(theirs["pid_namespace"])))
    return instance, peers


def _rival_claim(store, world_rank: int, instance: int, mine: dict) -> "PeerProcess | None":
    """The process that published the previous instance of ``world_rank`` when it is not
    this one (a second process claiming the same rank gets the next instance number)."""
    if instance == 0:
        return None
    key = f"handshake/{instance - 1}/{world_rank}"
    if store.add(f"{key}/ready", 0) < 1:
        return None
    theirs = json.loads(bytes(store.get(key)).decode())
    if (theirs["host"], theirs["pid"], theirs["pid_namespace"]) == \
            (mine["host"], mine["pid"], mine["pid_namespace"]):
        return None  # this process's own earlier connector
    return PeerProcess(world_rank, int(theirs["pid"]), str(theirs["host"]), str(theirs["pid_namespace"]))


def _claimed_twice_error(world_rank: int, rival: PeerProcess, mine: dict) -> ConfigError:
    num_attn = mine["config"].get("topology.num_attn_ranks", 0)
    role = (f"attention role rank {world_rank}" if world_rank < num_attn
            else f"ffn role rank {world_rank - num_attn}")
    return ConfigError(f"{role} (world rank {world_rank}) is claimed by two processes: pid {rival.pid} on "
                       f"{rival.host} and pid {mine['pid']} on {mine['host']} (this one); give each "
                       f"process its own role rank")


def _compare(mine: dict, theirs: dict, my_rank: int, other_rank: int) -> None:
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name), theirs.get(name)
        if a != b:
            raise GeometryMismatchError(
                f"configuration mismatch in {name!r}: rank {my_rank} has {a!r}, rank {other_rank} "
                f"has {b!r} (every rank of an AFD job must use the same configs)")
