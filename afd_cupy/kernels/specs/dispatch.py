"""Spec builders of ``raw_kernels/attention/dispatch.cu``: the Attention side's pair-mode dispatch.

afd_dispatch_plan (the device routing plan), afd_dispatch_scatter (rows into the FFN ranks'
windows, then the headers and flags), afd_dispatch_fused (plan and scatter in one kernel
when the plan fits a block's shared memory) and afd_own_routing (the caller's routing into the
ring's own buffers), with their grids and afd_own_routing's numpy reference.
"""
from __future__ import annotations

import numpy as np

from afd_cupy import wire
from afd_cupy.kernels import checks, loader
from afd_cupy.kernels.loader import DTYPE_CODES
from afd_cupy.kernels.launches import LaunchSpec, launch_spec
from afd_cupy.kernels.specs.limits import (CHUNK, KERNEL_LIMITS, MAX_BLOCKS, MAX_EXPERTS,
                                           MAX_FFN_RANKS, few_row_parts, payload_row_bytes, row_grid)
from afd_cupy.kernels.specs.groups import publish_args, slot_args


def dispatch_num_chunks(num_partials: int) -> int:
    """Blocks (chunks of CHUNK partials) of afd_dispatch_plan for ``num_partials``; 0 for 0."""
    return -(-int(num_partials) // CHUNK)


def dispatch_plan_spec(*, topk_ids, num_partials, num_ffn_ranks, expert_per_rank, routed_cap,
                       layer_idx, chunk_hist, local_rank, expert_counts, expert_start, rank_offsets,
                       verdict, done_counter, status) -> LaunchSpec:
    """Device routing plan of ``num_partials = T * K`` flat partials (afd_dispatch_plan).

    ``topk_ids`` int32 [NK] (flat ``t*K+k``); scratch int32 ``chunk_hist`` [chunks, E] (after:
    per-chunk bases), ``local_rank`` [NK]; outputs int32 ``expert_counts``/``expert_start`` [E],
    ``rank_offsets`` [F+1] and ``verdict`` [1]: STATUS_OK, or the status code that stops this
    dispatch (the scatter reads only this word). Latches STATUS_CAPACITY (peer, count, cap) if a
    rank gets more than ``routed_cap`` partials, STATUS_BAD_EXPERT on an id outside [0, E), in
    the status block ``status``, with ``layer_idx`` (ST_LAYER). Safe in CUDA graph capture. Grid: :func:`plan_grid`.
    """
    num_partials = checks.count("num_partials", num_partials)
    num_ffn = checks.count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)
    epr = checks.count("expert_per_rank", expert_per_rank, low=1)
    num_experts = int(num_ffn) * int(epr)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_ffn_ranks * expert_per_rank = {num_experts} > {MAX_EXPERTS}")
    num_chunks = dispatch_num_chunks(num_partials)
    args = {"topk_ids": checks.device_array("topk_ids", topk_ids, np.int32, num_partials),
            "num_partials": num_partials, "num_experts": np.int32(num_experts),
            "expert_per_rank": epr, "num_ffn_ranks": num_ffn,
            "routed_cap": checks.count("routed_cap", routed_cap),
            "layer_idx": np.int32(layer_idx),
            "chunk_hist": checks.device_array("chunk_hist", chunk_hist, np.int32, num_chunks * num_experts),
            "local_rank": checks.device_array("local_rank", local_rank, np.int32, num_partials),
            "expert_counts": checks.device_array("expert_counts", expert_counts, np.int32, num_experts),
            "expert_start": checks.device_array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": checks.device_array("rank_offsets", rank_offsets, np.int32, int(num_ffn) + 1),
            "verdict": checks.device_array("verdict", verdict, np.int32, 1),
            "done_counter": checks.device_array("done_counter", done_counter, np.uint32, 1),
            "status": checks.address("status", status)}
    return launch_spec(loader.get_kernel("attention/dispatch.cu", "afd_dispatch_plan"), plan_grid(num_partials),
                 KERNEL_LIMITS["PLAN_THREADS"], args, shared_mem=4 * num_experts)


