"""numpy references of every dedup-mode step (docs/design/dedup.md): the specification the
host twin (:mod:`afd_cupy.routing.dedup`, numba) is tested against, and the one the CUDA kernels are
to be tested against. Straightforward loops and masks; slow; small sizes only.

Arrays are host numpy. ``T`` tokens, ``K`` top-k, ``F`` FFN ranks, ``epr`` experts per rank,
``H`` hidden, ``W = 2 + 2K`` route-table words (``wire.ROUTE_*``), ``R_j`` rows of rank j's
message, ``P_j`` its partials (``routed_tokens``), ``S_j`` its shared rows. Payload rows are
raw words (int16 for bf16/fp16, int32 for fp32) on the wire; reductions take fp32.

| step | runs on | future kernel |
|---|---|---|
| :func:`plan_reference` | Attention | plan (pos, counts, verdict: as ``afd_dispatch_plan``) + rows (row_map, shared_rank, num_rows, shared_rows) |
| :func:`scatter_reference` | Attention | scatter: route table + one payload row per (token, rank) into the peer windows |
| :func:`expand_reference` | FFN | expand: rows -> grouped staging (+ route table copy) |
| :func:`expand_verdict_reference` | FFN | expand: the record its route-table check latches |
| :func:`reduce_reference` | FFN | reduce + reply: grouped outputs -> one reply row per row |
| :func:`combine_reference` | Attention | combine: <= F reply rows per token |
"""
from __future__ import annotations

import numpy as np

from afd_cupy import wire
from afd_cupy.routing import planner
from afd_cupy.routing.dedup import DedupPlan


