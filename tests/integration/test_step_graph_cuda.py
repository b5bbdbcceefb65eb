"""A whole decode step of 6 layers captured in one CUDA graph (afd_cupy.attention.step_graph), Attention
side, against the same step run eagerly and against the fp64 MoE reference, layer by layer.

The Attention rank builds a :class:`~afd_cupy.attention.step_graph.DecodeStepGraph` over a fixed bf16
linear stand-in (afd_cupy.testing.step_model), then three times: fresh inputs (the third
replay with fewer rows than captured: zero padding), the static output NaN-filled, replay,
``check_errors()``; the same inputs through ``run_eager``. FFN side: an eager ``FFNWorker``
with real small bf16 experts (1A1F, 1A2F), or ``GraphFFNServer(identity=True)`` (1A1F).

With ``stages=2`` (every rank's ConnectorConfig with two micro-batch stages) the step runs as
the two-stage software pipeline; besides the checks above (per layer on the stages' tensors
concatenated: routing is per token, so the split step matches the fp64 reference as the
unsplit one does), each micro-batch's eager rows must equal, bit for bit, a one-stage step
(``stages=1`` on the same connector) run eagerly on that micro-batch's rows alone: the same
kernels on the same rows and shapes (stage 1 on ring 1 instead of ring 0 changes only
addresses, every wire field is 256-B aligned), each FFN item served on its own (async
schedule). What is asserted within a tolerance rather than exactly: captured vs eager (the
same kernels, but a GEMM under capture may use another workspace; recorded as
``bitwise_eager``) and anything against the unsplit step or the reference (other batch
sizes, fp64).

With ``stage_streams=True`` (the ``-streams`` cases: two stages, each on its own stream, the
captured step two parallel branches) the same checks run, and besides: the same step on one
stream (``stages=2``, captured too, on the same connector) must give the same rows bit for bit,
eagerly and captured (the same kernels on the same rows; only the streams differ); and a
replay issued right after an eager step, with no synchronization between, must wait for the
eager step's last use of the rings on the stage streams (``order_graph_replay``): both repeat
their earlier outputs bit for bit. (Captured vs the one-stream eager step is recorded,
``bitwise_graph_one_stream_eager``, not asserted, for the reason above.)
Needs a GPU, CuPy and NVSHMEM (device polling: CUDA MPS on one GPU, as tools/gpu_suite.sh)."""
from __future__ import annotations

import pytest

from afd_cupy.config import ModelConfig
from afd_cupy.runtime.launch import launch
from afd_cupy.testing.scenario import tolerance

pytestmark = pytest.mark.cuda
NUM_LAYERS, NUM_TOKENS, REPLAYS = 6, 40, 3
ROWS = (NUM_TOKENS, NUM_TOKENS, 23)  # rows per replay: the last one zero-padded to NUM_TOKENS


def _model(routed_scaling_factor: float) -> ModelConfig:
    return ModelConfig(hidden_size=128, num_experts=8, top_k=2, moe_intermediate_size=64,
                       num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=64,
                       num_layers=NUM_LAYERS, routed_scaling_factor=routed_scaling_factor)


def _rel(got, want) -> float:
    """Relative L2 error of ``got`` against ``want`` (inf when ``got`` has a NaN)."""
    got, want = got.double().cpu(), want.double().cpu()
    if bool(got.isnan().any()):
        return float("inf")
    return float((got - want).norm()) / (float(want.norm()) or 1.0)


def _step_program(ctx, num_ffn: int, ffn: str, model: ModelConfig, stages: int = 1,
                  stage_streams: bool = False) -> dict:
    import torch

    from afd_cupy.config import ConnectorConfig, TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.runtime.topology import Topology

    torch.cuda.set_device(ctx.device_id or 0)
    device = torch.device("cuda", ctx.device_id or 0)
    role, role_rank = Topology(1, num_ffn, model.num_experts).role_of(ctx.rank)
    config = ConnectorConfig(async_moe_ubatching=stages > 1, async_moe_num_ubatches=max(stages, 2))
    conn = AFDConnector(model, TopologyConfig(1, num_ffn), config, role=role, role_rank=role_rank,
                        store=ctx.store(), job_id=ctx.job_id, backend="cuda", device_id=ctx.device_id,
                        poll_mode="device", peer_timeout_s=30.0)
    try:
        if role.value == "ffn":
            return _serve(conn, ffn, role_rank, device)
        try:
            return _attention(conn, ffn, device, stages, stage_streams)
        finally:
            conn.announce_shutdown()
    finally:
        conn.close()


