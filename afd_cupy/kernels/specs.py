"""One spec builder and one grid function per kernel of ``raw_kernels/``.

Every builder takes keyword arguments named exactly like the kernel's C parameters (plus
``dtype_code`` for the payload templates and ``max_blocks``), checks them cheaply (dtype and
size of the arrays, signs of the sizes, the limits below), raises ``ValueError`` naming the
argument and returns a :class:`LaunchSpec`. Raw addresses (windows, peer mappings, pinned host
memory) are ``int``; scratch buffers are CuPy arrays; ``geo`` is
``WindowLayout.kernel_geometry()``. Kernels that use a ``done_counter`` (uint32 [1], zero,
device) leave it at zero again; one counter per kernel in flight.
"""
from __future__ import annotations

import numpy as np

from afd_cupy import wire
from afd_cupy.kernels.launches import (LaunchSpec, _address, _array, _count, _dtype, _geometry,
                                       _i64, _spec)
from afd_cupy.dtypes import PAYLOAD_DTYPES
from afd_cupy.kernels.loader import get_kernel

#: Limits and block sizes compiled into the kernels: the one Python copy of the constants of
#: raw_kernels/wire.cuh (a CPU test parses wire.cuh, the GPU probe reads them back).
KERNEL_LIMITS = {
    "CHUNK": 256,           # partials per afd_dispatch_plan block
    "MAX_BLOCKS": 1024,     # grid cap of the row-copy and combine kernels
    "MAX_FFN_RANKS": 256,   # static shared arrays of afd_dispatch_scatter
    "MAX_TOP_K": 64,        # static shared arrays of afd_combine
    "MAX_EXPERTS": 8192,    # dynamic shared memory of afd_dispatch_plan (4 B per expert)
    "ROWS_PER_BLOCK": 8,    # warps (one row each) of afd_dispatch_scatter and afd_reply
    "PLAN_THREADS": 256,
    "SCATTER_THREADS": 256,
    "WAIT_REPLIES_THREADS": 32,
    "COMBINE_THREADS": 256,
    "WAIT_ANY_THREADS": 32,
    "REPLY_THREADS": 256,
    "GATE_THREADS": 256,        # afd_gate_topk: a warp per token
    "GATE_MAX_EXPERTS": 1024,   # afd_gate_topk: 32 experts per lane, in registers
    "GATE_MAX_TOP_K": 32,       # afd_gate_topk: one lane per chosen expert
}
CHUNK = KERNEL_LIMITS["CHUNK"]
MAX_BLOCKS = KERNEL_LIMITS["MAX_BLOCKS"]
MAX_FFN_RANKS = KERNEL_LIMITS["MAX_FFN_RANKS"]
MAX_TOP_K = KERNEL_LIMITS["MAX_TOP_K"]
MAX_EXPERTS = KERNEL_LIMITS["MAX_EXPERTS"]
ROWS_PER_BLOCK = KERNEL_LIMITS["ROWS_PER_BLOCK"]


