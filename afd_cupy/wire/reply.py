"""The Attention side's reply checks: what a reply must echo (:class:`ReplyExpectation`),
late replies, and the verdict of a reply (:func:`reply_verdict`), the status record the device's
``afd_wait_replies`` latches for the same header words; :func:`check_reply` raises its typed
error (docs/design/protocol.md). Part of :mod:`afd_cupy.wire`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from afd_cupy.wire.header import (HDR_ECHO_SEQ, HDR_LAYER, HDR_ROUTED_TOKENS, HDR_SHARED_TOKENS,
                                  HDR_STAGE, Header, decode_header, header_fault)
from afd_cupy.wire.layout import HDR_FIXED_WORDS
from afd_cupy.wire.status import (CLEAR_STATUS, STATUS_BAD_HEADER, STATUS_REPLY_MISMATCH,
                                  STATUS_SHUTDOWN, StatusRecord)


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


def reply_verdict(words, want: ReplyExpectation, *, wire_mode: str = "pair", slot: int = -1,
                  ring: int = -1, flag: int = -1) -> StatusRecord:
    """The status record ``afd_wait_replies`` latches for a reply of int32 header ``words``
    (numpy array or sequence, ``HDR_FIXED_WORDS + expert_per_rank`` words, one more in dedup
    mode) to the dispatch ``want``; :data:`CLEAR_STATUS` (all words 0, a status block no kernel
    wrote to) when the reply passes.

    ``wire_mode``: the receiver's; ``slot`` / ``ring``: where the reply landed, ``flag``: the
    flag word it arrived with (recorded as ST_SLOT, ST_RING and, for a shutdown, ST_OBSERVED).
    The rules and their order: :func:`~afd_cupy.wire.header.header_fault` (STATUS_BAD_HEADER),
    then those of :func:`check_reply` (STATUS_SHUTDOWN, STATUS_REPLY_MISMATCH); ST_COUNT is the
    failing header word (-1 for a shutdown), ST_CAP -1, ST_LAYER ``want.layer_idx``.
    ``StatusRecord.error`` of the result is the error the host checks raise for the same words
    (same type; same message for a reply mismatch).
    """
    w = [int(v) for v in np.asarray(words, np.int32)]
    is_dedup = wire_mode == "dedup"
    expert_per_rank = len(w) - HDR_FIXED_WORDS - int(is_dedup)
    if expert_per_rank < 0:
        raise ValueError(f"reply_verdict: {len(w)} header words are too few for wire_mode={wire_mode!r}")
    slot, ring = int(slot), int(ring)
    fault = header_fault(w, is_dedup, want_shared=want.shared_tokens, want_rows=want.num_rows)
    if fault is not None:
        return _record(want, STATUS_BAD_HEADER, *fault, slot=slot, ring=ring)
    header = decode_header(w, expert_per_rank, wire_mode=wire_mode)
    fault = reply_fault(header, want, flag=int(flag))
    return CLEAR_STATUS if fault is None else _record(want, *fault, slot=slot, ring=ring)


def reply_fault(header: Header, want: ReplyExpectation, *,
                flag: int = -1) -> tuple[int, int, int, int] | None:
    """``(code, word, expected, observed)`` of the first reply rule a decoded ``header`` breaks
    for the pending dispatch ``want``, None when it answers it.

    In this order (the device's ``check_reply`` checks the same words in the same order): the
    shutdown flag (STATUS_SHUTDOWN, word -1, expected ``want.seq``, observed ``flag``; not for a
    shutdown that kept the reply to ``want``, ``FLAG_KEPT_REPLY``: that is the reply), then the
    echoed seq (low 32 bits), layer, stage, routed and shared row counts and ``num_rows``
    (STATUS_REPLY_MISMATCH, word = the header word).
    """
    if header.is_shutdown and not answers(header, want.seq):
        return STATUS_SHUTDOWN, -1, want.seq, flag
    rows_word = HDR_FIXED_WORDS + len(header.expert_counts)
    for word, observed, expected in ((HDR_ECHO_SEQ, header.echo_seq, want.seq & 0xFFFFFFFF),
                                     (HDR_LAYER, header.layer_idx, want.layer_idx),
                                     (HDR_STAGE, header.stage_idx, want.stage_idx),
                                     (HDR_ROUTED_TOKENS, header.routed_tokens, want.routed_tokens),
                                     (HDR_SHARED_TOKENS, header.shared_tokens, want.shared_tokens),
                                     (rows_word, header.num_rows, want.num_rows)):
        if observed != expected:
            return STATUS_REPLY_MISMATCH, word, expected, observed
    return None


def check_reply(header: Header, want: ReplyExpectation) -> None:
    """Raise the typed error of a reply that does not answer the pending dispatch ``want``:
    the first rule of :func:`reply_fault` it breaks, as ``StatusRecord.error`` names it
    (ConnectorShutdown for the shutdown flag, ProtocolError naming the field otherwise).
    Magic, version, mode and the expert-count sum were checked by :func:`decode_header`
    (WireError)."""
    fault = reply_fault(header, want)
    if fault is not None:
        record = _record(want, *fault)
        raise record.error(layer_idx=want.layer_idx, expert_per_rank=len(header.expert_counts))


def _record(want: ReplyExpectation, code: int, word: int, expected: int, observed: int, *,
            slot: int = -1, ring: int = -1) -> StatusRecord:
    return StatusRecord(code=code, peer=want.peer, slot=slot, ring=ring, expected=expected,
                        observed=observed, count=word, cap=-1, layer=want.layer_idx)
