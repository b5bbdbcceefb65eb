"""A whole decode step of 6 layers captured in one CUDA graph (afd_cupy.step_graph), Attention
side, against the same step run eagerly and against the fp64 MoE reference, layer by layer.

The Attention rank builds a :class:`~afd_cupy.step_graph.DecodeStepGraph` over a fixed bf16
linear stand-in (afd_cupy.testing.step_model), then three times: fresh inputs (the third
replay with fewer rows than captured: zero padding), the static output NaN-filled, replay,
``check_errors()``; the same inputs through ``run_eager``. FFN side: an eager ``FFNWorker``
with real small bf16 experts (1A1F, 1A2F), or ``GraphFFNServer(identity=True)`` (1A1F).
Needs a GPU, CuPy and NVSHMEM (device polling: CUDA MPS on one GPU, as tools/gpu_suite.sh)."""
from __future__ import annotations

import pytest

from afd_cupy.config import ModelConfig
from afd_cupy.launch import launch
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


def _step_program(ctx, num_ffn: int, ffn: str, model: ModelConfig) -> dict:
    import torch

    from afd_cupy.config import TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.topology import Topology

    torch.cuda.set_device(ctx.device_id or 0)
    device = torch.device("cuda", ctx.device_id or 0)
    role, role_rank = Topology(1, num_ffn, model.num_experts).role_of(ctx.rank)
    conn = AFDConnector(model, TopologyConfig(1, num_ffn), role=role, role_rank=role_rank,
                        store=ctx.store(), job_id=ctx.job_id, backend="cuda", device_id=ctx.device_id,
                        poll_mode="device", peer_timeout_s=30.0)
    try:
        if role.value == "ffn":
            return _serve(conn, ffn, role_rank, device)
        try:
            return _attention(conn, ffn, device)
        finally:
            conn.announce_shutdown()
    finally:
        conn.close()


def _serve(conn, ffn: str, ffn_rank: int, device) -> dict:
    from afd_cupy import moe
    from afd_cupy.ffn_worker import FFNWorker
    from afd_cupy.testing.scenario import layer_weights

    if ffn == "graph":
        from afd_cupy.backends.cuda_ffn_graph import GraphFFNServer

        return {"role": "ffn", "served": GraphFFNServer(conn, identity=True).run()}
    epr, model = conn.topology.expert_per_rank, conn.model
    pairs = [layer_weights(model, layer, 0, device) for layer in range(model.num_layers)]
    worker = FFNWorker(conn, [moe.local_experts(r, ffn_rank, epr) for r, _ in pairs], [s for _, s in pairs])
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


def _attention(conn, ffn: str, device) -> dict:
    import torch

    from afd_cupy.step_graph import DecodeStepGraph
    from afd_cupy.testing.step_model import LinearStandIn

    model = conn.model
    stand_in = LinearStandIn(NUM_LAYERS, model.hidden_size, model.num_experts,
                             dtype=torch.bfloat16, device=device, seed=3)
    step = DecodeStepGraph(conn, stand_in.attention_fns(), stand_in.router_fns(),
                           num_tokens=NUM_TOKENS, keep_layer_tensors=True)
    gen = torch.Generator().manual_seed(11)
    replays = []
    for rows in ROWS:
        hidden = torch.randn(rows, model.hidden_size, generator=gen).to(torch.bfloat16).to(device)
        step.output.fill_(float("nan"))
        for layer in step.layers:
            layer.moe_output.fill_(float("nan"))
        out = step.replay(hidden)
        conn.check_errors()
        captured = out.clone()
        padded = step.input.clone()  # what the graph ran on: hidden, then zero rows
        report = {"rows": rows, "nan": int(captured.isnan().sum()), "shape": tuple(captured.shape),
                  "padding_zero": bool((padded[rows:] == 0).all()),
                  "layers": _check_layers(step, stand_in, padded, rows, conn, model, ffn)}
        eager = step.run_eager(padded)[:rows]  # the same step, not captured, same inputs
        conn.check_errors()
        report["vs_eager"] = _rel(captured, eager)
        report["bitwise_eager"] = bool(torch.equal(captured, eager))
        replays.append(report)
    return {"role": "attention", "replays": replays, "rings": sorted(step.rings)}


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


@pytest.mark.parametrize("num_ffn,ffn,scaling", [
    pytest.param(1, "eager", 2.5, id="1A1F-eager-experts"),
    pytest.param(2, "eager", 2.5, id="1A2F-eager-experts"),
    pytest.param(1, "graph", 1.0, id="1A1F-graph-ffn-identity")])
def test_decode_step_captured_in_one_graph(num_ffn, ffn, scaling):
    attn, *ffns = launch(_step_program, 1 + num_ffn, args=(num_ffn, ffn, _model(scaling)), timeout_s=240)
    tol = tolerance("bfloat16")
    assert attn["rings"] == [0], attn["rings"]  # one dispatch in flight: every layer on ring 0
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
    # every layer of every step was sent (1 warm-up + 3 replays + 3 eager steps) and served
    served = [r["served"] for r in ffns]
    steps = 1 + 2 * REPLAYS
    assert sum(served) >= steps * NUM_LAYERS and max(served) <= steps * NUM_LAYERS, served
    if num_ffn == 1:
        assert served == [steps * NUM_LAYERS]
