"""Window and slot layout, header encode/decode: the single source of truth (DESIGN §4).

``raw_kernels/wire.cuh`` mirrors the constants here and takes the offsets as kernel
arguments from :class:`WindowLayout`; ``tests`` check the mirror with a tiny kernel.

::

    window = [ flags: int64[num_regions * ring_depth], padded to 256 B | slot(0,0) | slot(0,1) | ... ]
    slot   = [ header | route_table | routed_x | shared_idx | shared_x ]   every field 256-B aligned

Slot ``(region, ring)`` is slot number ``region * ring_depth + ring``; its flag is flag word
number ``region * ring_depth + ring``. A sender writes only ``region = its own role rank``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from afd_cupy.errors import GeometryMismatchError, WireError

MAGIC = 0x41464447  # "AFDG"
VERSION = 1
ALIGN = 256
FLAG_SHUTDOWN = 1 << 1

# Header words (int32). Keep in sync with raw_kernels/wire.cuh (checked by a test).
HDR_MAGIC = 0
HDR_VERSION = 1
HDR_SEQ = 2
HDR_SRC_RANK = 3
HDR_LAYER = 4
HDR_STAGE = 5
HDR_NUM_TOKENS = 6
HDR_ROUTED_TOKENS = 7
HDR_SHARED_TOKENS = 8
HDR_TOPK = 9
HDR_FLAGS = 10
HDR_ECHO_SEQ = 11
HDR_FIXED_WORDS = 12  # expert_counts[expert_per_rank] follow

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


def shared_capacity(max_num_batched_tokens: int, num_ffn_ranks: int, num_shared_experts: int) -> int:
    """Rows of one rank's round-robin shared slice: ``ceil(T / F)``, 0 without shared experts."""
    if num_shared_experts == 0:
        return 0
    return -(-max_num_batched_tokens // num_ffn_ranks)


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

    @classmethod
    def from_configs(cls, model, topology, connector) -> "WindowLayout":
        """Layout for ``ModelConfig``, ``TopologyConfig`` (or ``Topology``) and ``ConnectorConfig``."""
        num_attn, num_ffn = topology.num_attn_ranks, topology.num_ffn_ranks
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
                                       model.num_shared_experts),
        )

    # --- field sizes (bytes, unaligned) -------------------------------------------------
    @property
    def header_words(self) -> int:
        return HDR_FIXED_WORDS + self.expert_per_rank

    @property
    def row_bytes(self) -> int:
        return self.hidden_size * self.itemsize

    def field_bytes(self, name: str) -> int:
        sizes = {
            "header": self.header_words * 4,
            "route_table": self.routed_cap * 2 * 4,
            "routed_x": self.routed_cap * self.row_bytes,
            "shared_idx": self.shared_cap * 4,
            "shared_x": self.shared_cap * self.row_bytes,
        }
        return sizes[name]

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

    def slot_index(self, region: int, ring: int) -> int:
        if not (0 <= region < self.num_regions and 0 <= ring < self.ring_depth):
            raise IndexError(f"slot (region={region}, ring={ring}) outside "
                             f"[0, {self.num_regions}) x [0, {self.ring_depth})")
        return region * self.ring_depth + ring

    def slot_offset(self, region: int, ring: int) -> int:
        """Byte offset of slot (region, ring) from the start of the window."""
        return self.flags_bytes + self.slot_index(region, ring) * self.slot_bytes

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
    """Bytes of one window (the symmetric allocation per rank) for these configs."""
    return WindowLayout.from_configs(model, topology, connector).window_bytes


# --- header ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    """Decoded slot header (DESIGN §4). ``expert_counts`` is a tuple of ints."""

    seq: int
    src_rank: int
    layer_idx: int
    stage_idx: int
    num_tokens: int
    routed_tokens: int
    shared_tokens: int
    top_k: int
    flags: int
    echo_seq: int
    expert_counts: tuple

    @property
    def is_shutdown(self) -> bool:
        return bool(self.flags & FLAG_SHUTDOWN)


