"""A :class:`~afd_cupy.testing.scenario.Scenario` run whose FFN ranks serve through the
graph-driven FFN (:class:`~afd_cupy.backends.cuda_ffn_graph.GraphFFNServer`) instead of the
eager ``FFNWorker``; the Attention ranks and the reference checks are the scenario's own.
Used by ``tests/test_ffn_graph_cuda.py`` (cuda backend only)."""
from __future__ import annotations

import time

from afd_cupy import moe
from afd_cupy.config import TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.testing import scenario as sc
from afd_cupy.topology import Role, Topology


def run_graph_rank(ctx, scenario: sc.Scenario, bucket_tokens: tuple) -> dict:
    """Entry point of every process: Attention as ``scenario.run_rank``, FFN through graphs."""
    topo = Topology(scenario.num_attn, scenario.num_ffn, scenario.model.num_experts)
    role, role_rank = topo.role_of(ctx.rank)
    device = sc._device(scenario, ctx)
    conn = AFDConnector(scenario.model, TopologyConfig(scenario.num_attn, scenario.num_ffn),
                        scenario.connector, role=role, role_rank=role_rank, store=ctx.store(),
                        job_id=ctx.job_id, backend=scenario.backend, device_id=ctx.device_id,
                        poll_mode=scenario.poll_mode, peer_timeout_s=scenario.peer_timeout_s)
    try:
        if role is Role.ATTENTION:
            return sc._attention(conn, scenario, role_rank, device)
        return _graph_ffn(conn, scenario, role_rank, device, bucket_tokens)
    finally:
        conn.close()


def _graph_ffn(conn, scenario: sc.Scenario, ffn_rank: int, device, bucket_tokens) -> dict:
    from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer

    model = scenario.model
    epr = conn.topology.expert_per_rank
    routed, shared = [], []
    for layer in range(model.num_layers):
        global_routed, layer_shared = sc.layer_weights(model, layer, scenario.seed, device)
        routed.append(moe.local_experts(global_routed, ffn_rank, epr))
        shared.append(layer_shared)
    server = GraphFFNServer(conn, routed, shared if model.num_shared_experts else None,
                            bucket_tokens=bucket_tokens)
    start = time.perf_counter()
    served = server.run()
    return {"role": "ffn", "rank": ffn_rank, "served": served, "eager": server.num_eager,
            "replays": server.num_replays, "seconds": time.perf_counter() - start}
