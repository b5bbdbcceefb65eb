"""A discrete-event simulator of AFD serving: A Attention replicas, F FFN ranks, per layer.

A replica's step: per layer, attention on its own process, then one item to every FFN rank
(dispatch kernel + link), then it waits for every rank's reply (link) and combines; the next
layer starts after the combine. An FFN rank serves compute batches FIFO, one at a time:

- ``async``: every item is its own batch, served in arrival order;
- ``async_merge`` (a what-if: FFNWorker does not do it): as async, but a compute batch takes
  every waiting item of the head item's layer with it (weights read once for all of them);
- ``lockstep``: the items of (step, layer) from every replica form one merged batch, which
  enters the FIFO once the last of them arrived (a barrier per layer; replicas run the same
  number of steps, and a replica with nothing to do still sends an empty item).

Under balanced routing every FFN rank with the same placement and the same link from every
replica sees the same arrivals, so one rank per such class is simulated (exact, not an
approximation of the model). The measured window starts when every replica finished its
warm-up steps and ends when the last one finished its ``steps`` measured steps.
"""
from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass

from afd_cupy.capacity import costs as cm
from afd_cupy.capacity.results import ReplicaResult, SimResult, ffn_result
from afd_cupy.capacity.spec import Deployment, ModelShape, ReplicaLoad, SimConfig
from afd_cupy.errors import ConfigError

