// attention/dedup_attn_ll.cu: the low-latency dedup-mode dispatch (ConnectorConfig(dedup_dispatch="ll");
// docs/design/dedup.md, docs/design/kernels.md). Same wire bytes and outputs as
// afd_dedup_dispatch_fused (dedup_attn_fused.cu), with a shorter critical path per block.
//
// Why: afd_dedup_dispatch_fused has every block rank all T*K partials by expert (the staging
// rows pos[t, k]) before it writes a payload row, though a payload row only needs the ROW of its
// (token, rank) cell, which depends on tokens, not partials: row(t, j) = (t's shared experts run
// on j ? 0 : shared_rows[j]) + the number of earlier tokens of the same class on j. So here:
//   every block    the pair plan's verdict and counts (plan_in_block: ids, histogram, rank
//                  offsets; bad-id and capacity errors, an error latched earlier), then per
//                  token a 32-bit mask of its FFN ranks and its shared rank, then the row of
//                  every cell by one ballot per (rank, class) and warp and a scan over the warps
//                  (no per-partial ranking);
//   block 0        additionally the expert ranking (pos), the plan's and rows' outputs, row_map,
//                  and every route-table row (small: 4 * (2 + 2K) bytes a row);
//   blocks 1..     the payload rows, a warp per (cell, part of its row) (with a grid of one
//                  block, block 0 writes them too);
//   last block     as afd_dedup_dispatch_fused: sends only if no block skipped, seq, expected,
//                  headers, one system fence per rank, flags.
// No block waits for another before its rows: the only grid-wide ordering is last_block_done.
// Rows are ordered exactly as the plan orders them (shared rows first, token order within a
// class), so every byte equals the fused kernel's. Numpy reference:
// afd_cupy/testing/dedup_reference.py (plan_reference, scatter_reference).
#include "common/wire.cuh"
#include "common/payload.cuh"
#include "common/block.cuh"          // last_block_done, reset_done_counter
#include "common/publish.cuh"        // DispatchHeader, publish_dispatch
#include "attention/plan_block.cuh"  // plan_in_block, store_block_plan
#include "attention/dedup_attn.cuh"  // record_dedup_sends

using namespace afd;

// A token's FFN ranks are one 32-bit mask (kernels.specs.dedup_attn_ll mirrors it).
constexpr int LL_MAX_FFN_RANKS = 32;
// s_rows entry of a cell whose token does not go to the rank (rows are below 0xffff).
constexpr unsigned short LL_NO_ROW = 0xffff;

// Rank running the shared experts of a token with rank mask `mask` (non-zero): the first of
// first, first + 1, ..., F - 1, 0, ... in the mask (as dedup_attn.cuh's dedup_shared_rank).
__device__ __forceinline__ afd_i32 ll_shared_rank(afd_u32 mask, afd_i32 first) {
  const afd_u32 high = mask >> first;  // first < F <= 32
  return high ? first + __ffs(high) - 1 : __ffs(mask) - 1;
}