def _serve(conn, ffn: str, ffn_rank: int, device) -> dict:
    from afd_cupy import moe
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.testing.scenario import layer_weights

    if ffn == "graph":
        from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer

        return {"role": "ffn", "served": GraphFFNServer(conn, identity=True).run()}
    epr, model = conn.topology.expert_per_rank, conn.model
    pairs = [layer_weights(model, layer, 0, device) for layer in range(model.num_layers)]
    worker = FFNWorker(conn, [moe.local_experts(r, ffn_rank, epr) for r, _ in pairs], [s for _, s in pairs],
                       serving="loop")  # "eager": the Python loop, not the default graph FFN
    return {"role": "ffn", "served": worker.run()}


def _expected_moe(trace, layer: int, model, ffn: str):
    """fp32 [T, H] on the CPU: the fp64 reference MoE of the layer's own inputs (or, with
    identity experts, (sum_k w_k) * h + h: one shared row per token, f = 1)."""
    from afd_cupy.testing.reference import reference_moe
    from afd_cupy.testing.scenario import layer_weights

    h, weights = trace.moe_input.float().cpu(), trace.topk_weights.float().cpu()
    if ffn == "graph":
        return h * (weights.sum(dim=1, keepdim=True) + 1.0)
    routed, shared = layer_weights(model, layer, 0, "cpu")
    return reference_moe(h, trace.topk_ids.cpu(), weights, routed, shared, model.routed_scaling_factor)


def _attention(conn, ffn: str, device, stages: int, stage_streams: bool = False) -> dict:
    import torch

    from afd_cupy.attention.step_graph import DecodeStepGraph
    from afd_cupy.testing.step_model import LinearStandIn

    model = conn.model
    stand_in = LinearStandIn(NUM_LAYERS, model.hidden_size, model.num_experts,
                             dtype=torch.bfloat16, device=device, seed=3)
    step = DecodeStepGraph(conn, stand_in.attention_fns(), stand_in.router_fns(),
                           num_tokens=NUM_TOKENS, stages=stages, keep_layer_tensors=True,
                           stage_streams=stage_streams)
    # each micro-batch alone: a one-stage step on the same connector (run eagerly only)
    alone = DecodeStepGraph(conn, stand_in.attention_fns(), stand_in.router_fns(),
                            num_tokens=max(b - a for a, b in step.splits)) if stages > 1 else None
    # with stage streams: the same step on one stream (captured too), the rows' baseline
    one_stream = DecodeStepGraph(conn, stand_in.attention_fns(), stand_in.router_fns(), num_tokens=NUM_TOKENS,
                                 stages=stages) if stage_streams else None
    gen = torch.Generator().manual_seed(11)
    replays = []
    for rows in ROWS:
        hidden = torch.randn(rows, model.hidden_size, generator=gen).to(torch.bfloat16).to(device)
        step.output.fill_(float("nan"))
        for stage_layers in step.stage_layers:
            for layer in stage_layers:
                layer.moe_output.fill_(float("nan"))
        out = step.replay(hidden)
        conn.check_errors()
        captured = out.clone()
        padded = step.input.clone()  # what the graph ran on: hidden, then zero rows
        report = {"rows": rows, "nan": int(captured.isnan().sum()), "shape": tuple(captured.shape),
                  "padding_zero": bool((padded[rows:] == 0).all()),
                  "layers": _check_layers(step, stand_in, padded, rows, conn, model, ffn)}
        staged = step.run_eager(padded)  # the same step, not captured, same inputs
        conn.check_errors()
        eager = staged[:rows]
        report["vs_eager"] = _rel(captured, eager)
        report["bitwise_eager"] = bool(torch.equal(captured, eager))
        if alone is not None:  # the eager staged rows vs each micro-batch run alone
            by_itself = torch.cat([alone.run_eager(padded[a:b]) for a, b in step.splits])
            conn.check_errors()
            report["bitwise_alone"] = bool(torch.equal(staged, by_itself))
            report["alone_max_diff"] = float((staged.float() - by_itself.float()).abs().max())
        if one_stream is not None:
            one_eager = one_stream.run_eager(padded)
            conn.check_errors()
            one_captured = one_stream.replay(hidden).clone()
            conn.check_errors()
            report["bitwise_one_stream_eager"] = bool(torch.equal(staged, one_eager))
            report["bitwise_one_stream_graph"] = bool(torch.equal(captured, one_captured))
            # recorded, not asserted: captured vs eager, as ``bitwise_eager`` above
            report["bitwise_graph_one_stream_eager"] = bool(torch.equal(captured, one_eager[:rows]))
            # back to back, nothing synchronizes between: the replay's sends must come after
            # the eager step's receives on the stage streams (same rings)
            again = step.run_eager(padded)
            replayed = step.replay(hidden)
            conn.check_errors()
            report["bitwise_back_to_back"] = bool(torch.equal(again, staged)) and bool(torch.equal(replayed, captured))
        replays.append(report)
    return {"role": "attention", "replays": replays, "rings": sorted(step.rings),
            "stage_streams": len(step.stage_streams),
            "splits": [list(split) for split in step.splits],
            "alone_rings": sorted(alone.rings) if alone is not None else None}


