"""What a simulation reports: per replica, per FFN class, and the whole deployment."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (bench_common's convention); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class ReplicaResult:
    """One replica's measured steps: ``tokens_per_s``, step time mean/p50/p99 (seconds; for
    decode the step time IS the time per output token of each request in the batch)."""

    idx: int
    kind: str
    steps: int
    tokens: int
    tokens_per_s: float
    step_mean_s: float
    step_p50_s: float
    step_p99_s: float

    @classmethod
    def from_steps(cls, idx: int, kind: str, steps: list) -> "ReplicaResult":
        """``steps``: (start, end, tokens) per measured step."""
        durations = [end - start for start, end, _ in steps]
        tokens = sum(t for _, _, t in steps)
        elapsed = steps[-1][1] - steps[0][0] if steps else 0.0
        return cls(idx, kind, len(steps), tokens, tokens / elapsed if elapsed > 0 else float("nan"),
                   sum(durations) / len(durations) if durations else float("nan"),
                   percentile(durations, 50), percentile(durations, 99))


@dataclass(frozen=True)
class FFNResult:
    """One class of identical FFN ranks (``ranks``): busy fraction in the window, the mean
    device time of a compute batch that started in it (``busy_per_batch_s``, seconds; async:
    per item, what bench_afd's busy fraction / items per s measures); items
    waiting (arrived, not yet in a compute batch; lockstep: held for the other replicas) as a
    time average over the whole run and sampled at every take inside the window (what
    bench_afd reports); the arrivals and total wait that Little's law ties to the average."""

    ranks: tuple
    busy_fraction: float
    busy_per_batch_s: float
    items_waiting_mean: float
    items_waiting_max: int
    items_waiting_at_take_mean: float
    arrivals: int
    total_wait_s: float
    run_s: float

    @property
    def mean_wait_s(self) -> float:
        return self.total_wait_s / self.arrivals if self.arrivals else float("nan")


def ffn_result(ranks, busy_spans, take_samples, start, end, queued_area, total_wait, arrivals,
               run_end, inflight: tuple | None = None) -> FFNResult:
    """``busy_spans``: (start, end) of every finished compute batch; ``inflight``: the one
    still running when the run ended (start, run end), busy but of no known length."""
    window = max(end - start, 1e-30)
    busy = sum(max(0.0, min(e, end) - max(s, start)) for s, e in busy_spans + ([inflight] if inflight else []))
    inside = [n for t, n in take_samples if start <= t <= end]
    batches = [e - s for s, e in busy_spans if start <= s <= end]
    per_batch = sum(batches) / len(batches) if batches else float("nan")
    return FFNResult(tuple(ranks), busy / window, per_batch, queued_area / run_end if run_end > 0 else float("nan"),
                     max(inside, default=0), sum(inside) / len(inside) if inside else float("nan"),
                     arrivals, total_wait, run_end)


@dataclass(frozen=True)
class SimResult:
    """The whole run: the schedule, the wire mode, per replica and per FFN class results,
    the measured window ``[window_start_s, window_end_s]``, the GPUs used, events handled."""

    schedule: str
    wire_mode: str
    replicas: tuple
    ffn: tuple
    window_start_s: float
    window_end_s: float
    num_gpus: int
    events: int

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens_per_s for r in self.replicas)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.num_gpus

    @property
    def ffn_busy(self) -> float:
        """Busy fraction, mean over FFN ranks."""
        ranks = sum(len(f.ranks) for f in self.ffn)
        return sum(f.busy_fraction * len(f.ranks) for f in self.ffn) / ranks

    @property
    def worst_step_p99_s(self) -> float:
        return max(r.step_p99_s for r in self.replicas)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(tokens_per_s=self.tokens_per_s, tokens_per_s_per_gpu=self.tokens_per_s_per_gpu,
                   ffn_busy=self.ffn_busy, worst_step_p99_s=self.worst_step_p99_s)
        return out
