"""The rendezvous store and the launch helper (CPU only)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from afd_cupy.errors import AfdError, ConfigError, PeerTimeoutError
from afd_cupy.runtime.kvstore import KVClient, KVServer
from afd_cupy.runtime.launch import LaunchError, ProcessContext, device_for_rank, launch
from afd_cupy.runtime.store import (NamespacedStore, agreed_barrier, bound_listener, create_store,
                                    free_port, store_barrier)

from helpers.paths import REPO_ROOT

ROOT = str(REPO_ROOT)

# ---------------------------------------------------------------------------------------------
# Child functions (top level: pickled by reference into spawned processes)
# ---------------------------------------------------------------------------------------------


def _report_identity(ctx: ProcessContext, base: int):
    return (ctx.rank, ctx.world_size, base + ctx.rank ** 2, ctx.device_id,
            os.environ.get("AFD_TEST_MARKER"))


def _raise_on_ranks(ctx: ProcessContext, failing_ranks: tuple):
    if ctx.rank in failing_ranks:
        raise ValueError(f"boom from rank {ctx.rank}")
    time.sleep(30)  # a healthy rank still running when the failure is noticed


def _exit_rank_one(ctx: ProcessContext):
    if ctx.rank == 1:
        os._exit(3)
    time.sleep(30)


def _helper_thread_sleeps():
    time.sleep(600)


def _main_thread_blocks_on_a_lock():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # blocked in C with the GIL released, like a CUDA synchronize


def _hang_rank_one(ctx: ProcessContext):
    if ctx.rank == 1:
        threading.Thread(target=_helper_thread_sleeps, daemon=True).start()
        _main_thread_blocks_on_a_lock()
    return ctx.rank


def _barrier_generations(ctx: ProcessContext, num_rounds: int):
    store = ctx.store()
    seen = []
    for round_idx in range(num_rounds):
        time.sleep(0.01 * ((ctx.rank + round_idx) % 3))  # ranks arrive in varying order
        store.add(f"arrivals/{round_idx}", 1)
        store_barrier(store, "reused", ctx.world_size, timeout_s=20.0)
        seen.append(store.add(f"arrivals/{round_idx}", 0))
    return seen


# ---------------------------------------------------------------------------------------------
# device_for_rank
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank, nprocs, num_gpus, expected", [
    (0, 2, 0, None), (1, 4, 0, None),           # no GPU
    (0, 2, 2, 0), (1, 2, 2, 1), (3, 4, 8, 3),   # one GPU per process
    (0, 2, 1, 0), (1, 2, 1, 0), (3, 4, 2, 0),   # processes share GPU 0
])
def test_device_for_rank(rank, nprocs, num_gpus, expected):
    assert device_for_rank(rank, nprocs, num_gpus) == expected


# ---------------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_launch_returns_results_by_rank(nprocs):
    results = launch(_report_identity, nprocs, args=(100,), timeout_s=30, num_gpus=0,
                     env={"AFD_TEST_MARKER": "set-in-child"})
    assert results == [(r, nprocs, 100 + r * r, None, "set-in-child") for r in range(nprocs)]


def _slow_exit(ctx: ProcessContext, marker_dir: str, exit_s: float):
    """Report at once, then take ``exit_s`` to exit (as a rank tearing CUDA down does)."""
    import atexit

    def finish():
        time.sleep(exit_s)
        with open(os.path.join(marker_dir, f"exited{ctx.rank}"), "w") as f:
            f.write("clean")

    atexit.register(finish)
    return ctx.rank


@pytest.mark.timeout(60)
def test_exit_grace_lets_ranks_that_reported_finish_their_exit(tmp_path):
    # by default the launch terminates every rank the moment all results are in, inside its
    # teardown (on the GPU machine each rank then leaves its /dev/shm/cuda.shm.* file);
    # with exit_grace_s it waits (bounded) for the ranks to exit on their own
    assert launch(_slow_exit, 2, args=(str(tmp_path), 0.5), timeout_s=30, num_gpus=0,
                  exit_grace_s=10.0) == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["exited0", "exited1"]
    clean = tmp_path / "default"
    clean.mkdir()
    assert launch(_slow_exit, 2, args=(str(clean), 0.5), timeout_s=30, num_gpus=0) == [0, 1]
    assert os.listdir(clean) == []  # terminated inside the 0.5 s exit


@pytest.mark.timeout(60)
def test_a_rank_that_never_exits_is_stopped_after_the_exit_grace(tmp_path):
    start = time.monotonic()
    assert launch(_slow_exit, 1, args=(str(tmp_path), 30.0), timeout_s=30, num_gpus=0,
                  exit_grace_s=1.0) == [0]
    assert time.monotonic() - start < 15.0  # grace + terminate, not the rank's 30 s
    assert os.listdir(tmp_path) == []  # it was stopped inside its exit
    with pytest.raises(ValueError, match="exit_grace_s must be a finite number of seconds >= 0, got -1"):
        launch(_slow_exit, 1, args=(str(tmp_path), 0.0), exit_grace_s=-1)
    with pytest.raises(ConfigError, match="exit_grace_s must be a finite number of seconds >= 0, got inf"):
        launch(_slow_exit, 1, args=(str(tmp_path), 0.0), exit_grace_s=float("inf"))


def test_launch_error_is_an_afd_error():
    assert issubclass(LaunchError, AfdError)


@pytest.mark.timeout(60)
def test_child_exception_carries_traceback():
    expected = r"(?s)rank 1 raised:\nTraceback.*ValueError: boom from rank 1"
    with pytest.raises(LaunchError, match=expected) as info:
        launch(_raise_on_ranks, 2, args=((1,),), timeout_s=30, num_gpus=0)
    assert "_raise_on_ranks" in str(info.value)
    assert set(info.value.failures) == {1}


@pytest.mark.timeout(60)
def test_every_failing_rank_is_reported():
    with pytest.raises(LaunchError) as info:
        launch(_raise_on_ranks, 3, args=((0, 2),), timeout_s=30, num_gpus=0)
    message = str(info.value)
    assert "boom from rank 0" in message and "boom from rank 2" in message
    assert set(info.value.failures) == {0, 2}


@pytest.mark.timeout(60)
def test_child_exit_code_is_reported():
    with pytest.raises(LaunchError, match=r"rank 1 died without reporting \(exit code 3\)"):
        launch(_exit_rank_one, 2, timeout_s=30, num_gpus=0)


@pytest.mark.timeout(60)
def test_hung_child_is_killed_at_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 did not finish within 4\.0 s") as info:
        launch(_hang_rank_one, 2, timeout_s=4.0, num_gpus=0)
    assert set(info.value.failures) == {1}
    assert time.monotonic() - start < 15
    # where it hung: every thread's Python stack (faulthandler on SIGUSR1), the blocked main
    # thread and the sleeping helper both named
    failure = info.value.failures[1]
    assert "the Python stacks of its threads then" in failure, failure
    assert "in _main_thread_blocks_on_a_lock" in failure and "in _helper_thread_sleeps" in failure, failure
    assert "in _hang_rank_one" in failure, failure


# ---------------------------------------------------------------------------------------------
# store
# ---------------------------------------------------------------------------------------------


def _store_pair(kind: str, world_size: int, timeout_s: float):
    """(server, connect): a fresh store of ``kind`` ("torch": a TCPStore master; "afd": a
    KVServer) and a function returning a new client of it."""
    if kind == "torch":
        port = free_port()
        master = create_store("127.0.0.1", port, world_size, is_master=True, timeout_s=timeout_s)
        return master, lambda: create_store("127.0.0.1", port, world_size, is_master=False,
                                            timeout_s=timeout_s)
    server = KVServer(bound_listener("127.0.0.1"))
    return server, lambda: KVClient(server.host, server.port, timeout_s)


@pytest.fixture(params=["torch", "afd"])
def master_store(request):
    server, connect = _store_pair(request.param, 1, 10.0)
    yield server if request.param == "torch" else connect()
    if request.param == "afd":
        server.close()


@pytest.mark.timeout(60)
def test_store_barrier_generations():
    num_rounds = 5
    results = launch(_barrier_generations, 3, args=(num_rounds,), timeout_s=30, num_gpus=0)
    # After the n-th barrier of a reused name, every rank has arrived at round n.
    assert results == [[3] * num_rounds] * 3


@pytest.mark.timeout(20)
def test_store_barrier_timeout_names_counts(master_store):
    store = NamespacedStore(master_store, "timeout-test")
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"1 of 3 ranks arrived"):
        store_barrier(store, "lonely", 3, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 5
    # The next barrier of that name is a new generation, also bounded.
    with pytest.raises(PeerTimeoutError, match=r"'lonely/1'"):
        store_barrier(store, "lonely", 3, timeout_s=0.1)


def _on_threads(delays, body, kind="torch"):
    """Ranks as threads of this process, each with its own client of a fresh store (``kind``,
    :func:`_store_pair`): once every client is connected, rank i sleeps ``delays[i]``, then
    returns ``body(i, store)``. Results by rank. (Connected first: on a busy machine a
    client's connect can take seconds, which would make the delays meaningless.)"""
    master, connect = _store_pair(kind, len(delays), 30.0)
    results = [None] * len(delays)
    connected = threading.Barrier(len(delays), timeout=30)

    def rank(i):
        store = connect()
        store.add("connected", 1)  # a round trip: the connection is up
        connected.wait()
        time.sleep(delays[i])
        results[i] = body(i, store)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(delays))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    if kind == "afd":
        master.close()
    del master
    assert all(r is not None for r in results), results
    return results


