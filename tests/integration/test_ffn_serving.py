"""``FFNWorker(serving=...)``: which way ``run()`` serves (afd_cupy/ffn/serving.py).

On the CPU: the option's validation, every reason of the applicability check against fake
cuda connectors (no device access is reached before the reason), the memory and timeout
rules, ``run()`` through a stand-in graph server (items counted, failure announced after the
server closed, a refused server falls back to the loop; FP8 experts are looped, logged with
their reason, and the reply is their FP8 compute), and the host backend end to end: the
loop serves, the log says once why, ``serving="graph"`` fails the Attention side with the
reason. On the GPU (``cuda``): the default ``FFNWorker`` serves 1A1F through the graph FFN,
with identity experts and with bf16 experts checked against the MoE reference."""
from __future__ import annotations

import dataclasses
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from afd_cupy import moe
from afd_cupy.backends.base import Capabilities
from afd_cupy.backends.cuda_ffn_graph_capture import stack_weights
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.errors import ConfigError, ConnectorShutdown, PeerFailedError, WireError
from afd_cupy.ffn import serving as ffn_serving
from afd_cupy.ffn.serving import graph_ffn_applies, plan_serving
from afd_cupy.ffn.worker import FFNWorker
from afd_cupy.runtime.launch import launch
from afd_cupy.runtime.topology import Role, Topology
from afd_cupy.testing.reference import identity_experts, make_expert_weights, make_shared_weights
from afd_cupy.testing.scenario_spec import Scenario, run_scenario_rank, tolerance

HIDDEN, INTER, EPR, LAYERS = 16, 8, 2, 3


def _fake_connector(*, backend="cuda", dtype=torch.bfloat16, host_polling=None, peer_is_put=(False,),
                    script=("shutdown",), dispatch_dtype="payload"):
    """An FFN-side connector as the worker and the check see it; receives follow ``script``."""
    script = list(script)
    replies, announced = [], []

    def recv(timeout_ms=None):
        nxt = script.pop(0) if script else "shutdown"
        if nxt == "shutdown":
            raise ConnectorShutdown("scripted")
        return nxt

    model = SimpleNamespace(num_layers=LAYERS, hidden_size=HIDDEN, moe_intermediate_size=INTER,
                            num_shared_experts=1, routed_scaling_factor=1.0)
    return SimpleNamespace(
        backend=backend, role_rank=0, model=model, topology=SimpleNamespace(num_attn_ranks=1),
        layout=SimpleNamespace(expert_per_rank=EPR, is_fp8_dispatch=dispatch_dtype == "fp8_e4m3"),
        config=SimpleNamespace(dispatch_dtype=dispatch_dtype), torch_dtype=dtype, device=torch.device("cpu"),
        capabilities=None if backend is None else Capabilities(  # as the backend's path declares them
            backend=backend, wire_modes=("pair",),
            supports_nonblocking=backend == "cuda", device_polling=backend == "cuda" and host_polling is None,
            put_peers=tuple(rank for rank, is_put in enumerate(peer_is_put) if is_put)),
        recv_ffn_work_item=recv, send_ffn_work_item_output=lambda *a: replies.append(a),
        announce_failure=announced.append, replies=replies, announced=announced)


def _experts(dtype=torch.bfloat16, **changes):
    weights = make_expert_weights(EPR, HIDDEN, INTER, dtype=dtype, device="cpu", seed=1)
    return dataclasses.replace(weights, **changes)


def _shared(dtype=torch.bfloat16, **changes):
    weights = make_shared_weights(1, HIDDEN, INTER, dtype=dtype, device="cpu", seed=2)
    return dataclasses.replace(weights, **changes)


def _fp8_experts():
    return moe.FP8ExpertWeights.quantize(_experts(dtype=torch.float32))


def _worker(conn=None, **kwargs):
    conn = conn or _fake_connector()
    if "expert_fn" not in kwargs:
        kwargs.setdefault("experts", _experts(conn.torch_dtype))
        kwargs.setdefault("shared", _shared(conn.torch_dtype))
    experts, shared = kwargs.pop("experts", None), kwargs.pop("shared", None)
    return FFNWorker(conn, experts, shared, **kwargs)


# --- the option -------------------------------------------------------------------------------
@pytest.mark.parametrize("serving", ["fast", "", None, "Graph"])
def test_serving_option_is_validated_at_construction(serving):
    with pytest.raises(ConfigError, match=r"serving must be one of \('auto', 'graph', 'loop'\), got"):
        _worker(expert_fn=identity_experts, serving=serving)


def test_default_serving_is_auto():
    assert _worker(expert_fn=identity_experts).serving == "auto"


