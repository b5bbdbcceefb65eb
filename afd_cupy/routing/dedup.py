"""The dedup wire mode's host steps in numba (docs/design/dedup.md).

A token crosses the link once per FFN rank that owns at least one of its top-k experts, not
once per expert. Steps, named as the future kernels (numpy references of each, with their
specs: :mod:`afd_cupy.testing.dedup_reference`):

- Attention, :func:`plan_dedup`: the pair plan (``pos``: each partial's row in its rank's
  grouped-by-local-expert order, ``expert_counts``) plus ``row_map[t, j]`` (row of token t in
  FFN rank j's message, -1 when t does not go to j) and ``shared_rank[t]`` (the rank that runs
  token t's shared experts: the first of ``t mod F, t mod F + 1, ...`` that t goes to).
- Attention, :func:`route_table`: the route table of one rank's message (scatter).
- FFN, :func:`expand`: received rows -> local staging grouped by local expert (the layout the
  pair mode has in its window, so the grouped GEMM is unchanged).
- FFN, :func:`reduce_rows`: expert outputs -> one reply row per received row, fp32.
- Attention, :func:`combine_rows`: at most F reply rows per token, fp32.

:func:`wire_bytes` reports the bytes a dispatch and its replies put on the wire in either mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from afd_cupy import wire
from afd_cupy.routing import planner


@dataclass(frozen=True)
class DedupPlan:
    """Routing of ``num_tokens x top_k`` partials in dedup mode (host numpy, int32).

    - ``pairs``: the pair-mode :class:`planner.DispatchPlan` of the same ids: ``pos[t, k]`` is
      the staging row of partial (t, k) on its rank, ``expert_counts`` the group sizes.
    - ``row_map``: [T, F], row of token t in rank j's message, -1 when t does not go to j.
      Rows of one message: the tokens whose shared experts run there first, then the others,
      each group in token order.
    - ``shared_rank``: [T], rank running token t's shared experts; -1 without shared experts.
    - ``num_rows``: [F] rows of each rank's message; ``shared_rows``: [F] shared rows among them.
    """

    num_tokens: int
    top_k: int
    num_ffn_ranks: int
    expert_per_rank: int
    pairs: planner.DispatchPlan
    row_map: np.ndarray
    shared_rank: np.ndarray
    num_rows: np.ndarray
    shared_rows: np.ndarray

    @property
    def pos(self) -> np.ndarray:
        return self.pairs.pos

    def routed_count(self, ffn_rank: int) -> int:
        """Partials (expanded rows) of ``ffn_rank``: the header's ``routed_tokens``."""
        return self.pairs.routed_count(ffn_rank)

    def rank_counts(self, ffn_rank: int) -> np.ndarray:
        """int32 [epr]: partials per local expert of ``ffn_rank`` (the group list)."""
        return self.pairs.rank_counts(ffn_rank)

    def rank_tokens(self, ffn_rank: int) -> np.ndarray:
        """int32 [num_rows[ffn_rank]]: the token of each row of ``ffn_rank``'s message."""
        column = self.row_map[:, ffn_rank]
        sent = np.flatnonzero(column >= 0)
        tokens = np.empty(int(self.num_rows[ffn_rank]), np.int32)
        tokens[column[sent]] = sent
        return tokens