// Every thread of the block. s_rows[t * F + j] := row of token t in rank j's message, or
// LL_NO_ROW; s_carry[2j] := shared rows of j, s_carry[2j + 1] := its other rows. Tokens in
// rounds of SCATTER_THREADS (one a thread): per rank and class one ballot per warp gives the
// rank within the warp, s_wcnt the warp totals, a scan over the warps (and the earlier rounds'
// s_carry) the base. Ends with a barrier.
__device__ __forceinline__ void ll_row_table(const afd_u32* s_mask, const afd_i32* s_srank,
                                             afd_i32 num_tokens, afd_i32 num_ffn_ranks,
                                             unsigned short* s_rows, afd_i32* s_carry) {
  __shared__ afd_i32 s_wcnt[ROWS_PER_BLOCK][2 * LL_MAX_FFN_RANKS];
  constexpr unsigned int ALL = 0xffffffffu;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned int lower = (1u << lane) - 1u;
  if (tid < 2 * num_ffn_ranks) s_carry[tid] = 0;
  for (afd_i32 r0 = 0; r0 < num_tokens; r0 += SCATTER_THREADS) {  // block-uniform trip count
    const afd_i32 t = r0 + tid;
    const bool in = t < num_tokens;
    const afd_u32 mask = in ? s_mask[t] : 0u;
    const afd_i32 srank = in ? s_srank[t] : -1;
    for (afd_i32 j = 0; j < num_ffn_ranks; ++j) {  // warp-uniform: every lane votes
      const bool goes = (mask >> j) & 1u;
      const bool shared = goes && srank == j;
      const unsigned int votes_s = __ballot_sync(ALL, shared);
      const unsigned int votes_o = __ballot_sync(ALL, goes && !shared);
      if (lane == 0) {
        s_wcnt[warp][2 * j] = __popc(votes_s);
        s_wcnt[warp][2 * j + 1] = __popc(votes_o);
      }
      if (in) {
        const afd_i64 cell = static_cast<afd_i64>(t) * num_ffn_ranks + j;
        s_rows[cell] = goes ? static_cast<unsigned short>(__popc((shared ? votes_s : votes_o) & lower))
                            : LL_NO_ROW;
      }
    }
    __syncthreads();  // s_wcnt complete; s_carry of the earlier rounds complete
    if (in) {
      for (afd_i32 j = 0; j < num_ffn_ranks; ++j) {
        if (!((mask >> j) & 1u)) continue;
        const int key = 2 * j + (srank == j ? 0 : 1);
        afd_i32 base = s_carry[key];
        for (int w = 0; w < warp; ++w) base += s_wcnt[w][key];
        const afd_i64 cell = static_cast<afd_i64>(t) * num_ffn_ranks + j;
        s_rows[cell] = static_cast<unsigned short>(s_rows[cell] + base);
      }
    }
    __syncthreads();  // every base read s_carry before it grows
    if (tid < 2 * num_ffn_ranks) {
      afd_i32 run = 0;
      for (int w = 0; w < ROWS_PER_BLOCK; ++w) run += s_wcnt[w][tid];
      s_carry[tid] += run;
    }
    __syncthreads();  // s_carry grown before the next round (s_wcnt is rewritten there)
  }
  // the other rows follow the shared rows of their rank
  const afd_i64 num_cells = static_cast<afd_i64>(num_tokens) * num_ffn_ranks;
  for (afd_i64 cell = tid; cell < num_cells; cell += SCATTER_THREADS) {
    const afd_i32 t = static_cast<afd_i32>(cell / num_ffn_ranks);
    const afd_i32 j = static_cast<afd_i32>(cell % num_ffn_ranks);
    const unsigned short row = s_rows[cell];
    if (row != LL_NO_ROW && s_srank[t] != j) {
      s_rows[cell] = static_cast<unsigned short>(row + s_carry[2 * j]);
    }
  }
  __syncthreads();
}