def _agreed_round(name: str, delays, timeouts, kind="torch"):
    """agreed_barrier with each rank's timeout after its delay: [(verdict, seconds in it)]."""
    def body(i, store):
        start = time.monotonic()
        return agreed_barrier(store, name, len(delays), timeouts[i]), time.monotonic() - start

    return _on_threads(delays, body, kind)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["torch", "afd"])
def test_agreed_barrier_gives_every_rank_the_same_verdict(kind):
    # all arrive in time: every rank may run the collective teardown
    assert [v for v, _ in _agreed_round("all", [0, 0.05, 0.1], [5, 5, 5], kind)] == [True] * 3
    # the soak's hang: rank 0 (a short, "unhealthy" wait) gives up before the others arrive.
    # A plain barrier let the late ranks see a full count and enter nvshmem_barrier_all
    # without it; here every rank abandons, the late ones at once (not after their 5 s)
    late = _agreed_round("late", [0, 0.8, 0.8], [0.3, 5, 5], kind)
    assert [v for v, _ in late] == [False] * 3, late
    assert late[0][1] < 1.0 and late[1][1] < 1.0 and late[2][1] < 1.0, late
    # near the deadline: whatever the verdict, it is the same on every rank
    rng = np.random.default_rng(7)
    verdicts = set()
    for trial in range(12):
        delays = list(rng.uniform(0, 0.15, 3))
        timeouts = list(rng.uniform(0.02, 0.2, 3))
        got = {v for v, _ in _agreed_round(f"race{trial}", delays, timeouts, kind)}
        assert len(got) == 1, (trial, delays, timeouts, got)
        verdicts |= got
    assert verdicts == {True, False}  # both outcomes were exercised


