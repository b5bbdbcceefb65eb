"""Host routing planners (numba) and their numpy references.

One stable sort of the flattened ``topk_ids`` by global expert gives both groupings the wire
needs: segments by destination FFN rank (experts of rank r are contiguous) and, inside a
segment, rows grouped by local expert in token order. The numba planner is a counting sort
(O(T*K + E)); the numpy reference is ``argsort(kind="stable")``; tests hold them equal.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np


@dataclass(frozen=True)
class DispatchPlan:
    """Routing of ``num_tokens x top_k`` partials onto ``num_ffn_ranks`` ranks.

    - ``order``: int32 [T*K], flat partial index ``t*K + k`` in wire order.
    - ``route_table``: int32 [T*K, 2], (token index, top-k slot) in wire order.
    - ``expert_counts``: int32 [F*epr], partials per (padded) global expert.
    - ``rank_offsets``: int32 [F+1], segment of rank r is ``order[rank_offsets[r]:rank_offsets[r+1]]``.
    - ``pos``: int32 [T, K], row of partial (t, k) inside its destination rank's segment.
    """

    num_tokens: int
    top_k: int
    num_ffn_ranks: int
    expert_per_rank: int
    order: np.ndarray
    route_table: np.ndarray
    expert_counts: np.ndarray
    rank_offsets: np.ndarray
    pos: np.ndarray

    def routed_count(self, ffn_rank: int) -> int:
        return int(self.rank_offsets[ffn_rank + 1] - self.rank_offsets[ffn_rank])

    def rank_counts(self, ffn_rank: int) -> np.ndarray:
        """int32 [epr]: partials per local expert of ``ffn_rank`` (the group list)."""
        epr = self.expert_per_rank
        return self.expert_counts[ffn_rank * epr:(ffn_rank + 1) * epr]

    def rank_route_table(self, ffn_rank: int) -> np.ndarray:
        return self.route_table[self.rank_offsets[ffn_rank]:self.rank_offsets[ffn_rank + 1]]


def _check_ids(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    ids = np.asarray(topk_ids)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids must be [num_tokens, top_k], got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"topk_ids must be an integer array, got dtype {ids.dtype}")
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"topk_ids values must lie in [0, {num_experts}), got min={low} max={high}")
    return np.ascontiguousarray(ids, dtype=np.int32)


@numba.njit(cache=True, nogil=True)
def _counting_plan(flat_ids, top_k, num_padded, epr, num_ffn_ranks):
    num_partials = flat_ids.shape[0]
    counts = np.zeros(num_padded, np.int32)
    for i in range(num_partials):
        counts[flat_ids[i]] += 1
    cursor = np.empty(num_padded, np.int32)
    running = 0
    for e in range(num_padded):
        cursor[e] = running
        running += counts[e]
    rank_offsets = np.empty(num_ffn_ranks + 1, np.int32)
    for r in range(num_ffn_ranks + 1):
        rank_offsets[r] = cursor[r * epr] if r < num_ffn_ranks else num_partials
    order = np.empty(num_partials, np.int32)
    route_table = np.empty((num_partials, 2), np.int32)
    pos = np.empty(num_partials, np.int32)
    for i in range(num_partials):
        e = flat_ids[i]
        slot = cursor[e]
        cursor[e] = slot + 1
        order[slot] = i
        route_table[slot, 0] = i // top_k
        route_table[slot, 1] = i % top_k
        pos[i] = slot - rank_offsets[e // epr]
    return order, route_table, counts, rank_offsets, pos


def plan_dispatch(topk_ids, num_ffn_ranks: int, expert_per_rank: int,
                  num_experts: int | None = None) -> DispatchPlan:
    """Numba counting-sort planner. ``topk_ids``: int [T, K] numpy (host)."""
    num_padded = num_ffn_ranks * expert_per_rank
    ids = _check_ids(topk_ids, num_experts if num_experts is not None else num_padded)
    num_tokens, top_k = ids.shape
    order, route_table, counts, rank_offsets, pos = _counting_plan(
        ids.reshape(-1), top_k, num_padded, expert_per_rank, num_ffn_ranks)
    return DispatchPlan(num_tokens, top_k, num_ffn_ranks, expert_per_rank, order, route_table,
                        counts, rank_offsets, pos.reshape(num_tokens, top_k))


def plan_dispatch_reference(topk_ids, num_ffn_ranks: int, expert_per_rank: int,
                            num_experts: int | None = None) -> DispatchPlan:
    """numpy reference of :func:`plan_dispatch` (stable argsort)."""
    num_padded = num_ffn_ranks * expert_per_rank
    ids = _check_ids(topk_ids, num_experts if num_experts is not None else num_padded)
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    counts = np.bincount(flat, minlength=num_padded).astype(np.int32)
    rank_sums = counts.reshape(num_ffn_ranks, expert_per_rank).sum(axis=1)
    rank_offsets = np.concatenate([[0], np.cumsum(rank_sums)]).astype(np.int32)
    route_table = np.stack([order // top_k, order % top_k], axis=1).astype(np.int32)
    pos = np.empty(flat.shape[0], np.int32)
    pos[order] = np.arange(flat.shape[0], dtype=np.int32) - rank_offsets[flat[order] // expert_per_rank]
    return DispatchPlan(num_tokens, top_k, num_ffn_ranks, expert_per_rank, order,
                        route_table.reshape(-1, 2), counts, rank_offsets,
                        pos.reshape(num_tokens, top_k))


def shared_split(num_tokens: int, num_ffn_ranks: int, ffn_rank: int) -> np.ndarray:
    """int32 token indices of ``ffn_rank``'s round-robin shared slice: ``arange(r, T, F)``."""
    return np.arange(ffn_rank, num_tokens, num_ffn_ranks, dtype=np.int32)


