"""The protocol's home: header words and flags, encode/decode, reply and route-table checks,
status and doorbell words (docs/design/wire-format.md, docs/design/protocol.md). The window geometry (capacities, slot
layout, sizes) lives in :mod:`afd_cupy.layout` and is re-exported here.

``raw_kernels/common/wire.cuh`` mirrors the constants here and takes the offsets as kernel
arguments from :class:`WindowLayout`; ``tests`` check the mirror with a tiny kernel.

::

    window = [ flags: int64[num_regions * ring_depth], padded to 256 B | slot(0,0) | slot(0,1) | ... ]
    slot   = [ header | route_table | routed_x | shared_idx | shared_x ]   every field 256-B aligned

Two wire modes (``ConnectorConfig.wire_mode``, docs/design/dedup.md) share these field names:
``"pair"`` sends one row per (token, expert) partial plus a round-robin shared slice;
``"dedup"`` sends one row per (token, FFN rank it goes to) with a wider route table
(``route_table`` [token_cap, 2 + 2*top_k], ``routed_x`` [token_cap, hidden], empty shared
fields), marks its headers with ``FLAG_DEDUP`` and appends one header word, ``num_rows``.

Slot ``(region, ring)`` is slot number ``region * ring_depth + ring``; its flag is flag word
number ``region * ring_depth + ring``. A sender writes only ``region = its own role rank``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from afd_cupy import errors
from afd_cupy.errors import WireError
# the window geometry lives in afd_cupy.layout; its names are part of this module's API
from afd_cupy.layout import (ALIGN, FIELD_NAMES, HDR_FIXED_WORDS, ROUTE_FIXED_WORDS,  # noqa: F401
                             WIRE_MODES, WindowLayout, align_up, ffn_staging_size_hint,
                             route_width, routed_capacity, shared_capacity, window_size_hint)

MAGIC = 0x41464447  # "AFDG"
VERSION = 1
FLAG_SHUTDOWN = 1 << 1
#: header flag of every dedup-mode message (dispatch, reply, shutdown); never set in pair mode
FLAG_DEDUP = 1 << 2
#: with FLAG_SHUTDOWN, FFN -> Attention only: the shutdown was written over this rank's last
#: reply on the slot, whose header words (and rows) it kept: a reply the Attention side has not
#: read yet is still delivered, then the shutdown is seen (issue 35, item 13)
FLAG_KEPT_REPLY = 1 << 3

# Header words (int32). Keep in sync with raw_kernels/common/wire.cuh (checked by a test).
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
# HDR_FIXED_WORDS = 12 (from afd_cupy.layout): expert_counts[expert_per_rank] follow
# dedup only: one more word after expert_counts, num_rows (at HDR_FIXED_WORDS + expert_per_rank)

# Dedup route table row (int32 words), one per message row: ROUTE_FIXED_WORDS + 2 * top_k words.
ROUTE_TOKEN = 0    # token index in the sender's batch
ROUTE_SHARED = 1   # 1: this rank runs the token's shared experts (such rows come first), else 0
ROUTE_SLOTS = 2    # top_k staging rows of the token's partials on this rank, in top-k order, -1 pad;
#                    then (from ROUTE_SLOTS + top_k) their fp32 gate weights as raw bits, 0 pad


#: flag value (and header seq) of a shutdown message: above every data seq, so flags stay
#: monotonic and a shutdown is an arrival on any ring it is written to
SHUTDOWN_SEQ = (1 << 63) - 1

# --- status block and doorbell words (mirrored in raw_kernels/common/wire.cuh) ------------------
# A spinning or routing kernel latches its first error in a status block of STATUS_WORDS
# int64 words; the host turns it into the same typed error the host backend raises.
STATUS_OK = 0
STATUS_CAPACITY = 1        # peer, count, cap: a rank's routed partials exceed routed_cap
STATUS_TIMEOUT = 2         # peer, slot, ring, expected seq, observed flag
STATUS_BAD_HEADER = 3      # peer, slot, ring, expected, observed, count = header word index
STATUS_REPLY_MISMATCH = 4  # peer, slot, ring, expected, observed, count = header word index
STATUS_SHUTDOWN = 5        # peer, slot, ring: the peer announced shutdown instead of replying
STATUS_BAD_EXPERT = 6      # slot = partial index, expected = F * epr, observed = the bad id
STATUS_NAMES = {STATUS_OK: "OK", STATUS_CAPACITY: "CAPACITY", STATUS_TIMEOUT: "TIMEOUT",
                STATUS_BAD_HEADER: "BAD_HEADER", STATUS_REPLY_MISMATCH: "REPLY_MISMATCH",
                STATUS_SHUTDOWN: "SHUTDOWN", STATUS_BAD_EXPERT: "BAD_EXPERT"}

# Word indices of the status block; -1 in a word means "not applicable".
ST_CODE = 0
ST_PEER = 1
ST_SLOT = 2
ST_RING = 3
ST_EXPECTED = 4
ST_OBSERVED = 5
ST_COUNT = 6
ST_CAP = 7
ST_LAYER = 8  # layer of the dispatch (plan) or receive (wait, combine) that failed
STATUS_WORDS = 9
STATUS_FIELDS = ("code", "peer", "slot", "ring", "expected", "observed", "count", "cap", "layer")

# Word indices of the FFN wait_any doorbell (int64, pinned host); header words follow as int32.
DB_TICKET = 0
DB_STATUS = 1
DB_SLOT = 2
DB_FLAG = 3
DB_HEADER = 4

#: header words a reply echoes, in the order both the host and the device check them
HDR_WORD_NAMES = {HDR_MAGIC: "magic", HDR_VERSION: "version", HDR_SEQ: "seq",
                  HDR_SRC_RANK: "src_rank", HDR_LAYER: "layer_idx", HDR_STAGE: "stage_idx",
                  HDR_NUM_TOKENS: "num_tokens", HDR_ROUTED_TOKENS: "routed_tokens",
                  HDR_SHARED_TOKENS: "shared_tokens", HDR_TOPK: "top_k", HDR_FLAGS: "flags",
                  HDR_ECHO_SEQ: "echo_seq"}


# --- header ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    """Decoded slot header (docs/design/wire-format.md). ``expert_counts`` is a tuple of ints;
    ``num_rows`` is the dedup trailer word (rows of the message; 0 in pair mode)."""

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
    num_rows: int = 0

    @property
    def is_shutdown(self) -> bool:
        return bool(self.flags & FLAG_SHUTDOWN)

    @property
    def is_dedup(self) -> bool:
        return bool(self.flags & FLAG_DEDUP)

    @property
    def keeps_reply(self) -> bool:
        """A shutdown written over a reply that it kept (``FLAG_KEPT_REPLY``)."""
        return bool(self.flags & FLAG_SHUTDOWN) and bool(self.flags & FLAG_KEPT_REPLY)

    @property
    def wire_mode(self) -> str:
        return "dedup" if self.is_dedup else "pair"


def header_word_list(header: Header, expert_per_rank: int) -> list:
    """The int32 header words of ``header`` as a list of Python ints (the hot path's encoder:
    no numpy per field). :func:`encode_header` returns the same words as an array. A dedup
    header (``FLAG_DEDUP``) gets ``num_rows`` as one more word after ``expert_counts``."""
    if len(header.expert_counts) != expert_per_rank:
        raise WireError(f"expert_counts has {len(header.expert_counts)} entries, "
                        f"expected expert_per_rank={expert_per_rank}")
    if header.num_rows and not header.is_dedup:
        raise WireError(f"num_rows={header.num_rows} in a pair-mode header (no FLAG_DEDUP)")
    words = [_as_int32(MAGIC), VERSION, _as_int32(header.seq & 0xFFFFFFFF), header.src_rank,
             header.layer_idx, header.stage_idx, header.num_tokens, header.routed_tokens,
             header.shared_tokens, header.top_k, header.flags, _as_int32(header.echo_seq & 0xFFFFFFFF),
             *header.expert_counts]
    if header.is_dedup:
        words.append(header.num_rows)
    return words


def _as_int32(u32: int) -> int:
    """The signed int32 with the bits of the unsigned 32-bit value ``u32``."""
    return u32 - (1 << 32) if u32 >= 1 << 31 else u32


def encode_header(header: Header, expert_per_rank: int) -> np.ndarray:
    """int32 [HDR_FIXED_WORDS + expert_per_rank (+ 1 in dedup mode)] words of ``header``."""
    return np.array(header_word_list(header, expert_per_rank), dtype=np.int32)


def decode_header(words, expert_per_rank: int, layout: "WindowLayout | None" = None, *,
                  wire_mode: str | None = None) -> Header:
    """Validate and decode int32 header words (numpy array or sequence).

    ``wire_mode``: the receiver's mode (default: ``layout.wire_mode``, else "pair"); it sets
    the expected length (one more word, ``num_rows``, in dedup mode) and a message of the
    other mode (``FLAG_DEDUP`` set or not) is a WireError.

    Raises WireError with the observed values on a bad magic, version, length, mode, negative
    sizes, ``sum(expert_counts) != routed_tokens`` or (dedup) sizes no dedup message can have
    (``shared_tokens > num_rows``, ``routed_tokens`` outside ``[num_rows, num_rows * top_k]``),
    and, given the receiving window's ``layout``, on sizes over its capacities (views of them
    would read past the slot).
    """
    mode = wire_mode or (layout.wire_mode if layout is not None else "pair")
    is_dedup = mode == "dedup"
    array = np.asarray(words)
    expected_len = HDR_FIXED_WORDS + expert_per_rank + int(is_dedup)
    if array.ndim != 1 or array.shape[0] != expected_len:
        raise WireError(f"header has shape {array.shape}, expected ({expected_len},) "
                        f"for expert_per_rank={expert_per_rank} in wire_mode={mode!r}")
    w = array.tolist()  # Python ints: one conversion instead of one per field
    magic = w[HDR_MAGIC] & 0xFFFFFFFF
    if magic != MAGIC:
        raise WireError(f"bad header magic 0x{magic:08x}, expected 0x{MAGIC:08x}")
    if w[HDR_VERSION] != VERSION:
        raise WireError(f"unsupported wire version {w[HDR_VERSION]}, expected {VERSION}")
    flags = w[HDR_FLAGS]
    if bool(flags & FLAG_DEDUP) != is_dedup:
        sent = "dedup" if flags & FLAG_DEDUP else "pair"
        raise WireError(f"header flags 0x{flags & 0xFFFFFFFF:x} mark a {sent}-mode message; this "
                        f"receiver runs wire_mode={mode!r}")
    counts = tuple(w[HDR_FIXED_WORDS:HDR_FIXED_WORDS + expert_per_rank])
    routed, shared = w[HDR_ROUTED_TOKENS], w[HDR_SHARED_TOKENS]
    num_rows = w[HDR_FIXED_WORDS + expert_per_rank] if is_dedup else 0
    if min(counts, default=0) < 0 or routed < 0 or shared < 0 or num_rows < 0:
        raise WireError(f"negative sizes in header: routed_tokens={routed}, "
                        f"shared_tokens={shared}, expert_counts={counts}, num_rows={num_rows}")
    if sum(counts) != routed:
        raise WireError(f"header expert_counts sum to {sum(counts)} but routed_tokens={routed} "
                        f"(counts={counts})")
    if is_dedup:
        _check_dedup_sizes(num_rows, routed, shared, w[HDR_TOPK])
    if layout is not None:
        for name, value, cap in (("num_tokens", w[HDR_NUM_TOKENS], layout.token_cap),
                                 ("routed_tokens", routed, layout.routed_cap),
                                 ("shared_tokens", shared, layout.shared_cap),
                                 ("num_rows", num_rows, layout.token_cap)):
            if value > cap:
                raise WireError(f"header {name}={value} exceeds this window's capacity {cap}")
    return Header(
        seq=w[HDR_SEQ] & 0xFFFFFFFF, src_rank=w[HDR_SRC_RANK], layer_idx=w[HDR_LAYER],
        stage_idx=w[HDR_STAGE], num_tokens=w[HDR_NUM_TOKENS], routed_tokens=routed,
        shared_tokens=shared, top_k=w[HDR_TOPK], flags=flags,
        echo_seq=w[HDR_ECHO_SEQ] & 0xFFFFFFFF, expert_counts=counts, num_rows=num_rows)


def _check_dedup_sizes(num_rows: int, routed: int, shared: int, top_k: int) -> None:
    """Every dedup row carries 1..top_k partials and at most one shared token."""
    if shared > num_rows or not num_rows <= routed <= num_rows * max(top_k, 0):
        raise WireError(f"dedup header sizes inconsistent: num_rows={num_rows}, "
                        f"routed_tokens={routed} (must lie in [num_rows, num_rows * top_k={top_k}]), "
                        f"shared_tokens={shared} (must be <= num_rows)")


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


# Route-table rules of the device check (afd_dedup_expand, raw_kernels/ffn/dedup_ffn.cu), in the
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
             f"{errors._for_layer(record.layer if record.layer >= 0 else None)}")
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


# --- the protocol's messages -----------------------------------------------------------
def dispatch_header(*, seq: int, src_rank: int, layer_idx: int, stage_idx: int, num_tokens: int,
                    shared_tokens: int, top_k: int, expert_counts, wire_mode: str = "pair",
                    num_rows: int = 0) -> Header:
    """Header of a dispatch (Attention -> FFN); routed_tokens = sum(expert_counts).

    Dedup mode: ``FLAG_DEDUP`` set and ``num_rows`` = the message's rows (pair: must be 0).
    The device builds the same words in ``afd_dispatch_scatter`` (order pinned by the probe).
    """
    if wire_mode not in WIRE_MODES or (wire_mode == "pair" and num_rows):
        raise WireError(f"dispatch_header: wire_mode={wire_mode!r} with num_rows={num_rows}")
    counts = tuple(int(c) for c in expert_counts)
    return Header(seq=int(seq), src_rank=src_rank, layer_idx=layer_idx, stage_idx=stage_idx,
                  num_tokens=num_tokens, routed_tokens=sum(counts), shared_tokens=shared_tokens,
                  top_k=top_k, flags=FLAG_DEDUP if wire_mode == "dedup" else 0, echo_seq=0,
                  expert_counts=counts, num_rows=int(num_rows))


def reply_header(dispatch: Header, *, seq: int, src_rank: int) -> Header:
    """Header of the reply (FFN -> Attention) to ``dispatch``: sizes, indices and mode echoed."""
    return Header(seq=int(seq), src_rank=src_rank, layer_idx=dispatch.layer_idx,
                  stage_idx=dispatch.stage_idx, num_tokens=dispatch.num_tokens,
                  routed_tokens=dispatch.routed_tokens, shared_tokens=dispatch.shared_tokens,
                  top_k=dispatch.top_k, flags=dispatch.flags & FLAG_DEDUP, echo_seq=dispatch.seq,
                  expert_counts=dispatch.expert_counts, num_rows=dispatch.num_rows)


def shutdown_header(*, src_rank: int, top_k: int, expert_per_rank: int,
                    wire_mode: str = "pair") -> Header:
    """Header of a shutdown announcement (either direction); its flag value is SHUTDOWN_SEQ.
    In dedup mode it carries ``FLAG_DEDUP`` too (and ``num_rows`` = 0), like every message."""
    flags = FLAG_SHUTDOWN | (FLAG_DEDUP if wire_mode == "dedup" else 0)
    return Header(seq=SHUTDOWN_SEQ, src_rank=src_rank, layer_idx=0, stage_idx=0, num_tokens=0,
                  routed_tokens=0, shared_tokens=0, top_k=top_k, flags=flags, echo_seq=0,
                  expert_counts=(0,) * expert_per_rank)


def shutdown_over_reply(words: np.ndarray, flag: int, fresh: np.ndarray) -> np.ndarray:
    """The header words an FFN rank's shutdown writes into a slot whose current header words
    are ``words`` (int32 [header_words], read from the receiver's slot) and flag ``flag``:

    - a reply (0 < flag < SHUTDOWN_SEQ): the same words with ``FLAG_SHUTDOWN |
      FLAG_KEPT_REPLY`` added, so a reply not yet read stays deliverable (rows untouched);
    - already a shutdown (flag == SHUTDOWN_SEQ): the words unchanged (announcing twice keeps
      a kept reply);
    - nothing yet (flag 0): ``fresh``, the plain :func:`shutdown_header` words."""
    flag = int(flag)
    if flag == SHUTDOWN_SEQ:
        return np.array(words, np.int32, copy=True)
    if flag <= 0:
        return np.array(fresh, np.int32, copy=True)
    kept = np.array(words, np.int32, copy=True)
    kept[HDR_FLAGS] |= FLAG_SHUTDOWN | FLAG_KEPT_REPLY
    return kept


def answers(header: Header, want_seq: int) -> bool:
    """True when ``header`` is, or keeps (``FLAG_KEPT_REPLY``), the reply to the dispatch of
    seq ``want_seq`` (low 32 bits compared, like every echo)."""
    if header.is_shutdown and not header.keeps_reply:
        return False
    return header.echo_seq == want_seq & 0xFFFFFFFF


@dataclass(frozen=True)
class ReplyExpectation:
    """What the reply of FFN rank ``peer`` to one dispatch must echo."""

    peer: int
    seq: int
    layer_idx: int
    stage_idx: int
    routed_tokens: int
    shared_tokens: int
    num_rows: int = 0  # dedup: rows of the dispatch (0 in pair mode)


def is_late_reply(header: Header, want_seq: int) -> bool:
    """True for a reply to a dispatch older than the pending one (seq ``want_seq``).

    Such a reply answers a dispatch whose wait already timed out; it is dropped (its slot is
    consumed) and the wait goes on. Seqs are compared modulo 2**32 (the header carries the
    low 32 bits): ``echo_seq`` is late when it lies in the 2**31 seqs before ``want_seq``.
    """
    if header.is_shutdown:
        return False
    behind = (want_seq - header.echo_seq) & 0xFFFFFFFF
    return 0 < behind < (1 << 31)


def check_reply(header: Header, want: ReplyExpectation) -> None:
    """Raise the typed error of a reply that does not answer the pending dispatch ``want``.

    Checks, in this order (the device's ``afd_wait_replies`` checks the same words in the same
    order and latches the matching status): the shutdown flag (ConnectorShutdown; not for a
    shutdown that kept the reply to ``want``, ``FLAG_KEPT_REPLY``: that is the reply), then the
    echoed seq, layer, stage, routed and shared row counts and (dedup) ``num_rows``
    (ProtocolError naming the field). Magic, version, mode and the expert-count sum were
    checked by :func:`decode_header` (WireError).
    """
    if header.is_shutdown and not answers(header, want.seq):
        raise errors.shutdown_during_reply_error(want.peer, want.layer_idx)
    for name, observed, expected in (("echo_seq", header.echo_seq, want.seq & 0xFFFFFFFF),
                                     ("layer_idx", header.layer_idx, want.layer_idx),
                                     ("stage_idx", header.stage_idx, want.stage_idx),
                                     ("routed_tokens", header.routed_tokens, want.routed_tokens),
                                     ("shared_tokens", header.shared_tokens, want.shared_tokens),
                                     ("num_rows", header.num_rows, want.num_rows)):
        if observed != expected:
            raise errors.reply_mismatch_error(want.peer, name, expected, observed, want.layer_idx)


# --- status records ----------------------------------------------------------------------
@dataclass(frozen=True)
class StatusRecord:
    """A decoded status block (see STATUS_* and ST_*); -1 marks a word that does not apply."""

    code: int
    peer: int
    slot: int
    ring: int
    expected: int
    observed: int
    count: int
    cap: int
    layer: int = -1

    @classmethod
    def decode(cls, words) -> "StatusRecord":
        """From int64 words (numpy array or sequence) of at least STATUS_WORDS entries."""
        values = [int(v) for v in np.asarray(words)[:STATUS_WORDS]]
        return cls(*values)

    @property
    def name(self) -> str:
        return STATUS_NAMES.get(self.code, f"UNKNOWN({self.code})")

    def header_field(self, expert_per_rank: int | None = None) -> str:
        """Name of the header word in ``count`` (BAD_HEADER, REPLY_MISMATCH): a fixed word, an
        expert count, or (given ``expert_per_rank``) the dedup trailer ``num_rows``."""
        if expert_per_rank is not None and self.count == HDR_FIXED_WORDS + expert_per_rank:
            return "num_rows"
        if self.count in HDR_WORD_NAMES:
            return HDR_WORD_NAMES[self.count]
        return "expert_counts" if self.count >= HDR_FIXED_WORDS else f"word {self.count}"

    @property
    def ok(self) -> bool:
        return self.code == STATUS_OK

    def error(self, *, layer_idx=None, timeout_s: float | None = None,
              expert_per_rank: int | None = None) -> Exception:
        """The exception the host backend raises for the same fault (code must not be OK).

        The layer named is the one the kernel latched (the failing dispatch or receive, which
        with ``blocking=False`` receives can be older than the call that synchronised);
        ``layer_idx`` only stands in when the record has none (-1). ``expert_per_rank``: the
        window's, so that a header fault in word ``HDR_FIXED_WORDS + expert_per_rank`` (the
        dedup trailer) is named ``num_rows``; without it such a word reads as an expert count.
        """
        code, peer = self.code, self.peer
        if self.layer >= 0:
            layer_idx = self.layer
        if code == STATUS_CAPACITY:
            return errors.routed_capacity_error(self.count, peer, self.cap, nothing_sent=True,
                                                layer_idx=layer_idx)
        if code == STATUS_TIMEOUT and self.observed == SHUTDOWN_SEQ:
            return errors.shutdown_during_reply_error(peer, layer_idx)  # no raw sentinel shown
        if code == STATUS_TIMEOUT:
            return errors.reply_timeout_error(peer, self.ring, layer_idx, self.expected,
                                              self.observed, timeout_s)
        if code == STATUS_SHUTDOWN:
            return errors.shutdown_during_reply_error(peer, layer_idx)
        field = self.header_field(expert_per_rank)
        if code == STATUS_REPLY_MISMATCH:
            return errors.reply_mismatch_error(peer, field, self.expected, self.observed, layer_idx)
        if code == STATUS_BAD_HEADER:
            return errors.bad_header_error(peer, field, self.expected, self.observed, layer_idx)
        if code == STATUS_BAD_EXPERT:
            return errors.bad_expert_error(self.observed, self.slot, self.expected, layer_idx)
        return errors.ProtocolError(f"device status {self.name}{errors._for_layer(layer_idx)}: {self}",
                                    layer_idx=layer_idx)
