"""Header words and flags of the wire format, their encoding, the header's validity rule
(:func:`header_fault`, shared by :func:`decode_header` and the reply verdict) and the
protocol's message builders (docs/design/wire-format.md). Part of :mod:`afd_cupy.wire`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from afd_cupy.errors import WireError
from afd_cupy.wire.layout import HDR_FIXED_WORDS, WIRE_MODES, WindowLayout

MAGIC = 0x41464447  # "AFDG"
VERSION = 1
FLAG_SHUTDOWN = 1 << 1
#: header flag of every dedup-mode message (dispatch, reply, shutdown); never set in pair mode
FLAG_DEDUP = 1 << 2
#: with FLAG_SHUTDOWN, FFN -> Attention only: the shutdown was written over this rank's last
#: reply on the slot, whose header words (and rows) it kept: a reply the Attention side has not
#: read yet is still delivered, then the shutdown is seen (issue 35, item 13)
FLAG_KEPT_REPLY = 1 << 3
#: header flag of a dispatch whose rows are E4M3 with 128-channel fp32 scales
#: (``dispatch_dtype="fp8_e4m3"``, afd_cupy.wire.fp8): set on every data dispatch of such a
#: connector, never on replies (their rows are in the payload dtype) nor on shutdowns
FLAG_FP8 = 1 << 4

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
# HDR_FIXED_WORDS = 12 (from afd_cupy.wire.layout): expert_counts[expert_per_rank] follow
# dedup only: one more word after expert_counts, num_rows (at HDR_FIXED_WORDS + expert_per_rank)

# Dedup route table row (int32 words), one per message row: ROUTE_FIXED_WORDS + 2 * top_k words.
ROUTE_TOKEN = 0    # token index in the sender's batch
ROUTE_SHARED = 1   # 1: this rank runs the token's shared experts (such rows come first), else 0
ROUTE_SLOTS = 2    # top_k staging rows of the token's partials on this rank, in top-k order, -1 pad;
#                    then (from ROUTE_SLOTS + top_k) their fp32 gate weights as raw bits, 0 pad


#: flag value (and header seq) of a shutdown message: above every data seq, so flags stay
#: monotonic and a shutdown is an arrival on any ring it is written to
SHUTDOWN_SEQ = (1 << 63) - 1


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
    def is_fp8(self) -> bool:
        """The message's rows are FP8 wire rows (``FLAG_FP8``)."""
        return bool(self.flags & FLAG_FP8)

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

    Raises WireError with the observed values on a bad length, then on the first rule of
    :func:`header_fault` that fails (bad magic, version, mode, negative sizes,
    ``sum(expert_counts) != routed_tokens``, dedup sizes no dedup message can have), and,
    given the receiving window's ``layout``, on sizes over its capacities (views of them would
    read past the slot).
    """
    mode = wire_mode or (layout.wire_mode if layout is not None else "pair")
    is_dedup = mode == "dedup"
    array = np.asarray(words)
    expected_len = HDR_FIXED_WORDS + expert_per_rank + int(is_dedup)
    if array.ndim != 1 or array.shape[0] != expected_len:
        raise WireError(f"header has shape {array.shape}, expected ({expected_len},) "
                        f"for expert_per_rank={expert_per_rank} in wire_mode={mode!r}")
    w = array.tolist()  # Python ints: one conversion instead of one per field
    fault = header_fault(w, is_dedup)
    if fault is not None:
        raise WireError(_fault_message(fault, w, expert_per_rank, mode))
    counts = tuple(w[HDR_FIXED_WORDS:HDR_FIXED_WORDS + expert_per_rank])
    routed, shared = w[HDR_ROUTED_TOKENS], w[HDR_SHARED_TOKENS]
    num_rows = w[-1] if is_dedup else 0
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
        shared_tokens=shared, top_k=w[HDR_TOPK], flags=w[HDR_FLAGS],
        echo_seq=w[HDR_ECHO_SEQ] & 0xFFFFFFFF, expert_counts=counts, num_rows=num_rows)


def header_fault(words: list, is_dedup: bool, *, want_shared: int = -1,
                 want_rows: int = -1) -> tuple[int, int, int] | None:
    """``(word, expected, observed)`` of the first header rule that ``words`` (int32 header
    words as Python ints, of the right length; in dedup mode the last word is ``num_rows``)
    break, None when they pass. ``is_dedup``: the receiver's wire mode.

    The rules, in the order of the device's check (``check_reply`` of
    ``raw_kernels/attention/reply_check.cuh``), with the values it latches as ST_COUNT (``word``),
    ST_EXPECTED and ST_OBSERVED: magic; version; the mode flag (``FLAG_DEDUP`` set exactly in
    dedup mode); ``routed_tokens`` or an expert count negative (expected routed_tokens, observed
    the counts' sum); ``shared_tokens`` negative (expected ``want_shared``); ``num_rows``
    negative (expected ``want_rows``); the counts' sum != ``routed_tokens``; dedup only: sizes
    no dedup message can have (``num_rows <= routed_tokens <= num_rows * top_k``,
    ``shared_tokens <= num_rows``; expected the nearest ``num_rows`` the other sizes allow).
    ``want_shared`` / ``want_rows``: what the receiver expects (-1 when it has no expectation).
    """
    rows_word = len(words) - 1 if is_dedup else len(words)
    magic = words[HDR_MAGIC] & 0xFFFFFFFF
    if magic != MAGIC:
        return HDR_MAGIC, MAGIC, magic
    if words[HDR_VERSION] != VERSION:
        return HDR_VERSION, VERSION, words[HDR_VERSION]
    want_mode = FLAG_DEDUP if is_dedup else 0
    if words[HDR_FLAGS] & FLAG_DEDUP != want_mode:
        return HDR_FLAGS, want_mode, words[HDR_FLAGS] & FLAG_DEDUP
    counts = words[HDR_FIXED_WORDS:rows_word]
    counts_sum = sum(counts)
    routed, shared = words[HDR_ROUTED_TOKENS], words[HDR_SHARED_TOKENS]
    rows = words[rows_word] if is_dedup else 0
    if routed < 0 or min(counts, default=0) < 0:
        return HDR_ROUTED_TOKENS, routed, counts_sum
    if shared < 0:
        return HDR_SHARED_TOKENS, want_shared, shared
    if rows < 0:
        return rows_word, want_rows, rows
    if counts_sum != routed:
        return HDR_ROUTED_TOKENS, routed, counts_sum
    if is_dedup:
        top_k = words[HDR_TOPK]
        if rows > routed:
            return rows_word, routed, rows
        if shared > rows or routed > rows * max(top_k, 0):
            min_rows = -(-routed // top_k) if top_k > 0 else -1
            return rows_word, max(shared, min_rows), rows
    return None


def _fault_message(fault: tuple, words: list, expert_per_rank: int, mode: str) -> str:
    """The WireError message of :func:`decode_header` for a :func:`header_fault` verdict."""
    word, _, observed = fault
    if word == HDR_MAGIC:
        return f"bad header magic 0x{observed:08x}, expected 0x{MAGIC:08x}"
    if word == HDR_VERSION:
        return f"unsupported wire version {observed}, expected {VERSION}"
    if word == HDR_FLAGS:
        sent = "dedup" if observed else "pair"
        return (f"header flags 0x{words[HDR_FLAGS] & 0xFFFFFFFF:x} mark a {sent}-mode message; "
                f"this receiver runs wire_mode={mode!r}")
    counts = tuple(words[HDR_FIXED_WORDS:HDR_FIXED_WORDS + expert_per_rank])
    routed, shared, top_k = words[HDR_ROUTED_TOKENS], words[HDR_SHARED_TOKENS], words[HDR_TOPK]
    num_rows = words[-1] if mode == "dedup" else 0
    if min(counts, default=0) < 0 or min(routed, shared, num_rows) < 0:
        return (f"negative sizes in header: routed_tokens={routed}, shared_tokens={shared}, "
                f"expert_counts={counts}, num_rows={num_rows}")
    if sum(counts) != routed:
        return (f"header expert_counts sum to {sum(counts)} but routed_tokens={routed} "
                f"(counts={counts})")
    return (f"dedup header sizes inconsistent: num_rows={num_rows}, routed_tokens={routed} "
            f"(must lie in [num_rows, num_rows * top_k={top_k}]), shared_tokens={shared} "
            f"(must be <= num_rows)")


# --- the protocol's messages -----------------------------------------------------------
def slot_moved_on(flag: int, header: Header) -> bool:
    """True when a slot's flag word ``flag`` (int64, read now) no longer carries the seq of the
    message whose ``header`` was read there: its sender wrote the next message (or a shutdown)
    on the slot since, so what a reader took from the slot after the header may mix two
    messages. Compared on the low 32 bits, as the header carries them."""
    return (int(flag) & 0xFFFFFFFF) != header.seq


def dispatch_header(*, seq: int, src_rank: int, layer_idx: int, stage_idx: int, num_tokens: int,
                    shared_tokens: int, top_k: int, expert_counts, wire_mode: str = "pair",
                    num_rows: int = 0, fp8: bool = False) -> Header:
    """Header of a dispatch (Attention -> FFN); routed_tokens = sum(expert_counts).

    Dedup mode: ``FLAG_DEDUP`` set and ``num_rows`` = the message's rows (pair: must be 0).
    ``fp8``: the rows are FP8 wire rows (``FLAG_FP8``; pair mode only).
    The device builds the same words in ``afd_dispatch_scatter`` (order pinned by the probe).
    """
    if wire_mode not in WIRE_MODES or (wire_mode == "pair" and num_rows) or (fp8 and wire_mode != "pair"):
        raise WireError(f"dispatch_header: wire_mode={wire_mode!r} with num_rows={num_rows}, fp8={fp8}")
    counts = tuple(int(c) for c in expert_counts)
    flags = (FLAG_DEDUP if wire_mode == "dedup" else 0) | (FLAG_FP8 if fp8 else 0)
    return Header(seq=int(seq), src_rank=src_rank, layer_idx=layer_idx, stage_idx=stage_idx,
                  num_tokens=num_tokens, routed_tokens=sum(counts), shared_tokens=shared_tokens,
                  top_k=top_k, flags=flags, echo_seq=0, expert_counts=counts, num_rows=int(num_rows))


def dispatch_rows_fault(flags: int, layout: "WindowLayout") -> tuple[int, int, int] | None:
    """``(HDR_FLAGS, expected, observed)`` when a dispatch's header ``flags`` (int32 word) say
    its rows are in another format than the receiving FFN rank's ``layout`` expects
    (``FLAG_FP8`` set exactly when ``layout.is_fp8_dispatch``), None when they agree or the
    message is a shutdown (no rows). ``expected`` / ``observed``: the ``FLAG_FP8`` bits."""
    if flags & FLAG_SHUTDOWN:
        return None
    want = FLAG_FP8 if layout.is_fp8_dispatch else 0
    if flags & FLAG_FP8 != want:
        return HDR_FLAGS, want, flags & FLAG_FP8
    return None


def check_dispatch_rows(header: Header, layout: "WindowLayout") -> None:
    """WireError naming the flags and the receiver's ``dispatch_dtype`` when the dispatch
    ``header``'s row format (:func:`dispatch_rows_fault`) is not the one the receiving FFN rank
    reads: its rows are never read as the other format."""
    if dispatch_rows_fault(header.flags, layout) is None:
        return
    sent = "fp8_e4m3" if header.is_fp8 else "payload"
    raise WireError(f"dispatch from attention rank {header.src_rank} (layer {header.layer_idx}, seq "
                    f"{header.seq}): header flags 0x{header.flags & 0xFFFFFFFF:x} mark "
                    f"dispatch_dtype={sent!r} rows; this FFN rank reads "
                    f"dispatch_dtype={layout.dispatch_dtype!r}")


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

