"""FP8 experts from a DeepSeek-V3-style checkpoint (afd_cupy/moe/fp8_checkpoint.py through
``adapters.ffn_weights``), and served end to end.

The state dicts are synthetic and built here: random weights quantized with
``fp8.quantize_blockwise`` into per-expert E4M3 linears with ``weight_scale_inv``, partial
128-blocks included (hidden 192, intermediate 96), a dense layer beside the MoE layers. Checked:
only the rank's experts, converted to the rowwise format, padded; the shared experts
dequantized, and the routed ones too on request; errors name the key and the values. End to
end on the host backend (1A2F async, 2A1F lockstep with merged batches): ``FFNWorker`` serves
the adapter's FP8 experts on the loop, and the Attention side's output is the FP8 compute's
(an fp64 reference of the same E4M3 operands written here), not the bf16 compute's."""
from __future__ import annotations

import pytest
import torch

from afd_cupy import adapters, moe
from afd_cupy.config import ModelConfig, TopologyConfig
from afd_cupy.connector import AFDConnector
from afd_cupy.moe import fp8
from afd_cupy.moe.expert_formats import UnsupportedModelError
from afd_cupy.runtime.launch import launch
from afd_cupy.runtime.topology import Role, Topology

HIDDEN, INTER, NUM_EXPERTS = 192, 96, 5
MOE_LAYERS = (1, 3)  # layers 0 and 2 are dense (DeepSeek's first_k_dense_replace)
PROJ_SHAPES = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}


def fp8_state_dict(seed: int, shared_inter: int = 2 * INTER) -> dict:
    """A DeepSeek-V3-style state dict: per-expert E4M3 linears + weight_scale_inv, FP8 shared
    experts of intermediate ``shared_inter``, a router, and a dense layer's MLP."""
    gen = torch.Generator().manual_seed(seed)

    def linear(shape):
        w = torch.randn(shape, generator=gen) / shape[1] ** 0.5 * (1 + torch.rand(shape, generator=gen))
        return fp8.quantize_blockwise(w.to(torch.bfloat16))

    state = {"model.layers.0.mlp.gate_proj.weight": torch.randn(64, HIDDEN, generator=gen).to(torch.bfloat16)}
    for layer in MOE_LAYERS:
        prefix = f"model.layers.{layer}.mlp."
        state[prefix + "gate.weight"] = torch.randn(NUM_EXPERTS, HIDDEN, generator=gen)
        names = [(f"experts.{e}.{proj}", shape) for e in range(NUM_EXPERTS) for proj, shape in PROJ_SHAPES.items()]
        names += [(f"shared_experts.{proj}", (2 * rows, cols) if proj != "down_proj" else (rows, 2 * cols))
                  for proj, (rows, cols) in PROJ_SHAPES.items()]
        for name, shape in names:
            state[f"{prefix}{name}.weight"], state[f"{prefix}{name}.weight_scale_inv"] = linear(shape)
    return state


def _weights(state, ffn_rank=1, num_ffn_ranks=2, **kwargs):
    return adapters.ffn_weights(state, ffn_rank=ffn_rank, num_ffn_ranks=num_ffn_ranks, num_experts=NUM_EXPERTS,
                                **kwargs)


def _same_codes(a, b) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_ffn_weights_reads_the_ranks_fp8_experts_and_dequantizes_the_shared_ones():
    state = fp8_state_dict(seed=1)
    experts, shared = _weights(state)  # 5 experts over 2 ranks: rank 1 owns 3, 4 and a padded slot
    assert len(experts) == len(shared) == len(MOE_LAYERS)
    for layer, local, fused in zip(MOE_LAYERS, experts, shared):
        assert isinstance(local, moe.FP8ExpertWeights)
        sizes = (local.num_experts, local.first_expert, local.hidden_size, local.intermediate_size)
        assert sizes == (3, 3, HIDDEN, INTER)
        prefix = f"model.layers.{layer}.mlp."
        for slot, expert in enumerate((3, 4)):
            rows = {proj: fp8.blockwise_to_rowwise(state[f"{prefix}experts.{expert}.{proj}.weight"],
                                                   state[f"{prefix}experts.{expert}.{proj}.weight_scale_inv"])
                    for proj in PROJ_SHAPES}
            assert _same_codes(local.w13[slot, :INTER], rows["gate_proj"][0])
            assert _same_codes(local.w13[slot, INTER:], rows["up_proj"][0])
            assert _same_codes(local.w2[slot], rows["down_proj"][0])
            assert torch.equal(local.w13_scale[slot], torch.cat([rows["gate_proj"][1], rows["up_proj"][1]]))
            assert torch.equal(local.w2_scale[slot], rows["down_proj"][1])
        padded = local.dequantize()
        assert torch.equal(padded.w13[2], torch.zeros(2 * INTER, HIDDEN))
        assert torch.equal(padded.w2[2], torch.zeros(HIDDEN, INTER))
        deq = {proj: fp8.dequantize_blockwise(state[f"{prefix}shared_experts.{proj}.weight"],
                                              state[f"{prefix}shared_experts.{proj}.weight_scale_inv"])
               for proj in PROJ_SHAPES}
        assert isinstance(fused, moe.ExpertWeights) and fused.dtype == torch.bfloat16 and fused.num_experts == 1
        assert torch.equal(fused.w13[0], torch.cat([deq["gate_proj"], deq["up_proj"]]).to(torch.bfloat16))
        assert torch.equal(fused.w2[0], deq["down_proj"].to(torch.bfloat16))
    fp32_shared = _weights(state, dequant_dtype=torch.float32)[1][0]
    assert fp32_shared.dtype == torch.float32


