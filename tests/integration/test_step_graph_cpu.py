"""CPU checks of afd_cupy.attention.step_graph: what cannot be captured is a ConfigError naming the
values, raised before anything touches a GPU (a stand-in connector, and one real host-backend
connector); replay's input checks; the stand-in model's shapes. The capture itself:
tests/integration/test_step_graph_cuda.py."""
from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from afd_cupy.attention.endpoint import AttentionEndpoint
from afd_cupy.attention.step_graph import (DecodeStepGraph, RECV, SEND, check_capturable,
                                           pipeline_schedule, split_rows)
from afd_cupy.backends.base import Capabilities
from afd_cupy.backends.cuda_attention import CudaAttentionPath
from afd_cupy.config import ConnectorConfig
from afd_cupy.errors import ConfigError, ProtocolError
from afd_cupy.runtime.topology import Role
from afd_cupy.testing.step_model import LinearStandIn


def _conn(role=Role.ATTENTION, backend="cuda", poll_mode="device", token_cap=16, num_layers=4, pending=(),
          num_stages=1, supports_nonblocking=None):
    """The public attributes of an AFDConnector that the checks read (no private one: the
    step graph uses the connector's public calls only)."""
    config = ConnectorConfig(async_moe_ubatching=num_stages > 1, async_moe_num_ubatches=max(num_stages, 2))
    nonblocking = backend == "cuda" if supports_nonblocking is None else supports_nonblocking
    capabilities = Capabilities(backend=backend, wire_modes=("pair",),
                                supports_nonblocking=nonblocking, device_polling=poll_mode == "device")
    return SimpleNamespace(role=role, backend=backend, capabilities=capabilities,
                           layout=SimpleNamespace(token_cap=token_cap, ring_depth=config.ring_depth),
                           model=SimpleNamespace(num_layers=num_layers), config=config,
                           supports_nonblocking=nonblocking, order_graph_replay=lambda rings, stream: None,
                           pending_rings=lambda: tuple(sorted(pending)))


def _fns(n):
    return [lambda x: x] * n


@pytest.mark.parametrize("conn,tokens,layers,match", [
    (_conn(backend="host"), 8, 2, r"backend='host': its receive blocks on the host \(supports_nonblocking=False\)"),
    # the capability decides, not the backend's name
    (_conn(supports_nonblocking=False), 8, 2, r"backend='cuda': its receive blocks on the host"),
    (_conn(poll_mode="host"), 8, 2, r"poll_mode='host': a captured receive must wait on the device"),
    (_conn(role=Role.FFN), 8, 2, r"Attention-side connector, got role 'ffn'"),
    (_conn(token_cap=16), 17, 2, r"num_tokens=17 must be an int in \[1, token_cap=16\]"),
    (_conn(), 0, 2, r"num_tokens=0 must be"),
    (_conn(), 4.0, 2, r"num_tokens=4.0 must be"),
    (_conn(num_layers=4), 8, 5, r"5 layers in the step: must be in \[1, model.num_layers=4\]"),
    (_conn(), 8, 0, r"0 layers in the step"),
])
def test_what_cannot_be_captured_is_a_config_error(conn, tokens, layers, match):
    with pytest.raises(ConfigError, match=match):
        check_capturable(conn, tokens, layers)
    with pytest.raises(ConfigError, match=match):  # the constructor checks first, on the CPU
        DecodeStepGraph(conn, _fns(layers), _fns(layers), num_tokens=tokens)


@pytest.mark.parametrize("conn,tokens,stages,match", [
    (_conn(), 8, 2, r"stages=2 needs a connector with at least 2 micro-batch stages \(ConnectorConfig\("
                    r"async_moe_ubatching=True, async_moe_num_ubatches=2\) on every rank\); this one has "
                    r"num_stages=1 \(async_moe_ubatching=False, async_moe_num_ubatches=2\)"),
    (_conn(num_stages=2), 8, 4, r"stages=4 needs .* this one has num_stages=2 \(async_moe_ubatching=True"),
    (_conn(num_stages=2), 1, 2, r"num_tokens=1 rows cannot be split into stages=2 micro-batches"),
    (_conn(num_stages=4), 3, 4, r"num_tokens=3 rows cannot be split into stages=4"),
    (_conn(num_stages=2), 8, 0, r"stages must be an int >= 1, got 0"),
    (_conn(num_stages=2), 8, True, r"stages must be an int >= 1, got True"),
    (_conn(num_stages=2), 8, 2.0, r"stages must be an int >= 1, got 2.0"),
])
def test_stages_that_cannot_be_captured_are_config_errors(conn, tokens, stages, match):
    with pytest.raises(ConfigError, match=match):
        check_capturable(conn, tokens, 2, stages)
    with pytest.raises(ConfigError, match=match):
        DecodeStepGraph(conn, _fns(2), _fns(2), num_tokens=tokens, stages=stages)


