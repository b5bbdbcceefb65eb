"""Start-up, shutdown and time bounds (issue #35 items 2-6 and 10, CPU / host backend): close
never raises a lost store, a missing rank is named on every rank, one bound for the heap's
set-up, every timeout validated at the call, two jobs with one job id on one host, ranks
that die with their killed launcher, duplicate role ranks named."""
from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.errors import ConfigError, PeerTimeoutError
from afd_cupy.heap.host import HostHeap
from afd_cupy.runtime.kvstore import KVClient, KVServer
from afd_cupy.runtime.launch import DiedAsExpected, ProcessContext, connect, launch
from afd_cupy.runtime.store import NamespacedStore, bound_listener, create_store, free_port

from helpers.paths import REPO_ROOT

REPO = str(REPO_ROOT)
MODEL = ModelConfig(hidden_size=32, num_experts=4, top_k=2, moe_intermediate_size=16,
                    dtype="bfloat16", max_num_batched_tokens=8)
BAD_TIMEOUTS = [math.nan, math.inf, -math.inf, 0, -1.0, True, "5"]


def _subprocess_env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **extra}


# --- item 5: every time bound is validated at the call -----------------------------------------
@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
def test_connect_and_launch_refuse_a_timeout_that_is_not_finite_and_positive(bad):
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"startup_timeout_s must be a finite number of seconds > 0"):
        connect(("127.0.0.1", free_port()), rank=0, world_size=2, job_id="j", startup_timeout_s=bad)
    with pytest.raises(ConfigError, match=r"store_timeout_s must be a finite number of seconds > 0"):
        connect(("127.0.0.1", free_port()), rank=0, world_size=2, job_id="j", store_timeout_s=bad)
    with pytest.raises(ConfigError, match=r"^timeout_s must be a finite number of seconds > 0"):
        launch(_sleep_forever, 1, timeout_s=bad)
    with pytest.raises(ConfigError, match=r"startup_timeout_s must be a finite number of seconds > 0"):
        launch(_sleep_forever, 1, timeout_s=30.0, startup_timeout_s=bad)
    ctx = ProcessContext(0, 2, "j", "127.0.0.1", free_port(), None)
    with pytest.raises(ConfigError, match=r"startup_timeout_s must be a finite number of seconds > 0"):
        ctx.join(startup_timeout_s=bad)
    with pytest.raises(ConfigError, match=r"store_timeout_s must be a finite number of seconds > 0"):
        ProcessContext(0, 2, "j", "127.0.0.1", 1, None, store_timeout_s=bad)
    with pytest.raises(ConfigError, match=r"KVClient timeout_s must be a finite number of seconds > 0"):
        KVClient("127.0.0.1", 1, bad)
    assert time.monotonic() - start < 5.0  # refused at the call, nothing waited


def _sleep_forever(ctx):
    time.sleep(3600)


def test_store_waits_refuse_an_unbounded_timeout():
    from afd_cupy.runtime.store import store_barrier, store_fetch

    server = KVServer(bound_listener("127.0.0.1"))
    try:
        store = NamespacedStore(KVClient(server.host, server.port, 5.0), "j")
        for bad in (math.nan, math.inf, -1.0):
            with pytest.raises(ConfigError, match="finite timeout"):
                store_fetch(store, "never", bad)
            with pytest.raises(ConfigError, match="finite timeout"):
                store_barrier(store, "b", 2, bad)
    finally:
        server.close()


# --- item 2: close() logs a lost store, never raises it -----------------------------------------
@pytest.mark.parametrize("kind", ["afd", "torch"])
def test_heap_close_with_the_store_host_gone_logs_and_does_not_raise(kind, caplog):
    if kind == "afd":
        master = KVServer(bound_listener("127.0.0.1"))
        client = KVClient(master.host, master.port, 2.0)
    else:
        port = free_port()
        master = create_store("127.0.0.1", port, 2, is_master=True, timeout_s=2.0)
        client = create_store("127.0.0.1", port, 2, is_master=False, timeout_s=2.0)
    job_id = uuid.uuid4().hex[:12]
    heap = HostHeap(0, 1, NamespacedStore(client, job_id), job_id, timeout_s=2.0)
    heap.alloc(4096, "window0")
    if kind == "afd":
        master.close()
    del master  # the store's host is gone (a TCPStore master stops serving when dropped)
    caplog.set_level(logging.WARNING, logger="afd_cupy")
    start = time.monotonic()
    heap.close()  # before: torch's DistNetworkError / StoreLostError from the closing barrier
    assert time.monotonic() - start < 10.0
    assert "the store is unusable" in caplog.text and not glob.glob(f"/dev/shm/afd_{job_id}_*")


