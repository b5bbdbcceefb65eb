"""The data-path seam: what a backend implements and what it may know (docs/design/architecture.md, docs/design/backends.md).

::

    Attention:  dispatch ──► (peer windows) ··· combine ◄── (own window: replies)
    FFN:        wait_any ──► item_views ──► [experts, outside the path] ──► reply

A backend is a module under ``afd_cupy.backends`` with an ``open_path(ctx, ...)`` that
allocates its heap and window (collective) and returns the path of the context's role: an
:class:`AttentionPath` on an Attention rank, an :class:`FFNPath` on an FFN rank (the seam is
asymmetric: a rank holds only its own role's steps). Each path declares its
:class:`Capabilities`; callers read those, never the backend's name. The connector knows only
this file: it never names a backend, never builds a header and never counts a sequence
number. A data path never sees the connector: everything it may know is in the frozen
:class:`PathContext`.

The protocol's rules (header words, reply checks, status words, capacities) live in
``afd_cupy.wire``; ``host`` is their reference implementation in numpy and ``cuda`` runs the
same steps in RawKernels (``raw_kernels/``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from afd_cupy import wire
from afd_cupy.errors import BackendUnavailableError, ConfigError
from afd_cupy.runtime.topology import Role, Topology
from afd_cupy.transports import get_transport, transports_of

#: backend name -> module implementing ``open_path``
BACKEND_MODULES = {"host": "afd_cupy.backends.host", "cuda": "afd_cupy.backends.cuda"}
POLL_MODES = ("device", "host")


@dataclass(frozen=True)
class PathContext:
    """Everything a data path may know about its connector (immutable).

    ``dtype`` is the payload dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``),
    ``torch_dtype`` the same as a torch dtype. ``poll_mode`` is ``"device"`` (spinning kernels)
    or ``"host"`` (flags copied to the host); the host backend always polls on the host.
    """

    layout: wire.WindowLayout
    topology: Topology
    role: Role
    role_rank: int
    dtype: str
    torch_dtype: torch.dtype
    top_k: int
    num_experts: int
    has_shared: bool
    peer_timeout_s: float
    always_send: bool = False
    poll_mode: str = "device"
    transport: str = "direct"  # ConnectorConfig.transport (docs/design/put-transport.md)
    recv_spin_s: float = 5e-4  # FFN device-polled receive: spin this long, then sleep (docs/design/kernels.md)
    fused_dispatch: bool = True  # ConnectorConfig.fused_dispatch (cuda, both wire modes; docs/design/kernels.md)
    dedup_dispatch: str = "plan"  # ConnectorConfig.dedup_dispatch (cuda, dedup mode: "plan" | "ll")

    @property
    def world_rank(self) -> int:
        """This rank's world rank (= NVSHMEM PE): Attention ranks first."""
        return self.topology.world_rank(self.role, self.role_rank)

    @property
    def num_ffn_ranks(self) -> int:
        return self.topology.num_ffn_ranks

    @property
    def wire_mode(self) -> str:
        """``"pair"`` or ``"dedup"`` (the layout's, from ``ConnectorConfig.wire_mode``)."""
        return self.layout.wire_mode

    def peer_pe(self, role: Role, rank: int) -> int:
        """World rank of role rank ``rank`` of ``role``."""
        return self.topology.world_rank(role, rank)

    def opposite_pes(self) -> list[int]:
        """World ranks of every opposite-role peer, in role-rank order."""
        opposite = self.role.opposite
        return [self.peer_pe(opposite, r) for r in range(self.topology.num_role_ranks(opposite))]


@dataclass(frozen=True)
class Arrival:
    """A message found by ``wait_any``: slot (region, ring) holds it, ``header`` decoded."""

    region: int
    ring: int
    header: wire.Header


class ArrivalSuperseded(Exception):
    """Raised by :meth:`FFNPath.item_views` when the arrival's slot was rewritten while it was
    being read (its sender timed out and sent the next message there): what was read mixes two
    messages, so the item is not served; the newer message is the slot's next arrival."""


def superseded(arrival: Arrival, flag: int, cause: Exception) -> ArrivalSuperseded | None:
    """The ArrivalSuperseded of a route table rejected with ``cause`` when the slot's flag,
    read after the rejection, is ``flag`` (:func:`wire.slot_moved_on`); None when the flag still
    carries the arrival's seq: the table is bad under its own flag and ``cause`` stands."""
    if not wire.slot_moved_on(flag, arrival.header):
        return None
    return ArrivalSuperseded(f"dedup message seq {arrival.header.seq} from attention rank "
                             f"{arrival.region} (ring {arrival.ring}) was rewritten (flag {flag}) "
                             f"while its route table was read ({cause})")


