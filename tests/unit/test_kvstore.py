"""The launcher's torch-free store (afd_cupy.runtime.kvstore): TCPStore's conventions, bounded waits,
typed errors (CPU only)."""
from __future__ import annotations

import os
import re
import socket
import threading
import time

import pytest

from afd_cupy.errors import ConfigError, PeerTimeoutError
from afd_cupy.runtime.kvstore import KVClient, KVServer, StoreLostError
from afd_cupy.runtime.store import Store, bound_listener


@pytest.fixture
def server():
    srv = KVServer(bound_listener("127.0.0.1"))
    yield srv
    srv.close()


def test_set_get_add_follow_tcpstore_conventions(server):
    store = KVClient(server.host, server.port, 5.0)
    assert isinstance(store, Store)
    store.set("k", b"\x00\xffbinary")
    assert store.get("k") == b"\x00\xffbinary"
    store.set("k", "text")  # str values are stored as UTF-8, like TCPStore's
    assert store.get("k") == b"text"
    assert store.add("n", 0) == 0  # an absent count is 0 and now exists
    assert store.get("n") == b"0"
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.get("n") == b"-2"  # a count reads as its decimal text
    big = os.urandom(3 << 20)
    store.set("big", big)
    assert store.get("big") == big
    with pytest.raises(ValueError, match="does not hold a count"):
        store.add("k", 1)
    with pytest.raises(ValueError, match="at most 65535"):
        store.set("x" * 70000, b"")


def test_get_waits_for_the_key_and_is_bounded(server):
    store = KVClient(server.host, server.port, 0.5)
    setter = KVClient(server.host, server.port, 5.0)
    timer = threading.Timer(0.2, setter.set, args=("late", b"v"))
    start = time.monotonic()
    timer.start()
    assert store.get("late") == b"v"
    assert 0.15 < time.monotonic() - start < 0.45
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"store key 'never' was not set within 0\.5 s"):
        store.get("never")
    assert 0.45 < time.monotonic() - start < 2.0
    assert store.add("after-timeout", 1) == 1  # the connection is still in step


def test_concurrent_clients_and_threads_count_exactly(server):
    clients = [KVClient(server.host, server.port, 10.0) for _ in range(4)]
    threads_per_client, adds = 3, 200

    def work(client):
        for _ in range(adds):
            client.add("total", 1)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients
               for _ in range(threads_per_client)]  # threads share a client, too
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert clients[0].add("total", 0) == len(clients) * threads_per_client * adds


def test_a_probe_that_only_connects_does_not_disturb_the_server(server):
    # rendezvous.wait_for_master probes with a bare connection and closes it
    for _ in range(3):
        socket.create_connection((server.host, server.port), timeout=2).close()
    store = KVClient(server.host, server.port, 5.0)
    assert store.add("alive", 1) == 1


def test_clients_that_connect_before_the_server_exists_are_served():
    listener = bound_listener("127.0.0.1")
    port, got = listener.getsockname()[1], {}

    def client():
        store = KVClient("127.0.0.1", port, 20.0)
        store.set("early", b"client")
        got["sum"] = store.add("n", 3)

    thread = threading.Thread(target=client)
    thread.start()
    time.sleep(0.5)  # connected, waiting in the socket's backlog
    assert "sum" not in got
    server = KVServer(listener)
    try:
        thread.join(timeout=20.0)
        assert not thread.is_alive()
        assert got["sum"] == 3
        assert KVClient("127.0.0.1", port, 5.0).get("early") == b"client"
    finally:
        server.close()


def test_a_closed_server_is_a_store_lost_error_never_a_hang():
    server = KVServer(bound_listener("127.0.0.1"))
    store = KVClient(server.host, server.port, 30.0)
    store.set("k", b"v")
    waiting = {}

    def wait_forever():
        try:
            store.get("never-set")
        except Exception as err:  # noqa: BLE001 - the test looks at what it was
            waiting["err"] = err

    thread = threading.Thread(target=wait_forever)
    thread.start()
    time.sleep(0.3)  # inside the server-side wait
    start = time.monotonic()
    server.close()
    thread.join(10)
    assert time.monotonic() - start < 5.0  # not the 30 s bound
    assert isinstance(waiting.get("err"), StoreLostError), waiting
    with pytest.raises(StoreLostError, match=r"the store at 127\.0\.0\.1:\d+ is gone \(key 'k'\)"):
        store.get("k")
    server.close()  # idempotent
    start = time.monotonic()
    with pytest.raises(StoreLostError, match=r"no store answered at 127\.0\.0\.1:\d+ within 0\.3 s"):
        KVClient(server.host, server.port, 0.3)
    assert time.monotonic() - start < 2.0
    assert isinstance(StoreLostError("x"), ConnectionError)


def test_client_timeout_must_be_positive(server):
    for bad in (0, -1.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ConfigError, match=rf"KVClient timeout_s must be a finite number of "
                                              rf"seconds > 0, got {re.escape(repr(bad))}"):
            KVClient(server.host, server.port, bad)


def test_close_wakes_the_accepting_thread_at_once(monkeypatch):
    # close() must not wait out the accept poll (it ends every launch): with a 30 s poll, a
    # close that relied on it would take 30 s
    from afd_cupy.runtime import kvstore

    monkeypatch.setattr(kvstore, "_ACCEPT_POLL_S", 30.0)
    server = KVServer(bound_listener("127.0.0.1"))
    KVClient(server.host, server.port, 5.0).add("x", 1)
    start = time.monotonic()
    server.close()
    assert time.monotonic() - start < 5.0
    assert not server._acceptor.is_alive()
