"""The request side of ``bench_decode``: one Attention replica's decode batch, its open-loop
arrivals, and the per-token / per-request statistics. Pure host bookkeeping (numpy), no
device, no torch: the replica (``decode_model.DecodeReplica``) mirrors the slot moves in its
KV cache.

A batch has ``batch`` slots. Active requests always fill slots ``[0, n)`` (compact), so the
attention reads one contiguous prefix of the cache: when a request finishes, the request in
the last active slot moves into its slot (one :class:`Move`, its KV rows copied), and
waiting requests join at the end. Each request has a prompt length drawn uniformly from
``context * [1 - jitter, 1 + jitter]`` and an output length drawn uniformly from
``[ceil(output_len / 2), floor(3 * output_len / 2)]``; its KV-cache length before a step is
``prompt + generated``, and every step adds one token to every active request.

Arrivals (:class:`PoissonArrivals`): a seeded Poisson process in wall time (exponential gaps,
``rate`` requests/s) that does not look at the batch (open loop). Arrivals wait in a FIFO
queue until a slot frees. The batch starts full (``batch`` requests whose progress is drawn
uniformly in ``[0, their output length)``, so their finishes spread out) with an empty queue.

Statistics: every active request gets one output token per step, whose time per output token
(TPOT) is that step's wall time; :func:`weighted_percentile` takes the percentiles over tokens.
A request that finishes during the measured run also gets its own TPOT: the mean of the
measured step times it took part in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

DEFAULT_JITTER = 0.25


@dataclass(frozen=True)
class Move:
    """KV rows ``[0, length)`` of slot ``src`` go to slot ``dst`` (compaction after a finish)."""

    src: int
    dst: int
    length: int


@dataclass
class Request:
    request_id: int
    prompt_len: int
    output_len: int
    generated: int = 0
    measured_ms: float = 0.0  # sum of the measured step times this request took part in
    measured_steps: int = 0

    @property
    def kv_len(self) -> int:
        return self.prompt_len + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len


class PoissonArrivals:
    """Seeded Poisson arrivals at ``rate`` requests/s from ``start_s`` (``rate`` 0: none)."""

    def __init__(self, rate: float, seed: int, start_s: float):
        if not rate >= 0 or math.isinf(rate):
            raise ValueError(f"arrival rate must be finite and >= 0 requests/s, got {rate}")
        self.rate = float(rate)
        self.rng = np.random.default_rng(seed)
        self.next_s = start_s + self._gap()

    def _gap(self) -> float:
        return float(self.rng.exponential(1.0 / self.rate)) if self.rate > 0 else math.inf

    def due(self, now_s: float) -> int:
        """How many arrivals happened up to ``now_s`` since the last call."""
        count = 0
        while self.next_s <= now_s:
            count += 1
            self.next_s += self._gap()
        return count


@dataclass
class DecodeBatch:
    """One replica's requests (module doc). ``context``: mean prompt length; ``batch``: slots;
    ``output_len``: mean output length; ``seed``: prompt/output lengths and initial progress."""

    context: int
    batch: int
    output_len: int
    seed: int
    jitter: float = DEFAULT_JITTER
    active: list = field(default_factory=list)
    queue: list = field(default_factory=list)
    arrivals: PoissonArrivals | None = None
    num_arrived: int = 0
    num_finished: int = 0
    measuring: bool = False
    step_ms: list = field(default_factory=list)  # measured steps: wall ms
    step_tokens: list = field(default_factory=list)  # measured steps: tokens (= active requests)
    request_tpot_ms: list = field(default_factory=list)  # requests finished while measuring

    def __post_init__(self):
        if self.context < 1 or self.batch < 1 or self.output_len < 2:
            raise ValueError(f"need context >= 1, batch >= 1, output_len >= 2; got context={self.context}, "
                             f"batch={self.batch}, output_len={self.output_len}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"context jitter must be in [0, 1), got {self.jitter}")
        self.rng = np.random.default_rng(self.seed)
        self.next_id = 0
        for _ in range(self.batch):
            request = self._new_request()
            request.generated = int(self.rng.integers(0, request.output_len))
            self.active.append(request)

    # --- sizes
    @property
    def max_prompt(self) -> int:
        return max(1, round(self.context * (1 + self.jitter)))

    @property
    def max_output(self) -> int:
        return (3 * self.output_len) // 2

    @property
    def cache_len(self) -> int:
        """KV positions a slot needs (the longest prompt + the longest output), rounded up to 16."""
        return -(-(self.max_prompt + self.max_output) // 16) * 16

    def _new_request(self) -> Request:
        low = max(1, round(self.context * (1 - self.jitter)))
        prompt = int(self.rng.integers(low, self.max_prompt + 1))
        output = int(self.rng.integers(-(-self.output_len // 2), self.max_output + 1))
        self.next_id += 1
        return Request(self.next_id - 1, prompt, max(2, output))

    # --- the run
    def start_arrivals(self, rate: float, now_s: float) -> None:
        """Begin the open-loop arrivals at ``rate`` requests/s (seeded from ``seed``)."""
        self.arrivals = PoissonArrivals(rate, self.seed + 7919, now_s)

    def start_measuring(self) -> None:
        self.measuring = True

    def kv_lengths(self) -> np.ndarray:
        """int64 [n]: KV-cache length of each active slot before this step (its new token goes
        at that index)."""
        return np.fromiter((r.kv_len for r in self.active), np.int64, len(self.active))

    @property
    def num_active(self) -> int:
        return len(self.active)

    def advance(self, step_ms: float, now_s: float) -> list[Move]:
        """After a step of ``step_ms``: one token per active request, finished requests leave
        (compaction moves, in order), arrivals up to ``now_s`` queue, the queue fills free
        slots. Returns the moves the KV cache must make."""
        if self.measuring:
            self.step_ms.append(step_ms)
            self.step_tokens.append(len(self.active))
        for request in self.active:
            request.generated += 1
            if self.measuring:
                request.measured_ms += step_ms
                request.measured_steps += 1
        slots, moves = self.active, []
        lo, hi = 0, len(slots) - 1
        while True:  # fill finished slots from the end (two pointers)
            while lo <= hi and not slots[lo].done:
                lo += 1
            while hi >= lo and slots[hi].done:
                self._finish(slots[hi])
                hi -= 1
            if lo >= hi:
                break
            self._finish(slots[lo])  # slots[lo] is done, slots[hi] is not
            moves.append(Move(hi, lo, slots[hi].kv_len))
            slots[lo] = slots[hi]
            lo, hi = lo + 1, hi - 1
        del slots[hi + 1:]
        self._admit(now_s)
        return moves

    def _finish(self, request: Request) -> None:
        self.num_finished += 1
        if self.measuring and request.measured_steps:
            self.request_tpot_ms.append(request.measured_ms / request.measured_steps)

    def admit(self, now_s: float) -> None:
        """Queue the arrivals up to ``now_s`` and fill free slots (between steps)."""
        self._admit(now_s)

    def next_arrival_s(self) -> float:
        """When the next arrival comes (inf: never)."""
        return self.arrivals.next_s if self.arrivals is not None else float("inf")

    def _admit(self, now_s: float) -> None:
        if self.arrivals is not None:
            for _ in range(self.arrivals.due(now_s)):
                self.queue.append(self._new_request())
                self.num_arrived += 1
        while self.queue and len(self.active) < self.batch:
            self.active.append(self.queue.pop(0))

    def stats(self, elapsed_s: float) -> dict:
        """The measured run: steps, tokens, tokens/s, TPOT (per token and per finished request)."""
        tokens = int(sum(self.step_tokens))
        nan = float("nan")
        return {"steps": len(self.step_ms), "tokens": tokens, "elapsed_s": elapsed_s,
                "tokens_per_s": tokens / elapsed_s if elapsed_s > 0 else nan,
                "step_mean_ms": sum(self.step_ms) / len(self.step_ms) if self.step_ms else nan,
                "tpot_mean_ms": (sum(m * n for m, n in zip(self.step_ms, self.step_tokens)) / tokens
                                 if tokens else nan),
                "tpot_p50_ms": weighted_percentile(self.step_ms, self.step_tokens, 50),
                "tpot_p99_ms": weighted_percentile(self.step_ms, self.step_tokens, 99),
                "request_tpot_p50_ms": weighted_percentile(self.request_tpot_ms, None, 50),
                "request_tpot_p99_ms": weighted_percentile(self.request_tpot_ms, None, 99),
                "requests_finished": len(self.request_tpot_ms), "arrived": self.num_arrived,
                "mean_active": tokens / len(self.step_ms) if self.step_ms else nan,
                "queue_end": len(self.queue)}


def weighted_percentile(values, weights, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of ``values`` each counted ``weights[i]`` times
    (None: once each); NaN when the total weight is 0."""
    values = np.asarray(values, np.float64)
    weights = np.ones_like(values) if weights is None else np.asarray(weights, np.float64)
    if values.shape != weights.shape:
        raise ValueError(f"values {values.shape} and weights {weights.shape} differ in shape")
    total = float(weights.sum())
    if values.size == 0 or total <= 0:
        return float("nan")
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    rank = max(1.0, math.ceil(q / 100.0 * total))
    return float(values[order][min(int(np.searchsorted(cumulative, rank)), values.size - 1)])


def auto_rate(batch: int, output_len: int, step_s: float, overload: float) -> float:
    """An arrival rate that keeps ``batch`` slots full: ``overload`` x the replica's service
    rate at ``step_s`` per step (``batch`` requests of mean ``output_len`` tokens)."""
    if step_s <= 0:
        raise ValueError(f"step time must be > 0, got {step_s}")
    return overload * batch / (output_len * step_s)
