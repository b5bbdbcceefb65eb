"""Spec builder of ``raw_kernels/attention/dedup_attn_ll.cu``: afd_dedup_dispatch_ll, the
low-latency dedup-mode dispatch (``ConnectorConfig(dedup_dispatch="ll")``;
docs/design/kernels.md), with its grid, shared-memory bound and fit test.

Same arguments, outputs, errors and window bytes as :func:`dedup_dispatch_fused_spec`; only
block 0 ranks the partials by expert (the route tables), the other blocks write the payload
rows after a per-token plan (the row of a (token, rank) cell needs no per-partial ranking).
"""
from __future__ import annotations

import numpy as np

from afd_cupy.kernels import checks, loader
from afd_cupy.kernels.launches import LaunchSpec, launch_spec
from afd_cupy.kernels.specs.dedup_attn import (dedup_dispatch_head_args, dedup_dispatch_tail_args,
                                               dedup_scatter_grid)
from afd_cupy.kernels.specs.limits import KERNEL_LIMITS, MAX_BLOCKS, payload_row_bytes

#: a token's FFN ranks are one 32-bit mask in afd_dedup_dispatch_ll (LL_MAX_FFN_RANKS there)
LL_MAX_FFN_RANKS = 32
#: afd_dedup_dispatch_ll's dynamic shared memory at most (its static arrays take ~4 KiB of the
#: 48 KiB a block gets without an opt-in)
DEDUP_LL_MAX_SHARED_BYTES = 40 * 1024


def dedup_ll_shared_bytes(num_tokens: int, top_k: int, num_experts: int, num_ffn_ranks: int) -> int:
    """Dynamic shared memory of afd_dedup_dispatch_ll: ids, staging rows and weights per partial,
    counts and starts per expert, rank mask and shared rank per token (each padded to 4 words),
    one 16-bit count per warp and expert, one 16-bit row per (token, rank) cell:
    4 * (3 * round_up(T*K, 4) + 2 * E + 2 * round_up(T, 4)) + 16 * E + 2 * T * F."""
    partials4 = (int(num_tokens) * int(top_k) + 3) // 4 * 4
    tokens4 = (int(num_tokens) + 3) // 4 * 4
    return (4 * (3 * partials4 + 2 * int(num_experts) + 2 * tokens4) + 16 * int(num_experts)
            + 2 * int(num_tokens) * int(num_ffn_ranks))


def ll_dedup_dispatch_fits(num_tokens: int, top_k: int, num_experts: int, num_ffn_ranks: int) -> bool:
    """Whether a dedup dispatch of up to ``num_tokens`` tokens can run as afd_dedup_dispatch_ll:
    at most :data:`LL_MAX_FFN_RANKS` FFN ranks, T*K below 2**16 (16-bit counts) and
    :func:`dedup_ll_shared_bytes` within :data:`DEDUP_LL_MAX_SHARED_BYTES` (e.g. T = 128, K = 8,
    E = 256, F = 1: 19.3 KiB; T = 512, K = 8, E = 256, F = 8: 66 KiB, too much)."""
    return (int(num_ffn_ranks) <= LL_MAX_FFN_RANKS and int(num_tokens) * int(top_k) < 2**16
            and dedup_ll_shared_bytes(num_tokens, top_k, num_experts, num_ffn_ranks)
            <= DEDUP_LL_MAX_SHARED_BYTES)