def _verdict_round(name: str, delays, timeouts, problems, kind="torch"):
    """NvshmemHeap._every_pe_says on threads standing in for PEs: each PE's list, or its
    PeerTimeoutError."""
    from types import SimpleNamespace

    from afd_cupy.heap.nvshmem import NvshmemHeap

    def body(i, store):
        heap = SimpleNamespace(_barrier_name=name, _store=store, rank=i, world_size=len(delays),
                               timeout_s=timeouts[i])
        try:
            return NvshmemHeap._every_pe_says(heap, "fits/window", problems[i])
        except PeerTimeoutError as err:
            return err

    return _on_threads(delays, body, kind)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["torch", "afd"])
def test_nvshmem_verdict_exchange_is_one_verdict_for_every_pe(kind):
    # in time: every PE gets every PE's non-empty problem, in PE order
    ok = _verdict_round("ok", [0, 0.05, 0.1], [5, 5, 5], ["", "PE 1 short", "PE 2 short"], kind)
    assert ok == [["PE 1 short", "PE 2 short"]] * 3, ok
    # PE 2 publishes after PE 0 gave up but while PE 1 still waits: before, PE 0 raised and
    # PE 1 went on into nvshmem_malloc without it; now every PE raises
    late = _verdict_round("late", [0, 0, 0.8], [0.3, 5, 5], ["", "", ""], kind)
    assert all(isinstance(r, PeerTimeoutError) for r in late), late