# --- item 3: from_env().join() with a rank missing: every rank names it -------------------------
_JOIN_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch.distributed  # imported before the clock starts (the store is a TCPStore)
    from afd_cupy.runtime.launch import ProcessContext
    ctx = ProcessContext.from_env(store_timeout_s=10.0)
    start = time.monotonic()
    try:
        ctx.join(host_store=sys.argv[1] == "host", startup_timeout_s=float(sys.argv[2]))
        out = {"type": "joined"}
    except Exception as exc:
        out = {"type": type(exc).__name__, "message": str(exc),
               "missing": getattr(exc, "missing_ranks", None)}
    out["elapsed"] = time.monotonic() - start
    print(json.dumps(out))
""")


def test_join_with_a_rank_missing_names_it_on_every_rank():
    port, job_id, startup_s = free_port(), uuid.uuid4().hex[:12], 6.0
    procs = []
    for rank, role in ((0, "host"), (1, "join"), (2, "join")):
        env = _subprocess_env(AFD_STORE_ADDR=f"127.0.0.1:{port}", AFD_WORLD_SIZE="4",
                              AFD_RANK=str(rank), AFD_JOB_ID=job_id)
        procs.append(subprocess.Popen([sys.executable, "-c", _JOIN_SCRIPT, role, str(startup_s)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        if rank == 0:
            time.sleep(0.5)  # the joiners start after the store's host: their deadlines are later
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for rank, result in enumerate(results):
        assert result["type"] == "PeerTimeoutError", (rank, result)
        assert result["missing"] == [3] and "world ranks [3] of 4 did not join" in result["message"], results
        assert result["elapsed"] < startup_s + 2.5, (rank, result)


# --- item 4: a peer dying in the heap's set-up: one bound, a true number ------------------------
def _die_in_heap_setup(ctx, startup_s: float):
    from afd_cupy.connector import AFDConnector
    from afd_cupy.heap import host

    if ctx.rank == 1:  # published its segment, then dies before the "every rank mapped" barrier
        def die(*args, **kwargs):
            os._exit(3)

        host.store_barrier = die
    from afd_cupy.runtime.store import store_barrier

    store_barrier(ctx.store(), "both-imported", 2, 60.0)  # the handshake itself waits for no one
    start = time.monotonic()
    try:
        AFDConnector(MODEL, TopologyConfig(1, 1), role="attention" if ctx.rank == 0 else "ffn",
                     role_rank=0, store=ctx.store(), job_id=ctx.job_id, backend="host",
                     startup_timeout_s=startup_s, peer_timeout_s=5.0, cpu_threads=None)
    except PeerTimeoutError as exc:
        return time.monotonic() - start, str(exc)
    return time.monotonic() - start, "connected"


def test_a_peer_dying_in_heap_setup_fails_within_the_startup_bound():
    startup_s = 4.0
    elapsed, message = launch(_die_in_heap_setup, 2, args=(startup_s,), timeout_s=90.0,
                              expected_deaths=(1,))[0]
    # before: twice the bound (the failed set-up's close waited a second full bound); the
    # margin covers the short closing barrier and a loaded machine
    assert elapsed < startup_s + 2.0, (elapsed, message)
    assert "host heap of rank 0, alloc('window0')" in message, message
    # the heap gets what the handshake left of the one start-up bound, and says so truly
    bound = re.search(r"the alloc's bound is ([0-9.]+) s", message)
    assert bound and 0 < float(bound.group(1)) <= startup_s, message


# --- item 5: recv_ffn_work_item; local knobs need not match -------------------------------------
def _local_knobs_and_poll_timeouts(ctx):
    from afd_cupy.connector import AFDConnector

    is_ffn = ctx.rank == 1
    # the FFN rank's local knobs differ from the Attention rank's: no GeometryMismatchError
    config = ConnectorConfig(recv_poll_timeout_ms=7, fused_dispatch=False) if is_ffn else ConnectorConfig()
    conn = AFDConnector(MODEL, TopologyConfig(1, 1), config, role="ffn" if is_ffn else "attention",
                        role_rank=0, store=ctx.store(), job_id=ctx.job_id, backend="host",
                        startup_timeout_s=30.0, peer_timeout_s=5.0, cpu_threads=None)
    refused = []
    try:
        if is_ffn:
            for bad in (math.nan, math.inf, 0, -5):
                start = time.monotonic()
                try:
                    conn.recv_ffn_work_item(timeout_ms=bad)
                except ConfigError as exc:
                    refused.append((str(exc), time.monotonic() - start))
            from afd_cupy.errors import ConnectorShutdown

            try:
                while conn.recv_ffn_work_item(timeout_ms=50) is None:
                    pass
            except ConnectorShutdown:
                pass
    finally:
        conn.close()
    return refused


def test_local_knobs_may_differ_and_poll_timeouts_are_validated():
    refused = launch(_local_knobs_and_poll_timeouts, 2, timeout_s=120.0)[1]
    assert len(refused) == 4, refused
    for message, elapsed in refused:
        assert "timeout_ms must be a finite number of milliseconds > 0" in message
        assert elapsed < 1.0


# --- item 6: two jobs with one job id on one host -----------------------------------------------
def _solo_alloc(ctx, job_id: str):
    heap = HostHeap(0, 1, ctx.store(), job_id, timeout_s=10.0)
    try:
        heap.alloc(4096, "window0")
    finally:
        heap.close()
    return "ok"


def test_two_jobs_with_the_same_job_id_do_not_collide():
    """Job A's rank 0 holds its window segment while it waits for its peer; job B's rank 0
    (another process, its own store, the same job id "afd": AFDConnector's default) allocates
    the same window meanwhile. Before: HeapError "segment ... already exists"."""
    server = KVServer(bound_listener("127.0.0.1"))
    heap = HostHeap(0, 2, NamespacedStore(KVClient(server.host, server.port, 30.0), "a"), "afd",
                    timeout_s=30.0)
    waiting = threading.Thread(target=_expect_timeout, args=(heap,), daemon=True)
    try:
        waiting.start()
        time.sleep(0.3)  # job A's segment exists now
        assert launch(_solo_alloc, 1, args=("afd",), timeout_s=60.0) == ["ok"]
    finally:
        server.close()  # job A's wait ends (its store is gone)
        waiting.join(timeout=30)
        heap.close()


def _expect_timeout(heap):
    try:
        heap.alloc(4096, "window0")
    except Exception:  # noqa: BLE001 - job A never completes; only job B matters
        pass


# --- item 10: ranks die with their killed launcher ----------------------------------------------
_LAUNCHER_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from afd_cupy.heap.host import HostHeap
    from afd_cupy.runtime.launch import launch

    def hold_a_segment(ctx, out_dir):
        # a heap of 3 ranks with only 2 started: each rank holds its segment while it waits
        # on the store (the test's, which outlives the launcher), as a busy rank would run on
        heap = HostHeap(ctx.rank, 3, ctx.store(), ctx.job_id, timeout_s=600.0)
        with open(os.path.join(out_dir, f"rank{ctx.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        heap.alloc(4096, "window0")

    if __name__ == "__main__":
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        launch(hold_a_segment, 2, args=(sys.argv[2],), job_id=sys.argv[1], timeout_s=600.0,
               store_addr=sys.argv[3])
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")  # a zombie is dead
    except OSError:
        return True


def test_ranks_die_with_their_killed_launcher_and_leave_no_segments(tmp_path):
    job_id = uuid.uuid4().hex[:12]
    script = tmp_path / "killed_launcher.py"
    script.write_text(_LAUNCHER_SCRIPT)
    port = free_port()
    master = create_store("127.0.0.1", port, 3, is_master=True, timeout_s=60.0)  # outlives the launcher
    launcher = subprocess.Popen([sys.executable, str(script), job_id, str(tmp_path), f"127.0.0.1:{port}"],
                                env=_subprocess_env(), stderr=subprocess.PIPE, text=True)
    pid_files = [tmp_path / f"rank{rank}.pid" for rank in range(2)]
    pids = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (all(p.exists() and p.read_text() for p in pid_files)
                                                   and len(glob.glob(f"/dev/shm/afd_{job_id}_*")) == 2):
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in pid_files]
        assert len(glob.glob(f"/dev/shm/afd_{job_id}_*")) == 2  # both ranks hold their segment
        launcher.kill()  # kill -9: no finally, no cleanup of the launcher's own
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not all(_gone(pid) for pid in pids):
            time.sleep(0.05)
        assert all(_gone(pid) for pid in pids), "ranks outlived their launcher"
        assert glob.glob(f"/dev/shm/afd_{job_id}_*") == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, 9)
        for path in glob.glob(f"/dev/shm/afd_{job_id}_*"):
            os.unlink(path)
        del master


def test_the_orphan_watchdog_exits_a_rank_whose_parent_is_gone(tmp_path):
    """The portable guard alone (no death signal): a child whose parent pid is not its
    parent exits at once with ORPHAN_EXIT_CODE."""
    code = ("import os; from afd_cupy.runtime import orphan; orphan.DEATH_SIGNAL = None; "
            "orphan.die_with_parent(os.getppid() + 1000000); import time; time.sleep(30)")
    out = subprocess.run([sys.executable, "-c", code], env=_subprocess_env(), timeout=60,
                         capture_output=True, text=True)
    from afd_cupy.runtime.orphan import ORPHAN_EXIT_CODE

    assert out.returncode == ORPHAN_EXIT_CODE, out.stderr[-2000:]


# --- UX: a role rank claimed by two processes is named as such ----------------------------------
def _claim(ctx):
    from afd_cupy.connector import AFDConnector

    role, role_rank = ("ffn", 0) if ctx.rank == 2 else ("attention", 0)  # ranks 0 and 1 both claim it
    try:
        conn = AFDConnector(MODEL, TopologyConfig(1, 1), role=role, role_rank=role_rank,
                            store=ctx.store(), job_id=ctx.job_id, backend="host",
                            startup_timeout_s=3.0, peer_timeout_s=5.0, cpu_threads=None)
    except ConfigError as exc:
        return str(exc)
    if role == "attention":
        time.sleep(1.0)  # stay alive while the rival checks the claim
    conn.close()
    return "connected"


def test_a_role_rank_claimed_twice_is_named():
    results = launch(_claim, 3, timeout_s=120.0)
    assert results[2] == "connected"
    claims = sorted(results[:2])
    assert claims[1] == "connected", results
    assert "attention role rank 0 (world rank 0) is claimed by two processes" in claims[0], results


def test_launch_keeps_every_public_name_and_its_modules_stay_small():
    """Issue #32: runtime/launch.py split by concept; every name it had is still importable from it."""
    import afd_cupy.runtime.launch as launch_mod

    for name in ("DiedAsExpected", "IDLE_POOL_DEFAULTS", "LaunchError", "Placement", "ProcessContext",
                 "STORE_HOST", "THREAD_POOL_VARS", "connect", "detect_backend", "device_for_rank",
                 "launch", "parse_placement", "thread_limits", "visible_gpu_count"):
        assert hasattr(launch_mod, name), name
    assert DiedAsExpected(1, 3).exit_code == 3
    for module in ("launch", "children", "placement", "process_context", "orphan", "timeouts"):
        with open(os.path.join(REPO, "afd_cupy", "runtime", f"{module}.py")) as source:
            assert len(source.readlines()) < 400, module
