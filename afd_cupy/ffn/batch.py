"""Merging the work items of one (layer, stage) into one expert-grouped batch, and splitting
the outputs back per item: what ``FFNWorker(schedule="lockstep")`` runs its one grouped GEMM
over (:mod:`afd_cupy.ffn.worker`). Host arithmetic on header counts plus two device copies;
no synchronization."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from afd_cupy.handles import FFNWorkItem


@dataclass(frozen=True)
class MergedBatch:
    """Work items of one (layer, stage) merged into one expert-grouped batch.

    - ``routed_x``: [num_routed, H] item dtype/device: for each local expert e, the rows of
      item 0's group e, then item 1's group e, ... (what ``moe.grouped_mlp`` reads).
    - ``group_counts_host``: rows per local expert of the merged batch (sum of the items').
    - ``order``: int64 [num_routed] on the items' device: merged row j is row ``order[j]`` of
      the items' routed rows concatenated in item order (each item in its own wire order).
    - ``routed_sizes`` / ``shared_sizes``: rows of each item.
    - ``shared_x``: [num_shared, H] the items' shared rows concatenated, or None if none.
    """

    routed_x: torch.Tensor
    group_counts_host: list
    order: torch.Tensor
    routed_sizes: list
    shared_x: torch.Tensor | None
    shared_sizes: list


def merge_order(counts: np.ndarray) -> np.ndarray:
    """counts: int [num_items, num_experts] rows per (item, local expert) -> int64 [sum]:
    position, in the items' rows concatenated in item order, of each merged row (expert-major,
    then item). Pure host arithmetic on header counts: no device access."""
    counts = np.asarray(counts, np.int64)
    item_rows = counts.sum(axis=1)
    item_start = np.concatenate(([0], np.cumsum(item_rows)[:-1]))
    group_start = np.cumsum(counts, axis=1) - counts  # start of group e inside its item
    seg_src = (item_start[:, None] + group_start).T.ravel()  # segments in (expert, item) order
    seg_len = counts.T.ravel()
    seg_dst = np.cumsum(seg_len) - seg_len
    total = int(seg_len.sum())
    return np.repeat(seg_src - seg_dst, seg_len) + np.arange(total, dtype=np.int64)


def merge_items(items: Sequence[FFNWorkItem]) -> MergedBatch:
    """Merge the routed and shared rows of ``items`` (same layer; same dtype and device).

    Two device copies at most (concatenate, then one ``index_select`` into expert-major
    order); the gather index is built on the host from the headers' counts and copied to
    the device without a synchronization.
    """
    counts = np.array([item.group_counts_host for item in items], np.int64).reshape(len(items), -1)
    routed_sizes = [int(item.routed_x.shape[0]) for item in items]
    first = items[0].routed_x
    order_host = torch.from_numpy(merge_order(counts))
    order = order_host.to(first.device, non_blocking=True)
    concatenated = torch.cat([item.routed_x for item in items]) if sum(routed_sizes) else first[:0]
    routed_x = concatenated.index_select(0, order) if sum(routed_sizes) else concatenated
    shared_parts = [item.shared_x for item in items if item.shared_x is not None]
    shared_sizes = [0 if item.shared_x is None else int(item.shared_x.shape[0]) for item in items]
    shared_x = torch.cat(shared_parts) if shared_parts else None
    return MergedBatch(routed_x=routed_x, group_counts_host=[int(c) for c in counts.sum(axis=0)],
                       order=order, routed_sizes=routed_sizes, shared_x=shared_x,
                       shared_sizes=shared_sizes)


def split_outputs(batch: MergedBatch, routed_out: torch.Tensor, shared_out: torch.Tensor | None):
    """Inverse of :func:`merge_items` for the outputs: a list, per item, of
    ``(routed_out [routed_sizes[i], H] in the item's wire order, shared_out [shared_sizes[i], H]
    or None when the item had no shared rows)``. Views of two new tensors."""
    wire_order = torch.empty_like(routed_out)
    if routed_out.shape[0]:
        wire_order.index_copy_(0, batch.order, routed_out)
    routed_parts = torch.split(wire_order, batch.routed_sizes)
    if shared_out is None:
        shared_parts = [None] * len(batch.shared_sizes)
    else:
        shared_parts = list(torch.split(shared_out, batch.shared_sizes))
    return [(routed, shared if size else None)
            for routed, shared, size in zip(routed_parts, shared_parts, batch.shared_sizes)]
