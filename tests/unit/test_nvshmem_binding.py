"""The ctypes NVSHMEM binding: layout checks on CPU, the real heap on a GPU (``cuda``)."""
from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from afd_cupy.errors import BackendUnavailableError
from afd_cupy.heap import nvshmem, nvshmem_lib
from afd_cupy.runtime.launch import ProcessContext, launch


def _stamped_pattern(seed: int, src_rank: int, buf_idx: int, nbytes: int) -> np.ndarray:
    """[nbytes] uint8: int32 (src_rank, buf_idx) stamp, then seeded random bytes."""
    rng = np.random.default_rng([seed, src_rank, buf_idx])
    pattern = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    pattern[:8] = np.array([src_rank, buf_idx], dtype=np.int32).view(np.uint8)
    return pattern


# ---------------------------------------------------------------------------------------------
# CPU: struct layout, version stamps, library lookup
# ---------------------------------------------------------------------------------------------


def test_struct_sizes_match_headers():
    assert ctypes.sizeof(nvshmem_lib.UniqueId) == 128
    assert ctypes.sizeof(nvshmem_lib.UniqueIdArgs) == 24
    assert ctypes.sizeof(nvshmem_lib.InitArgs) == 128
    assert ctypes.sizeof(nvshmem_lib.InitAttr) == 144


def test_struct_field_offsets_match_headers():
    assert nvshmem_lib.UniqueId.internal.offset == 4
    assert (nvshmem_lib.UniqueIdArgs.id.offset, nvshmem_lib.UniqueIdArgs.myrank.offset,
            nvshmem_lib.UniqueIdArgs.nranks.offset) == (8, 16, 20)
    assert (nvshmem_lib.InitArgs.uid_args.offset, nvshmem_lib.InitArgs.content.offset) == (8, 32)
    assert (nvshmem_lib.InitAttr.mpi_comm.offset, nvshmem_lib.InitAttr.args.offset) == (8, 16)


def test_version_stamps_are_v1_plus_sizeof():
    assert nvshmem_lib.UNIQUEID_VERSION == (1 << 16) + 128
    assert nvshmem_lib.UNIQUEID_ARGS_VERSION == (1 << 16) + 24
    assert nvshmem_lib.INIT_ARGS_VERSION == (1 << 16) + 128
    assert nvshmem_lib.INIT_ATTR_VERSION == (1 << 16) + 144
    uid = nvshmem_lib.new_unique_id()
    assert uid.version == nvshmem_lib.UNIQUEID_VERSION and bytes(uid.internal) == b""
    attr = nvshmem_lib.new_init_attr()
    assert attr.version == nvshmem_lib.INIT_ATTR_VERSION and attr.mpi_comm is None
    assert attr.args.version == nvshmem_lib.INIT_ARGS_VERSION
    assert attr.args.uid_args.version == nvshmem_lib.UNIQUEID_ARGS_VERSION
    assert (attr.args.uid_args.myrank, attr.args.uid_args.nranks) == (-1, -1)


def test_check_names_call_and_code():
    nvshmem_lib.check_rc(0, "nvshmem_anything")
    with pytest.raises(nvshmem_lib.NvshmemError, match=r"nvshmemx_hostlib_init_attr failed with "
                       r"code 7 \(NVSHMEMX_ERROR_INTERNAL\)") as info:
        nvshmem_lib.check_rc(7, "nvshmemx_hostlib_init_attr")
    assert (info.value.call, info.value.code) == ("nvshmemx_hostlib_init_attr", 7)


