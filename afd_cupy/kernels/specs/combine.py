"""Spec builders of ``raw_kernels/attention/combine.cu``: the Attention side's receive.

afd_wait_replies (a one-warp bounded wait that checks every reply) and afd_combine (the fp32
weighted combine), with the combine's grid and the wait's pass mark.
"""
from __future__ import annotations

import numpy as np

from afd_cupy.kernels import checks, loader
from afd_cupy.kernels.launches import LaunchSpec, launch_spec
from afd_cupy.kernels.specs.limits import (COMBINE_PART_BLOCKS, KERNEL_LIMITS, MAX_BLOCKS,
                                           MAX_FFN_RANKS, MAX_TOP_K, payload_row_bytes)
from afd_cupy.kernels.specs.groups import reply_wait_args


def wait_pass_mark(expected) -> int:
    """The pass mark afd_wait_replies leaves in ``reply_flags[F]`` when every reply of the
    dispatch whose ``expected`` int64 [F] (seq per FFN rank, 0 = not sent) it waited for passed:
    ``seq * MAX_FFN_RANKS + j`` of the lowest rank ``j`` sent to; 0 when nothing was sent (the
    numpy twin of ``wait_pass_mark`` in reply_check.cuh)."""
    expected = np.asarray(expected, np.int64).reshape(-1)
    sent = np.flatnonzero(expected)
    return 0 if sent.size == 0 else int(expected[sent[0]]) * MAX_FFN_RANKS + int(sent[0])


def wait_replies_spec(*, window, geo, num_ffn_ranks, ring, expected, expected_counts, layer_idx,
                      stage_idx, last_seen, reply_flags, timeout_ns, status,
                      dedup=0) -> LaunchSpec:
    """One-warp spin until every rank with ``expected[j] != 0`` replied (afd_wait_replies).

    Launch right before the combine on the same stream with the same arguments: only this
    kernel spins, so a large combine never holds every SM while it waits. Checks each reply like
    ``wire.decode_header`` + ``wire.check_reply`` against ``expected``, ``expected_counts``
    (the scatter's outputs), ``layer_idx`` and ``stage_idx``; errors (TIMEOUT, BAD_HEADER,
    SHUTDOWN, REPLY_MISMATCH; ST_COUNT = the failing header word) are latched in ``status``.
    ``last_seen`` int64 [num_slots] is read only (the combine updates it); a reply answering
    an earlier dispatch (``wire.is_late_reply``) is skipped and the wait goes on. The flag of
    each accepted reply is written to ``reply_flags`` int64 [num_ffn_ranks + 1], and its last
    word gets the dispatch's pass mark when every reply passed (0 otherwise): the combine's
    blocks that find it skip their own re-check (zeros on allocation; the combine clears it).

    ``dedup`` = 1: the replies of a dedup dispatch (docs/design/dedup.md): ``FLAG_DEDUP`` required
    (and forbidden with 0), ``geo.header_words`` = HDR_FIXED_WORDS + epr + 1 with ``num_rows``
    last, ``expected_counts`` int32 [F, 3] (routed, shared, rows: :func:`dedup_scatter_spec`'s);
    a ``num_rows`` fault reports ST_COUNT = HDR_FIXED_WORDS + epr.
    """
    geo = checks.geometry("geo", geo)
    dedup = checks.count("dedup", dedup, high=1)
    args = reply_wait_args(window=window, geo=geo, num_ffn_ranks=num_ffn_ranks, ring=ring,
                            expected=expected, expected_counts=expected_counts,
                            layer_idx=layer_idx, stage_idx=stage_idx, last_seen=last_seen,
                            reply_flags=reply_flags, dedup=bool(dedup))
    args.update(timeout_ns=checks.int64("timeout_ns", timeout_ns, low=0), status=checks.address("status", status),
                dedup=dedup)
    return launch_spec(loader.get_kernel("attention/combine.cu", "afd_wait_replies"), 1,
                 KERNEL_LIMITS["WAIT_REPLIES_THREADS"], args)


