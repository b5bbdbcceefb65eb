// dedup_attn.cuh: device code of the Attention side's dedup dispatch (docs/design/dedup.md), shared
// by the staged form (afd_dedup_scatter, dedup_attn.cu) and the one-kernel form
// (afd_dedup_dispatch_fused, dedup_attn_fused.cu): the rank that runs a token's shared experts,
// one (token, rank) cell of a message (payload part and route-table row) and the last block's
// per-rank send record (seq, expected, expected_counts).
#pragma once

#include "common/wire.cuh"
#include "common/payload.cuh"

namespace afd {

// Rank running token t's shared experts: the first of t % F, t % F + 1, ... (mod F) that one of
// the token's ids (`ids`: its top_k ids, all in [0, F * epr)) lives on.
__device__ __forceinline__ afd_i32 dedup_shared_rank(const afd_i32* ids, afd_i32 top_k,
                                                     afd_i32 expert_per_rank, afd_i32 num_ffn_ranks,
                                                     afd_i64 token) {
  const afd_i32 first = static_cast<afd_i32>(token % num_ffn_ranks);
  afd_i32 best_dist = num_ffn_ranks, best = -1;
  for (int k = 0; k < top_k; ++k) {
    const afd_i32 j = ids[k] / expert_per_rank;
    const afd_i32 dist = (j - first + num_ffn_ranks) % num_ffn_ranks;
    if (dist < best_dist) {
      best_dist = dist;
      best = j;
    }
  }
  return best;
}

// Part `part` of message row `row` of cell (t, j), by one warp (afd_dedup_scatter,
// afd_dedup_dispatch_fused): that part of hidden[t] into the row and, with part 0, the
// route-table row: token, shared flag, the staging rows of t's partials on rank j in k order
// (-1 pad) and their fp32 weight bits (0 pad). `ids`: t's top_k expert ids; pos_of(p, e): the
// staging row of partial p (expert e) on its rank.
template <typename PosOf>
__device__ __forceinline__ void write_dedup_cell(const SlotGeometry& geo, char* slot, afd_u64 hidden,
                                                 afd_i64 row_bytes, afd_i64 part, afd_i64 part_bytes,
                                                 afd_i64 t, afd_i32 j, afd_i32 row, bool shared,
                                                 const afd_i32* ids, const float* topk_weights,
                                                 afd_i32 top_k, afd_i32 expert_per_rank,
                                                 PosOf pos_of, int lane) {
  constexpr unsigned int ALL = 0xffffffffu;
  const afd_i64 begin = part * part_bytes;
  if (begin < row_bytes) {  // (a 16-byte-rounded part size can leave the last part empty)
    const char* src_row = static_cast<const char*>(byte_ptr(hidden, t * row_bytes));
    const afd_i64 len = (row_bytes - begin < part_bytes) ? row_bytes - begin : part_bytes;
    warp_copy_row(geo.routed_row(slot, row, row_bytes) + begin, src_row + begin, len, lane);
  }
  if (part != 0) return;
  const afd_i32 route_words = ROUTE_FIXED_WORDS + 2 * top_k;
  afd_i32* entry = reinterpret_cast<afd_i32*>(slot + geo.off_route) +
                   static_cast<afd_i64>(row) * route_words;
  if (lane == 0) {
    entry[ROUTE_TOKEN] = static_cast<afd_i32>(t);
    entry[ROUTE_SHARED] = shared ? 1 : 0;
  }
  afd_i32 filled = 0;  // slots written so far, in k order
  for (afd_i32 k0 = 0; k0 < top_k; k0 += 32) {
    const afd_i32 k = k0 + lane;
    const afd_i32 e = (k < top_k) ? ids[k] : -1;
    const bool mine = k < top_k && e / expert_per_rank == j;
    const unsigned int mask = __ballot_sync(ALL, mine);
    if (mine) {
      const afd_i32 s = filled + __popc(mask & ((1u << lane) - 1u));
      const afd_i64 p = t * top_k + k;
      entry[ROUTE_SLOTS + s] = pos_of(p, e);
      entry[ROUTE_SLOTS + top_k + s] = __float_as_int(topk_weights[p]);
    }
    filled += __popc(mask);
  }
  for (afd_i32 s = filled + lane; s < top_k; s += 32) {
    entry[ROUTE_SLOTS + s] = -1;
    entry[ROUTE_SLOTS + top_k + s] = 0;
  }
}

// Shared and message rows of one rank's dedup message (record_dedup_sends).
struct DedupRows {
  afd_i32 shared, rows;
};

// The last block of a dedup dispatch (every thread): per rank j its routed rows (rank_offsets),
// shared and message rows (rows_of(j)) and, when `send` and the rank has rows (or always_send),
// the next seq; into the block's s_seq / s_routed / s_shared / s_rows for publish_dispatch, and
// expected / expected_counts [F, 3] for the reply wait. Ends with a block barrier.
template <typename RowsOf>
__device__ __forceinline__ void record_dedup_sends(afd_i32 num_ffn_ranks, const afd_i32* rank_offsets,
                                                   RowsOf rows_of, bool send, afd_i32 always_send,
                                                   afd_i64* seq_counters, afd_i64* s_seq,
                                                   afd_i32* s_routed, afd_i32* s_shared,
                                                   afd_i32* s_rows, afd_i64* expected,
                                                   afd_i32* expected_counts) {
  for (int j = threadIdx.x; j < num_ffn_ranks; j += SCATTER_THREADS) {
    const afd_i32 routed = rank_offsets[j + 1] - rank_offsets[j];
    const DedupRows r = rows_of(j);  // rows > 0 exactly when routed > 0
    afd_i64 seq = 0;
    if (send && (r.rows > 0 || always_send)) {
      seq = next_seq(seq_counters[j]);
      seq_counters[j] = seq;
    }
    s_seq[j] = seq;
    s_routed[j] = routed;
    s_shared[j] = r.shared;
    s_rows[j] = r.rows;
    expected[j] = seq;
    expected_counts[3 * j] = routed;  // what the reply must echo (afd_wait_replies, dedup = 1)
    expected_counts[3 * j + 1] = r.shared;
    expected_counts[3 * j + 2] = r.rows;
  }
  __syncthreads();
}

}  // namespace afd
