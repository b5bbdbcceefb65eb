"""Where an overlapping FFN worker's replies run (``FFNWorker(overlap=True)``; docs/design/overlap.md).

The default worker writes each reply on its own thread and, on cuda, on the stream that
computed it: the reply kernel of item i sits between item i's GEMMs and item i+1's. With
``overlap=True`` the replies go to a *reply lane* instead:

- :class:`StreamReplies` (cuda): a communication stream. ``submit`` records an event on the
  compute stream (torch's current stream) right after the item's expert work, makes the
  reply stream wait on it, and enqueues the replies there; the worker thread goes straight
  back to the next receive (the ``wait_any`` kernel runs on the path's own poll stream: the
  second communication stream) and enqueues item i+1's GEMMs while item i's reply kernel is
  still queued. Nothing synchronizes the host.
- :class:`ThreadReplies` (host backend, where every step runs on the calling thread): one
  reply thread, FIFO, fed by a bounded queue, so item i's reply writes run while the worker
  receives and computes item i+1 -- the same ordering freedom as the stream, with real
  concurrency, so the CPU tests exercise the worker's logic (hand-off, order, errors, drain).

Both keep the replies of one worker in submission order (one stream, one thread) and keep
the outputs alive until their reply has read them. Errors keep their type: a reply that
raises on the reply thread is re-raised on the worker thread at the next ``submit`` or
``drain``; every wait here is bounded.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence

from afd_cupy.errors import PeerTimeoutError

#: send(item, routed_out, shared_out): the connector's ``send_ffn_work_item_output``
SendFn = Callable[[object, object, object], None]
#: replies handed to the reply thread and not yet written, at most (host lane)
THREAD_QUEUE_DEPTH = 4


class StreamReplies:
    """cuda: replies on one communication stream, ordered after the compute stream by events.

    ``device``: the torch cuda device of the connector. Not thread-safe (one worker thread).
    """

    def __init__(self, send: SendFn, device, *, timeout_s: float):
        import torch

        self.torch = torch
        self.send = send
        self.device = device
        self.timeout_s = timeout_s
        self.stream = torch.cuda.Stream(device=device)

    def submit(self, items: Sequence, outputs: Sequence, after: Callable | None = None) -> None:
        """Enqueue the replies of ``items`` (``outputs[i]`` = (routed_out, shared_out)) on the
        reply stream after the work queued so far on the current (compute) stream. ``after(items)``
        runs with the reply stream current (a recorder's event then marks the replies' end)."""
        torch = self.torch
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # an event recorded now: the outputs are computed
        with torch.cuda.stream(self.stream):
            for item, (routed, shared) in zip(items, outputs):
                self.send(item, routed, shared)
            if after is not None:
                after(items)
        for routed, shared in outputs:
            # NOTE: allocated on the compute stream: the caching allocator must not hand their
            # memory to later compute work before the reply kernels read it (a no-op for memory
            # the allocator does not own, e.g. identity experts returning window views)
            for tensor in (routed, shared):
                if tensor is not None and tensor.is_cuda:
                    tensor.record_stream(self.stream)

    def drain(self) -> None:
        """Wait until every reply enqueued so far has run (reply kernels do not spin: bounded)."""
        self.stream.synchronize()

    def close(self) -> None:
        self.drain()


class ThreadReplies:
    """Host backend: one reply thread, FIFO, at most ``depth`` replies waiting.

    ``timeout_s`` bounds each wait of the worker thread on the reply thread (a full queue in
    ``submit``, ``drain``); a reply that takes longer raises :class:`PeerTimeoutError`. The
    thread starts at the first ``submit`` (again after ``close``) and is a daemon.
    """

    def __init__(self, send: SendFn, *, timeout_s: float, depth: int = THREAD_QUEUE_DEPTH):
        self.send = send
        self.timeout_s = timeout_s
        self.depth = depth
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._unfinished = 0  # replies submitted and not yet written (or failed)
        self._error: BaseException | None = None

    def submit(self, items: Sequence, outputs: Sequence, after: Callable | None = None) -> None:
        """Hand the replies of ``items`` to the reply thread; ``after(items)`` then runs here."""
        self._raise_error()
        if self._thread is None:
            self._start()
        with self._cond:
            self._unfinished += 1
        try:
            self._queue.put((tuple(items), tuple(outputs)), timeout=self.timeout_s)
        except queue.Full:
            with self._cond:
                self._unfinished -= 1
            raise PeerTimeoutError(f"FFN reply thread: {self.depth} replies still unwritten after "
                                   f"{self.timeout_s} s") from None
        if after is not None:
            after(items)

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._loop, args=(self._queue,),
                                        name="afd-ffn-replies", daemon=True)
        self._thread.start()

    def _loop(self, jobs: queue.Queue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            items, outputs = job
            try:
                for item, (routed, shared) in zip(items, outputs):
                    self.send(item, routed, shared)
            except BaseException as exc:  # re-raised on the worker thread; later replies still go
                with self._cond:
                    if self._error is None:
                        self._error = exc
            finally:
                with self._cond:
                    self._unfinished -= 1
                    self._cond.notify_all()

    def _raise_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def drain(self) -> None:
        """Wait (bounded) until every submitted reply was written; raise a reply's error."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._unfinished == 0, timeout=self.timeout_s)
        self._raise_error()
        if not done:
            raise PeerTimeoutError(f"FFN reply thread: {self._unfinished} replies unwritten after "
                                   f"{self.timeout_s} s")

    def close(self) -> None:
        """Drain, then stop the thread (a later ``submit`` starts a new one)."""
        try:
            self.drain()
        finally:
            if self._thread is not None:
                self._queue.put(None, timeout=self.timeout_s)
                self._thread.join(timeout=self.timeout_s)
                self._thread = self._queue = None


def reply_lane(connector, send: SendFn):
    """The lane for ``connector``'s device: :class:`StreamReplies` on cuda, else
    :class:`ThreadReplies`. Waits are bounded by the connector's ``peer_timeout_s``."""
    timeout_s = float(getattr(connector, "peer_timeout_s", 60.0))
    device = getattr(connector, "device", None)
    if getattr(device, "type", None) == "cuda":
        return StreamReplies(send, device, timeout_s=timeout_s)
    return ThreadReplies(send, timeout_s=timeout_s)