@pytest.mark.timeout(20)
def test_store_barrier_single_rank_passes(master_store):
    store_barrier(master_store, "solo", 1, timeout_s=1.0)
    store_barrier(master_store, "solo", 1, timeout_s=1.0)


@pytest.mark.timeout(20)
def test_namespaced_store_isolation(master_store):
    job_a = NamespacedStore(master_store, "job-a")
    job_b = NamespacedStore(master_store, "job-b")
    job_a.set("key", b"from-a")
    job_b.set("key", b"from-b")
    assert job_a.get("key") == b"from-a"
    assert job_b.get("key") == b"from-b"
    assert master_store.get("job-a/key") == b"from-a"
    assert job_a.add("counter", 2) == 2
    assert job_b.add("counter", 5) == 5
    assert job_a.add("counter", 0) == 2


def test_free_port_is_bindable():
    import socket

    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", port))


def _store_kind_and_torch(ctx: ProcessContext):
    import sys

    ctx.store().set(f"hello/{ctx.rank}", b"x")
    return ctx.store_kind, "torch" in sys.modules


def test_a_launch_run_alone_serves_its_store_without_torch():
    # the parent of a job run alone hosts a KVServer: it never imports torch for the store
    # (a TCPStore master cost the main job's parent a torch import, 4-5 s of CPU on the GPU
    # machine); the ranks reach it through ctx.store()
    here = Path(__file__).resolve().parent  # this file's folder, and tests/ (for helpers)
    code = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; from test_store_launch import "
            "_store_kind_and_torch as f; from afd_cupy.runtime.launch import launch; "
            "print(launch(f, 2, timeout_s=60.0), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[('afd',", "False),", "('afd',", "False)]", "False"], out.stdout


def test_launch_that_cannot_listen_for_its_store_starts_no_rank(monkeypatch):
    import multiprocessing

    from afd_cupy.runtime import process_context

    def broken(host):
        raise OSError(98, "Address already in use (simulated)")

    monkeypatch.setattr(process_context, "bound_listener", broken)
    with pytest.raises(LaunchError, match=r"could not listen for the job's store on 127\.0\.0\.1: "
                                          r"\[Errno 98\] Address already in use"):
        launch(_report_identity, 2, args=(0,), timeout_s=60.0)
    assert multiprocessing.active_children() == []


def test_process_context_refuses_an_unknown_store_kind():
    with pytest.raises(ValueError, match="store_kind must be 'torch' or 'afd', got 'redis'"):
        ProcessContext(0, 1, "job", "127.0.0.1", 1, None, store_kind="redis")


def test_detect_backend_override_and_cpu_fallback(monkeypatch):
    from afd_cupy.runtime import launch as launch_mod
    from afd_cupy.runtime import placement

    monkeypatch.setenv("AFD_BACKEND", "cuda")
    assert launch_mod.detect_backend() == "cuda"
    monkeypatch.setenv("AFD_BACKEND", "host")
    assert launch_mod.detect_backend() == "host"
    monkeypatch.setenv("AFD_BACKEND", "tpu")
    with pytest.raises(ValueError, match="AFD_BACKEND must be 'cuda' or 'host', got 'tpu'"):
        launch_mod.detect_backend()
    monkeypatch.delenv("AFD_BACKEND")
    monkeypatch.setattr(placement, "detect_num_gpus", lambda: 0)
    assert launch_mod.detect_backend() == "host"


def _thread_env(ctx):
    import torch

    from afd_cupy.runtime.launch import THREAD_POOL_VARS
    return {var: os.environ.get(var) for var in THREAD_POOL_VARS}, torch.get_num_threads()


def test_launched_processes_share_the_cores_unless_told_otherwise(monkeypatch):
    from afd_cupy.runtime.launch import THREAD_POOL_VARS, thread_limits

    for var in THREAD_POOL_VARS:
        monkeypatch.delenv(var, raising=False)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert thread_limits(2) == {var: share for var in THREAD_POOL_VARS}
    results = launch(_thread_env, 2, timeout_s=60, num_gpus=0, env={"NUMBA_NUM_THREADS": "1"})
    for env, torch_threads in results:
        assert env["OMP_NUM_THREADS"] == share and env["NUMBA_NUM_THREADS"] == "1"  # env= wins
        assert torch_threads == int(share)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's environment wins too
    assert "OMP_NUM_THREADS" not in thread_limits(2)


