"""Hugging Face MoE models disaggregated through afd_cupy.adapters (docs/design.md §1): every
family's blocks are recognised, its config maps to the right gate, and greedy generation with
the Attention side in one process and F FFN ranks matches the same model run in one process
(logits within tolerance at every step, the same tokens)."""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from afd_cupy import adapters  # noqa: E402
from afd_cupy.launch import launch  # noqa: E402
from afd_cupy.testing.hf_models import generation_rank, tiny_config, tiny_model  # noqa: E402

BACKENDS = [pytest.param("host", id="host"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # relative, against the model's own block


@pytest.mark.parametrize("family", adapters.FAMILIES)
def test_model_config_maps_each_family(family):
    config = adapters.model_config(tiny_config(family), dtype="bfloat16", max_num_batched_tokens=64)
    model = tiny_model(family, seed=0)
    assert config.num_layers == len(adapters.moe_blocks(model))
    assert config.top_k == 2 and config.num_experts == 8
    expect = {"deepseek_v3": ("sigmoid", "noaux_tc", 2.5, 1), "deepseek_v2": ("softmax", "group_limited_greedy", 2.0, 1),
              "qwen2_moe": ("softmax", None, 1.0, 1)}.get(family, ("softmax", None, 1.0, 0))
    assert (config.scoring_func, config.topk_method, config.routed_scaling_factor,
            config.num_shared_experts) == expect


@pytest.mark.parametrize("family", adapters.FAMILIES)
def test_ffn_weights_from_a_state_dict_equal_those_from_the_model(family):
    model = tiny_model(family, seed=3)
    num_experts = adapters.model_config(model.config, dtype="float32", max_num_batched_tokens=8).num_experts
    from_model = adapters.ffn_weights(model, ffn_rank=1, num_ffn_ranks=2, num_experts=num_experts)
    from_state = adapters.ffn_weights(model.state_dict(), ffn_rank=1, num_ffn_ranks=2, num_experts=num_experts)
    for (a, b) in zip(from_model[0], from_state[0]):
        assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2) and a.first_expert == 4
    for (a, b) in zip(from_model[1], from_state[1]):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
            assert (a.gate is None) == (b.gate is None) == (family != "qwen2_moe")


def test_unsupported_blocks_are_named():
    model = tiny_model("mixtral", seed=0)
    _, block = adapters.moe_blocks(model)[0]
    block.experts.act_fn = torch.nn.ReLU()
    with pytest.raises(adapters.UnsupportedModelError, match="MixtralSparseMoeBlock: expert activation ReLU"):
        adapters.ffn_weights(model, ffn_rank=0, num_ffn_ranks=1, num_experts=8)
    with pytest.raises(adapters.UnsupportedModelError, match="hidden_act 'relu'"):
        adapters.config_activation(tiny_config("mixtral", hidden_act="relu"))
    with pytest.raises(adapters.UnsupportedModelError, match="model_type 'llama'"):
        adapters.model_config(transformers.AutoConfig.for_model("llama"), dtype="float32",
                              max_num_batched_tokens=8)


def _generation_program(ctx, backend, num_ffn):
    """Every family in one launch, a connector each (a cuda launch costs seconds of start-up)."""
    return {family: generation_rank(ctx, family, backend=backend, num_ffn=num_ffn, steps=6)
            for family in adapters.FAMILIES}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_ffn", [1, 2])
def test_disaggregated_greedy_generation_matches_one_process(backend, num_ffn):
    results = launch(_generation_program, 1 + num_ffn, args=(backend, num_ffn), timeout_s=360)
    assert list(results[0]) == list(adapters.FAMILIES), results[0]
    for family in adapters.FAMILIES:
        attn = results[0][family]
        assert attn["tokens"] == attn["ref_tokens"], (family, attn)
        assert max(attn["errors"]) < TOLERANCE["float32"], (family, attn["errors"])
        assert sum(r[family]["served"] for r in results[1:]) >= 6, family  # the experts ran on the FFN ranks


def _block_program(ctx, backend, dtype, num_attn, num_ffn):
    """Every family in one launch, a connector each (a cuda launch costs seconds of start-up)."""
    return {family: _one_block_family(ctx, backend, family, dtype, num_attn, num_ffn)
            for family in adapters.FAMILIES}


def _one_block_family(ctx, backend, family, dtype, num_attn, num_ffn):
    from afd_cupy.config import TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.dtypes import torch_dtype
    from afd_cupy.ffn_worker import FFNWorker
    from afd_cupy.topology import Topology

    device = torch.device("cuda", ctx.device_id or 0) if backend == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = tiny_model(family, seed=5, dtype=torch_dtype(dtype)).to(device)
    config = adapters.model_config(model.config, dtype=dtype, max_num_batched_tokens=24)
    role, role_rank = Topology(num_attn, num_ffn, config.num_experts).role_of(ctx.rank)
    conn = AFDConnector(config, TopologyConfig(num_attn, num_ffn), role=role, role_rank=role_rank,
                        store=ctx.store(), job_id=ctx.job_id, backend=backend, device_id=ctx.device_id,
                        peer_timeout_s=60.0)
    try:
        if role.value == "ffn":
            experts, shared = adapters.ffn_weights(model.state_dict(), ffn_rank=role_rank,
                                                   num_ffn_ranks=num_ffn, num_experts=config.num_experts)
            return {"served": FFNWorker(conn, experts, shared if shared[0] is not None else None).run()}
        blocks = [block for _, block in adapters.moe_blocks(model)]
        x = torch.randn(2, 12, config.hidden_size, generator=torch.Generator().manual_seed(role_rank))
        x = x.to(device=device, dtype=torch_dtype(dtype))
        with torch.no_grad():
            refs = [block(x) for block in blocks]
            adapters.disaggregate_attention(model, conn)
            proxies = [block for _, block in model.named_modules() if isinstance(block, adapters.DisaggregatedMoE)]
            outs = [proxy(x) for proxy in proxies]
        conn.announce_shutdown()
        return {"errors": [float((o.float() - r.float()).norm() / r.float().norm()) for o, r in zip(outs, refs)],
                "dtypes": sorted({str(o.dtype) for o in outs})}
    finally:
        conn.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_attn,num_ffn", [(1, 2), (2, 1)])
def test_every_moe_block_matches_its_hf_block(backend, dtype, num_attn, num_ffn):
    results = launch(_block_program, num_attn + num_ffn, args=(backend, dtype, num_attn, num_ffn),
                     timeout_s=360)
    for report in results[:num_attn]:
        assert list(report) == list(adapters.FAMILIES), report
        for family, result in report.items():
            assert len(result["errors"]) >= 2 and max(result["errors"]) < TOLERANCE[dtype], (family, result)
            assert result["dtypes"] == [f"torch.{dtype}"], (family, result)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh"])
def test_gelu_gated_experts_generate_like_one_process(backend, hidden_act):
    rank_fn = functools.partial(generation_rank, backend=backend, num_ffn=2, steps=5,
                                overrides={"hidden_act": hidden_act})
    attn = launch(rank_fn, 3, args=("qwen2_moe",), timeout_s=240)[0]  # routed and shared experts
    assert attn["tokens"] == attn["ref_tokens"], attn
    assert max(attn["errors"]) < TOLERANCE["float32"], attn["errors"]
