"""What a transport is (docs/design/put-transport.md): how a message reaches the peer's window.

A transport is a :class:`Transport` registered under its ``ConnectorConfig.transport`` name;
:meth:`Transport.open` (collective, at set-up) returns this rank's :class:`Link`, which is
all the data paths of either role use of it:

- ``is_host_initiated`` False (``direct``): the sender's kernels (cuda) or host stores (host)
  write into the peer's mapped window; the link stages nothing and its hooks do nothing.
- ``is_host_initiated`` True (``put``): for a *staged* peer (``Link.is_staged[peer]``) the
  kernels write the same bytes, flag word included, into staging slot (region = peer's role
  rank, ring) of this rank's staging buffer (``Link.staging_base``, laid out like a window);
  right behind each kernel, on its stream, the data path calls :meth:`Link.after_dispatch`
  (Attention) or :meth:`Link.after_reply` (FFN), and the link copies the slot to the peer,
  flag last. Host-made messages (the shutdown headers; every message of the host backend)
  go through :meth:`Link.write_message`.

A new transport is one module that subclasses both and calls :func:`register`; the backends
select by these attributes, never by the name. Which backends can run it is its
``backends``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from afd_cupy.errors import ConfigError


class Link:
    """This rank's opened transport: ``peer_pes`` are the opposite role's world ranks by role
    rank, ``is_staged[peer]`` whether messages to that peer go through the staging.

    The base class is the direct link: nothing staged, ``staging_base`` 0 (the kernels'
    ``staging`` argument), the hooks no-ops. A host-initiated link overrides the hooks."""

    def __init__(self, transport: "Transport", window, peer_pes: Sequence[int],
                 is_staged: Sequence[bool] | None = None, *, staging_base: int = 0):
        self.transport = transport
        self.window = window
        self.peer_pes = list(peer_pes)
        self.is_staged = tuple(bool(s) for s in (is_staged or [False] * len(self.peer_pes)))
        self.staging_base = staging_base
        #: role ranks of the peers reached through the staging
        self.staged_peers = [peer for peer, staged in enumerate(self.is_staged) if staged]

    # --- hooks behind the kernels (cuda; ``stream`` a raw cudaStream_t) -----------------------
    def after_dispatch(self, stream: int, ring: int, num_tokens: int, *, num_ffn_ranks: int,
                       has_shared: bool) -> None:
        """Behind a dispatch of ``num_tokens`` tokens on ``ring``: deliver every staged peer's
        staging slot and then its flag word as the kernel left it (the kernel alone knows which
        peers it sent to, and their seqs). Never synchronizes. Direct: nothing."""

    def after_reply(self, stream: int, peer: int, ring: int, *, routed_rows: int, shared_rows: int,
                    seq: int) -> None:
        """Behind the reply kernel of a staged ``peer``: deliver the reply's rows and header
        from staging slot (peer, ring), then set the peer's flag to ``seq``."""
        raise ConfigError(f"transport {self.transport.name!r} stages no peer (peer {peer})")

    # --- host-made messages ----------------------------------------------------------------
    def write_message(self, pe: int, region: int, ring: int, header: np.ndarray, seq: int,
                      fields: dict | None = None, *, stream=None) -> None:
        """:meth:`Window.write_message` for world rank ``pe`` (``fields``, the header, then the
        flag = ``seq``), through the staging when ``pe`` is a staged peer. ``stream``: the
        cupy stream a cuda data path issues its copies on (current stream when None)."""
        peer = self.peer_pes.index(pe)
        if self.is_staged[peer]:
            self.write_staged(peer, ring, header, seq, fields or {}, stream=stream)
        else:
            self.window.write_message(pe, region, ring, header, seq, fields)

    def staged_header(self, peer: int, ring: int) -> np.ndarray | None:
        """int32 [header_words]: the header this rank last staged for ``peer`` on ``ring`` (what
        the peer's slot holds once its flag is set), None where nothing is staged."""
        return None

    def write_staged(self, peer: int, ring: int, header: np.ndarray, seq: int, fields: dict, *,
                     stream=None) -> None:
        """Write one host-made message to staged ``peer`` (slot: this rank's region, ``ring``)."""
        raise ConfigError(f"transport {self.transport.name!r} has no host-side send (peer {peer})")


class Transport:
    """A transport (class attributes; one instance per registered name).

    - ``name``: the ``ConnectorConfig.transport`` value;
    - ``is_host_initiated``: messages to a staged peer are delivered by host calls behind the
      kernels (:class:`Link`), so they cannot run inside a device-side loop such as
      ``GraphFFNServer``'s;
    - ``allows_unmapped_peers``: the window may leave a peer unmapped (its pointer 0; only
      the link reaches it);
    - ``backends``: the backends (``"host"``, ``"cuda"``) whose data paths run it.
    """

    name: str = ""
    is_host_initiated: bool = False
    allows_unmapped_peers: bool = False
    backends: tuple[str, ...] = ()

    def open(self, heap, window, ctx, *, instance: int) -> Link:
        """Collective over the world: this rank's link for ``window`` (``ctx``: the data path's
        ``PathContext``; ``instance`` keeps consecutive connectors of a job apart)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<transport {self.name!r}>"


_REGISTRY: dict[str, Transport] = {}


def register(transport: Transport, *, replace: bool = False) -> Transport:
    """Make ``transport`` selectable as ``ConnectorConfig(transport=transport.name)`` (in
    this process: a spawned rank registers it again when it imports the defining module)."""
    if not transport.name or (transport.name in _REGISTRY and not replace):
        raise ConfigError(f"transport name {transport.name!r} is empty or already registered")
    _REGISTRY[transport.name] = transport
    return transport


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def transport_names() -> tuple[str, ...]:
    """Registered names, in registration order (the built-ins: direct, put, auto)."""
    return tuple(_REGISTRY)


def get_transport(name: str) -> Transport:
    """The transport registered as ``name``; ConfigError naming the registered ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(f"transport must be one of {transport_names()}, got {name!r}") from None


def transports_of(backend: str) -> tuple[str, ...]:
    """Names of the transports ``backend`` runs."""
    return tuple(name for name, t in _REGISTRY.items() if backend in t.backends)