def dedup_ll_grid(num_tokens: int, num_ffn_ranks: int, row_bytes: int = 0,
                  max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_dedup_dispatch_ll: block 0 (plan outputs, route tables) + afd_dedup_scatter's
    grid for the payload rows (:func:`dedup_scatter_grid`); 1 when there is no (token, rank) cell."""
    if int(num_tokens) * int(num_ffn_ranks) == 0:
        return 1
    return 1 + dedup_scatter_grid(num_tokens, num_ffn_ranks, row_bytes, max_blocks)


def dedup_dispatch_ll_spec(*, dtype_code, hidden, num_tokens, hidden_size, topk_ids, topk_weights,
                           top_k, expert_per_rank, num_ffn_ranks, routed_cap, has_shared,
                           expert_counts, expert_start, rank_offsets, verdict, skipped, row_map,
                           shared_rank, num_rows, shared_rows, peer_windows, geo, ring, src_rank,
                           layer_idx, stage_idx, seq_counters, expected, expected_counts,
                           done_counter, status, hdr_flags=0, always_send=0, staging=0,
                           max_tokens=None, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Plan, rows and scatter of one dedup-mode dispatch in ONE kernel with a short critical
    path (afd_dedup_dispatch_ll<DT>). Arguments, outputs (window bytes, ``row_map`` int32 [T, F],
    ``shared_rank`` [T], ``num_rows`` / ``shared_rows`` [F], the plan's ``expert_counts`` /
    ``expert_start`` [E], ``rank_offsets`` [F+1], ``verdict`` [1], ``expected`` int64 [F],
    ``expected_counts`` int32 [F, 3], ``seq_counters``) and latched errors (BAD_EXPERT,
    CAPACITY; an earlier error: nothing sent) exactly as :func:`dedup_dispatch_fused_spec`.
    Dynamic shared memory sized for ``max_tokens`` (default ``num_tokens``); refuses what
    :func:`ll_dedup_dispatch_fits` rejects. Safe in CUDA graph capture. Grid: :func:`dedup_ll_grid`.
    """
    head = dedup_dispatch_head_args(hidden=hidden, num_tokens=num_tokens, hidden_size=hidden_size,
                                    topk_ids=topk_ids, topk_weights=topk_weights, top_k=top_k,
                                    expert_per_rank=expert_per_rank, num_ffn_ranks=num_ffn_ranks)
    num_tokens, top_k = int(head["num_tokens"]), int(head["top_k"])
    num_ffn, epr = int(head["num_ffn_ranks"]), int(head["expert_per_rank"])
    num_experts = num_ffn * epr
    max_tokens = num_tokens if max_tokens is None else int(max_tokens)
    if max_tokens < num_tokens:
        raise ValueError(f"max_tokens={max_tokens} < num_tokens={num_tokens}")
    if not ll_dedup_dispatch_fits(max_tokens, top_k, num_experts, num_ffn):
        raise ValueError(
            f"afd_dedup_dispatch_ll does not fit {max_tokens} tokens, top-{top_k}, {num_experts} "
            f"experts and {num_ffn} FFN ranks (at most {LL_MAX_FFN_RANKS} ranks, T*K < 65536, "
            f"{dedup_ll_shared_bytes(max_tokens, top_k, num_experts, num_ffn)} B of shared memory "
            f"<= {DEDUP_LL_MAX_SHARED_BYTES}): use dedup_dispatch='plan'")
    args = {**head, "routed_cap": checks.count("routed_cap", routed_cap),
            "has_shared": checks.count("has_shared", has_shared, high=1),
            "expert_counts": checks.device_array("expert_counts", expert_counts, np.int32, num_experts),
            "expert_start": checks.device_array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": checks.device_array("rank_offsets", rank_offsets, np.int32, num_ffn + 1),
            "verdict": checks.device_array("verdict", verdict, np.int32, 1),
            "skipped": checks.device_array("skipped", skipped, np.int32, 1),
            **dedup_dispatch_tail_args(
                row_map=row_map, shared_rank=shared_rank, num_rows=num_rows,
                shared_rows=shared_rows, peer_windows=peer_windows, staging=staging, geo=geo,
                ring=ring, always_send=always_send, src_rank=src_rank, layer_idx=layer_idx,
                stage_idx=stage_idx, hdr_flags=hdr_flags, seq_counters=seq_counters,
                expected=expected, expected_counts=expected_counts, done_counter=done_counter,
                num_tokens=num_tokens, num_ffn=num_ffn, epr=epr),
            "status": checks.address("status", status)}
    kernel = loader.get_kernel("attention/dedup_attn_ll.cu", "afd_dedup_dispatch_ll",
                               dtype_code=checks.dtype_code(dtype_code))
    grid = dedup_ll_grid(num_tokens, num_ffn, payload_row_bytes(hidden_size, dtype_code), max_blocks)
    return launch_spec(kernel, grid, KERNEL_LIMITS["SCATTER_THREADS"], args,
                       shared_mem=dedup_ll_shared_bytes(max_tokens, top_k, num_experts, num_ffn))
