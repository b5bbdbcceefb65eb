"""Model gates through the connector (docs/design/protocol.md): DeepSeek-V3's noaux_tc gate with a
selection bias and a routed scaling factor, Qwen2-MoE's gated shared expert, and gpt-oss-style
experts (biases, clamped SwiGLU, no shared expert), in 1A2F and 2A1F, against the float64
reference MoE on fresh random inputs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from afd_cupy import moe
from afd_cupy.config import ModelConfig, TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.ffn.worker import FFNWorker
from afd_cupy.moe import gates
from afd_cupy.runtime.launch import launch
from afd_cupy.runtime.topology import Topology
from afd_cupy.testing.reference import make_expert_weights, make_shared_weights, reference_moe
from afd_cupy.testing.scenario import tolerance
from afd_cupy.wire.dtypes import torch_dtype

from helpers.backends import DIRECT_BACKENDS

FAMILIES = {
    "deepseek_v3": dict(scoring_func="sigmoid", n_group=4, topk_group=2, topk_method="noaux_tc",
                        routed_scaling_factor=2.5, renormalize=True),
    "qwen2_moe": dict(scoring_func="softmax", renormalize=False),
    "gpt_oss": dict(scoring_func="softmax", renormalize=True),
}
#: gpt-oss-style experts: a clamp limit low enough that O(1) activations reach it
_SWIGLU_LIMIT = 1.5


def _model(family: str, dtype: str) -> ModelConfig:
    return ModelConfig(hidden_size=64, num_experts=16, top_k=4, moe_intermediate_size=32,
                       num_shared_experts=0 if family == "gpt_oss" else 1, dtype=dtype,
                       max_num_batched_tokens=32, num_layers=2, **FAMILIES[family])


def _weights(model: ModelConfig, family: str, device):
    dtype = torch_dtype(model.dtype)
    routed = make_expert_weights(model.num_experts, model.hidden_size, model.moe_intermediate_size,
                                 dtype=dtype, device=device, seed=11)
    shared = make_shared_weights(1, model.hidden_size, model.moe_intermediate_size, dtype=dtype,
                                 device=device, seed=12)
    if family == "qwen2_moe":
        gate = torch.randn(1, model.hidden_size, generator=torch.Generator().manual_seed(13))
        shared = moe.ExpertWeights(w13=shared.w13, w2=shared.w2, num_experts=1,
                                   gate=(gate * 0.5).to(dtype).to(device))
    if family == "gpt_oss":
        gen = torch.Generator().manual_seed(14)
        biases = {"w13_bias": torch.randn(model.num_experts, 2 * model.moe_intermediate_size, generator=gen),
                  "w2_bias": torch.randn(model.num_experts, model.hidden_size, generator=gen) * 0.5}
        routed = dataclasses.replace(routed, activation="clamped_swiglu", swiglu_limit=_SWIGLU_LIMIT,
                                     **{k: v.to(dtype).to(device) for k, v in biases.items()})
        shared = None
    return routed, shared


def _program(ctx, backend, dtype, num_attn, num_ffn):
    """Every family in one launch (a connector each, one after another): a launch on the cuda
    backend costs seconds of NVSHMEM and CUDA start-up, a connector far less."""
    return {family: _one_family(ctx, backend, family, dtype, num_attn, num_ffn) for family in sorted(FAMILIES)}


def _one_family(ctx, backend, family, dtype, num_attn, num_ffn):
    model = _model(family, dtype)
    role, role_rank = Topology(num_attn, num_ffn, model.num_experts).role_of(ctx.rank)
    device = torch.device("cuda", ctx.device_id or 0) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    conn = AFDConnector(model, TopologyConfig(num_attn, num_ffn), role=role, role_rank=role_rank,
                        store=ctx.store(), job_id=ctx.job_id, backend=backend,
                        device_id=ctx.device_id, peer_timeout_s=30.0)
    routed, shared = _weights(model, family, device)
    try:
        if role.value == "ffn":
            local = moe.local_experts(routed, role_rank, conn.layout.expert_per_rank)
            return {"served": FFNWorker(conn, local, shared).run()}
        gen = torch.Generator().manual_seed(100 + role_rank)
        bias = (torch.randn(model.num_experts, generator=gen) * 0.3).to(device)
        errors = []
        for layer in range(model.num_layers):
            hidden = torch.randn(20, model.hidden_size, generator=gen).to(torch_dtype(dtype)).to(device)
            logits = torch.randn(20, model.num_experts, generator=gen).to(device)
            use_bias = bias if family == "deepseek_v3" else None
            weights, ids = conn.select_experts(logits, use_bias)
            direct = gates.model_gate(model, logits, use_bias)
            assert torch.equal(ids, direct[1]) and torch.equal(weights, direct[0])
            # layer 1: weights that require grad (a training-style caller) must work as well
            sent = weights.clone().requires_grad_(layer == 1)
            out = conn.recv_ffn_output(conn.send_attn_output(hidden, ids, sent, layer))
            ref = reference_moe(hidden, ids, weights, routed, shared, model.routed_scaling_factor)
            errors.append(float((out.float().cpu() - ref).norm() / ref.norm()))
        conn.announce_shutdown()
        return {"errors": errors}
    finally:
        conn.close()


@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("num_attn,num_ffn", [(1, 2), (2, 1)])
def test_model_gates_through_the_connector_match_the_reference(backend, dtype, num_attn, num_ffn):
    results = launch(_program, num_attn + num_ffn, args=(backend, dtype, num_attn, num_ffn),
                     timeout_s=180)
    for report in results[:num_attn]:
        assert sorted(report) == sorted(FAMILIES), report
        for family, result in report.items():
            assert len(result["errors"]) == 2 and max(result["errors"]) < tolerance(dtype), (family, result)
