"""Tiny Hugging Face MoE models built from configs with random weights (no network), one per
family of ``afd_cupy.adapters.FAMILIES``: for tests and ``tools/hf_generate.py``."""
from __future__ import annotations

import torch

_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2,
               tie_word_embeddings=False)
_FAMILY = {
    "mixtral": dict(intermediate_size=32, num_local_experts=8),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      norm_topk_prob=True, head_dim=16),
    "olmoe": dict(intermediate_size=32, num_experts=8, norm_topk_prob=False, eos_token_id=1,
                  pad_token_id=1),
    "deepseek_v2": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy",
                        n_group=4, topk_group=2, routed_scaling_factor=2.0, kv_lora_rank=16,
                        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        head_dim=8),
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16,
                        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        head_dim=8),
    # attention sinks and a sliding window (every other layer) stay on the Attention rank; the
    # YaRN factor matches max_position_embeddings / original_max_position_embeddings
    "gpt_oss": dict(intermediate_size=32, num_local_experts=8, head_dim=16, sliding_window=4,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=4)),
}
#: gpt-oss: expert gate/up weights scaled up so that some gate/up values pass the clamp
#: limit (7.0) of its SwiGLU, and router biases large enough to change the routing
_GPT_OSS_GATE_UP_SCALE = 4.0
_ROUTER_BIAS_STD = 0.5


def tiny_config(family: str, **overrides):
    """A small config of ``family`` (3 layers, hidden 64, 8 experts, top-2), ``overrides``
    applied last (e.g. ``hidden_act="gelu"``)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**_COMMON, **_FAMILY[family], **overrides})


def tiny_model(family: str, *, seed: int, dtype=torch.float32, **overrides):
    """A ``*ForCausalLM`` of ``tiny_config(family)`` with seeded random weights, eval mode.

    Router weights and DeepSeek-V3's selection bias are drawn wide enough that routing
    differs between tokens; the fused expert weights (and gpt-oss's expert biases) are
    initialised explicitly (transformers leaves them empty or zero); gpt-oss's gate/up
    weights are scaled so that its SwiGLU clamp is reached, its router biases drawn wide."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in ** 0.5)
            if name.endswith("experts.gate_up_proj") and family == "gpt_oss":
                param.mul_(_GPT_OSS_GATE_UP_SCALE)
            if name.endswith("router.bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * _ROUTER_BIAS_STD)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    return model.to(dtype).eval()


def generation_rank(ctx, family: str, *, backend: str, num_ffn: int, steps: int,
                    prompt_len: int = 6, dtype: str = "float32", seed: int = 0,
                    overrides: dict | None = None) -> dict:
    """One rank of a disaggregated greedy generation (rank 0: Attention, the model minus its
    experts; ranks 1..F: FFN ranks holding only their experts, taken from a state dict).

    Rank 0 first runs the same model undisaggregated as the reference, then disaggregated,
    and reports per step the relative logit error, both token lists and both wall times.
    """
    from afd_cupy import adapters
    from afd_cupy.config import TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.dtypes import torch_dtype
    from afd_cupy.ffn_worker import FFNWorker

    device = torch.device("cuda", ctx.device_id or 0) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(device)
    model = tiny_model(family, seed=seed, dtype=torch_dtype(dtype), **(overrides or {})).to(device)
    config = adapters.model_config(model.config, dtype=dtype,
                                   max_num_batched_tokens=prompt_len + steps)
    role = "attention" if ctx.rank == 0 else "ffn"
    conn = AFDConnector(config, TopologyConfig(1, num_ffn), role=role,
                        role_rank=0 if ctx.rank == 0 else ctx.rank - 1, store=ctx.store(),
                        job_id=ctx.job_id, backend=backend, device_id=ctx.device_id,
                        peer_timeout_s=60.0)
    try:
        if role == "ffn":
            state, hf_config = model.state_dict(), model.config  # a (memory-mapped) checkpoint
            del model
            experts, shared = adapters.ffn_weights(state, ffn_rank=ctx.rank - 1, num_ffn_ranks=num_ffn,
                                                   num_experts=config.num_experts, hf_config=hf_config)
            return {"served": FFNWorker(conn, experts, shared if any(s is not None for s in shared) else None).run()}
        prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len),
                               generator=torch.Generator().manual_seed(seed + 7)).to(device)
        ref_tokens, ref_logits, ref_s = _greedy(model, prompt, steps)
        adapters.disaggregate_attention(model, conn)
        tokens, logits, afd_s = _greedy(model, prompt, steps)
        errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(logits, ref_logits)]
        conn.announce_shutdown()
        return {"tokens": tokens, "ref_tokens": ref_tokens, "errors": errors,
                "tokens_per_s": steps / afd_s, "ref_tokens_per_s": steps / ref_s}
    finally:
        conn.close()


def _greedy(model, prompt: torch.Tensor, steps: int):
    """Greedy decoding without a KV cache (every step recomputes the sequence): tokens, the
    last-position logits of every step, wall seconds."""
    import time

    ids, tokens, logits = prompt, [], []
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            step_logits = model(ids, use_cache=False).logits[0, -1]
            token = int(step_logits.argmax())
            tokens.append(token)
            logits.append(step_logits.cpu())
            ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
    return tokens, logits, time.perf_counter() - start