_ATTN_DONE, _ARRIVE, _HOST_DONE, _FFN_DONE, _REPLY, _REQUEST = range(6)


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
    busy_until: float = -1.0
    busy_s: float = 0.0
    pending: dict = None
    queued_area: float = 0.0  # integral of items waiting dt
    last_change: float = 0.0
    waiting: int = 0
    waits_total: float = 0.0
    arrival_sum: float = 0.0  # sum of the arrival times of the items still waiting
    items_started: int = 0
    take_samples: list = None
    busy_spans: list = None


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
        self.senders = sum(load.ffn for load in loads)  # replicas whose layers go through the FFN
        if not self.senders:
            raise ConfigError("loads: at least one replica must send to the FFN (every ReplicaLoad has ffn=False)")
        self.classes = self._classes()
        self.heap, self.seq, self.now = [], 0, 0.0
        self.gpu_busy: dict = {}

    def _classes(self) -> list:
        groups: dict = {}
        for j, p in enumerate(self.dep.ffn):
            links = tuple(self.dep.link(a, j) for a in range(self.dep.num_attn))
            gpu = p.gpu if self.dep.hbm_contention > 0 else -1  # the GPU matters only for contention
            groups.setdefault((p.node, gpu, p.share, links), []).append(j)
        return [_Class(ranks, key[2], key[:2], key[3], deque(), deque(), pending={}, take_samples=[], busy_spans=[])
                for key, ranks in groups.items()]

    # ------------------------------------------------------------------ event plumbing
    def _push(self, time: float, kind: int, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, kind, args))

    def _contention(self, gpu: tuple, me) -> float:
        """The one-GPU HBM model: 1 + kappa x shares of the other busy processes on ``gpu``."""
        kappa = self.dep.hbm_contention
        if kappa <= 0:
            return 1.0
        busy = self.gpu_busy.get(gpu, {})
        return 1.0 + kappa * sum(s for (who, (s, until)) in busy.items() if who != me and until > self.now)

    def _mark_busy(self, gpu: tuple, who, share: float, until: float) -> None:
        if self.dep.hbm_contention > 0:
            self.gpu_busy.setdefault(gpu, {})[who] = (share, until)

    # ------------------------------------------------------------------ replicas
    def _new_replica(self, idx: int, load: ReplicaLoad) -> dict:
        state = {"idx": idx, "load": load, "step": 0, "layer": 0, "replies": 0, "step_start": 0.0,
                 "steps": [], "active": [], "backlog": 0, "idle": False, "tokens": 0}
        p = self.dep.attention[idx]
        state["gpu"], state["share"] = (p.node, p.gpu), p.share
        if load.kind == "decode" and load.arrival_rate is None:
            for i in range(load.batch_size):  # closed loop, progress staggered evenly
                done = (i * load.output_len) // load.batch_size
                state["active"].append([load.context_len + done, load.output_len - done])
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
        active = st["active"][:load.batch_size]
        return len(active), 0.0, float(sum(ctx for ctx, _ in active))

    def _start_step(self, st: dict) -> None:
        tokens, pairs, ctx = self._step_shape(st)
        if tokens == 0 and self.cfg.schedule == "async":
            st["idle"] = True  # waits for an arrival (open loop)
            return
        st["idle"] = False
        st["shape"] = (tokens, pairs, ctx)
        if st["load"].kind == "prefill" and st["load"].arrival_rate is not None and tokens:
            st["backlog"] -= 1
        st["step_start"], st["layer"] = self.now, 0
        self._start_layer(st)

    def _start_layer(self, st: dict) -> None:
        tokens, pairs, ctx = st["shape"]
        base = cm.attention_time(self.costs, tokens, pairs, ctx, st["share"]) if tokens else self.costs.attn_fixed_s
        # the host issues layer l of the step by (l + 1) x attn_host_s; the device starts it then
        start = max(self.now, st["step_start"] + (st["layer"] + 1) * self.costs.attn_host_s)
        duration = base * self._contention(st["gpu"], ("a", st["idx"]))
        self._mark_busy(st["gpu"], ("a", st["idx"]), st["share"], start + duration)
        self._push(start + duration, _ATTN_DONE, st["idx"])

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
            self.now = done  # the combine runs on the replica's own stream before the next layer
            self._start_layer(st)
            return
        self._finish_step(st, done)

    def _finish_step(self, st: dict, end: float) -> None:
        tokens = st["shape"][0]
        st["steps"].append((st["step_start"], end, tokens))
        st["step"] += 1
        if st["load"].kind == "decode":
            self._advance_decode(st)
        self.now = end
        if not self._finished():
            self._start_step(st)

    def _advance_decode(self, st: dict) -> None:
        load, kept = st["load"], []
        for i, (ctx, left) in enumerate(st["active"]):
            if i < load.batch_size:
                ctx, left = ctx + 1, left - 1
            if left > 0:
                kept.append([ctx, left])
            elif load.arrival_rate is None:
                kept.append([load.context_len, load.output_len])  # closed loop: replaced at once
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
        need = self.cfg.warmup_steps + self.cfg.steps
        return all(len(st["steps"]) >= need for st in self.replicas)

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
        if not self.costs.ffn_host_overlap and (cls.busy_until > self.now or cls.gpu_queue):
            return
        item = cls.queue.popleft()
        cls.take_samples.append((self.now, cls.waiting - 1))
        if self.cfg.schedule != "lockstep":
            self._release(cls, (item,))
        cls.host_busy_until = self.now + self.costs.ffn_item_s
        self._push(cls.host_busy_until, _HOST_DONE, c, item)

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
        if cls.busy_until <= self.now:
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
        duration *= self._contention(cls.gpu, ("f", c))
        cls.busy_until = self.now + duration
        cls.busy_spans.append((self.now, cls.busy_until))
        self._mark_busy(cls.gpu, ("f", c), cls.share * len(cls.ranks), cls.busy_until)
        self._push(cls.busy_until, _FFN_DONE, c, tuple(batch))

    def _ffn_done(self, c: int, batch: tuple) -> None:
        cls = self.classes[c]
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
        for st in self.replicas:
            self._start_step(st)
        handlers = {_ATTN_DONE: self._attn_done, _ARRIVE: self._arrive, _HOST_DONE: self._host_done,
                    _FFN_DONE: self._ffn_done,
                    _REPLY: self._reply, _REQUEST: self._request}
        events = 0
        while self.heap and not self._finished():
            self.now, _, kind, args = heapq.heappop(self.heap)
            handlers[kind](*args)
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
                               cls.waits_total, cls.items_started, self.now) for cls in self.classes)
        return SimResult(self.cfg.schedule, self.cfg.wire_mode, replicas, ffn, start, end,
                         self.dep.num_gpus, events)


def simulate(shape: ModelShape, deployment: Deployment, loads: tuple, costs: cm.Costs,
             config: SimConfig = SimConfig()) -> SimResult:
    """Run one simulation (see :class:`Simulator`)."""
    return Simulator(shape, deployment, loads, costs, config).run()
