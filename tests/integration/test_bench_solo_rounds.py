"""bench_common.solo_rounds, the solo and co-run solo rounds of bench_afd and bench_decode:
two replicas as threads over one in-memory store (each its own store object, as each rank has)."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from helpers.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import bench_common as bc  # noqa: E402


class _Shared:
    def __init__(self):
        self.lock, self.counters = threading.Lock(), {}


class _RankStore:
    """One rank's store object over the shared counters (the barrier keys its generations by object)."""

    def __init__(self, shared: _Shared):
        self.shared = shared

    def add(self, key: str, amount: int) -> int:
        with self.shared.lock:
            self.shared.counters[key] = self.shared.counters.get(key, 0) + amount
            return self.shared.counters[key]


def _run_two(background_for, timeout_s=10.0):
    shared, log, out, errors = _Shared(), [], [None, None], []

    def rank(a):
        def solo():
            log.append(("solo", a, time.monotonic()))
            time.sleep(0.05)
            return {"rank": a}

        steps = [0]

        def background_step():
            steps[0] += 1
            time.sleep(0.002)
        try:
            out[a] = bc.solo_rounds(_RankStore(shared), "t/solo0", 2, a, timeout_s, solo,
                                    background_step if background_for(a) else None)
            if steps[0]:
                log.append(("background", a, steps[0]))
        except Exception as exc:  # noqa: BLE001 (the test reads it)
            errors.append((a, exc))
    threads = [threading.Thread(target=rank, args=(a,)) for a in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, log, errors


def test_each_replica_measures_alone_then_beside_the_others_background():
    out, log, errors = _run_two(lambda a: True)
    assert not errors, errors
    assert [o["rank"] for o in out] == [0, 1] and [o["corun"]["rank"] for o in out] == [0, 1]
    solos = [e for e in log if e[0] == "solo"]
    assert [e[1] for e in solos] == [0, 1, 0, 1]  # in turn: the solo round, then the co-run round
    backgrounds = [e for e in log if e[0] == "background"]
    # each replica ran a background load during the other's co-run turn, and it did run
    assert sorted(e[1] for e in backgrounds) == [0, 1] and all(e[2] > 0 for e in backgrounds)


def test_without_a_background_there_is_only_the_solo_round():
    out, log, errors = _run_two(lambda a: False)
    assert not errors and all("corun" not in o for o in out)
    assert [e[1] for e in log if e[0] == "solo"] == [0, 1]


def test_a_background_whose_replica_never_finishes_raises_instead_of_hanging():
    shared = _Shared()
    store = _RankStore(shared)
    other = _RankStore(shared)
    # replica 1 alone: replica 0 "arrives" at every barrier but never ends its co-run turn
    for name in ("t/solo0/0", "t/solo0/1", "t/solo0/2", "t/solo0/corun/0"):
        other.add(name, 1)
    with pytest.raises(RuntimeError, match="corun_done/0 not set within 0.3 s"):
        bc.solo_rounds(store, "t/solo0", 2, 1, 0.3, lambda: {"rank": 1}, lambda: time.sleep(0.01))


def test_more_backgrounds_run_one_round_each_after_the_co_run():
    shared, out, loads = _Shared(), [None, None], {0: [], 1: []}

    def rank(a):
        def solo():
            time.sleep(0.03)
            return {"rank": a}

        def step(name):
            return lambda: (loads[a].append(name), time.sleep(0.002))
        out[a] = bc.solo_rounds(_RankStore(shared), "t/solo1", 2, a, 10.0, solo, step("corun"),
                                {"spin1": step("spin1"), "spin2": step("spin2")})
    threads = [threading.Thread(target=rank, args=(a,)) for a in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for a in range(2):
        assert {k: v["rank"] for k, v in out[a].items() if isinstance(v, dict)} == {"corun": a, "spin1": a, "spin2": a}
        names = loads[a]  # each load ran, in the rounds' order, only during the other's turns
        assert names and names == sorted(names, key=["corun", "spin1", "spin2"].index) and set(names) == {
            "corun", "spin1", "spin2"}
