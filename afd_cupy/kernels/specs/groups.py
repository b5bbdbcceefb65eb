"""Argument groups that the pair and the dedup kernels share, in their C order.

:func:`slot_args` (where a dispatch writes) and :func:`publish_args` (what it stamps and
records) are common to afd_dispatch_scatter / afd_dispatch_fused and their dedup twins;
:func:`reply_wait_args` to afd_wait_replies, afd_combine and afd_dedup_combine. Each checks
its arguments (ValueError naming the argument) and returns them as an ordered dict.
"""
from __future__ import annotations

import numpy as np

from afd_cupy import wire
from afd_cupy.kernels import checks


def slot_args(*, peer_windows, staging, geo, ring, num_ffn) -> dict:
    """Where a dispatch writes (peer_windows, staging, geo, ring, in every dispatch kernel's
    order): each FFN rank's window base, the put staging, the checked ``geo``, the ring slot."""
    return {"peer_windows": checks.device_array("peer_windows", peer_windows, np.uint64, num_ffn),
            "staging": checks.address("staging", staging, allow_null=True),
            "geo": geo, "ring": checks.count("ring", ring, high=int(geo["ring_depth"]) - 1)}


def publish_args(*, geo, src_rank, layer_idx, stage_idx, hdr_flags, seq_counters, expected,
                  expected_counts, count_columns, done_counter, num_ffn) -> dict:
    """What a dispatch stamps and records (src_rank .. done_counter, in every dispatch kernel's
    order); ``expected_counts`` is [num_ffn, count_columns] (pair 2, dedup 3)."""
    return {"src_rank": checks.count("src_rank", src_rank, high=int(geo["num_regions"]) - 1),
            "layer_idx": np.int32(layer_idx), "stage_idx": np.int32(stage_idx),
            "hdr_flags": np.int32(hdr_flags),
            "seq_counters": checks.device_array("seq_counters", seq_counters, np.int64, num_ffn),
            "expected": checks.device_array("expected", expected, np.int64, num_ffn),
            "expected_counts": checks.device_array("expected_counts", expected_counts, np.int32,
                                      count_columns * num_ffn),
            "done_counter": checks.device_array("done_counter", done_counter, np.uint32, 1)}


def reply_wait_args(*, window, geo, num_ffn_ranks, ring, expected, expected_counts, layer_idx,
                     stage_idx, last_seen, reply_flags, dedup: bool = False) -> dict:
    """Checked arguments shared by afd_wait_replies, afd_combine and afd_dedup_combine, in their
    C order. ``dedup``: ``expected_counts`` has 3 columns (routed, shared, rows), else 2."""
    num_ffn = checks.count("num_ffn_ranks", num_ffn_ranks, low=1, high=int(geo["num_regions"]))
    if dedup and int(geo["header_words"]) < wire.HDR_FIXED_WORDS + 2:
        raise ValueError(f"geo.header_words = {int(geo['header_words'])} cannot hold a dedup "
                         "header (HDR_FIXED_WORDS + expert_per_rank + num_rows)")
    count_cols = 3 if dedup else 2
    return {"window": checks.address("window", window), "geo": geo,
            "num_ffn_ranks": num_ffn, "ring": checks.count("ring", ring, high=int(geo["ring_depth"]) - 1),
            "expected": checks.device_array("expected", expected, np.int64, int(num_ffn)),
            "expected_counts": checks.device_array("expected_counts", expected_counts, np.int32,
                                      count_cols * int(num_ffn)),
            "layer_idx": np.int32(layer_idx), "stage_idx": np.int32(stage_idx),
            "last_seen": checks.device_array("last_seen", last_seen, np.int64,
                                int(geo["num_regions"]) * int(geo["ring_depth"])),
            "reply_flags": checks.device_array("reply_flags", reply_flags, np.int64, int(num_ffn) + 1)}
