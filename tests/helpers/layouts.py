"""Window layouts built straight from their fields (no configs), for tests below the connector.

- :func:`small_layout`: a small pair-mode layout (2 regions, 2 rings, 4 experts per rank,
  hidden 64, bf16, top-4, 16 tokens) with any :class:`~afd_cupy.wire.WindowLayout` field
  overridden by keyword.
- :func:`kernel_layout`: the kernel tests' layout: the payload dtype by name and the shared
  capacity from the wire mode's rule (pair: a share of the tokens per FFN rank; dedup: every
  token), as ``WindowLayout.from_configs`` derives it.
"""
from __future__ import annotations

from afd_cupy import wire
from afd_cupy.wire import dtypes

SMALL_FIELDS = dict(num_regions=2, ring_depth=2, expert_per_rank=4, hidden_size=64, itemsize=2,
                    top_k=4, token_cap=16, routed_cap=40, shared_cap=8)


def small_layout(**overrides) -> wire.WindowLayout:
    """:data:`SMALL_FIELDS` with ``overrides`` (any WindowLayout field, ``wire_mode`` included)."""
    return wire.WindowLayout(**{**SMALL_FIELDS, **overrides})


def kernel_layout(*, num_regions, epr, hidden, dtype, top_k, token_cap, routed_cap, has_shared,
                  num_ffn=None, ring_depth=2, wire_mode="pair") -> wire.WindowLayout:
    """A layout for payload ``dtype`` (a name of dtypes.PAYLOAD_DTYPES); ``has_shared`` sizes the
    shared rows: pair mode ceil(token_cap / num_ffn) (``num_ffn`` needed), dedup token_cap."""
    if not has_shared:
        shared_cap = 0
    elif wire_mode == "dedup":
        shared_cap = token_cap
    else:
        shared_cap = -(-token_cap // num_ffn)
    return wire.WindowLayout(num_regions=num_regions, ring_depth=ring_depth, expert_per_rank=epr,
                             hidden_size=hidden, itemsize=dtypes.payload_dtype(dtype).itemsize,
                             top_k=top_k, token_cap=token_cap, routed_cap=routed_cap,
                             shared_cap=shared_cap, wire_mode=wire_mode)
