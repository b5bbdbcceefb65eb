"""What the connector hands out: the Attention side's DispatchHandle and the FFN side's
FFNWorkItem (docs/design/protocol.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from afd_cupy import wire
from afd_cupy.backends.base import Arrival


@dataclass(frozen=True)
class DispatchHandle:
    """What ``send_attn_output`` returns; pass it to ``recv_ffn_output``.

    Pair mode: ``topk_ids``/``topk_weights`` never travel: they stay here for the combine.
    They are the connector's own copies (int32 / fp32 views of buffers allocated per ring at
    start-up, filled by a stream-ordered copy in ``send_attn_output``), so the caller may reuse
    its tensors as soon as the send returns.
    Dedup mode: the weights travel in the route tables (read at send time) and the combine
    uses the send state's row map instead.
    """

    layer_idx: int
    stage_idx: int
    ring: int
    num_tokens: int
    topk_ids: Any = field(repr=False)
    topk_weights: Any = field(repr=False)
    state: Any = field(repr=False, compare=False)


@dataclass(frozen=True)
class FFNWorkItem:
    """One received dispatch, as zero-copy views into this FFN rank's window.

    - ``routed_x``: [routed_tokens, hidden] payload dtype, rows grouped by local expert.
    - ``group_counts``: int32 [expert_per_rank] on the payload's device, rows per local
      expert (sums to routed_tokens); ``group_counts_host`` the same as a tuple.
    - ``shared_x``: [shared_tokens, hidden] rows whose shared experts run on this rank (pair:
      the round-robin slice), or None when the item has no shared rows.
    - ``route_table``: int32 [routed_tokens, 2] (token index, top-k slot) per row in pair
      mode; int32 [num_rows, 2 + 2 * top_k] per received row in dedup mode (``wire.ROUTE_*``).
    The views stay valid until this item is answered with ``send_ffn_work_item_output``.
    In dedup mode ``routed_x`` is the path's local staging (the received rows expanded into
    expert groups) and the reply reduces the outputs to one row per received row; the
    outputs passed to ``send_ffn_work_item_output`` have the same shapes in both modes.
    """

    arrival: Arrival = field(repr=False)
    routed_x: Any = field(repr=False)
    group_counts: Any = field(repr=False)
    shared_x: Any = field(repr=False)
    route_table: Any = field(repr=False)

    @property
    def header(self) -> wire.Header:
        return self.arrival.header

    @property
    def src_rank(self) -> int:
        return self.arrival.region

    @property
    def ring(self) -> int:
        return self.arrival.ring

    @property
    def seq(self) -> int:
        return self.header.seq

    @property
    def layer_idx(self) -> int:
        return self.header.layer_idx

    @property
    def stage_idx(self) -> int:
        return self.header.stage_idx

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @property
    def routed_tokens(self) -> int:
        return self.header.routed_tokens

    @property
    def shared_tokens(self) -> int:
        return self.header.shared_tokens

    @property
    def num_rows(self) -> int:
        """Rows received (dedup mode; 0 in pair mode)."""
        return self.header.num_rows

    @property
    def group_counts_host(self) -> tuple:
        return self.header.expert_counts

    def __repr__(self) -> str:
        return (f"FFNWorkItem(src_rank={self.src_rank}, layer_idx={self.layer_idx}, "
                f"stage_idx={self.stage_idx}, ring={self.ring}, seq={self.seq}, "
                f"routed_tokens={self.routed_tokens}, shared_tokens={self.shared_tokens}, "
                f"num_rows={self.num_rows})")
