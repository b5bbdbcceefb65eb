"""Hugging Face MoE models disaggregated through afd_cupy.adapters (docs/design/architecture.md): every
family's blocks are recognised, its config maps to the right gate (and gpt-oss's SwiGLU to
the config's alpha and limit), the proxies gate the HF routers' own logits, every block
matches its HF block and the fp64 truth, and teacher-forced greedy generation with the
Attention side in one process and F FFN ranks matches the same model run in one process
(logits within tolerance at every step, the same tokens)."""
from __future__ import annotations

import functools

import pytest
import torch

from helpers.backends import DIRECT_BACKENDS

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from afd_cupy import adapters  # noqa: E402
from afd_cupy.moe import gates  # noqa: E402
from afd_cupy.runtime.launch import launch  # noqa: E402
from afd_cupy.testing.hf_models import (RouterRecorder, generation_rank, greedy_steps, tiny_config,  # noqa: E402
                                        tiny_model)
from afd_cupy.testing.logit_check import LOGIT_TOLERANCE  # noqa: E402
from afd_cupy.testing.reference import reference_moe  # noqa: E402

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # relative, against the model's own block
#: relative, a block's output against its fp64 truth (bf16: measured 2.3e-3 .. 2.8e-3 on the
#: host backend, the HF block's own bf16 output 4e-3 .. 5e-3)
TRUTH_TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-3}


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


def _same_tensor(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("family", adapters.FAMILIES)
def test_ffn_weights_from_a_state_dict_equal_those_from_the_model(family):
    model = tiny_model(family, seed=3)
    num_experts = adapters.model_config(model.config, dtype="float32", max_num_batched_tokens=8).num_experts
    from_model = adapters.ffn_weights(model, ffn_rank=1, num_ffn_ranks=2, num_experts=num_experts)
    from_state = adapters.ffn_weights(model.state_dict(), ffn_rank=1, num_ffn_ranks=2, num_experts=num_experts,
                                      hf_config=model.config)
    fields = ("w13", "w2", "w13_bias", "w2_bias", "gate")
    for (a, b) in zip(from_model[0], from_state[0]):
        assert all(_same_tensor(getattr(a, f), getattr(b, f)) for f in fields) and a.first_expert == 4
        assert (a.activation, a.swiglu_limit, a.swiglu_alpha) == (b.activation, b.swiglu_limit, b.swiglu_alpha)
        assert a.has_bias == (family == "gpt_oss")
        assert a.activation == ("clamped_swiglu" if family == "gpt_oss" else "silu")
    for (a, b) in zip(from_model[1], from_state[1]):
        assert (a is None) == (b is None) == (family not in ("qwen2_moe", "deepseek_v2", "deepseek_v3"))
        if a is not None:
            assert all(_same_tensor(getattr(a, f), getattr(b, f)) for f in fields)
            assert (a.gate is None) == (b.gate is None) == (family != "qwen2_moe")


def test_gpt_oss_experts_are_transposed_and_deinterleaved_on_extraction():
    """The FFN rank's ExpertWeights hold gpt-oss's experts in the canonical layout: w13 rows
    [gate | up] from gate_up_proj's interleaved columns, transposed; biases likewise."""
    model = tiny_model("gpt_oss", seed=4)
    experts = adapters.moe_blocks(model)[1][1].experts
    local = adapters.ffn_weights(model, ffn_rank=1, num_ffn_ranks=3, num_experts=8)[0][1]  # experts 3, 4, 5
    assert (local.num_experts, local.first_expert) == (3, 3)
    assert (local.swiglu_limit, local.swiglu_alpha) == (experts.limit, experts.alpha) == (7.0, 1.702)
    for i, e in enumerate(range(3, 6)):
        gate_up, bias = experts.gate_up_proj[e].detach(), experts.gate_up_proj_bias[e].detach()
        assert torch.equal(local.w13[i, :32], gate_up[:, 0::2].T) and torch.equal(local.w13[i, 32:], gate_up[:, 1::2].T)
        assert torch.equal(local.w13_bias[i], torch.cat([bias[0::2], bias[1::2]]))
        assert torch.equal(local.w2[i], experts.down_proj[e].detach().T)
        assert torch.equal(local.w2_bias[i], experts.down_proj_bias[e].detach())
    assert local.w13.is_contiguous() and local.w2.is_contiguous()
    padded = adapters.ffn_weights(model, ffn_rank=2, num_ffn_ranks=3, num_experts=8)[0][0]  # experts 6, 7, pad
    assert not padded.w13[2].any() and not padded.w13_bias[2].any() and not padded.w2_bias[2].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_router_through_model_gate_matches_the_hf_router(dtype):
    """transformers' GptOssTopKRouter (top-k of the biased logits, softmax over the k) and the
    ModelConfig gate model_config maps it to pick the same experts with the same weights."""
    model = tiny_model("gpt_oss", seed=6, dtype=dtype)
    config = adapters.model_config(model.config, dtype="float32", max_num_batched_tokens=8)
    x = torch.randn(300, config.hidden_size, generator=torch.Generator().manual_seed(7)).to(dtype)
    for _, block in adapters.moe_blocks(model):
        with torch.no_grad():
            logits, scores, ids = block.router(x)
        weights, got_ids = gates.model_gate(config, logits)
        assert torch.equal(got_ids.long(), ids)
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # HF's softmax runs in bf16
        torch.testing.assert_close(weights, scores.float(), rtol=tol, atol=tol)


def test_tiny_gpt_oss_reaches_the_swiglu_clamp():
    """So that the block and generation tests below would see a wrong clamp limit."""
    model = tiny_model("gpt_oss", seed=5)
    seen = []
    for _, block in adapters.moe_blocks(model):
        apply_gate = block.experts._apply_gate
        block.experts._apply_gate = lambda gate_up, f=apply_gate: seen.append(gate_up.detach()) or f(gate_up)
    with torch.no_grad():
        model(torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(8)))
    gate_up = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen])
    assert (gate_up[:, 0::2] > 7.0).float().mean() > 0.01 and (gate_up[:, 1::2].abs() > 7.0).float().mean() > 0.01


