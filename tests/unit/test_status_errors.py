"""The device status block seen from the host: typed exception mapping, mirror and reset.

``wire.StatusRecord.error`` maps a latched status to the exception the host backend raises;
:class:`afd_cupy.kernels.StatusChannel` runs mirror -> sync -> raise -> clear over a
:class:`StatusBlock`. Both are driven on the CPU with a fake CUDA runtime and stream.
"""
import ctypes

import numpy as np
import pytest

from afd_cupy import wire
from afd_cupy.errors import (CapacityError, InvalidRoutingError, ConnectorShutdown,
                             PeerTimeoutError, ProtocolError, WireError)
from afd_cupy.kernels import StatusBlock, StatusChannel


def _record(code, **fields):
    words = dict(code=code, peer=1, slot=3, ring=1, expected=7, observed=5, count=-1, cap=-1)
    words.update(fields)
    return wire.StatusRecord(**words)


def test_capacity_names_counts_and_cap():
    err = _record(wire.STATUS_CAPACITY, count=40, cap=32).error(layer_idx=2, timeout_s=60.0)
    assert isinstance(err, CapacityError) and (err.counts, err.cap) == (40, 32)
    assert str(err).startswith("40 routed partials for FFN rank 1 for layer 2 > routed_cap=32")
    assert str(err).endswith("nothing was sent") and err.layer_idx == 2


@pytest.mark.parametrize("code", [wire.STATUS_CAPACITY, wire.STATUS_TIMEOUT, wire.STATUS_SHUTDOWN,
                                  wire.STATUS_REPLY_MISMATCH, wire.STATUS_BAD_HEADER, wire.STATUS_BAD_EXPERT])
def test_latched_layer_wins_over_the_synchronising_call(code):
    """A kernel latches the layer of the dispatch or receive that failed (ST_LAYER); an error
    found by a later call's synchronisation names that layer, not the caller's."""
    count = wire.HDR_LAYER if code in (wire.STATUS_REPLY_MISMATCH, wire.STATUS_BAD_HEADER) else 40
    err = _record(code, count=count, cap=32, layer=6).error(layer_idx=2, timeout_s=1.0)
    assert "layer 6" in str(err) and "layer 2" not in str(err), str(err)
    if hasattr(err, "layer_idx"):
        assert err.layer_idx == 6
    fallback = _record(code, count=count, cap=32).error(layer_idx=2, timeout_s=1.0)  # layer -1
    assert "layer 2" in str(fallback), str(fallback)


def test_timeout_names_peer_ring_layer_and_seqs():
    err = _record(wire.STATUS_TIMEOUT).error(layer_idx=4, timeout_s=1.5)
    assert isinstance(err, PeerTimeoutError)
    assert (err.peer, err.ring, err.expected_seq, err.observed_seq, err.layer_idx) == (1, 1, 7, 5, 4)
    assert "FFN rank 1" in str(err) and "layer 4" in str(err) and "1.5 s" in str(err)


@pytest.mark.parametrize("code,count,kind,text", [
    (wire.STATUS_SHUTDOWN, -1, ConnectorShutdown, "FFN rank 1 announced shutdown"),
    (wire.STATUS_REPLY_MISMATCH, wire.HDR_ECHO_SEQ, ProtocolError, "echoes echo_seq=5, the pending dispatch has echo_seq=7"),
    (wire.STATUS_REPLY_MISMATCH, wire.HDR_LAYER, ProtocolError, "echoes layer_idx=5"),
    (wire.STATUS_REPLY_MISMATCH, wire.HDR_STAGE, ProtocolError, "echoes stage_idx=5"),
    (wire.STATUS_REPLY_MISMATCH, wire.HDR_ROUTED_TOKENS, ProtocolError, "echoes routed_tokens=5"),
    (wire.STATUS_REPLY_MISMATCH, wire.HDR_SHARED_TOKENS, ProtocolError, "echoes shared_tokens=5"),
    (wire.STATUS_BAD_HEADER, wire.HDR_MAGIC, WireError, "bad reply header from FFN rank 1 for layer 0: magic"),
    (wire.STATUS_BAD_HEADER, wire.HDR_VERSION, WireError, "version is 5, expected 7"),
    (wire.STATUS_BAD_HEADER, wire.HDR_ROUTED_TOKENS, WireError, "routed_tokens is 5, expected 7"),
    (wire.STATUS_BAD_HEADER, wire.HDR_SHARED_TOKENS, WireError, "shared_tokens is 5, expected 7"),
    (wire.STATUS_BAD_EXPERT, -1, InvalidRoutingError, "topk id 5 (partial 3) outside [0, 7) for layer 0"),
])
def test_other_codes(code, count, kind, text):
    err = _record(code, count=count).error(layer_idx=0, timeout_s=1.0)
    assert isinstance(err, kind) and text in str(err), str(err)
    if code == wire.STATUS_REPLY_MISMATCH:
        assert (err.peer, err.field, err.expected, err.observed) == (1, wire.HDR_WORD_NAMES[count], 7, 5)


