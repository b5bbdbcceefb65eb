"""cuda backend data path: NVSHMEM windows, CuPy RawKernels, torch tensors (docs/design/kernels.md, docs/design/backends.md).

Every launch goes to torch's current stream of the connector's device, so ordering with the
caller's torch work needs no synchronization. The Attention side issues two launches per
send (plan, scatter) and two per receive (wait, combine); ``recv_ffn_output(blocking=True)``
then copies the device status block to its pinned mirror and synchronizes once to turn a
latched status into an exception. The FFN side detects
arrivals with a spinning ``wait_any`` kernel on its own stream that rings a doorbell in
pinned host memory (``poll_mode="device"``) or by copying the flags to the host
(``poll_mode="host"``).

NOTE: device polling by several processes on one GPU needs CUDA MPS; without it the
spinning kernels time-slice with the peers' kernels (correct, but ~100 ms per switch).

Shape (composition, no mixins): :func:`open_path` builds one :class:`CudaRank` (what both
roles share: context, heap, window, device, status channel, streams, the shutdown and close
steps) and the path of the rank's role around it:
:class:`~afd_cupy.backends.cuda_attention.CudaAttentionPath` or
:class:`~afd_cupy.backends.cuda_ffn.CudaFFNPath`.
"""
from __future__ import annotations

import torch

from afd_cupy import wire
from afd_cupy.backends.base import Capabilities, PathContext
from afd_cupy.backends.host_poll import HostPolling
from afd_cupy.errors import ConfigError
from afd_cupy.kernels import StatusChannel
from afd_cupy.runtime.topology import Role
from afd_cupy.transports import get_transport
from afd_cupy.wire.dtypes import payload_dtype

try:  # torch's raw current-stream getter: ~1 us instead of ~10 us for current_stream()
    from torch._C import _cuda_getCurrentRawStream as _raw_current_stream
except ImportError:  # CPU-only torch builds
    _raw_current_stream = None

#: wire modes this backend implements (``ConnectorConfig.wire_mode``; dedup: the kernels of
#: docs/design/kernels.md, ``attention/dedup_attn*.cu`` and ``ffn/dedup_ffn.cu``)
WIRE_MODES = ("pair", "dedup")
#: what every cuda path can do (a path's own ``capabilities`` adds its poll mode and peers);
#: its transports are those registered for "cuda" (afd_cupy.transports: each transport lists its
#: backends), in both wire modes: the scatter and reply kernels of each mode write a staged
#: peer's message into the link's staging
CAPABILITIES = Capabilities(backend="cuda", wire_modes=WIRE_MODES, supports_nonblocking=True)


class _RawStream:
    """A raw ``cudaStream_t`` handle behind the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def cupy_stream(cp, handle: int, device_id: int):
    """A ``cupy.cuda.Stream`` over the raw stream ``handle`` (not owned: never destroyed).

    CuPy >= 14 takes foreign streams through ``Stream.from_external`` (device unknown to
    CuPy: callers select the device themselves) and deprecates ``ExternalStream``, which
    older CuPy versions need.
    """
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is None:
        return cp.cuda.ExternalStream(handle, device_id)
    return from_external(_RawStream(handle))


def open_path(ctx: PathContext, *, store, job_id: str, device_id, startup_timeout_s: float,
              instance: int = 0, nvshmem_env: dict | None = None):
    """NVSHMEM heap and window of this rank (collective), and the cuda data path."""
    from afd_cupy.heap.nvshmem import NvshmemHeap
    from afd_cupy.heap.window import Window

    transport = get_transport(ctx.transport)
    heap = NvshmemHeap(ctx.world_rank, ctx.topology.world_size, store, job_id, device_id or 0,
                       timeout_s=startup_timeout_s, env=nvshmem_env)
    try:
        window = Window(heap, ctx.layout, store, name=f"window{instance}",
                        geometry_timeout_s=startup_timeout_s, allow_unmapped=transport.allows_unmapped_peers)
        link = transport.open(heap, window, ctx, instance=instance)
    except BaseException:
        heap.close(peers_healthy=False)
        raise
    return open_role_path(CudaRank(ctx, heap, window, link))


def open_role_path(rank: "CudaRank"):
    """The path of ``rank``'s role around it (device buffers and packed launches allocated
    now; every zero fill precedes any stream's use)."""
    from afd_cupy.backends.cuda_attention import CudaAttentionPath
    from afd_cupy.backends.cuda_ffn import CudaFFNPath

    path = (CudaAttentionPath if rank.ctx.role is Role.ATTENTION else CudaFFNPath)(rank)
    rank.cp.cuda.Device(rank.device_id).synchronize()
    return path