def test_stages_up_to_the_connectors_pass_the_check():
    """stages <= num_stages (not ==): a runner's 1-row bucket runs stages=1 on a 2-stage
    connector, and stages=1 on any connector is the unstaged step."""
    for stages in (1, 2):
        check_capturable(_conn(num_stages=2), 2, 4, stages)
    check_capturable(_conn(num_stages=4), 16, 4, 3)
    check_capturable(_conn(num_stages=2), 1, 4, 1)


@pytest.mark.parametrize("tokens,stages,want", [
    (40, 1, ((0, 40),)), (40, 2, ((0, 20), (20, 40))), (5, 2, ((0, 3), (3, 5))),
    (7, 3, ((0, 3), (3, 5), (5, 7))), (4, 4, ((0, 1), (1, 2), (2, 3), (3, 4))),
    (10, 4, ((0, 3), (3, 6), (6, 8), (8, 10))), (1, 1, ((0, 1),))])
def test_split_rows_even_contiguous_nonempty(tokens, stages, want):
    assert split_rows(tokens, stages) == want


def test_split_rows_refuses_empty_micro_batches():
    for tokens, stages in ((1, 2), (0, 1), (3, 4)):
        with pytest.raises(ConfigError, match=f"num_tokens={tokens} rows cannot be split into stages={stages}"):
            split_rows(tokens, stages)


def test_pipeline_schedule_exact_orders():
    assert pipeline_schedule(3, 1) == ((SEND, 0, 0), (RECV, 0, 0), (SEND, 1, 0), (RECV, 1, 0),
                                       (SEND, 2, 0), (RECV, 2, 0))  # today's step, unchanged
    assert pipeline_schedule(2, 2) == ((SEND, 0, 0), (SEND, 0, 1), (RECV, 0, 0), (SEND, 1, 0),
                                       (RECV, 0, 1), (SEND, 1, 1), (RECV, 1, 0), (RECV, 1, 1))
    assert pipeline_schedule(1, 3) == ((SEND, 0, 0), (SEND, 0, 1), (SEND, 0, 2),
                                       (RECV, 0, 0), (RECV, 0, 1), (RECV, 0, 2))


@pytest.mark.parametrize("layers", [1, 2, 5])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_pipeline_schedule_keeps_send_then_recv_per_stage(layers, stages):
    """The legality of one stream (module doc): every (layer, stage) sent once, then received
    once; per stage strictly send, recv, send, ... in layer order (its ring is free before it
    is reused); at most one dispatch per stage pending, so at most S in all; and the overlap
    itself: S dispatches are pending whenever a receive is issued, but in the last layer's drain."""
    order = pipeline_schedule(layers, stages)
    assert len(order) == 2 * layers * stages
    pending: dict[int, int] = {}
    for op, layer, stage in order:
        if op == SEND:
            assert stage not in pending, (op, layer, stage)
            pending[stage] = layer
        else:
            assert pending.get(stage) == layer, (op, layer, stage)
            # every stage in flight when one is waited on (the last layer drains in stage order)
            assert len(pending) == (stages if layer < layers - 1 else stages - stage), (op, layer, stage)
            del pending[stage]
    assert not pending
    for stage in range(stages):
        mine = [(op, layer) for op, layer, s in order if s == stage]
        assert mine == [(op, layer) for layer in range(layers) for op in (SEND, RECV)]


def test_capturable_arguments_pass_the_check():
    check_capturable(_conn(token_cap=16, num_layers=4), 16, 4)
    check_capturable(_conn(token_cap=16, num_layers=4), 1, 1)
    # a backend of another name that declares non-blocking receives is capturable
    check_capturable(_conn(backend="other", supports_nonblocking=True), 8, 2)


def test_constructor_argument_mismatches():
    conn = _conn()
    with pytest.raises(ConfigError, match="3 attention callables but 2 routers"):
        DecodeStepGraph(conn, _fns(3), _fns(2), num_tokens=4)
    with pytest.raises(ConfigError, match="1 e_score_correction_bias entries for 2 layers"):
        DecodeStepGraph(conn, _fns(2), _fns(2), num_tokens=4, e_score_correction_bias=[None])
    with pytest.raises(ConfigError, match="warmup must be an int >= 1"):
        DecodeStepGraph(conn, _fns(2), _fns(2), num_tokens=4, warmup=0)
    with pytest.raises(ProtocolError, match=r"capture: dispatch\(es\) of this connector pending on ring\(s\) \[0\]"):
        DecodeStepGraph(_conn(pending=(0,)), _fns(2), _fns(2), num_tokens=4)


