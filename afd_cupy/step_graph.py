"""A whole decode step of L layers captured in ONE CUDA graph, Attention side (issue #13).

A model runner captures its decode step once per batch size and replays it every step; with
AFD each layer's MoE is a round trip to the FFN ranks. :class:`DecodeStepGraph` captures, for
L layers, what such a step does on an Attention rank::

    x_0 = input                                               # [T, H] model dtype
    for l in range(L):
        r, h = attention[l](x_l)        (or h = attention[l](x_l), r = h)   # captured
        w, ids = connector.select_experts(router[l](h), bias[l])           # fp32/int32 [T, K]
        handle = connector.send_attn_output(h, ids, w, layer_idx=l)
        m = connector.recv_ffn_output(handle, blocking=False)              # [T, H]
        x_{l+1} = r + m                                                     # the residual add
    output = x_L                                                            # static [T, H]

into one ``torch.cuda.CUDAGraph`` over a static input and a static output buffer;
:meth:`DecodeStepGraph.replay` copies fresh inputs in and replays it with no host step per
layer. Why this is legal (docs/design.md §4.10): each
layer has exactly one dispatch in flight, on the same ring, and the layer's receive (device
wait + combine) precedes the next layer's send in stream order, so the slot is free again
before it is rewritten; sequence numbers and what each reply must echo live on the device;
the host bookkeeping (ring acquired, released) balances inside every captured layer; the
layer index is fixed per layer at capture. The FFN side is unchanged: any FFN loop
(``FFNWorker``, ``GraphFFNServer``) serves the replayed dispatches like eager ones.

Why a new module rather than a connector method: the helper composes user callables, torch's
graph API and the connector's public calls; the connector stays one call per protocol step.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from afd_cupy.errors import ConfigError, ProtocolError
from afd_cupy.topology import Role

#: ``attention[l](x)`` -> ``h`` (MoE input and residual) or ``(residual, h)``; x, h, residual
#: [T, hidden_size] in the model dtype on the connector's device
AttentionFn = Callable[[torch.Tensor], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]
#: ``router[l](h)`` -> router logits, float [T, num_experts]
RouterFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerTensors:
    """One layer's tensors inside the graph (``DecodeStepGraph(keep_layer_tensors=True)``):
    valid after a replay until the next one. ``moe_input`` [T, H] model dtype (what was
    sent), ``topk_weights`` fp32 [T, K], ``topk_ids`` int32 [T, K], ``moe_output`` [T, H]
    model dtype (the combined reply), ``output`` [T, H] (``residual + moe_output``)."""

    moe_input: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    moe_output: torch.Tensor
    output: torch.Tensor


def check_capturable(connector, num_tokens: int, num_layers: int) -> None:
    """Raise ConfigError (with the values) when a step of ``num_layers`` layers of
    ``num_tokens`` tokens cannot be captured on ``connector``.

    Needs: an Attention-side connector on the cuda backend (the host backend's steps run on
    the CPU and block) with ``poll_mode="device"`` (host polling synchronizes per receive);
    1 <= num_tokens <= the window's ``token_cap``; 1 <= num_layers <= ``model.num_layers``
    (layer l of the step is the model's layer l). The ring depth is no limit: a step has one
    dispatch in flight at a time (each layer's receive precedes the next send), so every
    layer reuses the first ring of stage 0 and any ``ring_depth`` >= 1 suffices.
    """
    if connector.role is not Role.ATTENTION:
        raise ConfigError(f"a decode step is captured on an Attention-side connector, got role "
                          f"{connector.role.value!r}")
    if connector.backend != "cuda":
        raise ConfigError(f"backend={connector.backend!r}: only the cuda backend can be captured in "
                          "a CUDA graph (the host backend's steps run on the CPU and block)")
    poll_mode = connector.path.ctx.poll_mode
    if poll_mode != "device":
        raise ConfigError(f"poll_mode={poll_mode!r}: a captured receive must wait on the device "
                          "(poll_mode='device'); host polling synchronizes per receive")
    cap = connector.layout.token_cap
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) \
            or not 1 <= num_tokens <= cap:
        raise ConfigError(f"num_tokens={num_tokens!r} must be an int in [1, token_cap={cap}] "
                          "(token_cap = ModelConfig.max_num_batched_tokens)")
    total = connector.model.num_layers
    if not 1 <= num_layers <= total:
        raise ConfigError(f"{num_layers} layers in the step: must be in [1, model.num_layers={total}]")


class DecodeStepGraph:
    """A decode step of ``len(attention)`` layers captured in one CUDA graph (module doc).

    Args:
        connector: an Attention-side cuda ``AFDConnector`` with ``poll_mode="device"``.
        attention: one callable per layer, ``x [T, H] -> h`` or ``-> (residual, h)``, all
            model dtype on the connector's device; captured, so it must be capturable itself
            (no host synchronization, no allocation that depends on values).
        router: one callable per layer, ``h -> router logits`` float ``[T, num_experts]``;
            the gate is ``connector.select_experts`` (the model's gate).
        num_tokens: T, the batch size the graph is captured for (a runner captures one graph
            per batch-size bucket); :meth:`replay` takes up to T rows and zero-pads the rest.
        e_score_correction_bias: None or one ``[num_experts]`` float tensor (or None) per
            layer, passed to ``select_experts``.
        keep_layer_tensors: keep every layer's tensors (:class:`LayerTensors`, ``.layers``)
            alive for inspection; otherwise the graph's pool reuses them across layers.
        warmup: eager steps run on a side stream before capturing (as torch advises: lazy
            initialization, cuBLAS workspaces, CuPy module loading happen there).

    Construction runs ``warmup`` real steps (round trips: the FFN ranks must be serving) on
    the zeroed static input, then captures. Raises ConfigError (:func:`check_capturable`, and
    mismatched argument lengths) before touching the GPU, and ProtocolError when a dispatch of
    this connector is still pending (receive it first). Not thread-safe. Drop the object
    before ``connector.close()``.

    Attributes: ``input`` / ``output`` (static ``[T, H]`` model dtype), ``graph``,
    ``num_layers``, ``num_tokens``, ``rings`` (the rings the graph sends on), ``layers``
    (list of :class:`LayerTensors`, empty unless ``keep_layer_tensors``).
    """

    def __init__(self, connector, attention: Sequence[AttentionFn], router: Sequence[RouterFn], *,
                 num_tokens: int, e_score_correction_bias: Sequence | None = None,
                 keep_layer_tensors: bool = False, warmup: int = 1):
        attention, router = list(attention), list(router)
        check_capturable(connector, num_tokens, len(attention))
        if len(router) != len(attention):
            raise ConfigError(f"{len(attention)} attention callables but {len(router)} routers: "
                              "pass one of each per layer")
        bias = [None] * len(attention) if e_score_correction_bias is None else list(e_score_correction_bias)
        if len(bias) != len(attention):
            raise ConfigError(f"{len(bias)} e_score_correction_bias entries for {len(attention)} layers")
        if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 1:
            raise ConfigError(f"warmup must be an int >= 1 (torch needs an eager run before capture), "
                              f"got {warmup!r}")
        self.connector = connector
        self.attention, self.router, self.bias = attention, router, bias
        self.num_layers, self.num_tokens = len(attention), int(num_tokens)
        self.keep_layer_tensors = bool(keep_layer_tensors)
        self.layers: list[LayerTensors] = []
        self.rings: set[int] = set()
        self._check_no_pending("capture")
        device = connector.device
        hidden = connector.model.hidden_size
        self.input = torch.zeros(self.num_tokens, hidden, dtype=connector.torch_dtype, device=device)
        self.output = torch.empty_like(self.input)
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            side = torch.cuda.Stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(int(warmup)):
                    self._step(self.input)
            current.wait_stream(side)
            connector.check_errors()  # synchronizes; raises what the warm-up latched
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step(self.input, out=self.output, record=True)

    # --- the step -------------------------------------------------------------------------
    def _step(self, x: torch.Tensor, *, out: torch.Tensor | None = None, record: bool = False):
        """The L layers on ``x`` (module doc); the last residual add writes ``out`` when given.
        ``record``: note the rings sent on (and the layer tensors when kept)."""
        conn = self.connector
        for layer in range(self.num_layers):
            produced = self.attention[layer](x)
            residual, h = produced if isinstance(produced, tuple) else (produced, produced)
            weights, ids = conn.select_experts(self.router[layer](h), self.bias[layer])
            handle = conn.send_attn_output(h, ids, weights, layer)
            moe_out = conn.recv_ffn_output(handle, blocking=False)
            if out is not None and layer == self.num_layers - 1:
                x = torch.add(residual, moe_out, out=out)
            else:
                x = residual + moe_out
            if record:
                self.rings.add(handle.ring)
                if self.keep_layer_tensors:
                    self.layers.append(LayerTensors(h, weights, ids, moe_out, x))
        return x

    def run_eager(self, hidden: torch.Tensor) -> torch.Tensor:
        """The same step, not captured (a baseline; the runner's path for sizes without a
        graph): hidden [n, H] -> new [n, H] tensor, n <= ``token_cap``. Non-blocking like the
        replay: call ``connector.check_errors()`` to synchronize and raise latched errors."""
        self._check_no_pending("run_eager")
        return self._step(hidden)

    def replay(self, hidden: torch.Tensor) -> torch.Tensor:
        """Copy ``hidden`` [n, H] (model dtype, connector's device, n <= ``num_tokens``) into
        the static input (rows n.. zeroed), replay the graph on the current stream, return
        ``output[:n]`` (a view of the static output: overwritten by the next replay; clone
        it to keep it).

        No host synchronization: errors the kernels latched (a peer timeout, a bad reply)
        surface at ``connector.check_errors()`` or the next blocking call, and the rows of a
        failed layer are NaN. Raises ValueError for a bad ``hidden`` and ProtocolError when an
        eager dispatch of this connector is pending on a ring the graph sends on.
        """
        n = self._check_hidden(hidden)
        self._check_no_pending("replay")
        self.input[:n].copy_(hidden)
        if n < self.num_tokens:
            self.input[n:].zero_()
        self.graph.replay()
        return self.output[:n]

    # --- checks ---------------------------------------------------------------------------
    def _check_hidden(self, hidden) -> int:
        want = (self.input.dtype, self.input.device)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 \
                or hidden.shape[1] != self.input.shape[1] or hidden.shape[0] > self.num_tokens:
            raise ValueError(f"hidden must be [n <= {self.num_tokens}, {self.input.shape[1]}], got "
                             f"{getattr(hidden, 'shape', type(hidden).__name__)}")
        if (hidden.dtype, hidden.device) != want:
            raise ValueError(f"hidden is {hidden.dtype} on {hidden.device}, the step's input is "
                             f"{want[0]} on {want[1]}")
        return hidden.shape[0]

    def _check_no_pending(self, what: str) -> None:
        # NOTE: a replay bypasses the connector's ring bookkeeping; an eager dispatch still in
        # flight on a ring the graph sends on would be overwritten by the replay's send
        pending = sorted(ring for ring in self.connector._pending if not self.rings or ring in self.rings)
        if pending:
            raise ProtocolError(f"{what}: dispatch(es) of this connector pending on ring(s) {pending}; "
                                "receive them (recv_ffn_output) first")
