"""NVSHMEM's environment for the cuda backend: one explicit, validated dict, and the one
function that writes it.

NVSHMEM reads its settings from environment variables when it initializes, so they must be
in ``os.environ`` before ``nvshmemx_hostlib_init_attr``. afd_cupy builds them from typed
arguments (:func:`nvshmem_env`), carries the dict explicitly (``AFDConnector(nvshmem_env=...)``
-> ``open_path`` -> ``NvshmemHeap(env=...)``) and writes it in one place,
:func:`apply_nvshmem_env`, right before NVSHMEM initializes. Importing this module needs
neither CuPy nor the library.

Variables (NVSHMEM's documented names; ``NVSHMEM_INFO=1`` prints what a build accepts):

- ``NVSHMEM_REMOTE_TRANSPORT``: transport to PEs that are not load/store reachable: ``ibrc``
  (NVSHMEM's default), ``ucx``, ``libfabric``, ``ibdevx`` or ``none`` (one node only).
- ``NVSHMEM_SYMMETRIC_SIZE``: symmetric heap bytes per PE; :func:`nvshmem_heap_bytes` sizes
  it from ``afd_cupy.wire.window_size_hint``.
- ``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME`` / ``NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY``: interface
  (``eth0``, ``bond0``) and address family of the unique-id bootstrap. afd_cupy always
  bootstraps by unique id (rank 0 creates it, the job's store carries it), so
  ``NVSHMEM_BOOTSTRAP`` / ``NVSHMEM_BOOTSTRAP_PLUGIN`` are refused. Across nodes the id holds
  rank 0's socket address, which every node must reach: pick the interface when a node has
  several.
- ``NVSHMEM_HCA_LIST`` (``mlx5_0:1,mlx5_1:1``; ``^`` excludes) with
  ``NVSHMEM_ENABLE_NIC_PE_MAPPING=1``, without which NVSHMEM ignores the list.
- ``NVSHMEM_LIBFABRIC_PROVIDER``: ``cxi``, ``efa`` or ``verbs`` (libfabric transport only).
- ``NVSHMEM_DISABLE_NCCL=1`` (default): afd_cupy uses no NVSHMEM collective that needs NCCL,
  and loading NCCL into several PEs sharing one GPU only costs start-up time and memory.
- ``NVSHMEM_DISABLE_NVLS=1`` (default): afd_cupy never uses NVLink multicast, and on shared
  multi-GPU hosts it must stay off.
- ``NVSHMEM_DISABLE_LOCAL_ONLY_PROXY=1`` (default): when no remote transport is in use (one
  node, every peer load/store reachable) NVSHMEM still starts a proxy thread that spins on a
  host core for as long as the process lives (measured: 100 % of a core per PE, idle or not).
  afd_cupy needs it for nothing there: its kernels use no NVSHMEM device calls (no device-side
  global exit or wait timeouts) and the put transport's on-stream puts to load/store peers do
  not go through it. With a remote transport (several nodes) the variable has no effect and the
  proxy runs as NVSHMEM needs.

NOTE: NVSHMEM >= 3.6 also reads ``/etc/nvshmem.conf``, ``~/.nvshmem.conf`` and
``$NVSHMEM_CONF_FILE``, whose values override the environment; afd_cupy does not read them.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Mapping, MutableMapping

from afd_cupy.errors import ConfigError

logger = logging.getLogger("afd_cupy")

#: afd_cupy's defaults; a variable the environment already sets wins over them
NVSHMEM_DEFAULTS = {"NVSHMEM_DISABLE_NCCL": "1", "NVSHMEM_DISABLE_NVLS": "1",
                    "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1"}
#: documented values of ``NVSHMEM_REMOTE_TRANSPORT``; "none" for a single node
REMOTE_TRANSPORTS = ("none", "ibrc", "ucx", "libfabric", "ibdevx")
#: documented values of ``NVSHMEM_LIBFABRIC_PROVIDER``
LIBFABRIC_PROVIDERS = ("cxi", "efa", "verbs")
#: documented values of ``NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY``
SOCKET_FAMILIES = ("AF_INET", "AF_INET6")
#: symmetric heap head-room per PE over the windows: NVSHMEM's own symmetric objects (teams,
#: collective scratch, signal words) live in the same heap
HEAP_SLACK_BYTES = 512 << 20
HEAP_ALIGN_BYTES = 2 << 20

# Variables afd_cupy decides itself, refused in a dict, with the reason.
_REFUSED = {name: "afd_cupy always bootstraps NVSHMEM by unique id through the job's store"
            for name in ("NVSHMEM_BOOTSTRAP", "NVSHMEM_BOOTSTRAP_PLUGIN")}
# NVSHMEM parses these as bools (first character 0/n/N/f/F: false) or scaled sizes ("2g"):
# compared by meaning, not spelling.
_BOOL_VARS = {"NVSHMEM_DISABLE_NCCL", "NVSHMEM_DISABLE_NVLS", "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY",
              "NVSHMEM_ENABLE_NIC_PE_MAPPING"}
_SIZE_VARS = {"NVSHMEM_SYMMETRIC_SIZE"}
_HCA_ENTRY = re.compile(r"^\^?[A-Za-z0-9_.-]+(:[0-9]+)?$")
_IFNAME = re.compile(r"^\^?=?[A-Za-z0-9_.:@-]+$")
_NAME = re.compile(r"^NVSHMEM_[A-Z0-9_]+$")

# What apply_nvshmem_env wrote, per environment mapping: {id(environ): {variable: value}}.
_written: dict[int, dict[str, str]] = {}


def nvshmem_heap_bytes(window_bytes: int, *, num_windows: int = 1) -> int:
    """``NVSHMEM_SYMMETRIC_SIZE`` for ``num_windows`` windows of ``window_bytes`` each (from
    ``afd_cupy.wire.window_size_hint``): their sum plus :data:`HEAP_SLACK_BYTES`, rounded up
    to :data:`HEAP_ALIGN_BYTES`. Count one window per connector open at once in a process.
    Raises ConfigError naming the argument."""
    for arg, value in (("window_bytes", window_bytes), ("num_windows", num_windows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"nvshmem_heap_bytes: {arg}={value!r}: must be an int >= 1")
    total = window_bytes * num_windows + HEAP_SLACK_BYTES
    return -(-total // HEAP_ALIGN_BYTES) * HEAP_ALIGN_BYTES


def nvshmem_env(*, remote_transport: str | None = None, symmetric_size: int | None = None,
                bootstrap_ifname: str | None = None, bootstrap_family: str | None = None,
                hca_list=None, libfabric_provider: str | None = None,
                extra: Mapping | None = None) -> dict[str, str]:
    """NVSHMEM's environment for one process: ``{variable: value}``, validated (module doc).

    ``remote_transport``: ``NVSHMEM_REMOTE_TRANSPORT`` (:data:`REMOTE_TRANSPORTS`);
    ``symmetric_size``: ``NVSHMEM_SYMMETRIC_SIZE`` in bytes per PE (:func:`nvshmem_heap_bytes`);
    ``bootstrap_ifname`` / ``bootstrap_family``: the unique-id bootstrap's interface and
    family (:data:`SOCKET_FAMILIES`); ``hca_list``: ``"mlx5_0:1,mlx5_1:1"`` or a sequence of
    entries (adds ``NVSHMEM_ENABLE_NIC_PE_MAPPING=1``; not with ``remote_transport="none"``);
    ``libfabric_provider``: only with ``remote_transport="libfabric"``; ``extra``: any other
    ``NVSHMEM_*`` variable (str, int or bool values), which may also override a default.
    :data:`NVSHMEM_DEFAULTS` are included. Pass the result as
    ``AFDConnector(..., nvshmem_env=...)``. Raises ConfigError naming the argument and value.
    """
    env = dict(NVSHMEM_DEFAULTS)
    if remote_transport is not None:
        if remote_transport not in REMOTE_TRANSPORTS:
            raise ConfigError(f"remote_transport must be one of {REMOTE_TRANSPORTS}, got {remote_transport!r}")
        env["NVSHMEM_REMOTE_TRANSPORT"] = remote_transport
    if symmetric_size is not None:
        if isinstance(symmetric_size, bool) or not isinstance(symmetric_size, int) or symmetric_size <= 0:
            raise ConfigError(f"symmetric_size must be a positive int (bytes), got {symmetric_size!r}")
        env["NVSHMEM_SYMMETRIC_SIZE"] = str(symmetric_size)
    if bootstrap_ifname is not None:
        if not isinstance(bootstrap_ifname, str) or not _IFNAME.match(bootstrap_ifname):
            raise ConfigError(f"bootstrap_ifname must be a network interface name such as 'eth0', "
                              f"got {bootstrap_ifname!r}")
        env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = bootstrap_ifname
    if bootstrap_family is not None:
        if bootstrap_family not in SOCKET_FAMILIES:
            raise ConfigError(f"bootstrap_family must be one of {SOCKET_FAMILIES}, got {bootstrap_family!r}")
        env["NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY"] = bootstrap_family
    if hca_list is not None:
        env.update(_hca_env(hca_list, remote_transport))
    if libfabric_provider is not None:
        if libfabric_provider not in LIBFABRIC_PROVIDERS or remote_transport != "libfabric":
            raise ConfigError(f"libfabric_provider must be one of {LIBFABRIC_PROVIDERS} with "
                              f"remote_transport='libfabric', got {libfabric_provider!r} with "
                              f"remote_transport={remote_transport!r}")
        env["NVSHMEM_LIBFABRIC_PROVIDER"] = libfabric_provider
    for name, value in check_nvshmem_env(extra or {}, what="extra").items():
        if name in env and name not in NVSHMEM_DEFAULTS:
            raise ConfigError(f"extra[{name!r}]={value!r}: {name} is already set to {env[name]!r} "
                              f"by the typed arguments; use those")
        env[name] = value
    return env


def _hca_env(hca_list, remote_transport) -> dict[str, str]:
    entries = hca_list.split(",") if isinstance(hca_list, str) else hca_list
    if isinstance(entries, (bytes, Mapping)) or not hasattr(entries, "__iter__"):
        raise ConfigError(f"hca_list must be 'name[:port],...' or a sequence of such entries, got {hca_list!r}")
    entries = [e.strip() if isinstance(e, str) else e for e in entries]
    bad = [e for e in entries if not isinstance(e, str) or not _HCA_ENTRY.match(e)]
    if bad or not entries:
        raise ConfigError(f"hca_list={hca_list!r}: entries must look like 'mlx5_0:1' ('^' "
                          f"excludes); bad: {bad or 'none given'}")
    if remote_transport == "none":
        raise ConfigError(f"hca_list={hca_list!r} has no effect with remote_transport='none'")
    return {"NVSHMEM_HCA_LIST": ",".join(entries), "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"}


def check_nvshmem_env(env, *, what: str = "nvshmem_env") -> dict[str, str]:
    """A checked copy of ``env`` (a :func:`nvshmem_env` result or a hand-made mapping):
    ``NVSHMEM_*`` names only, none of the refused bootstrap variables, non-empty str / int /
    bool values (ints and bools as NVSHMEM spells them). The connector calls it among its
    local checks, so a bad dict fails on its rank before any collective step.
    Raises ConfigError naming ``what``, the variable and the value."""
    if not isinstance(env, Mapping):
        raise ConfigError(f"{what} must be a mapping of NVSHMEM_* variables (see afd_cupy.heap."
                          f"nvshmem_env.nvshmem_env), got {type(env).__name__} {env!r}")
    checked = {}
    for name, value in env.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{what} may only set NVSHMEM_* variables, got {name!r}")
        if name in _REFUSED:
            raise ConfigError(f"{what}[{name!r}]={value!r}: {_REFUSED[name]}")
        if isinstance(value, bool):
            value = "1" if value else "0"
        elif isinstance(value, int):
            value = str(value)
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            raise ConfigError(f"{what}[{name!r}]={value!r}: must be a non-empty str, an int or a bool")
        checked[name] = value.strip()
    return checked


def _parse_size(value: str):
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)[bB]?\s*", value)
    if not match:
        return value
    scale = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[match.group(2).lower()]
    return int(-(-float(match.group(1)) * (1 << scale) // 1))


def same_meaning(name: str, a: str, b: str) -> bool:
    """Whether NVSHMEM reads ``a`` and ``b`` alike for variable ``name`` (``"2g"`` equals
    ``"2147483648"`` for sizes, ``"true"`` equals ``"1"`` for switches)."""
    if name in _BOOL_VARS:
        return (a.strip()[:1] not in "0nNfF") == (b.strip()[:1] not in "0nNfF")
    if name in _SIZE_VARS:
        return _parse_size(a) == _parse_size(b)
    return a.strip() == b.strip()


def apply_nvshmem_env(env: Mapping | None = None,
                      environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Write ``env`` (None: :data:`NVSHMEM_DEFAULTS`) into ``environ`` (default
    ``os.environ``): the one place afd_cupy writes NVSHMEM's environment, right before NVSHMEM
    initializes. Returns ``{variable: value NVSHMEM will read}`` for the variables concerned.

    A variable the environment already sets wins where ``env`` only carries afd_cupy's
    default; a value the caller asked for that means something else than the environment's
    raises ConfigError naming the variable and both values (never a silent choice), and then
    nothing is written. What an earlier call wrote (an earlier heap of this process) and
    nobody changed since is undone first, so each heap starts from the user's environment.
    """
    environ = os.environ if environ is None else environ
    wanted = dict(NVSHMEM_DEFAULTS) if env is None else check_nvshmem_env(env)
    written = _written.setdefault(id(environ), {})
    mine = {name: value for name, value in written.items() if environ.get(name) == value}
    conflicts = [(name, value, environ[name]) for name, value in wanted.items()
                 if name in environ and name not in mine
                 and not same_meaning(name, environ[name], value)
                 and NVSHMEM_DEFAULTS.get(name) != value]
    if conflicts:
        raise ConfigError("; ".join(f"{name}={value!r} was requested, but the environment already "
                                    f"has {name}={current!r}" for name, value, current in conflicts)
                          + "; unset the variable or request the same value")
    for name in mine:
        del environ[name]
    written.clear()
    for name, value in wanted.items():
        if name not in environ:
            environ[name] = written[name] = value
    logger.debug("NVSHMEM environment: %s", wanted)
    return {name: environ[name] for name in wanted}