# --- the applicability check ------------------------------------------------------------------
def _bias():
    return torch.zeros(EPR, 2 * INTER, dtype=torch.bfloat16)


REASONS = [  # (id, worker factory, a fragment of the reason)
    ("host", lambda: _worker(_fake_connector(backend="host")), "the host backend has no CUDA graphs"),
    ("no-backend", lambda: _worker(_fake_connector(backend=None)), "backend None is not 'cuda'"),
    ("lockstep", lambda: _worker(schedule="lockstep"), "schedule='lockstep'"),
    ("recorder", lambda: _worker(recorder=SimpleNamespace()), "a recorder is set"),
    ("overlap", lambda: _worker(overlap=True), "overlap=True"),
    ("custom", lambda: _worker(expert_fn=lambda item: (item.routed_x, None)), "a custom expert_fn"),
    ("host-poll", lambda: _worker(_fake_connector(host_polling=object())), "poll_mode='host'"),
    ("put", lambda: _worker(_fake_connector(peer_is_put=(False, True, True))),
     r"Attention rank(s) [1, 2] are reached by NVSHMEM puts"),
    ("fp8-dispatch", lambda: _worker(_fake_connector(dispatch_dtype="fp8_e4m3")),
     "dispatch_dtype='fp8_e4m3' (FP8 rows: the graph FFN decodes them when built directly"),
    ("fp16", lambda: _worker(_fake_connector(dtype=torch.float16)), "experts in torch.float16"),
    ("bias", lambda: _worker(experts=_experts(w13_bias=_bias())), "expert biases"),
    ("gate", lambda: _worker(shared=_shared(gate=torch.ones(1, HIDDEN, dtype=torch.bfloat16))),
     "a shared-expert gate"),
    ("activations", lambda: _worker(experts=[_experts(), _experts(activation="gelu"), _experts()]),
     "routed experts with different activations per layer"),
    ("cpu-device", lambda: _worker(), "torch._grouped_mm does not take these experts on cpu"),
    ("fp8", lambda: _worker(experts=[_experts(), _fp8_experts(), _experts()]),
     "FP8 experts (moe.FP8ExpertWeights: the graph FFN runs them with its streamed GEMMs when built directly"),
]


@pytest.mark.parametrize("make, fragment", [r[1:] for r in REASONS], ids=[r[0] for r in REASONS])
def test_check_names_why_the_graph_ffn_does_not_apply(make, fragment):
    worker = make()
    is_ok, reason = graph_ffn_applies(worker)
    assert not is_ok and fragment in reason, reason
    assert plan_serving(worker) == ffn_serving.ServingPlan("loop", reason)
    worker.serving = "graph"
    with pytest.raises(ConfigError, match=r"serving='graph'\): the graph FFN cannot serve here: "):
        plan_serving(worker)


def test_fp8_experts_pass_the_weight_check_and_the_graph_refuses_them():
    conn = _fake_connector()
    wrong = dataclasses.replace(_fp8_experts(), num_experts=EPR + 1, w13=torch.zeros(EPR + 1, 2 * INTER, HIDDEN,
                                dtype=torch.float8_e4m3fn), w13_scale=torch.ones(EPR + 1, 2 * INTER),
                                w2=torch.zeros(EPR + 1, HIDDEN, INTER, dtype=torch.float8_e4m3fn),
                                w2_scale=torch.ones(EPR + 1, HIDDEN))
    with pytest.raises(ConfigError, match=r"routed experts are \(num_experts, hidden, intermediate, dtype\) = "
                                          r"\(3, 16, 8, torch.bfloat16\)"):
        _worker(conn, experts=wrong)
    with pytest.raises(ConfigError, match="shared experts must be a moe.ExpertWeights, got FP8ExpertWeights"):
        _worker(conn, experts=_fp8_experts(), shared=moe.FP8ExpertWeights.quantize(_shared(torch.float32)))
    worker = _worker(conn, experts=_fp8_experts())  # the payload dtype (bf16) is the rows'
    assert worker.serving_plan().mode == "loop"
    with pytest.raises(ConfigError, match=r"runs FP8 experts \(moe.FP8ExpertWeights\) only with "
                                          r"GraphFFNServer\(expert_gemm='stream'\)"):
        stack_weights(worker.experts, worker.shared, LAYERS, EPR, "cpu")


