"""A small key-value store in pure Python: the rendezvous store of a job one launch runs alone.

:func:`afd_cupy.runtime.launch.launch` hosts a :class:`KVServer` in its own process (a thread that
accepts, one thread per connected client) and every rank talks to it through a
:class:`KVClient`. Neither needs torch: before, the parent imported torch (4-5 s of CPU on
the GPU machine) only to host a ``torch.distributed.TCPStore`` master. Jobs whose ranks
several launchers start (``store_addr``, ``ProcessContext.from_env``) still meet at a
TCPStore, which other tools (torchrun) also start.

Both sides implement the :class:`~afd_cupy.runtime.store.Store` protocol with TCPStore's value
conventions: ``add`` keeps the count as its decimal text (``get`` of a counted key returns
it) and creates the key at ``amount``; ``get`` waits until the key exists, bounded by the
client's ``timeout_s``, then raises :class:`~afd_cupy.errors.PeerTimeoutError` naming the
key. A client whose server is gone (the launcher died, or the job ended) gets
:class:`StoreLostError`.

Wire format (network byte order), one request at a time per connection:
request ``op: u8, key_len: u16, payload_len: u32, key, payload``; reply
``status: u8, payload_len: u32, payload``. ``op`` SET (payload: the value), GET (payload:
the wait bound in seconds, f64), ADD (payload: i64); ``status`` OK (payload: the value, or
the sum as i64), TIMEOUT, ERROR (payload: the message, UTF-8).
"""
from __future__ import annotations

import socket
import struct
import threading
import time

from afd_cupy.errors import AfdError, PeerTimeoutError
from afd_cupy.runtime.timeouts import check_timeout

_REQUEST = struct.Struct("!BHI")
_REPLY = struct.Struct("!BI")
_I64 = struct.Struct("!q")
_F64 = struct.Struct("!d")
_SET, _GET, _ADD = 1, 2, 3
_OK, _TIMEOUT, _ERROR = 0, 1, 2
_MAX_KEY = 0xFFFF
_ACCEPT_POLL_S = 0.2  # close() wakes accept() on Linux; elsewhere the thread sees it this soon
_CONNECT_RETRY_S = (0.01, 0.2)  # first and longest pause between connection attempts


class StoreLostError(AfdError, ConnectionError):
    """The store's server closed the connection or cannot be reached (its process is gone)."""


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock``; EOFError when the peer closes first."""
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class KVServer:
    """Serves the store on ``listener``, a bound and listening TCP socket
    (:func:`afd_cupy.runtime.store.bound_listener`), which it owns from here on. Clients that
    connected before the server existed are served from the socket's backlog. Serves until
    :meth:`close`; its threads are daemons, so it never keeps the process alive."""

    def __init__(self, listener: socket.socket):
        self.host, self.port = listener.getsockname()[:2]
        self._listener = listener
        listener.settimeout(_ACCEPT_POLL_S)
        self._data: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._clients: set[socket.socket] = set()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"afd-kvstore-{self.port}")
        self._acceptor.start()

    def __repr__(self) -> str:
        return f"KVServer({self.host}:{self.port}, {len(self._data)} keys)"

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # the listener was closed
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._changed:
                if self._closed:
                    conn.close()
                    return
                self._clients.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"afd-kvstore-{self.port}-client").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                op, key_len, payload_len = _REQUEST.unpack(_recv_exact(conn, _REQUEST.size))
                key = _recv_exact(conn, key_len)
                payload = _recv_exact(conn, payload_len)
                status, answer = self._handle(op, key, payload)
                if self._closed:
                    return  # no answer: the client's StoreLostError, not a timeout
                conn.sendall(_REPLY.pack(status, len(answer)) + answer)
        except (EOFError, OSError):
            pass  # the client left (a probe that only connects, too), or close()
        finally:
            with self._changed:
                self._clients.discard(conn)
            conn.close()

    def _handle(self, op: int, key: bytes, payload: bytes) -> tuple[int, bytes]:
        with self._changed:
            if op == _SET:
                self._data[key] = payload
                self._changed.notify_all()
                return _OK, b""
            if op == _ADD:
                (amount,) = _I64.unpack(payload)
                try:
                    total = int(self._data.get(key, b"0")) + amount
                except ValueError:
                    return _ERROR, f"key {key!r} does not hold a count".encode()
                self._data[key] = str(total).encode()
                self._changed.notify_all()
                return _OK, _I64.pack(total)
            if op == _GET:
                (wait_s,) = _F64.unpack(payload)
                if self._changed.wait_for(lambda: key in self._data or self._closed, wait_s) \
                        and key in self._data:
                    return _OK, self._data[key]
                return _TIMEOUT, b""
        return _ERROR, f"unknown store operation {op}".encode()

    def close(self) -> None:
        """Stop serving: the listener and every client connection close (their next call
        raises StoreLostError). Idempotent."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            clients = list(self._clients)
            self._changed.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (Linux)
        except OSError:
            pass
        self._listener.close()
        for conn in clients:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(timeout=2 * _ACCEPT_POLL_S)