def _hf_block_and_experts(family, seed, dtype, **overrides):
    """(model, its ModelConfig, FFN rank 0 of 1's experts and shared experts from the state
    dict with hf_config=, as an FFN rank builds them)."""
    model = tiny_model(family, seed=seed, dtype=dtype, **overrides)
    config = adapters.model_config(model.config, dtype=str(dtype).removeprefix("torch."), max_num_batched_tokens=8)
    experts, shared = adapters.ffn_weights(model.state_dict(), ffn_rank=0, num_ffn_ranks=1,
                                           num_experts=config.num_experts, hf_config=model.config)
    return model, config, experts, shared


@pytest.mark.parametrize("alpha,limit", [(1.5, 7.0), (1.702, 5.0), (2.1, 4.0)])
def test_gpt_oss_swiglu_alpha_and_limit_come_from_the_config(alpha, limit):
    """transformers' GptOssExperts reads swiglu_alpha / swiglu_limit from the config: so must
    the state-dict path (it fixed alpha at 1.702 and refused any limit but 7.0). The MoE output
    of the extracted experts (fp64 reference, the HF router's logits through the model gate)
    equals the HF block's in fp32."""
    model, config, experts, shared = _hf_block_and_experts("gpt_oss", 11, torch.float32,
                                                           swiglu_alpha=alpha, swiglu_limit=limit)
    x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(12))
    for layer, (_, block) in enumerate(adapters.moe_blocks(model)):
        assert (block.experts.alpha, block.experts.limit) == (alpha, limit)
        assert (experts[layer].swiglu_alpha, experts[layer].swiglu_limit) == (alpha, limit)
        with torch.no_grad():
            want = block(x.unsqueeze(0))[0][0]
            weights, ids = gates.model_gate(config, block.router(x)[0])
        got = reference_moe(x, ids, weights, experts[layer], shared[layer], 1.0)
        assert float((got - want).norm() / want.norm()) < 1e-5, (layer, alpha, limit)


