"""Spec builders of ``raw_kernels/attention/dedup_attn.cu`` and ``dedup_attn_fused.cu``: the
Attention side of the dedup wire mode (docs/design/dedup.md): afd_dedup_rows,
afd_dedup_scatter, afd_dedup_dispatch_fused and afd_dedup_combine, with their grids and the
fused kernel's shared-memory bound.
"""
from __future__ import annotations

import numpy as np

from afd_cupy import wire
from afd_cupy.kernels import checks, loader
from afd_cupy.kernels.launches import LaunchSpec, launch_spec
from afd_cupy.kernels.specs.limits import (KERNEL_LIMITS, MAX_BLOCKS, MAX_FFN_RANKS, MAX_TOP_K,
                                           ROWS_PER_BLOCK, payload_row_bytes, row_grid, row_parts)
from afd_cupy.kernels.specs.groups import publish_args, reply_wait_args, slot_args
from afd_cupy.kernels.specs.dispatch import dispatch_num_chunks, plan_grid
from afd_cupy.kernels.specs.combine import combine_grid


def dedup_rows_spec(*, topk_ids, num_tokens, top_k, expert_per_rank, num_ffn_ranks, has_shared,
                    verdict, rows_hist, rows_local, row_map, shared_rank, num_rows, shared_rows,
                    done_counter) -> LaunchSpec:
    """Rows of each FFN rank's dedup message (afd_dedup_rows), after :func:`dispatch_plan_spec`.

    ``topk_ids`` int32 [T*K] (the plan's); ``verdict`` int32 [1] (the plan's: with anything but
    STATUS_OK the ids are not read); scratch int32 ``rows_hist`` [chunks * 2F] and
    ``rows_local`` [T*K]. Outputs int32: ``row_map`` [T, F] (row of token t in rank j's
    message, -1 when t does not go to j), ``shared_rank`` [T] (rank running t's shared
    experts, -1 without), ``num_rows`` [F], ``shared_rows`` [F]. Same values as
    ``dedup_reference.plan_reference``. Safe in CUDA graph capture. Grid: :func:`dedup_rows_grid`.
    """
    num_tokens = checks.count("num_tokens", num_tokens)
    top_k = checks.count("top_k", top_k, low=1, high=MAX_TOP_K)
    num_ffn = checks.count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)
    num_partials = int(num_tokens) * int(top_k)
    args = {"topk_ids": checks.device_array("topk_ids", topk_ids, np.int32, num_partials),
            "num_tokens": num_tokens, "top_k": top_k,
            "expert_per_rank": checks.count("expert_per_rank", expert_per_rank, low=1),
            "num_ffn_ranks": num_ffn, "has_shared": checks.count("has_shared", has_shared, high=1),
            "verdict": checks.device_array("verdict", verdict, np.int32, 1),
            "rows_hist": checks.device_array("rows_hist", rows_hist, np.int32,
                                dispatch_num_chunks(num_partials) * 2 * int(num_ffn)),
            "rows_local": checks.device_array("rows_local", rows_local, np.int32, num_partials),
            "row_map": checks.device_array("row_map", row_map, np.int32, int(num_tokens) * int(num_ffn)),
            "shared_rank": checks.device_array("shared_rank", shared_rank, np.int32, int(num_tokens)),
            "num_rows": checks.device_array("num_rows", num_rows, np.int32, int(num_ffn)),
            "shared_rows": checks.device_array("shared_rows", shared_rows, np.int32, int(num_ffn)),
            "done_counter": checks.device_array("done_counter", done_counter, np.uint32, 1)}
    return launch_spec(loader.get_kernel("attention/dedup_attn.cu", "afd_dedup_rows"),
                 dedup_rows_grid(int(num_tokens), int(top_k)), KERNEL_LIMITS["PLAN_THREADS"], args)


def dedup_rows_grid(num_tokens: int, top_k: int) -> int:
    """Blocks of afd_dedup_rows: one per CHUNK partials, at least 1 (as the plan)."""
    return plan_grid(num_tokens * top_k)


