"""The ``put`` and ``auto`` transports (docs/design/put-transport.md): host-initiated NVSHMEM
on-stream puts of messages the kernels laid out in this rank's symmetric staging.

``put`` stages every peer (the multi-node path, forced on one node to test it); ``auto``
stages the peers whose window ``nvshmem_ptr`` does not map (mixed jobs) and is ``direct`` on a
heap that maps every peer (the host backend). For a staged peer the kernels write exactly
what they would have written into the peer's window into staging slot (region = peer's role
rank, ring), flag word included. Right behind the kernel, on the same stream, the host enqueues:

- dispatch (Attention -> FFN): for every staged peer, ``nvshmemx_putmem_on_stream`` of the
  :func:`dispatch_ranges` (header, route entries, rows: an upper bound from the token count T,
  never the routing, so no synchronization); one ``nvshmemx_quiet_on_stream`` (every range
  delivered); then per peer an 8-byte put of the staging flag word onto the peer's flag word.
  The flag's value is device-made (only the scatter knows which peers it sent to, and their
  seqs), so a put-with-signal, whose value is a host argument, cannot carry it; a peer not sent
  to gets its unchanged flag (no arrival) and a copy of the unchanged staging bytes.
- reply and shutdown (host-known seq): the ranges but the last with ``putmem_on_stream``, a
  quiet when there was more than one, and the last range with
  ``nvshmemx_putmem_signal_on_stream(..., NVSHMEM_SIGNAL_SET, seq)``, which sets the flag only
  after its own data is delivered.

Ranges are ``(offset, nbytes)`` from the start of a slot; they cover every byte the receiver
reads, and never more than the slot. Not safe to call from two streams at once for the same
ring (the connector's ring ordering covers the Attention side; the FFN replies on one stream).
"""
from __future__ import annotations

import ctypes

import numpy as np

from afd_cupy.heap.nvshmem_lib import NVSHMEM_SIGNAL_SET
from afd_cupy.transports.base import Link, Transport, register
from afd_cupy.wire.layout import WindowLayout

#: two ranges closer than this are copied as one put (one call less for a few stale bytes)
MERGE_GAP_BYTES = 4096
FLAG_BYTES = 8