class _RecordingConnector:
    """Stands in for an AFDConnector on the Attention side: records what the proxy passes to
    select_experts, gates with the real ModelConfig gate, replies zeros."""

    def __init__(self, config):
        self.model, self.calls = config, []

    def select_experts(self, logits, bias=None):
        self.calls.append((logits.clone(), None if bias is None else bias.clone()))
        return gates.model_gate(self.model, logits, bias)

    def send_attn_output(self, x, ids, weights, layer_idx):
        self.calls[-1] += (ids.clone(),)
        return x

    def recv_ffn_output(self, handle, blocking=True):
        return torch.zeros_like(handle)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("family", adapters.FAMILIES)
def test_proxy_router_logits_equal_the_hf_blocks_bit_for_bit_in_bf16(family, device):
    """The proxy gates exactly the logits the HF block's router computes (same module, same
    dtype, same input; DeepSeek's router in fp32 as from_pretrained keeps it) and picks the
    same experts, exact ties of bf16 logits included (15-30 of the 2048 tokens tie at the top-k
    boundary per bf16-router family here, none of DeepSeek's fp32 logits; on cuda the one-kernel
    gate takes the lower expert id of a tie, torch.topk the lower index too)."""
    model = tiny_model(family, seed=13, dtype=torch.bfloat16).to(device)
    config = adapters.model_config(model.config, dtype="bfloat16", max_num_batched_tokens=4096)
    x = torch.randn(1, 2048, config.hidden_size, generator=torch.Generator().manual_seed(14))
    x = x.to(device=device, dtype=torch.bfloat16)
    blocks = [block for _, block in adapters.moe_blocks(model)]
    seen = []
    handles = [adapters.router_of(block).register_forward_hook(lambda m, i, out: seen.append(out)) for block in blocks]
    with torch.no_grad():
        for block in blocks:
            block(x)
    for handle in handles:
        handle.remove()
    conn = _RecordingConnector(config)
    adapters.disaggregate_attention(model, conn)
    proxies = [m for m in model.modules() if isinstance(m, adapters.DisaggregatedMoE)]
    with torch.no_grad():
        for proxy in proxies:
            proxy(x)
    assert len(conn.calls) == len(seen) == len(blocks)
    for (logits, bias, ids), (hf_logits, _, hf_ids) in zip(conn.calls, seen):
        assert logits.dtype == hf_logits.dtype and torch.equal(logits, hf_logits.reshape(logits.shape))
        assert torch.equal(ids.long().sort(dim=-1).values, hf_ids.long().sort(dim=-1).values)


