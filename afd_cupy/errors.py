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


def for_layer(layer_idx) -> str:
    """The message fragment " for layer N" (empty when ``layer_idx`` is None)."""
    return f" for layer {layer_idx}" if layer_idx is not None else ""


def bad_header_error(peer: int, field: str, expected, observed, layer_idx=None) -> WireError:
    """The WireError of a reply header from FFN rank ``peer`` whose ``field`` is invalid."""
    return WireError(f"bad reply header from FFN rank {peer}{for_layer(layer_idx)}: {field} is "
                     f"{observed!r}, expected {expected!r}")


class ProtocolError(AfdError):
    """A peer broke the protocol (unexpected echo_seq, reply from a rank not waited on...).

    ``peer``, ``layer_idx``, ``field``, ``expected`` and ``observed`` are kept when known.
    """

    def __init__(self, message: str, *, peer=None, layer_idx=None, field=None, expected=None,
                 observed=None):
        super().__init__(message)
        self.peer = peer
        self.layer_idx = layer_idx
        self.field = field
        self.expected = expected
        self.observed = observed


class CapacityError(AfdError):
    """A message does not fit its slot. Nothing of the message was written."""

    def __init__(self, message: str, *, counts=None, cap: int | None = None, layer_idx=None):
        super().__init__(message)
        self.counts = counts
        self.cap = cap
        self.layer_idx = layer_idx


def token_cap_error(num_tokens: int, cap: int) -> CapacityError:
    """The CapacityError of a batch of ``num_tokens`` over ``token_cap``."""
    return CapacityError(f"num_tokens={num_tokens} > token_cap={cap} (max_num_batched_tokens)",
                         counts=num_tokens, cap=cap)


def shared_capacity_error(count: int, peer: int, cap: int) -> CapacityError:
    """The CapacityError of ``count`` shared rows for FFN rank ``peer`` over ``cap``."""
    return CapacityError(f"{count} shared rows for FFN rank {peer} > shared_cap={cap}",
                         counts=count, cap=cap)


def routed_capacity_error(count: int, peer: int, cap: int, *, nothing_sent: bool = False,
                          layer_idx=None) -> CapacityError:
    """The CapacityError of ``count`` routed partials for FFN rank ``peer`` over ``cap``."""
    suffix = "; nothing was sent" if nothing_sent else ""
    return CapacityError(
        f"{count} routed partials for FFN rank {peer}{for_layer(layer_idx)} > routed_cap={cap}; raise "
        f"routed_cap_multiplier (worst case = number of FFN ranks){suffix}", counts=count, cap=cap,
        layer_idx=layer_idx)


class InvalidRoutingError(AfdError, ValueError):
    """An expert id outside [0, num_experts) was given to a dispatch. Nothing was sent."""


def bad_expert_error(expert: int, partial: int, num_experts: int, layer_idx=None) -> InvalidRoutingError:
    """The error of topk id ``expert`` (flat index t * top_k + k: ``partial``) out of range."""
    return InvalidRoutingError(f"topk id {expert} (partial {partial}) outside [0, {num_experts})"
                               f"{for_layer(layer_idx)}; nothing was sent")


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
    return PeerTimeoutError(
        f"no reply from FFN rank {peer} (region {peer}, ring {ring}){for_layer(layer_idx)}, dispatch seq "
        f"{expected_seq} within {timeout_s} s; flag still {observed_seq}",
        peer=peer, region=peer, ring=ring, expected_seq=expected_seq, observed_seq=observed_seq,
        layer_idx=layer_idx)


class PeerLostError(AfdError):
    """Peers died without announcing shutdown (their processes are gone).

    ``peers``: the role ranks found dead."""

    def __init__(self, message: str, *, peers=()):
        super().__init__(message)
        self.peers = tuple(peers)


class ConnectorShutdown(AfdError):
    """The opposite role announced shutdown. A normal way for a loop to end."""

    def __init__(self, message: str = "peer announced shutdown", *, src_rank=None):
        super().__init__(message)
        self.src_rank = src_rank


class PeerFailedError(PeerLostError):
    """A peer's own code raised; it published why and left (shutdown announced).

    ``peers``: (its role rank,); ``error_type`` / ``error_message``: the peer's exception."""

    def __init__(self, message: str, *, peers=(), error_type: str = "", error_message: str = ""):
        super().__init__(message, peers=peers)
        self.error_type = error_type
        self.error_message = error_message


def shutdown_during_reply_error(peer: int, layer_idx=None) -> ConnectorShutdown:
    """FFN rank ``peer`` announced shutdown while this Attention rank waited for its reply."""
    return ConnectorShutdown(f"FFN rank {peer} announced shutdown while a reply{for_layer(layer_idx)} "
                             "was pending", src_rank=peer)


def reply_mismatch_error(peer: int, field: str, expected: int, observed: int,
                         layer_idx=None) -> ProtocolError:
    """A reply from FFN rank ``peer`` whose echoed ``field`` is not what was sent."""
    return ProtocolError(f"reply from FFN rank {peer}{for_layer(layer_idx)} echoes {field}="
                         f"{observed}, the pending dispatch has {field}={expected}",
                         peer=peer, layer_idx=layer_idx, field=field, expected=expected,
                         observed=observed)


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
