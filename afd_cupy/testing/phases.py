"""Wall and CPU time of named phases of one process (``tools/startup_profile.py``).

``PhaseTimer().phase(name)`` is a context manager adding the wall (``time.perf_counter``)
and this process's CPU time (``time.process_time``: every thread, user + system) of its
block to phase ``name``; a name entered several times (one per layer) accumulates and counts
its entries. :data:`NO_PHASES` does nothing, for callers that do not profile.
"""
from __future__ import annotations

import contextlib
import time


class PhaseTimer:
    """Phases in first-entry order: ``{name: {"wall_s", "cpu_s", "count"}}``."""

    def __init__(self):
        self.phases: dict[str, dict] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - wall, time.process_time() - cpu)

    def add(self, name: str, wall_s: float, cpu_s: float) -> None:
        entry = self.phases.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0, "count": 0})
        entry["wall_s"] += wall_s
        entry["cpu_s"] += cpu_s
        entry["count"] += 1


class _NoPhases:
    """A PhaseTimer that records nothing."""

    phases: dict = {}

    def phase(self, name: str):
        return contextlib.nullcontext()

    def add(self, name: str, wall_s: float, cpu_s: float) -> None:
        pass


NO_PHASES = _NoPhases()