class _ProtocolMoE(torch.nn.Module):
    """A torch MoE block that is no Hugging Face class, following the adapter protocol:
    router ``gate``, fused experts in the given layout with biases, a biased shared MLP.
    ``forward_f64`` is a float64 loop written from the tensors as stored."""

    def __init__(self, transposed: bool, interleaved: bool, hidden=16, inter=8, num_experts=4):
        super().__init__()
        gen = torch.Generator().manual_seed(9)
        self.transposed, self.interleaved = transposed, interleaved
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.experts = torch.nn.Module()
        gate_up_shape = (num_experts, hidden, 2 * inter) if transposed else (num_experts, 2 * inter, hidden)
        down_shape = (num_experts, inter, hidden) if transposed else (num_experts, hidden, inter)
        self.experts.gate_up_proj = torch.nn.Parameter(torch.randn(gate_up_shape, generator=gen) / 4)
        self.experts.down_proj = torch.nn.Parameter(torch.randn(down_shape, generator=gen) / 3)
        self.experts.gate_up_proj_bias = torch.nn.Parameter(torch.randn(num_experts, 2 * inter, generator=gen))
        self.experts.down_proj_bias = torch.nn.Parameter(torch.randn(num_experts, hidden, generator=gen))
        self.experts.act_fn = torch.nn.SiLU()
        if interleaved:  # an interleaved layout must say so through _apply_gate
            self.experts._apply_gate = lambda gu: torch.nn.functional.silu(gu[..., 0::2]) * gu[..., 1::2]
        self.shared_expert = torch.nn.Module()
        self.shared_expert.gate_proj = torch.nn.Linear(hidden, 12, bias=True)
        self.shared_expert.up_proj = torch.nn.Linear(hidden, 12, bias=False)
        self.shared_expert.down_proj = torch.nn.Linear(12, hidden, bias=True)

    def forward_f64(self, x, ids, weights):
        out = torch.full(x.shape, float("nan"), dtype=torch.float64)
        ex, sh = self.experts, self.shared_expert
        for t in range(x.shape[0]):
            xt = x[t].double()
            g = sh.gate_proj.weight.double() @ xt + sh.gate_proj.bias.double()
            u = sh.up_proj.weight.double() @ xt
            out[t] = sh.down_proj.weight.double() @ (g / (1 + torch.exp(-g)) * u) + sh.down_proj.bias.double()
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                w = ex.gate_up_proj[e].double()
                gate_up = (xt @ w if self.transposed else w @ xt) + ex.gate_up_proj_bias[e].double()
                gate, up = (gate_up[0::2], gate_up[1::2]) if self.interleaved else gate_up.chunk(2)
                h = gate / (1 + torch.exp(-gate)) * up
                d = ex.down_proj[e].double()
                expert_out = (h @ d if self.transposed else d @ h) + ex.down_proj_bias[e].double()
                out[t] += weights[t, k].double() * expert_out
        return out


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_a_protocol_block_with_any_layout_biases_and_a_biased_shared_mlp(transposed, interleaved):
    block = _ProtocolMoE(transposed, interleaved)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = block
    experts, shared = adapters.ffn_weights(model, ffn_rank=0, num_ffn_ranks=1, num_experts=4)
    assert experts[0].has_bias and shared[0].w13_bias is not None and shared[0].w2_bias is not None
    assert not shared[0].w13_bias[0, 12:].any()  # up_proj has no bias: zeros
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(10))
    weights, ids = gates.select_experts(block.gate(x).detach(), 2)
    got = reference_moe(x, ids, weights, experts[0], shared[0], 1.0)
    with torch.no_grad():
        want = block.forward_f64(x, ids, weights)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


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


def test_unsupported_gpt_oss_variants_are_named():
    model = tiny_model("gpt_oss", seed=0)
    _, block = adapters.moe_blocks(model)[0]
    state = model.state_dict()
    with pytest.raises(adapters.UnsupportedModelError, match=r"gpt_oss: swiglu_alpha=-1.5 in the config"):
        adapters.ffn_weights(state, ffn_rank=0, num_ffn_ranks=1, num_experts=8,
                             hf_config=tiny_config("gpt_oss", swiglu_alpha=-1.5))
    with pytest.raises(adapters.UnsupportedModelError, match=r"gpt_oss: .*pass hf_config= to ffn_weights"):
        adapters.config_activation(model.config)
    with pytest.raises(ValueError, match=r"pass activation \('silu'\) or hf_config, not both"):
        adapters.ffn_weights(state, ffn_rank=0, num_ffn_ranks=1, num_experts=8, activation="silu",
                             hf_config=model.config)
    bad_bias = {**state, "model.layers.0.mlp.experts.down_proj_bias": torch.zeros(8, 63)}
    with pytest.raises(adapters.UnsupportedModelError,
                       match=r"model.layers.0.mlp.experts: down_proj_bias is \(8, 63\), expected \(8, 64\)"):
        adapters.ffn_weights(bad_bias, ffn_rank=0, num_ffn_ranks=1, num_experts=8, hf_config=model.config)
    block.experts.is_transposed = False
    with pytest.raises(adapters.UnsupportedModelError,
                       match=r"GptOssMLP: experts.is_transposed=False contradicts the weight shapes "
                             r"gate_up_proj \(8, 64, 64\), down_proj \(8, 32, 64\)"):
        adapters.ffn_weights(model, ffn_rank=0, num_ffn_ranks=1, num_experts=8)
    block.experts.is_transposed = True
    block.experts._apply_gate = lambda gate_up: torch.relu(gate_up[..., ::2]) * gate_up[..., 1::2]
    with pytest.raises(adapters.UnsupportedModelError,
                       match=r"GptOssMLP: the experts' gate GptOssExperts._apply_gate matches none"):
        adapters.ffn_weights(model, ffn_rank=0, num_ffn_ranks=1, num_experts=8)
    del block.experts._apply_gate
    block.experts.down_proj = torch.nn.Parameter(torch.zeros(8, 31, 64))
    with pytest.raises(adapters.UnsupportedModelError,
                       match=r"GptOssMLP: expert weights gate_up_proj \(8, 64, 64\) and down_proj \(8, 31, 64\) "
                             r"are neither"):
        adapters.ffn_weights(model, ffn_rank=0, num_ffn_ranks=1, num_experts=8)


