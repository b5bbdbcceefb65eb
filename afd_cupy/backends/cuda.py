"""cuda backend data path: NVSHMEM windows, CuPy RawKernels, torch tensors (DESIGN §7).

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
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from afd_cupy import kernels, wire
from afd_cupy.errors import (ConnectorShutdown, PeerTimeoutError, ProtocolError, WireError,
                             reply_timeout_error, routed_capacity_error)
from afd_cupy.kernels import PinnedInt64, StatusChannel

#: extra host-side wait beyond a kernel's own timeout before the host stops trusting it
_HOST_GRACE_S = 5.0

try:  # torch's raw current-stream getter: ~1 us instead of ~10 us for current_stream()
    from torch._C import _cuda_getCurrentRawStream as _raw_current_stream
except ImportError:  # CPU-only torch builds
    _raw_current_stream = None


@dataclass(frozen=True)
class DispatchScratch:
    """Device scratch of one dispatch in flight, sized for ``max_partials`` (CuPy arrays).

    ``chunk_hist`` int32 [max(1, chunks), E]; ``local_rank``, ``pos`` int32 [max(1, NK)];
    ``expert_counts``, ``expert_start`` int32 [E]; ``rank_offsets`` int32 [F + 1];
    ``verdict`` int32 [1] (the plan's send decision, read by the scatter);
    ``plan_done``, ``scatter_done`` uint32 [1] zeroed done counters.
    """

    chunk_hist: object
    local_rank: object
    pos: object
    expert_counts: object
    expert_start: object
    rank_offsets: object
    verdict: object
    plan_done: object
    scatter_done: object

    @classmethod
    def allocate(cls, max_partials: int, num_ffn_ranks: int, expert_per_rank: int) -> "DispatchScratch":
        import cupy

        num_experts = num_ffn_ranks * expert_per_rank
        rows = max(1, kernels.dispatch_num_chunks(max_partials))
        return cls(chunk_hist=cupy.zeros((rows, num_experts), cupy.int32),
                   local_rank=cupy.zeros(max(1, max_partials), cupy.int32),
                   pos=cupy.zeros(max(1, max_partials), cupy.int32),
                   expert_counts=cupy.zeros(num_experts, cupy.int32),
                   expert_start=cupy.zeros(num_experts, cupy.int32),
                   rank_offsets=cupy.zeros(num_ffn_ranks + 1, cupy.int32),
                   verdict=cupy.zeros(1, cupy.int32),
                   plan_done=cupy.zeros(1, cupy.uint32), scatter_done=cupy.zeros(1, cupy.uint32))


@dataclass
class CudaSendState:
    """One dispatch in flight: its ring's scratch and the tensors its kernels read."""

    scratch: DispatchScratch
    expected: object  # cupy int64 [F]
    topk_ids: torch.Tensor  # int32 [T*K], kept alive for the combine
    hidden: torch.Tensor
    num_tokens: int


class CudaDataPath:
    def __init__(self, conn):
        import cupy

        self.cp = cupy
        self.conn = conn
        self.window = conn.window
        self.layout = layout = conn.layout
        self.device_id = conn.heap.device_id
        self.dtype_code = kernels.DTYPE_CODES[conn.model.dtype]
        self.geometry = layout.kernel_geometry()
        self.timeout_ns = int(conn.peer_timeout_s * 1e9)
        self.own_window = self.window.peer_ptr(conn.world_rank)
        # NOTE: device memory, read by the host only after a synchronization (see StatusBlock);
        # the FFN doorbell and header staging below stay pinned: the host polls / writes them
        # without synchronizing.
        self.status = StatusChannel.allocate(stream=self.stream, timeout_s=conn.peer_timeout_s)
        self.last_seen = cupy.zeros(layout.num_slots, cupy.int64)
        self._streams: dict[int, object] = {}
        if conn.role.value == "attention":
            self._init_attention()
        else:
            self._init_ffn()

    # --- set-up -----------------------------------------------------------------------------
    def _init_attention(self) -> None:
        cp, conn, layout = self.cp, self.conn, self.layout
        num_ffn = conn.topology.num_ffn_ranks
        max_partials = layout.token_cap * layout.top_k
        self.peer_windows = cp.array([self.window.peer_ptr(conn.ffn_pe(j)) for j in range(num_ffn)],
                                     dtype=cp.uint64)
        self.seq_counters = cp.zeros((layout.ring_depth, num_ffn), cp.int64)
        self.scratch = [DispatchScratch.allocate(max_partials, num_ffn, layout.expert_per_rank)
                        for _ in range(layout.ring_depth)]
        self.expected = [cp.zeros(num_ffn, cp.int64) for _ in range(layout.ring_depth)]
        # (routed, shared) rows sent to each FFN rank: what its reply must echo
        self.expected_counts = [cp.zeros((num_ffn, 2), cp.int32) for _ in range(layout.ring_depth)]
        self.combine_done = [cp.zeros(1, cp.uint32) for _ in range(layout.ring_depth)]
        self.launches = [self._attention_launches(ring) for ring in range(layout.ring_depth)]

    def _attention_launches(self, ring: int) -> dict:
        """The four Attention-side kernels of one ring, checked and packed once.

        The specs are checked at full capacity (``token_cap`` tokens) with placeholders for
        the per-call arguments (token count, hidden/ids/weights/output pointers, layer,
        stage), which :meth:`dispatch` and :meth:`combine` rewrite before each launch.
        NOTE: the connector checks ``num_tokens <= token_cap`` before every dispatch, so the
        scratch buffers checked here fit every launch.
        """
        conn, layout, geo = self.conn, self.layout, self.geometry
        scratch, expected = self.scratch[ring], self.expected[ring]
        num_ffn, epr, cap = conn.topology.num_ffn_ranks, layout.expert_per_rank, layout.token_cap
        placeholder_ids = scratch.local_rank  # int32 [token_cap * top_k]; replaced per call
        plan = kernels.dispatch_plan_spec(
            topk_ids=placeholder_ids, num_partials=cap * layout.top_k, num_ffn_ranks=num_ffn,
            expert_per_rank=epr, routed_cap=layout.routed_cap, chunk_hist=scratch.chunk_hist,
            local_rank=scratch.local_rank, expert_counts=scratch.expert_counts,
            expert_start=scratch.expert_start, rank_offsets=scratch.rank_offsets,
            verdict=scratch.verdict, done_counter=scratch.plan_done, status=self.status.ptr)
        scatter = kernels.dispatch_scatter_spec(
            dtype_code=self.dtype_code, hidden=self.own_window, num_tokens=cap,
            hidden_size=layout.hidden_size, topk_ids=placeholder_ids, num_partials=cap * layout.top_k,
            top_k=layout.top_k, expert_per_rank=epr, num_ffn_ranks=num_ffn,
            chunk_hist=scratch.chunk_hist, local_rank=scratch.local_rank,
            expert_start=scratch.expert_start, rank_offsets=scratch.rank_offsets,
            expert_counts=scratch.expert_counts, verdict=scratch.verdict,
            peer_windows=self.peer_windows, geo=geo, ring=ring, has_shared=int(conn.has_shared),
            always_send=int(conn.always_send), pos_out=scratch.pos, src_rank=conn.role_rank,
            layer_idx=0, stage_idx=0, hdr_flags=0, seq_counters=self.seq_counters[ring],
            expected=expected, expected_counts=self.expected_counts[ring],
            done_counter=scratch.scatter_done)
        replies = dict(window=self.own_window, geo=geo, num_ffn_ranks=num_ffn, ring=ring,
                       expected=expected, expected_counts=self.expected_counts[ring], layer_idx=0,
                       stage_idx=0, last_seen=self.last_seen, timeout_ns=self.timeout_ns,
                       status=self.status.ptr)
        wait = kernels.wait_replies_spec(**replies)
        combine = kernels.combine_spec(
            dtype_code=self.dtype_code, out=self.own_window, num_tokens=cap,
            hidden_size=layout.hidden_size, topk_ids=placeholder_ids,
            topk_weights=placeholder_ids.view(self.cp.float32), pos=scratch.pos,
            top_k=layout.top_k, expert_per_rank=epr, has_shared=int(conn.has_shared),
            out_scale=1.0, done_counter=self.combine_done[ring], **replies)
        return {name: kernels.PackedLaunch(spec) for name, spec in
                (("plan", plan), ("scatter", scatter), ("wait", wait), ("combine", combine))}

    def _init_ffn(self) -> None:
        cp, layout = self.cp, self.layout
        self.scan_start = cp.zeros(1, cp.int32)
        self.doorbell = PinnedInt64(wire.DB_HEADER + -(-layout.header_words // 2))
        self.ticket = 0
        self.poll_stream = cp.cuda.Stream(non_blocking=True)
        # one pinned header staging row per (attention peer, ring): one reply in flight each
        self.staging = PinnedInt64(layout.num_slots * -(-layout.header_words // 2))
        self.reply_done = [cp.zeros(1, cp.uint32) for _ in range(layout.num_slots)]
        self.views = [self._slot_views(region, ring) for region in range(layout.num_regions)
                      for ring in range(layout.ring_depth)]
        self.empty_rows = torch.empty(0, layout.hidden_size, dtype=self.conn.torch_dtype,
                                      device=torch.device("cuda", self.device_id))
        self.wait_any_launch = kernels.PackedLaunch(kernels.wait_any_spec(
            window=self.own_window, geo=self.geometry, last_seen=self.last_seen,
            scan_start=self.scan_start, timeout_ns=0, doorbell=self.doorbell.ptr, ticket=0))
        self.reply_launches: dict[tuple, kernels.PackedLaunch] = {}  # (attn_rank, ring) -> launch

    def _slot_views(self, region: int, ring: int) -> dict:
        """Full-capacity torch views of one slot of the own window (created once)."""
        layout, window, pe = self.layout, self.window, self.conn.world_rank
        words = np.int16 if layout.itemsize == 2 else np.int32
        views = {"counts": self._as_torch(window.header_view(pe, region, ring)[wire.HDR_FIXED_WORDS:])}
        for name, cap in (("routed_x", layout.routed_cap), ("shared_x", layout.shared_cap)):
            if cap:
                raw = window.field(pe, region, ring, name, words, (cap, layout.hidden_size))
                views[name] = self._as_torch(raw).view(self.conn.torch_dtype)
        if layout.routed_cap:
            views["route_table"] = self._as_torch(
                window.field(pe, region, ring, "route_table", np.int32, (layout.routed_cap, 2)))
        return views

    def _as_torch(self, cupy_array) -> torch.Tensor:
        return torch.as_tensor(cupy_array, device=torch.device("cuda", self.device_id))

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
            stream = self._streams[handle] = self.cp.cuda.ExternalStream(handle, self.device_id)
        return stream

    # --- Attention side ---------------------------------------------------------------------
    def dispatch(self, hidden, topk_ids, *, layer_idx: int, stage_idx: int, ring: int) -> CudaSendState:
        conn, layout = self.conn, self.layout
        self.status.raise_latched()
        num_tokens = hidden.shape[0]
        hidden = hidden.contiguous()
        ids = topk_ids.to(torch.int32).reshape(-1).contiguous()
        scratch, expected = self.scratch[ring], self.expected[ring]
        launches, stream = self.launches[ring], self.stream_ptr()
        num_partials = num_tokens * layout.top_k
        plan = launches["plan"]
        plan.set("topk_ids", ids.data_ptr())
        plan.set("num_partials", num_partials)
        plan.launch(stream, kernels.plan_grid(num_partials))
        scatter = launches["scatter"]
        scatter.set("hidden", hidden.data_ptr())
        scatter.set("num_tokens", num_tokens)
        scatter.set("topk_ids", ids.data_ptr())
        scatter.set("num_partials", num_partials)
        scatter.set("layer_idx", layer_idx)
        scatter.set("stage_idx", stage_idx)
        scatter.launch(stream, kernels.scatter_grid(num_tokens, layout.top_k, int(conn.has_shared)))
        # what this ring's replies must echo, checked by the wait and combine kernels
        wait, combine = launches["wait"], launches["combine"]
        wait.set("layer_idx", layer_idx)
        wait.set("stage_idx", stage_idx)
        combine.set("layer_idx", layer_idx)
        combine.set("stage_idx", stage_idx)
        return CudaSendState(scratch, expected, ids, hidden, num_tokens)

    def combine(self, state: CudaSendState, topk_ids, topk_weights, *, ring: int, layer_idx: int,
                out_scale: float, blocking: bool = True) -> torch.Tensor:
        layout, conn = self.layout, self.conn
        num_tokens = state.num_tokens
        weights = topk_weights.to(torch.float32).reshape(-1).contiguous()
        out = torch.empty(num_tokens, layout.hidden_size, dtype=conn.torch_dtype,
                          device=torch.device("cuda", self.device_id))
        launches, stream = self.launches[ring], self.stream_ptr()
        if conn.poll_mode == "host":
            self._host_wait_replies(state, ring, layer_idx)
        else:
            launches["wait"].launch(stream)
        combine = launches["combine"]
        combine.set("out", out.data_ptr())
        combine.set("num_tokens", num_tokens)
        combine.set("topk_ids", state.topk_ids.data_ptr())
        combine.set("topk_weights", weights.data_ptr())
        combine.set("out_scale", out_scale)
        combine.launch(stream, kernels.combine_grid(num_tokens))
        if blocking:
            self.status.sync_and_raise(layer_idx=layer_idx)
        return out

    def _host_wait_replies(self, state: CudaSendState, ring: int, layer_idx: int) -> None:
        """poll_mode="host": wait for the reply flags with host copies (no spinning kernel)."""
        self.status.sync_and_raise(layer_idx=layer_idx)
        expected = state.expected.get()
        deadline = time.monotonic() + self.conn.peer_timeout_s
        for j in np.flatnonzero(expected):
            index = self.layout.slot_index(int(j), ring)
            seen = int(self.last_seen[index].get())
            flag = self.window.flag_view(self.conn.world_rank, int(j), ring)
            while int(flag.get()[0]) == seen:
                if time.monotonic() >= deadline:
                    raise reply_timeout_error(int(j), ring, layer_idx, int(expected[j]), seen,
                                              self.conn.peer_timeout_s)
                time.sleep(0)

    def check_errors(self) -> None:
        self.status.sync_and_raise()

    # --- FFN side ---------------------------------------------------------------------------
    def wait_any(self, timeout_s: float):
        if self.conn.poll_mode == "host":
            arrival = self.window.wait_any(timeout_s)
            if arrival is None:
                return None
            words = self.window.header_view(self.conn.world_rank, arrival.region, arrival.ring).get()
            return arrival.region, arrival.ring, words
        return self._device_wait_any(timeout_s)

    def _device_wait_any(self, timeout_s: float):
        layout = self.layout
        self.ticket += 1
        bell = self.doorbell.array
        launch = self.wait_any_launch
        launch.set("timeout_ns", int(timeout_s * 1e9))
        launch.set("ticket", self.ticket)
        launch.launch(self.poll_stream.ptr)
        deadline = time.monotonic() + timeout_s + _HOST_GRACE_S
        spins = 0
        while bell[wire.DB_TICKET] != self.ticket:
            spins += 1
            if spins % 4096 == 0 and time.monotonic() > deadline:
                # NOTE: the kernel may not have started (GPU busy); waiting for it is bounded by
                # its own timeout once it runs, and it must not consume an arrival unseen.
                self.poll_stream.synchronize()
                if bell[wire.DB_TICKET] != self.ticket:
                    raise PeerTimeoutError(f"wait_any kernel did not report ticket {self.ticket}")
        if bell[wire.DB_STATUS] != wire.STATUS_OK:
            return None
        slot = int(bell[wire.DB_SLOT])
        words = bell[wire.DB_HEADER:].view(np.int32)[:layout.header_words].copy()
        region, ring = divmod(slot, layout.ring_depth)
        return region, ring, words

    def item_views(self, region: int, ring: int, header: wire.Header):
        views = self.views[self.layout.slot_index(region, ring)]
        empty = self.empty_rows
        routed = views["routed_x"][:header.routed_tokens] if header.routed_tokens else empty
        shared = views["shared_x"][:header.shared_tokens] if header.shared_tokens else empty
        route = views["route_table"][:header.routed_tokens] if "route_table" in views else None
        return routed, shared, route, views["counts"]

    def reply(self, attn_rank: int, ring: int, header_words, seq: int, routed_out, shared_out) -> None:
        """Write the outputs and the reply header (int32 words, any sequence) to ``attn_rank``."""
        layout = self.layout
        slot = layout.slot_index(attn_rank, ring)
        row_words = -(-layout.header_words // 2) * 2
        self.staging.int32[slot * row_words:slot * row_words + layout.header_words] = header_words
        routed_out = routed_out.contiguous()
        num_routed = routed_out.shape[0]
        num_shared = 0 if shared_out is None else shared_out.shape[0]
        launch = self.reply_launches.get((attn_rank, ring))
        if launch is None:
            launch = self.reply_launches[(attn_rank, ring)] = self._reply_launch(attn_rank, ring)
        launch.set("routed_out", routed_out.data_ptr() if num_routed else 0)
        launch.set("num_routed", num_routed)
        launch.set("shared_out", shared_out.contiguous().data_ptr() if num_shared else 0)
        launch.set("num_shared", num_shared)
        launch.set("seq", seq)
        # NOTE: a copy made by .contiguous() may be freed on return: torch's allocator reuses
        # it only for work queued later on this same stream, after the kernel has read it.
        launch.launch(self.stream_ptr(), kernels.reply_grid(num_routed + num_shared))

    def _reply_launch(self, attn_rank: int, ring: int) -> kernels.PackedLaunch:
        """The reply kernel of one (Attention rank, ring), checked and packed once."""
        layout, conn = self.layout, self.conn
        slot = layout.slot_index(attn_rank, ring)
        row_words = -(-layout.header_words // 2) * 2
        return kernels.PackedLaunch(kernels.reply_spec(
            dtype_code=self.dtype_code, dst_window=self.window.peer_ptr(conn.attn_pe(attn_rank)),
            geo=self.geometry, src_rank=conn.role_rank, ring=ring, routed_out=0, num_routed=0,
            shared_out=0, num_shared=0, hidden_size=layout.hidden_size,
            header_src=self.staging.ptr + slot * row_words * 4, seq=0,
            done_counter=self.reply_done[slot]))

    # --- both -------------------------------------------------------------------------------
    def send_control(self, pe: int, ring: int, header_words: np.ndarray, seq: int) -> None:
        """A header-only message (shutdown) written with ordered copies on the current stream."""
        with self.stream():
            self.window.write_message(pe, self.conn.role_rank, ring, header_words, seq)
        self.stream().synchronize()

    def close(self) -> None:
        torch.cuda.synchronize(self.device_id)


def require_available() -> None:
    """Raise ImportError when CuPy or the NVSHMEM host library cannot be loaded here."""
    import cupy  # noqa: F401

    from afd_cupy.heap.nvshmem_lib import find_library

    if not find_library():
        raise ImportError("libnvshmem_host.so.3 not found (install nvidia-nvshmem-cu12/cu13)")