def plan_grid(num_partials: int) -> int:
    """Blocks of afd_dispatch_plan: one per CHUNK partials, at least 1."""
    return max(1, dispatch_num_chunks(num_partials))


def _pair_dispatch_head(*, hidden, num_tokens, hidden_size, topk_ids, num_partials, top_k,
                        expert_per_rank, num_ffn_ranks) -> dict:
    """The first, checked arguments of afd_dispatch_scatter and afd_dispatch_fused (hidden ..
    num_ffn_ranks, in their kernel order); num_partials must be num_tokens * top_k."""
    num_partials = checks.count("num_partials", num_partials)
    num_tokens = checks.count("num_tokens", num_tokens)
    top_k = checks.count("top_k", top_k, low=1)
    if int(num_partials) != int(num_tokens) * int(top_k):
        raise ValueError(f"num_partials={num_partials} != num_tokens * top_k = "
                         f"{num_tokens} * {top_k}")
    return {"hidden": checks.address("hidden", hidden, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": checks.count("hidden_size", hidden_size, low=1),
            "topk_ids": checks.device_array("topk_ids", topk_ids, np.int32, num_partials),
            "num_partials": num_partials, "top_k": top_k,
            "expert_per_rank": checks.count("expert_per_rank", expert_per_rank, low=1),
            "num_ffn_ranks": checks.count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)}


def dispatch_row_bytes(hidden_size, dtype_code, hdr_flags) -> int:
    """Bytes of one dispatched row of afd_dispatch_scatter / afd_dispatch_fused: an FP8 wire row
    (``wire.fp8_row_bytes``) when ``hdr_flags`` carry ``wire.FLAG_FP8``, else a payload row.
    ValueError when FP8 rows cannot be made: a float32 payload or ``hidden_size % 128 != 0``."""
    if not int(hdr_flags) & wire.FLAG_FP8:
        return payload_row_bytes(hidden_size, dtype_code)
    if checks.dtype_code(dtype_code) == DTYPE_CODES["float32"] or int(hidden_size) % wire.FP8_GROUP:
        raise ValueError(f"hdr_flags=0x{int(hdr_flags):x} (FLAG_FP8) needs a bf16/fp16 dtype_code and "
                         f"hidden_size % {wire.FP8_GROUP} == 0, got dtype_code={dtype_code}, "
                         f"hidden_size={hidden_size}")
    return wire.fp8_row_bytes(int(hidden_size))


def _pair_dispatch_tail(*, peer_windows, staging, geo, ring, has_shared, always_send, pos_out,
                        src_rank, layer_idx, stage_idx, hdr_flags, seq_counters, expected,
                        expected_counts, done_counter, num_partials, num_ffn, epr) -> dict:
    """The publishing arguments of afd_dispatch_scatter and afd_dispatch_fused (peer_windows ..
    done_counter, in their kernel order), checked against a pair layout of ``epr`` experts per
    rank."""
    geo = checks.geometry("geo", geo, header_words=wire.HDR_FIXED_WORDS + int(epr))
    return {**slot_args(peer_windows=peer_windows, staging=staging, geo=geo, ring=ring, num_ffn=num_ffn),
            "has_shared": checks.count("has_shared", has_shared, high=1),
            "always_send": checks.count("always_send", always_send, high=1),
            "pos_out": checks.device_array("pos_out", pos_out, np.int32, num_partials),
            **publish_args(geo=geo, src_rank=src_rank, layer_idx=layer_idx, stage_idx=stage_idx,
                            hdr_flags=hdr_flags, seq_counters=seq_counters, expected=expected,
                            expected_counts=expected_counts, count_columns=2,
                            done_counter=done_counter, num_ffn=num_ffn)}