def test_teacher_forcing_feeds_the_given_tokens_and_records_every_router():
    """greedy_steps(forced=) grows the sequence by the forced tokens, not its own greedy ones:
    step i's logits are the model's on prompt + forced[:i]; RouterRecorder keeps each step's
    routers' (logits, ids) in layer order."""
    model = tiny_model("qwen3_moe", seed=15)
    prompt = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(16))
    free_tokens = greedy_steps(model, prompt, 4)[0]
    forced = [(t + 1) % 96 for t in free_tokens]  # never the greedy token
    with RouterRecorder(model) as recorder:
        tokens, logits, _ = greedy_steps(model, prompt, 4, forced=forced)
    assert tokens[0] == free_tokens[0] and len(recorder.steps) == 4
    for i in range(4):
        with torch.no_grad():
            want = model(torch.cat([prompt, torch.tensor([forced[:i]], dtype=prompt.dtype)], dim=1),
                         use_cache=False).logits[0, -1]
        assert torch.equal(logits[i], want) and tokens[i] == int(want.argmax())
        assert [tuple(ids.shape) for _, ids in recorder.steps[i]] == [(5 + i, 2)] * 3


def _generation_program(ctx, backend, num_ffn):
    """Every family in one launch, a connector each (a cuda launch costs seconds of start-up)."""
    return {family: generation_rank(ctx, family, backend=backend, num_ffn=num_ffn, steps=6)
            for family in adapters.FAMILIES}


@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
@pytest.mark.parametrize("num_ffn", [1, 2])
def test_disaggregated_greedy_generation_matches_one_process(backend, num_ffn):
    results = launch(_generation_program, 1 + num_ffn, args=(backend, num_ffn), timeout_s=360)
    assert list(results[0]) == list(adapters.FAMILIES), results[0]
    for family in adapters.FAMILIES:
        attn = results[0][family]
        assert attn["tokens"] == attn["ref_tokens"], (family, attn)
        assert attn["check"]["ok"] and attn["check"]["tolerance"] == LOGIT_TOLERANCE["float32"], (family, attn)
        assert max(attn["errors"]) < LOGIT_TOLERANCE["float32"], (family, attn["errors"])
        assert sum(r[family]["served"] for r in results[1:]) >= 6, family  # the experts ran on the FFN ranks


def _block_program(ctx, backend, dtype, num_attn, num_ffn):
    """Every family in one launch, a connector each (a cuda launch costs seconds of start-up)."""
    return {family: _one_block_family(ctx, backend, family, dtype, num_attn, num_ffn)
            for family in adapters.FAMILIES}


