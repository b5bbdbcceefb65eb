"""Window geometry: capacities, the slot layout of each wire mode and the window's size
(docs/design/wire-format.md). Re-exported by :mod:`afd_cupy.wire`, the protocol's home, which
owns every other rule; the few constants the geometry needs are defined here and imported
there (this module imports nothing from ``wire``).

::

    window = [ flags: int64[num_regions * ring_depth], padded to 256 B | slot(0,0) | slot(0,1) | ... ]
    slot   = [ header | route_table | routed_x | shared_idx | shared_x ]   every field 256-B aligned
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from afd_cupy.errors import GeometryMismatchError, WireError
from afd_cupy.wire.fp8 import DISPATCH_DTYPES, check_dispatch_dtype, fp8_row_bytes

ALIGN = 256
#: ``ConnectorConfig.wire_mode`` values (docs/design/wire-format.md, docs/design/dedup.md)
WIRE_MODES = ("pair", "dedup")
HDR_FIXED_WORDS = 12  # header words before expert_counts[expert_per_rank] (wire.HDR_*)
ROUTE_FIXED_WORDS = 2  # dedup route-table words before the top-k slots and weights (wire.ROUTE_*)
FIELD_NAMES = ("header", "route_table", "routed_x", "shared_idx", "shared_x")


def align_up(nbytes: int, alignment: int = ALIGN) -> int:
    return -(-nbytes // alignment) * alignment


def routed_capacity(max_num_batched_tokens: int, top_k: int, num_ffn_ranks: int,
                    multiplier: float) -> int:
    """``ceil(ceil(T * topk / F) * multiplier)``, never more than ``T * topk``.

    NOTE: one rank can receive at most ``T * topk`` partials (every partial), so the cap is
    clipped there; multiplier = F therefore already covers the worst case.
    """
    even_split = -(-max_num_batched_tokens * top_k // num_ffn_ranks)
    return min(int(math.ceil(even_split * multiplier)), max_num_batched_tokens * top_k)


def shared_capacity(max_num_batched_tokens: int, num_ffn_ranks: int, num_shared_experts: int,
                    wire_mode: str = "pair") -> int:
    """Shared rows one rank can get: ``ceil(T / F)`` (pair: the round-robin slice) or ``T``
    (dedup: a token's shared experts run on one of the ranks it goes to, so one rank may run
    them all); 0 without shared experts."""
    if num_shared_experts == 0:
        return 0
    if wire_mode == "dedup":
        return max_num_batched_tokens
    return -(-max_num_batched_tokens // num_ffn_ranks)


def route_width(top_k: int, wire_mode: str) -> int:
    """int32 words per route-table row: 2 (token, top-k slot) in pair mode, 2 + 2 * top_k in
    dedup mode (token, shared flag, top_k staging rows, top_k fp32 weight bits)."""
    return ROUTE_FIXED_WORDS + 2 * top_k if wire_mode == "dedup" else 2


@dataclass(frozen=True)
class WindowLayout:
    """Byte geometry of one window. Both roles must build the same one (checked at start)."""

    num_regions: int
    ring_depth: int
    expert_per_rank: int
    hidden_size: int
    itemsize: int
    top_k: int
    token_cap: int
    routed_cap: int
    shared_cap: int
    wire_mode: str = "pair"
    dispatch_dtype: str = "payload"

    def __post_init__(self) -> None:
        if self.wire_mode not in WIRE_MODES:
            raise WireError(f"wire_mode must be one of {WIRE_MODES}, got {self.wire_mode!r}")
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            raise WireError(f"dispatch_dtype must be one of {DISPATCH_DTYPES}, got {self.dispatch_dtype!r}")

    @classmethod
    def from_configs(cls, model, topology, connector) -> "WindowLayout":
        """Layout for ``ModelConfig``, ``TopologyConfig`` (or ``Topology``) and ``ConnectorConfig``.
        ConfigError when ``connector.dispatch_dtype`` cannot run with this model
        (:func:`afd_cupy.wire.fp8.check_dispatch_dtype`)."""
        num_attn, num_ffn = topology.num_attn_ranks, topology.num_ffn_ranks
        wire_mode = connector.wire_mode
        check_dispatch_dtype(connector.dispatch_dtype, payload_dtype=model.dtype,
                             hidden_size=model.hidden_size, wire_mode=wire_mode)
        return cls(
            num_regions=max(num_attn, num_ffn),
            ring_depth=connector.ring_depth,
            expert_per_rank=-(-model.num_experts // num_ffn),
            hidden_size=model.hidden_size,
            itemsize=model.itemsize,
            top_k=model.top_k,
            token_cap=model.max_num_batched_tokens,
            routed_cap=routed_capacity(model.max_num_batched_tokens, model.top_k, num_ffn,
                                       connector.routed_cap_multiplier),
            shared_cap=shared_capacity(model.max_num_batched_tokens, num_ffn,
                                       model.num_shared_experts, wire_mode),
            wire_mode=wire_mode,
            dispatch_dtype=connector.dispatch_dtype,
        )

    # --- field sizes (bytes, unaligned) -------------------------------------------------
    @property
    def is_dedup(self) -> bool:
        return self.wire_mode == "dedup"

    @property
    def header_words(self) -> int:
        """int32 header words: 12 + expert_per_rank, plus ``num_rows`` in dedup mode."""
        return HDR_FIXED_WORDS + self.expert_per_rank + int(self.is_dedup)

    @property
    def num_rows_word(self) -> int:
        """Header word index of ``num_rows`` (dedup mode only)."""
        return HDR_FIXED_WORDS + self.expert_per_rank

    @property
    def route_width(self) -> int:
        """int32 words per route-table row (:func:`route_width`)."""
        return route_width(self.top_k, self.wire_mode)

    @property
    def row_bytes(self) -> int:
        """Bytes of one payload row (a reply row; a dispatch row unless FP8 dispatch)."""
        return self.hidden_size * self.itemsize

    @property
    def is_fp8_dispatch(self) -> bool:
        """Dispatched rows are E4M3 with 128-channel scales (``dispatch_dtype="fp8_e4m3"``)."""
        return self.dispatch_dtype == "fp8_e4m3"

    @property
    def dispatch_row_bytes(self) -> int:
        """Bytes of one dispatched row: ``row_bytes``, or ``fp8.fp8_row_bytes(hidden_size)`` in
        FP8 dispatch (the row stride of ``routed_x`` / ``shared_x`` in an A->F message)."""
        return fp8_row_bytes(self.hidden_size) if self.is_fp8_dispatch else self.row_bytes

    @property
    def slot_row_bytes(self) -> int:
        """Bytes per row the slot's ``routed_x`` / ``shared_x`` reserve: the larger of the two
        directions' rows (dispatches and replies share one slot layout)."""
        return max(self.row_bytes, self.dispatch_row_bytes)

    def field_bytes(self, name: str) -> int:
        """Bytes of field ``name``. Pair: routed_cap partial rows and shared_cap shared rows.
        Dedup: token_cap rows (one per token at most) and their route table; no shared fields
        (the shared rows are the first ``shared_tokens`` rows of ``routed_x``)."""
        rows = self.token_cap if self.is_dedup else self.routed_cap
        shared = 0 if self.is_dedup else self.shared_cap
        sizes = {
            "header": self.header_words * 4,
            "route_table": rows * self.route_width * 4,
            "routed_x": rows * self.slot_row_bytes,
            "shared_idx": shared * 4,
            "shared_x": shared * self.slot_row_bytes,
        }
        return sizes[name]

    def message_bytes(self, *, reply: bool, num_rows: int = 0, routed_tokens: int = 0,
                      shared_tokens: int = 0) -> int:
        """Bytes one message writes into its receiver's window: fields, header, 8-byte flag.

        Pair: dispatch = routed_tokens x (row + 8 B route entry) + shared_tokens x (row + 4 B
        index), rows of ``dispatch_row_bytes``; reply = (routed_tokens + shared_tokens) rows of
        ``row_bytes``. Dedup (``num_rows`` rows; the
        shared rows are among them): dispatch = num_rows x (row + 4 * route_width B); reply =
        num_rows rows. A message that is not sent (empty, without ``always_send``) costs 0:
        the caller decides.
        """
        fixed = self.header_words * 4 + 8
        if self.is_dedup:
            per_row = self.row_bytes + (0 if reply else self.route_width * 4)
            return fixed + num_rows * per_row
        row = self.row_bytes if reply else self.dispatch_row_bytes
        routed = routed_tokens * (row + (0 if reply else 8))
        shared = shared_tokens * (row + (0 if reply else 4))
        return fixed + routed + shared

    def field_offset(self, name: str) -> int:
        """Offset of a field from the start of its slot (256-B aligned)."""
        offset = 0
        for field in FIELD_NAMES:
            if field == name:
                return offset
            offset += align_up(self.field_bytes(field))
        raise KeyError(f"unknown slot field {name!r}; fields: {FIELD_NAMES}")

    # --- window geometry ------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_regions * self.ring_depth

    @property
    def flags_bytes(self) -> int:
        return align_up(self.num_slots * 8)

    @property
    def slot_bytes(self) -> int:
        return sum(align_up(self.field_bytes(name)) for name in FIELD_NAMES)

    @property
    def window_bytes(self) -> int:
        return self.flags_bytes + self.num_slots * self.slot_bytes

    @property
    def ffn_staging_bytes(self) -> int:
        """Bytes of an FFN rank's local (not symmetric) staging with one buffer per slot.
        Dedup: the expanded rows grouped by local expert (``routed_cap`` rows, like pair mode's
        ``routed_x``) and a copy of the route table. Pair with FP8 dispatch: the dequantized
        routed and shared rows (``routed_cap + shared_cap`` payload rows). 0 otherwise (the GEMM
        reads the window)."""
        if self.is_fp8_dispatch and not self.is_dedup:
            return self.num_slots * (align_up(self.routed_cap * self.row_bytes)
                                     + align_up(self.shared_cap * self.row_bytes))
        if not self.is_dedup:
            return 0
        per_slot = (align_up(self.routed_cap * self.row_bytes)
                    + align_up(self.token_cap * self.route_width * 4))
        return self.num_slots * per_slot

    def slot_index(self, region: int, ring: int) -> int:
        if not (0 <= region < self.num_regions and 0 <= ring < self.ring_depth):
            raise IndexError(f"slot (region={region}, ring={ring}) outside "
                             f"[0, {self.num_regions}) x [0, {self.ring_depth})")
        return region * self.ring_depth + ring

    def slot_offset(self, region: int, ring: int) -> int:
        """Byte offset of slot (region, ring) from the start of the window."""
        return self.flags_bytes + self.slot_index(region, ring) * self.slot_bytes

    #: numpy twin of ``struct SlotGeometry`` (raw_kernels/common/wire.cuh): same fields, same order,
    #: same C layout (checked on the CPU by parsing the struct, on the GPU by the probe)
    KERNEL_GEOMETRY_DTYPE = np.dtype([
        ("flags_bytes", np.int64), ("slot_bytes", np.int64), ("off_header", np.int64),
        ("off_route", np.int64), ("off_routed_x", np.int64), ("off_shared_idx", np.int64),
        ("off_shared_x", np.int64), ("num_regions", np.int32), ("ring_depth", np.int32),
        ("header_words", np.int32)], align=True)

    def kernel_geometry(self) -> np.void:
        """This layout as one ``struct SlotGeometry`` value: the kernels' ``geo`` argument
        (a numpy structured scalar of :attr:`KERNEL_GEOMETRY_DTYPE`)."""
        values = (self.flags_bytes, self.slot_bytes,
                  *(self.field_offset(name) for name in FIELD_NAMES),
                  self.num_regions, self.ring_depth, self.header_words)
        return np.array(values, dtype=self.KERNEL_GEOMETRY_DTYPE)[()]

    def as_dict(self) -> dict:
        return asdict(self)

    def check_same(self, other: dict, *, my_rank: int, other_rank: int) -> None:
        """Raise GeometryMismatchError naming the first differing field and both ranks."""
        mine = self.as_dict()
        for name, value in mine.items():
            if other.get(name) != value:
                raise GeometryMismatchError(
                    f"window geometry mismatch in {name!r}: rank {my_rank} has {value!r}, "
                    f"rank {other_rank} has {other.get(name)!r}")


def window_size_hint(model, topology, connector) -> int:
    """Bytes of one window (the symmetric allocation per rank) for these configs, in the
    connector's ``wire_mode``: pair slots hold ``routed_cap + shared_cap`` rows, dedup slots
    ``token_cap`` rows (docs/design/wire-format.md). In dedup mode each FFN rank also needs
    :func:`ffn_staging_size_hint` bytes of ordinary (not symmetric) memory."""
    return WindowLayout.from_configs(model, topology, connector).window_bytes


def ffn_staging_size_hint(model, topology, connector) -> int:
    """Bytes of an FFN rank's local staging (``WindowLayout.ffn_staging_bytes``): dedup's
    expanded rows, or the dequantized rows of an FP8 dispatch; 0 in pair mode without FP8."""
    return WindowLayout.from_configs(model, topology, connector).ffn_staging_bytes