def test_fp8_experts_stack_for_the_streamed_graph_gemms():
    """stack_weights(..., expert_gemm="stream") stacks FP8 routed experts with their scales (the
    eager fallback's per-layer views are FP8 too) and bf16 shared ones; FP8 mixed with bf16
    layers is refused."""
    layers = [_fp8_experts() for _ in range(LAYERS)]
    shared = [_shared() for _ in range(LAYERS)]
    stacked, views, shared_views = stack_weights(layers, shared, LAYERS, EPR, "cpu", "stream")
    assert stacked.w13.dtype == torch.float8_e4m3fn and stacked.w13.shape == (LAYERS * EPR, 2 * INTER, HIDDEN)
    assert stacked.w13_scale.shape == (LAYERS * EPR, 2 * INTER) and stacked.w2_scale.shape == (LAYERS * EPR, HIDDEN)
    for layer, view in enumerate(views):
        assert isinstance(view, moe.FP8ExpertWeights) and view.num_experts == EPR
        assert torch.equal(view.w13.float(), layers[layer].w13.float())
        assert torch.equal(view.w2_scale, layers[layer].w2_scale)
        assert view.w13.data_ptr() == stacked.w13[layer * EPR].data_ptr()  # a view, not a copy
    chunk = stacked.routed(slice(EPR, 3 * EPR))
    assert isinstance(chunk, moe.FP8ExpertWeights) and chunk.num_experts == 2 * EPR
    assert torch.equal(chunk.w13_scale, torch.cat([layers[1].w13_scale, layers[2].w13_scale]))
    assert stacked.shared().num_experts == LAYERS and torch.equal(shared_views[2].w2, shared[2].w2)
    bf16_stacked, _, _ = stack_weights([_experts()] * LAYERS, shared, LAYERS, EPR, "cpu", "stream")
    assert bf16_stacked.w13_scale is None and isinstance(bf16_stacked.routed(slice(0, EPR)), moe.ExpertWeights)
    with pytest.raises(ConfigError, match="every layer FP8"):
        stack_weights([_fp8_experts(), _experts(), _fp8_experts()], shared, LAYERS, EPR, "cpu", "stream")


def test_identity_experts_on_a_cuda_connector_apply_and_loop_opts_out():
    worker = _worker(expert_fn=identity_experts)
    assert graph_ffn_applies(worker) == (True, "")
    assert plan_serving(worker) == ffn_serving.ServingPlan("graph")
    worker.serving = "loop"
    assert plan_serving(worker) == ffn_serving.ServingPlan("loop", "serving='loop'")


def test_a_reassigned_expert_fn_is_seen_at_run_time():
    worker = _worker(expert_fn=identity_experts)
    worker.expert_fn = lambda item: identity_experts(item)  # e.g. a recording wrapper
    assert "a custom expert_fn" in graph_ffn_applies(worker)[1]


def test_stacked_bytes_and_the_memory_rule():
    routed = [_experts() for _ in range(LAYERS)]
    shared = [_shared() for _ in range(LAYERS)]
    per_layer = 2 * (EPR * 2 * INTER * HIDDEN + EPR * HIDDEN * INTER) + 2 * 3 * INTER * HIDDEN
    stacked = ffn_serving.stacked_expert_bytes(routed, shared)
    assert stacked == LAYERS * per_layer
    assert ffn_serving.stack_memory_rule(stacked, stacked * 2, "cuda:0") == ""
    reason = ffn_serving.stack_memory_rule(stacked, stacked, "cuda:0")
    assert "stacking the experts for the graphs needs" in reason and "free on cuda:0" in reason


def test_graph_wait_bound_follows_timeout_ms():
    assert ffn_serving.graph_idle_timeout_s(None) == ffn_serving.GRAPH_IDLE_TIMEOUT_S
    assert ffn_serving.graph_idle_timeout_s(4) == pytest.approx(0.004)
    assert ffn_serving.graph_idle_timeout_s(5000) == ffn_serving.GRAPH_IDLE_TIMEOUT_S
    with pytest.raises(ConfigError, match="timeout_ms must be a finite number"):
        ffn_serving.graph_idle_timeout_s(0)


# --- run() through a stand-in server ----------------------------------------------------------
class _Server:
    """GraphFFNServer's public face: ``run`` serves ``items`` then raises ``error`` (if any)."""

    def __init__(self, items=3, error=None):
        self.items, self.error, self.idle_timeout_s = items, error, None
        self.identity, self.buckets, self.depth = True, (object(),), 4
        self.num_served, self.closed, self.stops = 0, 0, []

    def run(self, stop_event=None):
        self.stops.append(stop_event)
        self.num_served += self.items
        if self.error is not None:
            raise self.error
        self.closed += 1
        return self.num_served

    def close(self):
        self.closed += 1