def plan_reference(topk_ids, num_ffn_ranks: int, expert_per_rank: int, *, has_shared: bool,
                   num_experts: int | None = None) -> DedupPlan:
    """Plan. In: ``topk_ids`` int [T, K] in [0, num_experts). Out (all int32):
    ``pairs`` (pair plan: ``pos`` [T, K] staging row of partial (t, k) on rank ids//epr, i.e.
    its index among that rank's partials sorted stably by (local expert, t*K + k);
    ``expert_counts`` [F*epr]); ``row_map`` [T, F] (-1: t does not go to j); ``shared_rank``
    [T] (first j in t%F, t%F+1, ... (mod F) with any of t's experts; -1 without shared
    experts); ``num_rows`` [F]; ``shared_rows`` [F]. Rows of rank j: tokens with
    shared_rank == j in token order, then the other tokens that go to j in token order."""
    pairs = planner.plan_dispatch_reference(topk_ids, num_ffn_ranks, expert_per_rank, num_experts)
    ids = np.asarray(topk_ids, np.int64).reshape(pairs.num_tokens, pairs.top_k)
    num_tokens = ids.shape[0]
    goes = np.zeros((num_tokens, num_ffn_ranks), bool)
    goes[np.repeat(np.arange(num_tokens), ids.shape[1]), (ids // expert_per_rank).ravel()] = True
    shared_rank = np.full(num_tokens, -1, np.int32)
    if has_shared:
        for t in range(num_tokens):
            cyclic = [(t + step) % num_ffn_ranks for step in range(num_ffn_ranks)]
            shared_rank[t] = next(j for j in cyclic if goes[t, j])
    row_map = np.full((num_tokens, num_ffn_ranks), -1, np.int32)
    for j in range(num_ffn_ranks):
        tokens = np.flatnonzero(goes[:, j])
        is_shared = shared_rank[tokens] == j
        ordered = np.concatenate([tokens[is_shared], tokens[~is_shared]])
        row_map[ordered, j] = np.arange(ordered.size)
    num_rows = goes.sum(axis=0).astype(np.int32)
    shared_rows = np.bincount(shared_rank[shared_rank >= 0], minlength=num_ffn_ranks).astype(np.int32)
    return DedupPlan(num_tokens, ids.shape[1], num_ffn_ranks, expert_per_rank, pairs, row_map,
                     shared_rank, num_rows, shared_rows)


def scatter_reference(plan: DedupPlan, hidden_raw: np.ndarray, topk_ids, topk_weights,
                      ffn_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Scatter, for rank j = ``ffn_rank``. In: ``hidden_raw`` [T, H] raw payload words,
    ``topk_ids`` int [T, K], ``topk_weights`` float [T, K]. Out: ``(route_table`` int32
    [R_j, W], ``rows`` [R_j, H] raw): row r = ``row_map[t, j]`` holds token t: ``table[r] =
    [t, shared_rank[t] == j, pos[t, k] for the k with ids[t, k] // epr == j in k order, -1
    pad to K, fp32 bits of topk_weights[t, k] for the same k, 0 pad]``, ``rows[r] =
    hidden_raw[t]``. The header: ``wire.dispatch_header(..., wire_mode="dedup", num_rows=R_j,
    shared_tokens=S_j, expert_counts=rank_counts(j))``."""
    ids = np.asarray(topk_ids, np.int64)
    weights = np.asarray(topk_weights, np.float32)
    num_rows, top_k, j = int(plan.num_rows[ffn_rank]), plan.top_k, ffn_rank
    table = np.zeros((num_rows, wire.ROUTE_FIXED_WORDS + 2 * top_k), np.int32)
    table[:, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + top_k] = -1
    rows = np.zeros((num_rows, hidden_raw.shape[1]), hidden_raw.dtype)
    for t in np.flatnonzero(plan.row_map[:, j] >= 0):
        r = plan.row_map[t, j]
        mine = [k for k in range(top_k) if ids[t, k] // plan.expert_per_rank == j]
        table[r, wire.ROUTE_TOKEN] = t
        table[r, wire.ROUTE_SHARED] = int(plan.shared_rank[t] == j)
        table[r, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + len(mine)] = plan.pos[t, mine]
        table[r, wire.ROUTE_SLOTS + top_k:wire.ROUTE_SLOTS + top_k + len(mine)] = \
            weights[t, mine].view(np.int32)
        rows[r] = hidden_raw[t]
    return table, rows


def expand_reference(route_table: np.ndarray, rows: np.ndarray, routed_tokens: int) -> np.ndarray:
    """Expand. In: ``route_table`` int32 [R, W] (valid: ``wire.check_route_table``), ``rows``
    [R, H] (raw words or any dtype), ``routed_tokens`` = P. Out: [P, H] same dtype,
    ``out[table[r, 2 + s]] = rows[r]`` for every slot s with ``table[r, 2 + s] >= 0`` (each
    of the P rows written exactly once; the shared inputs are ``rows[:S]``, not copied)."""
    top_k = (route_table.shape[1] - wire.ROUTE_FIXED_WORDS) // 2
    slots = route_table[:, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + top_k]
    src, slot = np.nonzero(slots >= 0)
    out = np.zeros((routed_tokens, rows.shape[1]), rows.dtype)
    out[slots[src, slot]] = rows[src]
    return out


def expand_verdict_reference(route_table: np.ndarray, *, num_tokens: int, routed_tokens: int,
                             shared_tokens: int):
    """What ``afd_dedup_expand`` latches for ``route_table`` (int32 [R, W]): None when
    ``wire.check_route_table`` accepts it, else ``(rule, row, column, expected, observed)``
    (``wire.ROUTE_FAULT_*``; -1 where a word does not apply), the record's ST_CAP, ST_COUNT,
    ST_SLOT, ST_EXPECTED, ST_OBSERVED.

    Per row: the token rule, else the shared rule; per slot s: a staging row after a -1 pad, or
    none in slot 0 (packing), else one >= P (range), else the slot claims its staging row. The
    verdict is the smallest (rule, row, column); a duplicate is reported at the second-smallest
    row claiming a staging row (column: that row's first slot whose row was claimed by an
    earlier row or an earlier slot); with no fault, fewer than P claimed slots is the count rule.
    """
    top_k = (route_table.shape[1] - wire.ROUTE_FIXED_WORDS) // 2
    faults, claims = [], {}
    for r, words in enumerate(np.asarray(route_table, np.int64)):
        token, flag = words[wire.ROUTE_TOKEN], words[wire.ROUTE_SHARED]
        if not 0 <= token < num_tokens:
            faults.append((wire.ROUTE_FAULT_TOKEN, r, wire.ROUTE_TOKEN, num_tokens, int(token)))
        elif flag != int(r < shared_tokens):
            faults.append((wire.ROUTE_FAULT_SHARED, r, wire.ROUTE_SHARED, int(r < shared_tokens),
                           int(flag)))
        slots = words[wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + top_k]
        for s, pos in enumerate(slots):
            column = wire.ROUTE_SLOTS + s
            if (pos >= 0 and (slots[:s] < 0).any()) or (s == 0 and pos < 0):
                faults.append((wire.ROUTE_FAULT_PACKING, r, column, -1, int(pos)))
            elif pos >= routed_tokens:
                faults.append((wire.ROUTE_FAULT_RANGE, r, column, routed_tokens, int(pos)))
            elif pos >= 0:
                claims.setdefault(int(pos), []).append(r)
    duplicates = [sorted(rows)[1] for rows in claims.values() if len(rows) > 1]
    if duplicates:
        r = min(duplicates)
        slots = route_table[r, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + top_k]
        for s, pos in enumerate(slots):
            if not 0 <= pos < routed_tokens:
                break
            owner = min(claims[int(pos)])
            if owner < r or (slots[:s] == pos).any():
                faults.append((wire.ROUTE_FAULT_DUPLICATE, r, wire.ROUTE_SLOTS + s, owner, int(pos)))
                break
    if faults:
        return min(faults)
    num_claimed = int(((route_table[:, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + top_k] >= 0)
                       & (route_table[:, wire.ROUTE_SLOTS:wire.ROUTE_SLOTS + top_k] < routed_tokens)).sum())
    if num_claimed != routed_tokens:
        return (wire.ROUTE_FAULT_COUNT, -1, -1, routed_tokens, num_claimed)
    return None


def reduce_reference(route_table: np.ndarray, routed_out: np.ndarray,
                     shared_out: np.ndarray | None) -> np.ndarray:
    """Reduce. In: ``route_table`` int32 [R, W]; ``routed_out`` [P, H] and ``shared_out``
    [S, H] or None, the worker's outputs (``moe.apply_routed_scaling`` applied: routed x f for
    bf16/fp32, shared / f for fp16) in any float dtype. Out: fp32 [R, H], ``out[r] = sum over
    the slots s of row r in order of fp32(w_s) * fp32(routed_out[pos_s]) (+ fp32(shared_out[r])
    when r < S)``, each product and sum rounded to fp32 (no FMA assumed; the kernel may fuse,
    within 1 ulp per term). The reply row is this rounded once to the reply dtype."""
    top_k = (route_table.shape[1] - wire.ROUTE_FIXED_WORDS) // 2
    hidden = routed_out.shape[1]
    weights = np.ascontiguousarray(route_table[:, wire.ROUTE_SLOTS + top_k:]).view(np.float32)
    routed = np.asarray(routed_out, np.float32)
    out = np.zeros((route_table.shape[0], hidden), np.float32)
    for r in range(route_table.shape[0]):
        for s in range(top_k):
            pos = route_table[r, wire.ROUTE_SLOTS + s]
            if pos < 0:
                break
            out[r] += weights[r, s] * routed[pos]
        if shared_out is not None and r < shared_out.shape[0]:
            out[r] += np.asarray(shared_out[r], np.float32)
    return out


def combine_reference(row_map: np.ndarray, reply_rows, out_scale: float = 1.0) -> np.ndarray:
    """Combine. In: ``row_map`` int32 [T, F]; ``reply_rows[j]`` [R_j, H] any float dtype (the
    reply rows of rank j, decoded); ``out_scale`` (``moe.combine_scale``: f for fp16, else 1).
    Out: fp32 [T, H], ``out[t] = out_scale * sum over j = 0..F-1 with row_map[t, j] >= 0 of
    fp32(reply_rows[j][row_map[t, j]])``, summed in rank order; the caller rounds once to the
    payload dtype."""
    num_tokens = row_map.shape[0]
    hidden = next(np.asarray(rows).shape[1] for rows in reply_rows)
    out = np.zeros((num_tokens, hidden), np.float32)
    for t in range(num_tokens):
        for j in range(row_map.shape[1]):
            if row_map[t, j] >= 0:
                out[t] += np.asarray(reply_rows[j][row_map[t, j]], np.float32)
    return out * np.float32(out_scale)
