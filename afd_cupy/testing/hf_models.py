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
    weights are scaled so that its SwiGLU clamp is reached, its router biases drawn wide.
    Tensors the family keeps in fp32 (``_keep_in_fp32_modules_strict``: DeepSeek's router
    weight and ``e_score_correction_bias``) stay fp32 whatever ``dtype``, as in a checkpoint
    loaded by ``from_pretrained``."""
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
    model = model.to(dtype).eval()
    # as from_pretrained loads a checkpoint: what the family keeps in fp32 (DeepSeek's router
    # weights and selection bias) stays fp32 in a bf16 model
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if any(pattern in name for pattern in keep) and tensor.is_floating_point():
                tensor.data = tensor.data.float()
    return model


def generation_rank(ctx, family: str, *, backend: str, num_ffn: int, steps: int,
                    prompt_len: int = 6, dtype: str = "float32", seed: int = 0,
                    overrides: dict | None = None) -> dict:
    """One rank of a disaggregated, teacher-forced greedy generation (rank 0: Attention, the
    model minus its experts; ranks 1..F: FFN ranks holding only their experts, taken from a
    state dict).

    Rank 0 first runs the model undisaggregated as the reference (greedy, ``steps`` tokens),
    then disaggregated, fed the reference's tokens (teacher forcing: every step sees the same
    sequence in both runs), recording every sparse-MoE router's logits and choice in both. It
    returns ``logit_check.check_generation`` of the two (``"check"``), the per-step errors
    (``"errors"``: ``max |logit error| / rms(ref logits)``), both token lists (``"tokens"``:
    the disaggregated run's greedy choice at each step), both tokens/s, and for a dtype other
    than fp32 ``"ref_noise"``: the same error of the reference against itself run in fp32
    (same weights, same tokens), bf16's own deviation for scale. FFN ranks return
    ``{"served": work items}``.
    """
    import copy

    from afd_cupy import adapters
    from afd_cupy.config import TopologyConfig
    from afd_cupy.connector import AFDConnector
    from afd_cupy.wire.dtypes import torch_dtype
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.testing import logit_check

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
        fp32_copy = copy.deepcopy(model).float() if dtype != "float32" else None
        with RouterRecorder(model) as ref_routing:
            ref_tokens, ref_logits, ref_s = greedy_steps(model, prompt, steps)
        recorder = RouterRecorder(model)  # the routers stay (in the proxies) when the experts go
        adapters.disaggregate_attention(model, conn)
        with recorder as afd_routing:
            tokens, logits, afd_s = greedy_steps(model, prompt, steps, forced=ref_tokens)
        conn.announce_shutdown()
        check = logit_check.check_generation(ref_logits, logits, dtype, ref_routing.steps, afd_routing.steps)
        report = {"tokens": tokens, "ref_tokens": ref_tokens, "check": check,
                  "errors": [step["error"] for step in check["steps"]],
                  "tokens_per_s": steps / afd_s, "ref_tokens_per_s": steps / ref_s}
        if fp32_copy is not None:
            fp32_logits = greedy_steps(fp32_copy, prompt, steps, forced=ref_tokens)[1]
            report["ref_noise"] = [logit_check.scaled_error(a, b) for a, b in zip(ref_logits, fp32_logits)]
        return report
    finally:
        conn.close()


class RouterRecorder:
    """Records, per forward pass of ``model``, every sparse-MoE router's ``(logits [T, E],
    topk_ids [T, K])`` in forward order (the router's own choice: the Hugging Face routers
    return ``(logits, weights, ids)``); ``steps`` holds one list per forward, on the CPU once
    the ``with`` block exits. Hooks the router modules, which stay in place (inside the
    proxies) when ``disaggregate_attention`` replaces the blocks. Adds no host synchronization
    while recording (the tensors are kept and copied at exit)."""

    def __init__(self, model):
        from afd_cupy import adapters

        self.routers = [adapters.router_of(block) for _, block in adapters.moe_blocks(model)]
        self.steps: list[list] = []
        self._handles = []
        self._num_calls = 0

    def __enter__(self):
        self._handles = [router.register_forward_hook(self._record) for router in self.routers]
        return self

    def _record(self, module, _inputs, output):
        if not (isinstance(output, tuple) and len(output) == 3):
            raise TypeError(f"router {type(module).__name__} returned {type(output).__name__}, "
                            "expected (logits, weights, ids)")
        if self._num_calls % len(self.routers) == 0:
            self.steps.append([])
        self._num_calls += 1
        self.steps[-1].append((output[0].detach(), output[2].detach()))

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self.steps = [[(logits.float().cpu(), ids.cpu()) for logits, ids in step] for step in self.steps]
        return False


def greedy_steps(model, prompt: torch.Tensor, steps: int, *, forced: list[int] | None = None):
    """Greedy decoding without a KV cache (every step recomputes the sequence): the greedy
    tokens, the last-position logits of every step (CPU), wall seconds. With ``forced``
    (teacher forcing) the sequence grows by ``forced[i]`` after step i instead of by the
    greedy token; the greedy tokens are still returned."""
    import time

    ids, tokens, logits = prompt, [], []
    start = time.perf_counter()
    with torch.no_grad():
        for step in range(steps):
            step_logits = model(ids, use_cache=False).logits[0, -1]
            token = int(step_logits.argmax())
            tokens.append(token)
            logits.append(step_logits.cpu())
            fed = token if forced is None else forced[step]
            ids = torch.cat([ids, torch.tensor([[fed]], device=ids.device)], dim=1)
    return tokens, logits, time.perf_counter() - start
