"""The kernels' status block and the FFN doorbell, as words (mirrored in
``raw_kernels/common/wire.cuh``), and :class:`StatusRecord`, a decoded status block and the typed error
it stands for (docs/design/protocol.md). Part of :mod:`afd_cupy.wire`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from afd_cupy import errors
from afd_cupy.wire.header import HDR_WORD_NAMES, SHUTDOWN_SEQ
from afd_cupy.wire.layout import HDR_FIXED_WORDS

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
        return errors.ProtocolError(f"device status {self.name}{errors.for_layer(layer_idx)}: {self}",
                                    layer_idx=layer_idx)


#: the record of a status block no kernel wrote to (every word 0): what a check that passes
#: leaves, and what :func:`afd_cupy.wire.reply_verdict` returns for a reply that passes
CLEAR_STATUS = StatusRecord(*(0,) * STATUS_WORDS)
