"""The cuda backend's device status block: typed exception mapping, mirror and reset (host code)."""
import ctypes
import types

import numpy as np
import pytest

from afd_cupy import kernels
from afd_cupy.backends.cuda import CudaDataPath, _status_error
from afd_cupy.errors import (CapacityError, ConnectorShutdown, PeerTimeoutError, ProtocolError,
                             WireError)


def _status(code, **fields):
    words = dict(code=code, peer=1, slot=3, ring=1, expected=7, observed=5, count=-1, cap=-1)
    words.update(fields)
    return {**words, "name": kernels.STATUS_NAMES[code]}


def test_capacity_names_counts_and_cap():
    err = _status_error(_status(kernels.STATUS_CAPACITY, count=40, cap=32), 2, 60.0)
    assert isinstance(err, CapacityError) and (err.counts, err.cap) == (40, 32)
    assert str(err).startswith("40 routed partials for FFN rank 1 > routed_cap=32")
    assert str(err).endswith("nothing was sent")


def test_timeout_names_peer_ring_layer_and_seqs():
    err = _status_error(_status(kernels.STATUS_TIMEOUT), 4, 1.5)
    assert isinstance(err, PeerTimeoutError)
    assert str(err) == ("no reply from FFN rank 1 (region 1, ring 1) for layer 4, dispatch seq 7 "
                        "within 1.5 s; flag still 5")
    assert (err.peer, err.ring, err.expected_seq, err.observed_seq, err.layer_idx) == (1, 1, 7, 5, 4)


@pytest.mark.parametrize("code,kind,text", [
    (kernels.STATUS_SHUTDOWN, ConnectorShutdown, "FFN rank 1 announced shutdown"),
    (kernels.STATUS_ECHO_MISMATCH, ProtocolError, "echoes seq 5, pending dispatch has seq 7 for layer 0"),
    (kernels.STATUS_BAD_HEADER, WireError, "bad reply header from FFN rank 1 for layer 0"),
    (kernels.STATUS_BAD_EXPERT, ProtocolError, "device status BAD_EXPERT for layer 0"),
])
def test_other_codes(code, kind, text):
    err = _status_error(_status(code), 0, 1.0)
    assert isinstance(err, kind) and text in str(err)


# --- device status block + pinned mirror (StatusBlock), with a fake CUDA runtime --------------
class _FakeRuntime:
    """cupy.cuda.runtime's two calls used by StatusBlock, on host memory, logging each call."""

    memcpyDeviceToHost = 2

    def __init__(self, log):
        self.log = log

    def memcpyAsync(self, dst, src, size, kind, stream):
        assert kind == self.memcpyDeviceToHost
        self.log.append(("mirror", stream))
        ctypes.memmove(dst, src, size)

    def memsetAsync(self, ptr, value, size, stream):
        self.log.append(("clear", stream))
        ctypes.memset(ptr, value, size)


class _FakeStream:
    ptr = 0x5EED

    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append(("sync", self.ptr))


def _fake_path():
    """A CudaDataPath with only what the status logic touches; 'device' words are numpy."""
    log = []
    device = np.zeros(kernels.STATUS_WORDS, np.int64)
    path = object.__new__(CudaDataPath)
    path.status = kernels.StatusBlock(device.ctypes.data, np.zeros(kernels.STATUS_WORDS, np.int64),
                                      _FakeRuntime(log), owners=(device,))
    path.conn = types.SimpleNamespace(peer_timeout_s=1.5)
    stream = _FakeStream(log)
    path.stream = lambda: stream
    return path, device, log


def test_status_block_rejects_a_short_mirror():
    with pytest.raises(ValueError, match="int64 array"):
        kernels.StatusBlock(1, np.zeros(3, np.int64), None)


def test_device_error_is_seen_only_through_the_mirror_before_a_sync():
    path, device, log = _fake_path()
    device[:] = [kernels.STATUS_TIMEOUT, 1, 3, 1, 7, 5, -1, -1]
    path.raise_latched(layer_idx=4)  # no mirror yet: the host sees nothing, touches nothing
    assert log == [] and path.status.host.tolist() == [0] * kernels.STATUS_WORDS
    with pytest.raises(PeerTimeoutError, match="no reply from FFN rank 1 .* for layer 4"):
        path._sync_and_raise(layer_idx=4)
    ptr = _FakeStream.ptr
    assert log == [("mirror", ptr), ("sync", ptr), ("clear", ptr), ("sync", ptr)]
    assert device.tolist() == [0] * kernels.STATUS_WORDS  # both copies start clean again
    assert path.status.host.tolist() == [0] * kernels.STATUS_WORDS


def test_check_errors_raises_a_latched_error_once():
    path, device, log = _fake_path()
    path.check_errors()  # clean: one mirror and one sync, nothing cleared
    assert log == [("mirror", _FakeStream.ptr), ("sync", _FakeStream.ptr)]
    device[:] = [kernels.STATUS_CAPACITY, 2, -1, -1, -1, -1, 40, 32]
    with pytest.raises(CapacityError, match="40 routed partials for FFN rank 2 > routed_cap=32"):
        path.check_errors()
    path.check_errors()  # cleared on raise
    assert device.tolist() == [0] * kernels.STATUS_WORDS