def dispatch_scatter_spec(*, dtype_code, hidden, num_tokens, hidden_size, topk_ids, num_partials,
                          top_k, expert_per_rank, num_ffn_ranks, chunk_hist, local_rank,
                          expert_start, rank_offsets, expert_counts, verdict, peer_windows, geo,
                          ring, has_shared, pos_out, src_rank, layer_idx, stage_idx, hdr_flags,
                          seq_counters, expected, expected_counts, done_counter, always_send=0,
                          staging=0, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Write every non-empty FFN rank's message, flags last (afd_dispatch_scatter<DT>).

    ``hidden``: payload [T, H] row-major; plan arrays and ``verdict`` from
    :func:`dispatch_plan_spec`; ``peer_windows`` uint64 [F] (device) base address of each FFN
    rank's window as mapped here; the message goes to slot (region = ``src_rank``, ``ring``).
    A 0 entry marks an FFN rank reached by puts (docs/design/put-transport.md): its message and flag go
    to slot (region = that rank, ``ring``) of ``staging`` (this rank's symmetric put staging,
    required non-zero then), and the host puts them.
    Outputs: ``pos_out`` int32 [NK] (row of each partial in its destination's segment),
    ``expected`` int64 [F] (seq sent to each rank, 0 = not sent), ``expected_counts`` int32
    [F, 2] (routed, shared rows sent: what the reply must echo); ``seq_counters`` int64 [F]
    (this ring's row) is incremented for non-empty ranks only, or for every rank when
    ``always_send`` is 1 (header-only messages to empty ranks, for lockstep). If the verdict is
    not STATUS_OK nothing is written to any peer and ``expected`` is all 0.
    ``hdr_flags`` with ``wire.FLAG_FP8``: the rows are quantized into FP8 wire rows
    (:func:`dispatch_row_bytes` each; reference ``wire.fp8.quantize_wire_rows``).
    Grid: :func:`scatter_grid`.
    """
    head = _pair_dispatch_head(hidden=hidden, num_tokens=num_tokens, hidden_size=hidden_size,
                               topk_ids=topk_ids, num_partials=num_partials, top_k=top_k,
                               expert_per_rank=expert_per_rank, num_ffn_ranks=num_ffn_ranks)
    num_tokens, num_partials, top_k = head["num_tokens"], head["num_partials"], head["top_k"]
    num_ffn, epr = int(head["num_ffn_ranks"]), int(head["expert_per_rank"])
    num_experts = num_ffn * epr
    dispatch_row_bytes(hidden_size, dtype_code, hdr_flags)  # ValueError: no FP8 rows possible
    tail = _pair_dispatch_tail(
        peer_windows=peer_windows, staging=staging, geo=geo, ring=ring, has_shared=has_shared,
        always_send=always_send, pos_out=pos_out, src_rank=src_rank, layer_idx=layer_idx,
        stage_idx=stage_idx, hdr_flags=hdr_flags, seq_counters=seq_counters, expected=expected,
        expected_counts=expected_counts, done_counter=done_counter, num_partials=num_partials,
        num_ffn=num_ffn, epr=epr)
    args = {**head,
            "chunk_hist": checks.device_array("chunk_hist", chunk_hist, np.int32,
                                 dispatch_num_chunks(num_partials) * num_experts),
            "local_rank": checks.device_array("local_rank", local_rank, np.int32, num_partials),
            "expert_start": checks.device_array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": checks.device_array("rank_offsets", rank_offsets, np.int32, num_ffn + 1),
            "expert_counts": checks.device_array("expert_counts", expert_counts, np.int32, num_experts),
            "verdict": checks.device_array("verdict", verdict, np.int32, 1), **tail}
    kernel = loader.get_kernel("attention/dispatch.cu", "afd_dispatch_scatter", dtype_code=checks.dtype_code(dtype_code))
    return launch_spec(kernel, scatter_grid(int(num_tokens), int(top_k), int(args["has_shared"]), max_blocks),
                 KERNEL_LIMITS["SCATTER_THREADS"], args)


#: afd_dispatch_fused plans in every block's shared memory: 4 B per partial and 8 B per expert
#: of dynamic shared memory, at most this much (the static arrays take ~5 KiB of the 48 KiB a
#: block gets without an opt-in). Beyond it the dispatch takes the two kernels.
FUSED_MAX_SHARED_BYTES = 40 * 1024


def fused_shared_bytes(num_partials: int, num_experts: int) -> int:
    """Dynamic shared memory of afd_dispatch_fused: ids (padded to 4) + counts + starts."""
    return 4 * ((int(num_partials) + 3) // 4 * 4 + 2 * int(num_experts))


def fused_dispatch_fits(num_partials: int, num_experts: int) -> bool:
    """Whether a dispatch of up to ``num_partials`` partials over ``num_experts`` experts can run
    as the one-kernel afd_dispatch_fused."""
    return fused_shared_bytes(num_partials, num_experts) <= FUSED_MAX_SHARED_BYTES


def dispatch_fused_spec(*, dtype_code, hidden, num_tokens, hidden_size, topk_ids, num_partials,
                        top_k, expert_per_rank, num_ffn_ranks, routed_cap, expert_counts,
                        expert_start, rank_offsets, verdict, skipped, peer_windows, geo, ring,
                        has_shared, pos_out, src_rank, layer_idx, stage_idx, hdr_flags,
                        seq_counters, expected, expected_counts, done_counter, status,
                        always_send=0, staging=0, max_partials=None,
                        max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Plan and scatter of one pair-mode dispatch in ONE kernel (afd_dispatch_fused<DT>): the
    same wire order, window contents, ``pos_out``, ``expected``, ``expected_counts`` and
    ``seq_counters`` as :func:`dispatch_plan_spec` + :func:`dispatch_scatter_spec`, and the
    same latched errors (BAD_EXPERT with the lowest bad index, CAPACITY with the lowest
    over-full rank; an error latched earlier in ``status``: nothing sent). Block 0 also writes
    the plan's ``expert_counts`` / ``expert_start`` int32 [E], ``rank_offsets`` int32 [F+1] and
    ``verdict`` int32 [1] (block 0's view). ``skipped`` uint32-sized int32 [1] scratch, zero
    between dispatches (the kernel leaves it zero). The dynamic shared memory is sized for
    ``max_partials`` (default ``num_partials``; the largest a later launch of this packed spec
    may use): at most :data:`FUSED_MAX_SHARED_BYTES` (:func:`fused_dispatch_fits`).
    ``hdr_flags`` with ``wire.FLAG_FP8``: FP8 wire rows, as :func:`dispatch_scatter_spec`.
    Grid: :func:`scatter_grid` with ``row_bytes`` = :func:`dispatch_row_bytes`.
    """
    head = _pair_dispatch_head(hidden=hidden, num_tokens=num_tokens, hidden_size=hidden_size,
                               topk_ids=topk_ids, num_partials=num_partials, top_k=top_k,
                               expert_per_rank=expert_per_rank, num_ffn_ranks=num_ffn_ranks)
    num_tokens, num_partials, top_k = head["num_tokens"], head["num_partials"], head["top_k"]
    num_ffn, epr = int(head["num_ffn_ranks"]), int(head["expert_per_rank"])
    num_experts = num_ffn * epr
    row_bytes = dispatch_row_bytes(hidden_size, dtype_code, hdr_flags)
    max_partials = int(num_partials) if max_partials is None else int(max_partials)
    if max_partials < int(num_partials):
        raise ValueError(f"max_partials={max_partials} < num_partials={int(num_partials)}")
    if not fused_dispatch_fits(max_partials, num_experts):
        raise ValueError(f"afd_dispatch_fused needs {fused_shared_bytes(max_partials, num_experts)} B "
                         f"of shared memory for {max_partials} partials and {num_experts} experts, "
                         f"more than {FUSED_MAX_SHARED_BYTES}: use the plan and scatter kernels")
    tail = _pair_dispatch_tail(
        peer_windows=peer_windows, staging=staging, geo=geo, ring=ring, has_shared=has_shared,
        always_send=always_send, pos_out=pos_out, src_rank=src_rank, layer_idx=layer_idx,
        stage_idx=stage_idx, hdr_flags=hdr_flags, seq_counters=seq_counters, expected=expected,
        expected_counts=expected_counts, done_counter=done_counter, num_partials=num_partials,
        num_ffn=num_ffn, epr=epr)
    args = {**head, "routed_cap": checks.count("routed_cap", routed_cap),
            "expert_counts": checks.device_array("expert_counts", expert_counts, np.int32, num_experts),
            "expert_start": checks.device_array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": checks.device_array("rank_offsets", rank_offsets, np.int32, num_ffn + 1),
            "verdict": checks.device_array("verdict", verdict, np.int32, 1),
            "skipped": checks.device_array("skipped", skipped, np.int32, 1),
            **tail, "status": checks.address("status", status)}
    kernel = loader.get_kernel("attention/dispatch.cu", "afd_dispatch_fused", dtype_code=checks.dtype_code(dtype_code))
    return launch_spec(kernel, scatter_grid(int(num_tokens), int(top_k), int(args["has_shared"]), max_blocks,
                                            row_bytes=row_bytes),
                 KERNEL_LIMITS["SCATTER_THREADS"], args,
                 shared_mem=fused_shared_bytes(max_partials, num_experts))


def scatter_grid(num_tokens: int, top_k: int, has_shared: int, max_blocks: int = MAX_BLOCKS,
                 row_bytes: int = 0) -> int:
    """Blocks of afd_dispatch_scatter (``row_bytes`` 0: one warp per routed partial and per
    shared row) and of afd_dispatch_fused (``row_bytes``: one warp per part of such a row,
    :func:`~afd_cupy.kernels.specs.limits.few_row_parts`)."""
    rows = num_tokens * top_k + (num_tokens if has_shared else 0)
    return row_grid(rows * (few_row_parts(row_bytes, rows) if row_bytes else 1), max_blocks)


def own_routing_grid(num_partials: int) -> int:
    """Blocks of afd_own_routing: a thread per partial, at least 1, at most MAX_BLOCKS (the
    blocks stride)."""
    return max(1, min(dispatch_num_chunks(num_partials), MAX_BLOCKS))


def own_routing_spec(*, weights_dtype_code, ids, ids_int64, mask, num_experts, weights, num_partials,
                     ids_out, weights_out) -> LaunchSpec:
    """The caller's routing into a ring's own buffers (afd_own_routing<DT>, DT = the weights'
    dtype code).

    ``ids``: address of int32 [NK] (int64 with ``ids_int64`` = 1); ``weights``: address of
    [NK] in ``weights_dtype_code``'s dtype (bf16, fp16 or fp32); ``ids_out`` int32 [NK] and
    ``weights_out`` float32 [NK] (cupy). ``ids_out[i]`` is ``ids[i]`` as int32, -1 when
    ``mask`` and the id lies outside [0, ``num_experts``); ``weights_out[i]`` the weight as
    fp32 (:func:`own_routing_reference`). Safe in CUDA graph capture. Grid:
    :func:`own_routing_grid`.
    """
    num_partials = checks.count("num_partials", num_partials)
    args = {"ids": checks.address("ids", ids, allow_null=num_partials == 0),
            "ids_int64": checks.count("ids_int64", ids_int64, high=1),
            "mask": checks.count("mask", mask, high=1),
            "num_experts": checks.count("num_experts", num_experts, low=1, high=MAX_EXPERTS),
            "weights": checks.address("weights", weights, allow_null=num_partials == 0),
            "num_partials": num_partials,
            "ids_out": checks.device_array("ids_out", ids_out, np.int32, num_partials),
            "weights_out": checks.device_array("weights_out", weights_out, np.float32, num_partials)}
    kernel = loader.get_kernel("attention/routing.cu", "afd_own_routing",
                               dtype_code=checks.dtype_code(weights_dtype_code))
    return launch_spec(kernel, own_routing_grid(num_partials), KERNEL_LIMITS["PLAN_THREADS"], args)


def own_routing_reference(ids, weights, *, mask: bool, num_experts: int) -> tuple:
    """numpy twin of afd_own_routing: (int32 ids, float32 weights), both flat. ``ids`` int32 or
    int64; ``mask``: ids outside [0, num_experts) become -1 (the kernel masks int64 ids always
    in the cuda backend's use); ``weights``: float values (bf16 decoded to float32 by the
    caller)."""
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    if mask:
        ids = np.where((ids < 0) | (ids >= num_experts), -1, ids)
    return ids.astype(np.int32), np.asarray(weights, np.float32).reshape(-1)