def _one_block_family(ctx, backend, family, dtype, num_attn, num_ffn):
    from afd_cupy.config import TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.wire.dtypes import torch_dtype
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.runtime.topology import Topology

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
            experts, shared = adapters.ffn_weights(model.state_dict(), ffn_rank=role_rank, num_ffn_ranks=num_ffn,
                                                   num_experts=config.num_experts, hf_config=model.config)
            return {"served": FFNWorker(conn, experts, shared if shared[0] is not None else None).run()}
        blocks = [block for _, block in adapters.moe_blocks(model)]
        every_expert, every_shared = adapters.ffn_weights(model, ffn_rank=0, num_ffn_ranks=1,
                                                          num_experts=config.num_experts)
        x = torch.randn(2, 12, config.hidden_size, generator=torch.Generator().manual_seed(role_rank))
        x = x.to(device=device, dtype=torch_dtype(dtype))
        with torch.no_grad():
            refs = [block(x) for block in blocks]
            adapters.disaggregate_attention(model, conn)
            proxies = [block for _, block in model.named_modules() if isinstance(block, adapters.DisaggregatedMoE)]
            outs = [proxy(x) for proxy in proxies]
            # fp64 truth of each layer for the proxy's routing (its router's logits, the gate)
            truths = []
            for proxy, experts, shared in zip(proxies, every_expert, every_shared):
                logits = proxy.router(x.reshape(-1, config.hidden_size))[0]
                weights, ids = conn.select_experts(logits, getattr(proxy.router, "e_score_correction_bias", None))
                truths.append(reference_moe(x.reshape(-1, config.hidden_size), ids, weights, experts, shared,
                                            config.routed_scaling_factor).view(x.shape))
        conn.announce_shutdown()
        # gpt-oss blocks return (hidden, router_scores): the proxies the same pair
        structure = [(type(o).__name__, len(o) if isinstance(o, tuple) else 1) for o in outs + refs]
        score_errors = [float((o[1].float() - r[1].float()).norm() / r[1].float().norm())
                        for o, r in zip(outs, refs) if isinstance(r, tuple)]
        outs = [o[0] if isinstance(o, tuple) else o for o in outs]
        refs = [r[0] if isinstance(r, tuple) else r for r in refs]
        def rel(a, b):
            return float((a.cpu().double() - b.cpu().double()).norm() / b.cpu().double().norm())
        return {"errors": [rel(o, r) for o, r in zip(outs, refs)],
                "errors_vs_truth": [rel(o, t) for o, t in zip(outs, truths)],
                "hf_errors_vs_truth": [rel(r, t) for r, t in zip(refs, truths)],
                "dtypes": sorted({str(o.dtype) for o in outs}), "structure": structure, "score_errors": score_errors}
    finally:
        conn.close()


@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_attn,num_ffn", [(1, 2), (2, 1)])
def test_every_moe_block_matches_its_hf_block(backend, dtype, num_attn, num_ffn):
    """Every family's disaggregated blocks against the HF blocks on the same input, and both
    against the fp64 truth of the proxy's routing (afd_cupy.testing.reference)."""
    results = launch(_block_program, num_attn + num_ffn, args=(backend, dtype, num_attn, num_ffn),
                     timeout_s=360)
    for report in results[:num_attn]:
        assert list(report) == list(adapters.FAMILIES), report
        for family, result in report.items():
            assert len(result["errors"]) >= 2 and max(result["errors"]) < TOLERANCE[dtype], (family, result)
            # against the fp64 truth of the same routing: no error beyond the dtype's rounding,
            # and in bf16 no more than the HF block's own (which rounds more often)
            for afd, hf in zip(result["errors_vs_truth"], result["hf_errors_vs_truth"]):
                assert afd < TRUTH_TOLERANCE[dtype] and (dtype == "float32" or afd <= 1.5 * hf), (family, result)
            assert result["dtypes"] == [f"torch.{dtype}"], (family, result)
            expected = ("tuple", 2) if family == "gpt_oss" else ("Tensor", 1)
            assert set(result["structure"]) == {expected}, (family, result["structure"])
            assert len(result["score_errors"]) == (len(result["errors"]) if family == "gpt_oss" else 0)
            assert all(err < TOLERANCE[dtype] for err in result["score_errors"]), (family, result["score_errors"])


@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh"])
def test_gelu_gated_experts_generate_like_one_process(backend, hidden_act):
    rank_fn = functools.partial(generation_rank, backend=backend, num_ffn=2, steps=5,
                                overrides={"hidden_act": hidden_act})
    attn = launch(rank_fn, 3, args=("qwen2_moe",), timeout_s=240)[0]  # routed and shared experts
    assert attn["tokens"] == attn["ref_tokens"], attn
    assert attn["check"]["ok"] and max(attn["errors"]) < LOGIT_TOLERANCE["float32"], attn["errors"]