# --- which peers, which bytes (no GPU) -------------------------------------------------------
def staged_peers(stages_mapped: bool, mapped: list[bool]) -> list[bool]:
    """Per peer whether it is reached by puts, given whether its window maps here
    (``nvshmem_ptr`` non-NULL): every peer when ``stages_mapped`` (``put``), else the
    unmapped ones (``auto``)."""
    return [stages_mapped or not ok for ok in mapped]


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

    Rows are ``layout.dispatch_row_bytes`` long (FP8 wire rows with ``dispatch_dtype="fp8_e4m3"``).

    Sorted, merged across gaps up to :data:`MERGE_GAP_BYTES`, all inside the slot."""
    if not 0 <= num_tokens <= layout.token_cap:
        raise ValueError(f"num_tokens={num_tokens} outside [0, token_cap={layout.token_cap}]")
    if layout.is_dedup:
        rows, shared = min(num_tokens, layout.token_cap), 0
    else:
        rows = min(num_tokens * layout.top_k, layout.routed_cap)
        shared = shared_rows_of(num_tokens, num_ffn_ranks, ffn_rank) if has_shared else 0
    ranges = [(layout.field_offset("header"), layout.header_words * 4),
              (layout.field_offset("route_table"), rows * layout.route_width * 4),
              (layout.field_offset("routed_x"), rows * layout.dispatch_row_bytes)]
    if shared:
        ranges += [(layout.field_offset("shared_idx"), shared * 4),
                   (layout.field_offset("shared_x"), shared * layout.dispatch_row_bytes)]
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


# --- the link: puts from the staging -----------------------------------------------------------
class PutLink(Link):
    """Puts from this rank's staging to the same slot of its peers' windows.

    ``lib``: the bound NVSHMEM host library (``NvshmemHeap.lib``); ``staging_base`` and
    ``window.buffer.base_ptr``: symmetric addresses (this PE's copies, as ``nvshmem_malloc``
    returned them) of the staging and of the window; ``own_region``: this rank's role rank
    (its region in every peer's window)."""

    def __init__(self, transport: Transport, window, lib, layout: WindowLayout, *, staging_base: int,
                 own_region: int, peer_pes: list[int], is_staged: list[bool]):
        super().__init__(transport, window, peer_pes, is_staged, staging_base=staging_base)
        self.lib = lib
        self.layout = layout
        self.window_base = window.buffer.base_ptr
        self.own_region = own_region
        # ctypes arguments of each (peer, ring, ranges) put sequence, built once: the hot path
        # then makes only the library calls (a decode step has few distinct token counts)
        self._prepared: dict[tuple, list] = {}

    def staging_slot(self, peer: int, ring: int) -> int:
        """Local address of staging slot (peer, ring): what the kernels fill for ``peer``."""
        return self.staging_base + self.layout.slot_offset(peer, ring)

    def _remote_slot(self, ring: int) -> int:
        return self.window_base + self.layout.slot_offset(self.own_region, ring)

    def _remote_flag(self, ring: int) -> int:
        return self.window_base + FLAG_BYTES * self.layout.slot_index(self.own_region, ring)

    def _staging_flag(self, peer: int, ring: int) -> int:
        return self.staging_base + FLAG_BYTES * self.layout.slot_index(peer, ring)

    def _put_ranges(self, peer: int, ring: int, ranges, stream: int) -> None:
        key = (peer, ring, tuple(ranges))
        args = self._prepared.get(key)
        if args is None:
            src, dst = self.staging_slot(peer, ring), self._remote_slot(ring)
            args = self._prepared[key] = [(ctypes.c_void_p(dst + offset), ctypes.c_void_p(src + offset),
                                           nbytes, self.peer_pes[peer]) for offset, nbytes in ranges]
        stream = ctypes.c_void_p(stream)
        for dst, src, nbytes, pe in args:
            self.lib.nvshmemx_putmem_on_stream(dst, src, nbytes, pe, stream)

    def after_dispatch(self, stream: int, ring: int, num_tokens: int, *, num_ffn_ranks: int,
                       has_shared: bool) -> None:
        """Every staged peer's slot for ``ring``, one quiet, then their flag words (module doc)."""
        staged = self.staged_peers
        if not staged:
            return
        for peer in staged:
            self._put_ranges(peer, ring, self._dispatch_ranges(num_tokens, num_ffn_ranks, peer, has_shared),
                             stream)
        self.lib.nvshmemx_quiet_on_stream(ctypes.c_void_p(stream))
        for peer in staged:
            self.lib.nvshmemx_putmem_on_stream(
                ctypes.c_void_p(self._remote_flag(ring)), ctypes.c_void_p(self._staging_flag(peer, ring)),
                FLAG_BYTES, self.peer_pes[peer], ctypes.c_void_p(stream))

    def _dispatch_ranges(self, num_tokens: int, num_ffn_ranks: int, peer: int, has_shared: bool):
        key = ("dispatch", num_tokens, peer)
        ranges = self._prepared.get(key)
        if ranges is None:
            ranges = self._prepared[key] = dispatch_ranges(
                self.layout, num_tokens=num_tokens, num_ffn_ranks=num_ffn_ranks, ffn_rank=peer,
                has_shared=has_shared)
        return ranges

    def send_signaled(self, stream: int, peer: int, ring: int, ranges, seq: int) -> None:
        """Enqueue the puts of ``ranges`` of staging slot (peer, ring) and set the peer's flag
        word of this slot to ``seq`` once they are delivered: every range but the last as a
        plain put, a quiet when there were such, the last as a put-with-signal (SIGNAL_SET)."""
        *first, (last_offset, last_bytes) = list(ranges)
        if first:
            self._put_ranges(peer, ring, first, stream)
            self.lib.nvshmemx_quiet_on_stream(ctypes.c_void_p(stream))
        src = self.staging_slot(peer, ring) + last_offset
        dst = self._remote_slot(ring) + last_offset
        self.lib.nvshmemx_putmem_signal_on_stream(
            ctypes.c_void_p(dst), ctypes.c_void_p(src), last_bytes, ctypes.c_void_p(self._remote_flag(ring)),
            ctypes.c_uint64(seq), NVSHMEM_SIGNAL_SET, self.peer_pes[peer], ctypes.c_void_p(stream))

    def after_reply(self, stream: int, peer: int, ring: int, *, routed_rows: int, shared_rows: int,
                    seq: int) -> None:
        """Behind the reply kernel: the reply's puts and its flag = ``seq``."""
        self.send_signaled(stream, peer, ring, reply_ranges(
            self.layout, routed_rows=routed_rows, shared_rows=shared_rows), seq)

    def staged_header(self, peer: int, ring: int) -> np.ndarray | None:
        """The header words of staging slot (peer, ring), copied to the host (synchronous)."""
        if not self.is_staged[peer]:
            return None
        import cupy

        words = np.empty(self.layout.header_words, np.int32)
        runtime = cupy.cuda.runtime
        runtime.memcpy(words.ctypes.data, self.staging_slot(peer, ring) + self.layout.field_offset("header"),
                       words.nbytes, runtime.memcpyDeviceToHost)
        return words

    def write_staged(self, peer: int, ring: int, header, seq: int, fields: dict, *, stream=None) -> None:
        """A header-only message (the shutdown): the words into staging slot (peer, ring) on
        ``stream`` (a cupy stream), then a put-with-signal of the header setting the flag."""
        if fields:
            raise ValueError(f"the put transport sends header-only messages from the host, got "
                             f"fields {sorted(fields)}")
        import cupy

        stream_ptr = (stream or cupy.cuda.get_current_stream()).ptr
        words = np.ascontiguousarray(header, np.int32)
        runtime = cupy.cuda.runtime
        # NOTE: a pageable-source H2D copy has returned once the source was read
        runtime.memcpyAsync(self.staging_slot(peer, ring) + self.layout.field_offset("header"),
                            words.ctypes.data, words.nbytes, runtime.memcpyHostToDevice, stream_ptr)
        self.send_signaled(stream_ptr, peer, ring, control_ranges(self.layout), seq)


class PutTransport(Transport):
    """``put`` (``stages_mapped``: every peer) or ``auto`` (the unmapped peers only)."""

    is_host_initiated = True
    allows_unmapped_peers = True

    def __init__(self, name: str, *, stages_mapped: bool, backends: tuple[str, ...]):
        self.name, self.stages_mapped, self.backends = name, stages_mapped, backends

    def open(self, heap, window, ctx, *, instance: int) -> Link:
        """Collective: each peer's choice from whether its window maps here, then an agreement
        with every PE whether any stages a peer, and if so the symmetric staging on every PE
        (allocation is collective): a :class:`PutLink`; else a link that stages nothing."""
        pes = ctx.opposite_pes()
        staged = staged_peers(self.stages_mapped, [bool(window.peer_ptr(pe)) for pe in pes])
        if not any(staged) and not window.allow_unmapped:
            return Link(self, window, pes)  # every PE's allocation mapped every peer: none stages
        wanted = heap.any_pe(f"put/window{instance}", f"PE {heap.rank}" if any(staged) else "")
        if not wanted:
            return Link(self, window, pes, staged)
        staging = heap.alloc(staging_bytes(ctx.layout), f"staging{instance}", allow_unmapped=True)
        return PutLink(self, window, heap.lib, ctx.layout, staging_base=staging.base_ptr,
                       own_region=ctx.role_rank, peer_pes=pes, is_staged=staged)


PUT = register(PutTransport("put", stages_mapped=True, backends=("cuda",)))
#: on the host backend (shared memory maps every peer) ``auto`` is ``direct``
AUTO = register(PutTransport("auto", stages_mapped=False, backends=("host", "cuda")))