def dedup_dispatch_head_args(*, hidden, num_tokens, hidden_size, topk_ids, topk_weights, top_k,
                             expert_per_rank, num_ffn_ranks) -> dict:
    """The leading arguments of afd_dedup_scatter and afd_dedup_dispatch_fused (hidden ..
    num_ffn_ranks, in their kernel order), checked."""
    num_tokens = checks.count("num_tokens", num_tokens)
    top_k = checks.count("top_k", top_k, low=1, high=MAX_TOP_K)
    num_partials = int(num_tokens) * int(top_k)
    return {"hidden": checks.address("hidden", hidden, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "topk_ids": checks.device_array("topk_ids", topk_ids, np.int32, num_partials),
            "topk_weights": checks.device_array("topk_weights", topk_weights, np.float32, num_partials),
            "top_k": top_k, "expert_per_rank": checks.count("expert_per_rank", expert_per_rank, low=1),
            "num_ffn_ranks": checks.count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)}


def dedup_dispatch_tail_args(*, row_map, shared_rank, num_rows, shared_rows, peer_windows, staging,
                             geo, ring, always_send, src_rank, layer_idx, stage_idx, hdr_flags,
                             seq_counters, expected, expected_counts, done_counter, num_tokens,
                             num_ffn, epr) -> dict:
    """The rows' and publishing arguments of afd_dedup_scatter and afd_dedup_dispatch_fused
    (row_map .. done_counter, in their kernel order), checked against a dedup layout of ``epr``
    experts per rank."""
    geo = checks.geometry("geo", geo, header_words=wire.HDR_FIXED_WORDS + int(epr) + 1)
    return {"row_map": checks.device_array("row_map", row_map, np.int32, num_tokens * num_ffn),
            "shared_rank": checks.device_array("shared_rank", shared_rank, np.int32, num_tokens),
            "num_rows": checks.device_array("num_rows", num_rows, np.int32, num_ffn),
            "shared_rows": checks.device_array("shared_rows", shared_rows, np.int32, num_ffn),
            **slot_args(peer_windows=peer_windows, staging=staging, geo=geo, ring=ring, num_ffn=num_ffn),
            "always_send": checks.count("always_send", always_send, high=1),
            **publish_args(geo=geo, src_rank=src_rank, layer_idx=layer_idx, stage_idx=stage_idx,
                            hdr_flags=hdr_flags, seq_counters=seq_counters, expected=expected,
                            expected_counts=expected_counts, count_columns=3,
                            done_counter=done_counter, num_ffn=num_ffn)}


