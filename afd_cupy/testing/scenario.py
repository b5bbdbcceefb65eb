"""The reference end-to-end scenario: an AFD MoE run checked against a single-process MoE.

Shared by the tests and ``tools/smoke.py``. Every process of the world runs
:func:`run_rank` under :func:`afd_cupy.launch.launch`: Attention ranks gate random hidden
states, send, receive and compare each layer's output with
:func:`afd_cupy.testing.reference.reference_moe` computed from the same weights (a naive
per-token fp64 MoE); FFN ranks serve with an ``FFNWorker`` until every Attention rank
announced shutdown.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from afd_cupy import moe
from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.dtypes import torch_dtype
from afd_cupy.ffn_worker import FFNWorker
from afd_cupy.testing.reference import make_expert_weights, make_shared_weights, reference_moe
from afd_cupy.topology import Role, Topology


@dataclass(frozen=True)
class Scenario:
    """One run. ``tokens[a][layer]`` = tokens Attention rank a sends at that layer
    (default: ``num_tokens`` everywhere); ``sleep_s[a]`` = pause of rank a between layers,
    so replicas sit at different layers and the FFN serves them out of order."""

    model: ModelConfig
    num_attn: int
    num_ffn: int
    backend: str = "host"
    poll_mode: str = "device"
    num_tokens: int = 16
    tokens: tuple | None = None
    sleep_s: tuple | None = None
    seed: int = 0
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    peer_timeout_s: float = 60.0
    check: bool = True
    favor_ffn_rank: int | None = None  # gate logits pushed towards this FFN rank's experts
    always_send: bool = False  # Attention sends to every FFN rank even when empty (lockstep)
    schedule: str = "async"  # FFN worker schedule: "async" or "lockstep"
    ffn_overlap: bool = False  # FFNWorker(overlap=True): replies on a reply stream / thread
    graph_replays: int = 0  # cuda: > 0 captures each layer's send + recv in a CUDA graph and
    #                         replays every layer this many times with fresh inputs
    stage_streams: bool = False  # each layer as two in-flight stages (needs num_stages = 2): the
    #                              first half of the tokens stage 0, the rest stage 1 (cuda: on
    #                              a second stream, events only); combines with graph_replays

    @property
    def num_checks(self) -> int:
        """Reference comparisons each Attention rank reports."""
        return self.model.num_layers * max(1, self.graph_replays)

    def tokens_for(self, attn_rank: int, layer_idx: int) -> int:
        return self.tokens[attn_rank][layer_idx] if self.tokens else self.num_tokens

    @property
    def world_size(self) -> int:
        return self.num_attn + self.num_ffn


def layer_weights(model: ModelConfig, layer_idx: int, seed: int, device):
    """(global routed experts, fused shared experts or None) of one layer."""
    dtype = torch_dtype(model.dtype)
    base = seed * 1000 + layer_idx * 7
    routed = make_expert_weights(model.num_experts, model.hidden_size, model.moe_intermediate_size,
                                 dtype=dtype, device=device, seed=base)
    shared = make_shared_weights(model.num_shared_experts, model.hidden_size,
                                 model.moe_intermediate_size, dtype=dtype, device=device, seed=base + 1)
    return routed, shared


def _device(scenario: Scenario, ctx) -> torch.device:
    if scenario.backend == "host":
        return torch.device("cpu")
    torch.cuda.set_device(ctx.device_id or 0)
    return torch.device("cuda", ctx.device_id or 0)


def run_rank(ctx, scenario: Scenario) -> dict:
    """Entry point of every process (see module doc). Returns a per-rank report dict."""
    topo = Topology(scenario.num_attn, scenario.num_ffn, scenario.model.num_experts)
    role, role_rank = topo.role_of(ctx.rank)
    device = _device(scenario, ctx)
    conn = AFDConnector(scenario.model, TopologyConfig(scenario.num_attn, scenario.num_ffn),
                        scenario.connector, role=role, role_rank=role_rank, store=ctx.store(),
                        job_id=ctx.job_id, backend=scenario.backend, device_id=ctx.device_id,
                        poll_mode=scenario.poll_mode, peer_timeout_s=scenario.peer_timeout_s,
                        always_send=scenario.always_send or scenario.schedule == "lockstep")
    try:
        if role is Role.ATTENTION:
            report = _attention(conn, scenario, role_rank, device)
        else:
            report = _ffn(conn, scenario, role_rank, device)
        return {**report, "device_id": ctx.device_id}
    finally:
        conn.close()


def _ffn(conn: AFDConnector, scenario: Scenario, ffn_rank: int, device) -> dict:
    model = scenario.model
    epr = conn.topology.expert_per_rank
    routed, shared = [], []
    for layer in range(model.num_layers):
        global_routed, layer_shared = layer_weights(model, layer, scenario.seed, device)
        routed.append(moe.local_experts(global_routed, ffn_rank, epr))
        shared.append(layer_shared)
    kwargs = {} if scenario.schedule == "async" else {"schedule": scenario.schedule}
    if scenario.ffn_overlap:
        kwargs["overlap"] = True
    worker = FFNWorker(conn, routed, shared if model.num_shared_experts else None, **kwargs)
    history = []
    compute = worker.expert_fn

    stages = set()

    def recording(item):
        history.append((item.src_rank, item.layer_idx, item.routed_tokens, item.shared_tokens))
        stages.add(item.stage_idx)
        return compute(item)

    worker.expert_fn = recording
    start = time.perf_counter()
    served = worker.run()
    return {"role": "ffn", "rank": ffn_rank, "served": served, "history": history,
            "stages": sorted(stages), "seconds": time.perf_counter() - start}


def _attention(conn: AFDConnector, scenario: Scenario, attn_rank: int, device) -> dict:
    if scenario.stage_streams:
        return _attention_two_stages(conn, scenario, attn_rank, device)
    if scenario.graph_replays:
        return _attention_graphs(conn, scenario, attn_rank, device)
    model = scenario.model
    errors, times = [], []
    gen = torch.Generator().manual_seed(scenario.seed * 7919 + attn_rank)
    for layer in range(model.num_layers):
        hidden, weights, ids = _layer_inputs(conn, scenario, gen, scenario.tokens_for(attn_rank, layer), device)
        start = time.perf_counter()
        handle = conn.send_attn_output(hidden.to(device), ids, weights, layer)
        out = conn.recv_ffn_output(handle)
        times.append(time.perf_counter() - start)
        if scenario.check:
            errors.append(_compare(out, hidden, ids, weights, model, layer, scenario.seed))
        if scenario.sleep_s and scenario.sleep_s[attn_rank]:
            time.sleep(scenario.sleep_s[attn_rank])
    conn.announce_shutdown()
    return {"role": "attention", "rank": attn_rank, "errors": errors, "times": times}


def _layer_inputs(conn: AFDConnector, scenario: Scenario, gen, num_tokens: int, device):
    """Fresh (hidden [T, H] model dtype on the CPU, weights fp32 [T, K], ids int32 [T, K] on
    ``device``) from ``gen``; gate logits pushed towards ``favor_ffn_rank`` when set."""
    model = scenario.model
    hidden = torch.randn(num_tokens, model.hidden_size, generator=gen).to(torch_dtype(model.dtype))
    logits = torch.randn(num_tokens, model.num_experts, generator=gen)
    if scenario.favor_ffn_rank is not None:
        owned = conn.topology.owned_experts(scenario.favor_ffn_rank)
        logits[:, owned.start:owned.stop] += 50.0
    weights, ids = conn.select_experts(logits.to(device))
    return hidden, weights, ids


def _attention_graphs(conn: AFDConnector, scenario: Scenario, attn_rank: int, device) -> dict:
    """Each layer's ``send_attn_output`` + ``recv_ffn_output(blocking=False)`` captured once in
    a CUDA graph over static input tensors, then every layer replayed ``graph_replays`` times
    with fresh inputs copied in and its output NaN-filled first; each replay is compared with
    the reference (``check_errors()`` after each replay raises what the kernels latched)."""
    model = scenario.model
    gen = torch.Generator().manual_seed(scenario.seed * 7919 + attn_rank)

    def fresh_inputs():
        return _layer_inputs(conn, scenario, gen, scenario.num_tokens, device)

    hidden, weights, ids = fresh_inputs()  # valid ids for the capture (nothing runs during it)
    static_hidden, static_weights, static_ids = hidden.to(device), weights.clone(), ids.clone()
    # warm-up before capturing, as torch advises: one eager round trip of 0 tokens runs every
    # kernel once (lazy module loading, allocator) and sends nothing (empty messages never go)
    conn.recv_ffn_output(conn.send_attn_output(static_hidden[:0], static_ids[:0], static_weights[:0], 0))
    graphs, outs = [], []
    for layer in range(model.num_layers):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            handle = conn.send_attn_output(static_hidden, static_ids, static_weights, layer)
            outs.append(conn.recv_ffn_output(handle, blocking=False))
        graphs.append(graph)
    errors, times = [], []
    for _ in range(scenario.graph_replays):
        for layer in range(model.num_layers):
            hidden, weights, ids = fresh_inputs()
            static_hidden.copy_(hidden)
            static_weights.copy_(weights)
            static_ids.copy_(ids)
            outs[layer].fill_(float("nan"))
            start = time.perf_counter()
            graphs[layer].replay()
            conn.check_errors()  # synchronizes
            times.append(time.perf_counter() - start)
            if scenario.check:
                errors.append(_compare(outs[layer], hidden, ids, weights, model, layer, scenario.seed))
    conn.announce_shutdown()
    return {"role": "attention", "rank": attn_rank, "errors": errors, "times": times}


def _two_stage_layer(conn: AFDConnector, layer: int, hidden, ids, weights, side) -> list:
    """Send both halves (stage 0, then stage 1 on ``side`` when it is a stream), then receive
    both (``blocking=False``); the current stream joins ``side`` at the end (events only, no
    host synchronization: capturable). Returns the two outputs."""
    current = torch.cuda.current_stream(hidden.device) if side is not None else None
    split = hidden.shape[0] // 2
    halves = (slice(0, split), slice(split, None))
    streams = (current, side)
    if side is not None:
        side.wait_stream(current)  # the inputs were written on the current stream
    handles, outs = [], []
    for stage, rows in enumerate(halves):
        with _on(streams[stage]):
            handles.append(conn.send_attn_output(hidden[rows], ids[rows], weights[rows], layer, stage))
    for stage, handle in enumerate(handles):
        with _on(streams[stage]):
            outs.append(conn.recv_ffn_output(handle, blocking=False))
    if side is not None:
        current.wait_stream(side)
    return outs


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _attention_two_stages(conn: AFDConnector, scenario: Scenario, attn_rank: int, device) -> dict:
    """Every layer as two in-flight micro-batch stages (:func:`_two_stage_layer`), compared
    with the reference; with ``graph_replays`` each layer's two-stream step is captured once in
    a CUDA graph (the second stream forks from and joins the capture stream by events) and
    replayed with fresh inputs and NaN-filled outputs."""
    model = scenario.model
    gen = torch.Generator().manual_seed(scenario.seed * 7919 + attn_rank)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    errors, times = [], []

    def fresh():
        hidden, weights, ids = _layer_inputs(conn, scenario, gen, scenario.num_tokens, device)
        return hidden.to(device), weights, ids

    if not scenario.graph_replays:
        for layer in range(model.num_layers):
            hidden, weights, ids = fresh()
            start = time.perf_counter()
            outs = _two_stage_layer(conn, layer, hidden, ids, weights, side)
            conn.check_errors()
            times.append(time.perf_counter() - start)
            errors.append(_compare(torch.cat(outs), hidden.cpu(), ids, weights, model, layer, scenario.seed))
        conn.announce_shutdown()
        return {"role": "attention", "rank": attn_rank, "errors": errors, "times": times}
    static = fresh()
    _two_stage_layer(conn, 0, static[0], static[2], static[1], side)  # eager warm-up before capture
    conn.check_errors()
    graphs, outs = [], []
    for layer in range(model.num_layers):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(_two_stage_layer(conn, layer, static[0], static[2], static[1], side))
        graphs.append(graph)
    for _ in range(scenario.graph_replays):
        for layer in range(model.num_layers):
            hidden, weights, ids = fresh()
            for target, value in zip(static, (hidden, weights, ids)):
                target.copy_(value)
            for out in outs[layer]:
                out.fill_(float("nan"))
            start = time.perf_counter()
            graphs[layer].replay()
            conn.check_errors()
            times.append(time.perf_counter() - start)
            errors.append(_compare(torch.cat(outs[layer]), hidden.cpu(), ids, weights, model, layer,
                                   scenario.seed))
    conn.announce_shutdown()
    return {"role": "attention", "rank": attn_rank, "errors": errors, "times": times}


def _compare(out, hidden, ids, weights, model, layer, seed) -> dict:
    """Relative error of ``out`` against the fp64 per-token reference; NaN counts."""
    routed, shared = layer_weights(model, layer, seed, "cpu")
    ref = reference_moe(hidden, ids.cpu(), weights.cpu(), routed, shared, model.routed_scaling_factor)
    got = out.float().cpu()
    num_nan = int(torch.isnan(got).sum())
    denom = float(ref.norm()) or 1.0
    rel = float((got - ref).norm()) / denom if num_nan == 0 else float("inf")
    return {"layer": layer, "num_tokens": int(hidden.shape[0]), "rel_err": rel, "num_nan": num_nan,
            "shape_ok": tuple(got.shape) == tuple(ref.shape)}


def tolerance(dtype: str) -> float:
    """Relative-error bound against the fp64 reference per payload dtype."""
    return {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}[dtype]