def _placed(ctx):
    return ctx.device_id, ctx.sm_percent, os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


def test_placement_puts_each_rank_on_its_gpu_with_its_sm_share():
    from afd_cupy.runtime.launch import Placement, parse_placement

    placement = parse_placement("0:50, 0:50, 1", 3)
    assert placement == [Placement(0, 50), Placement(0, 50), Placement(1, None)]
    assert str(placement[0]) == "GPU 0 at 50% of its SMs" and parse_placement("2", 2) == [Placement(2)] * 2
    results = launch(_placed, 3, timeout_s=60, num_gpus=0, placement=placement)
    assert results == [(0, 50, "50"), (0, 50, "50"), (1, None, None)]
    with pytest.raises(ValueError, match="placement '0,1' has 2 entries for 3 ranks"):
        parse_placement("0,1", 3)
    with pytest.raises(ValueError, match=r"placement entry 'x:5'"):
        parse_placement("x:5", 1)
    with pytest.raises(ValueError, match=r"sm_percent must be in \[1, 100\], got 0"):
        Placement(0, 0)


# ---------------------------------------------------------------------------------------------
# A job whose ranks several launchers start ("nodes" sharing one TCPStore on a real port)
# ---------------------------------------------------------------------------------------------
def _lonely_attention(ctx: ProcessContext):
    """The only rank that starts: its connector must give up within the start-up timeout."""
    from afd_cupy.config import ModelConfig, TopologyConfig
    from afd_cupy.connector import AFDConnector

    model = ModelConfig(hidden_size=32, num_experts=4, top_k=2, moe_intermediate_size=16,
                        num_shared_experts=0, dtype="float32", max_num_batched_tokens=8, num_layers=2)
    start = time.monotonic()
    try:
        AFDConnector(model, TopologyConfig(1, 2), role="attention", role_rank=0, store=ctx.store(),
                     job_id=ctx.job_id, backend="host", startup_timeout_s=3.0).close()
        return {"error": None}
    except PeerTimeoutError as err:
        return {"error": str(err), "elapsed": time.monotonic() - start}


