"""The kernels' status block and its host side: pinned words, the device block, the channel.

Status block (``int64[STATUS_WORDS]``, any device-visible memory; words in :mod:`afd_cupy.wire`):
the first error of a kernel is latched with ``atomicCAS`` on word ``ST_CODE``. The cuda backend
keeps it in device memory and mirrors it into pinned host memory at its synchronization points
(:class:`StatusBlock`); :class:`StatusChannel` owns that sequence (mirror -> sync -> raise ->
clear) and turns a latched status into the exception the host backend raises for the same
fault (``wire.StatusRecord.error``). The kernels work with any status memory (the kernel tests
use a :class:`PinnedInt64`).
"""
from __future__ import annotations

import numpy as np

from afd_cupy import wire


class PinnedInt64:
    """Zeroed int64 words in pinned host memory: ``array`` (numpy view) and ``ptr`` (address).

    With unified addressing the host address is valid on the device as is, so ``ptr`` is what
    the kernels take as a status block, doorbell or header source. Keep the object alive as
    long as any kernel may touch the memory.
    """

    def __init__(self, num_words: int):
        import cupy

        if num_words <= 0:
            raise ValueError(f"num_words must be positive, got {num_words}")
        self._mem = cupy.cuda.alloc_pinned_memory(num_words * 8)
        self.array = np.frombuffer(self._mem, dtype=np.int64, count=num_words)
        self.array[:] = 0
        self.ptr = int(self._mem.ptr)

    @property
    def int32(self) -> np.ndarray:
        """int32 view of the same memory (``2 * num_words`` words)."""
        return self.array.view(np.int32)


class StatusBlock:
    """The kernels' status block in device memory plus a pinned host mirror of it.

    ``ptr``: device int64 [STATUS_WORDS], what the kernels take as ``status``; ``host``: numpy
    int64 [STATUS_WORDS] view of the pinned mirror, as fresh as the last completed
    :meth:`enqueue_mirror`.

    NOTE: the status lives on the device because the combine's blocks read it (their re-check)
    and the plan reads it once per dispatch: in pinned host memory each of those reads is a
    PCIe round trip. The host only reads it after a stream synchronization, so one D2H copy
    enqueued right before that synchronization is enough. Buffers the host reads *without*
    synchronizing (the wait_any doorbell) or writes for a kernel (the reply header staging)
    stay in pinned memory.
    """

    NBYTES = wire.STATUS_WORDS * 8

    def __init__(self, device_ptr: int, host: np.ndarray, runtime, owners=()):
        if host.dtype != np.int64 or host.size < wire.STATUS_WORDS or not host.flags.c_contiguous:
            raise ValueError(f"host must be a contiguous int64 array of >= {wire.STATUS_WORDS} words")
        self.ptr = int(device_ptr)
        self.host = host
        self._runtime = runtime  # cupy.cuda.runtime (or a test fake with the same calls)
        self._owners = owners  # keep the device array and the pinned memory alive

    @classmethod
    def allocate(cls) -> "StatusBlock":
        """A zeroed device status block and its zeroed pinned mirror (synchronous)."""
        import cupy

        device = cupy.zeros(wire.STATUS_WORDS, cupy.int64)
        pinned = PinnedInt64(wire.STATUS_WORDS)
        cupy.cuda.Device().synchronize()  # the zero fill precedes any kernel on any stream
        return cls(device.data.ptr, pinned.array, cupy.cuda.runtime, owners=(device, pinned))

    def enqueue_mirror(self, stream_ptr: int) -> None:
        """Enqueue the device -> pinned copy on ``stream_ptr``; read :attr:`host` after a sync."""
        rt = self._runtime
        rt.memcpyAsync(self.host.ctypes.data, self.ptr, self.NBYTES, rt.memcpyDeviceToHost,
                       stream_ptr)

    def read(self) -> wire.StatusRecord:
        """The host mirror, decoded (no CUDA call)."""
        return wire.StatusRecord.decode(self.host)

    def clear(self, stream_ptr: int) -> None:
        """Zero the mirror now and the device words in ``stream_ptr``'s order (no sync)."""
        self.host[:wire.STATUS_WORDS] = 0
        self._runtime.memsetAsync(self.ptr, 0, self.NBYTES, stream_ptr)


class StatusChannel:
    """The host's view of one :class:`StatusBlock`: mirror -> sync -> raise -> clear.

    ``stream``: a callable returning the stream to order the copies on (an object with ``ptr``
    and ``synchronize()``, e.g. the cupy view of torch's current stream); ``timeout_s``: the
    peer timeout the kernels were given, named in timeout errors; ``expert_per_rank``: the
    window's, so that a fault in the dedup header's ``num_rows`` word is named as such.
    """

    def __init__(self, block: StatusBlock, *, stream, timeout_s: float,
                 expert_per_rank: int | None = None):
        self.block = block
        self._stream = stream
        self.timeout_s = timeout_s
        self.expert_per_rank = expert_per_rank

    @classmethod
    def allocate(cls, *, stream, timeout_s: float,
                 expert_per_rank: int | None = None) -> "StatusChannel":
        return cls(StatusBlock.allocate(), stream=stream, timeout_s=timeout_s,
                   expert_per_rank=expert_per_rank)

    @property
    def ptr(self) -> int:
        """Device address of the status block (the kernels' ``status`` argument)."""
        return self.block.ptr

    def sync_and_raise(self, *, layer_idx: int | None = None) -> None:
        """Mirror the device status to the host, synchronize the stream, raise what it holds."""
        stream = self._stream()
        self.block.enqueue_mirror(stream.ptr)
        stream.synchronize()
        self.raise_latched(layer_idx=layer_idx)

    def raise_latched(self, *, layer_idx: int | None = None) -> None:
        """Raise the error in the host mirror, if any, after clearing both copies.

        The mirror is as fresh as the last :meth:`sync_and_raise`: without one, this sees no
        error latched since (a cheap safety net, not a check).
        NOTE: on the error path the device words are cleared in stream order and the stream is
        synchronized before raising, so the next launch on any stream starts from a clean status.
        """
        host = self.block.host
        if host[wire.ST_CODE] == wire.STATUS_OK:  # the common case: one word, no decode
            return
        record = self.block.read()
        stream = self._stream()
        self.block.clear(stream.ptr)
        stream.synchronize()
        raise record.error(layer_idx=layer_idx, timeout_s=self.timeout_s,
                           expert_per_rank=self.expert_per_rank)
