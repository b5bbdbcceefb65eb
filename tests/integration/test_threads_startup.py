"""Thread budget of launched and foreign processes (afd_cupy.runtime.env, launch, AFDConnector's
cpu_threads)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch  # imported at module level: a launched child has torch before fn runs

from afd_cupy.errors import ConfigError
from afd_cupy.routing import planner
from afd_cupy.runtime import connector_setup, env
from afd_cupy.runtime.handshake import PeerProcess
from afd_cupy.runtime.launch import IDLE_POOL_DEFAULTS, THREAD_POOL_VARS, launch, thread_limits

from helpers.paths import REPO_ROOT

ROOT = str(REPO_ROOT)


@pytest.fixture
def no_thread_vars(monkeypatch):
    for var in THREAD_POOL_VARS:  # setenv first: undo then restores an unset variable too
        monkeypatch.setenv(var, "1")
        monkeypatch.delenv(var)
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)


def _child_threads(ctx):
    return {var: os.environ.get(var) for var in THREAD_POOL_VARS}, torch.get_num_threads()


def test_thread_share_divides_the_affinity_cores():
    cores = len(os.sched_getaffinity(0))
    assert env.usable_cores() == cores
    assert env.thread_share(2) == max(1, cores // 2)
    assert env.thread_share(10 * cores) == 1
    with pytest.raises(ValueError, match="number of threads must be an int >= 1, got 0"):
        env.thread_env(0)


def test_launch_gives_children_a_share_unless_the_user_set_it(no_thread_vars):
    share = str(env.thread_share(2))
    no_thread_vars.setenv("OMP_NUM_THREADS", "3")  # the user's environment wins, per variable
    results = launch(_child_threads, 2, timeout_s=60, num_gpus=0, env={"NUMBA_NUM_THREADS": "1"})
    for child_env, torch_threads in results:
        assert child_env == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": share,
                             "OPENBLAS_NUM_THREADS": share, "NUMBA_NUM_THREADS": "1"}
        assert torch_threads == 3


def test_threads_per_process_wins_over_the_environment(no_thread_vars):
    no_thread_vars.setenv("OMP_NUM_THREADS", "3")
    assert thread_limits(2, threads_per_process=2) == {var: "2" for var in THREAD_POOL_VARS}
    results = launch(_child_threads, 1, timeout_s=60, num_gpus=0, threads_per_process=2)
    assert results == [({var: "2" for var in THREAD_POOL_VARS}, 2)]
    with pytest.raises(ValueError, match="got 0"):
        launch(_child_threads, 1, timeout_s=60, num_gpus=0, threads_per_process=0)


def test_limit_threads_keeps_user_settings_unless_told(no_thread_vars):
    no_thread_vars.setenv("OMP_NUM_THREADS", "2")
    applied = env.limit_threads(1)
    assert applied == {"MKL_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1, "NUMBA_NUM_THREADS": 1}
    assert os.environ["OMP_NUM_THREADS"] == "2"
    applied = env.limit_threads(1, keep_user_settings=False)
    assert applied["torch"] == 1 and torch.get_num_threads() == 1
    assert all(os.environ[var] == "1" for var in THREAD_POOL_VARS)


def test_connector_cpu_threads_auto_acts_only_when_nothing_was_set(no_thread_vars):
    here = PeerProcess(1, 1, socket.gethostname(), "")
    elsewhere = PeerProcess(2, 2, "another-host", "")
    torch.set_num_threads(2)
    no_thread_vars.setattr(env, "usable_cores", lambda: 2)
    no_thread_vars.setenv("OMP_NUM_THREADS", "2")
    connector_setup.apply_cpu_threads("auto", [here, elsewhere])  # the user decided: no change
    assert torch.get_num_threads() == 2
    no_thread_vars.delenv("OMP_NUM_THREADS")
    connector_setup.apply_cpu_threads(None, [here, elsewhere])  # opted out
    assert torch.get_num_threads() == 2 and "OMP_NUM_THREADS" not in os.environ
    connector_setup.apply_cpu_threads("auto", [here, elsewhere])  # 2 ranks here share 2 cores
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    for bad in (0, "many", True):
        with pytest.raises(ConfigError, match="cpu_threads must be 'auto', None or an int >= 1"):
            connector_setup.check_cpu_threads(bad)


def test_planner_warm_up_runs():
    planner.warm_up()
    assert planner._counting_plan.signatures and planner._combine_kernel.signatures


def _child_wait_policy(ctx):
    return os.environ.get("OMP_WAIT_POLICY"), os.environ.get("OPENBLAS_THREAD_TIMEOUT")


def test_children_get_sleeping_idle_pools_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    assert launch(_child_wait_policy, 1, timeout_s=60, num_gpus=0) == [("PASSIVE", "4")]
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's environment wins
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "28")
    assert launch(_child_wait_policy, 1, timeout_s=60, num_gpus=0) == [("ACTIVE", "28")]
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT")
    assert launch(_child_wait_policy, 1, timeout_s=60, num_gpus=0,
                  env={"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_THREAD_TIMEOUT": "10"}) == [("ACTIVE", "10")]


def test_idle_pool_env_fills_only_what_the_environment_leaves_unset():
    assert env.idle_pool_env({}) == env.IDLE_POOL_DEFAULTS
    assert env.idle_pool_env({"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_THREAD_TIMEOUT": ""}) == {
        "OPENBLAS_THREAD_TIMEOUT": "4"}  # empty counts as unset, as the launcher reads it


_NUMPY_IMPORT_CPU = ("import time; t = time.process_time(); import numpy; time.sleep(0.4); "
                     "print(time.process_time() - t)")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="OpenBLAS starts no worker on one core")
def test_openblas_workers_sleep_under_the_idle_defaults():
    # numpy's OpenBLAS starts a worker per core at import, and each spins ~0.1 s (2^28
    # cycles) before it sleeps; under IDLE_POOL_DEFAULTS they sleep at once. CPU seconds of
    # `import numpy` + 0.4 s asleep, three fresh interpreters each way, the least of each
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS",
                                                          "OMP_NUM_THREADS")}

    def cpu(apply: bool) -> float:
        runs = [subprocess.run([sys.executable, "-c", _NUMPY_IMPORT_CPU], capture_output=True,
                               text=True, check=True,
                               env={**env, **(IDLE_POOL_DEFAULTS if apply else {})})
                for _ in range(3)]
        return min(float(r.stdout) for r in runs)

    spinning, sleeping = cpu(False), cpu(True)
    extra_workers = len(os.sched_getaffinity(0)) - 1
    # default: every extra worker spins for a sizeable part of its 2^28 cycles
    assert spinning - sleeping > 0.02 * extra_workers, (spinning, sleeping)


def test_visible_gpu_count_reads_cuda_visible_devices_as_the_runtime_does():
    from afd_cupy.runtime.launch import visible_gpu_count

    assert visible_gpu_count(4, None) == 4
    assert visible_gpu_count(4, "") == 0
    assert visible_gpu_count(4, "1,3") == 2
    assert visible_gpu_count(4, "0,7,1") == 1  # the first invalid index ends the list
    assert visible_gpu_count(2, "1,1") == 1  # so does a repeat
    assert visible_gpu_count(2, "GPU-1a2b,GPU-3c4d,GPU-5e6f") == 2  # never more than exist
    assert visible_gpu_count(0, "0") == 0


def test_detecting_the_backend_does_not_import_torch():
    code = ("import sys; from afd_cupy.runtime.launch import detect_backend; b = detect_backend(); "
            "print(b, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout.split()
    assert out[1] == "False", out