def _patch_server(monkeypatch, *servers):
    built = list(servers)
    calls = []

    def open_server(worker, idle_timeout_s, previous=None):
        calls.append((idle_timeout_s, previous))
        if previous is not None and previous.idle_timeout_s == idle_timeout_s:
            return previous
        server = built.pop(0)
        if isinstance(server, Exception):
            raise server
        server.idle_timeout_s = idle_timeout_s  # what the real server is built with
        return server

    monkeypatch.setattr(ffn_serving, "open_graph_server", open_server)
    return calls


def test_run_serves_through_the_graph_and_counts_its_items(monkeypatch, caplog):
    server = _Server(items=3)
    calls = _patch_server(monkeypatch, server)
    worker = _worker(expert_fn=identity_experts)
    stop = threading.Event()
    with caplog.at_level(logging.INFO, logger="afd_cupy"):
        assert worker.run(stop, timeout_ms=5) == 3
        assert worker.run(stop, timeout_ms=5) == 6  # the same server again, counts add up
    assert worker.served_by == "graph" and worker.graph_server is server and worker.serving_reason == ""
    assert server.stops == [stop, stop] and calls == [(0.005, None), (0.005, server)]
    assert worker.num_batches == 6 and worker.connector.replies == []  # nothing through the loop
    assert sum("serving with the graph FFN" in r.getMessage() for r in caplog.records) == 2


def test_a_failing_graph_run_closes_the_server_then_announces(monkeypatch):
    error = WireError("bad route table")
    server = _Server(items=2, error=error)
    _patch_server(monkeypatch, server)
    worker = _worker(expert_fn=identity_experts)
    with pytest.raises(WireError, match="bad route table"):
        worker.run()
    assert server.closed == 1 and worker.connector.announced == [error]
    assert worker.num_served == 2  # what it served before the error