def test_replay_input_checks_and_pending_rings():
    step = DecodeStepGraph.__new__(DecodeStepGraph)  # the checks only: no graph on the CPU
    step.input, step.num_tokens, step.rings = torch.zeros(4, 8, dtype=torch.bfloat16), 4, {0}
    step.connector = _conn(pending=(1,))  # a pending eager dispatch on a ring the graph does not use
    assert step._check_hidden(torch.zeros(3, 8, dtype=torch.bfloat16)) == 3
    step._check_no_pending("replay")
    for bad, match in ((torch.zeros(5, 8, dtype=torch.bfloat16), r"must be \[n <= 4, 8\], got torch.Size\(\[5, 8\]\)"),
                       (torch.zeros(4, 7, dtype=torch.bfloat16), r"must be \[n <= 4, 8\]"),
                       (torch.zeros(4, 8), r"hidden is torch.float32 on cpu, the step's input is torch.bfloat16"),
                       ([[0.0] * 8], r"got list")):
        with pytest.raises(ValueError, match=match):
            step.replay(bad)
    step.connector = _conn(pending=(0,))
    with pytest.raises(ProtocolError, match=r"replay: dispatch\(es\) .* ring\(s\) \[0\]"):
        step.replay(torch.zeros(4, 8, dtype=torch.bfloat16))


class _RecordingConnector:
    """A stand-in Attention connector for the schedule on the CPU: the checks' attributes, the
    real ring rule (``AttentionEndpoint._acquire_ring`` on this object's ``_pending``), a row-wise
    gate, and an "FFN" that answers at receive with ``2 * h + 1``. ``calls`` records
    ``(op, layer, stage, ring, rows)`` in issue order."""

    def __init__(self, num_stages=2, ring_depth=None, num_layers=4, token_cap=16):
        self.role, self.backend = Role.ATTENTION, "cuda"
        self.capabilities = Capabilities(backend="cuda", wire_modes=("pair",),
                                         supports_nonblocking=True, device_polling=True)
        self.path = SimpleNamespace(order_graph_replay=lambda rings, stream: None)
        self.config = ConnectorConfig(async_moe_ubatching=num_stages > 1, async_moe_num_ubatches=max(num_stages, 2),
                                      ring_depth=ring_depth)
        self.layout = SimpleNamespace(token_cap=token_cap, ring_depth=self.config.ring_depth)
        self.model = SimpleNamespace(num_layers=num_layers)
        self.supports_nonblocking = True
        self._pending, self.calls = {}, []

    def pending_rings(self):
        return AttentionEndpoint.pending_rings(self)  # the real call on this object's _pending

    def order_graph_replay(self, rings, stream):
        self.path.order_graph_replay(rings, stream)

    def select_experts(self, logits, bias=None, impl="auto"):
        self.gate_impls = getattr(self, "gate_impls", []) + [impl]
        weights, ids = logits.softmax(dim=-1).topk(2, dim=-1)
        return weights.float(), ids.int()

    def send_attn_output(self, hidden, ids, weights, layer_idx, stage_idx=0):
        ring = AttentionEndpoint._acquire_ring(self, stage_idx)  # RingExhaustedError if the stage's ring is busy
        handle = SimpleNamespace(ring=ring, layer_idx=layer_idx, stage_idx=stage_idx, hidden=hidden)
        self._pending[ring] = handle
        self.calls.append((SEND, layer_idx, stage_idx, ring, hidden.shape[0]))
        return handle

    def forget_dispatch(self, handle):
        AttentionEndpoint.forget(self, handle)  # the real rule on this object's _pending
        self.calls.append(("forget", handle.layer_idx, handle.stage_idx, handle.ring, handle.hidden.shape[0]))

    def _require(self, role, what):
        assert role is Role.ATTENTION

    def _check_pending(self, handle):
        AttentionEndpoint._check_pending(self, handle)

    def recv_ffn_output(self, handle, *, blocking=True):
        assert not blocking and self._pending.get(handle.ring) is handle
        del self._pending[handle.ring]
        self.calls.append((RECV, handle.layer_idx, handle.stage_idx, handle.ring, handle.hidden.shape[0]))
        return handle.hidden * 2 + 1


def _row_wise_step(conn, layers, tokens, stages, keep=False):
    """A DecodeStepGraph set up without the GPU (``_setup`` only) over row-wise fp32 layers."""
    step = DecodeStepGraph.__new__(DecodeStepGraph)
    step._setup(conn, [lambda x, l=l: (x + l, (x + l) * 0.5) for l in range(layers)],
                [lambda h: h[:, :4] * 3.0] * layers, num_tokens=tokens, stages=stages,
                e_score_correction_bias=None, keep_layer_tensors=keep, warmup=1)
    return step


