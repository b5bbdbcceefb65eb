"""The construction steps of :class:`~afd_cupy.connector.AFDConnector` that are not the
facade's own: argument checks, the ``cpu_threads`` policy and the rank's endpoint.
"""
from __future__ import annotations

import logging
import numbers
import socket

import torch

from afd_cupy.attention.endpoint import AttentionEndpoint
from afd_cupy.backends.base import POLL_MODES
from afd_cupy.errors import ConfigError
from afd_cupy.ffn.endpoint import FFNEndpoint
from afd_cupy.runtime import env, peer_state
from afd_cupy.runtime.topology import Role

logger = logging.getLogger("afd_cupy")


def check_config(name: str, value, cls):
    if not isinstance(value, cls):
        hint = f" (use {cls.__name__}.from_mapping for a dict)" if isinstance(value, dict) else ""
        raise ConfigError(f"{name} must be a {cls.__name__}, got {type(value).__name__}{hint}")
    return value


def check_poll_mode(value) -> None:
    if value not in POLL_MODES:
        raise ConfigError(f"poll_mode must be one of {POLL_MODES}, got {value!r}")


def check_recv_spin_us(value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigError(f"recv_spin_us must be an int >= 0 (microseconds), got {value!r}")


def open_endpoint(conn, store, peers):
    """The endpoint of ``conn``'s role over ``conn.path`` (``peers``: the handshake's
    ``PeerProcess`` of every other rank)."""
    if conn.role is Role.ATTENTION:
        # FFN ranks known gone (shut down, dead, failed): refused at once later
        ffn_peers = peer_state.FFNPeers(conn.topology, peers, store, conn.instance)
        return AttentionEndpoint(conn.path, model=conn.model, config=conn.config,
                                 layout=conn.layout, torch_dtype=conn.torch_dtype,
                                 out_scale=conn.out_scale, ffn_peers=ffn_peers)
    attn_processes = {p.world_rank: p for p in peers
                      if conn.topology.role_of(p.world_rank)[0] is Role.ATTENTION}
    return FFNEndpoint(conn.path, model=conn.model, config=conn.config, topology=conn.topology,
                       role_rank=conn.role_rank, torch_dtype=conn.torch_dtype,
                       attn_processes=attn_processes, store=store, instance=conn.instance)


def check_cpu_threads(value) -> None:
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"cpu_threads must be 'auto', None or an int >= 1, got {value!r}")


def apply_cpu_threads(cpu_threads, peers) -> None:
    """The ``cpu_threads`` policy of :class:`AFDConnector` (see its docstring).

    NOTE: "auto" acts on torch's pool only: OpenMP/MKL/OpenBLAS/numba read their variables
    when they load, which happened before any connector exists; numba starts no pool here
    (afd_cupy has no parallel=True function)."""
    if cpu_threads is None:
        return
    if cpu_threads != "auto":
        env.limit_threads(int(cpu_threads), keep_user_settings=False)
        return
    if env.user_thread_vars():
        return  # the user, or the launcher, decided
    host = socket.gethostname()
    num_local = 1 + sum(1 for peer in peers if peer.host == host)
    share = env.thread_share(num_local)
    if torch.get_num_threads() > share:
        logger.info("afd_cupy: %d ranks of this job on this host: torch threads %d -> %d "
                    "(AFDConnector(cpu_threads=None) keeps them)", num_local,
                    torch.get_num_threads(), share)
        env.limit_threads(share)
