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
layer. Why this is legal (docs/design/cuda-graphs.md): each
layer has exactly one dispatch in flight, on the same ring, and the layer's receive (device
wait + combine) precedes the next layer's send in stream order, so the slot is free again
before it is rewritten; sequence numbers and what each reply must echo live on the device;
the host bookkeeping (ring acquired, released) balances inside every captured layer; the
layer index is fixed per layer at capture. The FFN side is unchanged: any FFN loop
(``FFNWorker``, ``GraphFFNServer``) serves the replayed dispatches like eager ones.

**Micro-batch stages** (``stages=S`` > 1, issue #15 item 3): the T rows split into S
contiguous micro-batches (:func:`split_rows`: sizes as even as possible, the larger first),
micro-batch s sent as the connector's stage s, and the step is issued on ONE stream as a
software pipeline (:func:`pipeline_schedule`)::

    for s in range(S): A(0, s)                 # A(l, s) = attention + gate + send of (l, s)
    for l in range(L):
        for s in range(S):
            R(l, s)                            # R(l, s) = receive (wait + combine) + residual
            if l + 1 < L: A(l + 1, s)

The FFN is another process, so while the stream waits in R(l, s) for stage s's reply,
stages s+1.. of layer l and stages < s of layer l+1 are already at the FFN: the attention of
one micro-batch runs while the others' round trips are in flight (S = 1 is the plain step
above, issue for issue). Legal because stage s only ever uses its own ring(s) (the
connector's ring rule: stage s takes rings s, s+S', ... of a connector with S' >= S stages) and
its send of layer l+1 comes after its receive of layer l in stream order, so the host's
send-then-recv rule per (peer, stage) holds at every point of the issue order (at most S
dispatches pending, one per stage) and on the device each ring is rewritten only after the
wait and combine that read it have run; rings of different stages share no device state but
the error status. Each micro-batch runs the same kernels on the same rows as that micro-batch
sent alone, so its output rows are bit-identical to a one-stage step on those rows (routing
is per token; only kernels whose results depend on the batch size, such as a GEMM's algorithm,
could differ from the unsplit step, within bf16 rounding).

**A stream per stage** (``stage_streams=True``, S > 1): the host issues the same
:func:`pipeline_schedule`, but every operation of micro-batch s goes to the object's own
stream s (``stage_streams[s]``, created once), forked from the current stream at the start of
the step (``wait_stream``) and joined back into it at the end, before anything reads the
rows of two stages together. On the device the step is then S independent chains, one per
micro-batch::

    A(0, s) -> R(0, s) -> A(1, s) -> R(1, s) -> ... -> R(L-1, s)     on stream s, s < S

which a capture records as S parallel branches of the graph between the fork and the join.
On one stream every stage's attention and kernels run in series and the stream stalls in
each receive's spinning wait kernel; with a stream per stage, one micro-batch's attention,
gate, dispatch and combine run while another's wait kernel spins for its reply. Legal for the
reasons above, per chain: stage s's send of layer l+1 follows its receive of layer l on
stream s, stages share no device state but the error status and the per-slot ``last_seen``,
and the host order still keeps send-then-recv per stage. The cuda path's ring ordering
(per ring, the stream of its last use) sees ring s always used from stream s, so it adds nothing inside the step;
a replay on the current stream is ordered after the rings' last eager use on a stage stream
by ``order_graph_replay`` (and by the join, which already made the current stream wait).
Outputs are bit-identical to the one-stream step's (the same kernels on the same rows).
``stage_streams=True`` with S = 1 is the plain step (no extra stream).

Why a new module rather than a connector method: the helper composes user callables, torch's
graph API and the connector's public calls (``pending_rings``, ``capabilities``,
``order_graph_replay`` and the protocol calls; nothing private, no path attribute); the connector stays one call per protocol step. The
plan (:func:`split_rows`, :func:`pipeline_schedule`, :func:`check_capturable`) lives in
:mod:`afd_cupy.attention.step_schedule` and is re-exported here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from afd_cupy.errors import ConfigError, ProtocolError
from afd_cupy.moe import gates
# the plan (split, issue order, capture checks) lives in step_schedule; re-exported here, the
# public import path of these names
from afd_cupy.attention.step_schedule import (RECV, SEND, check_capturable, check_stages,  # noqa: F401
                                    pipeline_schedule, split_rows)

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