class CudaRank:
    """What both role paths of one cuda rank share, built once by :func:`open_path`.

    ``cp`` (the cupy module), ``ctx``, ``layout``, ``heap``, ``window``; ``link``: the
    transport's :class:`~afd_cupy.transports.Link` (which opposite peers, by role rank, the
    kernels reach through its staging: ``link.is_staged``, ``link.staging_base``; the copies
    behind the kernels); ``device_id`` / ``device``; ``dtype_code`` (the kernels'
    payload code); ``geometry`` (the kernels' window geometry); ``timeout_ns`` (every spinning
    kernel's bound); ``own_window`` (this rank's window base); ``host_polling`` (a
    :class:`HostPolling` with ``poll_mode="host"``, else None); ``status`` (the device status
    channel); ``last_seen`` (cupy int64 [num_slots]: the last flag consumed per own slot);
    ``capabilities``. The streams, the shutdown, the close and the error check are here.
    """

    def __init__(self, ctx: PathContext, heap, window, link):
        if ctx.wire_mode not in WIRE_MODES:
            raise ConfigError(f"the cuda backend implements wire_mode {WIRE_MODES}, not "
                              f"{ctx.wire_mode!r}")
        import cupy

        self.cp = cupy
        self.ctx = ctx
        self.heap = heap
        self.window = window
        # the transport's link (afd_cupy.transports): which opposite peers (by role rank) the
        # kernels reach through the staging (link.is_staged), and the copies behind the kernels
        self.link = link
        self.layout = layout = ctx.layout
        self.device_id = heap.device_id
        self.device = torch.device("cuda", self.device_id)
        self.dtype_code = payload_dtype(ctx.dtype).kernel_code
        self.geometry = layout.kernel_geometry()
        self.timeout_ns = int(ctx.peer_timeout_s * 1e9)
        self.own_window = window.peer_ptr(ctx.world_rank)
        self.host_polling = HostPolling(window) if ctx.poll_mode == "host" else None
        put_peers = tuple(link.staged_peers)
        is_ffn, device_polling = ctx.role is Role.FFN, ctx.poll_mode == "device"
        self.capabilities = Capabilities(
            backend="cuda", wire_modes=WIRE_MODES, supports_nonblocking=True,
            device_polling=device_polling, host_reply_seqs=is_ffn, put_peers=put_peers,
            supports_graph_server=is_ffn and device_polling and not put_peers)
        self._streams: dict[int, object] = {}
        # NOTE: device memory, read by the host only after a synchronization (see StatusBlock);
        # the FFN doorbell and header staging below stay pinned: the host polls / writes them
        # without synchronizing.
        self.status = StatusChannel.allocate(stream=self.stream, timeout_s=ctx.peer_timeout_s,
                                             expert_per_rank=layout.expert_per_rank)
        self.last_seen = cupy.zeros(layout.num_slots, cupy.int64)

    # --- shared helpers -----------------------------------------------------------------------
    def as_torch(self, cupy_array) -> torch.Tensor:
        return torch.as_tensor(cupy_array, device=self.device)

    def use_device(self) -> None:
        """Make this path's GPU current: a connector driven from a new thread would otherwise
        launch under device 0's context."""
        runtime = self.cp.cuda.runtime
        if runtime.getDevice() != self.device_id:
            runtime.setDevice(self.device_id)

    def stream_ptr(self) -> int:
        """Raw handle of torch's current stream on this device."""
        if _raw_current_stream is not None:
            return _raw_current_stream(self.device_id)
        return torch.cuda.current_stream(self.device_id).cuda_stream

    def stream(self):
        """The cupy view of torch's current stream on this device (cached per handle)."""
        handle = self.stream_ptr()
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = cupy_stream(self.cp, handle, self.device_id)
        return stream

    def no_capture(self, what: str) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{what} synchronizes with the host and cannot be captured in a CUDA "
                             "graph: capture recv_ffn_output(blocking=False) with poll_mode='device'")

    # --- both -------------------------------------------------------------------------------
    def check_errors(self) -> None:
        self.use_device()
        self.status.sync_and_raise()

    def announce_shutdown(self, sent_reply_seq=None) -> None:
        """Shutdown headers to every ring of every opposite peer: ordered copies on the current
        stream (payload-free, header then flag), then a synchronization.

        An FFN rank keeps a reply its peer may not have read (``wire.shutdown_over_reply``):
        over a direct peer from the peer's slot; over a staged peer from the header it staged
        and ``sent_reply_seq(peer, ring)``, the seq of the last reply it sent there (0: none)."""
        ctx, layout = self.ctx, self.layout
        self.use_device()
        words = wire.encode_header(wire.shutdown_header(src_rank=ctx.role_rank, top_k=ctx.top_k,
                                                        expert_per_rank=layout.expert_per_rank,
                                                        wire_mode=ctx.wire_mode),
                                   layout.expert_per_rank)
        stream = self.stream()
        keep_replies = ctx.role is Role.FFN
        if keep_replies:  # every reply enqueued so far has landed before its header is read
            torch.cuda.synchronize(self.device_id)
        window = self.window
        with stream:
            for peer, pe in enumerate(ctx.opposite_pes()):
                for ring in range(layout.ring_depth):
                    out = words
                    # a reply the Attention side may not have read stays readable
                    if keep_replies and not self.link.is_staged[peer]:
                        flag = int(window.to_host(window.flag_view(pe, ctx.role_rank, ring))[0])
                        current = window.to_host(window.header_view(pe, ctx.role_rank, ring))
                        out = wire.shutdown_over_reply(current, flag, words)
                    elif keep_replies and sent_reply_seq is not None:  # the peer's slot is not mapped here
                        flag = sent_reply_seq(peer, ring)
                        current = self.link.staged_header(peer, ring) if flag else None
                        out = wire.shutdown_over_reply(current, flag, words) if flag else words
                    self.link.write_message(pe, ctx.role_rank, ring, out, wire.SHUTDOWN_SEQ, stream=stream)
        stream.synchronize()

    def close(self, *, peers_healthy: bool = True, events=()) -> None:
        """Wait for this rank's queued kernels (all bounded by their timeouts), destroy the
        role path's raw CUDA ``events``, then release the window and the heap (collective;
        short and non-raising after a peer failure)."""
        self.use_device()
        try:
            torch.cuda.synchronize(self.device_id)
            for event in events:
                self.cp.cuda.runtime.eventDestroy(event)
        finally:
            self.window.close()
            self.heap.close(peers_healthy=peers_healthy)


def require_available() -> None:
    """Raise ImportError when CuPy or the NVSHMEM host library cannot be loaded here."""
    import cupy  # noqa: F401

    from afd_cupy.heap.nvshmem_lib import find_library

    if not find_library():
        raise ImportError("libnvshmem_host.so.3 not found (install nvidia-nvshmem-cu12/cu13)")
