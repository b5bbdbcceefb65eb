"""Jobs whose ranks several launchers start: the launch rendezvous (``afd_cupy.runtime.rendezvous``),
``connect`` / ``ProcessContext.join`` for a rank a foreign launcher started, per-node
shared-memory cleanup (CPU only; the two-launch end-to-end runs are in test_store_launch.py)."""
from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from afd_cupy.config import TopologyConfig
from afd_cupy.errors import ConfigError, PeerTimeoutError
from afd_cupy.heap.host import cleanup_job_segments, segment_path
from afd_cupy.runtime import env, rendezvous
from afd_cupy.runtime.launch import ProcessContext, connect, launch
from afd_cupy.runtime.store import NamespacedStore, create_store, free_port
from afd_cupy.runtime.topology import Role



def _world_rank(ctx: ProcessContext):
    return ctx.rank, ctx.world_size


@pytest.fixture
def job_store():
    master = create_store("127.0.0.1", free_port(), 4, is_master=True, timeout_s=10.0)
    return NamespacedStore(master, uuid.uuid4().hex[:12])


def test_parse_store_addr():
    assert env.parse_store_addr("node0:29500") == ("node0", 29500)
    assert env.parse_store_addr("[fe80::1]:7") == ("fe80::1", 7)
    assert env.parse_store_addr(("h", "12")) == ("h", 12)
    for bad, message in (("node0", "must be 'host:port'"), ("h:x", "port 'x' is not an integer"),
                         (":5", "needs a host and a port"), ("h:70000", "needs a host and a port"),
                         ("fe80::1", "IPv6 host in brackets"), ("[::1:29500", "IPv6 host in brackets"),
                         (("h", True), "port True is not an integer"),
                         (("h", 29500.7), "port 29500.7 is not an integer")):
        with pytest.raises(ConfigError, match=message):
            env.parse_store_addr(bad)


def test_rank_started_twice_is_refused(job_store):
    rendezvous.join(job_store, [0, 1], 4, "j")
    with pytest.raises(ConfigError, match="job j: world rank 1 was started twice"):
        rendezvous.join(job_store, [1, 2], 4, "j")


def test_launchers_with_different_world_sizes_are_refused(job_store):
    rendezvous.join(job_store, [0, 1], 4, "j")
    rendezvous.join(job_store, [2, 3], 5, "j")
    joining = rendezvous.Rendezvous(job_store, 4, "j", 1.0, [0, 1], "here")
    with pytest.raises(ConfigError, match=r"world rank 2 was started .* with world_size=5, ranks "
                                          r"\[0, 1\] here with world_size=4"):
        joining.wait()


def test_rendezvous_names_every_missing_rank(job_store):
    rendezvous.join(job_store, [0, 2], 4, "j")
    joining = rendezvous.Rendezvous(job_store, 4, "j", 0.3, [0, 2], "by test")
    with pytest.raises(PeerTimeoutError, match=r"world ranks \[1, 3\] of 4 did not join within 0.3 s") as info:
        joining.wait()
    assert info.value.missing_ranks == [1, 3] and info.value.peer == 1
    # the job was given up for everyone: a launcher still waiting raises the same at once
    rendezvous.join(job_store, [1, 3], 4, "j")
    late = rendezvous.Rendezvous(job_store, 4, "j", 30.0, [1, 3], "late")
    with pytest.raises(PeerTimeoutError, match=r"world ranks \[1, 3\] of 4 did not join: the launcher "
                                               r"of ranks \[0, 2\] gave the job up after 0.3 s"):
        late.wait()


def test_a_launch_whose_store_master_never_answers_names_the_other_ranks():
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"no store master answered at 127.0.0.1:\d+ within 1.0 s; "
                                               r"world ranks \[0, 1\] of 3 are not started here") as info:
        launch(_world_rank, 1, world_size=3, first_rank=2, store_addr=("127.0.0.1", free_port()),
               job_id=uuid.uuid4().hex[:12], startup_timeout_s=1.0, timeout_s=30)
    assert info.value.missing_ranks == [0, 1] and time.monotonic() - start < 10.0


def test_launch_argument_errors():
    with pytest.raises(ValueError, match="host_store=True needs the store_addr"):
        launch(_world_rank, 1, host_store=True)
    with pytest.raises(ConfigError, match="job_id must be a non-empty string"):
        launch(_world_rank, 1, world_size=2, store_addr="h:1", job_id="a b")
    with pytest.raises(ConfigError, match="world_size must be an int >= 1, got 1.5"):
        connect("h:1", rank=0, world_size=1.5, job_id="j")


def test_a_foreign_rank_joins_a_launch_that_hosts_the_store():
    """Node A (a launch) hosts the master and runs world rank 0; world rank 1 is this test
    process, started by "another launcher": it connects, learns its role, and closes last; the
    hosting launch returns only once rank 1 is done."""
    port, job_id = free_port(), uuid.uuid4().hex[:12]
    out = {}

    def node_a():
        out["a"] = launch(_world_rank, 1, world_size=2, store_addr=("127.0.0.1", port),
                          host_store=True, job_id=job_id, timeout_s=60)
        out["a_done_at"] = time.monotonic()

    thread = threading.Thread(target=node_a)
    thread.start()
    ctx = connect(f"127.0.0.1:{port}", rank=1, world_size=2, job_id=job_id, startup_timeout_s=30)
    assert ctx.role(TopologyConfig(1, 1)) == (Role.FFN, 0)
    time.sleep(0.5)
    assert thread.is_alive(), "the hosting launch dropped the store before rank 1 was done"
    closed_at = time.monotonic()
    ctx.close()
    thread.join(30)
    assert out["a"] == [(0, 2)] and out["a_done_at"] >= closed_at


def test_process_context_role():
    ctx = ProcessContext(3, 5, "j", "h", 1, None)
    assert ctx.role(TopologyConfig(2, 3)) == (Role.FFN, 1)
    assert ProcessContext(1, 5, "j", "h", 1, None).role(TopologyConfig(2, 3)) == (Role.ATTENTION, 1)
    with pytest.raises(ConfigError, match="topology of 2 Attention \\+ 2 FFN ranks does not match job j's world_size=5"):
        ctx.role(TopologyConfig(2, 2))


def test_a_node_cleans_only_its_own_ranks_segments():
    job_id = uuid.uuid4().hex[:12]
    paths = [segment_path(job_id, "window0", rank) for rank in (0, 1, 11)]
    for path in paths:
        open(path, "wb").close()
    try:
        assert cleanup_job_segments(job_id, ranks=[1]) == [paths[1]]
        assert os.path.exists(paths[0]) and os.path.exists(paths[2])
        assert sorted(cleanup_job_segments(job_id)) == sorted([paths[0], paths[2]])
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
