"""Typed exceptions of afd_cupy.

Every error carries the values that explain it (peer, layer, seq, counts, caps) in its
message and, where useful, as attributes, so a caller can log or react without parsing text.
"""
from __future__ import annotations


class AfdError(Exception):
    """Base class of every afd_cupy error."""


class ConfigError(AfdError, ValueError):
    """A configuration value is invalid (unknown key, wrong type, non-positive size...)."""


class TopologyError(ConfigError):
    """The requested Attention/FFN topology is impossible."""


class GeometryMismatchError(ConfigError):
    """Two ranks disagree about the window geometry exchanged at start-up."""


class WireError(AfdError):
    """A header or window field failed validation (bad magic, version, length, counts)."""


class ProtocolError(AfdError):
    """A peer broke the protocol (unexpected echo_seq, reply from a rank not waited on...)."""


class CapacityError(AfdError):
    """A message does not fit its slot. Nothing of the message was written."""

    def __init__(self, message: str, *, counts=None, cap: int | None = None):
        super().__init__(message)
        self.counts = counts
        self.cap = cap


def routed_capacity_error(count: int, peer: int, cap: int, *, nothing_sent: bool = False) -> CapacityError:
    """The CapacityError of ``count`` routed partials for FFN rank ``peer`` over ``cap``."""
    suffix = "; nothing was sent" if nothing_sent else ""
    return CapacityError(
        f"{count} routed partials for FFN rank {peer} > routed_cap={cap}; raise "
        f"routed_cap_multiplier (worst case = number of FFN ranks){suffix}", counts=count, cap=cap)


class RingExhaustedError(AfdError):
    """No free ring slot for a (peer, stage): the configuration does not match the peers."""


class PeerTimeoutError(AfdError, TimeoutError):
    """A bounded wait ended without the expected arrival."""

    def __init__(self, message: str, *, peer=None, region=None, ring=None,
                 expected_seq=None, observed_seq=None, layer_idx=None):
        super().__init__(message)
        self.peer = peer
        self.region = region
        self.ring = ring
        self.expected_seq = expected_seq
        self.observed_seq = observed_seq
        self.layer_idx = layer_idx


def reply_timeout_error(peer: int, ring: int, layer_idx, expected_seq: int, observed_seq: int,
                        timeout_s: float) -> PeerTimeoutError:
    """The PeerTimeoutError of an Attention rank that got no reply from FFN rank ``peer``."""
    where = f" for layer {layer_idx}" if layer_idx is not None else ""
    return PeerTimeoutError(
        f"no reply from FFN rank {peer} (region {peer}, ring {ring}){where}, dispatch seq "
        f"{expected_seq} within {timeout_s} s; flag still {observed_seq}",
        peer=peer, region=peer, ring=ring, expected_seq=expected_seq, observed_seq=observed_seq,
        layer_idx=layer_idx)


class ConnectorShutdown(AfdError):
    """The opposite role announced shutdown. A normal way for a loop to end."""

    def __init__(self, message: str = "peer announced shutdown", *, src_rank=None):
        super().__init__(message)
        self.src_rank = src_rank


class HeapError(AfdError, RuntimeError):
    """A symmetric heap could not be created, mapped or freed."""


class NvshmemError(HeapError):
    """An NVSHMEM host call failed; names the call and its return code."""

    def __init__(self, message: str, *, call: str | None = None, code: int | None = None):
        super().__init__(message)
        self.call = call
        self.code = code


class BackendUnavailableError(AfdError, RuntimeError):
    """The requested backend cannot run here (no GPU, no CuPy, no NVSHMEM library)."""
