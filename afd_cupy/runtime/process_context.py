"""What a rank knows about its job (:class:`ProcessContext`), its client of the job's store,
and the store a process hosts: the store side of a launch.

A rank started by :func:`afd_cupy.runtime.launch.launch` gets its context as ``fn``'s first argument;
a rank another launcher started (torchrun, SLURM, k8s) builds it with
:meth:`ProcessContext.from_env` or :func:`connect` and joins the job's launch rendezvous
(:mod:`afd_cupy.runtime.rendezvous`).
"""
from __future__ import annotations

import dataclasses
import logging
import os

from afd_cupy.errors import ConfigError
from afd_cupy.runtime import env as env_mod
from afd_cupy.runtime import rendezvous
from afd_cupy.runtime.children import LaunchError
from afd_cupy.runtime.kvstore import KVServer
from afd_cupy.runtime.store import (NamespacedStore, Store, bound_listener, connect_store,
                                    create_store)
from afd_cupy.runtime.timeouts import check_optional_timeout, check_timeout

logger = logging.getLogger("afd_cupy")

STORE_HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class ProcessContext:
    """What a launched process knows about its job. Picklable; passed as ``fn``'s first arg."""

    rank: int
    world_size: int
    job_id: str
    store_host: str
    store_port: int
    device_id: int | None
    store_timeout_s: float = 120.0
    sm_percent: int | None = None  # this rank's MPS SM share, when the launch placed it
    #: what serves the store: "torch" (a ``torch.distributed.TCPStore`` master) or "afd"
    #: (the :class:`~afd_cupy.runtime.kvstore.KVServer` a launch hosts for a job it runs alone)
    store_kind: str = "torch"

    def __post_init__(self):
        check_timeout("store_timeout_s", self.store_timeout_s)
        if self.store_kind not in ("torch", "afd"):
            raise ValueError(f"store_kind must be 'torch' or 'afd', got {self.store_kind!r}")

    @classmethod
    def from_env(cls, environ=None, *, store_timeout_s: float = 120.0) -> "ProcessContext":
        """The context of a rank started by another launcher (torchrun, SLURM, k8s...), from
        ``AFD_STORE_ADDR`` (``host:port`` of a TCPStore master the job shares),
        ``AFD_WORLD_SIZE``, ``AFD_RANK`` (world rank: Attention ranks first), ``AFD_JOB_ID``
        (the same on every rank) and optionally ``AFD_DEVICE`` (read by
        :func:`afd_cupy.runtime.env.rank_settings`). Connects nothing: call :meth:`join` next.
        Raises ValueError naming a missing or malformed variable."""
        from afd_cupy.runtime import env

        settings = env.rank_settings(environ)
        return cls(settings["rank"], settings["world_size"], settings["job_id"],
                   settings["store_host"], settings["store_port"], settings["device_id"],
                   store_timeout_s)

    def role(self, topology) -> tuple:
        """``(Role, role_rank)`` of this rank in ``topology`` (a ``TopologyConfig``): world
        ranks ``0 .. A-1`` are Attention, ``A .. A+F-1`` FFN. Raises ConfigError when the
        topology's world size is not this job's."""
        from afd_cupy.runtime.topology import Role

        num_attn, num_ffn = topology.num_attn_ranks, topology.num_ffn_ranks
        if num_attn + num_ffn != self.world_size:
            raise ConfigError(f"topology of {num_attn} Attention + {num_ffn} FFN ranks does not "
                              f"match job {self.job_id}'s world_size={self.world_size}")
        return (Role.ATTENTION, self.rank) if self.rank < num_attn else (Role.FFN, self.rank - num_attn)

    def join(self, *, host_store: bool = False, startup_timeout_s: float = 120.0) -> "ProcessContext":
        """For a rank another launcher started: join the job's launch rendezvous
        (:mod:`afd_cupy.runtime.rendezvous`) and return once every world rank joined. With
        ``host_store=True`` this process starts the store master at its address (exactly one
        process of the job does, and must call :meth:`close` last so that the store outlives
        every rank). Host-blocking. Raises ConfigError for a rank joined twice or a world-size
        disagreement, PeerTimeoutError naming the missing world ranks (``missing_ranks``)
        when the master does not answer or the job is incomplete within ``startup_timeout_s``
        (every rank alike: the first to give up tells the others, who raise at once, and the
        store's host waits until they have read it; a rank whose store went away raises it
        too, naming the ranks it still missed). ConfigError for a ``startup_timeout_s`` that
        is not a finite number > 0.
        """
        check_timeout("startup_timeout_s", startup_timeout_s)
        key = (self.store_host, self.store_port)
        joining = None
        try:
            if host_store:
                _hosted_masters[key] = start_store(self.world_size, self.store_timeout_s,
                                                   self.store_host, self.store_port)
            else:
                rendezvous.wait_for_master(self.store_host, self.store_port, startup_timeout_s,
                                           job_id=self.job_id, world_size=self.world_size,
                                           here=[self.rank])
            rendezvous.join(self.store(), [self.rank], self.world_size, self.job_id)
            joining = rendezvous.Rendezvous(self.store(), self.world_size, self.job_id,
                                            startup_timeout_s, [self.rank], f"by pid {os.getpid()}")
            joining.wait()
        except BaseException:
            if joining is not None and joining.abandoned and key in _hosted_masters:
                joining.linger()  # the other ranks read the verdict before the store goes
            _client_stores.pop((*key, self.job_id), None)
            _hosted_masters.pop(key, None)
            raise
        return self

    def close(self, timeout_s: float | None = None) -> None:
        """For a :meth:`join`-ed rank: mark it done; in the process hosting the store master
        also wait, bounded by ``timeout_s`` (default ``store_timeout_s``), until every rank is
        done, then stop serving. Call it last, after the connector's ``close()``. Idempotent;
        never raises for a store problem (a store whose host is gone is logged); ConfigError
        for a ``timeout_s`` that is not a finite number > 0 (the launchers do this themselves
        for the ranks they start)."""
        check_optional_timeout("timeout_s", timeout_s)
        key = (self.store_host, self.store_port, self.job_id)
        try:
            rendezvous.mark_done(self.store(), [self.rank])
        except Exception as exc:  # noqa: BLE001 - the store may already be gone
            logger.debug("rank %d could not mark itself done: %s", self.rank, exc)
        master = _hosted_masters.pop((self.store_host, self.store_port), None)
        if master is not None and key in _client_stores:
            wait_s = self.store_timeout_s if timeout_s is None else timeout_s
            rendezvous.await_done(_client_stores[key], self.world_size, wait_s, self.job_id)
        _client_stores.pop(key, None)
        del master  # a hosted master stops serving when dropped

    def store(self) -> NamespacedStore:
        """This process's client of the job's store, namespaced by ``job_id``.

        Connected on the first call and reused afterwards, so every caller in the process
        shares one object (barrier generations are counted per store object, see
        :func:`afd_cupy.runtime.store.store_barrier`).
        """
        key = (self.store_host, self.store_port, self.job_id)
        if key not in _client_stores:
            client = connect_store(self.store_kind, self.store_host, self.store_port,
                                   self.world_size, self.store_timeout_s)
            _client_stores[key] = NamespacedStore(client, self.job_id)
        return _client_stores[key]