@pytest.mark.parametrize("stages,ring_depth", [(1, None), (2, None), (2, 4), (3, None)])
def test_staged_step_issues_the_pipeline_on_each_stages_own_ring(stages, ring_depth):
    """run_eager drives the connector in :func:`pipeline_schedule`'s order: micro-batch s on
    stage s and ring s (also with deeper rings: its previous dispatch was received first),
    the split's rows, never a busy ring; its rows equal each micro-batch run alone (S = 1 on
    the same rows) bit for bit, and the unsplit step's (row-wise functions)."""
    conn = _RecordingConnector(num_stages=max(stages, 2) if stages > 1 else 1, ring_depth=ring_depth)
    layers, tokens = 3, 7
    step = _row_wise_step(conn, layers, tokens, stages)
    x = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(0))
    got = step.run_eager(x)
    sizes = [stop - start for start, stop in split_rows(tokens, stages)]
    assert conn.calls == [(op, layer, stage, stage, sizes[stage])
                          for op, layer, stage in pipeline_schedule(layers, stages)]
    assert not conn._pending
    alone_conn = _RecordingConnector(num_stages=1)
    alone = _row_wise_step(alone_conn, layers, tokens, 1)
    want = torch.cat([alone.run_eager(x[start:stop]) for start, stop in split_rows(tokens, stages)])
    assert torch.equal(got, want)
    assert torch.equal(got, alone.run_eager(x))


def test_staged_capture_path_writes_out_and_records_rings_and_layers():
    """The captured path's logic (``_step(out=..., record=True)``), on the CPU: the last
    layer's adds write each micro-batch's rows of ``out``; rings {0, 1}; ``stage_layers``
    [S][L] and ``layers`` concatenated per layer."""
    conn = _RecordingConnector(num_stages=2)
    step = _row_wise_step(conn, 2, 5, 2, keep=True)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    out = torch.full((5, 8), float("nan"))
    assert step._step(x, out=out, record=True) is out
    assert torch.equal(out, step.run_eager(x)) and step.rings == {0, 1}
    assert [len(layers) for layers in step.stage_layers] == [2, 2]
    assert [t.moe_input.shape[0] for t in step.stage_layers[1]] == [2, 2]
    full = step.layers
    assert len(full) == 2 and full[1].output.shape == (5, 8) and torch.equal(full[1].output, out)
    assert torch.equal(full[0].moe_input, (x + 0) * 0.5)
    assert full[0].topk_ids.dtype == torch.int32 and full[0].topk_weights.shape == (5, 2)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_failing_layer_releases_the_rings_still_in_flight(stages):
    """Layer 1's attention raises on stage 0: the stages whose layer-0 dispatch was sent but
    not received get their rings released (forget_dispatch), nothing stays pending, and the
    same step runs again afterwards."""
    conn = _RecordingConnector(num_stages=max(stages, 2) if stages > 1 else 1)
    step = _row_wise_step(conn, 3, 6, stages)
    healthy = step.attention[1]
    step.attention[1] = lambda x: (_ for _ in ()).throw(RuntimeError("attention failed"))
    with pytest.raises(RuntimeError, match="attention failed"):
        step.run_eager(torch.zeros(6, 8))
    forgotten = [(layer, stage) for op, layer, stage, *_ in conn.calls if op == "forget"]
    # stage 0 was received before its layer-1 attention ran; stages 1.. were still in flight
    assert forgotten == [(0, s) for s in range(1, stages)]
    assert not conn._pending
    step.attention[1] = healthy
    assert step.run_eager(torch.zeros(6, 8)).shape == (6, 8) and not conn._pending


def test_forget_dispatch_needs_a_pending_handle():
    conn = _RecordingConnector(num_stages=1)
    handle = conn.send_attn_output(torch.zeros(2, 8), None, None, 0)
    conn.forget_dispatch(handle)
    with pytest.raises(ProtocolError, match="handle for layer 0 ring 0 is not pending"):
        conn.forget_dispatch(handle)


def test_run_eager_with_fewer_rows_than_stages_is_a_value_error():
    step = _row_wise_step(_RecordingConnector(num_stages=2), 2, 4, 2)
    with pytest.raises(ValueError, match=r"run_eager: 1 row\(s\) cannot be split into stages=2"):
        step.run_eager(torch.zeros(1, 8))
    assert step.run_eager(torch.zeros(3, 8)).shape == (3, 8)  # n != T splits n: 2 + 1


