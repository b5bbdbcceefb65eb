"""The reference end-to-end scenario: an AFD MoE run checked against a single-process MoE.

Shared by the tests and ``tools/smoke.py``. Every process of the world runs
:func:`run_rank` under :func:`afd_cupy.runtime.launch.launch`: Attention ranks gate random hidden
states, send, receive and compare each layer's output with
:func:`afd_cupy.testing.reference.reference_moe` computed from the same weights (a naive
per-token fp64 MoE); FFN ranks serve with an ``FFNWorker`` until every Attention rank
announced shutdown.
"""
from __future__ import annotations

import contextlib
import time

import torch

from afd_cupy import moe
from afd_cupy.config import ModelConfig, TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.ffn.worker import FFNWorker
from afd_cupy.runtime.topology import Role, Topology
from afd_cupy.testing.phases import NO_PHASES
from afd_cupy.testing.reference import make_expert_weights, make_shared_weights, reference_moe
from afd_cupy.testing.scenario_spec import Scenario, tolerance
from afd_cupy.wire.dtypes import torch_dtype

__all__ = ("Scenario", "layer_weights", "run_rank", "tolerance")


def layer_weights(model: ModelConfig, layer_idx: int, seed: int, device):
    """(global routed experts, fused shared experts or None) of one layer."""
    dtype = torch_dtype(model.dtype)
    base = seed * 1000 + layer_idx * 7
    routed = make_expert_weights(model.num_experts, model.hidden_size, model.moe_intermediate_size,
                                 dtype=dtype, device=device, seed=base)
    shared = make_shared_weights(model.num_shared_experts, model.hidden_size,
                                 model.moe_intermediate_size, dtype=dtype, device=device, seed=base + 1)
    return routed, shared


def rank_device(scenario: Scenario, ctx) -> torch.device:
    """The torch device of this process's rank (the CPU for the host backend; else its GPU,
    made current)."""
    if scenario.backend == "host":
        return torch.device("cpu")
    torch.cuda.set_device(ctx.device_id or 0)
    return torch.device("cuda", ctx.device_id or 0)


def run_rank(ctx, scenario: Scenario, timer=NO_PHASES) -> dict:
    """Entry point of every process (see module doc). Returns a per-rank report dict.

    ``timer``: a :class:`~afd_cupy.testing.phases.PhaseTimer` that gets the start-up, run and
    shutdown phases of this rank (``tools/startup_profile.py``)."""
    topo = Topology(scenario.num_attn, scenario.num_ffn, scenario.model.num_experts)
    role, role_rank = topo.role_of(ctx.rank)
    device = rank_device(scenario, ctx)
    with timer.phase("connector init"):
        conn = _connector(ctx, scenario, role, role_rank)
    try:
        if role is Role.ATTENTION:
            report = run_attention(conn, scenario, role_rank, device, timer)
        else:
            report = _ffn(conn, scenario, role_rank, device, timer)
        return {**report, "device_id": ctx.device_id}
    finally:
        with timer.phase("shutdown"):
            conn.close()


def _connector(ctx, scenario: Scenario, role, role_rank: int) -> AFDConnector:
    mixed = _mixed_transport(scenario, role_rank) if scenario.mixed_transport else contextlib.nullcontext()
    with mixed:
        return AFDConnector(scenario.model, TopologyConfig(scenario.num_attn, scenario.num_ffn),
                            scenario.connector, role=role, role_rank=role_rank, store=ctx.store(),
                            job_id=ctx.job_id, backend=scenario.backend, device_id=ctx.device_id,
                            poll_mode=scenario.poll_mode, peer_timeout_s=scenario.peer_timeout_s,
                            always_send=scenario.always_send or scenario.schedule == "lockstep")