@dataclass(frozen=True)
class ItemViews:
    """Zero-copy views of a received dispatch (valid until it is answered).

    - ``routed_x``: [routed_tokens, hidden] payload dtype, rows grouped by local expert (in
      dedup mode: the path's local staging the rows were expanded into, not the window).
    - ``shared_x``: [shared_tokens, hidden] rows whose shared experts run on this rank (pair:
      the round-robin slice; dedup: the first ``shared_tokens`` received rows).
    - ``route_table``: int32 [routed_tokens, 2] (token index, top-k slot) per row in pair
      mode; int32 [num_rows, 2 + 2 * top_k] (``wire.ROUTE_*``) in dedup mode; or None.
    - ``group_counts``: int32 [expert_per_rank] on the payload's device, rows per local expert.
    """

    routed_x: Any = field(repr=False)
    shared_x: Any = field(repr=False)
    route_table: Any = field(repr=False)
    group_counts: Any = field(repr=False)


@dataclass(frozen=True)
class Capabilities:
    """What a data path can do, declared by its backend and read by the callers that need to
    know (the connector, ``step_schedule.check_capturable``, the graph FFN server) instead of
    comparing backend names.

    - ``backend``: the backend's name (for messages only: decide on the fields below).
    - ``wire_modes``: the ``ConnectorConfig.wire_mode`` values the backend implements;
      :attr:`transports` (the ``ConnectorConfig.transport`` values) is derived from the
      transport registry, where each transport lists its backends.
    - ``supports_nonblocking``: ``combine(blocking=False)`` enqueues the wait and the combine
      without a host synchronization (cuda).
    - ``device_polling``: waits run on the device (cuda with ``poll_mode="device"``); with
      ``supports_nonblocking`` a step of sends and receives can be captured in a CUDA graph
      (:attr:`supports_graph_capture`).
    - ``host_reply_seqs``: FFN side: the reply seq per slot lives on the host and can be handed
      to another loop (:meth:`FFNPath.reply_seq_counters`).
    - ``put_peers``: opposite-role ranks reached through the transport's staging
      (``Link.staged_peers``: host-initiated copies such as NVSHMEM puts, not stores).
    - ``supports_graph_server``: FFN side: a ``GraphFFNServer`` may drive this path
      (:meth:`FFNPath.graph_resources`): device polling, host reply seqs, no put peer.
    """

    backend: str
    wire_modes: tuple
    supports_nonblocking: bool = False
    device_polling: bool = False
    host_reply_seqs: bool = False
    put_peers: tuple = ()
    supports_graph_server: bool = False

    @property
    def transports(self) -> tuple[str, ...]:
        """The registered transports that list this backend (``afd_cupy.transports``; one
        registered later, e.g. by a test module, is included from then on)."""
        return transports_of(self.backend)

    @property
    def supports_graph_capture(self) -> bool:
        """A step of ``send_attn_output`` / ``recv_ffn_output(blocking=False)`` calls can be
        captured in a CUDA graph (non-blocking receive waiting on the device)."""
        return self.supports_nonblocking and self.device_polling


class _PathBase(Protocol):
    """What both role paths implement."""

    #: torch device of the payload tensors this path takes and returns
    device: torch.device
    #: what the path can do (read by callers instead of the backend's name)
    capabilities: Capabilities

    def check_errors(self) -> None:
        """Synchronize and raise what a non-blocking call latched (no-op when none can be)."""

    def announce_shutdown(self) -> None:
        """Write a shutdown header to every ring of every opposite-role peer."""

    def close(self, *, peers_healthy: bool = True) -> None:
        """Collective: release streams, the window and the heap. With ``peers_healthy=False``
        (a peer timed out or died) the closing barrier is short: close() returns promptly."""


class AttentionPath(_PathBase, Protocol):
    """The Attention side of a backend: :meth:`dispatch` (plan -> scatter) and :meth:`combine`
    (wait_replies -> combine). Steps are named as in the kernels."""

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 layer_idx: int, stage_idx: int, ring: int) -> Any:
        """Send one layer's rows; returns the path's opaque send state for :meth:`combine`.

        ``topk_weights`` travel in dedup mode (the FFN side reduces with them); pair mode
        reads them only in :meth:`combine`. A routed-capacity overflow sends nothing and is
        raised by :meth:`combine` of this state (on cuda: at its next synchronization), on
        both backends."""

    def combine(self, state: Any, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                ring: int, layer_idx: int, stage_idx: int, out_scale: float,
                blocking: bool) -> torch.Tensor:
        """Wait for the replies of exactly the ranks sent to; return the fp32-combined rows."""

    def sent_to(self, state: Any) -> list[int]:
        """FFN ranks the dispatch of ``state`` was sent to (may synchronize; not hot path)."""

    def order_graph_replay(self, rings, stream: int) -> None:
        """A captured graph sending on ``rings`` is replayed on raw stream ``stream`` next:
        order it after each ring's last use on another stream (no-op where no such ordering
        exists: a path without graph capture)."""