def test_stage_streams_option_is_checked_and_recorded():
    """stage_streams: a bool (ConfigError naming the value, before the GPU); with S > 1 the
    step has a stream per stage (the constructor creates them); with S = 1 it is the plain
    one-stream step (a no-op, no stream)."""
    for bad in (1, "yes", None):
        with pytest.raises(ConfigError, match=f"stage_streams must be a bool .*, got {bad!r}"):
            DecodeStepGraph(_conn(num_stages=2), _fns(2), _fns(2), num_tokens=4, stages=2, stage_streams=bad)
    conn = _RecordingConnector(num_stages=2)
    for stages, option, want in ((2, True, True), (2, False, False), (1, True, False), (1, False, False)):
        step = DecodeStepGraph.__new__(DecodeStepGraph)
        step._setup(conn, _fns(2), _fns(2), num_tokens=4, stages=stages, e_score_correction_bias=None,
                    keep_layer_tensors=False, warmup=1, stage_streams=option)
        assert step.multi_stream is want and step.stage_streams == (), (stages, option)
    # S = 1: run_eager touches no stream (torch.cuda would raise on this CPU-only machine)
    plain = DecodeStepGraph.__new__(DecodeStepGraph)
    plain._setup(_RecordingConnector(num_stages=1), [lambda x: (x, x * 0.5)] * 2, [lambda h: h[:, :4]] * 2,
                 num_tokens=4, stages=1, e_score_correction_bias=None, keep_layer_tensors=False, warmup=1,
                 stage_streams=True)
    assert torch.equal(plain.run_eager(torch.ones(4, 8)), torch.full((4, 8), 7.0))  # x -> 2x + 1, twice


def test_gate_impl_is_checked_and_reaches_every_gate():
    """gate_impl: one of gates.GATE_IMPLS (ConfigError naming the value, before the GPU); every
    layer's select_experts gets it as ``impl``."""
    with pytest.raises(ConfigError, match=r"gate_impl must be one of \('auto', 'torch', 'kernel'\), got 'fast'"):
        DecodeStepGraph(_conn(num_stages=1), _fns(2), _fns(2), num_tokens=4, gate_impl="fast")
    for impl in ("auto", "torch", "kernel"):
        conn = _RecordingConnector(num_stages=1)
        step = DecodeStepGraph.__new__(DecodeStepGraph)
        step._setup(conn, [lambda x: (x, x * 0.5)] * 3, [lambda h: h[:, :4]] * 3, num_tokens=4, stages=1,
                    e_score_correction_bias=None, keep_layer_tensors=False, warmup=1, gate_impl=impl)
        step.run_eager(torch.ones(4, 8))
        assert step.gate_impl == impl and conn.gate_impls == [impl] * 3


@dataclasses.dataclass(eq=False)
class _Stream:
    """A stand-in ``torch.cuda.Stream``: a name, a raw handle, ``wait_stream`` logged."""

    name: str
    cuda_stream: int
    log: list

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))


