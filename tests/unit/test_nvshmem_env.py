"""NVSHMEM's environment as one explicit dict (``afd_cupy.heap.nvshmem_env``): building,
validation, precedence, and the one place it is applied (the NvshmemHeap constructor, before
NVSHMEM initializes), on the CPU with a fake CuPy and a fake NVSHMEM library."""
from __future__ import annotations

import os
import sys
import types

import pytest

from afd_cupy.errors import ConfigError
from afd_cupy.heap import nvshmem
from afd_cupy.heap import nvshmem_env as env_module
from afd_cupy.heap.nvshmem_env import (HEAP_ALIGN_BYTES, HEAP_SLACK_BYTES, NVSHMEM_DEFAULTS,
                                       apply_nvshmem_env, check_nvshmem_env, nvshmem_env,
                                       nvshmem_heap_bytes)


@pytest.fixture(autouse=True)
def _no_nvshmem_environment(monkeypatch):
    """No NVSHMEM_* variable of the caller's shell, and no record of earlier writes."""
    for name in list(os.environ):
        if name.startswith("NVSHMEM_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(env_module, "_written", {})


def test_one_place_and_the_heap_module_re_exports_it():
    assert nvshmem.nvshmem_env is nvshmem_env and nvshmem.apply_nvshmem_env is apply_nvshmem_env
    assert nvshmem_env() == NVSHMEM_DEFAULTS == {"NVSHMEM_DISABLE_NCCL": "1", "NVSHMEM_DISABLE_NVLS": "1",
                                                  "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1"}


def test_multi_node_dict_from_typed_arguments():
    env = nvshmem_env(remote_transport="ibrc", symmetric_size=3 << 30, bootstrap_ifname="eth0",
                      bootstrap_family="AF_INET", hca_list=["mlx5_0:1", "mlx5_3:1"],
                      extra={"NVSHMEM_DEBUG": "WARN", "NVSHMEM_DISABLE_NCCL": False})
    assert env == {"NVSHMEM_DISABLE_NCCL": "0", "NVSHMEM_DISABLE_NVLS": "1",
                   "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1", "NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NVSHMEM_SYMMETRIC_SIZE": str(3 << 30),
                   "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth0",
                   "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY": "AF_INET",
                   "NVSHMEM_HCA_LIST": "mlx5_0:1,mlx5_3:1", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1",
                   "NVSHMEM_DEBUG": "WARN"}
    fabric = nvshmem_env(remote_transport="libfabric", libfabric_provider="efa")
    assert fabric["NVSHMEM_LIBFABRIC_PROVIDER"] == "efa"


@pytest.mark.parametrize("kwargs,message", [
    (dict(remote_transport="rdma"), r"remote_transport must be one of .* got 'rdma'"),
    (dict(symmetric_size=0), r"symmetric_size must be a positive int \(bytes\), got 0"),
    (dict(symmetric_size=1.5), r"symmetric_size must be a positive int \(bytes\), got 1.5"),
    (dict(symmetric_size=True), r"symmetric_size must be a positive int \(bytes\), got True"),
    (dict(bootstrap_ifname="eth0; rm"), r"bootstrap_ifname must be a network interface name .* 'eth0; rm'"),
    (dict(bootstrap_family="AF_UNIX"), r"bootstrap_family must be one of .* got 'AF_UNIX'"),
    (dict(hca_list="mlx5_0:x"), r"hca_list='mlx5_0:x': entries must look like .* bad: \['mlx5_0:x'\]"),
    (dict(hca_list="mlx5_0:1", remote_transport="none"), r"hca_list='mlx5_0:1' has no effect"),
    (dict(libfabric_provider="efa", remote_transport="ibrc"), r"libfabric_provider .* got 'efa' with remote_transport='ibrc'"),
    (dict(extra={"CUDA_VISIBLE_DEVICES": "0"}), r"extra may only set NVSHMEM_\* variables, got 'CUDA_VISIBLE_DEVICES'"),
    (dict(extra={"NVSHMEM_BOOTSTRAP": "MPI"}), r"extra\['NVSHMEM_BOOTSTRAP'\]='MPI': afd_cupy always bootstraps"),
    (dict(extra={"NVSHMEM_DEBUG": ""}), r"extra\['NVSHMEM_DEBUG'\]='': must be a non-empty str"),
    (dict(remote_transport="ucx", extra={"NVSHMEM_REMOTE_TRANSPORT": "ibrc"}), r"already set to 'ucx' by the typed arguments"),
])
def test_validation_names_argument_and_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        nvshmem_env(**kwargs)


def test_heap_bytes_from_the_window_hint():
    assert nvshmem_heap_bytes(1) == -(-(1 + HEAP_SLACK_BYTES) // HEAP_ALIGN_BYTES) * HEAP_ALIGN_BYTES
    two = nvshmem_heap_bytes(100 << 20, num_windows=2)
    assert two % HEAP_ALIGN_BYTES == 0 and 200 << 20 < two - HEAP_SLACK_BYTES + HEAP_ALIGN_BYTES
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match=rf"window_bytes={bad!r}: must be an int >= 1"):
            nvshmem_heap_bytes(bad)


def test_defaults_yield_to_the_environment():
    environ = {"NVSHMEM_DISABLE_NCCL": "0"}
    assert apply_nvshmem_env(None, environ) == {"NVSHMEM_DISABLE_NCCL": "0", "NVSHMEM_DISABLE_NVLS": "1",
                                                "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1"}
    environ = {"NVSHMEM_DISABLE_NCCL": "0"}  # also when the defaults come inside a dict
    apply_nvshmem_env(nvshmem_env(symmetric_size=1 << 30), environ)
    assert environ == {"NVSHMEM_DISABLE_NCCL": "0", "NVSHMEM_DISABLE_NVLS": "1",
                       "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1", "NVSHMEM_SYMMETRIC_SIZE": str(1 << 30)}


def test_explicit_values_must_mean_what_the_environment_says():
    environ = {"NVSHMEM_SYMMETRIC_SIZE": "2g", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "true", "PATH": "/bin"}
    applied = apply_nvshmem_env(nvshmem_env(symmetric_size=2 << 30, hca_list="mlx5_0:1"), environ)
    assert applied["NVSHMEM_SYMMETRIC_SIZE"] == "2g"  # same meaning, other spelling: agreement
    assert environ["NVSHMEM_HCA_LIST"] == "mlx5_0:1" and environ["PATH"] == "/bin"
    user = {"NVSHMEM_SYMMETRIC_SIZE": "1073741824", "NVSHMEM_REMOTE_TRANSPORT": "ucx"}
    with pytest.raises(ConfigError, match=r"NVSHMEM_REMOTE_TRANSPORT='ibrc' was requested, but the environment "
                                          r"already has NVSHMEM_REMOTE_TRANSPORT='ucx'; NVSHMEM_SYMMETRIC_SIZE="
                                          r"'2147483648' was requested, but the environment already has "
                                          r"NVSHMEM_SYMMETRIC_SIZE='1073741824'"):
        apply_nvshmem_env(nvshmem_env(symmetric_size=2 << 30, remote_transport="ibrc"), user)
    assert user == {"NVSHMEM_SYMMETRIC_SIZE": "1073741824", "NVSHMEM_REMOTE_TRANSPORT": "ucx"}


def test_own_earlier_writes_are_replaced_not_reported():
    environ = {"NVSHMEM_DEBUG": "INFO"}  # the user's
    apply_nvshmem_env(nvshmem_env(remote_transport="ibrc", symmetric_size=1 << 30), environ)
    applied = apply_nvshmem_env(nvshmem_env(remote_transport="none"), environ)  # a second heap
    assert applied["NVSHMEM_REMOTE_TRANSPORT"] == "none" and "NVSHMEM_SYMMETRIC_SIZE" not in environ
    apply_nvshmem_env(None, environ)
    assert environ == {"NVSHMEM_DEBUG": "INFO", **NVSHMEM_DEFAULTS}
    with pytest.raises(ConfigError, match="NVSHMEM_DEBUG='WARN' was requested, but the environment "
                                          "already has NVSHMEM_DEBUG='INFO'"):
        apply_nvshmem_env({"NVSHMEM_DEBUG": "WARN"}, environ)


def test_hand_made_dicts_are_checked():
    assert check_nvshmem_env({"NVSHMEM_SYMMETRIC_SIZE": 1 << 20, "NVSHMEM_DEBUG": " WARN "}) == \
        {"NVSHMEM_SYMMETRIC_SIZE": str(1 << 20), "NVSHMEM_DEBUG": "WARN"}
    with pytest.raises(ConfigError, match="nvshmem_env must be a mapping .* got str"):
        apply_nvshmem_env("NVSHMEM_DEBUG=WARN", {})
    with pytest.raises(ConfigError, match=r"nvshmem_env may only set NVSHMEM_\* variables, got 'OMP_NUM_THREADS'"):
        check_nvshmem_env({"OMP_NUM_THREADS": "1"})


def test_connector_refuses_a_bad_dict_before_any_collective_step():
    from afd_cupy.config import ModelConfig, TopologyConfig
    from afd_cupy.connector import AFDConnector

    class _NoStore:  # any store call would mean a collective step was reached
        def __getattr__(self, name):
            raise AssertionError(f"store.{name} called")

    model = ModelConfig(hidden_size=32, num_experts=4, top_k=2, moe_intermediate_size=16,
                        dtype="float32", max_num_batched_tokens=8, num_layers=1)
    with pytest.raises(ConfigError, match=r"nvshmem_env\['NVSHMEM_BOOTSTRAP'\]='MPI'"):
        AFDConnector(model, TopologyConfig(1, 1), role="attention", role_rank=0, store=_NoStore(),
                     backend="host", nvshmem_env={"NVSHMEM_BOOTSTRAP": "MPI"})


# --- the one place it is applied: NvshmemHeap, before nvshmemx_hostlib_init_attr ---------------
class _FakeLib:
    """Records the calls and the NVSHMEM_* environment seen at initialization."""

    def __init__(self):
        self.calls, self.seen_at_init = [], None

    def nvshmemx_init_status(self):
        return nvshmem.STATUS_NOT_INITIALIZED

    def nvshmemx_get_uniqueid(self, uid):
        self.calls.append("get_uniqueid")
        return 0

    def nvshmemx_set_attr_uniqueid_args(self, rank, nranks, uid, attr):
        return 0

    def nvshmemx_hostlib_init_attr(self, flags, attr):
        self.calls.append("init")
        self.seen_at_init = {k: v for k, v in os.environ.items() if k.startswith("NVSHMEM_")}
        return 0

    def nvshmem_my_pe(self):
        return 0

    def nvshmem_n_pes(self):
        return 1

    def nvshmem_barrier_all(self):
        pass

    def nvshmemx_hostlib_finalize(self):
        self.calls.append("finalize")


class _DictStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def get(self, key):
        return self.data[key]

    def add(self, key, amount):
        self.data[key] = int(self.data.get(key, 0)) + amount
        return self.data[key]


@pytest.fixture
def fake_nvshmem(monkeypatch):
    runtime = types.SimpleNamespace(free=lambda ptr: None, deviceSynchronize=lambda: None)
    device = types.SimpleNamespace(use=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda i: device, runtime=runtime)))
    lib = _FakeLib()
    monkeypatch.setattr(nvshmem, "load_library", lambda: lib)
    monkeypatch.setattr(nvshmem, "library_version", lambda lib: (nvshmem.SUPPORTED_MAJOR, 4, 5))
    monkeypatch.setattr(nvshmem, "_heap_alive", False)
    return lib


