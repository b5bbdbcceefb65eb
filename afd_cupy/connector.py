"""The AFD connector: one object per process, Attention side or FFN side (DESIGN §6).

Attention side::

    weights, ids = conn.select_experts(router_logits)
    handle = conn.send_attn_output(hidden, ids, weights, layer_idx)   # one-sided writes
    out = conn.recv_ffn_output(handle)                                 # wait + fp32 combine

FFN side::

    item = conn.recv_ffn_work_item(timeout_ms)      # None on poll timeout
    conn.send_ffn_work_item_output(item, routed_out, shared_out)

Both: ``announce_shutdown()``; receiving the opposite role's shutdown raises
``ConnectorShutdown`` (an FFN rank raises once every Attention rank has announced it).
Construction and ``close()`` are collective over the whole AFD world.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from afd_cupy import moe, wire
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.errors import (ConfigError, ConnectorShutdown, ProtocolError, RingExhaustedError)
from afd_cupy.payload import torch_dtype
from afd_cupy.topology import Role, Topology
from afd_cupy.wire import WindowLayout

logger = logging.getLogger("afd_cupy")

#: flag value of a shutdown message: above every data seq, so flags stay monotonic
SHUTDOWN_SEQ = (1 << 63) - 1
BACKENDS = ("cuda", "host")
POLL_MODES = ("device", "host")


@dataclass(frozen=True)
class DispatchHandle:
    """What ``send_attn_output`` returns; pass it to ``recv_ffn_output``.

    ``topk_ids``/``topk_weights`` never travel: they stay here for the combine.
    """

    layer_idx: int
    stage_idx: int
    ring: int
    num_tokens: int
    topk_ids: Any = field(repr=False)
    topk_weights: Any = field(repr=False)
    state: Any = field(repr=False, compare=False)


@dataclass(frozen=True)
class FFNWorkItem:
    """One received dispatch, as zero-copy views into this FFN rank's window.

    - ``routed_x``: [routed_tokens, hidden] payload dtype, rows grouped by local expert.
    - ``group_list``: int32 [expert_per_rank] on the payload's device, rows per local expert
      (sums to routed_tokens); ``group_list_host`` the same as a tuple.
    - ``shared_x``: [shared_tokens, hidden] rows of this rank's round-robin shared slice.
    - ``route_table``: int32 [routed_tokens, 2] (token index, top-k slot) per row.
    The views stay valid until this item is answered with ``send_ffn_work_item_output``.
    """

    src_rank: int
    layer_idx: int
    stage_idx: int
    num_tokens: int
    ring: int
    seq: int
    routed_x: Any = field(repr=False)
    group_list: Any = field(repr=False)
    group_list_host: tuple = field(repr=False)
    shared_x: Any = field(repr=False)
    route_table: Any = field(repr=False)
    header: wire.Header = field(repr=False)

    @property
    def routed_tokens(self) -> int:
        return self.header.routed_tokens

    @property
    def shared_tokens(self) -> int:
        return self.header.shared_tokens


class AFDConnector:
    """Attention-side or FFN-side endpoint of the AFD world.

    Args:
        model, topology, connector: the configs (both roles must pass equal ones).
        role: ``"attention"`` or ``"ffn"``; role_rank: rank inside the role.
        store: rendezvous store (``set``/``get``/``add``) shared by the whole world,
            namespaced per job.
        job_id: names this job's shared-memory segments (host backend).
        backend: ``"cuda"`` (NVSHMEM + CuPy kernels) or ``"host"`` (shared memory + numba).
        device_id: CUDA device of this process (cuda backend).
        poll_mode: cuda backend only: ``"device"`` (spinning kernels; needs one GPU per
            process or CUDA MPS) or ``"host"`` (flags copied to the host per poll).
        peer_timeout_s: bound of every wait for a peer's reply.
        startup_timeout_s: bound of the collective start-up (NVSHMEM bootstrap, heap barriers).
        always_send: Attention side: send a (header-only) message to every FFN rank even when
            it gets no rows. Needed by the lockstep FFN schedule, which waits for every
            replica's layer; off by default (empty messages never create a wait).
    """

    def __init__(self, model: ModelConfig, topology: TopologyConfig,
                 connector: ConnectorConfig | None = None, *, role: str | Role, role_rank: int,
                 store, job_id: str = "afd", backend: str = "host", device_id: int | None = None,
                 poll_mode: str = "device", peer_timeout_s: float = 60.0, always_send: bool = False,
                 startup_timeout_s: float = 120.0):
        self.model = model
        self.config = connector or ConnectorConfig()
        self.role = Role(role)
        self.role_rank = role_rank
        self.topology = Topology.from_configs(model, topology)
        self._check_args(backend, poll_mode)
        self.backend = backend
        self.poll_mode = poll_mode
        self.peer_timeout_s = float(peer_timeout_s)
        self.always_send = bool(always_send)
        self.startup_timeout_s = float(startup_timeout_s)
        self.world_rank = self.topology.world_rank(self.role, role_rank)
        self.layout = WindowLayout.from_configs(model, topology, self.config)
        self.has_shared = model.num_shared_experts > 0
        self.torch_dtype = torch_dtype(model.dtype)
        self.out_scale = moe.combine_scale(self.torch_dtype, model.routed_scaling_factor)
        self._seqs = np.zeros((self.topology.num_regions, self.layout.ring_depth), np.int64)
        self._pending: dict[int, DispatchHandle] = {}
        self._shutdown_from: set[int] = set()
        self._closed = False
        self.heap = self._make_heap(store, job_id, device_id)
        from afd_cupy.window import Window
        self.window = Window(self.heap, self.layout, store)
        self.path = self._make_path()
        logger.info("afd_cupy %s rank %d (world rank %d/%d) up: backend=%s window=%.1f MiB",
                    self.role.value, role_rank, self.world_rank, self.topology.world_size,
                    backend, self.layout.window_bytes / 2**20)

    def _check_args(self, backend: str, poll_mode: str) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if poll_mode not in POLL_MODES:
            raise ConfigError(f"poll_mode must be one of {POLL_MODES}, got {poll_mode!r}")
        if self.config.attn_ranks_per_dp != 1:
            raise ConfigError(f"attn_ranks_per_dp={self.config.attn_ranks_per_dp}: only 1 is supported "
                              "(one sending Attention rank per data-parallel replica)")

    def _make_heap(self, store, job_id: str, device_id: int | None):
        world = self.topology.world_size
        if self.backend == "host":
            from afd_cupy.heap.host import HostHeap
            return HostHeap(self.world_rank, world, store, job_id, timeout_s=self.startup_timeout_s)
        from afd_cupy.heap.nvshmem import NvshmemHeap
        return NvshmemHeap(self.world_rank, world, store, job_id, device_id or 0,
                           timeout_s=self.startup_timeout_s)

    def _make_path(self):
        if self.backend == "host":
            from afd_cupy.backends.host import HostDataPath
            return HostDataPath(self)
        from afd_cupy.backends.cuda import CudaDataPath
        return CudaDataPath(self)

    # --- helpers shared by the data paths ---------------------------------------------------
    def ffn_pe(self, ffn_rank: int) -> int:
        return self.topology.world_rank(Role.FFN, ffn_rank)

    def attn_pe(self, attn_rank: int) -> int:
        return self.topology.world_rank(Role.ATTENTION, attn_rank)

    def next_seq(self, peer: int, ring: int) -> int:
        """Next host-side seq of this rank's messages to ``peer`` on ``ring`` (1, 2, ...)."""
        self._seqs[peer, ring] += 1
        return int(self._seqs[peer, ring])

    @property
    def device(self) -> torch.device:
        if self.backend == "host":
            return torch.device("cpu")
        return torch.device("cuda", self.heap.device_id)

    # --- Attention side ---------------------------------------------------------------------
    def select_experts(self, router_logits: torch.Tensor):
        """Gate with the model's scoring: ``(topk_weights fp32 [T,K], topk_ids int32 [T,K])``."""
        model = self.model
        return moe.select_experts(
            router_logits, model.top_k, use_grouped_topk=model.n_group is not None,
            num_expert_group=model.n_group, topk_group=model.topk_group,
            scoring_func=model.scoring_func, renormalize=model.renormalize)

    def send_attn_output(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, layer_idx: int, stage_idx: int = 0) -> DispatchHandle:
        """Route and write ``hidden`` one-sided into the FFN ranks' windows.

        hidden: [T, hidden_size] model dtype on this connector's device; topk_ids: int
        [T, top_k]; topk_weights: float [T, top_k]. Raises CapacityError (nothing written)
        when a rank's routed partials exceed routed_cap. Not collective; never blocks on peers.
        """
        self._require(Role.ATTENTION, "send_attn_output")
        self._check_send_args(hidden, topk_ids, topk_weights, layer_idx, stage_idx)
        ring = self._acquire_ring(stage_idx)
        try:
            state = self.path.dispatch(hidden, topk_ids, layer_idx=layer_idx,
                                       stage_idx=stage_idx, ring=ring)
        except BaseException:
            self._pending.pop(ring, None)
            raise
        handle = DispatchHandle(layer_idx, stage_idx, ring, hidden.shape[0], topk_ids,
                                topk_weights, state)
        self._pending[ring] = handle
        return handle

    def recv_ffn_output(self, handle: DispatchHandle, *, blocking: bool = True) -> torch.Tensor:
        """Wait for the replies of exactly the FFN ranks that were sent to, and combine.

        Returns [T, hidden_size] in the model dtype: ``Σ_k w[t,k]·expert(t,k) + shared(t)``
        accumulated in fp32. ``blocking=False`` (cuda backend) enqueues the wait and the
        combine on the current stream without a host synchronization; errors then surface at
        the next blocking call or ``check_errors()``, and failed rows are NaN.
        """
        self._require(Role.ATTENTION, "recv_ffn_output")
        if self._pending.get(handle.ring) is not handle:
            raise ProtocolError(f"handle for layer {handle.layer_idx} ring {handle.ring} is not pending "
                                "(already received, or from another connector)")
        try:
            return self.path.combine(handle.state, handle.topk_ids, handle.topk_weights,
                                     ring=handle.ring, layer_idx=handle.layer_idx,
                                     out_scale=self.out_scale, **self._blocking_kw(blocking))
        finally:
            del self._pending[handle.ring]

    def _blocking_kw(self, blocking: bool) -> dict:
        return {} if self.backend == "host" else {"blocking": blocking}

    def check_errors(self) -> None:
        """Synchronize and raise any error latched by a non-blocking call (cuda backend)."""
        if self.backend == "cuda":
            self.path.check_errors()

    def _acquire_ring(self, stage_idx: int) -> int:
        num_stages, depth = self.config.num_stages, self.layout.ring_depth
        for ring in range(stage_idx % num_stages, depth, num_stages):
            if ring not in self._pending:
                self._pending[ring] = None  # reserved until the handle exists
                return ring
        rings = list(range(stage_idx % num_stages, depth, num_stages))
        raise RingExhaustedError(
            f"stage {stage_idx}: all its rings {rings} have a dispatch in flight; Attention is "
            f"send-then-recv per (peer, stage), so ring_depth={depth} with {num_stages} stage(s) "
            "means the caller skipped a recv_ffn_output or the configs do not match")

    def _check_send_args(self, hidden, topk_ids, topk_weights, layer_idx, stage_idx) -> None:
        model = self.model
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != model.hidden_size:
            raise ValueError(f"hidden must be a [num_tokens, {model.hidden_size}] tensor, got "
                             f"{getattr(hidden, 'shape', type(hidden).__name__)}")
        if hidden.dtype != self.torch_dtype:
            raise ValueError(f"hidden has dtype {hidden.dtype}, the model dtype is {self.torch_dtype}")
        if hidden.device.type != self.device.type:
            raise ValueError(f"hidden is on {hidden.device}, the {self.backend} backend needs {self.device.type}")
        expected = (hidden.shape[0], model.top_k)
        for name, tensor, ok_dtype in (("topk_ids", topk_ids, not topk_ids.dtype.is_floating_point),
                                       ("topk_weights", topk_weights, topk_weights.dtype.is_floating_point)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
            if not ok_dtype:
                raise ValueError(f"{name} has wrong dtype {tensor.dtype}")
            if tensor.device.type != hidden.device.type:
                raise ValueError(f"{name} is on {tensor.device}, hidden on {hidden.device}")
        if hidden.shape[0] > self.layout.token_cap:
            from afd_cupy.errors import CapacityError
            raise CapacityError(f"num_tokens={hidden.shape[0]} > token_cap={self.layout.token_cap} "
                                "(max_num_batched_tokens)", counts=hidden.shape[0], cap=self.layout.token_cap)
        if not (0 <= stage_idx < self.config.num_stages):
            raise ValueError(f"stage_idx={stage_idx} outside [0, {self.config.num_stages})")
        if layer_idx < 0:
            raise ValueError(f"layer_idx must be >= 0, got {layer_idx}")

    # --- FFN side ---------------------------------------------------------------------------
    def recv_ffn_work_item(self, timeout_ms: int | None = None) -> FFNWorkItem | None:
        """Next dispatch from any Attention rank, or None after ``timeout_ms``
        (default ``recv_poll_timeout_ms``). Fair across regions (rotating scan).
        Raises ConnectorShutdown once every Attention rank has announced shutdown."""
        self._require(Role.FFN, "recv_ffn_work_item")
        timeout_ms = self.config.recv_poll_timeout_ms if timeout_ms is None else timeout_ms
        while True:
            arrival = self.path.wait_any(timeout_ms / 1000.0)
            if arrival is None:
                return None
            region, ring, words = arrival
            header = wire.decode_header(words, self.layout.expert_per_rank)
            if header.is_shutdown:
                self._note_shutdown(header.src_rank)
                continue
            return self._work_item(region, ring, header)

    def _note_shutdown(self, src_rank: int) -> None:
        self._shutdown_from.add(src_rank)
        logger.info("afd_cupy ffn rank %d: attention rank %d announced shutdown (%d/%d)",
                    self.role_rank, src_rank, len(self._shutdown_from), self.topology.num_attn_ranks)
        if len(self._shutdown_from) == self.topology.num_attn_ranks:
            raise ConnectorShutdown("every Attention rank announced shutdown", src_rank=src_rank)

    def _work_item(self, region: int, ring: int, header: wire.Header) -> FFNWorkItem:
        if header.src_rank != region:
            raise ProtocolError(f"message in region {region} claims source rank {header.src_rank}")
        routed, shared, route, group_list = self.path.item_views(region, ring, header)
        return FFNWorkItem(src_rank=region, layer_idx=header.layer_idx, stage_idx=header.stage_idx,
                           num_tokens=header.num_tokens, ring=ring, seq=header.seq, routed_x=routed,
                           group_list=group_list, group_list_host=header.expert_counts,
                           shared_x=shared if header.shared_tokens else None, route_table=route,
                           header=header)

    def send_ffn_work_item_output(self, item: FFNWorkItem, routed_out: torch.Tensor,
                                  shared_out: torch.Tensor | None = None) -> None:
        """Write the expert outputs back into the sender's window (region = this FFN rank).

        routed_out: [item.routed_tokens, hidden] in wire order; shared_out:
        [item.shared_tokens, hidden] or None (only when the item had no shared rows).
        """
        self._require(Role.FFN, "send_ffn_work_item_output")
        self._check_outputs(item, routed_out, shared_out)
        seq = self.next_seq(item.src_rank, item.ring)
        h = item.header
        reply = wire.Header(seq=seq, src_rank=self.role_rank, layer_idx=h.layer_idx,
                            stage_idx=h.stage_idx, num_tokens=h.num_tokens,
                            routed_tokens=h.routed_tokens, shared_tokens=h.shared_tokens,
                            top_k=h.top_k, flags=0, echo_seq=h.seq, expert_counts=h.expert_counts)
        words = wire.header_word_list(reply, self.layout.expert_per_rank)
        self.path.reply(item.src_rank, item.ring, words, seq, routed_out,
                        shared_out if h.shared_tokens else None)

    def _check_outputs(self, item, routed_out, shared_out) -> None:
        hidden = self.model.hidden_size
        expected = (item.routed_tokens, hidden)
        if tuple(routed_out.shape) != expected or routed_out.dtype != self.torch_dtype:
            raise ValueError(f"routed_out must be {expected} {self.torch_dtype}, got "
                             f"{tuple(routed_out.shape)} {routed_out.dtype}")
        if item.shared_tokens:
            expected = (item.shared_tokens, hidden)
            if shared_out is None or tuple(shared_out.shape) != expected or shared_out.dtype != self.torch_dtype:
                raise ValueError(f"shared_out must be {expected} {self.torch_dtype} for an item with "
                                 f"shared rows, got {None if shared_out is None else tuple(shared_out.shape)}")

    # --- both sides -------------------------------------------------------------------------
    def announce_shutdown(self) -> None:
        """Write a shutdown header to every opposite-role peer (region = own rank, ring 0)."""
        opposite = self.role.opposite
        for peer in range(self.topology.num_role_ranks(opposite)):
            header = wire.Header(seq=SHUTDOWN_SEQ, src_rank=self.role_rank, layer_idx=0, stage_idx=0,
                                 num_tokens=0, routed_tokens=0, shared_tokens=0,
                                 top_k=self.model.top_k, flags=wire.FLAG_SHUTDOWN, echo_seq=0,
                                 expert_counts=(0,) * self.layout.expert_per_rank)
            words = wire.encode_header(header, self.layout.expert_per_rank)
            self.path.send_control(self.topology.world_rank(opposite, peer), 0, words, SHUTDOWN_SEQ)

    def close(self) -> None:
        """Collective: every rank of the world calls it; frees the window. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.path.close()
        self.window.close()
        self.heap.close()

    def __enter__(self) -> "AFDConnector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            logger.warning("AFDConnector rank %s was not closed (close() is collective)",
                           getattr(self, "world_rank", "?"))

    def _require(self, role: Role, what: str) -> None:
        if self.role is not role:
            raise ProtocolError(f"{what} is a {role.value}-side call; this connector is {self.role.value}")
        if self._closed:
            raise ProtocolError(f"{what} on a closed connector")