class _Streams:
    """The stream calls of ``DecodeStepGraph._step`` / ``replay`` on the CPU (monkeypatched
    ``torch.cuda.current_stream``, ``torch.cuda.stream``, ``Tensor.record_stream``) and the
    CUDA runtime calls of the cuda path's ring ordering: everything goes to one ``log`` in
    call order. ``capturing``: the names of the streams in a capture."""

    def __init__(self, monkeypatch):
        self.log, self.capturing, self.by_handle = [], set(), {}
        self.current = self.make("main")
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self.use)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda tensor, stream: self.log.append(("record_stream", tensor.shape[0], stream.name)))

    def make(self, name):
        stream = _Stream(name, 100 + len(self.by_handle), self.log)
        self.by_handle[stream.cuda_stream] = stream
        return stream

    @contextlib.contextmanager
    def use(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    # the runtime calls CudaAttentionPath._order_ring makes, on raw handles
    def streamIsCapturing(self, handle):
        return self.by_handle[handle].name in self.capturing

    def eventRecord(self, event, handle):
        self.log.append(("event", event, self.by_handle[handle].name))

    def streamWaitEvent(self, handle, event):
        self.log.append(("wait_event", self.by_handle[handle].name, event))


class _OrderingPath(CudaAttentionPath):
    """The cuda path's ring ordering (the real ``_order_ring`` / ``order_graph_replay``) over
    :class:`_Streams`' runtime; one named event per ring."""

    def __init__(self, streams, ring_depth):
        self.ctx = SimpleNamespace(poll_mode="device")
        self.cp = SimpleNamespace(cuda=SimpleNamespace(runtime=streams))
        self._ring_stream = [None] * ring_depth
        self._ring_event = [f"ev{ring}" for ring in range(ring_depth)]


class _StreamRecordingConnector(_RecordingConnector):
    """:class:`_RecordingConnector` whose sends and receives order their ring as the cuda
    path does (``_order_ring`` on the current stream's handle) and log ``(op, layer, stage,
    ring, stream name)`` to the streams' log."""

    def __init__(self, streams, **kwargs):
        super().__init__(**kwargs)
        self.streams = streams
        self.path = _OrderingPath(streams, self.layout.ring_depth)

    def _used(self, op, handle):
        self.path._order_ring(handle.ring, torch.cuda.current_stream().cuda_stream)
        self.streams.log.append((op, handle.layer_idx, handle.stage_idx, handle.ring, self.streams.current.name))

    def send_attn_output(self, hidden, ids, weights, layer_idx, stage_idx=0):
        handle = super().send_attn_output(hidden, ids, weights, layer_idx, stage_idx)
        self._used(SEND, handle)
        return handle

    def recv_ffn_output(self, handle, *, blocking=True):
        out = super().recv_ffn_output(handle, blocking=blocking)
        self._used(RECV, handle)
        return out


def _stream_step(monkeypatch, layers=2, tokens=5, stages=2, keep=False):
    streams = _Streams(monkeypatch)
    conn = _StreamRecordingConnector(streams, num_stages=stages)
    step = DecodeStepGraph.__new__(DecodeStepGraph)
    step._setup(conn, [lambda x, l=l: (x + l, (x + l) * 0.5) for l in range(layers)],
                [lambda h: h[:, :4] * 3.0] * layers, num_tokens=tokens, stages=stages,
                e_score_correction_bias=None, keep_layer_tensors=keep, warmup=1, stage_streams=True)
    step.stage_streams = tuple(streams.make(f"s{stage}") for stage in range(stages))
    return streams, conn, step


@pytest.mark.parametrize("stages", [2, 3])
def test_stage_streams_fork_issue_each_stage_on_its_stream_and_join(monkeypatch, stages):
    """run_eager with a stream per stage: every stage stream waits for the current one before
    any operation (fork); each (layer, stage)'s send and receive go to stream s, in the
    schedule's host order, on ring s (so the ring ordering never fires); the current stream
    waits for every stage stream after the last operation (join), then the stages' rows are
    marked used by the current stream (record_stream) for the concatenation; the rows equal
    the one-stream step's bit for bit."""
    streams, conn, step = _stream_step(monkeypatch, layers=3, tokens=7, stages=stages)
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(4))
    got = step.run_eager(x)
    sizes = [stop - start for start, stop in split_rows(7, stages)]
    assert streams.log == (
        [("wait", f"s{s}", "main") for s in range(stages)]
        + [(op, layer, stage, stage, f"s{stage}") for op, layer, stage in pipeline_schedule(3, stages)]
        + [("wait", "main", f"s{s}") for s in range(stages)]
        + [("record_stream", sizes[s], "main") for s in range(stages)])
    assert streams.current.name == "main" and not conn._pending
    one_stream = _row_wise_step(_RecordingConnector(num_stages=stages), 3, 7, stages)
    assert torch.equal(got, one_stream.run_eager(x))