def header_word_list(header: Header, expert_per_rank: int) -> list:
    """The int32 header words of ``header`` as a list of Python ints (the hot path's encoder:
    no numpy per field). :func:`encode_header` returns the same words as an array."""
    if len(header.expert_counts) != expert_per_rank:
        raise WireError(f"expert_counts has {len(header.expert_counts)} entries, "
                        f"expected expert_per_rank={expert_per_rank}")
    return [_as_int32(MAGIC), VERSION, _as_int32(header.seq & 0xFFFFFFFF), header.src_rank,
            header.layer_idx, header.stage_idx, header.num_tokens, header.routed_tokens,
            header.shared_tokens, header.top_k, header.flags, _as_int32(header.echo_seq & 0xFFFFFFFF),
            *header.expert_counts]


def _as_int32(u32: int) -> int:
    """The signed int32 with the bits of the unsigned 32-bit value ``u32``."""
    return u32 - (1 << 32) if u32 >= 1 << 31 else u32


def encode_header(header: Header, expert_per_rank: int) -> np.ndarray:
    """int32 [HDR_FIXED_WORDS + expert_per_rank] words of ``header``."""
    return np.array(header_word_list(header, expert_per_rank), dtype=np.int32)


def decode_header(words, expert_per_rank: int) -> Header:
    """Validate and decode int32 header words (numpy array or sequence).

    Raises WireError with the observed values on a bad magic, version, length, negative
    sizes or ``sum(expert_counts) != routed_tokens``.
    """
    array = np.asarray(words)
    expected_len = HDR_FIXED_WORDS + expert_per_rank
    if array.ndim != 1 or array.shape[0] != expected_len:
        raise WireError(f"header has shape {array.shape}, expected ({expected_len},) "
                        f"for expert_per_rank={expert_per_rank}")
    w = array.tolist()  # Python ints: one conversion instead of one per field
    magic = w[HDR_MAGIC] & 0xFFFFFFFF
    if magic != MAGIC:
        raise WireError(f"bad header magic 0x{magic:08x}, expected 0x{MAGIC:08x}")
    if w[HDR_VERSION] != VERSION:
        raise WireError(f"unsupported wire version {w[HDR_VERSION]}, expected {VERSION}")
    counts = tuple(w[HDR_FIXED_WORDS:])
    routed, shared = w[HDR_ROUTED_TOKENS], w[HDR_SHARED_TOKENS]
    if min(counts, default=0) < 0 or routed < 0 or shared < 0:
        raise WireError(f"negative sizes in header: routed_tokens={routed}, "
                        f"shared_tokens={shared}, expert_counts={counts}")
    if sum(counts) != routed:
        raise WireError(f"header expert_counts sum to {sum(counts)} but routed_tokens={routed} "
                        f"(counts={counts})")
    return Header(
        seq=w[HDR_SEQ] & 0xFFFFFFFF, src_rank=w[HDR_SRC_RANK], layer_idx=w[HDR_LAYER],
        stage_idx=w[HDR_STAGE], num_tokens=w[HDR_NUM_TOKENS], routed_tokens=routed,
        shared_tokens=shared, top_k=w[HDR_TOPK], flags=w[HDR_FLAGS],
        echo_seq=w[HDR_ECHO_SEQ] & 0xFFFFFFFF, expert_counts=counts)


def check_capacity(layout: WindowLayout, *, num_tokens: int, routed_tokens: int,
                   shared_tokens: int, peer: int) -> None:
    """Raise CapacityError (nothing written yet) if a message does not fit its slot."""
    from afd_cupy.errors import CapacityError, routed_capacity_error

    if num_tokens > layout.token_cap:
        raise CapacityError(f"num_tokens={num_tokens} > token_cap={layout.token_cap} "
                            "(max_num_batched_tokens)", counts=num_tokens, cap=layout.token_cap)
    if routed_tokens > layout.routed_cap:
        raise routed_capacity_error(routed_tokens, peer, layout.routed_cap)
    if shared_tokens > layout.shared_cap:
        raise CapacityError(f"{shared_tokens} shared rows for FFN rank {peer} > shared_cap={layout.shared_cap}",
                            counts=shared_tokens, cap=layout.shared_cap)