def combine_spec(*, dtype_code, out, num_tokens, hidden_size, topk_ids, topk_weights, pos, top_k,
                 expert_per_rank, num_ffn_ranks, has_shared, window, geo, ring, expected,
                 expected_counts, layer_idx, stage_idx, last_seen, reply_flags, timeout_ns,
                 out_scale, done_counter, status, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Wait for and check the replies (as :func:`wait_replies_spec`), then combine
    (afd_combine<DT>).

    ``out``: payload [T, H]; ``topk_ids`` int32 [T*K]; ``topk_weights`` float32 [T*K];
    ``pos`` int32 [T*K] (``pos_out`` of the scatter); ``window``: this rank's own window;
    ``last_seen`` is set from ``reply_flags`` on success. Bounded by ``timeout_ns``; on an error the output
    rows are NaN. Grid: :func:`combine_grid`.
    """
    num_tokens = checks.count("num_tokens", num_tokens)
    top_k = checks.count("top_k", top_k, low=1, high=MAX_TOP_K)
    geo = checks.geometry("geo", geo)
    num_partials = int(num_tokens) * int(top_k)
    wait = reply_wait_args(window=window, geo=geo, num_ffn_ranks=num_ffn_ranks, ring=ring,
                            expected=expected, expected_counts=expected_counts,
                            layer_idx=layer_idx, stage_idx=stage_idx, last_seen=last_seen,
                            reply_flags=reply_flags)
    args = {"out": checks.address("out", out, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "topk_ids": checks.device_array("topk_ids", topk_ids, np.int32, num_partials),
            "topk_weights": checks.device_array("topk_weights", topk_weights, np.float32, num_partials),
            "pos": checks.device_array("pos", pos, np.int32, num_partials), "top_k": top_k,
            "expert_per_rank": checks.count("expert_per_rank", expert_per_rank, low=1),
            "num_ffn_ranks": wait.pop("num_ffn_ranks"),
            "has_shared": checks.count("has_shared", has_shared, high=1), **wait}
    args.update(timeout_ns=checks.int64("timeout_ns", timeout_ns, low=0), out_scale=np.float32(out_scale),
                done_counter=checks.device_array("done_counter", done_counter, np.uint32, 1),
                status=checks.address("status", status))
    kernel = loader.get_kernel("attention/combine.cu", "afd_combine", dtype_code=checks.dtype_code(dtype_code))
    grid = combine_grid(int(num_tokens), payload_row_bytes(int(args["hidden_size"]), dtype_code), max_blocks)
    return launch_spec(kernel, grid, KERNEL_LIMITS["COMBINE_THREADS"], args)


#: a combine of at most this many blocks waits for its replies itself, with no afd_wait_replies
#: before it (every block's first warp runs the reply wait, combine_wait in reply_check.cuh): one
#: kernel less on a small decode batch's critical path, and no more SMs held while waiting than
#: this. Larger combines keep the one-warp wait kernel, so that a combine of many blocks never
#: spins on every SM (a GEMM of another MPS client could not be scheduled).
COMBINE_SELF_WAIT_BLOCKS = 8


def combine_waits_itself(grid: int) -> bool:
    """Whether a combine of ``grid`` blocks (:func:`combine_grid`) runs without the wait kernel
    before it (:data:`COMBINE_SELF_WAIT_BLOCKS`)."""
    return int(grid) <= COMBINE_SELF_WAIT_BLOCKS


def combine_parts(row_bytes: int, num_tokens: int) -> int:
    """Blocks per token of the combines (afd_combine, afd_dedup_combine), as they compute it
    (``combine_parts`` in wire.cuh): up to one 16-byte vector of the row a thread
    (``ceil(row_bytes / 16 / COMBINE_THREADS)``), fewer as tokens grow, at most
    COMBINE_PART_BLOCKS blocks in all, at least 1."""
    vecs = -(-int(row_bytes) // 16)
    full = -(-vecs // KERNEL_LIMITS["COMBINE_THREADS"])
    room = COMBINE_PART_BLOCKS // int(num_tokens) if int(num_tokens) > 0 else full
    return max(1, min(full, room))


def combine_grid(num_tokens: int, row_bytes: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_combine / afd_dedup_combine for ``num_tokens`` tokens of ``row_bytes``
    bytes: one per (token, part) item (:func:`combine_parts`), at most ``max_blocks``, at
    least 1. Any grid gives the same output (blocks stride over the items)."""
    return max(1, min(int(num_tokens) * combine_parts(row_bytes, num_tokens), max_blocks))
