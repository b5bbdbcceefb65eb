"""The next-seq rule, the one Python home (docs/design/protocol.md, "Sequence numbers").

Every message a rank writes into a slot carries the slot's next sequence number: the
previous one plus one, starting at 1 (0 means "nothing sent"; ``wire.SHUTDOWN_SEQ`` is
reserved for shutdown headers and never reached by counting). Each sender keeps one counter
per slot it writes: an Attention rank per (FFN rank, ring), an FFN rank per (Attention rank,
ring). The flag of a slot is this number, so a changed flag is a new message (ABA-safe).

The kernels apply the same rule on the device (``raw_kernels/wire.cuh``); this module is what
the host backend, the host-side reply counters of the cuda backend and the graph stage's
numpy reference (:mod:`afd_cupy.ffn.graph`) use.
"""
from __future__ import annotations

import numpy as np


def next_seq(prev_seq: int) -> int:
    """The seq of the message after one that carried ``prev_seq`` (0: none yet)."""
    return int(prev_seq) + 1


class SeqCounter:
    """One sequence counter per slot of shape ``shape`` (int64, all 0: nothing sent yet).

    ``values`` is the counters' array (the seq of the last message per slot), e.g.
    ``[num_regions, ring_depth]`` or ``[num_slots]``. Not thread-safe: each counter has one
    writer (the rank that sends on the slot).
    """

    __slots__ = ("values",)

    def __init__(self, shape):
        self.values = np.zeros(shape, np.int64)

    def advance(self, index) -> int:
        """Take the next seq of slot ``index`` (an int or a tuple into :attr:`values`)."""
        seq = next_seq(self.values[index])
        self.values[index] = seq
        return seq

    def last(self, index) -> int:
        """The seq of the last message of slot ``index`` (0: none yet)."""
        return int(self.values[index])

    def set_last(self, index, seq: int) -> None:
        """Make ``seq`` the last seq of slot ``index``: its next message carries ``seq + 1``
        (another loop used the slot meanwhile, or a test stages a message by hand)."""
        self.values[index] = int(seq)

    def copy(self) -> np.ndarray:
        """A copy of every counter."""
        return self.values.copy()

    def load(self, values) -> None:
        """Replace every counter (``values``: the same number of counters). ValueError for a
        wrong count."""
        values = np.asarray(values, np.int64)
        if values.size != self.values.size:
            raise ValueError(f"{values.size} counters for {self.values.size} slots")
        self.values[...] = values.reshape(self.values.shape)
