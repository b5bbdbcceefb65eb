"""The cuda backend's put transport (docs/design/put-transport.md): host-initiated NVSHMEM on-stream
puts of messages the kernels laid out in this rank's symmetric staging.

For a peer reached by puts the kernels write exactly what they would have written into the
peer's window, into staging slot (region = peer's role rank, ring) of this rank's staging
buffer (same layout as a window), and the scatter stores the flag into the staging flag word
of that slot. Right behind the kernel, on the same stream, the host enqueues:

- dispatch (Attention -> FFN): for every put peer, ``nvshmemx_putmem_on_stream`` of the
  ranges of :func:`afd_cupy.transport.dispatch_ranges` (header, route entries, rows: an upper
  bound from the token count, no synchronization); one ``nvshmemx_quiet_on_stream`` (every
  range delivered); then per peer an 8-byte put of the staging flag word onto the peer's flag
  word. The flag's value is device-made (only the scatter knows which peers it sent to, and
  their seqs), so a put-with-signal, whose value is a host argument, cannot carry it; a peer
  not sent to gets its unchanged flag (no arrival) and a copy of the unchanged staging bytes.
- reply and shutdown (host-known seq): the ranges but the last with ``putmem_on_stream``, a
  quiet when there was more than one, and the last range with
  ``nvshmemx_putmem_signal_on_stream(..., NVSHMEM_SIGNAL_SET, seq)``, which sets the flag only
  after its own data is delivered.

Not safe to call from two streams at once for the same ring (the connector's ring ordering
covers the Attention side; the FFN replies on one stream). Whether the on-stream calls can be
captured in a CUDA graph is measured by the e2e capture test (docs/design/put-transport.md), not assumed here.
"""
from __future__ import annotations

import ctypes

from afd_cupy import transport
from afd_cupy.heap.nvshmem_lib import NVSHMEM_SIGNAL_SET
from afd_cupy.layout import WindowLayout

FLAG_BYTES = 8