def test_fp8_experts_false_dequantizes_the_routed_experts_without_conversion():
    state = fp8_state_dict(seed=4)
    experts, shared = _weights(state, fp8_experts=False)
    fp8_shared = _weights(state)[1]
    for layer, local, fused, want_fused in zip(MOE_LAYERS, experts, shared, fp8_shared):
        assert isinstance(local, moe.ExpertWeights) and local.dtype == torch.bfloat16
        assert (local.num_experts, local.first_expert) == (3, 3) and torch.equal(fused.w13, want_fused.w13)
        prefix = f"model.layers.{layer}.mlp.experts.4."
        deq = {proj: fp8.dequantize_blockwise(state[f"{prefix}{proj}.weight"],
                                              state[f"{prefix}{proj}.weight_scale_inv"]) for proj in PROJ_SHAPES}
        assert torch.equal(local.w13[1], torch.cat([deq["gate_proj"], deq["up_proj"]]).to(torch.bfloat16))
        assert torch.equal(local.w2[1], deq["down_proj"].to(torch.bfloat16))
        assert torch.equal(local.w2[2], torch.zeros(HIDDEN, INTER, dtype=torch.bfloat16))  # padded slot


def test_the_first_rank_and_a_whole_set():
    state = fp8_state_dict(seed=2)
    first, whole = _weights(state, ffn_rank=0)[0], _weights(state, ffn_rank=0, num_ffn_ranks=1)[0]
    assert (first[0].first_expert, whole[1].num_experts) == (0, NUM_EXPERTS)
    assert _same_codes(first[1].w2, whole[1].w2[:3]) and torch.equal(first[1].w13_scale, whole[1].w13_scale[:3])


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("model.layers.3.mlp.experts.4.up_proj.weight_scale_inv"),
     r"'model.layers.3.mlp.experts.4.up_proj.weight_scale_inv' is missing"),
    (lambda s: s.update({"model.layers.1.mlp.experts.3.down_proj.weight": torch.zeros(HIDDEN, INTER)}),
     r"experts.3.down_proj.weight is \(192, 96\) torch.float32, expected \[192, 96\] torch.float8_e4m3fn"),
    (lambda s: s.update({"model.layers.1.mlp.experts.4.gate_proj.weight_scale_inv": torch.ones(1, 1)}),
     r"experts.4.gate_proj.weight_scale_inv is \(1, 1\) torch.float32, expected \[1, 2\]"),
    (lambda s: s.update({"model.layers.1.mlp.experts.9.gate_proj.weight_scale_inv": torch.ones(1, 2)}),
     r"model.layers.1.mlp.experts: expert id 9 in the state dict, expected 5 experts"),
])
def test_bad_fp8_state_dicts_are_named(edit, match):
    state = fp8_state_dict(seed=3)
    edit(state)
    with pytest.raises(UnsupportedModelError, match=match):
        _weights(state)


def test_fp8_options_are_for_fp8_state_dicts_only():
    state = {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 8, 4),
             "model.layers.0.mlp.experts.down_proj": torch.zeros(2, 4, 4)}
    for options in ({"dequant_dtype": torch.float32}, {"fp8_experts": False}):
        with pytest.raises(ValueError, match=r"fp8_experts=.* and dequant_dtype=.* apply to FP8 state dicts"):
            adapters.ffn_weights(state, ffn_rank=0, num_ffn_ranks=1, num_experts=2, **options)
    experts, _ = adapters.ffn_weights(state, ffn_rank=0, num_ffn_ranks=1, num_experts=2)
    assert isinstance(experts[0], moe.ExpertWeights) and experts[0].dtype == torch.float32  # as stored


# --------------------------------------------------------------------------- end to end

MODEL = ModelConfig(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, top_k=2, moe_intermediate_size=INTER,
                    num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=16,
                    num_layers=len(MOE_LAYERS), routed_scaling_factor=2.5)
SEED, TOKENS = 11, 13