# --- StatusChannel over a StatusBlock, with a fake CUDA runtime and stream ----------------------
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


def _channel():
    """A StatusChannel whose 'device' words are a numpy array."""
    log = []
    device = np.zeros(wire.STATUS_WORDS, np.int64)
    block = StatusBlock(device.ctypes.data, np.zeros(wire.STATUS_WORDS, np.int64),
                        _FakeRuntime(log), owners=(device,))
    stream = _FakeStream(log)
    return StatusChannel(block, stream=lambda: stream, timeout_s=1.5), device, log


def test_status_block_rejects_a_short_mirror():
    with pytest.raises(ValueError, match="int64 array"):
        StatusBlock(1, np.zeros(3, np.int64), None)


def test_channel_ptr_is_the_device_block():
    channel, device, _ = _channel()
    assert channel.ptr == device.ctypes.data


def test_device_error_is_seen_only_through_the_mirror_before_a_sync():
    channel, device, log = _channel()
    device[:] = [wire.STATUS_TIMEOUT, 1, 3, 1, 7, 5, -1, -1, -1]
    channel.raise_latched(layer_idx=4)  # no mirror yet: the host sees nothing, touches nothing
    assert log == [] and channel.block.host.tolist() == [0] * wire.STATUS_WORDS
    with pytest.raises(PeerTimeoutError, match="FFN rank 1 .* layer 4") as info:
        channel.sync_and_raise(layer_idx=4)
    assert "1.5 s" in str(info.value)  # the channel's timeout_s
    ptr = _FakeStream.ptr
    assert log == [("mirror", ptr), ("sync", ptr), ("clear", ptr), ("sync", ptr)]
    assert device.tolist() == [0] * wire.STATUS_WORDS  # both copies start clean again
    assert channel.block.host.tolist() == [0] * wire.STATUS_WORDS


def test_sync_and_raise_raises_a_latched_error_once():
    channel, device, log = _channel()
    channel.sync_and_raise()  # clean: one mirror and one sync, nothing cleared
    assert log == [("mirror", _FakeStream.ptr), ("sync", _FakeStream.ptr)]
    device[:] = [wire.STATUS_CAPACITY, 2, -1, -1, -1, -1, 40, 32, -1]
    with pytest.raises(CapacityError, match="40 routed partials for FFN rank 2 > routed_cap=32"):
        channel.sync_and_raise()
    channel.sync_and_raise()  # cleared on raise
    assert device.tolist() == [0] * wire.STATUS_WORDS


def test_reply_mismatch_through_the_channel_names_the_field():
    channel, device, _ = _channel()
    device[:] = [wire.STATUS_REPLY_MISMATCH, 3, 7, 1, 9, 10, wire.HDR_LAYER, -1, -1]
    with pytest.raises(ProtocolError, match="FFN rank 3 for layer 9 echoes layer_idx=10") as info:
        channel.sync_and_raise(layer_idx=9)
    assert (info.value.field, info.value.expected, info.value.observed) == ("layer_idx", 9, 10)


# --- dedup: the num_rows trailer word (HDR_FIXED_WORDS + expert_per_rank) -----------------------
def test_dedup_num_rows_word_is_named_given_expert_per_rank():
    word = wire.HDR_FIXED_WORDS + 4
    mismatch = _record(wire.STATUS_REPLY_MISMATCH, count=word)
    err = mismatch.error(layer_idx=0, expert_per_rank=4)
    assert isinstance(err, ProtocolError) and (err.field, err.expected, err.observed) == ("num_rows", 7, 5)
    assert "echoes num_rows=5, the pending dispatch has num_rows=7" in str(err)
    # without the window's expert_per_rank the word reads as an expert count (pair mode's view)
    assert mismatch.error(layer_idx=0).field == "expert_counts"
    assert mismatch.error(layer_idx=0, expert_per_rank=5).field == "expert_counts"
    bad = _record(wire.STATUS_BAD_HEADER, count=word).error(layer_idx=0, expert_per_rank=4)
    assert isinstance(bad, WireError) and "num_rows is 5, expected 7" in str(bad)
    assert _record(wire.STATUS_BAD_HEADER, count=wire.HDR_FLAGS).error(layer_idx=0).args[0].count("flags is 5")


def test_channel_names_num_rows_with_its_expert_per_rank():
    channel, device, _ = _channel()
    channel.expert_per_rank = 3
    device[:] = [wire.STATUS_REPLY_MISMATCH, 1, 2, 0, 9, 8, wire.HDR_FIXED_WORDS + 3, -1, 4]
    with pytest.raises(ProtocolError, match="echoes num_rows=8, the pending dispatch has num_rows=9") as info:
        channel.sync_and_raise()
    assert info.value.field == "num_rows"
