"""A discrete-event simulator of AFD serving: A Attention replicas, F FFN ranks, per layer.

A replica's step: per layer, attention on its own process, then one item to every FFN rank
(dispatch kernel + link), then it waits for every rank's reply (link) and combines; the next
layer starts after the combine. An FFN rank's host loop takes the arrivals in the order ``SimConfig.ffn_pick`` says (the
library's: round robin over the Attention ranks, as ``afd_wait_any`` scans its slots), and its
device serves the compute batches FIFO, one at a time:

- ``async``: every item is its own batch, served in arrival order;
- ``async_merge`` (a what-if: FFNWorker does not do it): as async, but a compute batch takes
  every waiting item of the head item's layer with it (weights read once for all of them);
- ``lockstep``: the items of (step, layer) from every replica form one merged batch, which
  enters the FIFO once the last of them arrived (a barrier per layer; replicas run the same
  number of steps, and a replica with nothing to do still sends an empty item).

Processes sharing a GPU (``Deployment.hbm_contention``, ``.ffn_contention``) slow each other
as a fluid (``shared_gpu``). ``SimConfig.noise_cv`` multiplies every attention layer, FFN host take and GEMM
batch by an independent lognormal factor of mean 1 (a seeded stream of its own).

Under balanced routing every FFN rank with the same placement and the same link from every
replica sees the same arrivals, so one rank per such class is simulated (exact, not an
approximation of the model). The measured window starts when every replica finished its
warm-up steps and ends when the last one finished its ``steps`` measured steps.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.results import ReplicaResult, SimResult, ffn_result
from afd_cupy.capacity.shared_gpu import Phase, SharedGPUs
from afd_cupy.capacity.spec import Deployment, ModelShape, ReplicaLoad, SimConfig
from afd_cupy.errors import ConfigError

_ATTN_DONE, _ARRIVE, _HOST_DONE, _FFN_DONE, _REPLY, _REQUEST, _PHASE_BEGIN, _PHASE_END = range(8)


@dataclass
class _Class:
    """One class of identical FFN ranks: placement, multiplicity, FIFO server state."""

    ranks: list
    share: float
    gpu: tuple
    links: tuple  # one Link per replica
    queue: deque = None  # arrivals the host loop has not taken yet
    gpu_queue: deque = None  # compute batches the device has not started yet
    host_busy_until: float = -1.0
    computing: bool = False  # the device runs a compute batch
    compute_since: float = 0.0
    pending: dict = None
    queued_area: float = 0.0  # integral of items waiting dt
    last_change: float = 0.0
    waiting: int = 0
    waits_total: float = 0.0
    arrival_sum: float = 0.0  # sum of the arrival times of the items still waiting
    items_started: int = 0
    take_samples: list = None
    busy_spans: list = None
    scan_start: int = 0  # ffn_pick "rotate": the slot the host loop's next scan starts at


class Simulator:
    """One run of ``deployment`` serving ``loads`` (one per replica); :meth:`run` -> SimResult."""

    def __init__(self, shape: ModelShape, deployment: Deployment, loads: tuple, costs: cm.Costs,
                 config: SimConfig = SimConfig()):
        if not isinstance(loads, tuple) or len(loads) != deployment.num_attn:
            raise ConfigError(f"loads must be a tuple of one ReplicaLoad per Attention replica "
                              f"({deployment.num_attn}), got {loads!r}")
        for load in loads:
            if not isinstance(load, ReplicaLoad):
                raise ConfigError(f"loads holds {load!r}, not a ReplicaLoad")
        self.shape, self.dep, self.loads, self.costs, self.cfg = shape, deployment, loads, costs, config
        self.rng = random.Random(config.seed)
        # the noise's own stream: the arrivals stay the same whatever noise_cv is
        self.noise_rng = random.Random(f"noise-{config.seed}")
        sigma2 = math.log1p(config.noise_cv ** 2)
        self.noise_mu, self.noise_sigma = -sigma2 / 2, math.sqrt(sigma2)  # lognormal of mean 1
        self.senders = sum(load.ffn for load in loads)  # replicas whose layers go through the FFN
        if not self.senders:
            raise ConfigError("loads: at least one replica must send to the FFN (every ReplicaLoad has ffn=False)")
        self.classes = self._classes()
        self.heap, self.seq, self.now = [], 0, 0.0
        self.gpus = SharedGPUs(deployment, lambda time, *args: self._push(time, _PHASE_END, *args))

    def _classes(self) -> list:
        groups: dict = {}
        for j, p in enumerate(self.dep.ffn):
            links = tuple(self.dep.link(a, j) for a in range(self.dep.num_attn))
            gpu = p.gpu if self.dep.contended else -1  # the GPU matters only for contention
            groups.setdefault((p.node, gpu, p.share, links), []).append(j)
        return [_Class(ranks, key[2], key[:2], key[3], deque(), deque(), pending={}, take_samples=[], busy_spans=[])
                for key, ranks in groups.items()]

    # ------------------------------------------------------------------ event plumbing
    def _push(self, time: float, kind: int, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, kind, args))

    # ------------------------------------------------------------------ device phases, shared GPUs
    def _run_phase(self, gpu: tuple, who: tuple, share: float, kind: str, work_s: float, start: float,
                   then: tuple) -> None:
        """Run ``work_s`` seconds of a ``kind`` phase of process ``who`` from ``start``; at its
        end the event ``then`` = (kind, args) fires. Without contention it ends at start + work;
        with it the phase shares its GPU with the others running there (shared_gpu)."""
        if not self.dep.contended:
            self._push(start + work_s, then[0], *then[1])
            return
        phase = Phase(share, kind, work_s, then)
        if start > self.now:
            self._push(start, _PHASE_BEGIN, gpu, who, phase)
        else:
            self._phase_begin(gpu, who, phase)

    def _phase_begin(self, gpu: tuple, who: tuple, phase: Phase) -> None:
        self.gpus.begin(self.now, gpu, who, phase)

    def _phase_end(self, gpu: tuple, who: tuple, version: int) -> None:
        phase = self.gpus.end(self.now, gpu, who, version)
        if phase is not None:
            self.handlers[phase.then[0]](*phase.then[1])

    def _noise(self) -> float:
        """A service time's noise factor (SimConfig.noise_cv): exactly 1.0 without noise."""
        if self.cfg.noise_cv <= 0:
            return 1.0
        return self.noise_rng.lognormvariate(self.noise_mu, self.noise_sigma)

    # ------------------------------------------------------------------ replicas
    def _new_replica(self, idx: int, load: ReplicaLoad) -> dict:
        state = {"idx": idx, "load": load, "step": 0, "layer": 0, "replies": 0, "step_start": 0.0,
                 "steps": [], "active": [], "backlog": 0, "idle": False, "tokens": 0}
        p = self.dep.attention[idx]
        state["gpu"], state["share"] = (p.node, p.gpu), p.share
        if load.kind == "decode" and load.arrival_rate is None:
            # closed loop, progress staggered evenly: request i is (done_i + step) mod output_len
            # tokens into its output, replaced by a new one when it finishes, so the batch's
            # cached tokens repeat with period output_len (one sum per phase of that cycle)
            done = [(i * load.output_len) // load.batch_size for i in range(load.batch_size)]
            state["ctx_cycle"] = [sum(load.context_len + (d + t) % load.output_len for d in done)
                                  for t in range(load.output_len)]
        if load.arrival_rate is not None:
            self._push(self.rng.expovariate(load.arrival_rate), _REQUEST, idx)
        return state

    def _step_shape(self, st: dict) -> tuple:
        """(tokens, causal pairs, cached tokens) of the replica's next step."""
        load = st["load"]
        if load.kind == "prefill":
            if load.arrival_rate is not None and st["backlog"] == 0:
                return 0, 0.0, 0.0
            return sum(load.lengths), float(sum(n * (n + 1) // 2 for n in load.lengths)), 0.0
        if "ctx_cycle" in st:
            return load.batch_size, 0.0, float(st["ctx_cycle"][st["step"] % load.output_len])
        active = st["active"][:load.batch_size]
        return len(active), 0.0, float(sum(ctx for ctx, _ in active))

    def _start_step(self, st: dict, at: float | None = None) -> None:
        """The replica's next step from ``at`` (default now)."""
        tokens, pairs, ctx = self._step_shape(st)
        if tokens == 0 and self.cfg.schedule == "async":
            st["idle"] = True  # waits for an arrival (open loop)
            return
        st["idle"] = False
        st["shape"] = (tokens, pairs, ctx)
        if st["load"].kind == "prefill" and st["load"].arrival_rate is not None and tokens:
            st["backlog"] -= 1
        st["step_start"], st["layer"] = self.now if at is None else at, 0
        self._start_layer(st, st["step_start"])

    def _start_layer(self, st: dict, at: float | None = None) -> None:
        """The step's next layer from ``at`` (default now): its attention phase."""
        tokens, pairs, ctx = st["shape"]
        fixed = self.costs.attn_fixed_s
        work = cm.attention_time(self.costs, tokens, pairs, ctx, st["share"]) - fixed if tokens else 0.0
        noise = self._noise()
        # the host issues layer l of the step by (l + 1) x attn_host_s; the device starts it then
        start = max(self.now if at is None else at, st["step_start"] + (st["layer"] + 1) * self.costs.attn_host_s)
        # NOTE: the fixed part (launches, eager issue) neither loads the GPU nor slows beside others
        self._run_phase(st["gpu"], ("a", st["idx"]), st["share"], "attention", work * noise, start + fixed * noise,
                        (_ATTN_DONE, (st["idx"],)))

    def _attn_done(self, a: int) -> None:
        st = self.replicas[a]
        if not st["load"].ffn:  # a background replica: its next layer at once, nothing sent
            st["layer"] += 1
            if st["layer"] < self.shape.layers:
                self._start_layer(st)
            else:
                self._finish_step(st, self.now)
            return
        tokens = st["shape"][0]
        num_ffn = self.dep.num_ffn
        nbytes = cm.wire_rows(self.shape, tokens, num_ffn, self.cfg.wire_mode) * self.shape.row_bytes
        st["replies"] = 0
        for c, cls in enumerate(self.classes):
            arrive = (self.now + self.costs.dispatch_fixed_s + cls.links[a].time_s(nbytes)
                      + self.costs.ffn_poll_s)
            self._push(arrive, _ARRIVE, c, a, st["step"], st["layer"], tokens)

    def _reply(self, a: int) -> None:
        st = self.replicas[a]
        st["replies"] += 1
        if st["replies"] < len(self.classes):
            return
        done = self.now + self.costs.combine_fixed_s
        st["layer"] += 1
        if st["layer"] < self.shape.layers:
            self._start_layer(st, done)  # the combine runs on the replica's own stream before it
            return
        self._finish_step(st, done)

    def _finish_step(self, st: dict, end: float) -> None:
        tokens = st["shape"][0]
        st["steps"].append((st["step_start"], end, tokens))
        st["step"] += 1
        if len(st["steps"]) == self.cfg.warmup_steps + self.cfg.steps:
            self.unfinished -= 1
        if st["load"].kind == "decode" and "ctx_cycle" not in st:
            self._advance_decode(st)
        if not self._finished():
            self._start_step(st, end)

    def _advance_decode(self, st: dict) -> None:
        """Open loop: the batch's requests one token further; finished ones leave."""
        load, kept = st["load"], []
        for i, (ctx, left) in enumerate(st["active"]):
            if i < load.batch_size:
                ctx, left = ctx + 1, left - 1
            if left > 0:
                kept.append([ctx, left])
        st["active"] = kept

    def _request(self, a: int) -> None:
        st = self.replicas[a]
        load = st["load"]
        if load.kind == "prefill":
            st["backlog"] += 1
        else:
            st["active"].append([load.context_len, load.output_len])
        if not self._finished():
            self._push(self.now + self.rng.expovariate(load.arrival_rate), _REQUEST, a)
        if st["idle"]:
            self._start_step(st)

    def _finished(self) -> bool:
        """True once every replica ran its warm-up and measured steps."""
        return self.unfinished == 0

    # ------------------------------------------------------------------ FFN ranks
    def _set_waiting(self, cls: _Class, delta: int) -> None:
        cls.queued_area += cls.waiting * (self.now - cls.last_change)
        cls.last_change, cls.waiting = self.now, cls.waiting + delta

    def _release(self, cls: _Class, items) -> None:
        """``items`` stop waiting now (taken by the host loop; lockstep: their batch formed)."""
        self._set_waiting(cls, -len(items))
        cls.arrival_sum -= sum(item[2] for item in items)
        cls.waits_total += sum(self.now - item[2] for item in items)
        cls.items_started += len(items)

    def _arrive(self, c: int, a: int, step: int, layer: int, tokens: int) -> None:
        cls = self.classes[c]
        self._set_waiting(cls, +1)
        cls.arrival_sum += self.now
        cls.queue.append((a, tokens, self.now, layer, step))
        self._kick_host(c)

    def _kick_host(self, c: int) -> None:
        """The FFN's host loop takes the next arrival when it is free (and, without
        ``ffn_host_overlap``, only once the device finished: one thread does both)."""
        cls = self.classes[c]
        if not cls.queue or cls.host_busy_until > self.now:
            return
        if not self.costs.ffn_host_overlap and (cls.computing or cls.gpu_queue):
            return
        item = self._pick(cls)
        cls.take_samples.append((self.now, cls.waiting - 1))
        if self.cfg.schedule != "lockstep":
            self._release(cls, (item,))
        cls.host_busy_until = self.now + self.costs.ffn_item_s * self._noise()
        self._push(cls.host_busy_until, _HOST_DONE, c, item)

    def _pick(self, cls: _Class) -> tuple:
        """The waiting arrival the host loop takes next (SimConfig.ffn_pick), off the queue.
        ``rotate``: the first waiting slot from ``scan_start`` on, as ``afd_wait_any`` scans
        (slot = Attention rank: ring depth 1, no micro-batch stages), then the scan starts
        after it; ``fifo``: the oldest arrival."""
        if self.cfg.ffn_pick == "fifo":
            return cls.queue.popleft()
        num_slots = max(self.dep.num_attn, self.dep.num_ffn)  # the window's regions (wire: max(A, F))
        idx = min(range(len(cls.queue)), key=lambda i: (cls.queue[i][0] - cls.scan_start) % num_slots)
        item = cls.queue[idx]
        del cls.queue[idx]
        cls.scan_start = (item[0] + 1) % num_slots
        return item

    def _host_done(self, c: int, item: tuple) -> None:
        cls = self.classes[c]
        if self.cfg.schedule == "lockstep":
            key = (item[4], item[3])
            group = cls.pending.setdefault(key, [])
            group.append(item)
            if len(group) == self.senders:
                self._release(cls, group)
                cls.gpu_queue.append(cls.pending.pop(key))
        else:
            cls.gpu_queue.append([item])
        if not cls.computing:
            self._serve(c)
        self._kick_host(c)

    def _serve(self, c: int) -> None:
        """The device runs the next compute batch (expert GEMMs), FIFO."""
        cls = self.classes[c]
        if not cls.gpu_queue:
            return
        batch = cls.gpu_queue.popleft()
        if self.cfg.schedule == "async_merge":  # every queued item of the head's layer joins it
            same = [b for b in cls.gpu_queue if b[0][3] == batch[0][3]]
            for b in same:
                cls.gpu_queue.remove(b)
                batch = batch + b
        tokens = sum(item[1] for item in batch)
        duration = cm.expert_gemm_time(self.costs, self.shape, tokens, self.dep.num_ffn, cls.share)
        if len(batch) > 1 and self.cfg.merge_copies:  # merge_items / split_outputs' device copies
            duration += cm.merge_copy_time(self.costs, self.shape, tokens, self.dep.num_ffn, cls.share)
        cls.computing, cls.compute_since = True, self.now
        self._run_phase(cls.gpu, ("f", c), cls.share * len(cls.ranks), "ffn", duration * self._noise(), self.now,
                        (_FFN_DONE, (c, tuple(batch))))

    def _ffn_done(self, c: int, batch: tuple) -> None:
        cls = self.classes[c]
        cls.computing = False
        cls.busy_spans.append((cls.compute_since, self.now))
        for item in batch:
            a, tokens = item[0], item[1]
            nbytes = cm.wire_rows(self.shape, tokens, self.dep.num_ffn, self.cfg.wire_mode) * self.shape.row_bytes
            self._push(self.now + cls.links[a].time_s(nbytes), _REPLY, a)
        self._serve(c)
        self._kick_host(c)

    # ------------------------------------------------------------------ run
    def run(self, max_events: int = 20_000_000) -> SimResult:
        """Simulate until every replica finished warm-up + measured steps; the result holds
        the measured window's statistics (module doc)."""
        self.replicas = [self._new_replica(a, load) for a, load in enumerate(self.loads)]
        self.unfinished = len(self.replicas)
        for st in self.replicas:
            self._start_step(st)
        self.handlers = {_ATTN_DONE: self._attn_done, _ARRIVE: self._arrive, _HOST_DONE: self._host_done,
                         _FFN_DONE: self._ffn_done, _REPLY: self._reply, _REQUEST: self._request,
                         _PHASE_BEGIN: self._phase_begin, _PHASE_END: self._phase_end}
        events = 0
        while self.heap and not self._finished():
            self.now, _, kind, args = heapq.heappop(self.heap)
            self.handlers[kind](*args)
            events += 1
            if events > max_events:
                raise ConfigError(f"simulation exceeded max_events={max_events}: reduce steps or layers")
        if not self._finished():
            raise ConfigError("simulation ran out of events before every replica finished its steps "
                              "(an open-loop arrival rate of 0 work?)")
        return self._result(events)

    def _result(self, events: int) -> SimResult:
        warm = self.cfg.warmup_steps
        start = max(st["steps"][warm - 1][1] if warm else 0.0 for st in self.replicas)
        end = max(st["steps"][-1][1] for st in self.replicas)
        for cls in self.classes:
            self._set_waiting(cls, 0)
            # Little's law counts every arrival: the ones still waiting add their age so far
            cls.waits_total += cls.waiting * self.now - cls.arrival_sum
            cls.items_started += cls.waiting
        replicas = tuple(ReplicaResult.from_steps(st["idx"], st["load"].kind, st["steps"][warm:])
                         for st in self.replicas)
        ffn = tuple(ffn_result(cls.ranks, cls.busy_spans, cls.take_samples, start, end, cls.queued_area,
                               cls.waits_total, cls.items_started, self.now,
                               inflight=(cls.compute_since, self.now) if cls.computing else None)
                    for cls in self.classes)
        return SimResult(self.cfg.schedule, self.cfg.wire_mode, replicas, ffn, start, end,
                         self.dep.num_gpus, events)


def simulate(shape: ModelShape, deployment: Deployment, loads: tuple, costs: cm.Costs,
             config: SimConfig = SimConfig()) -> SimResult:
    """Run one simulation (see :class:`Simulator`)."""
    return Simulator(shape, deployment, loads, costs, config).run()