class KVClient:
    """A connection to a :class:`KVServer` at ``host:port``; calls are bounded by
    ``timeout_s`` (the connection attempts too). Thread-safe (one call at a time).

    Raises ConfigError for a ``timeout_s`` that is not a finite number > 0, StoreLostError
    when no server answers within ``timeout_s``."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port = host, port
        self.timeout_s = check_timeout("KVClient timeout_s", timeout_s)
        self._lock = threading.Lock()
        self._sock = self._connect()

    def __repr__(self) -> str:
        return f"KVClient({self.host}:{self.port})"

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.timeout_s
        pause = _CONNECT_RETRY_S[0]
        while True:
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=max(0.05, deadline - time.monotonic()))
            except OSError as err:
                if time.monotonic() + pause >= deadline:
                    raise StoreLostError(f"no store answered at {self.host}:{self.port} within "
                                         f"{self.timeout_s:.1f} s: {err}") from err
                time.sleep(pause)
                pause = min(2 * pause, _CONNECT_RETRY_S[1])
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock

    def _call(self, op: int, key, payload: bytes, wait_s: float = 0.0) -> tuple[int, bytes]:
        name, key = key, _as_bytes(key)
        if len(key) > _MAX_KEY:
            raise ValueError(f"store key of {len(key)} bytes; at most {_MAX_KEY}")
        with self._lock:
            try:
                # the server answers a GET after at most wait_s; the margin covers the network
                self._sock.settimeout(self.timeout_s + wait_s)
                self._sock.sendall(_REQUEST.pack(op, len(key), len(payload)) + key + payload)
                status, size = _REPLY.unpack(_recv_exact(self._sock, _REPLY.size))
                answer = _recv_exact(self._sock, size)
            except (EOFError, OSError) as err:
                reason = "it closed the connection" if isinstance(err, EOFError) else repr(err)
                raise StoreLostError(f"the store at {self.host}:{self.port} is gone (key "
                                     f"{name!r}): {reason}") from err
        if status == _ERROR:
            raise ValueError(f"store at {self.host}:{self.port}: {answer.decode()}")
        return status, answer

    def set(self, key, value) -> None:
        """Store ``value`` (bytes or str) under ``key``."""
        self._call(_SET, key, _as_bytes(value))

    def get(self, key) -> bytes:
        """The value of ``key``; waits until it is set, bounded by ``timeout_s``
        (PeerTimeoutError naming the key)."""
        status, answer = self._call(_GET, key, _F64.pack(self.timeout_s), self.timeout_s)
        if status == _TIMEOUT:
            raise PeerTimeoutError(f"store key {key!r} was not set within {self.timeout_s:.1f} s "
                                   f"(store at {self.host}:{self.port})")
        return answer

    def add(self, key, amount: int) -> int:
        """Add ``amount`` to the count at ``key`` (0 when absent) and return the sum."""
        return _I64.unpack(self._call(_ADD, key, _I64.pack(int(amount)))[1])[0]

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            self._sock.close()

    def __del__(self):
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()
