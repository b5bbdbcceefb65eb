"""Host backend, dedup wire mode: the steps of the host paths that differ from pair mode
(docs/design/dedup.md). Plain functions over the rank's shared
:class:`~afd_cupy.backends.host.HostRank` (context, window, seq counters) and what the
calling path passes explicitly (the reply wait, the FFN side's route-table copies).

Attention: plan (:func:`dedup.plan_dedup`) -> scatter (route table + one row per (token,
rank)); wait replies (the pair-mode wait and checks, plus ``num_rows``) -> combine
(:func:`dedup.combine_rows`). FFN: item views expand the rows into local grouped staging
(:func:`dedup.expand`); the reply reduces the worker's outputs per row
(:func:`dedup.reduce_rows`) and sends one row per received row.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from afd_cupy import errors, wire
from afd_cupy.backends.base import Arrival, ItemViews, superseded
from afd_cupy.errors import ProtocolError
from afd_cupy.routing import dedup
from afd_cupy.runtime.topology import Role
from afd_cupy.wire.dtypes import raw_to_f32, raw_to_torch, torch_to_raw


# --- Attention side: plan -> scatter ----------------------------------------------------
def dispatch(rank, state, ids: np.ndarray, hidden: torch.Tensor, topk_weights: torch.Tensor,
             *, layer_idx: int, stage_idx: int, ring: int):
    """``rank``: the HostRank; ``state``: a HostSendState with nothing sent yet; ``ids``:
    int32 [T, K] in range. Returns ``state``, filled in."""
    ctx, layout = rank.ctx, rank.layout
    num_ffn, num_tokens = ctx.num_ffn_ranks, hidden.shape[0]
    plan = dedup.plan_dedup(ids, num_ffn, layout.expert_per_rank, ctx.num_experts,
                            has_shared=ctx.has_shared)
    state.shared_counts = plan.shared_rows.astype(np.int64)
    try:  # every check before any write: an overflowing dispatch sends nothing
        for j in range(num_ffn):
            wire.check_capacity(layout, num_tokens=num_tokens, routed_tokens=plan.routed_count(j),
                                shared_tokens=int(plan.shared_rows[j]), peer=j, nothing_sent=True,
                                layer_idx=layer_idx)
    except errors.CapacityError as exc:
        state.error = exc
        return state
    raw = torch_to_raw(hidden.detach(), ctx.dtype).reshape(num_tokens, layout.hidden_size)
    weights = topk_weights.detach().to(torch.float32).numpy()
    for j in range(num_ffn):
        if plan.num_rows[j] == 0 and not ctx.always_send:
            continue  # empty message: not sent, not waited on
        state.expected[j] = rank.seqs.advance((j, ring))
        table = dedup.route_table(plan, ids, weights, j)
        header = wire.dispatch_header(
            seq=int(state.expected[j]), src_rank=ctx.role_rank, layer_idx=layer_idx,
            stage_idx=stage_idx, num_tokens=num_tokens, shared_tokens=int(plan.shared_rows[j]),
            top_k=plan.top_k, expert_counts=plan.rank_counts(j), wire_mode="dedup",
            num_rows=int(plan.num_rows[j]))
        fields = {"route_table": table, "routed_x": raw[table[:, wire.ROUTE_TOKEN]]}
        rank.link.write_message(ctx.peer_pe(Role.FFN, j), ctx.role_rank, ring,
                                wire.encode_header(header, layout.expert_per_rank),
                                int(state.expected[j]), fields)
    state.plan = plan
    return state


# --- Attention side: wait_replies -> combine --------------------------------------------
def combine(rank, state, wait_reply, *, ring: int, layer_idx: int, stage_idx: int,
            out_scale: float) -> torch.Tensor:
    """``wait_reply(want, ring, deadline)``: the Attention path's reply wait (pair mode's)."""
    ctx, plan, hidden = rank.ctx, state.plan, rank.layout.hidden_size
    deadline = time.monotonic() + ctx.peer_timeout_s
    reply_rows = []
    for j in range(ctx.num_ffn_ranks):
        if state.expected[j] == 0:
            reply_rows.append(np.zeros((0, hidden), np.float32))
            continue
        want = wire.ReplyExpectation(
            peer=j, seq=int(state.expected[j]), layer_idx=layer_idx, stage_idx=stage_idx,
            routed_tokens=plan.routed_count(j), shared_tokens=int(plan.shared_rows[j]),
            num_rows=int(plan.num_rows[j]))
        header = wait_reply(want, ring, deadline)
        reply_rows.append(rank.rows(j, ring, "routed_x", header.num_rows))
    out = np.full((plan.num_tokens, hidden), np.nan, np.float32)
    if plan.num_tokens:
        dedup.combine_rows(out, plan.row_map, reply_rows, out_scale)
    return torch.from_numpy(out).to(ctx.torch_dtype)


# --- FFN side -----------------------------------------------------------------------------
def item_views(rank, tables: dict, arrival: Arrival) -> ItemViews:
    """Validate the route table, keep a copy for the reply in ``tables`` (slot -> (seq,
    table)), expand the rows into new grouped staging; the shared rows are a view of the
    first ``shared_tokens`` rows."""
    header, layout, window = arrival.header, rank.layout, rank.window
    region, ring, pe = arrival.region, arrival.ring, window.own_pe
    table = np.array(window.field(pe, region, ring, "route_table", np.int32,
                                  (header.num_rows, layout.route_width)))
    try:
        wire.check_route_table(table, num_tokens=header.num_tokens, routed_tokens=header.routed_tokens,
                               shared_tokens=header.shared_tokens, top_k=layout.top_k)
    except errors.WireError as exc:  # read while the sender's next message landed?
        moved_on = superseded(arrival, int(window.flag_view(pe, region, ring)[0]), exc)
        if moved_on is not None:
            raise moved_on from exc
        raise
    rows = window.field(pe, region, ring, "routed_x", rank.raw,
                        (header.num_rows, layout.hidden_size))
    staging = dedup.expand(table, rows, header.routed_tokens)
    # NOTE: the reply reduces through this copy, not the window: a sender that timed out
    # and re-sent on this slot cannot change the route table under the item
    tables[layout.slot_index(region, ring)] = (header.seq, table)
    return ItemViews(routed_x=raw_to_torch(staging, rank.ctx.dtype),
                     shared_x=raw_to_torch(rows[:header.shared_tokens], rank.ctx.dtype),
                     route_table=torch.from_numpy(table),
                     group_counts=torch.tensor(header.expert_counts, dtype=torch.int32))


def reply(rank, tables: dict, arrival: Arrival, routed_out: torch.Tensor,
          shared_out: torch.Tensor | None) -> None:
    """Reduce the outputs per received row (fp32, one rounding) through the route table
    :func:`item_views` kept in ``tables``, then write the rows, the reply header and the flag."""
    ctx, layout, header = rank.ctx, rank.layout, arrival.header
    slot = layout.slot_index(arrival.region, arrival.ring)
    seq, table = tables.pop(slot, (None, None))
    if seq != header.seq:
        raise ProtocolError(f"dedup reply to attention rank {arrival.region} (ring {arrival.ring}, "
                            f"seq {header.seq}): its route table is gone (item views not taken, "
                            f"or superseded by seq {seq})", peer=arrival.region,
                            layer_idx=header.layer_idx)
    routed = raw_to_f32(torch_to_raw(routed_out.detach(), ctx.dtype), ctx.dtype)
    shared = None
    if shared_out is not None and header.shared_tokens:
        shared = raw_to_f32(torch_to_raw(shared_out.detach(), ctx.dtype), ctx.dtype)
    rows = dedup.reduce_rows(table, routed.reshape(-1, layout.hidden_size), shared)
    reply_seq = rank.seqs.advance((arrival.region, arrival.ring))
    words = wire.encode_header(wire.reply_header(header, seq=reply_seq, src_rank=ctx.role_rank),
                               layout.expert_per_rank)
    fields = {"routed_x": torch_to_raw(torch.from_numpy(rows).to(ctx.torch_dtype), ctx.dtype)}
    rank.link.write_message(ctx.peer_pe(Role.ATTENTION, arrival.region), ctx.role_rank,
                            arrival.ring, words, reply_seq, fields)
