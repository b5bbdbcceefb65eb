"""The model side of ``bench_decode``: one Attention replica's decode layers over a KV cache
held on its device, the FFN ranks' expert weights, and the check of the AFD output against
the fp64 reference.

Per layer (``DecodeReplica.attention``), for the ``n`` active requests of the batch (slots
``[0, n)``, see ``decode_batch``): RMSNorm, the QKV projection (``heads`` query heads,
``kv_heads`` key/value heads: grouped-query attention), the new token's K and V written into
the layer's cache at each request's own position, decode attention of the one new query per
request over its own cached positions, the O projection. The attention is
``torch.nn.functional.scaled_dot_product_attention`` with the ``heads // kv_heads`` query
heads of a group as the query rows of their KV head (q ``[n, kv_heads, group, head_dim]``,
K/V ``[n, kv_heads, L, head_dim]``, a boolean mask ``[n, 1, 1, L]`` of each request's
positions ``<= its length``): every cached K/V row is read once, no repeat of the KV heads.
``L`` is the batch's longest length rounded up to 16. On cuda the attention runs on SDPA's
memory-efficient kernel (or its flash and math kernels where that one does not apply), never
on its cuDNN kernel: cuDNN builds an execution plan for every new shape, 66-70 ms each on an
H200 (torch 2.11), and ``L`` changes every 16 steps, so one step in ~16 stalled and the TPOT
p99 was 50-90 ms against a p50 of 6-20 ms (docs/performance.md, Known issues). The cache of a layer is
``[batch, kv_heads, cache_len, head_dim]`` (bf16), filled with random values at the start; a
request that joins finds its prompt's KV already there (prefill runs elsewhere: decode only).

Weights are drawn with a ``torch.Generator`` on the rank's device from the seed, so an
Attention rank can rebuild exactly the global experts of a layer the FFN ranks hold
(:func:`layer_experts`) and check one layer's AFD output against
``afd_cupy.testing.reference.reference_moe`` (fp64 on the CPU, :func:`check_layer`).
"""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_afd  # noqa: E402
import bench_spans as spans  # noqa: E402


@dataclasses.dataclass(frozen=True)
class DecodeDims(bench_afd.Dims):
    """bench_afd's model dimensions plus the key/value heads of grouped-query attention."""

    kv_heads: int = 4

    def __post_init__(self):
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"need hidden % heads == 0 and heads % kv_heads == 0, got hidden={self.hidden}, "
                             f"heads={self.heads}, kv_heads={self.kv_heads}")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def model_config(self, max_tokens: int):
        """The connector's ``ModelConfig`` of this model (bf16, ``max_tokens`` per batch)."""
        from afd_cupy.config import ModelConfig

        return ModelConfig(hidden_size=self.hidden, num_experts=self.experts, top_k=self.top_k,
                           moe_intermediate_size=self.intermediate, num_shared_experts=self.shared,
                           dtype="bfloat16", max_num_batched_tokens=max_tokens, num_layers=self.layers)


def _randn(shape, fan_in: int, device, gen):
    import torch

    return (torch.randn(shape, device=device, generator=gen) * fan_in ** -0.5).to(torch.bfloat16)


def layer_experts(dims: DecodeDims, layer_idx: int, seed: int, device):
    """(global routed experts [E, 2I, H] / [E, H, I], fused shared experts or None) of one
    layer, bf16 on ``device``, from a generator on ``device`` (the same on every rank)."""
    import torch

    from afd_cupy import moe

    gen = torch.Generator(device=device).manual_seed(seed * 1000 + 500 + layer_idx)
    d = dims
    routed = moe.ExpertWeights(w13=_randn((d.experts, 2 * d.intermediate, d.hidden), d.hidden, device, gen),
                               w2=_randn((d.experts, d.hidden, d.intermediate), d.intermediate, device, gen),
                               num_experts=d.experts)
    if not d.shared:
        return routed, None
    inter = d.shared * d.intermediate
    shared = moe.ExpertWeights(w13=_randn((1, 2 * inter, d.hidden), d.hidden, device, gen),
                               w2=_randn((1, d.hidden, inter), inter, device, gen), num_experts=1)
    return routed, shared


def ffn_weights(dims: DecodeDims, ffn_rank: int, expert_per_rank: int, seed: int, device) -> tuple:
    """(per-layer local routed experts of FFN rank ``ffn_rank``, per-layer shared or None)."""
    from afd_cupy import moe

    experts, shared = [], []
    for layer_idx in range(dims.layers):
        routed, fused = layer_experts(dims, layer_idx, seed, device)
        experts.append(moe.local_experts(routed, ffn_rank, expert_per_rank))
        shared.append(fused)
        del routed
    return experts, (shared if dims.shared else None)