@contextlib.contextmanager
def _mixed_transport(scenario: Scenario, role_rank: int):
    """``Scenario.mixed_transport``: while the connector opens, ``transports.put.staged_peers``
    (which ``PutTransport.open`` asks once per rank) stages the peers p with ``role_rank + p``
    odd, whether they map or not; the rest of the start-up (the agreement on the staging, the
    kernels' per-peer choice) runs unchanged. Only in this rank's process."""
    from afd_cupy.transports import put

    if scenario.backend != "cuda" or scenario.connector.transport != "auto":
        raise ValueError(f"mixed_transport needs backend 'cuda' and transport 'auto', got "
                         f"{scenario.backend!r} and {scenario.connector.transport!r}")
    original = put.staged_peers

    def staged_peers(stages_mapped, mapped):
        return [bool((role_rank + peer) % 2) or staged
                for peer, staged in enumerate(original(stages_mapped, mapped))]

    put.staged_peers = staged_peers
    try:
        yield
    finally:
        put.staged_peers = original


def _ffn(conn: AFDConnector, scenario: Scenario, ffn_rank: int, device, timer=NO_PHASES) -> dict:
    model = scenario.model
    epr = conn.topology.expert_per_rank
    routed, shared = [], []
    with timer.phase("weights"):
        for layer in range(model.num_layers):
            global_routed, layer_shared = layer_weights(model, layer, scenario.seed, device)
            routed.append(moe.local_experts(global_routed, ffn_rank, epr))
            shared.append(layer_shared)
    kwargs = {} if scenario.schedule == "async" else {"schedule": scenario.schedule}
    if scenario.ffn_overlap:
        kwargs["overlap"] = True
    kwargs["gemm_sm_carveout"] = scenario.gemm_sm_carveout
    worker = FFNWorker(conn, routed, shared if model.num_shared_experts else None,
                       serving=scenario.ffn_serving, **kwargs)
    plan = worker.serving_plan()
    history = []
    compute = worker.expert_fn

    stages, carveouts = set(), set()

    def recording(item):
        history.append((item.src_rank, item.layer_idx, item.routed_tokens, item.shared_tokens))
        stages.add(item.stage_idx)
        carveouts.add(moe.current_sm_carveout())  # what the expert GEMMs are launched with
        return compute(item)

    if plan.mode == "loop":  # a custom expert_fn would keep the graph FFN from serving
        worker.expert_fn = recording
    start = time.perf_counter()
    with timer.phase("serve (until shutdown)"):
        served = worker.run()
    server = worker.graph_server if worker.served_by == "graph" else None
    return {"role": "ffn", "rank": ffn_rank, "served": served, "history": history,
            "serving": worker.served_by, "serving_reason": worker.serving_reason,
            "eager": None if server is None else server.num_eager,
            "stages": sorted(stages), "carveouts": sorted(carveouts, key=str),
            "gemm_sm_carveout": worker.gemm_sm_carveout,
            "seconds": time.perf_counter() - start}


def run_attention(conn: AFDConnector, scenario: Scenario, attn_rank: int, device,
                  timer=NO_PHASES) -> dict:
    """The Attention rank ``attn_rank``'s body of a scenario (plain, two-stage or graph
    replays, as ``scenario`` says) over the open ``conn``; returns its report dict."""
    if scenario.stage_streams:
        return _attention_two_stages(conn, scenario, attn_rank, device)
    if scenario.graph_replays:
        return _attention_graphs(conn, scenario, attn_rank, device)
    model = scenario.model
    errors, times = [], []
    gen = torch.Generator().manual_seed(scenario.seed * 7919 + attn_rank)
    for layer in range(model.num_layers):
        with timer.phase("inputs + gate"):
            hidden, weights, ids = _layer_inputs(conn, scenario, gen,
                                                 scenario.tokens_for(attn_rank, layer), device)
        with timer.phase("first round trip" if layer == 0 else "round trips"):
            start = time.perf_counter()
            handle = conn.send_attn_output(hidden.to(device), ids, weights, layer)
            out = conn.recv_ffn_output(handle)
            times.append(time.perf_counter() - start)
        if scenario.check:
            with timer.phase("reference check"):
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