def test_stage_streams_capture_path_and_replay_ordering(monkeypatch):
    """The constructor's sequence with a stream per stage, on the CPU: the warm-up on a side
    stream (forks from and joins into it), the capture (the stage streams join the capture:
    no ring event, the rings stay on their stage streams; the last layer writes ``out``
    directly, nothing recorded for a concatenation), then replay on the main stream: it first
    waits for each ring's last eager use on its stage stream (order_graph_replay), and an
    eager step after it orders each ring behind the replay; a replay after that eager step
    waits for the stage streams again."""
    streams, conn, step = _stream_step(monkeypatch, keep=True)
    log, x = streams.log, torch.randn(5, 8, generator=torch.Generator().manual_seed(6))
    side, capture = streams.make("side"), streams.make("capture")
    with streams.use(side):
        warm = step._step(x)
    assert log[:2] == [("wait", "s0", "side"), ("wait", "s1", "side")]
    assert log[-4:] == [("wait", "side", "s0"), ("wait", "side", "s1"),
                        ("record_stream", 3, "side"), ("record_stream", 2, "side")]
    assert not [entry for entry in log if entry[0] in ("event", "wait_event")]  # first use of each ring
    del log[:]
    out = torch.full((5, 8), float("nan"))
    streams.capturing = {"capture", "s0", "s1"}
    with streams.use(capture):
        assert step._step(x, out=out, record=True) is out
    streams.capturing = set()
    assert log == ([("wait", "s0", "capture"), ("wait", "s1", "capture")]
                   + [(op, layer, stage, stage, f"s{stage}") for op, layer, stage in step.schedule]
                   + [("wait", "capture", "s0"), ("wait", "capture", "s1")])
    assert torch.equal(out, warm) and step.rings == {0, 1}
    assert [len(layers) for layers in step.stage_layers] == [2, 2]
    assert conn.path._ring_stream == [step.stage_streams[0].cuda_stream, step.stage_streams[1].cuda_stream]
    step.input, step.output = torch.zeros(5, 8), out
    step.graph = SimpleNamespace(replay=lambda: log.append(("replay", streams.current.name)))
    del log[:]
    assert torch.equal(step.replay(x), warm)
    replay_ordering = [("event", "ev0", "s0"), ("wait_event", "main", "ev0"),
                       ("event", "ev1", "s1"), ("wait_event", "main", "ev1"), ("replay", "main")]
    assert log == replay_ordering
    del log[:]
    assert torch.equal(step.run_eager(x), warm)
    # the fork, then each ring's first use on its stage stream waits for the replay's stream
    assert log[:5] == [("wait", "s0", "main"), ("wait", "s1", "main"),
                       ("event", "ev0", "main"), ("wait_event", "s0", "ev0"), (SEND, 0, 0, 0, "s0")]
    assert log[5:7] == [("event", "ev1", "main"), ("wait_event", "s1", "ev1")]
    del log[:]
    step.replay(x)
    assert log == replay_ordering


def test_a_capture_leaves_the_ring_on_its_last_eager_stream(monkeypatch):
    """CudaAttentionPath._order_ring: a use on a capturing stream orders nothing and keeps the
    ring's stream (the capture runs nothing), so the replay waits for the ring's last eager
    use (here on stream P, maybe still in flight), not for the idle capture stream."""
    streams = _Streams(monkeypatch)
    path = _OrderingPath(streams, 1)
    p, capture, r = streams.make("P"), streams.make("capture"), streams.make("R")
    path._order_ring(0, p.cuda_stream)
    streams.capturing = {"capture"}
    path._order_ring(0, capture.cuda_stream)
    path._order_ring(0, capture.cuda_stream)
    streams.capturing = set()
    assert streams.log == [] and path._ring_stream == [p.cuda_stream]
    path.order_graph_replay({0}, r.cuda_stream)
    assert streams.log == [("event", "ev0", "P"), ("wait_event", "R", "ev0")]
    assert path._ring_stream == [r.cuda_stream]
    path._order_ring(0, r.cuda_stream)  # same stream: nothing
    assert len(streams.log) == 2


@pytest.mark.parametrize("stages", [2, 3])
def test_a_failing_layer_on_stage_streams_still_joins(monkeypatch, stages):
    """A stage's attention raises mid-step: the in-flight rings are released and every stage
    stream is joined back into the current one (a capture must end with its side streams
    rejoined) before the error propagates; no record_stream (nothing was concatenated)."""
    streams, conn, step = _stream_step(monkeypatch, layers=3, tokens=6, stages=stages)
    step.attention[1] = lambda x: (_ for _ in ()).throw(RuntimeError("attention failed"))
    with pytest.raises(RuntimeError, match="attention failed"):
        step.run_eager(torch.zeros(6, 8))
    assert streams.log[-stages:] == [("wait", "main", f"s{s}") for s in range(stages)]
    assert not [entry for entry in streams.log if entry[0] == "record_stream"]
    assert not conn._pending and streams.current.name == "main"


def test_linear_stand_in_shapes_and_determinism():
    a = LinearStandIn(3, 16, 4, dtype=torch.bfloat16, device="cpu", seed=1)
    b = LinearStandIn(3, 16, 4, dtype=torch.bfloat16, device="cpu", seed=1, shared_weights=True)
    x = torch.randn(5, 16).to(torch.bfloat16)
    residual, h = a.attention_fns()[2](x)
    assert residual.shape == h.shape == (5, 16) and residual.dtype == torch.bfloat16
    assert torch.equal(h, residual * 0.5)
    logits = a.router_fns()[1](h)
    assert logits.shape == (5, 4) and logits.dtype == torch.float32
    assert torch.equal(a.w[0], b.w[0]) and b.w[2] is b.w[0] and not torch.equal(a.w[2], a.w[0])
    # normalize: the MoE input is the residual RMS-normalized (rows of mean square 1, bf16),
    # the residual unchanged; a row 1000x larger gives the same h
    n = LinearStandIn(3, 16, 4, dtype=torch.bfloat16, device="cpu", seed=1, normalize=True)
    big = torch.cat([x[:1], x[:1] * 1000]).to(torch.bfloat16)
    residual_n, h_n = n.attention_fns()[2](big)
    assert torch.equal(residual_n, a.attention_fns()[2](big)[0]) and h_n.dtype == torch.bfloat16
    assert torch.allclose(h_n.float().pow(2).mean(-1), torch.ones(2), rtol=2e-2)
    assert torch.allclose(h_n[0].float(), h_n[1].float(), rtol=2e-2, atol=2e-2)


