"""A :class:`~afd_cupy.testing.scenario.Scenario` run whose FFN ranks serve through the
graph-driven FFN (:class:`~afd_cupy.backends.cuda_ffn_graph.GraphFFNServer`) instead of the
eager ``FFNWorker``; the Attention ranks and the reference checks are the scenario's own.
:func:`run_graph_identity_rank`: 1A1F with identity experts in either wire mode (pair: with
FP8 dispatch rows too), optionally after a corrupt dedup route table. Used by
``tests/kernels/test_ffn_graph_cuda.py`` (cuda backend only)."""
from __future__ import annotations

import time

from afd_cupy import moe
from afd_cupy.config import TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.runtime.topology import Role, Topology
from afd_cupy.testing import scenario as sc
from afd_cupy.wire import fp8
from afd_cupy.wire.dtypes import f32_to_raw, raw_to_f32, torch_to_raw


def run_graph_rank(ctx, scenario: sc.Scenario, bucket_tokens: tuple, expert_gemm: str = "grouped_mm",
                   fp8_experts: bool = False) -> dict:
    """Entry point of every process: Attention as ``scenario.run_rank``, FFN through graphs
    (``GraphFFNServer(expert_gemm=...)``; ``fp8_experts``: the routed experts quantized as a
    block-scaled FP8 checkpoint, ``moe.FP8ExpertWeights``)."""
    topo = Topology(scenario.num_attn, scenario.num_ffn, scenario.model.num_experts)
    role, role_rank = topo.role_of(ctx.rank)
    device = sc.rank_device(scenario, ctx)
    conn = AFDConnector(scenario.model, TopologyConfig(scenario.num_attn, scenario.num_ffn),
                        scenario.connector, role=role, role_rank=role_rank, store=ctx.store(),
                        job_id=ctx.job_id, backend=scenario.backend, device_id=ctx.device_id,
                        poll_mode=scenario.poll_mode, peer_timeout_s=scenario.peer_timeout_s)
    try:
        if role is Role.ATTENTION:
            return sc.run_attention(conn, scenario, role_rank, device)
        return _graph_ffn(conn, scenario, role_rank, device, bucket_tokens, expert_gemm, fp8_experts)
    finally:
        conn.close()


def _graph_ffn(conn, scenario: sc.Scenario, ffn_rank: int, device, bucket_tokens, expert_gemm: str,
               fp8_experts: bool) -> dict:
    from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer

    model = scenario.model
    epr = conn.topology.expert_per_rank
    routed, shared = [], []
    for layer in range(model.num_layers):
        global_routed, layer_shared = sc.layer_weights(model, layer, scenario.seed, device)
        local = moe.local_experts(global_routed, ffn_rank, epr)
        routed.append(moe.FP8ExpertWeights.quantize(local, blockwise=True) if fp8_experts else local)
        shared.append(layer_shared)
    server = GraphFFNServer(conn, routed, shared if model.num_shared_experts else None,
                            bucket_tokens=bucket_tokens, gemm_sm_carveout=scenario.gemm_sm_carveout,
                            expert_gemm=expert_gemm)
    start = time.perf_counter()
    served = server.run()
    return {"role": "ffn", "rank": ffn_rank, "served": served, "eager": server.num_eager,
            "replays": server.num_replays, "gemm_sm_carveout": server.gemm_sm_carveout,
            "expert_gemm": server.expert_gemm, "seconds": time.perf_counter() - start}