class DecodeStepGraph:
    """A decode step of ``len(attention)`` layers captured in one CUDA graph (module doc).

    Args:
        connector: an Attention-side cuda ``AFDConnector`` with ``poll_mode="device"``.
        attention: one callable per layer, ``x [T, H] -> h`` or ``-> (residual, h)``, all
            model dtype on the connector's device; captured, so it must be capturable itself
            (no host synchronization, no allocation that depends on values). With stages it
            is called per micro-batch (``x [T_s, H]``): it must treat rows independently
            (a decode step's attention does: one row per request).
        router: one callable per layer, ``h -> router logits`` float ``[T, num_experts]``;
            the gate is ``connector.select_experts`` (the model's gate).
        num_tokens: T, the batch size the graph is captured for (a runner captures one graph
            per batch-size bucket); :meth:`replay` takes up to T rows and zero-pads the rest.
        stages: S micro-batch stages (default 1: one dispatch in flight per layer). S > 1
            splits the T rows into S contiguous micro-batches (:func:`split_rows`) issued as a
            software pipeline (:func:`pipeline_schedule`, module doc); needs
            ``S <= connector.config.num_stages`` and ``S <= T``.
        e_score_correction_bias: None or one ``[num_experts]`` float tensor (or None) per
            layer, passed to ``select_experts``.
        gate_impl: ``select_experts``'s ``impl`` ("auto": a greedy gate runs as one kernel;
            "torch": torch's ops; "kernel"), ConfigError otherwise.
        stage_streams: with S > 1, issue micro-batch s on the object's own stream s
            (``stage_streams``, S ``torch.cuda.Stream`` created once) instead of all stages on
            one stream: forked from the current stream at the start of each step and joined
            back at its end, so the S chains are independent branches of the captured graph
            (module doc). Same host order, same kernels, same outputs. Ignored (one stream, no
            stream created) when S = 1. ``run_eager`` uses the same streams.
        keep_layer_tensors: keep every layer's tensors (:class:`LayerTensors`, ``.layers``,
            per micro-batch ``.stage_layers``) alive for inspection; otherwise the graph's
            pool reuses them across layers.
        warmup: eager steps run on a side stream before capturing (as torch advises: lazy
            initialization, cuBLAS workspaces, CuPy module loading happen there).

    Construction runs ``warmup`` real steps (round trips: the FFN ranks must be serving) on
    the zeroed static input, then captures. Raises ConfigError (:func:`check_capturable`, and
    mismatched argument lengths) before touching the GPU, and ProtocolError when a dispatch of
    this connector is still pending (receive it first). Not thread-safe. Drop the object
    before ``connector.close()``.

    Attributes: ``input`` / ``output`` (static ``[T, H]`` model dtype), ``graph``,
    ``num_layers``, ``num_tokens``, ``stages``, ``splits`` (``(start, stop)`` rows per
    micro-batch), ``schedule`` (the issue order), ``multi_stream`` (True when each stage has
    its own stream: ``stage_streams=True`` and S > 1), ``stage_streams`` (those S streams, an
    empty tuple otherwise), ``rings`` (the rings the graph sends on:
    ``{0, .., S-1}``), ``stage_layers`` (``[S][L]`` :class:`LayerTensors` of each
    micro-batch, empty lists unless ``keep_layer_tensors``) and ``layers`` (per layer, all
    T rows: ``stage_layers[0]`` when S = 1, else the stages' tensors concatenated at access,
    a copy).
    """

    def __init__(self, connector, attention: Sequence[AttentionFn], router: Sequence[RouterFn], *,
                 num_tokens: int, stages: int = 1, e_score_correction_bias: Sequence | None = None,
                 keep_layer_tensors: bool = False, warmup: int = 1, stage_streams: bool = False,
                 gate_impl: str = "auto"):
        self._setup(connector, attention, router, num_tokens=num_tokens, stages=stages,
                    e_score_correction_bias=e_score_correction_bias,
                    keep_layer_tensors=keep_layer_tensors, warmup=warmup, stage_streams=stage_streams,
                    gate_impl=gate_impl)
        self._check_no_pending("capture")
        device = connector.device
        hidden = connector.model.hidden_size
        self.input = torch.zeros(self.num_tokens, hidden, dtype=connector.torch_dtype, device=device)
        self.output = torch.empty_like(self.input)
        with torch.cuda.device(device):
            if self.multi_stream:  # once: the warm-up, the capture and run_eager use the same S
                self.stage_streams = tuple(torch.cuda.Stream(device) for _ in range(self.stages))
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

    def _setup(self, connector, attention, router, *, num_tokens, stages, e_score_correction_bias,
               keep_layer_tensors, warmup, stage_streams=False, gate_impl="auto") -> None:
        """The checks and the host-side attributes: everything but the GPU work (CPU tests
        drive :meth:`run_eager` on a stand-in connector after this alone)."""
        attention, router = list(attention), list(router)
        check_capturable(connector, num_tokens, len(attention), stages)
        if len(router) != len(attention):
            raise ConfigError(f"{len(attention)} attention callables but {len(router)} routers: "
                              "pass one of each per layer")
        bias = [None] * len(attention) if e_score_correction_bias is None else list(e_score_correction_bias)
        if len(bias) != len(attention):
            raise ConfigError(f"{len(bias)} e_score_correction_bias entries for {len(attention)} layers")
        if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 1:
            raise ConfigError(f"warmup must be an int >= 1 (torch needs an eager run before capture), "
                              f"got {warmup!r}")
        if not isinstance(stage_streams, bool):
            raise ConfigError(f"stage_streams must be a bool (True: a stream per micro-batch stage), "
                              f"got {stage_streams!r}")
        if gate_impl not in gates.GATE_IMPLS:
            raise ConfigError(f"gate_impl must be one of {gates.GATE_IMPLS}, got {gate_impl!r}")
        self.gate_impl = gate_impl
        self.connector = connector
        self.attention, self.router, self.bias = attention, router, bias
        self.num_layers, self.num_tokens, self.stages = len(attention), int(num_tokens), int(stages)
        self.splits = split_rows(self.num_tokens, self.stages)
        self.schedule = pipeline_schedule(self.num_layers, self.stages)
        self.keep_layer_tensors = bool(keep_layer_tensors)
        # S = 1 has one chain: a stream of its own would only add the fork and join
        self.multi_stream = stage_streams and self.stages > 1
        self.stage_streams: tuple = ()  # the constructor creates them (CPU tests set stand-ins)
        self.stage_layers: list[list[LayerTensors]] = [[] for _ in range(self.stages)]
        self.rings: set[int] = set()

    @property
    def layers(self) -> list[LayerTensors]:
        """Per layer, the :class:`LayerTensors` of all T rows (see the class doc)."""
        if self.stages == 1:
            return self.stage_layers[0]
        return [LayerTensors(*(torch.cat([getattr(self.stage_layers[s][layer], field.name)
                                          for s in range(self.stages)])
                               for field in dataclasses.fields(LayerTensors)))
                for layer in range(len(self.stage_layers[0]))]

    # --- the step -------------------------------------------------------------------------
    def _step(self, x: torch.Tensor, *, out: torch.Tensor | None = None, record: bool = False):
        """The L layers on ``x`` in :attr:`schedule`'s order (module doc); the last layer's
        residual adds write ``out`` (its micro-batch rows) when given. ``record``: note the
        rings sent on (and the layer tensors when kept). With :attr:`multi_stream`, stage s's
        operations go to ``stage_streams[s]``, forked from and joined back into the current
        stream. Returns the new ``[n, H]`` rows: a new tensor, or ``out`` when given (no
        concatenation kernel in the graph)."""
        conn, last = self.connector, self.num_layers - 1
        splits = self.splits if x.shape[0] == self.num_tokens else split_rows(x.shape[0], self.stages)
        xs = [x[start:stop] for start, stop in splits]  # each micro-batch's current rows
        sent: list = [None] * self.stages  # stage -> (handle, residual, h, weights, ids) in flight
        streams = self.stage_streams if self.multi_stream else None
        if streams:
            # fork: every stage stream starts after what the current stream queued (x's rows,
            # an earlier step or replay); inside a capture this makes the stage streams join
            # the capture, their work parallel branches of the graph
            current = torch.cuda.current_stream(x.device)
            for stream in streams:
                stream.wait_stream(current)
        try:
            # consecutive operations of one stage (a receive and the stage's next send) share
            # one stream switch; the host order stays the schedule's
            for stage, ops in itertools.groupby(self.schedule, key=lambda entry: entry[2]):
                with torch.cuda.stream(streams[stage]) if streams else contextlib.nullcontext():
                    for op, layer, _ in ops:
                        if op == SEND:
                            produced = self.attention[layer](xs[stage])
                            residual, h = produced if isinstance(produced, tuple) else (produced, produced)
                            weights, ids = conn.select_experts(self.router[layer](h), self.bias[layer],
                                                               impl=self.gate_impl)
                            handle = conn.send_attn_output(h, ids, weights, layer, stage)
                            sent[stage] = (handle, residual, h, weights, ids)
                            if record:
                                self.rings.add(handle.ring)
                            continue
                        handle, residual, h, weights, ids = sent[stage]
                        sent[stage] = None
                        moe_out = conn.recv_ffn_output(handle, blocking=False)
                        if out is not None and layer == last:
                            start, stop = splits[stage]
                            xs[stage] = torch.add(residual, moe_out,
                                                  out=out if self.stages == 1 else out[start:stop])
                        else:
                            xs[stage] = residual + moe_out
                        if record and self.keep_layer_tensors:
                            self.stage_layers[stage].append(LayerTensors(h, weights, ids, moe_out, xs[stage]))
        except BaseException:
            # a stage whose send went out but whose receive was not issued keeps its ring
            # reserved: release it, or every later send on that stage raises (its reply, if
            # the dispatch really went, is dropped by seq like any late reply)
            for entry in sent:
                if entry is not None:
                    conn.forget_dispatch(entry[0])
            raise
        finally:
            if streams:
                # join, on success and failure alike (a capture must end with its side streams
                # rejoined; a caller's check_errors() synchronizes the current stream only):
                # the current stream waits for every stage's last kernel before anything reads
                # two stages' rows (the concatenation below, a replay's static output)
                for stream in streams:
                    current.wait_stream(stream)
        if out is not None:
            return out
        if self.stages == 1:
            return xs[0]
        if streams:
            # Allocator: every tensor of the step was allocated on the stream that uses it
            # (stage s's on stream s) except the rows read by the concatenation below, which
            # runs on the current stream after the join. NOTE: freeing them returns their
            # blocks to stream s's pool, and the next allocation on stream s may come before
            # the concatenation has run: our own next step is safe (it forks from the current
            # stream first, behind the concatenation), but torch.cuda.Stream() hands streams
            # out of a per-device pool, so stream s can also be another component's stream.
            # record_stream makes the allocator wait for the current stream's use. The input
            # rows x[start:stop] need nothing: their block belongs to the current stream, and
            # everything the current stream runs later comes after the join, i.e. after stage
            # s's reads. Nothing crosses streams in the captured path (``out`` is static).
            for rows in xs:
                rows.record_stream(current)
        return torch.cat(xs)

    def run_eager(self, hidden: torch.Tensor) -> torch.Tensor:
        """The same step, not captured (a baseline; the runner's path for sizes without a
        graph): hidden [n, H] -> new [n, H] tensor, n <= ``token_cap``; with stages, the n rows
        split as :func:`split_rows` does (ValueError when n < stages) and run in the same
        :attr:`schedule` (with :attr:`multi_stream` on the stage streams, joined back into the
        current stream before it returns). Non-blocking like the replay: call
        ``connector.check_errors()`` to synchronize and raise latched errors."""
        self._check_no_pending("run_eager")
        rows = getattr(hidden, "shape", (0,))[0]
        if self.stages > 1 and rows < self.stages:
            raise ValueError(f"run_eager: {rows} row(s) cannot be split into stages={self.stages} "
                             "micro-batches of at least one row each")
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
        # after the rings' last eager use on another stream (a stage stream of run_eager or of
        # the warm-up, another object's stream), and before the next: the graph's branches run
        # inside the replay, which is ordered on the current stream as a whole
        self.connector.order_graph_replay(self.rings,
                                          torch.cuda.current_stream(self.input.device).cuda_stream)
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
        pending = [ring for ring in self.connector.pending_rings() if not self.rings or ring in self.rings]
        if pending:
            raise ProtocolError(f"{what}: dispatch(es) of this connector pending on ring(s) {pending}; "
                                "receive them (recv_ffn_output) first")