def _host_rank(ctx):
    from afd_cupy.config import ModelConfig, TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.testing.reference import identity_experts

    model = ModelConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8,
                        num_shared_experts=0, dtype="bfloat16", max_num_batched_tokens=8, num_layers=2)
    role = "attention" if ctx.rank == 0 else "ffn"
    conn = AFDConnector(model, TopologyConfig(1, 1), role=role, role_rank=0, store=ctx.store(),
                        job_id=ctx.job_id, backend="host")
    try:
        if role == "ffn":
            return FFNWorker(conn, expert_fn=identity_experts).run()
        try:
            DecodeStepGraph(conn, _fns(2), _fns(2), num_tokens=4)
        except ConfigError as exc:
            return str(exc)
        finally:
            conn.announce_shutdown()
        return "no error"
    finally:
        conn.close()


@pytest.mark.timeout(120)
def test_a_real_host_connector_is_refused():
    from afd_cupy.runtime.launch import launch

    attn, served = launch(_host_rank, 2, timeout_s=100)
    assert "backend='host': its receive blocks on the host (supports_nonblocking=False)" in attn and served == 0


def _host_staged_rank(ctx):
    """1A1F on the host backend with two stages: the staged schedule (the capture checks
    patched away: the host backend cannot be captured, but it runs the same protocol) against
    the real connector and an FFNWorker with identity experts."""
    from unittest import mock

    from afd_cupy.attention import step_graph
    from afd_cupy.config import ModelConfig, TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.testing.reference import identity_experts

    model = ModelConfig(hidden_size=16, num_experts=4, top_k=2, moe_intermediate_size=8,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=16, num_layers=3)
    role = "attention" if ctx.rank == 0 else "ffn"
    conn = AFDConnector(model, TopologyConfig(1, 1),
                        ConnectorConfig(async_moe_ubatching=True, async_moe_num_ubatches=2),
                        role=role, role_rank=0, store=ctx.store(), job_id=ctx.job_id, backend="host")
    try:
        if role == "ffn":
            return FFNWorker(conn, expert_fn=identity_experts).run()
        try:
            stand_in = LinearStandIn(3, 16, 4, dtype=torch.bfloat16, device="cpu", seed=2, scale=0.5)
            steps = {}
            with mock.patch.object(step_graph, "check_capturable", lambda *args: None):
                for stages in (1, 2):
                    step = DecodeStepGraph.__new__(DecodeStepGraph)
                    step._setup(conn, stand_in.attention_fns(), stand_in.router_fns(), num_tokens=11,
                                stages=stages, e_score_correction_bias=None, keep_layer_tensors=False,
                                warmup=1)
                    steps[stages] = step
            x = torch.randn(11, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            staged = steps[2]._step(x, record=True)
            alone = torch.cat([steps[1].run_eager(x[a:b]) for a, b in steps[2].splits])
            unsplit = steps[1].run_eager(x)
            rel = float((staged.double() - unsplit.double()).norm() / unsplit.double().norm())
            return {"rings": sorted(steps[2].rings), "splits": steps[2].splits,
                    "bitwise_alone": bool(torch.equal(staged, alone)), "rel_unsplit": rel,
                    "pending": list(conn.pending_rings())}
        finally:
            conn.announce_shutdown()
    finally:
        conn.close()


@pytest.mark.timeout(120)
def test_two_stages_on_a_real_host_connector():
    """The real protocol serves the pipeline (each stage on its own ring, nothing left
    pending); each micro-batch's rows equal the one-stage step on those rows bit for bit,
    and the unsplit step's within bf16 rounding (its GEMMs see another batch size)."""
    from afd_cupy.runtime.launch import launch
    from afd_cupy.testing.scenario import tolerance

    attn, served = launch(_host_staged_rank, 2, timeout_s=100)
    assert attn["rings"] == [0, 1] and attn["splits"] == ((0, 6), (6, 11)) and attn["pending"] == []
    assert attn["bitwise_alone"], attn
    assert attn["rel_unsplit"] <= tolerance("bfloat16"), attn
    assert served == 3 * 2 + 3 * 2 + 3, served  # staged (3 layers x 2), alone (2 x 3), unsplit (3)
