"""Processes sharing one GPU, as a fluid: the simulator's model of one-GPU contention.

Every device phase running on a GPU (an attention layer's variable part, an expert GEMM
batch) runs at ``1 / (1 + Σ κ(its kind, their kind) x the shares of the other phases running
there)`` of its speed alone, re-rated whenever one starts or ends: a phase is slowed for the
part of it that overlaps others, by how much of the GPU they hold (``Deployment.hbm_contention``
for the attention, ``.attn_gemm_contention`` for the attention beside expert GEMMs,
``.ffn_contention`` for the FFN's GEMMs). Fixed costs (launches, eager issue)
never enter: they neither load the GPU nor slow.
"""
from __future__ import annotations

from dataclasses import dataclass

from afd_cupy.capacity.spec import Deployment


@dataclass
class Phase:
    """A device phase in flight: ``work_s`` seconds left at its speed alone, the ``rate`` it
    runs at since ``since`` (seconds of simulated time); ``version`` tells its current end
    event from the ones a rate change superseded; ``then`` = (event kind, args) at its end."""

    share: float  # of its GPU's SMs (Placement.share)
    kind: str  # "attention" or "ffn": picks its κ (Deployment.contention)
    work_s: float
    then: tuple
    rate: float = 1.0
    since: float = 0.0
    version: int = 0


class SharedGPUs:
    """The phases running on each GPU of ``deployment``. ``push(time, gpu, who, version)``
    schedules a phase's end; the simulator hands that event back to :meth:`end`."""

    def __init__(self, deployment: Deployment, push):
        self.dep, self.push = deployment, push
        self.running: dict = {}  # GPU -> {process: Phase}
        self.versions = 0

    def begin(self, now: float, gpu: tuple, who: tuple, phase: Phase) -> None:
        """``phase`` of process ``who`` starts on ``gpu`` at ``now``."""
        running = self.running.setdefault(gpu, {})
        self._settle(now, running)
        phase.since = now
        running[who] = phase
        self._rerate(now, gpu, running)

    def end(self, now: float, gpu: tuple, who: tuple, version: int) -> Phase | None:
        """The phase whose end event this is, taken off ``gpu`` (the others re-rated); None
        for an end a later rate change superseded."""
        running = self.running[gpu]
        phase = running.get(who)
        if phase is None or phase.version != version:
            return None
        self._settle(now, running)
        del running[who]
        self._rerate(now, gpu, running)
        return phase

    @staticmethod
    def _settle(now: float, running: dict) -> None:
        """Book the work every running phase did since its last rate change."""
        for phase in running.values():
            phase.work_s = max(0.0, phase.work_s - (now - phase.since) * phase.rate)
            phase.since = now

    def _rerate(self, now: float, gpu: tuple, running: dict) -> None:
        total = sum(phase.share for phase in running.values())
        by_kind = self.dep.attn_gemm_contention is not None  # else one κ per phase, whatever beside it
        for who, phase in running.items():
            if by_kind:
                load = sum(self.dep.contention(phase.kind, other.kind) * other.share
                           for key, other in running.items() if key != who)
            else:
                load = self.dep.contention(phase.kind) * (total - phase.share)
            phase.rate = 1.0 / (1.0 + load)
            self.versions += 1  # unique: an end left behind by an earlier phase never matches
            phase.version = self.versions
            self.push(now + phase.work_s / phase.rate, gpu, who, phase.version)