def _run_nodes(nodes, port, job_id, args=(), fn=None, world_size=None, host_first=False, **kwargs):
    """Run each (first_rank, nprocs) node as its own launch, concurrently; results by node.
    ``host_first``: the first node hosts the store master (else one exists at ``port``)."""
    import threading

    from afd_cupy.testing.scenario import run_rank

    results, errors = {}, {}

    def node(first, count):
        try:
            results[first] = launch(fn or run_rank, count, args=args, world_size=world_size,
                                    first_rank=first, store_addr=("127.0.0.1", port),
                                    job_id=job_id, timeout_s=120,
                                    host_store=host_first and first == nodes[0][0], **kwargs)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors[first] = err

    threads = [threading.Thread(target=node, args=node_spec) for node_spec in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("num_attn,num_ffn,nodes,host_first", [
    (1, 1, ((0, 1), (1, 1)), False), (2, 2, ((0, 2), (2, 2)), False), (2, 2, ((0, 2), (2, 2)), True)],
    ids=["1A|1F", "2A|2F", "2A|2F-hosted"])
def test_two_launches_sharing_one_store_run_one_job(num_attn, num_ffn, nodes, host_first):
    """Node A runs the Attention ranks, node B the FFN ranks: two launches, one TCPStore master
    on a real port (started by neither, or hosted by node A, which then keeps it until node B's
    ranks are done), one job id; every output matches the reference."""
    import uuid

    from afd_cupy.config import ModelConfig
    from afd_cupy.testing.scenario import Scenario, tolerance

    model = ModelConfig(hidden_size=64, num_experts=8, top_k=2, moe_intermediate_size=32,
                        num_shared_experts=1, dtype="bfloat16", max_num_batched_tokens=32, num_layers=2)
    scenario = Scenario(model, num_attn, num_ffn, backend="host", num_tokens=20)
    port = free_port()
    master = None if host_first else create_store("127.0.0.1", port, num_attn + num_ffn,
                                                  is_master=True, timeout_s=60)
    job_id = uuid.uuid4().hex[:12]
    results = _run_nodes(nodes, port, job_id, args=(scenario,), world_size=num_attn + num_ffn,
                         host_first=host_first)
    del master
    attn = results[0]
    ffn = results[nodes[1][0]]
    assert [r["role"] for r in attn] == ["attention"] * num_attn
    assert [r["role"] for r in ffn] == ["ffn"] * num_ffn
    for report in attn:
        assert len(report["errors"]) == scenario.num_checks
        for err in report["errors"]:
            assert err["shape_ok"] and err["num_nan"] == 0 and err["rel_err"] <= tolerance("bfloat16"), err


def test_a_node_that_never_starts_is_named_within_the_startup_timeout():
    """Only node A starts: its rank's connector gives up at its own start-up timeout naming the
    missing peer, and the launch itself raises the rendezvous' PeerTimeoutError naming every
    missing world rank, at the launch's startup_timeout_s."""
    import threading
    import uuid

    port = free_port()
    master = create_store("127.0.0.1", port, 3, is_master=True, timeout_s=60)
    job_id = uuid.uuid4().hex[:12]
    start = time.monotonic()
    caught = {}

    def node_a():
        try:
            launch(_lonely_attention, 1, world_size=3, store_addr=f"127.0.0.1:{port}",
                   job_id=job_id, timeout_s=60, startup_timeout_s=5.0)
        except BaseException as err:  # noqa: BLE001 - checked below
            caught["err"] = err

    thread = threading.Thread(target=node_a)
    thread.start()
    thread.join()
    del master
    err = caught.get("err")
    assert isinstance(err, PeerTimeoutError), err
    assert "world ranks [1, 2] of 3 did not join within 5.0 s" in str(err), err
    assert err.missing_ranks == [1, 2] and err.peer == 1
    assert time.monotonic() - start < 30.0


def test_launch_refuses_a_partial_job_without_a_shared_store():
    with pytest.raises(ValueError, match="needs the shared store_addr"):
        launch(_report_identity, 1, args=(0,), world_size=2, first_rank=1)
    with pytest.raises(ValueError, match=r"ranks 1..2 do not fit a world of 2"):
        launch(_report_identity, 2, args=(0,), world_size=2, first_rank=1,
               store_addr=("127.0.0.1", 1), job_id="x")


def test_process_context_from_the_environment():
    env = {"AFD_STORE_ADDR": "node0.example:29511", "AFD_WORLD_SIZE": "4", "AFD_RANK": "3",
           "AFD_JOB_ID": "job7", "AFD_DEVICE": "1"}
    ctx = ProcessContext.from_env(env)
    assert (ctx.store_host, ctx.store_port, ctx.world_size, ctx.rank, ctx.job_id, ctx.device_id) == \
        ("node0.example", 29511, 4, 3, "job7", 1)
    assert ProcessContext.from_env({**env, "AFD_DEVICE": ""}).device_id is None
    with pytest.raises(ValueError, match="AFD_RANK, AFD_JOB_ID not set"):
        ProcessContext.from_env({"AFD_STORE_ADDR": "h:1", "AFD_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="malformed AFD_"):
        ProcessContext.from_env({**env, "AFD_STORE_ADDR": "node0:port"})
    with pytest.raises(ValueError, match="0 <= rank < world size"):
        ProcessContext.from_env({**env, "AFD_RANK": "4"})
    # the launchers' parser (env.parse_store_addr): IPv6 in brackets, ports in [1, 65535]
    ctx6 = ProcessContext.from_env({**env, "AFD_STORE_ADDR": "[fe80::1]:29511"})
    assert (ctx6.store_host, ctx6.store_port) == ("fe80::1", 29511)
    for bad in ("node0:0", ":29511", "node0:70000", "node0"):
        with pytest.raises(ValueError, match=rf"malformed AFD_\* variable: .*{re.escape(bad)}"):
            ProcessContext.from_env({**env, "AFD_STORE_ADDR": bad})