def _fp8_expert_f64(x: torch.Tensor, weights: moe.FP8ExpertWeights, expert: int) -> torch.Tensor:
    """One FP8 expert on rows x [n, H] bf16, in fp64 from the E4M3 operands (rows quantized,
    gate/up rounded to bf16 as the GEMM writes it, glu, quantized again)."""
    w13 = fp8.dequantize_rowwise(weights.w13[expert], weights.w13_scale[expert]).double()
    w2 = fp8.dequantize_rowwise(weights.w2[expert], weights.w2_scale[expert]).double()
    gate_up = (fp8.dequantize_rowwise(*fp8.quantize_rowwise(x)).double() @ w13.T).to(torch.bfloat16).double()
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = gate * torch.sigmoid(gate) * up
    return fp8.dequantize_rowwise(*fp8.quantize_rowwise(hidden)).double() @ w2.T


def _references(x, ids, weights, routed: moe.FP8ExpertWeights, shared: moe.ExpertWeights):
    """(the FP8 layer, the same layer in bf16 math from the dequantized weights), fp64."""
    bf16_routed = routed.dequantize()
    out_fp8 = torch.zeros(x.shape, dtype=torch.float64)
    out_bf16 = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e, w = int(ids[t, k]), float(weights[t, k]) * MODEL.routed_scaling_factor
            out_fp8[t] += w * _fp8_expert_f64(x[t:t + 1], routed, e)[0]
            dense = moe.grouped_mlp(x[t:t + 1].float(), torch.tensor([int(i == e) for i in range(NUM_EXPERTS)]),
                                    bf16_routed)
            out_bf16[t] += w * dense[0].double()
    shared_out = moe.shared_mlp(x.float(), moe.ExpertWeights(shared.w13.float(), shared.w2.float(), 1)).double()
    return out_fp8 + shared_out, out_bf16 + shared_out


def _fp8_program(ctx, num_attn: int, num_ffn: int, schedule: str):
    """AnF on the host backend: FFN ranks serve ``ffn_weights`` of the FP8 state dict with an
    FFNWorker of ``schedule``; each Attention rank reports its errors per layer against both
    references."""
    from afd_cupy.ffn.worker import FFNWorker

    role, role_rank = Topology(num_attn, num_ffn, MODEL.num_experts).role_of(ctx.rank)
    conn = AFDConnector(MODEL, TopologyConfig(num_attn, num_ffn), role=role, role_rank=role_rank,
                        store=ctx.store(), job_id=ctx.job_id, backend="host", peer_timeout_s=30.0,
                        always_send=schedule == "lockstep")
    try:
        state = fp8_state_dict(seed=SEED)
        if role is Role.FFN:
            experts, shared = _weights(state, ffn_rank=role_rank, num_ffn_ranks=num_ffn)
            worker = FFNWorker(conn, experts, shared, schedule=schedule)
            return {"served": worker.run(), "served_by": worker.served_by, "reason": worker.serving_reason,
                    "batches": worker.num_batches}
        (routed_layers, shared_layers) = _weights(state, ffn_rank=0, num_ffn_ranks=1)
        gen = torch.Generator().manual_seed(5 + role_rank)
        errors = []
        for layer in range(MODEL.num_layers):
            x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
            weights, ids = conn.select_experts(torch.randn(TOKENS, NUM_EXPERTS, generator=gen))
            out = conn.recv_ffn_output(conn.send_attn_output(x, ids, weights, layer)).double()
            want_fp8, want_bf16 = _references(x, ids, weights, routed_layers[layer], shared_layers[layer])
            errors.append(tuple(float((out - want).norm() / want.norm()) for want in (want_fp8, want_bf16)))
        conn.announce_shutdown()
        return {"errors": errors}
    finally:
        conn.close()


@pytest.mark.parametrize("num_attn, num_ffn, schedule", [(1, 2, "async"), (2, 1, "lockstep")])
def test_ffn_worker_serves_fp8_checkpoint_experts_on_the_host_backend(num_attn, num_ffn, schedule):
    """async: each item's own grouped GEMM; lockstep: both replicas' items of a layer merged into
    one grouped GEMM (one batch per layer)."""
    results = launch(_fp8_program, num_attn + num_ffn, args=(num_attn, num_ffn, schedule), timeout_s=180)
    for ffn in results[num_attn:]:
        assert ffn["served"] == num_attn * MODEL.num_layers and ffn["served_by"] == "loop", ffn
        assert ffn["batches"] == (MODEL.num_layers if schedule == "lockstep" else ffn["served"]), ffn
        assert "the host backend has no CUDA graphs" in ffn["reason"], ffn
    for attn in results[:num_attn]:
        for err_fp8, err_bf16 in attn["errors"]:
            assert err_fp8 < 1e-2 and err_bf16 > 3 * err_fp8, attn["errors"]  # FP8's output, not bf16's
