"""How a message reaches a peer (docs/design/put-transport.md): ``direct`` (the sender's kernels store
into the peer's window through its ``nvshmem_ptr`` mapping) or ``put`` (the kernels write the
same bytes into the sender's own symmetric staging slot for that (peer, ring), laid out like
the receiver's slot, and NVSHMEM copies them with host-initiated on-stream puts, the flag
word last). This module holds the rules both need and that need no GPU: the transport
names, the per-peer choice, and the byte ranges a put must copy, which the host computes
from what it knows without a synchronization (the token count T, never the routing).

Ranges are ``(offset, nbytes)`` from the start of a slot; they cover every byte the receiver
reads (header, route entries, rows), and never more than the slot.
"""
from __future__ import annotations

from afd_cupy.errors import ConfigError
from afd_cupy.layout import WindowLayout

#: ``ConnectorConfig.transport`` values: ``"auto"`` = direct where the peer's window maps
#: (``nvshmem_ptr`` non-NULL), put elsewhere (mixed jobs); ``"put"`` forces put for every
#: peer (to test it on one node); ``"direct"`` refuses unmapped peers
TRANSPORTS = ("direct", "put", "auto")
#: two ranges closer than this are copied as one put (one call less for a few stale bytes)
MERGE_GAP_BYTES = 4096


def peer_transports(transport: str, mapped: list[bool]) -> list[str]:
    """``"direct"`` / ``"put"`` per peer for ``transport`` and whether each peer's window is
    mapped here (``nvshmem_ptr`` non-NULL). Raises ConfigError for an unknown transport, and
    for ``"direct"`` with an unmapped peer (naming the peer indices)."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "put":
        return ["put"] * len(mapped)
    unmapped = [peer for peer, ok in enumerate(mapped) if not ok]
    if transport == "direct" and unmapped:
        raise ConfigError(f"transport='direct' but peers {unmapped} are not load/store reachable "
                          f"(nvshmem_ptr NULL); use transport='auto' or 'put'")
    return ["direct" if ok else "put" for ok in mapped]


def shared_rows_of(num_tokens: int, num_ffn_ranks: int, ffn_rank: int) -> int:
    """Shared rows FFN rank ``ffn_rank`` gets from a pair-mode dispatch of ``num_tokens``
    tokens (tokens ``ffn_rank, ffn_rank + F, ...``): ``ceil((T - j) / F)``, 0 when T <= j."""
    return -(-(num_tokens - ffn_rank) // num_ffn_ranks) if num_tokens > ffn_rank else 0


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for offset, nbytes in sorted(r for r in ranges if r[1] > 0):
        if merged and offset - (merged[-1][0] + merged[-1][1]) <= MERGE_GAP_BYTES:
            merged[-1][1] = max(merged[-1][1], offset + nbytes - merged[-1][0])
        else:
            merged.append([offset, nbytes])
    return [(offset, nbytes) for offset, nbytes in merged]


def dispatch_ranges(layout: WindowLayout, *, num_tokens: int, num_ffn_ranks: int, ffn_rank: int,
                    has_shared: bool) -> list[tuple[int, int]]:
    """Slot byte ranges that cover any dispatch of ``num_tokens`` tokens to FFN rank
    ``ffn_rank``, whatever the routing: the header, then

    - pair: route entries and routed rows for ``min(T * top_k, routed_cap)`` partials (a rank
      gets at most every partial, and more than ``routed_cap`` is a CapacityError that sends
      nothing), shared indices and rows for exactly :func:`shared_rows_of` rows;
    - dedup: route-table rows (``route_width`` words each) and payload rows for
      ``min(T, token_cap)`` rows: a rank gets at most one row per token, whatever the routing,
      and its shared rows are among them (the layout has no shared fields); the header
      includes the ``num_rows`` trailer. ``ffn_rank`` and ``has_shared`` do not change it.

    Sorted, merged across gaps up to :data:`MERGE_GAP_BYTES`, all inside the slot."""
    _check_tokens(layout, num_tokens)
    header = layout.header_words * 4
    route_row = layout.route_width * 4
    if layout.is_dedup:
        rows = min(num_tokens, layout.token_cap)
        shared = 0
    else:
        rows = min(num_tokens * layout.top_k, layout.routed_cap)
        shared = shared_rows_of(num_tokens, num_ffn_ranks, ffn_rank) if has_shared else 0
    ranges = [(layout.field_offset("header"), header),
              (layout.field_offset("route_table"), rows * route_row),
              (layout.field_offset("routed_x"), rows * layout.row_bytes)]
    if shared:
        ranges += [(layout.field_offset("shared_idx"), shared * 4),
                   (layout.field_offset("shared_x"), shared * layout.row_bytes)]
    return _merge(ranges)


def reply_ranges(layout: WindowLayout, *, routed_rows: int, shared_rows: int) -> list[tuple[int, int]]:
    """Slot byte ranges of a reply: the header, ``routed_rows`` rows of ``routed_x`` and
    ``shared_rows`` rows of ``shared_x`` (the FFN knows both exactly; dedup: ``routed_rows``
    = the message's ``num_rows``, one reply row per dispatch row with the shared outputs
    folded in, and ``shared_rows`` = 0: the layout has no shared fields, so anything else is
    a ValueError). Sorted and merged like :func:`dispatch_ranges`."""
    if routed_rows < 0 or shared_rows < 0:
        raise ValueError(f"reply rows must be >= 0, got routed={routed_rows}, shared={shared_rows}")
    if layout.is_dedup and shared_rows:
        raise ValueError(f"a dedup reply has no shared rows (got shared_rows={shared_rows}): pass "
                         f"the message's num_rows as routed_rows")
    routed_cap, shared_cap = ((layout.token_cap, 0) if layout.is_dedup
                              else (layout.routed_cap, layout.shared_cap))
    if routed_rows > routed_cap or shared_rows > shared_cap:
        raise ValueError(f"reply rows (routed={routed_rows}, shared={shared_rows}) exceed the "
                         f"slot's ({routed_cap}, {shared_cap}) in wire_mode={layout.wire_mode!r}")
    ranges = [(layout.field_offset("header"), layout.header_words * 4),
              (layout.field_offset("routed_x"), routed_rows * layout.row_bytes)]
    if shared_rows:
        ranges.append((layout.field_offset("shared_x"), shared_rows * layout.row_bytes))
    return _merge(ranges)


def control_ranges(layout: WindowLayout) -> list[tuple[int, int]]:
    """The header alone (a shutdown message)."""
    return [(layout.field_offset("header"), layout.header_words * 4)]


def ranges_bytes(ranges: list[tuple[int, int]]) -> int:
    return sum(nbytes for _, nbytes in ranges)


def staging_bytes(layout: WindowLayout) -> int:
    """Bytes of a rank's symmetric put staging: the window's layout, staging slot (peer, ring)
    being slot (region = peer role rank, ring), and flag word (peer, ring) holding the flag the
    kernels would have stored at the peer (the value the flag put copies)."""
    return layout.window_bytes


def _check_tokens(layout: WindowLayout, num_tokens: int) -> None:
    if not 0 <= num_tokens <= layout.token_cap:
        raise ValueError(f"num_tokens={num_tokens} outside [0, token_cap={layout.token_cap}]")


__all__ = ["TRANSPORTS", "MERGE_GAP_BYTES", "peer_transports", "shared_rows_of", "dispatch_ranges",
           "reply_ranges", "control_ranges", "ranges_bytes", "staging_bytes"]
