"""The AFD connector: one object per process, Attention side or FFN side (docs/design/protocol.md).

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
import numbers
import socket
import threading

import torch

from afd_cupy import env, gates, handshake, moe, peer_state
from afd_cupy.backends.base import POLL_MODES, Arrival, PathContext, open_path, require_backend
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.dtypes import torch_dtype
from afd_cupy.errors import (AfdError, ConfigError, ConnectorShutdown, PeerLostError,
                             PeerTimeoutError, ProtocolError, RingExhaustedError, token_cap_error)
from afd_cupy.handles import DispatchHandle, FFNWorkItem  # noqa: F401 - part of this module's API
from afd_cupy.heap.nvshmem_env import check_nvshmem_env
from afd_cupy.timeouts import check_optional_timeout, check_timeout
from afd_cupy.topology import Role, Topology
from afd_cupy.wire import WindowLayout

logger = logging.getLogger("afd_cupy")


def _check_config(name: str, value, cls):
    if not isinstance(value, cls):
        hint = f" (use {cls.__name__}.from_mapping for a dict)" if isinstance(value, dict) else ""
        raise ConfigError(f"{name} must be a {cls.__name__}, got {type(value).__name__}{hint}")
    return value


class AFDConnector:
    """Attention-side or FFN-side endpoint of the AFD world.

    Args:
        model, topology, connector: the configs (both roles must pass equal ones).
        role: ``"attention"`` or ``"ffn"``; role_rank: rank inside the role.
        store: rendezvous store (``set``/``get``/``add``) shared by the whole world,
            namespaced per job.
        job_id: names this job's shared-memory segments (host backend).
        backend: ``"cuda"`` (NVSHMEM + CuPy kernels) or ``"host"`` (shared memory + numpy).
        device_id: CUDA device of this process (cuda backend).
        poll_mode: cuda backend only: ``"device"`` (spinning kernels; needs one GPU per
            process or CUDA MPS) or ``"host"`` (flags copied to the host per poll).
        recv_spin_us: cuda backend, FFN side, ``poll_mode="device"``: how long (µs) a receive
            spins on the wait kernel's doorbell before it sleeps in the CUDA driver until the
            kernel ends (a blocking-sync event), so an idle FFN burns no host core. Items that
            arrive within the spin are seen at once; later ones pay the driver's wake-up
            (docs/design/kernels.md). 0: sleep at once. Default 500.
        peer_timeout_s: bound of every wait for a peer's reply (finite, > 0).
        startup_timeout_s: bound of the collective start-up (NVSHMEM bootstrap, heap barriers).
        nvshmem_env: cuda backend: NVSHMEM's environment as one dict
            (``afd_cupy.heap.nvshmem_env.nvshmem_env(remote_transport=..., symmetric_size=...)``;
            checked here, before any collective step), set right before NVSHMEM initializes;
            default: afd_cupy's defaults only. The host backend ignores it.
        always_send: Attention side: send a (header-only) message to every FFN rank even when
            it gets no rows. Needed by the lockstep FFN schedule, which waits for every
            replica's layer; off by default (empty messages never create a wait).
        cpu_threads: this process's CPU thread pools (torch intra-op, OpenMP, MKL, OpenBLAS,
            numba). ``"auto"`` (default): only when nothing set them (no
            ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``/``OPENBLAS_NUM_THREADS``/
            ``NUMBA_NUM_THREADS``, as ``afd_cupy.launch`` sets for its children) and torch's
            pool is larger, lower it to this host's cores divided by the job's ranks on this
            host (from the handshake); an int: exactly that many
            (``afd_cupy.env.limit_threads``); None: leave the process alone.

    Raises ConfigError for invalid arguments and BackendUnavailableError when ``backend``
    cannot run here. Construction and :meth:`close` are collective over the AFD world.

    ``path`` is the backend's :class:`~afd_cupy.backends.base.DataPath` (public so that tools
    can time its steps; the connector's own methods are the API).
    """

    def __init__(self, model: ModelConfig, topology: TopologyConfig,
                 connector: ConnectorConfig | None = None, *, role: str | Role, role_rank: int,
                 store, job_id: str = "afd", backend: str = "host", device_id: int | None = None,
                 poll_mode: str = "device", peer_timeout_s: float = 60.0, always_send: bool = False,
                 startup_timeout_s: float = 120.0, nvshmem_env: dict | None = None,
                 cpu_threads: int | str | None = "auto", recv_spin_us: int = 500):
        self.model = _check_config("model", model, ModelConfig)
        _check_config("topology", topology, TopologyConfig)
        self.config = _check_config("connector", connector or ConnectorConfig(), ConnectorConfig)
        if self.config.attn_ranks_per_dp != 1:
            raise ConfigError(f"attn_ranks_per_dp={self.config.attn_ranks_per_dp}: only 1 is supported "
                              "(one sending Attention rank per data-parallel replica)")
        self.role = Role(role)
        self.role_rank = role_rank
        self.topology = Topology.from_configs(model, topology)
        self.backend = backend
        self.peer_timeout_s = check_timeout("peer_timeout_s", peer_timeout_s)
        self.startup_timeout_s = check_timeout("startup_timeout_s", startup_timeout_s)
        self.world_rank = self.topology.world_rank(self.role, role_rank)
        require_backend(backend, self.config.wire_mode, self.config.transport)  # before any collective step
        if poll_mode not in POLL_MODES:
            raise ConfigError(f"poll_mode must be one of {POLL_MODES}, got {poll_mode!r}")
        _check_cpu_threads(cpu_threads)
        if isinstance(recv_spin_us, bool) or not isinstance(recv_spin_us, numbers.Integral) or recv_spin_us < 0:
            raise ConfigError(f"recv_spin_us must be an int >= 0 (microseconds), got {recv_spin_us!r}")
        if nvshmem_env is not None:  # checked here, so a bad dict fails before any collective step
            nvshmem_env = check_nvshmem_env(nvshmem_env)
        self.layout = WindowLayout.from_configs(model, topology, self.config)
        self.torch_dtype = torch_dtype(model.dtype)
        self.out_scale = moe.combine_scale(self.torch_dtype, model.routed_scaling_factor)
        self._pending: dict[int, DispatchHandle | None] = {}
        self._received: dict[tuple, int] = {}  # FFN: (src_rank, ring) -> seq of the newest item
        self._answered: set[tuple] = set()  # FFN: (src_rank, ring) whose newest item was answered
        # FFN: one receiving and one replying thread may share the connector (FFNWorker(overlap=
        # True) on the host backend). NOTE: the Attention rank may send the next item on a slot
        # as soon as a reply's flag is written; without the lock the receiving thread could
        # record that item before the replying thread marks the slot answered, and the new item
        # would count as answered. Taking an item and answering one are atomic w.r.t. each other.
        self._ffn_lock = threading.Lock()
        self._shutdown_from: set[int] = set()
        self._lost: set[int] = set()  # FFN: attention ranks found dead
        self._shutdown_announced = False
        self._store = store  # read again only on error paths (a failed FFN's reason)
        self._peer_failed = False  # a wait timed out or a peer died: close() must not hang on it
        self._closed = False
        self.instance, peers = handshake.exchange(
            store, world_rank=self.world_rank, world_size=self.topology.world_size,
            record=handshake.config_record(model, topology, self.config, backend=backend),
            timeout_s=self.startup_timeout_s)
        self._peer_processes = peers
        # Attention: FFN ranks known gone (shut down, dead, failed): refused at once later
        self._ffn_peers = peer_state.FFNPeers(self.topology, peers, store, self.instance)
        _apply_cpu_threads(cpu_threads, peers)
        self._attn_processes = {p.world_rank: p for p in peers
                                if self.topology.role_of(p.world_rank)[0] is Role.ATTENTION}
        ctx = PathContext(layout=self.layout, topology=self.topology, role=self.role,
                          role_rank=role_rank, dtype=model.dtype, torch_dtype=self.torch_dtype,
                          top_k=model.top_k, num_experts=model.num_experts,
                          has_shared=model.num_shared_experts > 0,
                          peer_timeout_s=self.peer_timeout_s, always_send=bool(always_send),
                          poll_mode=poll_mode, transport=self.config.transport,
                          recv_spin_s=recv_spin_us * 1e-6, fused_dispatch=self.config.fused_dispatch,
                          dedup_dispatch=self.config.dedup_dispatch)
        try:
            self.path = open_path(backend, ctx, store=store, job_id=job_id, device_id=device_id,
                                  startup_timeout_s=self.startup_timeout_s, instance=self.instance,
                                  nvshmem_env=nvshmem_env)
        except BaseException:
            self._closed = True  # nothing to close: no "not closed" warning from __del__
            raise
        # pair mode, Attention: the combine's routing, owned from send_attn_output on
        self._owned_routing = (peer_state.owned_routing_buffers(self.layout, model.top_k, self.device)
                               if self.role is Role.ATTENTION and not self.layout.is_dedup else None)
        logger.info("afd_cupy %s rank %d (world rank %d/%d) up: backend=%s window=%.1f MiB",
                    self.role.value, role_rank, self.world_rank, self.topology.world_size,
                    backend, self.layout.window_bytes / 2**20)

    @property
    def device(self) -> torch.device:
        """torch device of this connector's payload tensors."""
        return self.path.device

    # --- Attention side ---------------------------------------------------------------------
    def select_experts(self, router_logits: torch.Tensor,
                       e_score_correction_bias: torch.Tensor | None = None, *, impl: str = "auto"):
        """Gate with the model's gate (``gates.model_gate``): ``(topk_weights fp32 [T,K],
        topk_ids int32 [T,K])``.

        ``router_logits``: float [T, num_experts]; ``e_score_correction_bias``: float
        [num_experts] (DeepSeek-V3's selection bias), same device, or None. The weights
        exclude ``routed_scaling_factor``: the FFN side applies it (``moe.apply_routed_scaling``).
        ``impl``: "auto" (default: a greedy gate on CUDA logits runs as one kernel,
        ``gates.select_experts``), "torch" (torch's ops) or "kernel" (ValueError if it cannot).
        """
        model = self.model
        if router_logits.dim() != 2 or router_logits.shape[1] != model.num_experts:
            raise ValueError(f"router_logits must be [num_tokens, {model.num_experts}], got "
                             f"{tuple(router_logits.shape)}")
        return gates.model_gate(model, router_logits, e_score_correction_bias, impl=impl)

    def send_attn_output(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, layer_idx: int, stage_idx: int = 0) -> DispatchHandle:
        """Route and write ``hidden`` one-sided into the FFN ranks' windows.

        hidden: [T, hidden_size] model dtype on this connector's device; topk_ids: int
        [T, top_k] (values in [0, num_experts)); topk_weights: float [T, top_k]; layer_idx in
        [0, num_layers); stage_idx in [0, num_stages). Not collective; never blocks on peers.

        In dedup mode (``ConnectorConfig.wire_mode``) ``topk_weights`` travel and are read
        here; in pair mode the combine needs both, and this call copies them (stream-ordered,
        no host synchronization, into buffers allocated per ring at start-up: capturable), so
        the caller may overwrite its tensors as soon as this returns.

        A dispatch that went to an FFN rank known gone (its shutdown, death or published
        failure seen by an earlier receive) raises at once: ConnectorShutdown, PeerLostError
        or PeerFailedError naming the rank.

        Raises ValueError for bad arguments and CapacityError when T > token_cap, here. A
        rank's routed partials over routed_cap, or an expert id out of range found on the
        device, send nothing and raise from ``recv_ffn_output`` of this handle (on both
        backends; with ``blocking=False`` on cuda, at the next blocking call).
        """
        self._require(Role.ATTENTION, "send_attn_output")
        if self._shutdown_announced:
            raise ProtocolError("send_attn_output after announce_shutdown(): the FFN ranks were told "
                                "this rank is done")
        self._check_send_args(hidden, topk_ids, topk_weights, layer_idx, stage_idx)
        layer_idx, stage_idx = int(layer_idx), int(stage_idx)
        ring = self._acquire_ring(stage_idx)
        try:
            state = self.path.dispatch(hidden, topk_ids, topk_weights, layer_idx=layer_idx,
                                       stage_idx=stage_idx, ring=ring)
        except BaseException:
            self._pending.pop(ring, None)
            raise
        if self._ffn_peers.gone and not _capturing(self.device):  # sent_to may synchronize
            try:
                self._ffn_peers.refuse(self.path.sent_to(state))
            except AfdError:
                self._pending.pop(ring, None)
                raise
        if self._owned_routing is not None:  # pair mode: the combine reads them, so own them
            topk_ids, topk_weights = peer_state.own_routing(self._owned_routing[ring], topk_ids,
                                                            topk_weights)
        handle = DispatchHandle(layer_idx, stage_idx, ring, hidden.shape[0], topk_ids,
                                topk_weights, state)
        self._pending[ring] = handle
        return handle

    def recv_ffn_output(self, handle: DispatchHandle, *, blocking: bool = True) -> torch.Tensor:
        """Wait for the replies of exactly the FFN ranks that were sent to, and combine.

        Returns [T, hidden_size] in the model dtype: ``Σ_k w[t,k]·expert(t,k) + shared(t)``
        accumulated in fp32. Replies that answer an earlier dispatch whose wait timed out are
        recognised by their seq and dropped. ``blocking=False`` (where the backend supports
        it: cuda) enqueues the wait and the combine on the current stream without a host
        synchronization; errors then surface at the next blocking call or ``check_errors()``,
        and failed rows are NaN. A reply the FFN rank sent before its shutdown is delivered;
        the shutdown is raised by the next wait for that rank. An FFN rank whose code failed
        (``announce_failure``, called by ``FFNWorker.run``) raises PeerFailedError naming the
        rank and its exception.
        """
        self._require(Role.ATTENTION, "recv_ffn_output")
        self._check_pending(handle)
        try:
            return self.path.combine(handle.state, handle.topk_ids, handle.topk_weights,
                                     ring=handle.ring, layer_idx=handle.layer_idx,
                                     stage_idx=handle.stage_idx, out_scale=self.out_scale,
                                     blocking=blocking)
        except AfdError as exc:
            self._note_reply_error(exc)
        finally:
            del self._pending[handle.ring]

    def _note_reply_error(self, exc: AfdError):
        """Raise ``exc`` (a wait for replies failed), or the PeerFailedError of the FFN rank
        that published why it failed; a rank it shows gone is refused at once later."""
        if isinstance(exc, PeerTimeoutError):
            self._peer_failed = True
        replacement = self._ffn_peers.note(exc)
        if replacement is exc:
            raise exc
        raise replacement from exc

    def forget_dispatch(self, handle: DispatchHandle) -> None:
        """Release the ring of a dispatch that will not be received (the caller's step failed
        between the send and the receive, or a CUDA graph capture was abandoned): the next
        send may use the ring again, and the dispatch's reply, if it comes, is recognised by
        its seq and dropped like any late reply. Raises ProtocolError if ``handle`` is not
        pending. Not collective; never blocks."""
        self._require(Role.ATTENTION, "forget_dispatch")
        self._check_pending(handle)
        del self._pending[handle.ring]

    def sent_to(self, handle: DispatchHandle) -> list[int]:
        """FFN ranks the dispatch of ``handle`` was sent to (may synchronize; for tools)."""
        return self.path.sent_to(handle.state)

    def check_errors(self) -> None:
        """Synchronize and raise any error latched by a non-blocking call (no-op on host)."""
        try:
            self.path.check_errors()
        except AfdError as exc:
            if self.role is not Role.ATTENTION:
                raise
            self._note_reply_error(exc)

    def _check_pending(self, handle: DispatchHandle) -> None:
        if self._pending.get(handle.ring) is not handle:
            raise ProtocolError(f"handle for layer {handle.layer_idx} ring {handle.ring} is not pending "
                                "(already received, or from another connector)")

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
        _check_index("layer_idx", layer_idx, model.num_layers)
        _check_index("stage_idx", stage_idx, self.config.num_stages)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != model.hidden_size:
            raise ValueError(f"hidden must be a [num_tokens, {model.hidden_size}] tensor, got "
                             f"{getattr(hidden, 'shape', type(hidden).__name__)}")
        if hidden.dtype != self.torch_dtype:
            raise ValueError(f"hidden has dtype {hidden.dtype}, the model dtype is {self.torch_dtype}")
        self._check_device("hidden", hidden)
        expected = (hidden.shape[0], model.top_k)
        for name, tensor, is_float in (("topk_ids", topk_ids, False), ("topk_weights", topk_weights, True)):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
            if tensor.dtype.is_floating_point != is_float or tensor.dtype == torch.bool or tensor.is_complex():
                raise ValueError(f"{name} has wrong dtype {tensor.dtype} (expected "
                                 f"{'a float' if is_float else 'an integer'} dtype)")
            self._check_device(name, tensor)
        if hidden.shape[0] > self.layout.token_cap:
            raise token_cap_error(hidden.shape[0], self.layout.token_cap)

    def _check_device(self, name: str, tensor: torch.Tensor) -> None:
        device = self.device
        if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
            raise ValueError(f"{name} is on {tensor.device}, this connector's tensors live on {device}")

    # --- FFN side ---------------------------------------------------------------------------
    def recv_ffn_work_item(self, timeout_ms: int | None = None) -> FFNWorkItem | None:
        """Next dispatch from any Attention rank, or None after ``timeout_ms``
        (default ``recv_poll_timeout_ms``). Fair across regions (rotating scan).
        Raises ConnectorShutdown once every Attention rank has announced shutdown, and
        PeerLostError once every Attention rank has shut down or died (a dead rank is noticed
        when a poll finds nothing: its process is gone; same host only)."""
        self._require(Role.FFN, "recv_ffn_work_item")
        timeout_ms = check_optional_timeout("timeout_ms", timeout_ms, unit="ms") or self.config.recv_poll_timeout_ms
        while True:
            arrival = self.path.wait_any(timeout_ms / 1000.0)
            if arrival is None:
                self._check_attention_alive()
                return None
            if arrival.header.is_shutdown:
                self._note_shutdown(arrival.header.src_rank)
                continue
            return self._work_item(arrival)

    def _note_shutdown(self, src_rank: int) -> None:
        if src_rank in self._shutdown_from:
            return  # the same announcement, seen on another ring
        self._shutdown_from.add(src_rank)
        logger.info("afd_cupy ffn rank %d: attention rank %d announced shutdown (%d/%d)",
                    self.role_rank, src_rank, len(self._shutdown_from), self.topology.num_attn_ranks)
        self._raise_if_lost()
        if len(self._shutdown_from) == self.topology.num_attn_ranks:
            raise ConnectorShutdown("every Attention rank announced shutdown", src_rank=src_rank)

    def finished_attention_ranks(self) -> frozenset:
        """FFN side: Attention role ranks that will send no more (announced shutdown, or found
        dead by an idle poll). The lockstep schedule serves the others without them."""
        return frozenset(self._shutdown_from)

    def _check_attention_alive(self) -> None:
        """Idle-time liveness check: raise PeerLostError once no Attention rank can send."""
        dead = [self.topology.role_of(pe)[1] for pe, proc in self._attn_processes.items()
                if proc.is_alive() is False]
        for rank in dead:
            if rank not in self._shutdown_from:
                logger.warning("afd_cupy ffn rank %d: attention rank %d died without shutdown",
                               self.role_rank, rank)
                self._shutdown_from.add(rank)
                self._lost.add(rank)
        self._raise_if_lost()

    def _raise_if_lost(self) -> None:
        """PeerLostError once every Attention rank is done and some of them died."""
        if self._lost and len(self._shutdown_from) == self.topology.num_attn_ranks:
            self._peer_failed = True
            raise PeerLostError(f"attention rank(s) {sorted(self._lost)} died without announcing "
                                "shutdown; every other attention rank has shut down",
                                peers=sorted(self._lost))

    def _work_item(self, arrival: Arrival) -> FFNWorkItem:
        header = arrival.header
        if header.src_rank != arrival.region:
            raise ProtocolError(f"message in region {arrival.region} claims source rank {header.src_rank}")
        key = (arrival.region, arrival.ring)
        with self._ffn_lock:  # NOTE: a reply on this slot may be completing on another thread
            views = self.path.item_views(arrival)
            self._received[key] = header.seq
            self._answered.discard(key)
        return FFNWorkItem(arrival=arrival, routed_x=views.routed_x, group_counts=views.group_counts,
                           shared_x=views.shared_x if header.shared_tokens else None,
                           route_table=views.route_table)

    def send_ffn_work_item_output(self, item: FFNWorkItem, routed_out: torch.Tensor,
                                  shared_out: torch.Tensor | None = None) -> None:
        """Write the expert outputs back into the sender's window (region = this FFN rank).

        routed_out: [item.routed_tokens, hidden] in wire order; shared_out:
        [item.shared_tokens, hidden] or None (only when the item had no shared rows); both in
        the model dtype on this connector's device. Raises ProtocolError when the item was
        already answered. An item superseded by a newer dispatch on its slot (its sender timed
        out and moved on) is not answered: the reply would be dropped there anyway.
        """
        self._require(Role.FFN, "send_ffn_work_item_output")
        self._check_outputs(item, routed_out, shared_out)
        key = (item.src_rank, item.ring)
        with self._ffn_lock:  # the flag write and the bookkeeping before the next item on the slot
            if self._shutdown_announced:
                raise ProtocolError(f"send_ffn_work_item_output after announce_shutdown(): the reply "
                                    f"to {item!r} would not be read (the attention ranks were told "
                                    "this rank is done)", peer=item.src_rank, layer_idx=item.layer_idx)
            newest = self._received.get(key)
            if newest == item.seq and key in self._answered:
                raise ProtocolError(f"work item from attention rank {item.src_rank} (layer {item.layer_idx}, "
                                    f"ring {item.ring}, seq {item.seq}) was already answered",
                                    peer=item.src_rank, layer_idx=item.layer_idx)
            if newest != item.seq:
                logger.warning("afd_cupy ffn rank %d: %r was superseded by seq %s on its slot; not answered",
                               self.role_rank, item, newest)
                return
            self.path.reply(item.arrival, routed_out, shared_out if item.shared_tokens else None)
            self._answered.add(key)

    def _check_outputs(self, item, routed_out, shared_out) -> None:
        hidden = self.model.hidden_size
        expected = (item.routed_tokens, hidden)
        if tuple(routed_out.shape) != expected or routed_out.dtype != self.torch_dtype:
            raise ValueError(f"routed_out must be {expected} {self.torch_dtype}, got "
                             f"{tuple(routed_out.shape)} {routed_out.dtype}")
        self._check_device("routed_out", routed_out)
        if item.shared_tokens:
            expected = (item.shared_tokens, hidden)
            if shared_out is None or tuple(shared_out.shape) != expected or shared_out.dtype != self.torch_dtype:
                raise ValueError(f"shared_out must be {expected} {self.torch_dtype} for an item with "
                                 f"shared rows, got {None if shared_out is None else tuple(shared_out.shape)}")
            self._check_device("shared_out", shared_out)

    # --- both sides -------------------------------------------------------------------------
    def announce_shutdown(self) -> None:
        """Write a shutdown header to every ring of every opposite-role peer. After it, an
        Attention rank may not send again; an FFN rank may not reply again (ProtocolError).
        An FFN rank's shutdown keeps the replies it already wrote readable
        (``wire.FLAG_KEPT_REPLY``; not over the cuda put transport)."""
        self._require(self.role, "announce_shutdown")
        with self._ffn_lock:  # FFN: not in the middle of a reply on another thread
            self.path.announce_shutdown()
            self._shutdown_announced = True

    def announce_failure(self, exc: BaseException) -> None:
        """FFN side: tell every Attention rank that this rank's own code raised ``exc`` and
        that it stops: the reason (type and message) is written to the store, then a shutdown
        is announced; an Attention rank waiting for this rank (or sending to it later) raises
        ``PeerFailedError`` naming this rank and the exception. Best effort: a store that
        cannot be reached leaves a plain shutdown (logged)."""
        self._require(Role.FFN, "announce_failure")
        try:
            peer_state.publish_failure(self._store, self.instance, self.role_rank, exc)
        except Exception as store_exc:  # the shutdown below still releases the peers
            logger.warning("afd_cupy ffn rank %d: could not publish the failure %r: %s",
                           self.role_rank, exc, store_exc)
        if not self._shutdown_announced:
            self.announce_shutdown()

    def close(self) -> None:
        """Collective: every rank of the world calls it; frees the window. Idempotent.

        An Attention rank that has not announced shutdown does so first (best effort), so the
        FFN ranks leave their loops even when this rank closes from an exception path. When a
        peer process is found dead, or a wait timed out and some peer's liveness cannot be
        seen from here (another host), the closing barrier is short; when the job gives up on
        the barrier every rank abandons its window alike (logged, not raised; bounded, never a
        hang: ``store.agreed_barrier``).
        """
        if self._closed:
            return
        try:
            if self.role is Role.ATTENTION and not self._shutdown_announced:
                try:
                    self.announce_shutdown()
                except Exception as exc:  # close() must go on; the original error matters more
                    logger.warning("afd_cupy attention rank %d: shutdown announcement in close() "
                                   "failed: %s", self.role_rank, exc)
        finally:
            self._closed = True
            # a peer this rank never waited on may have died too: ask the OS where it can tell
            alive = {p.world_rank: p.is_alive() for p in self._peer_processes}
            dead = [rank for rank, is_alive in alive.items() if is_alive is False]
            if dead:
                logger.warning("afd_cupy %s rank %d: world rank(s) %s are gone; closing without them",
                               self.role.value, self.role_rank, dead)
            # a short closing barrier when a peer is gone, or may be (a wait timed out and some
            # peer's liveness is unknown here); a timed-out wait whose peers all still run (a
            # slow FFN that answered late) waits for them like a clean close
            unknown = any(is_alive is None for is_alive in alive.values())
            self.path.close(peers_healthy=not dead and not (self._peer_failed and unknown))

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

    # --- seams of the loops built on the connector (issue #32) ------------------------------
    # afd_cupy.step_graph and the graph FFN server (backends/cuda_ffn_graph.py) drive the
    # connector from outside; these public calls give them what they used to read from the
    # private bookkeeping above. NOTE: keep this block last in the class.
    @property
    def supports_nonblocking(self) -> bool:
        """True when ``recv_ffn_output(blocking=False)`` enqueues the wait and the combine
        without a host synchronization (the data path's declared capability: cuda), so a step
        of such calls can be captured in a CUDA graph; False where a receive blocks (host)."""
        return bool(self.path.supports_nonblocking)

    def pending_rings(self) -> tuple[int, ...]:
        """Attention side: the rings with a dispatch in flight (sent and neither received nor
        forgotten; a ring a send is reserving counts too), sorted. Not collective; never
        blocks."""
        return tuple(sorted(self._pending))

    def check_attention_alive(self) -> None:
        """FFN side, for a loop that waits for arrivals itself (a graph replay) instead of
        :meth:`recv_ffn_work_item`: the idle-time liveness check that receive runs when a poll
        finds nothing. Raises PeerLostError once every Attention rank has shut down or died
        and some died (same host only)."""
        self._require_ffn_loop("check_attention_alive")
        self._check_attention_alive()

    def note_shutdown(self, src_rank: int) -> None:
        """FFN side, for such a loop: count the shutdown header of Attention rank
        ``src_rank`` that it found, as :meth:`recv_ffn_work_item` counts one (the same
        announcement seen on another ring counts once). Raises ConnectorShutdown once every
        Attention rank has announced, PeerLostError as :meth:`check_attention_alive`."""
        self._require_ffn_loop("note_shutdown")
        self._note_shutdown(int(src_rank))

    def accept_arrival(self, arrival: Arrival) -> FFNWorkItem:
        """FFN side, for such a loop: the work item of a dispatch it found (``arrival``: region,
        ring and decoded header), recorded as received exactly as :meth:`recv_ffn_work_item`
        records one, so :meth:`send_ffn_work_item_output` answers it once. Raises
        ProtocolError when the header's source rank is not its region's."""
        self._require_ffn_loop("accept_arrival")
        return self._work_item(arrival)

    def reply_seq_counters(self):
        """FFN side, cuda: a copy of the data path's reply seq per slot (int64 numpy
        ``[num_slots]``, slot = region * ring_depth + ring: the seq of the last reply this rank
        wrote there), for a loop that takes the replies over (the graph FFN server keeps them
        on the device while it runs). ProtocolError where the path keeps none (host)."""
        return self._reply_seqs("reply_seq_counters").copy()

    def set_reply_seq_counters(self, counters, *, slot: int | None = None) -> None:
        """FFN side, cuda: give the counters back (``counters`` int ``[num_slots]``), or with
        ``slot`` set that slot's counter to ``counters`` (an int: the next reply on the slot
        carries ``counters + 1``). ValueError for a wrong length or slot. Not collective."""
        seqs = self._reply_seqs("set_reply_seq_counters")
        if slot is None:
            if len(counters) != len(seqs):
                raise ValueError(f"set_reply_seq_counters: {len(counters)} counters for "
                                 f"{len(seqs)} slots")
            seqs[:] = counters
            return
        if isinstance(slot, bool) or not isinstance(slot, numbers.Integral) or not 0 <= slot < len(seqs):
            raise ValueError(f"set_reply_seq_counters: slot={slot!r} outside [0, {len(seqs)})")
        seqs[int(slot)] = int(counters)

    def _reply_seqs(self, what: str):
        self._require_ffn_loop(what)
        seqs = getattr(self.path, "reply_seqs", None)
        if seqs is None:
            raise ProtocolError(f"{what}: backend {self.backend!r} keeps no host reply-seq counters")
        return seqs

    def _require_ffn_loop(self, what: str) -> None:
        # role only: a loop's close() may still hand back what it holds after the connector
        # saw the last shutdown
        if self.role is not Role.FFN:
            raise ProtocolError(f"{what} is an ffn-side call; this connector is {self.role.value}")


def _check_cpu_threads(value) -> None:
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"cpu_threads must be 'auto', None or an int >= 1, got {value!r}")


def _apply_cpu_threads(cpu_threads, peers) -> None:
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


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_index(name: str, value, bound: int) -> None:
    """``value`` must be an int (not bool, not a float) in [0, bound)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) < bound:
        raise ValueError(f"{name}={int(value)} outside [0, {bound})")
