"""cuda backend, Attention side: the device scratch of one dispatch in flight, allocated per
ring when the path opens (so the hot path allocates nothing). Used by
:mod:`~afd_cupy.backends.cuda_attention` and the kernel tests.
"""
from __future__ import annotations

from dataclasses import dataclass

from afd_cupy import kernels


@dataclass(frozen=True)
class DispatchScratch:
    """Device scratch of one dispatch in flight, sized for ``max_partials`` (CuPy arrays).

    ``chunk_hist`` int32 [max(1, chunks), E]; ``local_rank``, ``pos`` int32 [max(1, NK)];
    ``expert_counts``, ``expert_start`` int32 [E]; ``rank_offsets`` int32 [F + 1];
    ``verdict`` int32 [1] (the plan's send decision, read by the scatter);
    ``plan_done``, ``scatter_done`` uint32 [1] zeroed done counters; ``skipped`` int32 [1]
    (afd_dispatch_fused: a block that saw an earlier error, zero between dispatches).
    """

    chunk_hist: object
    local_rank: object
    pos: object
    expert_counts: object
    expert_start: object
    rank_offsets: object
    verdict: object
    plan_done: object
    scatter_done: object
    skipped: object

    @classmethod
    def allocate(cls, max_partials: int, num_ffn_ranks: int, expert_per_rank: int) -> "DispatchScratch":
        import cupy

        num_experts = num_ffn_ranks * expert_per_rank
        rows = max(1, kernels.dispatch_num_chunks(max_partials))
        return cls(chunk_hist=cupy.zeros((rows, num_experts), cupy.int32),
                   local_rank=cupy.zeros(max(1, max_partials), cupy.int32),
                   pos=cupy.zeros(max(1, max_partials), cupy.int32),
                   expert_counts=cupy.zeros(num_experts, cupy.int32),
                   expert_start=cupy.zeros(num_experts, cupy.int32),
                   rank_offsets=cupy.zeros(num_ffn_ranks + 1, cupy.int32),
                   verdict=cupy.zeros(1, cupy.int32),
                   plan_done=cupy.zeros(1, cupy.uint32), scatter_done=cupy.zeros(1, cupy.uint32),
                   skipped=cupy.zeros(1, cupy.int32))


@dataclass(frozen=True)
class DedupRowsScratch:
    """Device buffers of one dedup dispatch in flight, sized for ``max_tokens`` (CuPy arrays).

    Scratch int32 ``rows_hist`` [max(1, chunks) * 2F], ``rows_local`` [max(1, T*K)]; outputs of
    ``afd_dedup_rows`` int32 ``row_map`` [max(1, T), F] (read again by the combine),
    ``shared_rank`` [max(1, T)], ``num_rows``, ``shared_rows`` [F]; ``rows_done`` uint32 [1]
    zeroed done counter.
    """

    rows_hist: object
    rows_local: object
    row_map: object
    shared_rank: object
    num_rows: object
    shared_rows: object
    rows_done: object

    @classmethod
    def allocate(cls, max_tokens: int, top_k: int, num_ffn_ranks: int) -> "DedupRowsScratch":
        import cupy

        max_partials = max_tokens * top_k
        chunks = max(1, kernels.dispatch_num_chunks(max_partials))
        return cls(rows_hist=cupy.zeros(chunks * 2 * num_ffn_ranks, cupy.int32),
                   rows_local=cupy.zeros(max(1, max_partials), cupy.int32),
                   row_map=cupy.full((max(1, max_tokens), num_ffn_ranks), -1, cupy.int32),
                   shared_rank=cupy.full(max(1, max_tokens), -1, cupy.int32),
                   num_rows=cupy.zeros(num_ffn_ranks, cupy.int32),
                   shared_rows=cupy.zeros(num_ffn_ranks, cupy.int32),
                   rows_done=cupy.zeros(1, cupy.uint32))