class FFNPath(_PathBase, Protocol):
    """The FFN side of a backend: :meth:`wait_any` -> :meth:`item_views` -> [experts, outside
    the path] -> :meth:`reply`."""

    def wait_any(self, timeout_s: float) -> Optional[Arrival]:
        """Next arrival in this rank's window (fair over slots), or None after ``timeout_s``."""

    def pending_arrivals(self) -> int:
        """Messages that arrived in this rank's window and no ``wait_any`` has taken yet
        (instrumentation: may synchronize a side stream; not for the hot path)."""

    @property
    def has_unclaimed_wait(self) -> bool:
        """A wait interrupted on the host (a signal) left its device wait running: it may have
        taken an arrival that only the next :meth:`wait_any` returns (another loop watching
        the window, a graph, must let that call claim it first)."""

    def item_views(self, arrival: Arrival) -> ItemViews:
        """Zero-copy views of the dispatch in ``arrival``'s slot (FP8 dispatch: its rows decoded
        to the payload dtype). Raises :class:`ArrivalSuperseded` (dedup) when the slot was
        rewritten while it was read, WireError when the header's row format (``FLAG_FP8``) is
        not the layout's ``dispatch_dtype`` (``wire.check_dispatch_rows``)."""

    def slot_flag(self, region: int, ring: int) -> int:
        """The flag word of own slot (region, ring) now (cuda: a device-to-host copy; not for
        the hot path: read when a message it holds was rejected)."""

    def reply(self, arrival: Arrival, routed_out: torch.Tensor,
              shared_out: Optional[torch.Tensor]) -> None:
        """Write the outputs, :func:`wire.reply_header` and the flag into the sender's window."""

    def reply_seq_counters(self):
        """A copy of the reply seq per slot (int64 numpy ``[num_slots]``), where
        ``capabilities.host_reply_seqs``; ProtocolError elsewhere."""

    def set_reply_seq_counters(self, counters, *, slot: int | None = None) -> None:
        """Replace every reply seq (``counters`` ``[num_slots]``), or with ``slot`` that slot's
        (the next reply there carries ``counters + 1``); ValueError for a wrong length or slot,
        ProtocolError where ``capabilities.host_reply_seqs`` is False."""


#: either role's path (what ``open_path`` returns for the context's role)
DataPath = AttentionPath | FFNPath


def require_backend(backend: str, wire_mode: str = "pair", transport: str = "direct"):
    """The module of ``backend`` once it is known to be able to run ``wire_mode`` over
    ``transport`` here.

    Raises ConfigError for an unknown name, a wire mode or a transport the backend does not
    implement (its module's ``CAPABILITIES``, whose transports come from the registry),
    BackendUnavailableError when its libraries are missing (checked before any collective
    step, so a misconfigured rank fails alone and fast).
    """
    if backend not in BACKEND_MODULES:
        raise ConfigError(f"backend must be one of {tuple(BACKEND_MODULES)}, got {backend!r}")
    module = importlib.import_module(BACKEND_MODULES[backend])
    modes = module.CAPABILITIES.wire_modes
    if wire_mode not in modes:
        raise ConfigError(f"backend {backend!r} does not implement wire_mode={wire_mode!r} (it "
                          f"implements {modes}); use wire_mode='pair' or backend='host'")
    get_transport(transport)  # ConfigError naming the registered transports
    transports = module.CAPABILITIES.transports
    if transport not in transports:
        raise ConfigError(f"backend {backend!r} does not implement transport={transport!r} (it "
                          f"implements {transports})")
    try:
        module.require_available()
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {backend!r} cannot run here: {exc}") from exc
    return module


def open_path(backend: str, ctx: PathContext, *, store, job_id: str, device_id: int | None,
              startup_timeout_s: float, instance: int = 0,
              nvshmem_env: dict | None = None) -> DataPath:
    """Allocate ``backend``'s heap and window (collective over the world) and return the path
    of ``ctx.role``: an :class:`AttentionPath` or an :class:`FFNPath`.

    ``instance`` (from the start-up handshake) keeps consecutive connectors of one job apart.
    ``nvshmem_env`` (``afd_cupy.heap.nvshmem.nvshmem_env(...)``) is NVSHMEM's environment for
    the cuda backend; the host backend has no NVSHMEM and ignores it.

    Raises ConfigError for an unknown backend, poll mode or a wire mode the backend does not
    implement, and BackendUnavailableError when the backend cannot run here (e.g. ``"cuda"`` without CuPy, a GPU or NVSHMEM).
    """
    if ctx.poll_mode not in POLL_MODES:
        raise ConfigError(f"poll_mode must be one of {POLL_MODES}, got {ctx.poll_mode!r}")
    module = require_backend(backend, ctx.wire_mode, ctx.transport)
    return module.open_path(ctx, store=store, job_id=job_id, device_id=device_id,
                            startup_timeout_s=startup_timeout_s, instance=instance,
                            nvshmem_env=nvshmem_env)
