// dedup_attn_fused.cu: plan, rows and scatter of a decode-size dedup dispatch in one kernel
// (afd_dedup_dispatch_fused; docs/design/dedup.md, docs/design/kernels.md). Same outputs and wire
// order as afd_dispatch_plan -> afd_dedup_rows -> afd_dedup_scatter (dispatch.cu, dedup_attn.cu).
// Numpy reference: afd_cupy/testing/dedup_reference.py (plan_reference, scatter_reference).
#include "common/wire.cuh"
#include "common/payload.cuh"
#include "common/block.cuh"
#include "common/publish.cuh"        // publish_dispatch
#include "attention/plan_block.cuh"  // plan_in_block, store_block_plan
#include "attention/dedup_attn.cuh"  // dedup_shared_rank, write_dedup_cell, record_dedup_sends

using namespace afd;

// Plan, rows and scatter of a decode-size dedup dispatch in ONE kernel (docs/design/kernels.md, as
// afd_dispatch_fused does for pair mode): every block plans the whole dispatch in its shared
// memory from the ids, then writes its (token, rank) cells; no block waits for another before
// its rows. Same wire order and outputs as afd_dispatch_plan -> afd_dedup_rows ->
// afd_dedup_scatter: the staging row of each partial (pos, by expert then by partial index),
// the rows of each message (keys 2j: t's shared experts run on j, first; then 2j + 1; by token
// within a key), route tables, payload rows, headers, flags. Block 0 writes the plan's
// expert_counts, expert_start, rank_offsets, verdict and the rows' shared_rank, num_rows,
// shared_rows; every cell's warp writes its row_map entry (-1: not sent there, or nothing sent).
// Errors as afd_dispatch_fused: the verdict from the ids (BAD_EXPERT, CAPACITY) by block 0; an
// error latched earlier, read once per block: that block writes no rows and sets `skipped`, and
// the last block then publishes nothing.
// NOTE: the counts per key and per expert are added once per equal-key group of a warp
// (__match_any_sync), not per thread: per-thread shared atomics on one word serialize (~3 us
// for 64 on an H200).
// grid = dedup_scatter_grid(T, F, row bytes), block = SCATTER_THREADS, dynamic shared memory =
// 4 * (3 * round_up(T*K, 4) + 6 * E + 8 * F + round_up(T, 4)) bytes (dedup_dispatch_fused_spec).
template <int DT>
__global__ void __launch_bounds__(SCATTER_THREADS)
afd_dedup_dispatch_fused(afd_u64 hidden,  // payload [num_tokens, hidden_size], row-major
                         afd_i32 num_tokens, afd_i32 hidden_size,
                         const afd_i32* __restrict__ topk_ids,    // [num_tokens * top_k]
                         const float* __restrict__ topk_weights,  // [num_tokens * top_k]
                         afd_i32 top_k, afd_i32 expert_per_rank, afd_i32 num_ffn_ranks,
                         afd_i32 routed_cap, afd_i32 has_shared,
                         afd_i32* __restrict__ expert_counts,  // [E] out (block 0)
                         afd_i32* __restrict__ expert_start,   // [E] out (block 0)
                         afd_i32* __restrict__ rank_offsets,   // [F + 1] out (block 0)
                         afd_i32* __restrict__ verdict,        // [1] out (block 0)
                         afd_i32* skipped,                     // [1] scratch, 0 between dispatches
                         afd_i32* __restrict__ row_map,        // [num_tokens, F] out
                         afd_i32* __restrict__ shared_rank,    // [num_tokens] out (block 0)
                         afd_i32* __restrict__ num_rows,       // [F] out (block 0)
                         afd_i32* __restrict__ shared_rows,    // [F] out (block 0)
                         const afd_u64* __restrict__ peer_windows,  // [F], 0: put peer
                         afd_u64 staging,  // own symmetric put staging (0 without put peers)
                         SlotGeometry geo, afd_i32 ring, afd_i32 always_send,
                         afd_i32 src_rank, afd_i32 layer_idx, afd_i32 stage_idx, afd_i32 hdr_flags,
                         afd_i64* seq_counters,     // [F], this ring's row
                         afd_i64* expected,         // [F] out: seq sent, 0 = not sent
                         afd_i32* expected_counts,  // [F, 3] out: (routed, shared, rows)
                         unsigned int* done_counter, afd_i64* status) {
  constexpr unsigned int ALL = 0xffffffffu;
  extern __shared__ __align__(16) afd_i32 s_dyn[];
  __shared__ afd_i64 s_seq[MAX_FFN_RANKS];
  __shared__ afd_i32 s_routed[MAX_FFN_RANKS];
  __shared__ afd_i32 s_shared[MAX_FFN_RANKS];
  __shared__ afd_i32 s_rows[MAX_FFN_RANKS];
  __shared__ afd_i32 s_rank_off[MAX_FFN_RANKS + 1];
  __shared__ afd_i32 s_keyrun[2 * MAX_FFN_RANKS];  // rows per key in total
  __shared__ afd_i32 s_send;

  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i32 num_experts = num_ffn_ranks * expert_per_rank;
  const afd_i32 num_partials = num_tokens * top_k;
  const afd_i32 p4 = (num_partials + 3) & ~3;
  afd_i32* s_ids = s_dyn;             // [P], -1 = bad id
  afd_i32* s_pos = s_ids + p4;        // [P] staging row of each partial on its rank
  afd_i32* s_prow = s_pos + p4;       // [P] first partial of (t, j): rank among its key's
  afd_i32* s_hist = s_prow + p4;      // [E] counts
  afd_i32* s_start = s_hist + num_experts;  // [E] exclusive starts
  afd_i32* s_srank = s_start + num_experts;  // [T] rank running t's shared experts, -1: none
  // [ROWS_PER_BLOCK][E + 2F], a row per warp (the warps of a SCATTER_THREADS block) for step 2:
  // its partials of each expert, then its first partials of each row key; after the scan over
  // the warps, the bases of its ranks. 16 bits: every value is at most T*K, below 2**16 for
  // any T*K whose 12 B per partial fit a block's shared memory (<= 227 KiB); half the size
  // keeps e.g. T = 256, K = 8, E = 256 (F <= 32) within DEDUP_FUSED_MAX_SHARED_BYTES.
  const afd_i32 num_cols = num_experts + 2 * num_ffn_ranks;
  unsigned short* s_warp_cols =
      reinterpret_cast<unsigned short*>(s_srank + ((num_tokens + 3) & ~3));
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();

  // 1. The pair plan (as afd_dispatch_fused): ids, histogram, scan, rank offsets, verdict.
  const BlockPlan plan = plan_in_block(topk_ids, num_partials, expert_per_rank, num_ffn_ranks,
                                       routed_cap, layer_idx, status, s_ids, s_hist, s_start,
                                       s_rank_off);
  const bool planned = plan.code == STATUS_OK;  // the ids are valid: rows can be planned

  // 2. The rows (as afd_dedup_rows) and each partial's staging row: stable ranks among equal
  // experts (pos) and, for the first partial of each (token, rank), among equal row keys. Warp w
  // ranks a contiguous segment of the partials, 32 at a time in order (__match_any_sync within
  // a step, the warp's running counts per column across steps); a scan over the warps per
  // column then gives each warp's bases. Four block barriers in all, no long scans: rounds of
  // 256 partials ranked by block_rank_of_key (5 barriers a round, warp 7 reading 224 earlier
  // keys twice) cost ~9 us of every block's critical path at T = 128, K = 8 (H200).
  if (planned) {
    for (int t = tid; t < num_tokens; t += SCATTER_THREADS) {
      s_srank[t] = has_shared ? dedup_shared_rank(s_ids + static_cast<afd_i64>(t) * top_k, top_k,
                                                  expert_per_rank, num_ffn_ranks, t)
                              : -1;
    }
    for (int c = tid; c < ROWS_PER_BLOCK * num_cols; c += SCATTER_THREADS) s_warp_cols[c] = 0;
    __syncthreads();
    const int warp = tid >> 5;
    const unsigned int lower = (1u << lane) - 1u;
    const afd_i32 seg = (((num_partials + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK) + 31) & ~31;
    const afd_i32 seg_begin = min(warp * seg, num_partials);
    const afd_i32 seg_end = min(seg_begin + seg, num_partials);
    unsigned short* cols = s_warp_cols + warp * num_cols;  // this warp's row
    for (afd_i32 p0 = seg_begin; p0 < seg_end; p0 += 32) {  // warp-uniform trip count
      const afd_i32 p = p0 + lane;
      const afd_i32 e = p < seg_end ? s_ids[p] : -1;
      afd_i32 key = -1;
      if (e >= 0) {
        const afd_i32 t = p / top_k, k = p - t * top_k, j = e / expert_per_rank;
        const afd_i32* ids = s_ids + static_cast<afd_i64>(t) * top_k;
        bool first = true;
        for (afd_i32 kk = 0; kk < k && first; ++kk) first = (ids[kk] / expert_per_rank != j);
        if (first) key = 2 * j + (s_srank[t] == j ? 0 : 1);
      }
      const unsigned int same_e = __match_any_sync(ALL, e);
      const unsigned int same_key = __match_any_sync(ALL, key);
      // warp-local ranks: the counts of the earlier steps + the equal lanes below this one
      if (e >= 0) s_pos[p] = cols[e] + __popc(same_e & lower);
      if (p < seg_end) {
        s_prow[p] = key >= 0 ? cols[num_experts + key] + __popc(same_key & lower) : -1;
      }
      __syncwarp();  // every lane has read the counts before the lowest lane of a group adds
      if (e >= 0 && lane == __ffs(same_e) - 1) cols[e] += __popc(same_e);
      if (key >= 0 && lane == __ffs(same_key) - 1) cols[num_experts + key] += __popc(same_key);
      __syncwarp();  // the next step reads the sums
    }
    __syncthreads();
    // Per column, exclusive scan over the warps in segment order. An expert's bases start at its
    // first staging row on its rank; a key's total is its row count.
    for (int c = tid; c < num_cols; c += SCATTER_THREADS) {
      afd_i32 run = c < num_experts ? s_start[c] - s_rank_off[c / expert_per_rank] : 0;
      for (int w = 0; w < ROWS_PER_BLOCK; ++w) {
        const afd_i32 count = s_warp_cols[w * num_cols + c];
        s_warp_cols[w * num_cols + c] = static_cast<unsigned short>(run);
        run += count;
      }
      if (c >= num_experts) s_keyrun[c - num_experts] = run;
    }
    __syncthreads();
    for (afd_i32 p = seg_begin + lane; p < seg_end; p += 32) {  // the partials ranked above
      const afd_i32 e = s_ids[p];
      if (e < 0) continue;
      s_pos[p] += cols[e];
      const afd_i32 prow = s_prow[p];
      if (prow >= 0) {  // the first partial of (t, j): its key again
        const afd_i32 t = p / top_k, j = e / expert_per_rank;
        s_prow[p] = prow + cols[num_experts + 2 * j + (s_srank[t] == j ? 0 : 1)];
      }
    }
    __syncthreads();
  }
  // s_keyrun now holds the totals: shared rows (even keys) and other rows (odd keys) per rank.
  // As afd_dedup_rows after a verdict other than STATUS_OK (bad ids, or an error latched
  // earlier): the rows' outputs say nothing is sent (-1, 0).
  const bool ok = planned && !plan.skip;
  if (blockIdx.x == 0) {
    store_block_plan(plan, s_hist, s_start, s_rank_off, num_experts, num_ffn_ranks, expert_counts,
                     expert_start, rank_offsets, verdict);
    for (int j = tid; j < num_ffn_ranks; j += SCATTER_THREADS) {
      shared_rows[j] = ok ? s_keyrun[2 * j] : 0;
      num_rows[j] = ok ? s_keyrun[2 * j] + s_keyrun[2 * j + 1] : 0;
    }
    for (int t = tid; t < num_tokens; t += SCATTER_THREADS) shared_rank[t] = ok ? s_srank[t] : -1;
  }

  // 3. This block's (token, rank) cells: row_map always; rows and route tables when sending.
  {
    const afd_i64 num_cells = static_cast<afd_i64>(num_tokens) * num_ffn_ranks;
    const afd_i64 parts = row_parts(row_bytes);
    const afd_i64 part_bytes = ((row_bytes + parts - 1) / parts + 15) & ~static_cast<afd_i64>(15);
    const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
    for (afd_i64 item = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5);
         item < num_cells * parts; item += warp_stride) {
      const afd_i64 cell = item / parts, part = item % parts;
      const afd_i64 t = cell / num_ffn_ranks;
      const afd_i32 j = static_cast<afd_i32>(cell % num_ffn_ranks);
      const afd_i32* ids = s_ids + t * top_k;
      // the token's first partial on rank j (warp-uniform)
      afd_i32 first_k = -1;
      if (planned) {
        for (afd_i32 k0 = 0; k0 < top_k && first_k < 0; k0 += 32) {
          const afd_i32 k = k0 + lane;
          const unsigned int mask = __ballot_sync(ALL, k < top_k && ids[k] / expert_per_rank == j);
          if (mask != 0u) first_k = k0 + __ffs(mask) - 1;
        }
      }
      afd_i32 row = -1;
      if (first_k >= 0) {
        const afd_i32 key = 2 * j + (s_srank[t] == j ? 0 : 1);
        row = ((key & 1) ? s_keyrun[key - 1] : 0) + s_prow[t * top_k + first_k];
      }
      if (part == 0 && lane == 0) row_map[cell] = ok ? row : -1;
      if (!ok || row < 0) continue;
      char* slot = geo.send_slot(peer_windows[j], staging, j, src_rank, ring);
      write_dedup_cell(geo, slot, hidden, row_bytes, part, part_bytes, t, j, row, s_srank[t] == j,
                       ids, topk_weights, top_k, expert_per_rank,
                       [&](afd_i64 p, afd_i32) { return s_pos[p]; }, lane);
    }
  }
  if (tid == 0 && planned && plan.skip) {
    atomicOr(reinterpret_cast<unsigned int*>(skipped), 1u);  // released by last_block_done
  }

  // Every block's rows and route-table rows are released at system scope here.
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;

  // 4. Last block: send only if no block skipped, then as afd_dedup_scatter.
  if (tid == 0) {
    s_send = (planned && !plan.skip && __ldcg(skipped) == 0) ? 1 : 0;
    *skipped = 0;
  }
  __syncthreads();
  const bool send = s_send != 0;
  record_dedup_sends(num_ffn_ranks, s_rank_off,
                     [&](int j) {  // (0 and 0 when not ok, as afd_dedup_rows leaves them)
                       return ok ? DedupRows{s_keyrun[2 * j], s_keyrun[2 * j] + s_keyrun[2 * j + 1]}
                                 : DedupRows{0, 0};
                     },
                     send, always_send, seq_counters, s_seq, s_routed, s_shared, s_rows, expected,
                     expected_counts);
  if (send) {
    const DispatchHeader hdr{src_rank, layer_idx, stage_idx, num_tokens, top_k,
                             hdr_flags | static_cast<afd_i32>(FLAG_DEDUP)};
    publish_dispatch</*DEDUP=*/true>(geo, peer_windows, staging, ring, num_ffn_ranks,
                                     expert_per_rank, hdr, s_seq, s_routed, s_shared, s_rows,
                                     s_hist);
  }
  reset_done_counter(done_counter);
}
