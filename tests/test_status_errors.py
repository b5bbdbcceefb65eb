"""The cuda backend's device status block -> typed exception mapping (pure host code)."""
import pytest

from afd_cupy import kernels
from afd_cupy.backend_cuda import _status_error
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