def dedup_scatter_spec(*, dtype_code, hidden, num_tokens, hidden_size, topk_ids, topk_weights,
                       top_k, expert_per_rank, num_ffn_ranks, chunk_hist, local_rank,
                       expert_start, rank_offsets, expert_counts, verdict, row_map, shared_rank,
                       num_rows, shared_rows, peer_windows, geo, ring, src_rank, layer_idx,
                       stage_idx, seq_counters, expected, expected_counts, done_counter,
                       hdr_flags=0, always_send=0, staging=0, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Write every FFN rank's dedup message, flags last (afd_dedup_scatter<DT>).

    ``hidden``: payload [T, H] row-major; ``topk_weights`` float32 [T*K] (read here: they
    travel in the route tables); plan arrays and ``verdict`` from :func:`dispatch_plan_spec`,
    ``row_map`` .. ``shared_rows`` from :func:`dedup_rows_spec`; ``geo`` of a dedup layout
    (``header_words`` = HDR_FIXED_WORDS + epr + 1). Into slot (``src_rank``, ``ring``) of each
    rank j with rows: route-table rows [R_j, 2 + 2K] and payload rows [R_j, H]
    (``dedup_reference.scatter_reference``), the header (``wire.dispatch_header(...,
    wire_mode="dedup")``; flags = ``hdr_flags | FLAG_DEDUP``), the flag. A 0 entry of
    ``peer_windows`` marks a rank reached by puts: its message and flag go to slot (region =
    that rank, ``ring``) of ``staging`` (as :func:`dispatch_scatter_spec`). Outputs ``expected``
    int64 [F] (seq sent, 0 = not sent) and ``expected_counts`` int32 [F, 3] = (routed, shared,
    rows) per rank, what :func:`wait_replies_spec` (``dedup=1``) checks. If the verdict is
    not STATUS_OK nothing is written to any peer and ``expected`` is all 0.
    Grid: :func:`dedup_scatter_grid`.
    """
    head = dedup_dispatch_head_args(hidden=hidden, num_tokens=num_tokens, hidden_size=hidden_size,
                                    topk_ids=topk_ids, topk_weights=topk_weights, top_k=top_k,
                                    expert_per_rank=expert_per_rank, num_ffn_ranks=num_ffn_ranks)
    num_tokens, top_k = head["num_tokens"], head["top_k"]
    num_ffn, epr = int(head["num_ffn_ranks"]), int(head["expert_per_rank"])
    num_experts, num_partials = num_ffn * epr, int(num_tokens) * int(top_k)
    args = {**head,
            "chunk_hist": checks.device_array("chunk_hist", chunk_hist, np.int32,
                                 dispatch_num_chunks(num_partials) * num_experts),
            "local_rank": checks.device_array("local_rank", local_rank, np.int32, num_partials),
            "expert_start": checks.device_array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": checks.device_array("rank_offsets", rank_offsets, np.int32, num_ffn + 1),
            "expert_counts": checks.device_array("expert_counts", expert_counts, np.int32, num_experts),
            "verdict": checks.device_array("verdict", verdict, np.int32, 1),
            **dedup_dispatch_tail_args(
                row_map=row_map, shared_rank=shared_rank, num_rows=num_rows,
                shared_rows=shared_rows, peer_windows=peer_windows, staging=staging, geo=geo,
                ring=ring, always_send=always_send, src_rank=src_rank, layer_idx=layer_idx,
                stage_idx=stage_idx, hdr_flags=hdr_flags, seq_counters=seq_counters,
                expected=expected, expected_counts=expected_counts, done_counter=done_counter,
                num_tokens=int(num_tokens), num_ffn=num_ffn, epr=epr)}
    kernel = loader.get_kernel("attention/dedup_attn.cu", "afd_dedup_scatter", dtype_code=checks.dtype_code(dtype_code))
    grid = dedup_scatter_grid(int(num_tokens), int(num_ffn), payload_row_bytes(hidden_size, dtype_code),
                              max_blocks)
    return launch_spec(kernel, grid, KERNEL_LIMITS["SCATTER_THREADS"], args)


def dedup_scatter_grid(num_tokens: int, num_ffn_ranks: int, row_bytes: int = 0,
                       max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_dedup_scatter: one warp per (token, FFN rank) cell and part of its row
    (:func:`row_parts`; ``row_bytes`` = hidden size x payload itemsize), at least 1."""
    return row_grid(num_tokens * num_ffn_ranks * row_parts(row_bytes), max_blocks)


def dedup_fused_shared_bytes(num_tokens: int, top_k: int, num_experts: int,
                             num_ffn_ranks: int) -> int:
    """Dynamic shared memory of afd_dedup_dispatch_fused: ids, staging rows and row ranks per
    partial (each padded to 4), counts and starts per expert, the shared-expert rank per token
    (padded to 4), then one 16-bit count per warp (ROWS_PER_BLOCK of them) and expert or row
    key (2 per FFN rank): 4 * (3 * round_up(T*K, 4) + 6 * E + 8 * F + round_up(T, 4))."""
    partials4 = (int(num_tokens) * int(top_k) + 3) // 4 * 4
    warp_cols = ROWS_PER_BLOCK * (int(num_experts) + 2 * int(num_ffn_ranks))
    return (4 * (3 * partials4 + 2 * int(num_experts) + (int(num_tokens) + 3) // 4 * 4)
            + 2 * warp_cols)


#: afd_dedup_dispatch_fused's dynamic shared memory at most (its static arrays take ~8 KiB of
#: the 48 KiB a block gets without an opt-in)
DEDUP_FUSED_MAX_SHARED_BYTES = 32 * 1024


def fused_dedup_dispatch_fits(num_tokens: int, top_k: int, num_experts: int,
                              num_ffn_ranks: int) -> bool:
    """Whether a dedup dispatch of up to ``num_tokens`` tokens can run as the one-kernel
    afd_dedup_dispatch_fused (e.g. T = 128, K = 8 at E <= 816 with F = 8, E <= 830 with F = 1;
    T = 256, K = 8 at E <= 288 with F = 8, E <= 297 with F = 1)."""
    return (dedup_fused_shared_bytes(num_tokens, top_k, num_experts, num_ffn_ranks)
            <= DEDUP_FUSED_MAX_SHARED_BYTES)


def dedup_dispatch_fused_spec(*, dtype_code, hidden, num_tokens, hidden_size, topk_ids,
                              topk_weights, top_k, expert_per_rank, num_ffn_ranks, routed_cap,
                              has_shared, expert_counts, expert_start, rank_offsets, verdict,
                              skipped, row_map, shared_rank, num_rows, shared_rows, peer_windows,
                              geo, ring, src_rank, layer_idx, stage_idx, seq_counters, expected,
                              expected_counts, done_counter, status, hdr_flags=0, always_send=0,
                              staging=0, max_tokens=None, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Plan, rows and scatter of one dedup-mode dispatch in ONE kernel
    (afd_dedup_dispatch_fused<DT>): the same window contents, ``row_map``, ``shared_rank``,
    ``num_rows``, ``shared_rows``, ``expected``, ``expected_counts`` [F, 3] and ``seq_counters``
    as :func:`dispatch_plan_spec` + :func:`dedup_rows_spec` + :func:`dedup_scatter_spec`, and the
    same latched errors (BAD_EXPERT, CAPACITY; an error latched earlier in ``status``: nothing
    sent). Block 0 also writes the plan's ``expert_counts`` / ``expert_start`` int32 [E],
    ``rank_offsets`` int32 [F+1] and ``verdict`` int32 [1]. ``skipped`` int32 [1] scratch, zero
    between dispatches. ``topk_weights`` float32 [T*K] travel in the route tables. The dynamic
    shared memory is sized for ``max_tokens`` (default ``num_tokens``; the largest a later launch
    of this packed spec may use): at most :data:`DEDUP_FUSED_MAX_SHARED_BYTES`
    (:func:`fused_dedup_dispatch_fits`). Grid: :func:`dedup_scatter_grid`.
    """
    head = dedup_dispatch_head_args(hidden=hidden, num_tokens=num_tokens, hidden_size=hidden_size,
                                    topk_ids=topk_ids, topk_weights=topk_weights, top_k=top_k,
                                    expert_per_rank=expert_per_rank, num_ffn_ranks=num_ffn_ranks)
    num_tokens, top_k = head["num_tokens"], head["top_k"]
    num_ffn, epr = head["num_ffn_ranks"], int(head["expert_per_rank"])
    num_experts = int(num_ffn) * epr
    max_tokens = int(num_tokens) if max_tokens is None else int(max_tokens)
    if max_tokens < int(num_tokens):
        raise ValueError(f"max_tokens={max_tokens} < num_tokens={int(num_tokens)}")
    shared_bytes = dedup_fused_shared_bytes(max_tokens, int(top_k), num_experts, int(num_ffn))
    if shared_bytes > DEDUP_FUSED_MAX_SHARED_BYTES:
        raise ValueError(f"afd_dedup_dispatch_fused needs {shared_bytes} B of shared memory for "
                         f"{max_tokens} tokens, top-{int(top_k)}, {num_experts} experts and "
                         f"{int(num_ffn)} FFN ranks, more than {DEDUP_FUSED_MAX_SHARED_BYTES}: "
                         f"use the plan, rows and scatter kernels")
    args = {**head, "routed_cap": checks.count("routed_cap", routed_cap),
            "has_shared": checks.count("has_shared", has_shared, high=1),
            "expert_counts": checks.device_array("expert_counts", expert_counts, np.int32, num_experts),
            "expert_start": checks.device_array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": checks.device_array("rank_offsets", rank_offsets, np.int32, int(num_ffn) + 1),
            "verdict": checks.device_array("verdict", verdict, np.int32, 1),
            "skipped": checks.device_array("skipped", skipped, np.int32, 1),
            **dedup_dispatch_tail_args(
                row_map=row_map, shared_rank=shared_rank, num_rows=num_rows,
                shared_rows=shared_rows, peer_windows=peer_windows, staging=staging, geo=geo,
                ring=ring, always_send=always_send, src_rank=src_rank, layer_idx=layer_idx,
                stage_idx=stage_idx, hdr_flags=hdr_flags, seq_counters=seq_counters,
                expected=expected, expected_counts=expected_counts, done_counter=done_counter,
                num_tokens=int(num_tokens), num_ffn=int(num_ffn), epr=epr),
            "status": checks.address("status", status)}
    kernel = loader.get_kernel("attention/dedup_attn_fused.cu", "afd_dedup_dispatch_fused", dtype_code=checks.dtype_code(dtype_code))
    grid = dedup_scatter_grid(int(num_tokens), int(num_ffn), payload_row_bytes(hidden_size, dtype_code),
                              max_blocks)
    return launch_spec(kernel, grid, KERNEL_LIMITS["SCATTER_THREADS"], args, shared_mem=shared_bytes)


def dedup_combine_spec(*, dtype_code, out, num_tokens, hidden_size, row_map, window, geo,
                       num_ffn_ranks, ring, expected, expected_counts, layer_idx, stage_idx,
                       last_seen, reply_flags, timeout_ns, out_scale, done_counter, status,
                       max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Wait for and check the dedup replies (as :func:`wait_replies_spec` with ``dedup=1``), then
    combine (afd_dedup_combine<DT>).

    ``out``: payload [T, H]; ``row_map`` int32 [T, F] (:func:`dedup_rows_spec`'s, of the same
    dispatch); ``window``: this rank's own window (rank j's reply rows in region j's
    ``routed_x``); ``expected_counts`` int32 [F, 3]. ``out[t] = out_scale * sum over j
    ascending with row_map[t, j] >= 0 of reply_j[row_map[t, j]]`` in fp32, rounded once
    (``dedup_reference.combine_reference``); ``last_seen`` is set from ``reply_flags`` on
    success. Bounded by ``timeout_ns``; on an error the output rows are NaN.
    Grid: :func:`combine_grid`.
    """
    num_tokens = checks.count("num_tokens", num_tokens)
    geo = checks.geometry("geo", geo)
    wait = reply_wait_args(window=window, geo=geo, num_ffn_ranks=num_ffn_ranks, ring=ring,
                            expected=expected, expected_counts=expected_counts,
                            layer_idx=layer_idx, stage_idx=stage_idx, last_seen=last_seen,
                            reply_flags=reply_flags, dedup=True)
    if int(wait["num_ffn_ranks"]) > MAX_FFN_RANKS:
        raise ValueError(f"num_ffn_ranks must be <= {MAX_FFN_RANKS}, got {int(wait['num_ffn_ranks'])}")
    args = {"out": checks.address("out", out, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "row_map": checks.device_array("row_map", row_map, np.int32,
                              int(num_tokens) * int(wait["num_ffn_ranks"])), **wait}
    args.update(timeout_ns=checks.int64("timeout_ns", timeout_ns, low=0), out_scale=np.float32(out_scale),
                done_counter=checks.device_array("done_counter", done_counter, np.uint32, 1),
                status=checks.address("status", status))
    kernel = loader.get_kernel("attention/dedup_attn.cu", "afd_dedup_combine", dtype_code=checks.dtype_code(dtype_code))
    grid = combine_grid(int(num_tokens), payload_row_bytes(int(args["hidden_size"]), dtype_code), max_blocks)
    return launch_spec(kernel, grid, KERNEL_LIMITS["COMBINE_THREADS"], args)
