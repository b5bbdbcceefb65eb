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
from afd_cupy.kernels import PinnedInt64, StatusBlock

#: extra host-side wait beyond a kernel's own timeout before the host stops trusting it
_HOST_GRACE_S = 5.0


@dataclass
class CudaSendState:
    """One dispatch in flight: its ring's scratch and the tensors its kernels read."""

    scratch: kernels.DispatchScratch
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
        self.geometry = kernels.layout_kernel_args(layout)
        self.timeout_ns = int(conn.peer_timeout_s * 1e9)
        self.own_window = self.window.peer_ptr(conn.world_rank)
        # NOTE: device memory, read by the host only after a synchronization (see StatusBlock);
        # the FFN doorbell and header staging below stay pinned: the host polls / writes them
        # without synchronizing.
        self.status = StatusBlock.allocate()
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
        self.scratch = [kernels.DispatchScratch.allocate(max_partials, num_ffn, layout.expert_per_rank)
                        for _ in range(layout.ring_depth)]
        self.expected = [cp.zeros(num_ffn, cp.int64) for _ in range(layout.ring_depth)]
        self.combine_done = [cp.zeros(1, cp.uint32) for _ in range(layout.ring_depth)]

    def _init_ffn(self) -> None:
        cp, layout = self.cp, self.layout
        self.scan_start = cp.zeros(1, cp.int32)
        self.doorbell = PinnedInt64(kernels.DB_HEADER + -(-layout.header_words // 2))
        self.ticket = 0
        self.poll_stream = cp.cuda.Stream(non_blocking=True)
        # one pinned header staging row per (attention peer, ring): one reply in flight each
        self.staging = PinnedInt64(layout.num_slots * -(-layout.header_words // 2))
        self.reply_done = [cp.zeros(1, cp.uint32) for _ in range(layout.num_slots)]
        self.views = [self._slot_views(region, ring) for region in range(layout.num_regions)
                      for ring in range(layout.ring_depth)]

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

    def stream(self):
        """The cupy view of torch's current stream on this device (cached per handle)."""
        handle = torch.cuda.current_stream(self.device_id).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = self.cp.cuda.ExternalStream(handle, self.device_id)
        return stream

    # --- Attention side ---------------------------------------------------------------------
    def dispatch(self, hidden, topk_ids, *, layer_idx: int, stage_idx: int, ring: int) -> CudaSendState:
        conn, layout, geo = self.conn, self.layout, self.geometry
        self.raise_latched()
        num_tokens = hidden.shape[0]
        hidden = hidden.contiguous()
        ids = topk_ids.to(torch.int32).reshape(-1).contiguous()
        ids_cp = self._cupy_view(ids)
        scratch, expected = self.scratch[ring], self.expected[ring]
        stream = self.stream()
        num_ffn, epr = conn.topology.num_ffn_ranks, layout.expert_per_rank
        num_partials = num_tokens * layout.top_k
        kernels.launch_dispatch_plan(
            topk_ids=ids_cp, num_partials=num_partials, num_ffn_ranks=num_ffn, expert_per_rank=epr,
            routed_cap=layout.routed_cap, chunk_hist=scratch.chunk_hist, local_rank=scratch.local_rank,
            expert_counts=scratch.expert_counts, expert_start=scratch.expert_start,
            rank_offsets=scratch.rank_offsets, done_counter=scratch.plan_done,
            status_ptr=self.status.ptr, stream=stream)
        kernels.launch_dispatch_scatter(
            dtype_code=self.dtype_code, hidden_ptr=hidden.data_ptr(), num_tokens=num_tokens,
            hidden_size=layout.hidden_size, topk_ids=ids_cp, num_partials=num_partials,
            top_k=layout.top_k, expert_per_rank=epr, num_ffn_ranks=num_ffn,
            chunk_hist=scratch.chunk_hist, local_rank=scratch.local_rank,
            expert_start=scratch.expert_start, rank_offsets=scratch.rank_offsets,
            expert_counts=scratch.expert_counts, peer_windows=self.peer_windows,
            slot_offset=layout.slot_offset(conn.role_rank, ring),
            flags_index=layout.slot_index(conn.role_rank, ring), off_header=geo["off_header"],
            off_route=geo["off_route"], off_routed_x=geo["off_routed_x"],
            off_shared_idx=geo["off_shared_idx"], off_shared_x=geo["off_shared_x"],
            hdr_words=geo["hdr_words"], has_shared=int(conn.has_shared),
            always_send=int(conn.always_send), pos_out=scratch.pos,
            src_rank=conn.role_rank, layer_idx=layer_idx, stage_idx=stage_idx, hdr_flags=0,
            seq_counters=self.seq_counters[ring], expected=expected,
            done_counter=scratch.scatter_done, status_ptr=self.status.ptr, stream=stream)
        return CudaSendState(scratch, expected, ids, hidden, num_tokens)

    def _cupy_view(self, tensor: torch.Tensor):
        """1-D cupy view of a contiguous tensor, without DLPack's stream handshake.

        NOTE: ``UnownedMemory`` is given the device id so that no CUDA call runs on this hot
        path; the tensor is the owner and stays alive with the view.
        """
        cp = self.cp
        dtype = {torch.int32: cp.int32, torch.float32: cp.float32}[tensor.dtype]
        if tensor.numel() == 0:
            return cp.zeros(1, dtype)
        memory = cp.cuda.UnownedMemory(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                       tensor, device_id=self.device_id)
        return cp.ndarray((tensor.numel(),), dtype, cp.cuda.MemoryPointer(memory, 0))

    def combine(self, state: CudaSendState, topk_ids, topk_weights, *, ring: int, layer_idx: int,
                out_scale: float, blocking: bool = True) -> torch.Tensor:
        layout, geo, conn = self.layout, self.geometry, self.conn
        num_tokens = state.num_tokens
        weights = topk_weights.to(torch.float32).reshape(-1).contiguous()
        out = torch.empty(num_tokens, layout.hidden_size, dtype=conn.torch_dtype,
                          device=torch.device("cuda", self.device_id))
        stream = self.stream()
        if conn.poll_mode == "host":
            self._host_wait_replies(state, ring, layer_idx)
        else:
            kernels.launch_wait_replies(
                window_ptr=self.own_window, num_ffn_ranks=conn.topology.num_ffn_ranks,
                flags_bytes=geo["flags_bytes"], slot_bytes=geo["slot_bytes"],
                ring_depth=layout.ring_depth, ring=ring, off_header=geo["off_header"],
                expected=state.expected, last_seen=self.last_seen, timeout_ns=self.timeout_ns,
                status_ptr=self.status.ptr, stream=stream)
        kernels.launch_combine(
            dtype_code=self.dtype_code, out_ptr=out.data_ptr(), num_tokens=num_tokens,
            hidden_size=layout.hidden_size, topk_ids=self._cupy_view(state.topk_ids),
            topk_weights=self._cupy_view(weights),
            pos=state.scratch.pos, top_k=layout.top_k, expert_per_rank=layout.expert_per_rank,
            num_ffn_ranks=conn.topology.num_ffn_ranks, has_shared=int(conn.has_shared),
            window_ptr=self.own_window, flags_bytes=geo["flags_bytes"], slot_bytes=geo["slot_bytes"],
            ring_depth=layout.ring_depth, ring=ring, off_header=geo["off_header"],
            off_routed_x=geo["off_routed_x"], off_shared_x=geo["off_shared_x"],
            hdr_words=geo["hdr_words"], expected=state.expected, last_seen=self.last_seen,
            timeout_ns=self.timeout_ns, out_scale=out_scale, done_counter=self.combine_done[ring],
            status_ptr=self.status.ptr, stream=stream)
        if blocking:
            self._sync_and_raise(layer_idx=layer_idx)
        return out

    def _host_wait_replies(self, state: CudaSendState, ring: int, layer_idx: int) -> None:
        """poll_mode="host": wait for the reply flags with host copies (no spinning kernel)."""
        self._sync_and_raise(layer_idx=layer_idx)
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
        self._sync_and_raise()

    def _sync_and_raise(self, *, layer_idx: int | None = None) -> None:
        """Mirror the device status to the host, synchronize the stream, raise what it holds."""
        stream = self.stream()
        self.status.enqueue_mirror(stream.ptr)
        stream.synchronize()
        self.raise_latched(layer_idx=layer_idx)

    def raise_latched(self, *, layer_idx: int | None = None) -> None:
        """Raise the first error in the host mirror of the status block, and clear both copies.

        The mirror is as fresh as the last :meth:`_sync_and_raise`: without one, this sees no
        error latched since (``dispatch`` calls it as a cheap safety net, not as a check).
        NOTE: the device words are cleared in stream order and the stream is synchronized
        (error path only), so the next launch on any stream starts from a clean status, as the
        immediate clear of the former pinned status block did.
        """
        status = self.status.read()
        if status["code"] == kernels.STATUS_OK:
            return
        stream = self.stream()
        self.status.clear(stream.ptr)
        stream.synchronize()
        raise _status_error(status, layer_idx, self.conn.peer_timeout_s)

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
        layout, geo = self.layout, self.geometry
        self.ticket += 1
        bell = self.doorbell.array
        kernels.launch_wait_any(
            window_ptr=self.own_window, num_slots=layout.num_slots, last_seen=self.last_seen,
            scan_start=self.scan_start, off_header=geo["off_header"], flags_bytes=geo["flags_bytes"],
            slot_bytes=geo["slot_bytes"], hdr_words=geo["hdr_words"],
            timeout_ns=int(timeout_s * 1e9), doorbell_ptr=self.doorbell.ptr, ticket=self.ticket,
            stream=self.poll_stream)
        deadline = time.monotonic() + timeout_s + _HOST_GRACE_S
        spins = 0
        while bell[kernels.DB_TICKET] != self.ticket:
            spins += 1
            if spins % 4096 == 0 and time.monotonic() > deadline:
                # NOTE: the kernel may not have started (GPU busy); waiting for it is bounded by
                # its own timeout once it runs, and it must not consume an arrival unseen.
                self.poll_stream.synchronize()
                if bell[kernels.DB_TICKET] != self.ticket:
                    raise PeerTimeoutError(f"wait_any kernel did not report ticket {self.ticket}")
        if bell[kernels.DB_STATUS] != kernels.STATUS_OK:
            return None
        slot = int(bell[kernels.DB_SLOT])
        words = bell[kernels.DB_HEADER:].view(np.int32)[:layout.header_words].copy()
        region, ring = divmod(slot, layout.ring_depth)
        return region, ring, words

    def item_views(self, region: int, ring: int, header: wire.Header):
        views = self.views[self.layout.slot_index(region, ring)]
        empty = torch.empty(0, self.layout.hidden_size, dtype=self.conn.torch_dtype,
                            device=torch.device("cuda", self.device_id))
        routed = views["routed_x"][:header.routed_tokens] if header.routed_tokens else empty
        shared = views["shared_x"][:header.shared_tokens] if header.shared_tokens else empty
        route = views["route_table"][:header.routed_tokens] if "route_table" in views else None
        return routed, shared, route, views["counts"]

    def reply(self, attn_rank: int, ring: int, header_words: np.ndarray, seq: int,
              routed_out, shared_out) -> None:
        layout, geo, conn = self.layout, self.geometry, self.conn
        slot = layout.slot_index(attn_rank, ring)
        row_words = -(-layout.header_words // 2) * 2
        staging = self.staging.int32[slot * row_words:slot * row_words + layout.header_words]
        staging[:] = header_words
        routed_out = routed_out.contiguous()
        num_shared = 0 if shared_out is None else shared_out.shape[0]
        shared_out = shared_out.contiguous() if num_shared else None
        kernels.launch_reply(
            dtype_code=self.dtype_code, dst_window_ptr=self.window.peer_ptr(conn.attn_pe(attn_rank)),
            slot_offset=layout.slot_offset(conn.role_rank, ring),
            flags_index=layout.slot_index(conn.role_rank, ring), off_header=geo["off_header"],
            off_routed_x=geo["off_routed_x"], off_shared_x=geo["off_shared_x"],
            routed_out_ptr=routed_out.data_ptr() if routed_out.shape[0] else 0,
            num_routed=routed_out.shape[0],
            shared_out_ptr=shared_out.data_ptr() if num_shared else 0, num_shared=num_shared,
            hidden_size=layout.hidden_size, header_src_ptr=self.staging.ptr + slot * row_words * 4,
            hdr_words=layout.header_words, seq=seq, done_counter=self.reply_done[slot],
            stream=self.stream())

    # --- both -------------------------------------------------------------------------------
    def send_control(self, pe: int, ring: int, header_words: np.ndarray, seq: int) -> None:
        """A header-only message (shutdown) written with ordered copies on the current stream."""
        with self.stream():
            self.window.write_message(pe, self.conn.role_rank, ring, header_words, seq)
        self.stream().synchronize()

    def close(self) -> None:
        torch.cuda.synchronize(self.device_id)


def _status_error(status: dict, layer_idx, timeout_s: float) -> Exception:
    code, peer = status["code"], status["peer"]
    where = f" for layer {layer_idx}" if layer_idx is not None else ""
    if code == kernels.STATUS_CAPACITY:
        return routed_capacity_error(status["count"], peer, status["cap"], nothing_sent=True)
    if code == kernels.STATUS_TIMEOUT:
        return reply_timeout_error(peer, status["ring"], layer_idx, status["expected"],
                                   status["observed"], timeout_s)
    if code == kernels.STATUS_SHUTDOWN:
        return ConnectorShutdown(f"FFN rank {peer} announced shutdown while a reply was pending",
                                 src_rank=peer)
    if code == kernels.STATUS_ECHO_MISMATCH:
        return ProtocolError(f"reply from FFN rank {peer} echoes seq {status['observed']}, pending "
                             f"dispatch has seq {status['expected']}{where}")
    if code == kernels.STATUS_BAD_HEADER:
        return WireError(f"bad reply header from FFN rank {peer}{where}: {status}")
    return ProtocolError(f"device status {status['name']}{where}: {status}")