def test_a_refused_server_falls_back_to_the_loop_and_says_why(monkeypatch, caplog):
    _patch_server(monkeypatch, ConfigError("depth must be >= 1"))
    item = SimpleNamespace(routed_x=torch.ones(1, HIDDEN), shared_x=None, layer_idx=0)
    worker = _worker(_fake_connector(script=[item, "shutdown"]), expert_fn=identity_experts)
    with caplog.at_level(logging.INFO, logger="afd_cupy"):
        assert worker.run() == 1
    assert worker.served_by == "loop" and len(worker.connector.replies) == 1
    lines = [r for r in caplog.records if "graph FFN not used" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert lines[0].getMessage() == ("afd_cupy ffn rank 0: graph FFN not used: GraphFFNServer refused: "
                                     "depth must be >= 1; serving with the Python loop")


def test_fp8_experts_are_served_by_the_loop_which_says_why(caplog):
    """auto on a cuda connector: the log names the FP8 experts; the loop's reply is the FP8
    compute of the item's rows (not a bf16 one)."""
    experts = _fp8_experts()
    counts = [3, 2]
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    item = SimpleNamespace(routed_x=x, group_counts=torch.tensor(counts), group_counts_host=counts,
                           shared_x=None, layer_idx=1)
    worker = _worker(_fake_connector(script=[item, "shutdown"]), experts=experts)
    with caplog.at_level(logging.INFO, logger="afd_cupy"):
        assert worker.run() == 1
    assert worker.served_by == "loop" and "FP8 experts" in worker.serving_reason
    [line] = [r for r in caplog.records if "graph FFN not used" in r.getMessage()]
    assert line.levelno == logging.WARNING and "FP8 experts (moe.FP8ExpertWeights" in line.getMessage()
    [(_, routed, shared)] = worker.connector.replies
    want = moe.grouped_mlp(x, torch.tensor(counts), experts)
    bf16 = moe.grouped_mlp(x, torch.tensor(counts), experts.dequantize(torch.bfloat16))
    assert shared is None and torch.equal(routed, want) and not torch.equal(routed, bf16)


def test_serving_graph_raises_a_refusal_and_announces_it(monkeypatch):
    refusal = ConfigError("depth must be >= 1")
    _patch_server(monkeypatch, refusal)
    worker = _worker(expert_fn=identity_experts, serving="graph")
    with pytest.raises(ConfigError, match="depth must be >= 1"):
        worker.run()
    assert worker.connector.announced == [refusal] and worker.connector.replies == []


# --- the host backend, end to end -------------------------------------------------------------
MODEL = ModelConfig(hidden_size=32, num_experts=4, top_k=2, moe_intermediate_size=16,
                    num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=16, num_layers=2)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _identity_program(ctx, backend, serving):
    """1A1F, identity experts: the FFN rank runs ``FFNWorker(serving=serving).run()`` and
    reports its "graph FFN" log lines; the Attention rank checks each layer (or the failure)."""
    role, role_rank = Topology(1, 1, MODEL.num_experts).role_of(ctx.rank)
    if backend == "cuda":
        torch.cuda.set_device(ctx.device_id or 0)
    conn = AFDConnector(MODEL, TopologyConfig(1, 1), role=role, role_rank=role_rank, store=ctx.store(),
                        job_id=ctx.job_id, backend=backend, device_id=ctx.device_id, peer_timeout_s=20.0)
    try:
        if role is Role.FFN:
            lines = _Lines()
            logging.getLogger("afd_cupy").addHandler(lines)
            logging.getLogger("afd_cupy").setLevel(logging.INFO)
            worker = FFNWorker(conn, expert_fn=identity_experts, serving=serving)
            try:
                served, error = worker.run(), None
            except ConfigError as exc:
                served, error = None, str(exc)
            server = worker.graph_server
            # a later run() serves with the same server (same wait bound and expert mode)
            reused = None if server is None else \
                ffn_serving.open_graph_server(worker, server.idle_timeout_s, server) is server
            return {"served": served, "error": error, "served_by": worker.served_by, "reused": reused,
                    "replays": None if server is None else server.num_replays,
                    "lines": [line for line in lines.lines if "graph FFN" in line[1]]}
        gen = torch.Generator().manual_seed(3)
        errors = []
        for layer in range(MODEL.num_layers):
            hidden = torch.randn(5, MODEL.hidden_size, generator=gen).to(torch.bfloat16)
            logits = torch.randn(5, MODEL.num_experts, generator=gen)
            weights, ids = conn.select_experts(logits.to(conn.device))
            try:
                out = conn.recv_ffn_output(conn.send_attn_output(hidden.to(conn.device), ids, weights, layer))
            except PeerFailedError as exc:
                errors.append(("PeerFailedError", exc.error_type, exc.error_message))
                break
            want = hidden.float() * (weights.float().cpu().sum(dim=1, keepdim=True) + 1.0)
            errors.append(float((out.float().cpu() - want).abs().max() / want.abs().max()))
        conn.announce_shutdown()
        return {"errors": errors}
    finally:
        conn.close()


def test_host_backend_loops_and_logs_why_once():
    attn, ffn = launch(_identity_program, 2, args=("host", "auto"), timeout_s=120)
    assert ffn["served"] == MODEL.num_layers and ffn["served_by"] == "loop", ffn
    assert ffn["lines"] == [("INFO", "afd_cupy ffn rank 0: graph FFN not used: the host backend has no "
                                     "CUDA graphs (its receive and reply are host code); serving with "
                                     "the Python loop")]
    assert len(attn["errors"]) == MODEL.num_layers and max(attn["errors"]) < 0.02, attn


def test_host_backend_serving_graph_fails_the_attention_side_with_the_reason():
    attn, ffn = launch(_identity_program, 2, args=("host", "graph"), timeout_s=120)
    assert ffn["served"] is None and "the host backend has no CUDA graphs" in ffn["error"], ffn
    [(kind, error_type, message)] = attn["errors"]
    assert (kind, error_type) == ("PeerFailedError", "ConfigError") and "serving='graph'" in message


# --- cuda: the default serving is the graph FFN -------------------------------------------------
@pytest.mark.cuda
def test_cuda_default_worker_serves_identity_experts_through_the_graph():
    attn, ffn = launch(_identity_program, 2, args=("cuda", "auto"), timeout_s=240)
    assert ffn["served"] == MODEL.num_layers and ffn["served_by"] == "graph" and ffn["replays"] > 0, ffn
    assert ffn["reused"] is True, ffn
    assert [level for level, _ in ffn["lines"]] == ["INFO"] and "serving with the graph FFN" in ffn["lines"][0][1]
    assert len(attn["errors"]) == MODEL.num_layers and max(attn["errors"]) < 0.02, attn


@pytest.mark.cuda
@pytest.mark.parametrize("wire_mode", ["pair", "dedup"])
def test_cuda_default_worker_serves_the_scenario_through_the_graph(wire_mode):
    scenario = Scenario(MODEL, 1, 1, backend="cuda", num_tokens=12, ffn_serving="auto",
                        connector=ConnectorConfig(wire_mode=wire_mode))
    attn, ffn = launch(run_scenario_rank, 2, args=(scenario,), timeout_s=240)
    assert ffn["serving"] == "graph" and ffn["serving_reason"] == "", ffn
    assert ffn["served"] == MODEL.num_layers and ffn["eager"] == 0, ffn
    assert max(e["rel_err"] for e in attn["errors"]) <= tolerance(MODEL.dtype), attn