# The store client of each job this process belongs to (see ProcessContext.store).
_client_stores: dict[tuple[str, int, str], NamespacedStore] = {}
# Store masters hosted by ProcessContext.join(host_store=True), until ProcessContext.close.
_hosted_masters: dict[tuple[str, int], Store] = {}


def connect(store_addr, *, rank: int, world_size: int, job_id: str, device_id: int | None = None,
            host_store: bool = False, startup_timeout_s: float = 120.0,
            store_timeout_s: float = 120.0) -> ProcessContext:
    """The joined :class:`ProcessContext` of a rank another launcher started:
    ``ProcessContext(...).join(...)`` with ``store_addr`` as ``"host:port"`` or
    ``(host, port)``. Raises as :meth:`ProcessContext.join`; ConfigError for a bad address,
    job id, rank or world size."""
    host, port = env_mod.parse_store_addr(store_addr)
    check_job(job_id, world_size, first_rank=rank, nprocs=1)
    check_timeout("startup_timeout_s", startup_timeout_s)
    check_timeout("store_timeout_s", store_timeout_s)
    ctx = ProcessContext(rank, world_size, job_id, host, port, device_id, store_timeout_s)
    return ctx.join(host_store=host_store, startup_timeout_s=startup_timeout_s)


def check_job(job_id, world_size, *, first_rank: int, nprocs: int) -> None:
    """ConfigError for a job id that is not a plain non-empty string, a world size below 1 or
    ranks ``first_rank .. first_rank + nprocs - 1`` outside ``[0, world_size)``."""
    if not isinstance(job_id, str) or not job_id.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"job_id must be a non-empty string of letters, digits, '-' and '_', "
                          f"got {job_id!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(first_rank, bool) or not isinstance(first_rank, int) \
            or not 0 <= first_rank or first_rank + nprocs > world_size:
        raise ConfigError(f"ranks {first_rank}..{first_rank + nprocs - 1} do not fit a world of "
                          f"{world_size}")


def start_store(world_size: int, timeout_s: float, host: str, port: int) -> Store:
    """Start a TCPStore master at ``host:port`` (a job several launchers start). Raises
    LaunchError when it cannot start."""
    try:
        return create_store(host, port, world_size, is_master=True, timeout_s=timeout_s)
    except Exception as err:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError
        raise LaunchError(f"could not start the store master at {host}:{port}: {err}") from err


def serve_own_store(host: str) -> KVServer:
    """The store of a job this launch runs alone: a KVServer on a free port of ``host``.
    Raises LaunchError when it cannot listen."""
    try:
        return KVServer(bound_listener(host))
    except OSError as err:
        raise LaunchError(f"could not listen for the job's store on {host}: {err}") from err
