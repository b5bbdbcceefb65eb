"""A window over a symmetric heap: flags + ring of slots, views, writes and host polling.

Every rank owns one window of ``layout.window_bytes`` and maps every peer's window. A sender
writes only region = its own role rank of the receiver's window; the receiver learns of an
arrival when the flag word of a slot changes (flags carry the sender's monotonically
increasing seq, so a changed value is an arrival: ABA-safe, never reset).

Two pollers live here:
- :meth:`Window.poll` — host polling (one device-to-host copy of all flags on the cuda
  backend), with a rotating scan start so no region starves and a last-seen mirror.
- device polling (the ``wait_any``/``combine`` kernels) keeps its last-seen words on the
  device instead; see ``afd_cupy.backends.cuda``.
"""
from __future__ import annotations

import json
import logging
import numpy as np

from afd_cupy.errors import CapacityError
from afd_cupy.runtime.store import Store, store_fetch, store_publish
from afd_cupy.wire import WindowLayout

logger = logging.getLogger("afd_cupy")


class Window:
    """This rank's window and mapped views of all peers' windows.

    Collective construction: allocates on the heap (zeroed, then a barrier inside the heap),
    then exchanges and checks the geometry with every rank of the world through ``store``.
    """

    def __init__(self, heap, layout: WindowLayout, store: Store, *, name: str = "window",
                 geometry_timeout_s: float = 60.0, allow_unmapped: bool = False):
        self.heap = heap
        self.layout = layout
        self.xp = heap.xp
        # allow_unmapped (a transport's allows_unmapped_peers): a peer that does not map has no
        # view here (peer_bytes None, peer_ptr 0); only the transport's link reaches it
        # (docs/design/put-transport.md). False: every peer maps (the allocation refuses otherwise)
        self.allow_unmapped = allow_unmapped
        self.buffer = (heap.alloc(layout.window_bytes, name, allow_unmapped=True) if allow_unmapped
                       else heap.alloc(layout.window_bytes, name))
        self._exchange_geometry(store, name, geometry_timeout_s)
        self._bases = [self.buffer.peer(pe) for pe in range(heap.world_size)]
        self.flags = self.local_bytes[:layout.num_slots * 8].view(np.int64)
        heap.barrier()  # no rank writes before every rank checked geometry

    # --- geometry ---------------------------------------------------------------------------
    def _exchange_geometry(self, store: Store, name: str, timeout_s: float) -> None:
        rank = self.heap.rank
        store_publish(store, f"geometry/{name}/{rank}", json.dumps(self.layout.as_dict()).encode())
        for other in range(self.heap.world_size):
            if other == rank:
                continue
            theirs = json.loads(bytes(store_fetch(store, f"geometry/{name}/{other}", timeout_s,
                                                  peer=other)).decode())
            self.layout.check_same(theirs, my_rank=rank, other_rank=other)

    # --- views ------------------------------------------------------------------------------
    @property
    def own_pe(self) -> int:
        """World rank (PE) of this window's owner."""
        return self.heap.rank

    @property
    def local_bytes(self):
        """uint8 [window_bytes] of this rank's window (xp array)."""
        return self._bases[self.heap.rank]

    def peer_bytes(self, pe: int):
        """uint8 [window_bytes] of world rank ``pe``'s window as mapped here."""
        return self._bases[pe]

    def peer_ptr(self, pe: int) -> int:
        return self.buffer.ptr(pe)

    def field(self, pe: int, region: int, ring: int, name: str, dtype, shape):
        """Typed view of field ``name`` of slot (region, ring) in ``pe``'s window.

        ``shape`` may be smaller than the field's capacity; an empty view is returned for a
        zero-size shape without touching the buffer (zero-length device views are avoided).
        """
        layout = self.layout
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > layout.field_bytes(name):
            raise CapacityError(f"view of {nbytes} B exceeds field {name!r} of "
                                f"{layout.field_bytes(name)} B", counts=nbytes, cap=layout.field_bytes(name))
        if nbytes == 0:
            return self.xp.empty(shape, dtype)
        start = layout.slot_offset(region, ring) + layout.field_offset(name)
        return self._bases[pe][start:start + nbytes].view(dtype).reshape(shape)

    def header_view(self, pe: int, region: int, ring: int):
        """int32 [header_words] of slot (region, ring) in ``pe``'s window."""
        return self.field(pe, region, ring, "header", np.int32, (self.layout.header_words,))

    def flag_view(self, pe: int, region: int, ring: int):
        """int64 [1] flag word of slot (region, ring) in ``pe``'s window."""
        index = self.layout.slot_index(region, ring)
        return self._bases[pe][index * 8:(index + 1) * 8].view(np.int64)

    # --- host-side write (host backend data path; control messages on both backends) -------
    def write_message(self, pe: int, region: int, ring: int, header: np.ndarray, seq: int,
                      fields: dict | None = None) -> None:
        """Write ``fields`` (name -> array of raw words), then the header, then the flag = seq.

        Arrays are numpy (host) and copied into ``pe``'s window. On the cuda backend the copies
        are issued on the current stream in order, so the flag lands last.
        NOTE: on the host backend, numpy stores execute in program order and x86-64 keeps
        store order (TSO); other CPUs would need a fence before the flag store.
        """
        for name, array in (fields or {}).items():
            array = np.ascontiguousarray(array)
            if array.size == 0:
                continue
            view = self.field(pe, region, ring, name, array.dtype, array.shape)
            self._assign(view, array)
        self._assign(self.header_view(pe, region, ring), np.ascontiguousarray(header, np.int32))
        self._assign(self.flag_view(pe, region, ring), np.array([seq], np.int64))

    def _assign(self, view, array: np.ndarray) -> None:
        if self.xp is np:
            view[...] = array
        else:
            view.set(array)

    # --- host reads ----------------------------------------------------------------------------
    def read_flags(self) -> np.ndarray:
        """int64 [num_slots] copy of this rank's flags (one D2H copy on cuda)."""
        return self.to_host(self.flags)

    def to_host(self, view) -> np.ndarray:
        """numpy copy of a view of any window (a D2H copy on cuda)."""
        return view.copy() if self.xp is np else view.get()

    def close(self) -> None:
        """Drop views; the heap owns (and frees) the memory in its collective close."""
        self._bases = []
        self.flags = None
