"""The checks of a message's contents: does it fit its slot (:func:`check_capacity`, before
anything is sent) and is a received dedup route table sound (:func:`check_route_table`, and
:func:`route_table_error` for the device's verdict on the same table). Part of
:mod:`afd_cupy.wire` (docs/design/dedup.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from afd_cupy import errors
from afd_cupy.errors import WireError
from afd_cupy.wire.header import ROUTE_SHARED, ROUTE_SLOTS, ROUTE_TOKEN
from afd_cupy.wire.layout import ROUTE_FIXED_WORDS, WindowLayout

if TYPE_CHECKING:
    from afd_cupy.wire.status import StatusRecord


def check_route_table(table: np.ndarray, *, num_tokens: int, routed_tokens: int,
                      shared_tokens: int, top_k: int) -> None:
    """Validate a received dedup route table (int32 [num_rows, 2 + 2 * top_k], host numpy)
    before anything is written through it; raise WireError naming the first bad row.

    Rules (docs/design/dedup.md): token indices in ``[0, num_tokens)``; the shared flag is 1
    exactly on the first ``shared_tokens`` rows; each row has 1..top_k staging rows packed
    first (-1 pad after); the staging rows of the message are each of ``[0, routed_tokens)``
    exactly once (so the expansion writes every grouped row once).
    """
    num_rows = table.shape[0]
    if table.ndim != 2 or table.shape[1] != ROUTE_FIXED_WORDS + 2 * top_k:
        raise WireError(f"route table has shape {table.shape}, expected "
                        f"({num_rows}, {ROUTE_FIXED_WORDS + 2 * top_k})")
    tokens, flags = table[:, ROUTE_TOKEN], table[:, ROUTE_SHARED]
    slots = table[:, ROUTE_SLOTS:ROUTE_SLOTS + top_k]
    bad = np.flatnonzero((tokens < 0) | (tokens >= num_tokens))
    if bad.size:
        raise WireError(f"route table row {bad[0]}: token {tokens[bad[0]]} outside [0, {num_tokens})")
    bad = np.flatnonzero(flags != (np.arange(num_rows) < shared_tokens))
    if bad.size:
        raise WireError(f"route table row {bad[0]}: shared flag {flags[bad[0]]}, expected "
                        f"{int(bad[0] < shared_tokens)} (shared_tokens={shared_tokens})")
    valid = slots >= 0
    unpacked = ~valid[:, 0] | (valid[:, 1:] & ~valid[:, :-1]).any(axis=1)  # no slot, or one after a -1
    bad = np.flatnonzero(unpacked)
    if bad.size:
        raise WireError(f"route table row {bad[0]}: staging rows {slots[bad[0]].tolist()} are not "
                        "1..top_k rows followed by -1 padding")
    rows = slots[valid]
    if rows.size != routed_tokens or (rows.size and (rows.max() >= routed_tokens or
                                                     np.bincount(rows, minlength=routed_tokens).max() > 1)):
        raise WireError(f"route table staging rows are not a permutation of [0, {routed_tokens}) "
                        f"(routed_tokens): {rows.size} slots, range "
                        f"[{rows.min() if rows.size else '-'}, {rows.max() if rows.size else '-'}]")


# Route-table rules of the device check (afd_dedup_expand, raw_kernels/dedup_ffn.cu), in the
# order check_route_table applies them; a latched record carries the rule in ST_CAP.
ROUTE_FAULT_TOKEN = 1      # token outside [0, num_tokens)
ROUTE_FAULT_SHARED = 2     # shared flag != (row < shared_tokens)
ROUTE_FAULT_PACKING = 3    # no staging row, or one after a -1 pad
ROUTE_FAULT_RANGE = 4      # staging row >= routed_tokens
ROUTE_FAULT_DUPLICATE = 5  # staging row already taken by an earlier row (or slot)
ROUTE_FAULT_COUNT = 6      # the table names fewer than routed_tokens staging rows


def route_table_error(record: "StatusRecord", *, shared_tokens: int) -> WireError:
    """The WireError of a route table the device check rejected (the host check raises the
    same type, naming the same row, for the same table).

    ``record``: the status latched by ``afd_dedup_expand``: code STATUS_BAD_HEADER, peer = the
    sending Attention rank, slot = the route-table column (ROUTE_TOKEN, ROUTE_SHARED,
    ROUTE_SLOTS + s; -1 for the count rule), count = the row (-1 for the count rule), cap = the
    rule (ROUTE_FAULT_*), expected / observed as below, layer = the dispatch's layer.
    """
    row, rule, expected, observed = record.count, record.cap, record.expected, record.observed
    slot = record.slot - ROUTE_SLOTS
    where = (f"dedup dispatch from attention rank {record.peer} (ring {record.ring})"
             f"{errors.for_layer(record.layer if record.layer >= 0 else None)}")
    if rule == ROUTE_FAULT_TOKEN:
        what = f"route table row {row}: token {observed} outside [0, {expected})"
    elif rule == ROUTE_FAULT_SHARED:
        what = (f"route table row {row}: shared flag {observed}, expected {expected} "
                f"(shared_tokens={shared_tokens})")
    elif rule == ROUTE_FAULT_PACKING:
        what = (f"route table row {row}: staging rows are not 1..top_k rows followed by -1 "
                f"padding (slot {slot} is {observed})")
    elif rule == ROUTE_FAULT_RANGE:
        what = (f"route table row {row}: staging row {observed} (slot {slot}) outside "
                f"[0, {expected}) (routed_tokens): the staging rows are not a permutation")
    elif rule == ROUTE_FAULT_DUPLICATE:
        what = (f"route table row {row}: staging row {observed} (slot {slot}) is also named by "
                f"row {expected}: the staging rows are not a permutation")
    elif rule == ROUTE_FAULT_COUNT:
        what = (f"route table staging rows are not a permutation of [0, {expected}) "
                f"(routed_tokens): {observed} slots")
    else:
        what = f"route table rejected by the device, unknown rule: {record}"
    return WireError(f"{where}: {what}")


def check_capacity(layout: WindowLayout, *, num_tokens: int, routed_tokens: int,
                   shared_tokens: int, peer: int, nothing_sent: bool = False,
                   layer_idx: int | None = None) -> None:
    """Raise CapacityError (nothing written yet) if a message does not fit its slot;
    ``nothing_sent``: the whole dispatch is dropped, and the routed error says so.

    The same rule in both modes: ``routed_tokens`` (partials) <= ``routed_cap``. In dedup mode
    it bounds the FFN rank's local grouped staging rather than the wire field (a dedup
    message has at most ``num_tokens`` <= ``token_cap`` rows, so its rows always fit)."""
    if num_tokens > layout.token_cap:
        raise errors.token_cap_error(num_tokens, layout.token_cap)
    if routed_tokens > layout.routed_cap:
        raise errors.routed_capacity_error(routed_tokens, peer, layout.routed_cap,
                                           nothing_sent=nothing_sent, layer_idx=layer_idx)
    if shared_tokens > layout.shared_cap:
        raise errors.shared_capacity_error(shared_tokens, peer, layout.shared_cap)