// Block 0, every thread: s_pos[p] := staging row of partial p on its rank (stable by expert,
// then by p), as afd_dedup_dispatch_fused's step 2 restricted to the expert columns: warp w
// ranks a contiguous segment 32 partials at a time (__match_any_sync), then a scan over the
// warps per expert gives each warp's bases. s_warp_cols [ROWS_PER_BLOCK][E] zeroed by the
// caller before a barrier; 16 bits suffice (every value < T*K < 2**16, checked by the spec).
// Every id is valid (called only on a STATUS_OK plan). Ends with a barrier.
__device__ __forceinline__ void ll_rank_partials(const afd_i32* s_ids, afd_i32 num_partials,
                                                 afd_i32 num_experts, afd_i32 expert_per_rank,
                                                 const afd_i32* s_start, const afd_i32* s_rank_off,
                                                 unsigned short* s_warp_cols, afd_i32* s_pos) {
  constexpr unsigned int ALL = 0xffffffffu;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned int lower = (1u << lane) - 1u;
  const afd_i32 seg = (((num_partials + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK) + 31) & ~31;
  const afd_i32 seg_begin = min(warp * seg, num_partials);
  const afd_i32 seg_end = min(seg_begin + seg, num_partials);
  unsigned short* cols = s_warp_cols + warp * num_experts;
  for (afd_i32 p0 = seg_begin; p0 < seg_end; p0 += 32) {  // warp-uniform trip count
    const afd_i32 p = p0 + lane;
    const afd_i32 e = p < seg_end ? s_ids[p] : -1;
    const unsigned int same = __match_any_sync(ALL, e);
    if (e >= 0) s_pos[p] = cols[e] + __popc(same & lower);
    __syncwarp();  // every lane read the counts before the lowest lane of a group adds
    if (e >= 0 && lane == __ffs(same) - 1) cols[e] = static_cast<unsigned short>(cols[e] + __popc(same));
    __syncwarp();
  }
  __syncthreads();
  for (int c = tid; c < num_experts; c += SCATTER_THREADS) {
    afd_i32 run = s_start[c] - s_rank_off[c / expert_per_rank];
    for (int w = 0; w < ROWS_PER_BLOCK; ++w) {
      const afd_i32 count = s_warp_cols[w * num_experts + c];
      s_warp_cols[w * num_experts + c] = static_cast<unsigned short>(run);
      run += count;
    }
  }
  __syncthreads();
  for (afd_i32 p = seg_begin + lane; p < seg_end; p += 32) s_pos[p] += cols[s_ids[p]];
  __syncthreads();
}

// One warp: the route-table row `row` of cell (t, j) in `slot`: token, shared flag, the staging
// rows of t's partials on j in k order (-1 pad) and their fp32 weight bits (0 pad); the same
// words as dedup_attn.cuh's write_dedup_cell.
__device__ __forceinline__ void ll_route_row(const SlotGeometry& geo, char* slot, afd_i32 row,
                                             afd_i32 t, afd_i32 j, bool shared, const afd_i32* ids,
                                             const afd_i32* pos, const float* weights,
                                             afd_i32 top_k, afd_i32 expert_per_rank, int lane) {
  constexpr unsigned int ALL = 0xffffffffu;
  afd_i32* entry = reinterpret_cast<afd_i32*>(slot + geo.off_route) +
                   static_cast<afd_i64>(row) * (ROUTE_FIXED_WORDS + 2 * top_k);
  if (lane == 0) {
    entry[ROUTE_TOKEN] = t;
    entry[ROUTE_SHARED] = shared ? 1 : 0;
  }
  afd_i32 filled = 0;
  for (afd_i32 k0 = 0; k0 < top_k; k0 += 32) {
    const afd_i32 k = k0 + lane;
    const bool mine = k < top_k && ids[k] / expert_per_rank == j;
    const unsigned int votes = __ballot_sync(ALL, mine);
    if (mine) {
      const afd_i32 s = filled + __popc(votes & ((1u << lane) - 1u));
      entry[ROUTE_SLOTS + s] = pos[k];
      entry[ROUTE_SLOTS + top_k + s] = __float_as_int(weights[k]);
    }
    filled += __popc(votes);
  }
  for (afd_i32 s = filled + lane; s < top_k; s += 32) {
    entry[ROUTE_SLOTS + s] = -1;
    entry[ROUTE_SLOTS + top_k + s] = 0;
  }
}

// Block 0, every thread, after the plan: the plan's and rows' outputs (as afd_dedup_dispatch_fused's
// block 0), row_map for every cell of the first T tokens, and (ok) the route-table rows.
__device__ __forceinline__ void ll_block0_outputs(
    const BlockPlan& plan, bool ok, afd_i32 num_tokens, afd_i32 top_k, afd_i32 expert_per_rank,
    afd_i32 num_ffn_ranks, const afd_i32* s_ids, const afd_i32* s_pos, const afd_i32* s_hist,
    const afd_i32* s_start, const afd_i32* s_rank_off, const afd_i32* s_srank,
    const unsigned short* s_rows, const afd_i32* s_carry, const float* topk_weights,
    afd_i32* expert_counts, afd_i32* expert_start, afd_i32* rank_offsets, afd_i32* verdict,
    afd_i32* row_map, afd_i32* shared_rank, afd_i32* num_rows, afd_i32* shared_rows,
    const afd_u64* peer_windows, afd_u64 staging, const SlotGeometry& geo, afd_i32 ring,
    afd_i32 src_rank) {
  const int tid = threadIdx.x;
  store_block_plan(plan, s_hist, s_start, s_rank_off, num_ffn_ranks * expert_per_rank,
                   num_ffn_ranks, expert_counts, expert_start, rank_offsets, verdict);
  for (int j = tid; j < num_ffn_ranks; j += SCATTER_THREADS) {
    shared_rows[j] = ok ? s_carry[2 * j] : 0;
    num_rows[j] = ok ? s_carry[2 * j] + s_carry[2 * j + 1] : 0;
  }
  for (int t = tid; t < num_tokens; t += SCATTER_THREADS) shared_rank[t] = ok ? s_srank[t] : -1;
  const afd_i64 num_cells = static_cast<afd_i64>(num_tokens) * num_ffn_ranks;
  for (afd_i64 cell = tid; cell < num_cells; cell += SCATTER_THREADS) {
    row_map[cell] = (ok && s_rows[cell] != LL_NO_ROW) ? static_cast<afd_i32>(s_rows[cell]) : -1;
  }
  if (!ok) return;
  for (afd_i64 cell = tid >> 5; cell < num_cells; cell += ROWS_PER_BLOCK) {  // a warp per cell
    const unsigned short row = s_rows[cell];
    if (row == LL_NO_ROW) continue;  // warp-uniform
    const afd_i32 t = static_cast<afd_i32>(cell / num_ffn_ranks);
    const afd_i32 j = static_cast<afd_i32>(cell % num_ffn_ranks);
    const afd_i64 p0 = static_cast<afd_i64>(t) * top_k;
    ll_route_row(geo, geo.send_slot(peer_windows[j], staging, j, src_rank, ring), row, t, j,
                 s_srank[t] == j, s_ids + p0, s_pos + p0, topk_weights + p0, top_k,
                 expert_per_rank, tid & 31);
  }
}

// grid = dedup_ll_grid (the spec: 1 + afd_dedup_scatter's grid, 1 without cells), block =
// SCATTER_THREADS, dynamic shared memory = dedup_ll_shared_bytes (the spec):
// 4 * (3 * round_up(T*K, 4) + 2 * E + 2 * round_up(T, 4)) + 16 * E + 2 * T * F bytes.
// Arguments, outputs and errors exactly as afd_dedup_dispatch_fused (dedup_attn_fused.cu), F <=
// LL_MAX_FFN_RANKS. Safe in graph capture (no host sync, no allocation).
template <int DT>
__global__ void __launch_bounds__(SCATTER_THREADS)
afd_dedup_dispatch_ll(afd_u64 hidden,  // payload [num_tokens, hidden_size], row-major
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
                      afd_i32* __restrict__ row_map,        // [num_tokens, F] out (block 0)
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
  extern __shared__ __align__(16) afd_i32 s_dyn[];
  __shared__ afd_i64 s_seq[LL_MAX_FFN_RANKS];
  __shared__ afd_i32 s_routed[LL_MAX_FFN_RANKS];
  __shared__ afd_i32 s_shared[LL_MAX_FFN_RANKS];
  __shared__ afd_i32 s_nrows[LL_MAX_FFN_RANKS];
  __shared__ afd_i32 s_rank_off[LL_MAX_FFN_RANKS + 1];
  __shared__ afd_i32 s_carry[2 * LL_MAX_FFN_RANKS];  // rows per (rank, class) in total
  __shared__ afd_i32 s_send;

  const int tid = threadIdx.x;
  const afd_i32 num_experts = num_ffn_ranks * expert_per_rank;
  const afd_i32 num_partials = num_tokens * top_k;
  const afd_i32 p4 = (num_partials + 3) & ~3, t4 = (num_tokens + 3) & ~3;
  afd_i32* s_ids = s_dyn;                      // [P], -1 = bad id
  afd_i32* s_pos = s_ids + p4;                 // [P] (block 0) staging row of each partial
  float* s_weight = reinterpret_cast<float*>(s_pos + p4);  // [P] (block 0) topk_weights
  afd_i32* s_hist = reinterpret_cast<afd_i32*>(s_weight + p4);  // [E] counts
  afd_i32* s_start = s_hist + num_experts;     // [E] exclusive starts
  afd_u32* s_mask = reinterpret_cast<afd_u32*>(s_start + num_experts);  // [T] ranks of token t
  afd_i32* s_srank = reinterpret_cast<afd_i32*>(s_mask + t4);           // [T] shared rank, -1: none
  unsigned short* s_warp_cols = reinterpret_cast<unsigned short*>(s_srank + t4);  // [8][E] (block 0)
  unsigned short* s_rows = s_warp_cols + ROWS_PER_BLOCK * num_experts;            // [T][F]
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const bool is_planner = blockIdx.x == 0;

  // Block 0 writes every route-table row (16 a warp at T = 128): their weights come from shared
  // memory, loaded here in the same round as the ids (plan_in_block's barrier orders them), not
  // by a dependent global load per row.
  if (is_planner) {
    for (afd_i32 p = tid; p < num_partials; p += SCATTER_THREADS) s_weight[p] = topk_weights[p];
  }
  const BlockPlan plan = plan_in_block(topk_ids, num_partials, expert_per_rank, num_ffn_ranks,
                                       routed_cap, layer_idx, status, s_ids, s_hist, s_start,
                                       s_rank_off);
  const bool planned = plan.code == STATUS_OK;  // block-uniform: every id is valid
  const bool ok = planned && !plan.skip;
  if (planned) {
    if (is_planner) {
      for (int c = tid; c < ROWS_PER_BLOCK * num_experts; c += SCATTER_THREADS) s_warp_cols[c] = 0;
    }
    for (afd_i32 t = tid; t < num_tokens; t += SCATTER_THREADS) {
      const afd_i32* ids = s_ids + static_cast<afd_i64>(t) * top_k;
      afd_u32 mask = 0u;
      for (afd_i32 k = 0; k < top_k; ++k) mask |= 1u << (ids[k] / expert_per_rank);
      s_mask[t] = mask;
      s_srank[t] = has_shared ? ll_shared_rank(mask, t % num_ffn_ranks) : -1;
    }
    __syncthreads();
    ll_row_table(s_mask, s_srank, num_tokens, num_ffn_ranks, s_rows, s_carry);
    if (is_planner) {
      ll_rank_partials(s_ids, num_partials, num_experts, expert_per_rank, s_start, s_rank_off,
                       s_warp_cols, s_pos);
    }
  }
  if (is_planner) {
    ll_block0_outputs(plan, ok, num_tokens, top_k, expert_per_rank, num_ffn_ranks, s_ids, s_pos,
                      s_hist, s_start, s_rank_off, s_srank, s_rows, s_carry, s_weight,
                      expert_counts, expert_start, rank_offsets, verdict, row_map, shared_rank,
                      num_rows, shared_rows, peer_windows, staging, geo, ring, src_rank);
  }
  // The payload rows: blocks 1.. (block 0 too when it is the only one), a warp per (cell, part).
  if (ok && (!is_planner || gridDim.x == 1)) {
    const afd_i64 num_cells = static_cast<afd_i64>(num_tokens) * num_ffn_ranks;
    const afd_i64 parts = row_parts(row_bytes);
    const afd_i64 part_bytes = ((row_bytes + parts - 1) / parts + 15) & ~static_cast<afd_i64>(15);
    const afd_i64 copy_blocks = gridDim.x > 1 ? gridDim.x - 1 : 1;
    const afd_i64 copy_block = gridDim.x > 1 ? blockIdx.x - 1 : 0;
    const int lane = tid & 31;
    for (afd_i64 item = copy_block * ROWS_PER_BLOCK + (tid >> 5); item < num_cells * parts;
         item += copy_blocks * ROWS_PER_BLOCK) {
      const afd_i64 cell = item / parts, part = item % parts;
      const unsigned short row = s_rows[cell];
      const afd_i64 begin = part * part_bytes;
      if (row == LL_NO_ROW || begin >= row_bytes) continue;  // warp-uniform
      const afd_i64 t = cell / num_ffn_ranks;
      const afd_i32 j = static_cast<afd_i32>(cell % num_ffn_ranks);
      char* slot = geo.send_slot(peer_windows[j], staging, j, src_rank, ring);
      const char* src_row = static_cast<const char*>(byte_ptr(hidden, t * row_bytes));
      const afd_i64 len = (row_bytes - begin < part_bytes) ? row_bytes - begin : part_bytes;
      warp_copy_row(geo.routed_row(slot, row, row_bytes) + begin, src_row + begin, len, lane);
    }
  }
  if (tid == 0 && planned && plan.skip) {
    atomicOr(reinterpret_cast<unsigned int*>(skipped), 1u);  // released by last_block_done
  }

  // Every block's rows and route-table rows are released at system scope here.
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;

  // Last block: send only if no block skipped; seq, expected, headers, fences, flags.
  if (tid == 0) {
    s_send = (ok && __ldcg(skipped) == 0) ? 1 : 0;
    *skipped = 0;
  }
  __syncthreads();
  const bool send = s_send != 0;
  record_dedup_sends(num_ffn_ranks, s_rank_off,
                     [&](int j) {  // (0 and 0 when not ok, as afd_dedup_rows leaves them)
                       return ok ? DedupRows{s_carry[2 * j], s_carry[2 * j] + s_carry[2 * j + 1]}
                                 : DedupRows{0, 0};
                     },
                     send, always_send, seq_counters, s_seq, s_routed, s_shared, s_nrows, expected,
                     expected_counts);
  if (send) {
    const DispatchHeader hdr{src_rank, layer_idx, stage_idx, num_tokens, top_k,
                             hdr_flags | static_cast<afd_i32>(FLAG_DEDUP)};
    publish_dispatch</*DEDUP=*/true>(geo, peer_windows, staging, ring, num_ffn_ranks,
                                     expert_per_rank, hdr, s_seq, s_routed, s_shared, s_nrows,
                                     s_hist);
  }
  reset_done_counter(done_counter);
}
