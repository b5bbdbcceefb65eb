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

A thin facade: construction and ``close()`` are here, every role call goes to the rank's
endpoint (:mod:`afd_cupy.attention.endpoint` / :mod:`afd_cupy.ffn.endpoint`, over the backend's
AttentionPath / FFNPath; docs/design/architecture.md).
"""
from __future__ import annotations

import logging

import torch

from afd_cupy import moe
from afd_cupy.backends.base import Arrival, Capabilities, PathContext, open_path, require_backend
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.errors import ConfigError, ProtocolError
from afd_cupy.handles import DispatchHandle, FFNWorkItem  # noqa: F401 - part of this module's API
from afd_cupy.heap.nvshmem_env import check_nvshmem_env
from afd_cupy.moe import gates
from afd_cupy.runtime import connector_setup, handshake
from afd_cupy.runtime.timeouts import check_timeout
from afd_cupy.runtime.topology import Role, Topology
from afd_cupy.wire import WindowLayout
from afd_cupy.wire.dtypes import torch_dtype

logger = logging.getLogger("afd_cupy")


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
            ``NUMBA_NUM_THREADS``, as ``afd_cupy.runtime.launch`` sets for its children) and torch's
            pool is larger, lower it to this host's cores divided by the job's ranks on this
            host (from the handshake); an int: exactly that many
            (``afd_cupy.runtime.env.limit_threads``); None: leave the process alone.

    Raises ConfigError for invalid arguments and BackendUnavailableError when ``backend``
    cannot run here. Construction and :meth:`close` are collective over the AFD world.

    ``path`` is the backend's path of this rank's role (an
    :class:`~afd_cupy.backends.base.AttentionPath` or :class:`~afd_cupy.backends.base.FFNPath`;
    public so that tools can time its steps; the connector's own methods are the API) and
    ``endpoint`` the :class:`~afd_cupy.attention.endpoint.AttentionEndpoint` or
    :class:`~afd_cupy.ffn.endpoint.FFNEndpoint` every role call goes to.
    """

    def __init__(self, model: ModelConfig, topology: TopologyConfig,
                 connector: ConnectorConfig | None = None, *, role: str | Role, role_rank: int,
                 store, job_id: str = "afd", backend: str = "host", device_id: int | None = None,
                 poll_mode: str = "device", peer_timeout_s: float = 60.0, always_send: bool = False,
                 startup_timeout_s: float = 120.0, nvshmem_env: dict | None = None,
                 cpu_threads: int | str | None = "auto", recv_spin_us: int = 500):
        self.model = connector_setup.check_config("model", model, ModelConfig)
        connector_setup.check_config("topology", topology, TopologyConfig)
        self.config = connector_setup.check_config("connector", connector or ConnectorConfig(), ConnectorConfig)
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
        connector_setup.check_poll_mode(poll_mode)
        connector_setup.check_cpu_threads(cpu_threads)
        connector_setup.check_recv_spin_us(recv_spin_us)
        if nvshmem_env is not None:  # a bad dict fails here, before any collective step
            nvshmem_env = check_nvshmem_env(nvshmem_env)
        self.layout = WindowLayout.from_configs(model, topology, self.config)
        self.torch_dtype = torch_dtype(model.dtype)
        self.out_scale = moe.combine_scale(self.torch_dtype, model.routed_scaling_factor)
        self._closed = False
        self.instance, peers = handshake.exchange(
            store, world_rank=self.world_rank, world_size=self.topology.world_size,
            record=handshake.config_record(model, topology, self.config, backend=backend),
            timeout_s=self.startup_timeout_s)
        self._peer_processes = peers
        connector_setup.apply_cpu_threads(cpu_threads, peers)
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
        self.endpoint = connector_setup.open_endpoint(self, store, peers)  # the role calls' target
        logger.info("afd_cupy %s rank %d (world rank %d/%d) up: backend=%s window=%.1f MiB",
                    self.role.value, role_rank, self.world_rank, self.topology.world_size,
                    backend, self.layout.window_bytes / 2**20)

    @property
    def device(self) -> torch.device:
        """torch device of this connector's payload tensors."""
        return self.path.device

    @property
    def capabilities(self) -> Capabilities:
        """What this rank's data path can do (:class:`~afd_cupy.backends.base.Capabilities`):
        callers decide on these fields, never on the backend's name."""
        return self.path.capabilities

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
        return self.endpoint.send(hidden, topk_ids, topk_weights, layer_idx, stage_idx)

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
        return self.endpoint.recv(handle, blocking=blocking)

    def forget_dispatch(self, handle: DispatchHandle) -> None:
        """Release the ring of a dispatch that will not be received (the caller's step failed
        between the send and the receive, or a CUDA graph capture was abandoned): the next
        send may use the ring again, and the dispatch's reply, if it comes, is recognised by
        its seq and dropped like any late reply. Raises ProtocolError if ``handle`` is not
        pending. Not collective; never blocks."""
        self._require(Role.ATTENTION, "forget_dispatch")
        self.endpoint.forget(handle)

    def sent_to(self, handle: DispatchHandle) -> list[int]:
        """FFN ranks the dispatch of ``handle`` was sent to (may synchronize; for tools)."""
        return self.endpoint.sent_to(handle)

    def check_errors(self) -> None:
        """Synchronize and raise any error latched by a non-blocking call (no-op on host)."""
        self.endpoint.check_errors()

    # --- FFN side ---------------------------------------------------------------------------
    def recv_ffn_work_item(self, timeout_ms: int | None = None) -> FFNWorkItem | None:
        """Next dispatch from any Attention rank, or None after ``timeout_ms``
        (default ``recv_poll_timeout_ms``). Fair across regions (rotating scan).
        Raises ConnectorShutdown once every Attention rank has announced shutdown, and
        PeerLostError once every Attention rank has shut down or died (a dead rank is noticed
        when a poll finds nothing: its process is gone; same host only)."""
        self._require(Role.FFN, "recv_ffn_work_item")
        return self.endpoint.recv(timeout_ms)

    def finished_attention_ranks(self) -> frozenset:
        """FFN side: Attention role ranks that will send no more (announced shutdown, or found
        dead by an idle poll). The lockstep schedule serves the others without them."""
        self._require_ffn_loop("finished_attention_ranks")
        return self.endpoint.finished_attention_ranks()

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
        self.endpoint.reply(item, routed_out, shared_out)

    # --- both sides -------------------------------------------------------------------------
    def announce_shutdown(self) -> None:
        """Write a shutdown header to every ring of every opposite-role peer. After it, an
        Attention rank may not send again; an FFN rank may not reply again (ProtocolError).
        An FFN rank's shutdown keeps the replies it already wrote readable
        (``wire.FLAG_KEPT_REPLY``; not over the cuda put transport)."""
        self._require(self.role, "announce_shutdown")
        self.endpoint.announce_shutdown()

    def announce_failure(self, exc: BaseException) -> None:
        """FFN side: tell every Attention rank that this rank's own code raised ``exc`` and
        that it stops: the reason (type and message) is written to the store, then a shutdown
        is announced; an Attention rank waiting for this rank (or sending to it later) raises
        ``PeerFailedError`` naming this rank and the exception. Best effort: a store that
        cannot be reached leaves a plain shutdown (logged)."""
        self._require(Role.FFN, "announce_failure")
        self.endpoint.announce_failure(exc)

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
            if self.role is Role.ATTENTION and not self.endpoint.shutdown_announced:
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
            peer_failed = self.endpoint.peer_failed
            self.path.close(peers_healthy=not dead and not (peer_failed and unknown))

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

    # --- seams of the loops built on the connector: afd_cupy.attention.step_graph and the graph FFN
    # server (backends/cuda_ffn_graph.py) drive it through these public calls only
    @property
    def supports_nonblocking(self) -> bool:
        """True when ``recv_ffn_output(blocking=False)`` enqueues the wait and the combine
        without a host synchronization (the data path's declared capability: cuda), so a step
        of such calls can be captured in a CUDA graph; False where a receive blocks (host)."""
        return self.capabilities.supports_nonblocking

    def pending_rings(self) -> tuple[int, ...]:
        """Attention side: the rings with a dispatch in flight (sent and neither received nor
        forgotten; a ring a send is reserving counts too), sorted. Not collective; never
        blocks."""
        self._require_role(Role.ATTENTION, "pending_rings")
        return self.endpoint.pending_rings()

    def order_graph_replay(self, rings, stream: int) -> None:
        """Attention side, for a loop that replays a captured graph sending on ``rings`` on
        the raw stream ``stream`` (``afd_cupy.attention.step_graph``): order the replay after each
        ring's last use on another stream, and the ring's next use after the replay (the
        replay bypasses the per-call ordering). No-op where the path has no streams (host).
        Not collective; never blocks."""
        self._require_role(Role.ATTENTION, "order_graph_replay")
        self.endpoint.order_graph_replay(rings, stream)

    def check_attention_alive(self) -> None:
        """FFN side, for a loop that waits for arrivals itself (a graph replay) instead of
        :meth:`recv_ffn_work_item`: the idle-time liveness check that receive runs when a poll
        finds nothing. Raises PeerLostError once every Attention rank has shut down or died
        and some died (same host only)."""
        self._require_ffn_loop("check_attention_alive")
        self.endpoint.check_attention_alive()

    def note_shutdown(self, src_rank: int) -> None:
        """FFN side, for such a loop: count the shutdown header of Attention rank
        ``src_rank`` that it found, as :meth:`recv_ffn_work_item` counts one (the same
        announcement seen on another ring counts once). Raises ConnectorShutdown once every
        Attention rank has announced, PeerLostError as :meth:`check_attention_alive`."""
        self._require_ffn_loop("note_shutdown")
        self.endpoint.note_shutdown(int(src_rank))

    def accept_arrival(self, arrival: Arrival) -> FFNWorkItem:
        """FFN side, for such a loop: the work item of a dispatch it found (``arrival``: region,
        ring and decoded header), recorded as received exactly as :meth:`recv_ffn_work_item`
        records one, so :meth:`send_ffn_work_item_output` answers it once. Raises
        ProtocolError when the header's source rank is not its region's."""
        self._require_ffn_loop("accept_arrival")
        return self.endpoint.accept_arrival(arrival)

    def reply_seq_counters(self):
        """FFN side, cuda: a copy of the data path's reply seq per slot (int64 numpy
        ``[num_slots]``, slot = region * ring_depth + ring: the seq of the last reply this rank
        wrote there), for a loop that takes the replies over (the graph FFN server keeps them
        on the device while it runs). ProtocolError where the path keeps none (host)."""
        self._require_ffn_loop("reply_seq_counters")
        return self.endpoint.reply_seq_counters()

    def set_reply_seq_counters(self, counters, *, slot: int | None = None) -> None:
        """FFN side, cuda: give the counters back (``counters`` int ``[num_slots]``), or with
        ``slot`` set that slot's counter to ``counters`` (an int: the next reply on the slot
        carries ``counters + 1``). ValueError for a wrong length or slot. Not collective."""
        self._require_ffn_loop("set_reply_seq_counters")
        self.endpoint.set_reply_seq_counters(counters, slot=slot)

    def _require_ffn_loop(self, what: str) -> None:
        # role only: a loop's close() may still hand back what it holds after the connector
        # saw the last shutdown
        self._require_role(Role.FFN, what)

    def _require_role(self, role: Role, what: str) -> None:
        if self.role is not role:
            raise ProtocolError(f"{what} is an {role.value}-side call; this connector is {self.role.value}")