@numba.njit(cache=True, nogil=True)
def _rows_plan(ids, epr, num_ffn_ranks, has_shared):
    num_tokens, top_k = ids.shape
    goes = np.zeros((num_tokens, num_ffn_ranks), np.uint8)
    for t in range(num_tokens):
        for k in range(top_k):
            goes[t, ids[t, k] // epr] = 1
    shared_rank = np.full(num_tokens, -1, np.int32)
    shared_rows = np.zeros(num_ffn_ranks, np.int32)
    if has_shared:
        for t in range(num_tokens):
            for step in range(num_ffn_ranks):
                j = (t + step) % num_ffn_ranks
                if goes[t, j]:
                    shared_rank[t] = j
                    shared_rows[j] += 1
                    break
    shared_cursor = np.zeros(num_ffn_ranks, np.int32)
    other_cursor = shared_rows.copy()  # the other rows follow the shared block
    row_map = np.full((num_tokens, num_ffn_ranks), -1, np.int32)
    for t in range(num_tokens):
        for j in range(num_ffn_ranks):
            if not goes[t, j]:
                continue
            if shared_rank[t] == j:
                row_map[t, j] = shared_cursor[j]
                shared_cursor[j] += 1
            else:
                row_map[t, j] = other_cursor[j]
                other_cursor[j] += 1
    return row_map, shared_rank, other_cursor, shared_rows


def plan_dedup(topk_ids, num_ffn_ranks: int, expert_per_rank: int, num_experts: int | None = None,
               *, has_shared: bool) -> DedupPlan:
    """Numba dedup planner. ``topk_ids``: int [T, K] numpy (host), values in
    ``[0, num_experts)`` (ValueError otherwise, from :func:`planner.plan_dispatch`)."""
    pairs = planner.plan_dispatch(topk_ids, num_ffn_ranks, expert_per_rank, num_experts)
    ids = np.ascontiguousarray(topk_ids, np.int32).reshape(pairs.num_tokens, pairs.top_k)
    row_map, shared_rank, num_rows, shared_rows = _rows_plan(ids, expert_per_rank, num_ffn_ranks,
                                                             bool(has_shared))
    return DedupPlan(pairs.num_tokens, pairs.top_k, num_ffn_ranks, expert_per_rank, pairs, row_map,
                     shared_rank, num_rows, shared_rows)


@numba.njit(cache=True, nogil=True)
def _fill_route_table(table, ids, weight_bits, pos, row_map, shared_rank, ffn_rank, epr):
    num_tokens, top_k = ids.shape
    for t in range(num_tokens):
        row = row_map[t, ffn_rank]
        if row < 0:
            continue
        table[row, 0] = t
        table[row, 1] = 1 if shared_rank[t] == ffn_rank else 0
        for s in range(top_k):
            table[row, 2 + s] = -1
            table[row, 2 + top_k + s] = 0
        slot = 0
        for k in range(top_k):
            if ids[t, k] // epr == ffn_rank:
                table[row, 2 + slot] = pos[t, k]
                table[row, 2 + top_k + slot] = weight_bits[t, k]
                slot += 1


def route_table(plan: DedupPlan, topk_ids, topk_weights, ffn_rank: int) -> np.ndarray:
    """int32 [num_rows[ffn_rank], 2 + 2K]: the route table of ``ffn_rank``'s message
    (wire.ROUTE_*): token, shared flag, the staging rows ``pos[t, k]`` of the token's partials
    on this rank in top-k order (-1 pad), their fp32 gate weights as raw bits (0 pad).

    ``topk_ids``: int [T, K]; ``topk_weights``: float [T, K] (rounded to fp32 here).
    """
    top_k = plan.top_k
    table = np.empty((int(plan.num_rows[ffn_rank]), wire.ROUTE_FIXED_WORDS + 2 * top_k), np.int32)
    ids = np.ascontiguousarray(topk_ids, np.int32).reshape(plan.num_tokens, top_k)
    bits = np.ascontiguousarray(topk_weights, np.float32).reshape(plan.num_tokens, top_k).view(np.int32)
    _fill_route_table(table, ids, bits, plan.pos, plan.row_map, plan.shared_rank, ffn_rank,
                      plan.expert_per_rank)
    return table


@numba.njit(cache=True, nogil=True)
def _expand(staging, table, rows, top_k):
    for r in range(table.shape[0]):
        for s in range(top_k):
            dst = table[r, 2 + s]
            if dst < 0:
                break
            staging[dst, :] = rows[r, :]


def expand(table: np.ndarray, rows: np.ndarray, routed_tokens: int,
           out: np.ndarray | None = None) -> np.ndarray:
    """FFN side: [routed_tokens, H] (``rows``' dtype): row ``pos`` of each slot of route-table
    row r is a copy of ``rows[r]``, i.e. the rows grouped by local expert in token order, as
    pair mode's ``routed_x``. ``table``: int32 [R, 2 + 2K] checked by
    :func:`wire.check_route_table` (every staging row is written exactly once). ``out``: the
    staging to fill ([routed_tokens, H], ``rows``' dtype); a new array when None."""
    top_k = (table.shape[1] - wire.ROUTE_FIXED_WORDS) // 2
    staging = np.empty((routed_tokens, rows.shape[1]), rows.dtype) if out is None else out
    if staging.shape != (routed_tokens, rows.shape[1]) or staging.dtype != rows.dtype:
        raise ValueError(f"staging must be [{routed_tokens}, {rows.shape[1]}] {rows.dtype}, got "
                         f"{staging.shape} {staging.dtype}")
    if routed_tokens:
        _expand(staging, table, rows, top_k)
    return staging


@numba.njit(cache=True, nogil=True)
def _reduce(out, table, weights, routed, shared, num_shared):
    hidden = out.shape[1]
    top_k = weights.shape[1]
    for r in range(out.shape[0]):
        acc = np.zeros(hidden, np.float32)
        for s in range(top_k):
            src = table[r, 2 + s]
            if src < 0:
                break
            w = weights[r, s]
            for h in range(hidden):
                acc[h] += w * routed[src, h]
        if r < num_shared:
            for h in range(hidden):
                acc[h] += shared[r, h]
        for h in range(hidden):
            out[r, h] = acc[h]


def reduce_rows(table: np.ndarray, routed_out: np.ndarray, shared_out: np.ndarray | None,
                out: np.ndarray | None = None) -> np.ndarray:
    """FFN side: fp32 [R, H], ``out[r] = sum_s w_s * routed_out[pos_s] + shared_out[r]`` (the
    shared term for r < len(shared_out) only), accumulated in fp32 in the route table's slot
    order (= top-k order, as the pair combine). ``routed_out``: fp32 [routed_tokens, H] in
    staging order, ``shared_out``: fp32 [shared_tokens, H] or None; both already carry the
    FFN-side routed-scaling rule (``moe.apply_routed_scaling``). The caller rounds once to
    the reply dtype. ``out``: fp32 [R, H] to fill; a new array when None."""
    top_k = (table.shape[1] - wire.ROUTE_FIXED_WORDS) // 2
    hidden = routed_out.shape[1]
    weights = np.ascontiguousarray(table[:, wire.ROUTE_SLOTS + top_k:]).view(np.float32)
    shared = np.zeros((0, hidden), np.float32) if shared_out is None else shared_out
    out = np.empty((table.shape[0], hidden), np.float32) if out is None else out
    _reduce(out, table, weights, np.ascontiguousarray(routed_out, np.float32),
            np.ascontiguousarray(shared, np.float32), shared.shape[0])
    return out


@numba.njit(cache=True, nogil=True)
def _combine(out, row_map, rows, rank_base, out_scale):
    num_tokens, num_ffn_ranks = row_map.shape
    hidden = out.shape[1]
    for t in range(num_tokens):
        acc = np.zeros(hidden, np.float32)
        for j in range(num_ffn_ranks):
            row = row_map[t, j]
            if row < 0:
                continue
            for h in range(hidden):
                acc[h] += rows[rank_base[j] + row, h]
        for h in range(hidden):
            out[t, h] = acc[h] * out_scale


def combine_rows(out: np.ndarray, row_map: np.ndarray, reply_rows, out_scale: float = 1.0) -> np.ndarray:
    """Attention side, into ``out`` fp32 [T, H]: ``out[t] = out_scale * sum_j reply_rows[j][
    row_map[t, j]]`` over the ranks t went to, in rank order, in fp32. ``reply_rows[j]``: fp32
    [num_rows[j], H] (empty for a rank not sent to). Deterministic."""
    hidden = out.shape[1]
    sizes = [rows.shape[0] for rows in reply_rows]
    rank_base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    stacked = np.ascontiguousarray(np.concatenate([np.asarray(r, np.float32).reshape(-1, hidden)
                                                   for r in reply_rows]))
    _combine(out, np.ascontiguousarray(row_map, np.int32), stacked, rank_base, np.float32(out_scale))
    return out


def warm_up() -> None:
    """Run every numba step once on tiny inputs, so that a connector's first dispatch or item
    does not pay the compilation (or the on-disk cache load, ~0.1 s per function): a first
    item would otherwise be late by that much against ``peer_timeout_s``."""
    ids = np.array([[0, 1]], np.int32)
    plan = plan_dedup(ids, 2, 1, has_shared=True)
    table = route_table(plan, ids, np.ones((1, 2), np.float32), 0)
    for dtype in (np.int16, np.int32):
        expand(table, np.zeros((1, 1), dtype), 1)
    reply = reduce_rows(table, np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))
    combine_rows(np.empty((1, 1), np.float32), plan.row_map, [reply, reply])