def test_import_loads_neither_cupy_nor_library():
    code = ("import sys, afd_cupy.heap.nvshmem, afd_cupy.heap.nvshmem_lib as m; "
            "assert 'cupy' not in sys.modules, 'cupy imported'; "
            "assert m._lib is None, 'library loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_override_path_is_reported(monkeypatch, tmp_path):
    missing = tmp_path / "libnvshmem_host.so.3"
    monkeypatch.setenv("AFD_NVSHMEM_LIB", str(missing))
    monkeypatch.setattr(nvshmem_lib, "_lib", None)
    with pytest.raises(BackendUnavailableError, match=r"AFD_NVSHMEM_LIB=.* does not exist.*"
                       r"pip install nvidia-nvshmem-cu13"):
        nvshmem_lib.load_library()


def test_library_not_found_anywhere_is_reported(monkeypatch):
    monkeypatch.delenv("AFD_NVSHMEM_LIB", raising=False)
    monkeypatch.setattr(nvshmem_lib, "_lib", None)
    monkeypatch.setattr(nvshmem_lib, "_package_library_paths", lambda: [])
    monkeypatch.setattr(nvshmem_lib, "LIB_SONAME", "libnvshmem_host_afd_absent.so.3")
    with pytest.raises(BackendUnavailableError,
                       match=r"pip install nvidia-nvshmem-cu13 .*or set AFD_NVSHMEM_LIB"):
        nvshmem_lib.load_library()


def test_wheel_directory_is_searched(monkeypatch, tmp_path):
    lib_dir = tmp_path / "nvidia" / "nvshmem" / "lib"
    lib_dir.mkdir(parents=True)
    (lib_dir / nvshmem_lib.LIB_SONAME).write_bytes(b"")
    monkeypatch.delenv("AFD_NVSHMEM_LIB", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert str(lib_dir / nvshmem_lib.LIB_SONAME) in nvshmem_lib._package_library_paths()


def test_every_table_symbol_resolves():
    path = nvshmem_lib.find_library()
    if path is None:
        pytest.skip("no nvidia-nvshmem wheel installed and AFD_NVSHMEM_LIB unset")
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        pytest.skip(f"{path} cannot be loaded here: {err}")
    missing = [symbol for symbol in nvshmem_lib.PROTOTYPES if not hasattr(lib, symbol)]
    assert missing == []
    major, minor, _ = nvshmem_lib.library_version(nvshmem_lib._bind(lib))
    assert (major, minor) >= (3, 0), f"unexpected NVSHMEM version {major}.{minor}"


def _installed_headers():
    """``include/`` of the NVSHMEM install the binding would load (the wheel ships it next to
    ``lib/``); skip when there is none."""
    import os

    path = nvshmem_lib.find_library()
    include = None if path is None else os.path.join(os.path.dirname(os.path.dirname(path)), "include")
    if include is None or not os.path.isdir(include):
        pytest.skip("no NVSHMEM headers next to the library (nvidia-nvshmem wheel or AFD_NVSHMEM_LIB)")
    return include


_C_TYPES = {"void *": ctypes.c_void_p, "const void *": ctypes.c_void_p, "uint64_t *": ctypes.c_void_p,
            "cudaStream_t": ctypes.c_void_p, "size_t": ctypes.c_size_t, "int": ctypes.c_int,
            "uint64_t": ctypes.c_uint64}
_PUT_SYMBOLS = ("nvshmemx_putmem_on_stream", "nvshmemx_putmem_signal_on_stream",
                "nvshmemx_quiet_on_stream", "nvshmemx_signal_op_on_stream")


def test_put_transport_prototypes_match_the_headers():
    """The put transport's ctypes entries against ``host/nvshmemx_api.h`` of the installed
    NVSHMEM (argument C types in order, void return), and the signal-op constants against
    ``device_host_transport/nvshmem_common_transport.h``."""
    import os
    import re

    include = _installed_headers()
    with open(os.path.join(include, "host", "nvshmemx_api.h")) as f:
        api = f.read()
    for symbol in _PUT_SYMBOLS:
        match = re.search(rf"\bvoid\s+{symbol}\s*\(([^)]*)\)", api)
        assert match, f"{symbol} not declared in host/nvshmemx_api.h"
        params = [" ".join(p.split()) for p in match.group(1).split(",")]
        expected = [_C_TYPES[re.sub(r"\s*\*", " *", re.sub(r"\s*\w+$", "", p))] for p in params]
        restype, argtypes = nvshmem_lib.PROTOTYPES[symbol]
        assert restype is None and argtypes == expected, (symbol, params, argtypes)
    with open(os.path.join(include, "device_host_transport", "nvshmem_common_transport.h")) as f:
        common = f.read()
    assert re.search(rf"NVSHMEM_SIGNAL_SET\s*=\s*{nvshmem_lib.NVSHMEM_SIGNAL_SET}\b", common)
    assert re.search(rf"NVSHMEM_SIGNAL_ADD\s*=\s*{nvshmem_lib.NVSHMEM_SIGNAL_ADD}\b", common)


# ---------------------------------------------------------------------------------------------
# GPU: several PEs (processes) on one or more GPUs
# ---------------------------------------------------------------------------------------------


def _nvshmem_write_every_peer(ctx: ProcessContext, seed: int, region_nbytes: int):
    import cupy

    from afd_cupy.heap.nvshmem import NvshmemHeap

    world = ctx.world_size
    heap = NvshmemHeap(ctx.rank, world, ctx.store(), ctx.job_id, ctx.device_id, timeout_s=60.0)
    identity = (heap._lib.nvshmem_my_pe(), heap._lib.nvshmem_n_pes())
    buffers = [heap.alloc(region_nbytes * world, f"buf{i}") for i in range(2)]
    was_zero = all(int(buf.local().sum()) == 0 for buf in buffers)
    heap.barrier()  # nobody writes before every rank has checked its fresh copy
    own = slice(ctx.rank * region_nbytes, (ctx.rank + 1) * region_nbytes)
    for buf_idx, buf in enumerate(buffers):
        pattern = cupy.asarray(_stamped_pattern(seed, ctx.rank, buf_idx, region_nbytes))
        for pe in range(world):
            buf.peer(pe)[own] = pattern
    heap.barrier()
    bad = []
    for buf_idx, buf in enumerate(buffers):
        local = cupy.asnumpy(buf.local())
        for src in range(world):
            region = local[src * region_nbytes:(src + 1) * region_nbytes]
            if not np.array_equal(region, _stamped_pattern(seed, src, buf_idx, region_nbytes)):
                bad.append((buf_idx, src))
    heap.close()
    heap.close()  # idempotent
    return identity, was_zero, bad, nvshmem._heap_alive


@pytest.mark.cuda
@pytest.mark.timeout(180)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_nvshmem_every_pe_writes_every_peer(nprocs):
    results = launch(_nvshmem_write_every_peer, nprocs, args=(77 + nprocs, 4096 + 256),
                     timeout_s=150, env={"NVSHMEM_SYMMETRIC_SIZE": str(256 << 20)})
    for rank, (identity, was_zero, bad, still_alive) in enumerate(results):
        assert identity == (rank, nprocs)
        assert was_zero, f"rank {rank}: fresh buffers not zero"
        assert bad == [], f"rank {rank} saw wrong regions (buffer, source): {bad}"
        assert not still_alive, f"rank {rank}: heap still marked alive after close()"
