"""The Attention endpoint: an Attention rank's protocol bookkeeping over its data path
(docs/design/architecture.md).

:class:`~afd_cupy.connector.AFDConnector` is a thin facade over one endpoint per rank; on an
Attention rank it is an :class:`AttentionEndpoint`, which owns what the protocol needs between
a send and its receive: the rings in flight (send-then-recv per (peer, stage)), the FFN peers
known gone, the pair-mode routing the combine reads, and the argument checks. The bytes move
in the backend's :class:`~afd_cupy.backends.base.AttentionPath`.
"""
from __future__ import annotations

import numbers

import torch

from afd_cupy.errors import (AfdError, PeerTimeoutError, ProtocolError, RingExhaustedError,
                             token_cap_error)
from afd_cupy.handles import DispatchHandle
from afd_cupy.runtime import peer_state


class AttentionEndpoint:
    """Send and receive of one Attention rank (the connector's Attention-side calls).

    ``path``: the backend's AttentionPath; ``model`` / ``config`` / ``layout``: the connector's
    configs and window layout; ``out_scale``: the combine's scale; ``ffn_peers``: a
    ``peer_state.FFNPeers`` (FFN ranks known gone, refused at once). Not thread-safe.
    """

    def __init__(self, path, *, model, config, layout, torch_dtype, out_scale: float, ffn_peers):
        self.path = path
        self.model, self.config, self.layout = model, config, layout
        self.torch_dtype, self.out_scale = torch_dtype, out_scale
        self._ffn_peers = ffn_peers
        self._pending: dict[int, DispatchHandle | None] = {}
        # pair mode: the combine's routing, owned from send on (dedup: it travels), unless the
        # path's sends keep their own copy (the cuda backend: one kernel per send)
        self._owned_routing = (None if layout.is_dedup or getattr(path, "owns_routing", False) else
                               peer_state.owned_routing_buffers(layout, model.top_k, path.device))
        self.shutdown_announced = False
        self.peer_failed = False  # a wait timed out or a peer died: close() must not hang on it

    @property
    def device(self) -> torch.device:
        return self.path.device

    # --- send and receive ---------------------------------------------------------------
    def send(self, hidden, topk_ids, topk_weights, layer_idx, stage_idx) -> DispatchHandle:
        """``AFDConnector.send_attn_output`` (its docstring)."""
        if self.shutdown_announced:
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

    def recv(self, handle: DispatchHandle, *, blocking: bool = True) -> torch.Tensor:
        """``AFDConnector.recv_ffn_output`` (its docstring)."""
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

    def forget(self, handle: DispatchHandle) -> None:
        """Release the ring of a dispatch that will not be received (ProtocolError if not
        pending)."""
        self._check_pending(handle)
        del self._pending[handle.ring]

    def sent_to(self, handle: DispatchHandle) -> list[int]:
        return self.path.sent_to(handle.state)

    def check_errors(self) -> None:
        try:
            self.path.check_errors()
        except AfdError as exc:
            self._note_reply_error(exc)

    def pending_rings(self) -> tuple[int, ...]:
        """The rings with a dispatch in flight (a ring a send is reserving counts too), sorted."""
        return tuple(sorted(self._pending))

    def order_graph_replay(self, rings, stream: int) -> None:
        """The path's ordering of a graph replay on raw stream ``stream`` (a no-op where the
        path has no streams)."""
        self.path.order_graph_replay(rings, stream)

    def announce_shutdown(self) -> None:
        self.path.announce_shutdown()
        self.shutdown_announced = True

    # --- bookkeeping --------------------------------------------------------------------
    def _note_reply_error(self, exc: AfdError):
        """Raise ``exc`` (a wait for replies failed), or the PeerFailedError of the FFN rank
        that published why it failed; a rank it shows gone is refused at once later."""
        if isinstance(exc, PeerTimeoutError):
            self.peer_failed = True
        replacement = self._ffn_peers.note(exc)
        if replacement is exc:
            raise exc
        raise replacement from exc

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
        check_device("hidden", hidden, self.device)
        expected = (hidden.shape[0], model.top_k)
        for name, tensor, dtypes in (("topk_ids", topk_ids, _INT_DTYPES),
                                     ("topk_weights", topk_weights, _FLOAT_DTYPES)):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.shape != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
            if tensor.dtype not in dtypes:
                raise ValueError(f"{name} has wrong dtype {tensor.dtype} (expected "
                                 f"{'a float' if dtypes is _FLOAT_DTYPES else 'an integer'} dtype)")
            check_device(name, tensor, self.device)
        if expected[0] > self.layout.token_cap:
            raise token_cap_error(expected[0], self.layout.token_cap)


# The dtypes a send accepts: real floats for the weights, integers (not bool) for the ids.
_FLOAT_DTYPES = frozenset(d for d in vars(torch).values()
                          if isinstance(d, torch.dtype) and d.is_floating_point)
_INT_DTYPES = frozenset(d for d in vars(torch).values()
                        if isinstance(d, torch.dtype) and not d.is_floating_point
                        and not d.is_complex and d != torch.bool)


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """ValueError unless ``tensor`` lives on ``device`` (either endpoint's tensors)."""
    actual = tensor.device
    if actual == device:  # the common case, one comparison
        return
    if actual.type != device.type or (device.index is not None and actual.index != device.index):
        raise ValueError(f"{name} is on {tensor.device}, this connector's tensors live on {device}")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_index(name: str, value, bound: int) -> None:
    """``value`` must be an int (not bool, not a float) in [0, bound)."""
    if type(value) is int and 0 <= value < bound:  # the common case, without the ABC check
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) < bound:
        raise ValueError(f"{name}={int(value)} outside [0, {bound})")