def count_nan(experts, shared) -> int:
    """NaNs in an FFN rank's per-layer routed and shared weights (a diagnostic of the check)."""
    import torch

    tensors = [t for layer in list(experts) + list(shared or []) if layer is not None
               for t in (layer.w13, layer.w2)]
    return int(sum(int(torch.isnan(t).sum()) for t in tensors))


def check_layer(dims: DecodeDims, layer_idx: int, seed: int, record: tuple, routed_scaling_factor: float) -> dict:
    """Relative error of one layer's AFD output against the fp64 reference.

    ``record`` = (hidden sent [T, H], topk_ids [T, K], topk_weights [T, K], AFD output [T, H]).
    Returns {"layer", "num_tokens", "rel_err", "num_nan", "tolerance", "ok"}."""
    import torch

    from afd_cupy.testing.reference import reference_moe
    from afd_cupy.testing.scenario_spec import tolerance

    hidden, ids, weights, out = record
    routed, shared = layer_experts(dims, layer_idx, seed, hidden.device)
    ref = reference_moe(hidden, ids, weights, routed, shared, routed_scaling_factor)
    got = out.float().cpu()
    num_nan = int(torch.isnan(got).sum())
    rel = float((got - ref).norm()) / (float(ref.norm()) or 1.0) if num_nan == 0 else float("inf")
    tol = tolerance("bfloat16")
    return {"layer": layer_idx, "num_tokens": int(hidden.shape[0]), "rel_err": rel, "num_nan": num_nan,
            "tolerance": tol, "ok": bool(num_nan == 0 and tuple(got.shape) == tuple(ref.shape) and rel <= tol),
            **(nan_report(hidden, ids, weights, got, ref, dims.experts) if num_nan else {})}


def nan_report(hidden, ids, weights, got, ref, num_experts: int) -> dict:
    """Where a check's NaNs are: in its inputs, its reference, which rows and columns of the
    output, and the experts whose tokens all came back with NaNs."""
    import torch

    ids_cpu, bad = ids.long().cpu(), torch.isnan(got)
    bad_rows = bad.any(dim=1)
    per_expert = [(e, int(bad_rows[(ids_cpu == e).any(dim=1)].sum()), int((ids_cpu == e).any(dim=1).sum()))
                  for e in range(num_experts)]
    return {"nan_in_hidden": int(torch.isnan(hidden.float()).sum()),
            "nan_in_weights": int(torch.isnan(weights.float()).sum()),
            "ids_out_of_range": int(((ids_cpu < 0) | (ids_cpu >= num_experts)).sum()),
            "nan_in_ref": int(torch.isnan(ref).sum()), "rows_with_nan": int(bad_rows.sum()),
            "columns_with_nan": int(bad.any(dim=0).sum()),
            "experts_all_nan": [e for e, nan_rows, rows in per_expert if rows and nan_rows == rows]}