# --- bytes on the wire ---------------------------------------------------------------------
@dataclass(frozen=True)
class WireBytes:
    """Bytes one dispatch puts on the wire: ``dispatch`` (Attention -> FFN, all ranks) and
    ``reply`` (FFN -> Attention), fields + headers + flags; ``messages``: messages each way."""

    dispatch: int
    reply: int
    messages: int


def wire_bytes(layout: wire.WindowLayout, topk_ids, *, num_ffn_ranks: int, has_shared: bool,
               always_send: bool = False) -> WireBytes:
    """Bytes of one dispatch of ``topk_ids`` (int [T, K] host) and its replies in
    ``layout.wire_mode`` (:meth:`wire.WindowLayout.message_bytes` per message sent)."""
    ids = np.asarray(topk_ids)
    num_tokens = ids.shape[0]
    epr = layout.expert_per_rank
    dispatch = reply = messages = 0
    if layout.is_dedup:
        plan = plan_dedup(ids, num_ffn_ranks, epr, has_shared=has_shared)
        sizes = [dict(num_rows=int(plan.num_rows[j])) for j in range(num_ffn_ranks)]
    else:
        pairs = planner.plan_dispatch(ids, num_ffn_ranks, epr)
        sizes = [dict(routed_tokens=pairs.routed_count(j),
                      shared_tokens=planner.shared_count(num_tokens, num_ffn_ranks, j) if has_shared else 0)
                 for j in range(num_ffn_ranks)]
    for size in sizes:
        if not any(size.values()) and not always_send:
            continue  # empty messages are not sent
        dispatch += layout.message_bytes(reply=False, **size)
        reply += layout.message_bytes(reply=True, **size)
        messages += 1
    return WireBytes(dispatch, reply, messages)
