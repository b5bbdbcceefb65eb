"""Host polling of a window's flags: the one host-side flag wait (docs/design/protocol.md).

Used by the host backend for everything and by the cuda backend with ``poll_mode="host"``
(one device-to-host copy of the flags per poll, no spinning kernel, no MPS needed).

A flag changes when its sender writes a new message; this poller keeps the value it last
consumed per slot (``seen``) and never resets a flag, so a changed value is an arrival
(ABA-safe). The scan start rotates so that no region starves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from afd_cupy import wire


#: idle back-off of the host waits: spin (yielding the GIL) this long, then sleep, starting at
#: IDLE_SLEEP_MIN_S and growing by IDLE_SLEEP_GROWTH per sleep up to IDLE_SLEEP_MAX_S. A message
#: arriving during the spin is seen at once; a later one within ~1/3 of the time waited (at most
#: IDLE_SLEEP_MAX_S late). Measured (tools/host_idle_cpu.py, 2 shared cores): an idle FFN rank
#: 6 % of a core instead of 29 %, a waiting Attention rank 4 % instead of 28 %, the busy round
#: trip unchanged (1.00x: a reply within the 2 ms spin is seen at once).
IDLE_SPIN_S = 2e-3
IDLE_SLEEP_MIN_S = 2e-5
IDLE_SLEEP_MAX_S = 1e-3
IDLE_SLEEP_GROWTH = 1.5


class Backoff:
    """One wait's idle back-off: call :meth:`pause` after each empty poll."""

    __slots__ = ("_spin_until", "_sleep_s")

    def __init__(self):
        self._spin_until = time.monotonic() + IDLE_SPIN_S
        self._sleep_s = IDLE_SLEEP_MIN_S

    def pause(self, deadline: float) -> None:
        """Yield (while spinning) or sleep, never past ``deadline`` (monotonic seconds)."""
        now = time.monotonic()
        if now < self._spin_until:
            time.sleep(0)
            return
        time.sleep(max(0.0, min(self._sleep_s, deadline - now)))
        self._sleep_s = min(self._sleep_s * IDLE_SLEEP_GROWTH, IDLE_SLEEP_MAX_S)


@dataclass(frozen=True)
class FlagArrival:
    """Slot (region, ring) of the own window now holds message ``flag``."""

    region: int
    ring: int
    flag: int


class HostPolling:
    """Arrival detection on ``window``'s own flags from the host.

    NOTE: on the host backend the flags are plain loads of shared memory; x86-64 keeps load
    order (TSO), so a header read after the flag read sees the writer's header. A weakly
    ordered host (Grace/ARM) needs an acquire fence between the two (numpy has none; see
    ``docs/design/protocol.md``, ``docs/design/fault-model.md``).
    """

    def __init__(self, window):
        self.window = window
        self.layout = window.layout
        self.seen = np.zeros(self.layout.num_slots, np.int64)
        self._scan_start = 0

    def poll(self) -> FlagArrival | None:
        """One scan of all own flags from a rotating start; the first changed slot or None.

        The slot is consumed: its flag is recorded as seen."""
        flags = self.window.read_flags()
        changed = np.flatnonzero(flags != self.seen)
        if changed.size == 0:
            return None
        num_slots = self.layout.num_slots
        rotated = (changed - self._scan_start) % num_slots
        slot = int(changed[np.argmin(rotated)])
        self.seen[slot] = flags[slot]
        self._scan_start = (slot + 1) % num_slots
        region, ring = divmod(slot, self.layout.ring_depth)
        return FlagArrival(region, ring, int(flags[slot]))

    def wait_any(self, timeout_s: float) -> FlagArrival | None:
        """Poll until an arrival or ``timeout_s``; None on timeout. Spins briefly, then backs
        off with growing short sleeps (:class:`Backoff`)."""
        deadline = time.monotonic() + timeout_s
        backoff = Backoff()
        while True:
            arrival = self.poll()
            if arrival is not None:
                return arrival
            if time.monotonic() >= deadline:
                return None
            backoff.pause(deadline)

    def wait_flag(self, region: int, ring: int, deadline: float) -> int | None:
        """Wait for the flag of slot (region, ring) to change; consume and return it, or None
        at ``deadline`` (``time.monotonic()`` seconds)."""
        slot = self.layout.slot_index(region, ring)
        view = self.window.flag_view(self.window.own_pe, region, ring)
        read = (lambda: int(view[0])) if isinstance(view, np.ndarray) else (lambda: int(view.get()[0]))
        seen = int(self.seen[slot])
        backoff = Backoff()
        while True:
            flag = read()
            if flag != seen:
                self.seen[slot] = flag
                return flag
            if time.monotonic() >= deadline:
                return None
            backoff.pause(deadline)

    def num_pending(self) -> int:
        """Slots whose flag changed since they were last consumed: arrivals not yet taken."""
        return int(np.count_nonzero(self.window.read_flags() != self.seen))

    def last_seen(self, region: int, ring: int) -> int:
        return int(self.seen[self.layout.slot_index(region, ring)])

    def read_header(self, region: int, ring: int) -> wire.Header:
        """Decode the header of slot (region, ring) of the own window (WireError if bad)."""
        words = self.window.to_host(self.window.header_view(self.window.own_pe, region, ring))
        return wire.decode_header(words, self.layout.expert_per_rank, self.layout)