def sdpa_backends(device):
    """The SDPA kernels decode attention may use on ``device``: on cuda every one but cuDNN's
    (module doc: its plan per new shape stalls a step); elsewhere torch's choice."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class DecodeReplica:
    """One replica's decode layers and KV caches (module doc)."""

    def __init__(self, dims: DecodeDims, device, seed: int):
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        h, d = dims.hidden, dims
        qkv_out = (d.heads + 2 * d.kv_heads) * d.head_dim
        self.dims, self.device, self.seed = dims, device, seed
        self.layers = [{"wqkv": _randn((qkv_out, h), h, device, gen), "wo": _randn((h, h), h, device, gen),
                        "wgate": _randn((d.experts, h), h, device, gen)} for _ in range(d.layers)]
        self.k_cache, self.v_cache = [], []
        self.inputs = self.slot_rows = None

    def allocate(self, batch: int, cache_len: int) -> None:
        """Fresh K/V caches [batch, kv_heads, cache_len, head_dim] per layer (random bf16) and
        the per-slot input rows [batch, H]."""
        import torch

        d = self.dims
        self.k_cache = self.v_cache = None  # free the previous phase's caches first
        gen = torch.Generator(device=self.device).manual_seed(self.seed + 1)
        shape = (batch, d.kv_heads, cache_len, d.head_dim)
        self.k_cache = [torch.randn(shape, device=self.device, generator=gen).to(torch.bfloat16)
                        for _ in range(d.layers)]
        self.v_cache = [torch.randn(shape, device=self.device, generator=gen).to(torch.bfloat16)
                        for _ in range(d.layers)]
        self.inputs = torch.randn((batch, d.hidden), device=self.device, generator=gen).to(torch.bfloat16)
        self.slot_rows = torch.arange(batch, device=self.device)

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    def step_inputs(self, kv_lengths: np.ndarray):
        """(x [n, H], positions int64 [n] on the device, mask bool [n, 1, 1, L]) of one step
        (L: the longest length + 1, rounded up to 16: the alignment SDPA's masked kernels want)."""
        import torch

        n = int(kv_lengths.shape[0])
        span = -(-(int(kv_lengths.max()) + 1) // 16) * 16
        span = min(span, self.k_cache[0].shape[2])
        positions = torch.from_numpy(kv_lengths).to(self.device, non_blocking=True)
        mask = torch.arange(span, device=self.device) <= positions[:, None]
        return self.inputs[:n], positions, mask.view(n, 1, 1, span)

    def attention(self, layer_idx: int, x, positions, mask):
        """x [n, H] bf16 -> attention output [n, H]; writes the new K/V at ``positions``."""
        import torch
        import torch.nn.functional as F

        d, w = self.dims, self.layers[layer_idx]
        n, span = x.shape[0], mask.shape[-1]
        qkv = F.linear(F.rms_norm(x, (d.hidden,)), w["wqkv"])
        q, k, v = qkv.split([d.heads * d.head_dim, d.kv_heads * d.head_dim, d.kv_heads * d.head_dim], dim=-1)
        rows = self.slot_rows[:n]
        k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]
        k_cache[rows, :, positions] = k.view(n, d.kv_heads, d.head_dim)
        v_cache[rows, :, positions] = v.view(n, d.kv_heads, d.head_dim)
        with sdpa_backends(x.device):
            out = F.scaled_dot_product_attention(q.view(n, d.kv_heads, d.group, d.head_dim),
                                                 k_cache[:n, :, :span], v_cache[:n, :, :span], attn_mask=mask)
        return F.linear(out.reshape(n, d.hidden), w["wo"])

    def router_input(self, layer_idx: int, x):
        """(normalized hidden to send, router logits [n, E])."""
        import torch.nn.functional as F

        normed = F.rms_norm(x, (self.dims.hidden,))
        return normed, F.linear(normed, self.layers[layer_idx]["wgate"])

    def apply_moves(self, moves) -> None:
        """Mirror the batch's compaction moves in every layer's cache."""
        for move in moves:
            for cache in self.k_cache + self.v_cache:
                cache[move.dst, :, :move.length].copy_(cache[move.src, :, :move.length])


def attention_step(replica: DecodeReplica, kv_lengths: np.ndarray):
    """The Attention side's own work of one decode step without the AFD transport: every
    layer's attention (new K/V written, SDPA over the cache) and router, residual adds; no
    expert call. bench_decode runs it as the other replicas' load on a shared GPU while one
    replica decodes (the co-run solo). Returns the final hidden [n, H]; not synchronized."""
    x, positions, mask = replica.step_inputs(kv_lengths)
    for layer_idx in range(replica.dims.layers):
        x = x + replica.attention(layer_idx, x, positions, mask)
        replica.router_input(layer_idx, x)
    return x


def decode_step(conn, replica: DecodeReplica, kv_lengths: np.ndarray, recorder=None, step_idx: int = 0,
                record_layer: int | None = None, record_blocking: bool = False):
    """All layers of one decode step of the active requests; one synchronization at the end
    (``conn.check_errors()``, which raises latched errors). Returns the final hidden [n, H], and
    with ``record_layer`` also (hidden sent, topk_ids, topk_weights, AFD output) of that layer
    (``record_blocking``: that layer's receive blocks, the others do not).

    ``recorder`` (a ``bench_spans.SpanRecorder``): attention, dispatch and combine spans of
    every layer on the stream lane, tagged ``(step_idx, layer)`` (bench_afd's tags)."""
    x, positions, mask = replica.step_inputs(kv_lengths)
    record = None
    for layer_idx in range(replica.dims.layers):
        if recorder is not None:
            recorder.mark(spans.STREAM, "attention", (step_idx, layer_idx))
        x = x + replica.attention(layer_idx, x, positions, mask)
        normed, logits = replica.router_input(layer_idx, x)
        weights, ids = conn.select_experts(logits)
        if recorder is not None:
            recorder.mark(spans.STREAM, "dispatch", (step_idx, layer_idx))
        handle = conn.send_attn_output(normed, ids, weights, layer_idx)
        if recorder is not None:
            recorder.mark(spans.STREAM, "combine", (step_idx, layer_idx))
        recorded = layer_idx == record_layer
        moe_out = conn.recv_ffn_output(handle, blocking=recorded and record_blocking)
        if recorded:  # copies: what the check reads must not depend on later layers' buffers
            record = (normed.clone(), ids.clone(), weights.clone(), moe_out.clone())
        x = x + moe_out
    if recorder is not None:
        recorder.mark(spans.STREAM, None)
    conn.check_errors()
    return (x, record) if record_layer is not None else x