class PutChannel:
    """Puts from this rank's staging to the same slot of its peers' windows.

    ``window_base`` / ``staging_base``: symmetric addresses (this PE's copies, as
    ``nvshmem_malloc`` returned them) of the window and of the staging buffer; ``lib`` the
    bound NVSHMEM host library; ``own_region`` this rank's role rank (its region in every
    peer's window); ``peer_pes`` the opposite role's world ranks by role rank; ``is_put`` which
    of them this channel serves.
    """

    def __init__(self, lib, layout: WindowLayout, *, window_base: int, staging_base: int,
                 own_region: int, peer_pes: list[int], is_put: list[bool]):
        self.lib = lib
        self.layout = layout
        self.window_base = window_base
        self.staging_base = staging_base
        self.own_region = own_region
        self.peer_pes = list(peer_pes)
        self.put_peers = [peer for peer, flag in enumerate(is_put) if flag]
        # ctypes arguments of each (peer, ring, ranges) put sequence, built once: the hot path
        # then makes only the library calls (a decode step has few distinct token counts)
        self._prepared: dict[tuple, list[tuple]] = {}

    # --- addresses --------------------------------------------------------------------------
    def staging_slot(self, peer: int, ring: int) -> int:
        """Local address of staging slot (peer, ring): what the kernels fill for ``peer``."""
        return self.staging_base + self.layout.slot_offset(peer, ring)

    def _remote_slot(self, ring: int) -> int:
        return self.window_base + self.layout.slot_offset(self.own_region, ring)

    def _remote_flag(self, ring: int) -> int:
        return self.window_base + FLAG_BYTES * self.layout.slot_index(self.own_region, ring)

    def _staging_flag(self, peer: int, ring: int) -> int:
        return self.staging_base + FLAG_BYTES * self.layout.slot_index(peer, ring)

    # --- sends ------------------------------------------------------------------------------
    def _put_args(self, peer: int, ring: int, ranges) -> list[tuple]:
        key = (peer, ring, tuple(ranges))
        args = self._prepared.get(key)
        if args is None:
            src, dst = self.staging_slot(peer, ring), self._remote_slot(ring)
            args = self._prepared[key] = [(ctypes.c_void_p(dst + offset), ctypes.c_void_p(src + offset),
                                           nbytes, self.peer_pes[peer]) for offset, nbytes in ranges]
        return args

    def _put_ranges(self, peer: int, ring: int, ranges, stream: int) -> None:
        stream = ctypes.c_void_p(stream)
        for dst, src, nbytes, pe in self._put_args(peer, ring, ranges):
            self.lib.nvshmemx_putmem_on_stream(dst, src, nbytes, pe, stream)

    def after_dispatch(self, stream: int, ring: int, num_tokens: int, *, num_ffn_ranks: int,
                       has_shared: bool) -> None:
        """Enqueue on ``stream`` (behind the scatter) the puts of every put peer's staging
        slot for ``ring`` and then their flag words (module doc). Never synchronizes."""
        if not self.put_peers:
            return
        for peer in self.put_peers:
            self._put_ranges(peer, ring, self._dispatch_ranges(num_tokens, num_ffn_ranks, peer, has_shared),
                             stream)
        self.lib.nvshmemx_quiet_on_stream(ctypes.c_void_p(stream))
        for peer in self.put_peers:
            self.lib.nvshmemx_putmem_on_stream(
                ctypes.c_void_p(self._remote_flag(ring)), ctypes.c_void_p(self._staging_flag(peer, ring)),
                FLAG_BYTES, self.peer_pes[peer], ctypes.c_void_p(stream))

    def _dispatch_ranges(self, num_tokens: int, num_ffn_ranks: int, peer: int, has_shared: bool):
        key = ("dispatch", num_tokens, peer)
        ranges = self._prepared.get(key)
        if ranges is None:
            ranges = self._prepared[key] = transport.dispatch_ranges(
                self.layout, num_tokens=num_tokens, num_ffn_ranks=num_ffn_ranks, ffn_rank=peer,
                has_shared=has_shared)
        return ranges

    def send_signaled(self, stream: int, peer: int, ring: int, ranges, seq: int) -> None:
        """Enqueue the puts of ``ranges`` of staging slot (peer, ring) and set the peer's flag
        word of this slot to ``seq`` once they are delivered: every range but the last as a
        plain put, a quiet when there were such, the last as a put-with-signal (SIGNAL_SET)."""
        ranges = list(ranges)
        *first, (last_offset, last_bytes) = ranges
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
        """Enqueue (behind the reply kernel) the reply's puts and its flag = ``seq``."""
        self.send_signaled(stream, peer, ring, transport.reply_ranges(
            self.layout, routed_rows=routed_rows, shared_rows=shared_rows), seq)


def open_put_channel(heap, window, layout: WindowLayout, ctx, *, instance: int):
    """Collective: decide each peer's transport from ``ctx.transport`` and whether its window
    maps here, agree with every PE whether any needs puts, and if so allocate the symmetric
    staging (on every PE: allocation is collective) and return ``(PutChannel, is_put)``;
    else ``(None, [False] * peers)``. Raises ConfigError for ``"direct"`` with an unmapped
    peer (before the window would be used)."""
    pes = ctx.opposite_pes()
    if ctx.transport == "direct":  # the same on every rank (handshake): nothing to agree on
        return None, [False] * len(pes)
    mapped = [bool(window.peer_ptr(pe)) for pe in pes]
    is_put = [mode == "put" for mode in transport.peer_transports(ctx.transport, mapped)]
    wanted = heap.any_pe(f"put/window{instance}", f"PE {heap.rank}" if any(is_put) else "")
    if not wanted:
        return None, is_put
    staging = heap.alloc(transport.staging_bytes(layout), f"staging{instance}", allow_unmapped=True)
    channel = PutChannel(heap._lib, layout, window_base=window.buffer.base_ptr,
                         staging_base=staging.base_ptr, own_region=ctx.role_rank, peer_pes=pes,
                         is_put=is_put)
    return channel, is_put