def shared_count(num_tokens: int, num_ffn_ranks: int, ffn_rank: int) -> int:
    """``len(shared_split(...))`` without building it."""
    return max(0, -(-(num_tokens - ffn_rank) // num_ffn_ranks))


@numba.njit(cache=True, nogil=True)
def _combine_kernel(out, topk_ids, topk_weights, pos, epr, routed, rank_base,
                    shared, shared_base, num_ffn_ranks, use_shared, out_scale):
    num_tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    for t in range(num_tokens):
        acc = np.zeros(hidden, np.float32)
        for k in range(top_k):
            row = rank_base[topk_ids[t, k] // epr] + pos[t, k]
            w = topk_weights[t, k]
            for h in range(hidden):
                acc[h] += w * routed[row, h]
        if use_shared:
            srow = shared_base[t % num_ffn_ranks] + t // num_ffn_ranks
            for h in range(hidden):
                acc[h] += shared[srow, h]
        for h in range(hidden):
            out[t, h] = acc[h] * out_scale


def combine(out, topk_ids, topk_weights, plan_pos, expert_per_rank: int, routed_rows,
            shared_rows=None, out_scale: float = 1.0):
    """Numba combine into ``out`` fp32 [T, H]: ``out[t] = s*(sum_k w[t,k]*reply(t,k) + shared(t))``.

    ``routed_rows[r]``: fp32 [routed_count(r), H] replies of FFN rank r in wire order;
    ``shared_rows[r]``: fp32 [shared_count(r), H] or None. Deterministic (fixed k order).
    """
    num_ffn_ranks = len(routed_rows)
    hidden = out.shape[1]
    routed, rank_base = _stack_rows(routed_rows, hidden)
    use_shared = shared_rows is not None
    shared, shared_base = _stack_rows(shared_rows if use_shared else [], hidden)
    if not use_shared:
        shared_base = np.zeros(num_ffn_ranks, np.int64)
    _combine_kernel(out, np.ascontiguousarray(topk_ids, np.int32),
                    np.ascontiguousarray(topk_weights, np.float32), np.ascontiguousarray(plan_pos, np.int32),
                    expert_per_rank, routed, rank_base, shared, shared_base, num_ffn_ranks,
                    use_shared, np.float32(out_scale))
    return out


def _stack_rows(rows_per_rank, hidden):
    sizes = [r.shape[0] for r in rows_per_rank]
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sizes else np.zeros(0, np.int64)
    stacked = (np.concatenate([np.asarray(r, np.float32).reshape(-1, hidden) for r in rows_per_rank])
               if sizes else np.zeros((0, hidden), np.float32))
    return np.ascontiguousarray(stacked), base


def combine_reference(topk_ids, topk_weights, plan_pos, expert_per_rank: int, routed_rows,
                      shared_rows=None, out_scale: float = 1.0) -> np.ndarray:
    """numpy reference of :func:`combine`; returns fp32 [T, H]."""
    topk_ids = np.asarray(topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_ffn_ranks = len(routed_rows)
    hidden = routed_rows[0].shape[1] if routed_rows else 0
    out = np.zeros((num_tokens, hidden), np.float32)
    for t in range(num_tokens):
        for k in range(top_k):
            rank = int(topk_ids[t, k]) // expert_per_rank
            out[t] += np.float32(topk_weights[t, k]) * np.asarray(routed_rows[rank][plan_pos[t, k]], np.float32)
        if shared_rows is not None:
            out[t] += np.asarray(shared_rows[t % num_ffn_ranks][t // num_ffn_ranks], np.float32)
    return out * np.float32(out_scale)


def warm_up() -> None:
    """Run both numba steps once on tiny inputs, so that the first dispatch and combine do not
    pay numba's first-call cost (loading the on-disk cache, or compiling; ~0.3 s per process
    with a warm cache here) inside a wait bounded by ``peer_timeout_s``."""
    plan = plan_dispatch(np.array([[0, 1]], np.int32), 2, 1)
    rows = [np.zeros((1, 1), np.float32)] * 2
    combine(np.empty((1, 1), np.float32), np.array([[0, 1]], np.int32),
            np.ones((1, 2), np.float32), plan.pos, 1, rows, rows)
