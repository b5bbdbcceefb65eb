"""The host backend's symmetric heap over POSIX shared memory (CPU, real processes)."""
from __future__ import annotations

import glob
import os
import signal
import uuid

import numpy as np
import pytest

from afd_cupy.errors import HeapError
from afd_cupy.heap.host import HostHeap, segment_path
from afd_cupy.runtime.launch import LaunchError, ProcessContext, launch
from afd_cupy.runtime.store import NamespacedStore, create_store, free_port

NUM_BUFFERS = 2


def _stamped_pattern(seed: int, src_rank: int, buf_idx: int, nbytes: int) -> np.ndarray:
    """[nbytes] uint8: int32 (src_rank, buf_idx) stamp, then seeded random bytes."""
    rng = np.random.default_rng([seed, src_rank, buf_idx])
    pattern = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    pattern[:8] = np.array([src_rank, buf_idx], dtype=np.int32).view(np.uint8)
    return pattern


def _job_segments(job_id: str) -> list[str]:
    return glob.glob(f"/dev/shm/afd_{job_id}_*")


# ---------------------------------------------------------------------------------------------
# Child functions
# ---------------------------------------------------------------------------------------------


def _write_every_peer_then_verify(ctx: ProcessContext, seed: int, region_nbytes: int):
    """Each rank writes its stamped pattern at region = own rank into every peer's copy."""
    world = ctx.world_size
    heap = HostHeap(ctx.rank, world, ctx.store(), ctx.job_id, timeout_s=20.0)
    buffers = [heap.alloc(region_nbytes * world, f"buf{i}") for i in range(NUM_BUFFERS)]
    assert all(not buf.local().any() for buf in buffers), "fresh buffers must be zero"
    heap.barrier()  # nobody writes before every rank has checked its fresh copy
    own = slice(ctx.rank * region_nbytes, (ctx.rank + 1) * region_nbytes)
    for buf_idx, buf in enumerate(buffers):
        pattern = _stamped_pattern(seed, ctx.rank, buf_idx, region_nbytes)
        for pe in range(world):
            buf.peer(pe)[own] = pattern
    heap.barrier()
    bad = []
    for buf_idx, buf in enumerate(buffers):
        for src in range(world):
            region = buf.local()[src * region_nbytes:(src + 1) * region_nbytes]
            if not np.array_equal(region, _stamped_pattern(seed, src, buf_idx, region_nbytes)):
                bad.append((buf_idx, src))
    pointers = [buf.ptr(pe) for buf in buffers for pe in range(world)]
    assert buffers[0].ptr(ctx.rank) == buffers[0].local().ctypes.data
    own_paths = [segment_path(ctx.job_id, f"buf{i}", ctx.rank) for i in range(NUM_BUFFERS)]
    heap.close()
    heap.close()  # idempotent
    return bad, len(set(pointers)) == len(pointers), [os.path.exists(p) for p in own_paths]


def _mismatched_sizes(ctx: ProcessContext):
    heap = HostHeap(ctx.rank, ctx.world_size, ctx.store(), ctx.job_id, timeout_s=20.0)
    with pytest.raises(HeapError) as info:
        heap.alloc(4096 * (ctx.rank + 1), "uneven")
    heap.close()
    return str(info.value)


def _alloc_then_die(ctx: ProcessContext, listing_path: str):
    heap = HostHeap(ctx.rank, ctx.world_size, ctx.store(), ctx.job_id, timeout_s=20.0)
    heap.alloc(8192, "doomed")
    heap.barrier()  # every rank returned from alloc (and so unlinked its segment's name)
    if ctx.rank == 1:
        with open(listing_path, "w") as listing:
            listing.write("\n".join(_job_segments(ctx.job_id)))
        os.kill(os.getpid(), signal.SIGKILL)
    heap.barrier()  # rank 0 waits here until the launcher terminates it


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_every_rank_writes_every_peer(nprocs):
    job_id = uuid.uuid4().hex[:12]
    results = launch(_write_every_peer_then_verify, nprocs, args=(1234 + nprocs, 1000),
                     timeout_s=40, num_gpus=0, job_id=job_id)
    for rank, (bad, pointers_distinct, own_left) in enumerate(results):
        assert bad == [], f"rank {rank} saw wrong regions (buffer, source): {bad}"
        assert pointers_distinct
        assert own_left == [False] * NUM_BUFFERS, f"rank {rank} did not unlink its segments"
    assert _job_segments(job_id) == []


@pytest.mark.timeout(60)
def test_peer_size_mismatch_names_peer_and_sizes():
    rank0_msg, rank1_msg = launch(_mismatched_sizes, 2, timeout_s=40, num_gpus=0)
    assert "peer 1" in rank0_msg and "8192 bytes" in rank0_msg and "allocated 4096" in rank0_msg
    assert "peer 0" in rank1_msg and "4096 bytes" in rank1_msg and "allocated 8192" in rank1_msg


@pytest.mark.timeout(60)
def test_killed_child_segments_are_cleaned(tmp_path):
    job_id = uuid.uuid4().hex[:12]
    listing_path = tmp_path / "segments.txt"
    with pytest.raises(LaunchError, match=r"rank 1 died without reporting \(exit code -9\)"):
        launch(_alloc_then_die, 2, args=(str(listing_path),), timeout_s=40, num_gpus=0,
               job_id=job_id)
    # Names are unlinked once every rank mapped every segment, so even before the kill (and
    # the launcher's own cleanup) nothing of the job is left in /dev/shm.
    assert listing_path.read_text().split() == [], "segments outlived the collective alloc"
    assert _job_segments(job_id) == []


@pytest.fixture
def solo_heap():
    master = create_store("127.0.0.1", free_port(), 1, is_master=True, timeout_s=10.0)
    job_id = uuid.uuid4().hex[:12]
    heap = HostHeap(0, 1, NamespacedStore(master, job_id), job_id, timeout_s=5.0)
    yield heap
    heap.close()
    assert _job_segments(job_id) == []


@pytest.mark.timeout(20)
@pytest.mark.parametrize("nbytes", [0, -8])
def test_alloc_non_positive_raises(solo_heap, nbytes):
    with pytest.raises(ValueError, match=f"nbytes must be positive, got {nbytes}"):
        solo_heap.alloc(nbytes, "empty")


@pytest.mark.timeout(20)
def test_solo_heap_views_and_reuse_errors(solo_heap):
    buf = solo_heap.alloc(256, "solo")
    view = buf.local()
    assert view.dtype == np.uint8 and view.shape == (256,) and not view.any()
    assert buf.peer(0) is view
    assert solo_heap.xp is np and solo_heap.backend == "host"
    with pytest.raises(ValueError, match="already allocated"):
        solo_heap.alloc(256, "solo")
    solo_heap.close()
    with pytest.raises(HeapError, match="closed"):
        solo_heap.alloc(256, "late")


def test_full_shm_is_a_heap_error_at_alloc_not_a_sigbus_later(solo_heap, monkeypatch):
    """A segment's pages are reserved at alloc: a full /dev/shm (Docker's default is 64 MB)
    raises HeapError naming the size and how to get room, and leaves no segment behind."""
    import errno

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(HeapError, match=r"cannot reserve 1048576 B \(1.0 MiB\) of shared memory") as info:
        solo_heap.alloc(1 << 20, "too_big")
    assert "window_size_hint" in str(info.value) and "--shm-size" in str(info.value)
    assert _job_segments(solo_heap.job_id) == []