def dispatch_num_chunks(num_partials: int) -> int:
    """Blocks (chunks of CHUNK partials) of afd_dispatch_plan for ``num_partials``; 0 for 0."""
    return -(-int(num_partials) // CHUNK)


def _row_bytes(hidden_size, dtype_code) -> int:
    """Bytes of one payload row of ``hidden_size`` elements of kernel dtype ``dtype_code``."""
    code = _dtype(dtype_code)
    return int(hidden_size) * next(d.itemsize for d in PAYLOAD_DTYPES.values() if d.kernel_code == code)


def _row_grid(num_rows: int, max_blocks: int) -> int:
    return max(1, min(-(-num_rows // ROWS_PER_BLOCK), max_blocks))


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
    num_partials = _count("num_partials", num_partials)
    num_ffn = _count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)
    epr = _count("expert_per_rank", expert_per_rank, low=1)
    num_experts = int(num_ffn) * int(epr)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_ffn_ranks * expert_per_rank = {num_experts} > {MAX_EXPERTS}")
    num_chunks = dispatch_num_chunks(num_partials)
    args = {"topk_ids": _array("topk_ids", topk_ids, np.int32, num_partials),
            "num_partials": num_partials, "num_experts": np.int32(num_experts),
            "expert_per_rank": epr, "num_ffn_ranks": num_ffn,
            "routed_cap": _count("routed_cap", routed_cap),
            "layer_idx": np.int32(layer_idx),
            "chunk_hist": _array("chunk_hist", chunk_hist, np.int32, num_chunks * num_experts),
            "local_rank": _array("local_rank", local_rank, np.int32, num_partials),
            "expert_counts": _array("expert_counts", expert_counts, np.int32, num_experts),
            "expert_start": _array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": _array("rank_offsets", rank_offsets, np.int32, int(num_ffn) + 1),
            "verdict": _array("verdict", verdict, np.int32, 1),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1),
            "status": _address("status", status)}
    return _spec(get_kernel("dispatch.cu", "afd_dispatch_plan"), plan_grid(num_partials),
                 KERNEL_LIMITS["PLAN_THREADS"], args, shared_mem=4 * num_experts)


def plan_grid(num_partials: int) -> int:
    """Blocks of afd_dispatch_plan: one per CHUNK partials, at least 1."""
    return max(1, dispatch_num_chunks(num_partials))


def _pair_dispatch_head(*, hidden, num_tokens, hidden_size, topk_ids, num_partials, top_k,
                        expert_per_rank, num_ffn_ranks) -> dict:
    """The first, checked arguments of afd_dispatch_scatter and afd_dispatch_fused (hidden ..
    num_ffn_ranks, in their kernel order); num_partials must be num_tokens * top_k."""
    num_partials = _count("num_partials", num_partials)
    num_tokens = _count("num_tokens", num_tokens)
    top_k = _count("top_k", top_k, low=1)
    if int(num_partials) != int(num_tokens) * int(top_k):
        raise ValueError(f"num_partials={num_partials} != num_tokens * top_k = "
                         f"{num_tokens} * {top_k}")
    return {"hidden": _address("hidden", hidden, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "topk_ids": _array("topk_ids", topk_ids, np.int32, num_partials),
            "num_partials": num_partials, "top_k": top_k,
            "expert_per_rank": _count("expert_per_rank", expert_per_rank, low=1),
            "num_ffn_ranks": _count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)}


def _slot_args(*, peer_windows, staging, geo, ring, num_ffn) -> dict:
    """Where a dispatch writes (peer_windows, staging, geo, ring, in every dispatch kernel's
    order): each FFN rank's window base, the put staging, the checked ``geo``, the ring slot."""
    return {"peer_windows": _array("peer_windows", peer_windows, np.uint64, num_ffn),
            "staging": _address("staging", staging, allow_null=True),
            "geo": geo, "ring": _count("ring", ring, high=int(geo["ring_depth"]) - 1)}


def _publish_args(*, geo, src_rank, layer_idx, stage_idx, hdr_flags, seq_counters, expected,
                  expected_counts, count_columns, done_counter, num_ffn) -> dict:
    """What a dispatch stamps and records (src_rank .. done_counter, in every dispatch kernel's
    order); ``expected_counts`` is [num_ffn, count_columns] (pair 2, dedup 3)."""
    return {"src_rank": _count("src_rank", src_rank, high=int(geo["num_regions"]) - 1),
            "layer_idx": np.int32(layer_idx), "stage_idx": np.int32(stage_idx),
            "hdr_flags": np.int32(hdr_flags),
            "seq_counters": _array("seq_counters", seq_counters, np.int64, num_ffn),
            "expected": _array("expected", expected, np.int64, num_ffn),
            "expected_counts": _array("expected_counts", expected_counts, np.int32,
                                      count_columns * num_ffn),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1)}


def _pair_dispatch_tail(*, peer_windows, staging, geo, ring, has_shared, always_send, pos_out,
                        src_rank, layer_idx, stage_idx, hdr_flags, seq_counters, expected,
                        expected_counts, done_counter, num_partials, num_ffn, epr) -> dict:
    """The publishing arguments of afd_dispatch_scatter and afd_dispatch_fused (peer_windows ..
    done_counter, in their kernel order), checked against a pair layout of ``epr`` experts per
    rank."""
    geo = _geometry("geo", geo, header_words=wire.HDR_FIXED_WORDS + int(epr))
    return {**_slot_args(peer_windows=peer_windows, staging=staging, geo=geo, ring=ring, num_ffn=num_ffn),
            "has_shared": _count("has_shared", has_shared, high=1),
            "always_send": _count("always_send", always_send, high=1),
            "pos_out": _array("pos_out", pos_out, np.int32, num_partials),
            **_publish_args(geo=geo, src_rank=src_rank, layer_idx=layer_idx, stage_idx=stage_idx,
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
    Grid: :func:`scatter_grid`.
    """
    head = _pair_dispatch_head(hidden=hidden, num_tokens=num_tokens, hidden_size=hidden_size,
                               topk_ids=topk_ids, num_partials=num_partials, top_k=top_k,
                               expert_per_rank=expert_per_rank, num_ffn_ranks=num_ffn_ranks)
    num_tokens, num_partials, top_k = head["num_tokens"], head["num_partials"], head["top_k"]
    num_ffn, epr = int(head["num_ffn_ranks"]), int(head["expert_per_rank"])
    num_experts = num_ffn * epr
    tail = _pair_dispatch_tail(
        peer_windows=peer_windows, staging=staging, geo=geo, ring=ring, has_shared=has_shared,
        always_send=always_send, pos_out=pos_out, src_rank=src_rank, layer_idx=layer_idx,
        stage_idx=stage_idx, hdr_flags=hdr_flags, seq_counters=seq_counters, expected=expected,
        expected_counts=expected_counts, done_counter=done_counter, num_partials=num_partials,
        num_ffn=num_ffn, epr=epr)
    args = {**head,
            "chunk_hist": _array("chunk_hist", chunk_hist, np.int32,
                                 dispatch_num_chunks(num_partials) * num_experts),
            "local_rank": _array("local_rank", local_rank, np.int32, num_partials),
            "expert_start": _array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": _array("rank_offsets", rank_offsets, np.int32, num_ffn + 1),
            "expert_counts": _array("expert_counts", expert_counts, np.int32, num_experts),
            "verdict": _array("verdict", verdict, np.int32, 1), **tail}
    kernel = get_kernel("dispatch.cu", "afd_dispatch_scatter", dtype_code=_dtype(dtype_code))
    return _spec(kernel, scatter_grid(int(num_tokens), int(top_k), int(args["has_shared"]), max_blocks),
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
    Grid: :func:`scatter_grid`.
    """
    head = _pair_dispatch_head(hidden=hidden, num_tokens=num_tokens, hidden_size=hidden_size,
                               topk_ids=topk_ids, num_partials=num_partials, top_k=top_k,
                               expert_per_rank=expert_per_rank, num_ffn_ranks=num_ffn_ranks)
    num_tokens, num_partials, top_k = head["num_tokens"], head["num_partials"], head["top_k"]
    num_ffn, epr = int(head["num_ffn_ranks"]), int(head["expert_per_rank"])
    num_experts = num_ffn * epr
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
    args = {**head, "routed_cap": _count("routed_cap", routed_cap),
            "expert_counts": _array("expert_counts", expert_counts, np.int32, num_experts),
            "expert_start": _array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": _array("rank_offsets", rank_offsets, np.int32, num_ffn + 1),
            "verdict": _array("verdict", verdict, np.int32, 1),
            "skipped": _array("skipped", skipped, np.int32, 1),
            **tail, "status": _address("status", status)}
    kernel = get_kernel("dispatch.cu", "afd_dispatch_fused", dtype_code=_dtype(dtype_code))
    return _spec(kernel, scatter_grid(int(num_tokens), int(top_k), int(args["has_shared"]), max_blocks),
                 KERNEL_LIMITS["SCATTER_THREADS"], args,
                 shared_mem=fused_shared_bytes(max_partials, num_experts))


def scatter_grid(num_tokens: int, top_k: int, has_shared: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_dispatch_scatter: one warp per routed partial and per shared row."""
    return _row_grid(num_tokens * top_k + (num_tokens if has_shared else 0), max_blocks)


def _reply_wait_args(*, window, geo, num_ffn_ranks, ring, expected, expected_counts, layer_idx,
                     stage_idx, last_seen, reply_flags, dedup: bool = False) -> dict:
    """Checked arguments shared by afd_wait_replies, afd_combine and afd_dedup_combine, in their
    C order. ``dedup``: ``expected_counts`` has 3 columns (routed, shared, rows), else 2."""
    num_ffn = _count("num_ffn_ranks", num_ffn_ranks, low=1, high=int(geo["num_regions"]))
    if dedup and int(geo["header_words"]) < wire.HDR_FIXED_WORDS + 2:
        raise ValueError(f"geo.header_words = {int(geo['header_words'])} cannot hold a dedup "
                         "header (HDR_FIXED_WORDS + expert_per_rank + num_rows)")
    count_cols = 3 if dedup else 2
    return {"window": _address("window", window), "geo": geo,
            "num_ffn_ranks": num_ffn, "ring": _count("ring", ring, high=int(geo["ring_depth"]) - 1),
            "expected": _array("expected", expected, np.int64, int(num_ffn)),
            "expected_counts": _array("expected_counts", expected_counts, np.int32,
                                      count_cols * int(num_ffn)),
            "layer_idx": np.int32(layer_idx), "stage_idx": np.int32(stage_idx),
            "last_seen": _array("last_seen", last_seen, np.int64,
                                int(geo["num_regions"]) * int(geo["ring_depth"])),
            "reply_flags": _array("reply_flags", reply_flags, np.int64, int(num_ffn) + 1)}


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
    geo = _geometry("geo", geo)
    dedup = _count("dedup", dedup, high=1)
    args = _reply_wait_args(window=window, geo=geo, num_ffn_ranks=num_ffn_ranks, ring=ring,
                            expected=expected, expected_counts=expected_counts,
                            layer_idx=layer_idx, stage_idx=stage_idx, last_seen=last_seen,
                            reply_flags=reply_flags, dedup=bool(dedup))
    args.update(timeout_ns=_i64("timeout_ns", timeout_ns, low=0), status=_address("status", status),
                dedup=dedup)
    return _spec(get_kernel("combine.cu", "afd_wait_replies"), 1,
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
    num_tokens = _count("num_tokens", num_tokens)
    top_k = _count("top_k", top_k, low=1, high=MAX_TOP_K)
    geo = _geometry("geo", geo)
    num_partials = int(num_tokens) * int(top_k)
    wait = _reply_wait_args(window=window, geo=geo, num_ffn_ranks=num_ffn_ranks, ring=ring,
                            expected=expected, expected_counts=expected_counts,
                            layer_idx=layer_idx, stage_idx=stage_idx, last_seen=last_seen,
                            reply_flags=reply_flags)
    args = {"out": _address("out", out, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "topk_ids": _array("topk_ids", topk_ids, np.int32, num_partials),
            "topk_weights": _array("topk_weights", topk_weights, np.float32, num_partials),
            "pos": _array("pos", pos, np.int32, num_partials), "top_k": top_k,
            "expert_per_rank": _count("expert_per_rank", expert_per_rank, low=1),
            "num_ffn_ranks": wait.pop("num_ffn_ranks"),
            "has_shared": _count("has_shared", has_shared, high=1), **wait}
    args.update(timeout_ns=_i64("timeout_ns", timeout_ns, low=0), out_scale=np.float32(out_scale),
                done_counter=_array("done_counter", done_counter, np.uint32, 1),
                status=_address("status", status))
    kernel = get_kernel("combine.cu", "afd_combine", dtype_code=_dtype(dtype_code))
    return _spec(kernel, combine_grid(int(num_tokens), max_blocks), KERNEL_LIMITS["COMBINE_THREADS"], args)


def combine_grid(num_tokens: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_combine: one per token, at most ``max_blocks``, at least 1."""
    return max(1, min(num_tokens, max_blocks))


def wait_any_spec(*, window, geo, last_seen, scan_start, counts_snapshot, timeout_ns, doorbell,
                  ticket) -> LaunchSpec:
    """FFN arrival detection over every slot flag of the own window (afd_wait_any).

    ``last_seen`` int64 [num_slots] and ``scan_start`` int32 [1] live on the device and are
    updated on arrival; ``counts_snapshot`` int32 [num_slots, expert_per_rank] (device) gets
    the arrived header's expert counts in the won slot's row, from the same loads as the
    doorbell's header words. ``doorbell``: pinned int64 [DB_HEADER + ceil(header_words / 2)]; the
    kernel writes slot, flag, status (STATUS_OK / STATUS_TIMEOUT) and header words, then
    ``ticket`` into word DB_TICKET last: the host spins on that word. One block, one warp.
    """
    geo = _geometry("geo", geo)
    num_slots = int(geo["num_regions"]) * int(geo["ring_depth"])
    args = {"window": _address("window", window), "geo": geo,
            "last_seen": _array("last_seen", last_seen, np.int64, num_slots),
            "scan_start": _array("scan_start", scan_start, np.int32, 1),
            "counts_snapshot": _array("counts_snapshot", counts_snapshot, np.int32,
                                      num_slots * (int(geo["header_words"]) - wire.HDR_FIXED_WORDS)),
            "timeout_ns": _i64("timeout_ns", timeout_ns, low=0),
            "doorbell": _address("doorbell", doorbell), "ticket": np.int64(ticket)}
    return _spec(get_kernel("wait_any.cu", "afd_wait_any"), 1, KERNEL_LIMITS["WAIT_ANY_THREADS"], args)


def reply_spec(*, dtype_code, dst_window, geo, src_rank, ring, routed_out, num_routed, shared_out,
               num_shared, hidden_size, header_src, seq, done_counter, staging=0, dst_peer=0,
               max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Write ``num_routed`` + ``num_shared`` output rows, then header and flag = ``seq``, into
    slot (region = ``src_rank``, the own FFN rank; ``ring``) of an Attention peer's window
    (afd_reply<DT>).

    ``routed_out`` / ``shared_out``: payload [R, H] / [S, H] (may be 0 when the count is 0);
    ``header_src``: pinned int32 [header_words] prepared by the host; it must stay unchanged
    until the kernel has run (one buffer per in-flight reply). ``dst_window`` 0: the peer is
    reached by puts: rows and header go to slot (region = ``dst_peer``, ``ring``) of
    ``staging`` and no flag is stored (the host's put-with-signal sets it; docs/design/put-transport.md).
    Grid: :func:`reply_grid`.
    """
    num_routed = _count("num_routed", num_routed)
    num_shared = _count("num_shared", num_shared)
    geo = _geometry("geo", geo)
    is_put = not int(dst_window or 0)
    args = {"dst_window": _address("dst_window", dst_window, allow_null=True),
            "staging": _address("staging", staging, allow_null=not is_put),
            "dst_peer": _count("dst_peer", dst_peer, high=int(geo["num_regions"]) - 1),
            "geo": geo,
            "src_rank": _count("src_rank", src_rank, high=int(geo["num_regions"]) - 1),
            "ring": _count("ring", ring, high=int(geo["ring_depth"]) - 1),
            "routed_out": _address("routed_out", routed_out, allow_null=num_routed == 0),
            "num_routed": num_routed,
            "shared_out": _address("shared_out", shared_out, allow_null=num_shared == 0),
            "num_shared": num_shared, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "header_src": _address("header_src", header_src), "seq": np.int64(seq),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1)}
    kernel = get_kernel("reply.cu", "afd_reply", dtype_code=_dtype(dtype_code))
    return _spec(kernel, reply_grid(int(num_routed) + int(num_shared), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def reply_grid(num_rows: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_reply: one warp per output row, at least 1."""
    return _row_grid(num_rows, max_blocks)


def dedup_expand_spec(*, dtype_code, window, geo, region, ring, num_rows, num_tokens, num_routed,
                      num_shared, top_k, hidden_size, staging, route_copy, claims, fault,
                      num_claimed, layer_idx, status, done_counter,
                      max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Copy and check the route table of slot (``region``, ``ring``) of the own ``window``, and
    expand its ``num_rows`` rows into grouped staging (afd_dedup_expand<DT>; dedup mode).

    ``staging``: payload [>= num_routed, H] (device address); ``route_copy``: int32
    [>= num_rows, 2 + 2 * top_k] (device), the copy the reply reduces through. Scratch, left as
    found: ``claims`` int32 [>= num_routed] all ``0x7fffffff``, ``fault`` uint64 [1] all ones,
    ``num_claimed`` and ``done_counter`` uint32 [1] zero. A table that
    ``wire.check_route_table`` would reject latches STATUS_BAD_HEADER in ``status`` (ST_PEER =
    ``region``, ST_SLOT = route-table column, ST_COUNT = row, ST_CAP = ``wire.ROUTE_FAULT_*``,
    ST_LAYER = ``layer_idx``; ``wire.route_table_error`` decodes it); nothing is written outside
    staging rows [0, num_routed) and route_copy rows [0, num_rows). Grid: :func:`dedup_expand_grid`.
    """
    geo = _geometry("geo", geo)
    num_rows = _count("num_rows", num_rows)
    top_k = _count("top_k", top_k, low=1, high=MAX_TOP_K)
    num_routed = _count("num_routed", num_routed)
    width = wire.ROUTE_FIXED_WORDS + 2 * int(top_k)
    args = {"window": _address("window", window), "geo": geo,
            "region": _count("region", region, high=int(geo["num_regions"]) - 1),
            "ring": _count("ring", ring, high=int(geo["ring_depth"]) - 1),
            "num_rows": num_rows, "num_tokens": _count("num_tokens", num_tokens),
            "num_routed": num_routed,
            "num_shared": _count("num_shared", num_shared, high=int(num_rows)),
            "top_k": top_k, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "staging": _address("staging", staging, allow_null=num_routed == 0),
            "route_copy": _array("route_copy", route_copy, np.int32, int(num_rows) * width),
            "claims": _array("claims", claims, np.int32, int(num_routed)),
            "fault": _array("fault", fault, np.uint64, 1),
            "num_claimed": _array("num_claimed", num_claimed, np.uint32, 1),
            "layer_idx": np.int32(layer_idx), "status": _address("status", status),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1)}
    kernel = get_kernel("dedup_ffn.cu", "afd_dedup_expand", dtype_code=_dtype(dtype_code))
    return _spec(kernel, dedup_expand_grid(int(num_rows), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def dedup_expand_grid(num_rows: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_dedup_expand: one warp per route-table row, at least 1."""
    return _row_grid(num_rows, max_blocks)


def dedup_reply_spec(*, dtype_code, dst_window, geo, src_rank, ring, route_copy, num_rows, top_k,
                     routed_out, num_routed, shared_out, num_shared, hidden_size, header_src, seq,
                     done_counter, staging=0, dst_peer=0, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Reduce the worker's outputs to one reply row per dispatch row and write them, then header
    and flag = ``seq``, into slot (region = ``src_rank``, ``ring``) of an Attention peer's
    window (afd_dedup_reply<DT>; dedup mode).

    ``route_copy``: int32 [num_rows, 2 + 2 * top_k] (device), the table afd_dedup_expand
    accepted; ``routed_out``: payload [num_routed, H] in staging order; ``shared_out``: payload
    [num_shared, H] (0 when num_shared is 0); both after ``moe.apply_routed_scaling``. Reply row
    r = round(sum_s w_s * routed_out[pos_s] (+ shared_out[r], r < num_shared)), fp32 in slot
    order, lands in ``routed_x`` row r of the slot. ``header_src``: pinned int32
    [header_words] (``wire.reply_header`` words with ``num_rows``), unchanged until the kernel
    ran. ``dst_window`` 0: the peer is reached by puts: rows and header go to slot (region =
    ``dst_peer``, ``ring``) of ``staging`` and no flag is stored (the host's put-with-signal
    sets it; docs/design/put-transport.md), as :func:`reply_spec`. Grid: :func:`dedup_reply_grid`.
    """
    geo = _geometry("geo", geo)
    is_put = not int(dst_window or 0)
    num_rows = _count("num_rows", num_rows)
    top_k = _count("top_k", top_k, low=1, high=MAX_TOP_K)
    num_routed = _count("num_routed", num_routed)
    num_shared = _count("num_shared", num_shared, high=int(num_rows))
    width = wire.ROUTE_FIXED_WORDS + 2 * int(top_k)
    args = {"dst_window": _address("dst_window", dst_window, allow_null=True),
            "staging": _address("staging", staging, allow_null=not is_put),
            "dst_peer": _count("dst_peer", dst_peer, high=int(geo["num_regions"]) - 1),
            "geo": geo,
            "src_rank": _count("src_rank", src_rank, high=int(geo["num_regions"]) - 1),
            "ring": _count("ring", ring, high=int(geo["ring_depth"]) - 1),
            "route_copy": _array("route_copy", route_copy, np.int32, int(num_rows) * width),
            "num_rows": num_rows, "top_k": top_k,
            "routed_out": _address("routed_out", routed_out, allow_null=num_routed == 0),
            "num_routed": num_routed,
            "shared_out": _address("shared_out", shared_out, allow_null=num_shared == 0),
            "num_shared": num_shared, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "header_src": _address("header_src", header_src), "seq": np.int64(seq),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1)}
    kernel = get_kernel("dedup_ffn.cu", "afd_dedup_reply", dtype_code=_dtype(dtype_code))
    return _spec(kernel, dedup_reply_grid(int(num_rows), _row_bytes(hidden_size, dtype_code), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


#: the dedup row kernels (afd_dedup_scatter, afd_dedup_reply) cut a payload row into one part
#: per this many bytes, at most ROW_MAX_PARTS, a warp each (wire.cuh: ROW_PART_BYTES,
#: ROW_MAX_PARTS, row_parts)
ROW_PART_BYTES = 4096
ROW_MAX_PARTS = 8


def row_parts(row_bytes: int) -> int:
    """Warps (column ranges) per payload row of the dedup row kernels, as they compute them."""
    return max(1, min(-(-int(row_bytes) // ROW_PART_BYTES), ROW_MAX_PARTS))


def dedup_reply_grid(num_rows: int, row_bytes: int = 0, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_dedup_reply: one warp per (reply row, part of the row), at least 1. The
    kernel strides over its items, so any grid is correct; this one keeps every item's warp
    in flight (``row_bytes`` = hidden size x payload itemsize)."""
    return _row_grid(int(num_rows) * row_parts(row_bytes), max_blocks)


# --- dedup wire mode, Attention side (raw_kernels/dedup_attn.cu, docs/design/dedup.md) -----------
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
    num_tokens = _count("num_tokens", num_tokens)
    top_k = _count("top_k", top_k, low=1, high=MAX_TOP_K)
    num_ffn = _count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)
    num_partials = int(num_tokens) * int(top_k)
    args = {"topk_ids": _array("topk_ids", topk_ids, np.int32, num_partials),
            "num_tokens": num_tokens, "top_k": top_k,
            "expert_per_rank": _count("expert_per_rank", expert_per_rank, low=1),
            "num_ffn_ranks": num_ffn, "has_shared": _count("has_shared", has_shared, high=1),
            "verdict": _array("verdict", verdict, np.int32, 1),
            "rows_hist": _array("rows_hist", rows_hist, np.int32,
                                dispatch_num_chunks(num_partials) * 2 * int(num_ffn)),
            "rows_local": _array("rows_local", rows_local, np.int32, num_partials),
            "row_map": _array("row_map", row_map, np.int32, int(num_tokens) * int(num_ffn)),
            "shared_rank": _array("shared_rank", shared_rank, np.int32, int(num_tokens)),
            "num_rows": _array("num_rows", num_rows, np.int32, int(num_ffn)),
            "shared_rows": _array("shared_rows", shared_rows, np.int32, int(num_ffn)),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1)}
    return _spec(get_kernel("dedup_attn.cu", "afd_dedup_rows"),
                 dedup_rows_grid(int(num_tokens), int(top_k)), KERNEL_LIMITS["PLAN_THREADS"], args)


def dedup_rows_grid(num_tokens: int, top_k: int) -> int:
    """Blocks of afd_dedup_rows: one per CHUNK partials, at least 1 (as the plan)."""
    return plan_grid(num_tokens * top_k)


def _dedup_dispatch_head(*, hidden, num_tokens, hidden_size, topk_ids, topk_weights, top_k,
                         expert_per_rank, num_ffn_ranks) -> dict:
    """The leading arguments of afd_dedup_scatter and afd_dedup_dispatch_fused (hidden ..
    num_ffn_ranks, in their kernel order), checked."""
    num_tokens = _count("num_tokens", num_tokens)
    top_k = _count("top_k", top_k, low=1, high=MAX_TOP_K)
    num_partials = int(num_tokens) * int(top_k)
    return {"hidden": _address("hidden", hidden, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "topk_ids": _array("topk_ids", topk_ids, np.int32, num_partials),
            "topk_weights": _array("topk_weights", topk_weights, np.float32, num_partials),
            "top_k": top_k, "expert_per_rank": _count("expert_per_rank", expert_per_rank, low=1),
            "num_ffn_ranks": _count("num_ffn_ranks", num_ffn_ranks, low=1, high=MAX_FFN_RANKS)}


def _dedup_dispatch_tail(*, row_map, shared_rank, num_rows, shared_rows, peer_windows, staging,
                         geo, ring, always_send, src_rank, layer_idx, stage_idx, hdr_flags,
                         seq_counters, expected, expected_counts, done_counter, num_tokens,
                         num_ffn, epr) -> dict:
    """The rows' and publishing arguments of afd_dedup_scatter and afd_dedup_dispatch_fused
    (row_map .. done_counter, in their kernel order), checked against a dedup layout of ``epr``
    experts per rank."""
    geo = _geometry("geo", geo, header_words=wire.HDR_FIXED_WORDS + int(epr) + 1)
    return {"row_map": _array("row_map", row_map, np.int32, num_tokens * num_ffn),
            "shared_rank": _array("shared_rank", shared_rank, np.int32, num_tokens),
            "num_rows": _array("num_rows", num_rows, np.int32, num_ffn),
            "shared_rows": _array("shared_rows", shared_rows, np.int32, num_ffn),
            **_slot_args(peer_windows=peer_windows, staging=staging, geo=geo, ring=ring, num_ffn=num_ffn),
            "always_send": _count("always_send", always_send, high=1),
            **_publish_args(geo=geo, src_rank=src_rank, layer_idx=layer_idx, stage_idx=stage_idx,
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
    head = _dedup_dispatch_head(hidden=hidden, num_tokens=num_tokens, hidden_size=hidden_size,
                                topk_ids=topk_ids, topk_weights=topk_weights, top_k=top_k,
                                expert_per_rank=expert_per_rank, num_ffn_ranks=num_ffn_ranks)
    num_tokens, top_k = head["num_tokens"], head["top_k"]
    num_ffn, epr = int(head["num_ffn_ranks"]), int(head["expert_per_rank"])
    num_experts, num_partials = num_ffn * epr, int(num_tokens) * int(top_k)
    args = {**head,
            "chunk_hist": _array("chunk_hist", chunk_hist, np.int32,
                                 dispatch_num_chunks(num_partials) * num_experts),
            "local_rank": _array("local_rank", local_rank, np.int32, num_partials),
            "expert_start": _array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": _array("rank_offsets", rank_offsets, np.int32, num_ffn + 1),
            "expert_counts": _array("expert_counts", expert_counts, np.int32, num_experts),
            "verdict": _array("verdict", verdict, np.int32, 1),
            **_dedup_dispatch_tail(
                row_map=row_map, shared_rank=shared_rank, num_rows=num_rows,
                shared_rows=shared_rows, peer_windows=peer_windows, staging=staging, geo=geo,
                ring=ring, always_send=always_send, src_rank=src_rank, layer_idx=layer_idx,
                stage_idx=stage_idx, hdr_flags=hdr_flags, seq_counters=seq_counters,
                expected=expected, expected_counts=expected_counts, done_counter=done_counter,
                num_tokens=int(num_tokens), num_ffn=num_ffn, epr=epr)}
    kernel = get_kernel("dedup_attn.cu", "afd_dedup_scatter", dtype_code=_dtype(dtype_code))
    grid = dedup_scatter_grid(int(num_tokens), int(num_ffn), _row_bytes(hidden_size, dtype_code),
                              max_blocks)
    return _spec(kernel, grid, KERNEL_LIMITS["SCATTER_THREADS"], args)


def dedup_scatter_grid(num_tokens: int, num_ffn_ranks: int, row_bytes: int = 0,
                       max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_dedup_scatter: one warp per (token, FFN rank) cell and part of its row
    (:func:`row_parts`; ``row_bytes`` = hidden size x payload itemsize), at least 1."""
    return _row_grid(num_tokens * num_ffn_ranks * row_parts(row_bytes), max_blocks)


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
    head = _dedup_dispatch_head(hidden=hidden, num_tokens=num_tokens, hidden_size=hidden_size,
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
    args = {**head, "routed_cap": _count("routed_cap", routed_cap),
            "has_shared": _count("has_shared", has_shared, high=1),
            "expert_counts": _array("expert_counts", expert_counts, np.int32, num_experts),
            "expert_start": _array("expert_start", expert_start, np.int32, num_experts),
            "rank_offsets": _array("rank_offsets", rank_offsets, np.int32, int(num_ffn) + 1),
            "verdict": _array("verdict", verdict, np.int32, 1),
            "skipped": _array("skipped", skipped, np.int32, 1),
            **_dedup_dispatch_tail(
                row_map=row_map, shared_rank=shared_rank, num_rows=num_rows,
                shared_rows=shared_rows, peer_windows=peer_windows, staging=staging, geo=geo,
                ring=ring, always_send=always_send, src_rank=src_rank, layer_idx=layer_idx,
                stage_idx=stage_idx, hdr_flags=hdr_flags, seq_counters=seq_counters,
                expected=expected, expected_counts=expected_counts, done_counter=done_counter,
                num_tokens=int(num_tokens), num_ffn=int(num_ffn), epr=epr),
            "status": _address("status", status)}
    kernel = get_kernel("dedup_attn.cu", "afd_dedup_dispatch_fused", dtype_code=_dtype(dtype_code))
    grid = dedup_scatter_grid(int(num_tokens), int(num_ffn), _row_bytes(hidden_size, dtype_code),
                              max_blocks)
    return _spec(kernel, grid, KERNEL_LIMITS["SCATTER_THREADS"], args, shared_mem=shared_bytes)


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
    num_tokens = _count("num_tokens", num_tokens)
    geo = _geometry("geo", geo)
    wait = _reply_wait_args(window=window, geo=geo, num_ffn_ranks=num_ffn_ranks, ring=ring,
                            expected=expected, expected_counts=expected_counts,
                            layer_idx=layer_idx, stage_idx=stage_idx, last_seen=last_seen,
                            reply_flags=reply_flags, dedup=True)
    if int(wait["num_ffn_ranks"]) > MAX_FFN_RANKS:
        raise ValueError(f"num_ffn_ranks must be <= {MAX_FFN_RANKS}, got {int(wait['num_ffn_ranks'])}")
    args = {"out": _address("out", out, allow_null=num_tokens == 0),
            "num_tokens": num_tokens, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "row_map": _array("row_map", row_map, np.int32,
                              int(num_tokens) * int(wait["num_ffn_ranks"])), **wait}
    args.update(timeout_ns=_i64("timeout_ns", timeout_ns, low=0), out_scale=np.float32(out_scale),
                done_counter=_array("done_counter", done_counter, np.uint32, 1),
                status=_address("status", status))
    kernel = get_kernel("dedup_attn.cu", "afd_dedup_combine", dtype_code=_dtype(dtype_code))
    return _spec(kernel, combine_grid(int(num_tokens), max_blocks), KERNEL_LIMITS["COMBINE_THREADS"], args)


# --- the graph-driven FFN (raw_kernels/ffn_graph.cu, afd_cupy/ffn_graph.py) -------------------
#: groups of one torch._grouped_mm problem list: fewer than 1024 (torch's CUTLASS path)
GRAPH_MAX_GROUPS = 1023


def _graph_stage_args(*, geo, expert_per_rank, is_dedup, src_rank, num_attn_ranks, token_cap,
                      routed_cap, shared_cap, routed_bucket, shared_bucket, num_layers,
                      layers_per_chunk, routed_offs, shared_offs, reply_seqs, state,
                      replay_counter, records, num_records, record_words) -> dict:
    """The checked arguments of the stage (afd_graph_stage and afd_graph_wait_stage), from geo on."""
    geo = _geometry("geo", geo)
    epr = _count("expert_per_rank", expert_per_rank, low=1)
    is_dedup = _count("is_dedup", is_dedup, high=1)
    if int(epr) + int(is_dedup) > GRAPH_MAX_GROUPS + 1 or \
            int(geo["header_words"]) != wire.HDR_FIXED_WORDS + int(epr) + int(is_dedup):
        raise ValueError(f"expert_per_rank={int(epr)} (is_dedup={int(is_dedup)}) must fit one "
                         f"grouped GEMM ({GRAPH_MAX_GROUPS} groups) and geo.header_words="
                         f"{int(geo['header_words'])}")
    num_layers = _count("num_layers", num_layers, low=1)
    layers_per_chunk = _count("layers_per_chunk", layers_per_chunk, low=1)
    if int(layers_per_chunk) * int(epr) > GRAPH_MAX_GROUPS:
        raise ValueError(f"layers_per_chunk * expert_per_rank = {int(layers_per_chunk) * int(epr)} "
                         f"> {GRAPH_MAX_GROUPS} groups")
    num_slots = int(geo["num_regions"]) * int(geo["ring_depth"])
    record_words = _count("record_words", record_words,
                          low=STAGE_RECORD_HEADER + -(-int(geo["header_words"]) // 2)
                          + (wire.STATUS_WORDS if int(is_dedup) else 0))
    return {"geo": geo, "expert_per_rank": epr,
            "is_dedup": is_dedup, "src_rank": _count("src_rank", src_rank),
            "num_attn_ranks": _count("num_attn_ranks", num_attn_ranks, low=1,
                                     high=int(geo["num_regions"])),
            "token_cap": _count("token_cap", token_cap), "routed_cap": _count("routed_cap", routed_cap),
            "shared_cap": _count("shared_cap", shared_cap),
            "routed_bucket": _count("routed_bucket", routed_bucket),
            "shared_bucket": _count("shared_bucket", shared_bucket),
            "num_layers": num_layers, "layers_per_chunk": layers_per_chunk,
            "routed_offs": _array("routed_offs", routed_offs, np.int32, int(num_layers) * int(epr)),
            "shared_offs": _address("shared_offs", shared_offs, allow_null=True),
            "reply_seqs": _array("reply_seqs", reply_seqs, np.int64, num_slots),
            "state": _array("state", state, np.int64,
                            STAGE_STATE_HEADER + -(-int(geo["header_words"]) // 2)),
            "replay_counter": _array("replay_counter", replay_counter, np.int64, 1),
            "records": _address("records", records),
            "num_records": _count("num_records", num_records, low=1), "record_words": record_words}


def graph_stage_spec(*, doorbell, **stage) -> LaunchSpec:
    """Decide what one graph replay does from the arrival ``afd_wait_any`` left in the DEVICE
    ``doorbell`` (afd_graph_stage; one block). Capturable: every input is read from device
    memory when the replay runs.

    ``stage`` (keywords): geo, expert_per_rank, is_dedup, src_rank, num_attn_ranks, token_cap,
    routed_cap, shared_cap, routed_bucket, shared_bucket, num_layers, layers_per_chunk,
    routed_offs, shared_offs, reply_seqs, state, replay_counter, records, num_records,
    record_words. Writes ``routed_offs`` int32 [num_layers * expert_per_rank] and
    ``shared_offs`` int32 [num_layers] (or null): cumulative end rows per group of the
    stacked-layer problem lists (``ffn_graph.routed_offsets_reference``); ``state`` int64
    [ffn_graph.state_words(...)]: what gather and reply read; increments ``reply_seqs[slot]``
    (int64 [num_slots]) for a served or eager item and ``replay_counter`` int64 [1]; one record
    of ``record_words`` int64 per replay into the pinned ring ``records`` [num_records,
    record_words] (dedup: room for the route-table verdict after the header words,
    ``ffn_graph.record_words(hw, dedup=True)``).
    """
    args = {"doorbell": _address("doorbell", doorbell), **_graph_stage_args(**stage)}
    return _spec(get_kernel("ffn_graph.cu", "afd_graph_stage"), 1, KERNEL_LIMITS["REPLY_THREADS"], args)


def graph_wait_stage_spec(*, window, last_seen, scan_start, counts_snapshot, timeout_ns,
                          **stage) -> LaunchSpec:
    """afd_wait_any and afd_graph_stage in one kernel (afd_graph_wait_stage; one block): wait
    (bounded by ``timeout_ns``) for the next arrival in the own ``window`` as :func:`wait_any_spec`
    does (``last_seen`` int64 [num_slots], ``scan_start`` int32 [1], ``counts_snapshot`` int32
    [num_slots, header_words - HDR_FIXED_WORDS], all device, updated on arrival), then stage it
    as :func:`graph_stage_spec` does (``stage``: the same keywords, no doorbell)."""
    args = _graph_stage_args(**stage)
    geo = args["geo"]
    num_slots = int(geo["num_regions"]) * int(geo["ring_depth"])
    args = {"window": _address("window", window),
            "last_seen": _array("last_seen", last_seen, np.int64, num_slots),
            "scan_start": _array("scan_start", scan_start, np.int32, 1),
            "counts_snapshot": _array("counts_snapshot", counts_snapshot, np.int32,
                                      num_slots * (int(geo["header_words"]) - wire.HDR_FIXED_WORDS)),
            "timeout_ns": _i64("timeout_ns", timeout_ns, low=0), **args}
    return _spec(get_kernel("ffn_graph.cu", "afd_graph_wait_stage"), 1, KERNEL_LIMITS["REPLY_THREADS"],
                 args)


#: int64 words before the header copy in the stage's state and record (ffn_graph.cu
#: STATE_HEADER, REC_HEADER; afd_cupy.ffn_graph mirrors them and a CPU test parses the .cu)
STAGE_STATE_HEADER = 9
STAGE_RECORD_HEADER = 6


def graph_gather_spec(*, dtype_code, window, geo, state, hidden_size, routed_staging,
                      shared_staging, routed_bucket, shared_bucket,
                      max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Copy the served item's rows from its window slot into the fixed staging rows
    (afd_graph_gather<DT>). ``routed_staging`` / ``shared_staging``: payload [bucket, H]
    device addresses (shared 0 without shared experts). Grid for the bucket (frozen at capture).
    """
    geo = _geometry("geo", geo)
    routed_bucket = _count("routed_bucket", routed_bucket)
    shared_bucket = _count("shared_bucket", shared_bucket)
    args = {"window": _address("window", window), "geo": geo,
            "state": _array("state", state, np.int64, STAGE_STATE_HEADER),
            "hidden_size": _count("hidden_size", hidden_size, low=1),
            "routed_staging": _address("routed_staging", routed_staging),
            "shared_staging": _address("shared_staging", shared_staging, allow_null=True)}
    kernel = get_kernel("ffn_graph.cu", "afd_graph_gather", dtype_code=_dtype(dtype_code))
    return _spec(kernel, reply_grid(int(routed_bucket) + int(shared_bucket), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def graph_reply_spec(*, dtype_code, own_window, peer_windows, geo, src_rank, state, routed_outs,
                     shared_out, hidden_size, done_counter, routed_bucket, shared_bucket,
                     num_chunks=1, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Reply of a graph replay (afd_graph_reply<DT>): rows, header built by the stage, flag.

    ``peer_windows`` uint64 [num_regions] (device): Attention rank i's window as mapped here
    (0 for regions without one); ``routed_outs`` uint64 [num_chunks] (device): the routed
    output [routed_bucket, H] of each layer chunk, 0 = the own window slot's rows (identity);
    ``shared_out``: [shared_bucket, H] or 0 (own window rows). Grid for the bucket.
    """
    geo = _geometry("geo", geo)
    routed_bucket = _count("routed_bucket", routed_bucket)
    shared_bucket = _count("shared_bucket", shared_bucket)
    args = {"own_window": _address("own_window", own_window),
            "peer_windows": _array("peer_windows", peer_windows, np.uint64, int(geo["num_regions"])),
            "geo": geo, "src_rank": _count("src_rank", src_rank),
            "state": _array("state", state, np.int64, STAGE_STATE_HEADER),
            "routed_outs": _array("routed_outs", routed_outs, np.uint64, int(num_chunks)),
            "shared_out": _address("shared_out", shared_out, allow_null=True),
            "hidden_size": _count("hidden_size", hidden_size, low=1),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1)}
    kernel = get_kernel("ffn_graph.cu", "afd_graph_reply", dtype_code=_dtype(dtype_code))
    return _spec(kernel, reply_grid(int(routed_bucket) + int(shared_bucket), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def graph_dedup_expand_spec(*, dtype_code, window, geo, state, top_k, hidden_size, routed_staging,
                            shared_staging, route_copy, claims, fault, num_claimed, reply_seqs,
                            done_counter, token_cap, routed_cap, rows_bucket,
                            max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Copy, check and expand the served dedup item of a graph replay (afd_graph_dedup_expand<DT>):
    everything about the item is read from the stage's ``state`` when the replay runs.

    ``routed_staging`` / ``shared_staging``: payload [bucket, H] device addresses, 0 for none
    (identity experts: check and copy only); ``route_copy`` int32 [token_cap, 2 + 2 * top_k];
    scratch as :func:`dedup_expand_spec`'s (``claims`` [routed_cap]); ``reply_seqs`` the stage's
    (a rejected table gives its reserved seq back). A rejected table is written into the replay's
    record (GS_BAD_ROUTE, verdict after the header words). Grid for ``rows_bucket`` message rows
    (frozen at capture; any count is served).
    """
    geo = _geometry("geo", geo)
    top_k = _count("top_k", top_k, low=1, high=MAX_TOP_K)
    width = wire.ROUTE_FIXED_WORDS + 2 * int(top_k)
    num_slots = int(geo["num_regions"]) * int(geo["ring_depth"])
    args = {"window": _address("window", window), "geo": geo,
            "state": _array("state", state, np.int64, STAGE_STATE_HEADER + -(-int(geo["header_words"]) // 2)),
            "top_k": top_k, "hidden_size": _count("hidden_size", hidden_size, low=1),
            "routed_staging": _address("routed_staging", routed_staging, allow_null=True),
            "shared_staging": _address("shared_staging", shared_staging, allow_null=True),
            "route_copy": _array("route_copy", route_copy, np.int32, int(_count("token_cap", token_cap)) * width),
            "claims": _array("claims", claims, np.int32, int(_count("routed_cap", routed_cap))),
            "fault": _array("fault", fault, np.uint64, 1),
            "num_claimed": _array("num_claimed", num_claimed, np.uint32, 1),
            "reply_seqs": _array("reply_seqs", reply_seqs, np.int64, num_slots),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1)}
    kernel = get_kernel("ffn_graph.cu", "afd_graph_dedup_expand", dtype_code=_dtype(dtype_code))
    return _spec(kernel, dedup_expand_grid(int(_count("rows_bucket", rows_bucket)), max_blocks),
                 KERNEL_LIMITS["REPLY_THREADS"], args)


def graph_dedup_reply_spec(*, dtype_code, own_window, peer_windows, geo, src_rank, state, route_copy,
                           top_k, routed_outs, shared_out, hidden_size, done_counter, token_cap,
                           rows_bucket, num_chunks=1, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """Reduce and reply of a graph replay in the dedup mode (afd_graph_dedup_reply<DT>): one reply
    row per received row, then the header the stage built and flag = the reply seq.

    ``route_copy``: the table :func:`graph_dedup_expand_spec`'s kernel accepted;
    ``routed_outs`` uint64 [num_chunks] (device): each layer chunk's grouped output [bucket, H]
    in staging order, 0 = identity experts (every slot reads the received row); ``shared_out``
    [bucket, H] or 0 (identity: the received row). Grid for ``rows_bucket`` rows (frozen).
    """
    geo = _geometry("geo", geo)
    top_k = _count("top_k", top_k, low=1, high=MAX_TOP_K)
    width = wire.ROUTE_FIXED_WORDS + 2 * int(top_k)
    args = {"own_window": _address("own_window", own_window),
            "peer_windows": _array("peer_windows", peer_windows, np.uint64, int(geo["num_regions"])),
            "geo": geo, "src_rank": _count("src_rank", src_rank),
            "state": _array("state", state, np.int64, STAGE_STATE_HEADER + -(-int(geo["header_words"]) // 2)),
            "route_copy": _array("route_copy", route_copy, np.int32, int(_count("token_cap", token_cap)) * width),
            "top_k": top_k,
            "routed_outs": _array("routed_outs", routed_outs, np.uint64, int(num_chunks)),
            "shared_out": _address("shared_out", shared_out, allow_null=True),
            "hidden_size": _count("hidden_size", hidden_size, low=1),
            "done_counter": _array("done_counter", done_counter, np.uint32, 1)}
    kernel = get_kernel("ffn_graph.cu", "afd_graph_dedup_reply", dtype_code=_dtype(dtype_code))
    grid = dedup_reply_grid(int(_count("rows_bucket", rows_bucket)), _row_bytes(hidden_size, dtype_code),
                            max_blocks)
    return _spec(kernel, grid, KERNEL_LIMITS["REPLY_THREADS"], args)


# --------------------------------------------------------------------------- the fused gate
GATE_LIMITS = {name: KERNEL_LIMITS[name] for name in ("GATE_THREADS", "GATE_MAX_EXPERTS", "GATE_MAX_TOP_K")}
#: ``scoring`` codes of afd_gate_topk (SCORE_* in raw_kernels/gate.cu)
GATE_SCORING = {"softmax": 0, "sigmoid": 1}


def gate_grid(num_tokens: int, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of afd_gate_topk: one warp per token, tokens grid-strided past ``max_blocks``."""
    warps = GATE_LIMITS["GATE_THREADS"] // 32
    return max(1, min(-(-int(num_tokens) // warps), max_blocks))


def gate_topk_spec(*, dtype_code, logits, num_tokens, num_experts, top_k, scoring, bias,
                   renormalize, topk_weights, topk_ids, max_blocks=MAX_BLOCKS) -> LaunchSpec:
    """The greedy gate in one kernel (afd_gate_topk<DT>; ``gates.gate_topk_reference``).

    ``logits``: address of [num_tokens, num_experts] of dtype ``dtype_code``, row-major;
    ``bias``: address of float32 [num_experts] (selection only) or 0; ``scoring``: 0 softmax,
    1 sigmoid; ``renormalize``: 0 or 1. Outputs: ``topk_weights`` float32 [T, K] and
    ``topk_ids`` int32 [T, K] (addresses), every element written. num_experts in [1,
    GATE_MAX_EXPERTS], top_k in [1, min(num_experts, GATE_MAX_TOP_K)]. Grid: :func:`gate_grid`.
    """
    num_tokens = _count("num_tokens", num_tokens)
    num_experts = _count("num_experts", num_experts, low=1, high=GATE_LIMITS["GATE_MAX_EXPERTS"])
    top_k = _count("top_k", top_k, low=1, high=min(int(num_experts), GATE_LIMITS["GATE_MAX_TOP_K"]))
    empty = int(num_tokens) == 0
    args = {"logits": _address("logits", logits, allow_null=empty), "num_tokens": num_tokens,
            "num_experts": num_experts, "top_k": top_k,
            "scoring": _count("scoring", scoring, high=max(GATE_SCORING.values())),
            "bias": _address("bias", bias, allow_null=True),
            "renormalize": _count("renormalize", renormalize, high=1),
            "topk_weights": _address("topk_weights", topk_weights, allow_null=empty),
            "topk_ids": _address("topk_ids", topk_ids, allow_null=empty)}
    kernel = get_kernel("gate.cu", "afd_gate_topk", dtype_code=_dtype(dtype_code))
    return _spec(kernel, gate_grid(int(num_tokens), max_blocks), GATE_LIMITS["GATE_THREADS"], args)