def run_graph_identity_rank(ctx, model, wire_mode: str, tokens: tuple, corrupt_first: bool,
                            dispatch_dtype: str = "payload", bucket_tokens: tuple = (128,)) -> dict:
    """1A1F with identity experts on the graph FFN (no GEMMs): the Attention rank checks each
    layer's output against ``(sum_k w_k + [shared experts]) * x`` (what identity experts give in
    both wire modes). ``corrupt_first``: before any layer the Attention rank writes a dedup
    message whose route table names staging row 0 twice straight into the FFN's window; the
    graph's expand must reject it, the server raise the eager path's WireError (reported as
    ``error``) and then go on serving the real layers. ``dispatch_dtype="fp8_e4m3"``: x
    travels as FP8 wire rows; each error also gets ``rel_err_quantized``, against the same
    output computed from x quantized and dequantized by ``wire.fp8`` (the rows the FFN must
    have decoded), and ``calc_diff`` against the unquantized output. ``bucket_tokens``: the
    server's buckets (a layer of more tokens is served by its eager fallback)."""
    import torch

    from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer
    from afd_cupy.config import ConnectorConfig
    from afd_cupy.errors import WireError

    topo = Topology(1, 1, model.num_experts)
    role, role_rank = topo.role_of(ctx.rank)
    torch.cuda.set_device(ctx.device_id or 0)
    device = torch.device("cuda", ctx.device_id or 0)
    config = ConnectorConfig(wire_mode=wire_mode, dispatch_dtype=dispatch_dtype)
    conn = AFDConnector(model, TopologyConfig(1, 1), config, role=role,
                        role_rank=role_rank, store=ctx.store(), job_id=ctx.job_id, backend="cuda",
                        device_id=ctx.device_id, peer_timeout_s=60.0)
    try:
        if role is Role.FFN:
            server = GraphFFNServer(conn, identity=True, bucket_tokens=bucket_tokens)
            error = None
            if corrupt_first:
                try:
                    server.run()
                except WireError as err:  # the queued replays stay queued: run() goes on below
                    error = str(err)
                ctx.store().set("ffn-saw-the-table", b"1")
            served = server.run()
            return {"role": "ffn", "error": error, "served": served, "eager": server.num_eager,
                    "replays": server.num_replays}
        if corrupt_first:
            _write_bad_route_table(conn)
            ctx.store().get("ffn-saw-the-table")  # before the first real dispatch supersedes it
        gen = torch.Generator().manual_seed(1)
        errors = []
        for layer, num_tokens in enumerate(tokens):
            hidden = torch.randn(num_tokens, model.hidden_size, generator=gen).to(conn.torch_dtype)
            weights, ids = conn.select_experts(torch.randn(num_tokens, model.num_experts, generator=gen).to(device))
            out = conn.recv_ffn_output(conn.send_attn_output(hidden.to(device), ids, weights,
                                                             layer % model.num_layers))
            scale = weights.float().sum(dim=1, keepdim=True).cpu() + float(model.num_shared_experts > 0)
            want = scale * hidden.float()
            err = (out.float().cpu() - want).norm() / want.norm().clamp_min(1e-30)
            errors.append({"layer": layer, "tokens": num_tokens, "rel_err": float(err),
                           "num_nan": int(torch.isnan(out.float()).sum())})
            if dispatch_dtype != "payload":
                decoded = scale * _fp8_wire_round_trip(hidden, model.dtype)
                got = out.float().cpu()
                errors[-1].update(rel_err_quantized=float((got - decoded).norm() / decoded.norm().clamp_min(1e-30)),
                                  calc_diff=fp8.calc_diff(got.numpy(), want.numpy()))
        conn.announce_shutdown()
        return {"role": "attention", "errors": errors}
    finally:
        conn.close()


def _fp8_wire_round_trip(hidden, dtype: str):
    """fp32 [T, H]: ``hidden`` (payload dtype, CPU) as an FFN rank reads it from FP8 wire rows:
    quantized and dequantized by ``wire.fp8``, then rounded to the payload dtype."""
    import torch

    raw = torch_to_raw(hidden, dtype)
    decoded = fp8.dequantize_wire_rows(fp8.quantize_wire_rows(raw_to_f32(raw, dtype)), raw.shape[1])
    return torch.from_numpy(raw_to_f32(f32_to_raw(decoded, dtype), dtype))


def _write_bad_route_table(conn) -> None:
    """A dedup dispatch with seq 1 on (FFN rank 0, ring 0) whose two rows both name staging row 0,
    written into the FFN's window (flag last); the path's next dispatch there takes seq 2."""
    import cupy as cp
    import numpy as np

    from afd_cupy import wire

    layout, path, model = conn.layout, conn.path, conn.model
    table = np.zeros((2, layout.route_width), np.int32)
    table[:, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + model.top_k] = -1
    table[:, wire.ROUTE_SLOTS] = 0  # row 0 and row 1 both name staging row 0
    table[1, wire.ROUTE_TOKEN] = 1
    header = wire.dispatch_header(seq=1, src_rank=0, layer_idx=0, stage_idx=0, num_tokens=2,
                                  shared_tokens=0, top_k=model.top_k,
                                  expert_counts=(2,) + (0,) * (layout.expert_per_rank - 1),
                                  wire_mode="dedup", num_rows=2)
    path.seq_counters[0, 0] = 1
    path.window.write_message(path.ctx.peer_pe(Role.FFN, 0), 0, 0,
                              wire.encode_header(header, layout.expert_per_rank), 1,
                              {"route_table": table})
    cp.cuda.Device().synchronize()