def _check_layers(step, stand_in, x, rows, conn, model, ffn) -> list:
    """Per layer, over all captured rows: the MoE input against the stand-in recomputed
    eagerly from the previous layer's captured output, the expert ids of the ``rows`` real
    tokens against the gate on the captured MoE input (padding rows tie), the combined reply
    against the reference, the residual add."""
    checks = []
    for layer, trace in enumerate(step.layers):
        residual, h = stand_in.attention(layer, x)
        _, ids = conn.select_experts(stand_in.router(layer, trace.moe_input))
        checks.append({"layer": layer,
                       "input": _rel(trace.moe_input, h),
                       "ids_mismatch": float((ids[:rows] != trace.topk_ids[:rows]).float().mean()),
                       "moe": _rel(trace.moe_output, _expected_moe(trace, layer, model, ffn)),
                       "residual": _rel(trace.output, residual.float() + trace.moe_output.float())})
        x = trace.output
    return checks


@pytest.mark.parametrize("num_ffn,ffn,scaling,stages,stage_streams", [
    pytest.param(1, "eager", 2.5, 1, False, id="1A1F-eager-experts"),
    pytest.param(2, "eager", 2.5, 1, False, id="1A2F-eager-experts"),
    pytest.param(1, "graph", 1.0, 1, False, id="1A1F-graph-ffn-identity"),
    pytest.param(1, "eager", 2.5, 2, False, id="1A1F-eager-experts-2stages"),
    pytest.param(2, "eager", 2.5, 2, False, id="1A2F-eager-experts-2stages"),
    pytest.param(1, "graph", 1.0, 2, False, id="1A1F-graph-ffn-identity-2stages"),
    pytest.param(1, "eager", 2.5, 2, True, id="1A1F-eager-experts-2stages-streams"),
    pytest.param(2, "eager", 2.5, 2, True, id="1A2F-eager-experts-2stages-streams"),
    pytest.param(1, "graph", 1.0, 2, True, id="1A1F-graph-ffn-identity-2stages-streams")])
def test_decode_step_captured_in_one_graph(num_ffn, ffn, scaling, stages, stage_streams):
    attn, *ffns = launch(_step_program, 1 + num_ffn, args=(num_ffn, ffn, _model(scaling), stages, stage_streams),
                         timeout_s=240)
    tol = tolerance("bfloat16")
    # one dispatch in flight per stage: micro-batch s on ring s, every layer
    assert attn["rings"] == list(range(stages)), attn["rings"]
    assert attn["stage_streams"] == (stages if stage_streams else 0), attn["stage_streams"]
    assert len(attn["replays"]) == REPLAYS
    for report in attn["replays"]:
        assert report["nan"] == 0 and report["shape"] == (report["rows"], 128), report
        assert report["padding_zero"], report
        assert report["vs_eager"] <= tol, report
        assert len(report["layers"]) == NUM_LAYERS
        for check in report["layers"]:
            assert check["ids_mismatch"] <= 0.05, (report["rows"], check)  # bf16 logit ties
            for key in ("input", "moe", "residual"):
                assert check[key] <= tol, (report["rows"], key, check)
        if stages > 1:  # exact: the same kernels on the same rows as the micro-batch alone
            assert report["bitwise_alone"], report
        if stage_streams:  # exact: the same kernels on the same rows, other streams
            assert report["bitwise_one_stream_eager"] and report["bitwise_one_stream_graph"], report
            assert report["bitwise_back_to_back"], report
    # every dispatch of every step was sent and served: the step's (1 warm-up + 3 replays +
    # 3 eager steps: L x S each) and, with stages, the one-stage step's (1 warm-up + per
    # replay one eager run per micro-batch: L each); with stage streams also the step's
    # back-to-back eager step and replay and the one-stream step's (1 warm-up + per replay
    # one eager step and one replay: L x S each)
    steps = 1 + 2 * REPLAYS
    if stage_streams:
        steps += 2 * REPLAYS + 1 + 2 * REPLAYS
    dispatches = steps * NUM_LAYERS * stages
    if stages > 1:
        assert attn["splits"] == [[0, 20], [20, 40]] and attn["alone_rings"] == [0], attn
        dispatches += (1 + REPLAYS * stages) * NUM_LAYERS
    served = [r["served"] for r in ffns]
    assert sum(served) >= dispatches and max(served) <= dispatches, served
    if num_ffn == 1:
        assert served == [dispatches]