def test_heap_applies_the_dict_before_nvshmem_initializes(fake_nvshmem, monkeypatch):
    monkeypatch.setenv("NVSHMEM_DEBUG", "WARN")  # the user's own: kept
    wanted = nvshmem_env(remote_transport="none", symmetric_size=64 << 20)
    heap = nvshmem.NvshmemHeap(0, 1, _DictStore(), "job", 0, timeout_s=2.0, env=wanted)
    heap.close()
    assert fake_nvshmem.seen_at_init == {**wanted, "NVSHMEM_DEBUG": "WARN"}
    assert fake_nvshmem.calls == ["get_uniqueid", "init", "finalize"]
    nvshmem.NvshmemHeap(0, 1, _DictStore(), "job", 0, timeout_s=2.0).close()  # the next heap
    assert fake_nvshmem.seen_at_init == {"NVSHMEM_DEBUG": "WARN", **NVSHMEM_DEFAULTS}


def test_heap_refuses_a_conflict_before_any_nvshmem_call(fake_nvshmem, monkeypatch):
    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "ucx")
    with pytest.raises(ConfigError, match="NVSHMEM_REMOTE_TRANSPORT='ibrc' was requested"):
        nvshmem.NvshmemHeap(0, 1, _DictStore(), "job", 0, timeout_s=2.0,
                            env=nvshmem_env(remote_transport="ibrc"))
    assert fake_nvshmem.calls == [] and not nvshmem._heap_alive
