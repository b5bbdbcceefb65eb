// dedup_attn.cu: Attention side of the dedup wire mode (docs/design/dedup.md, docs/design/kernels.md).
//
// A token crosses the link once per FFN rank that owns one of its top-k experts. After the pair
// plan (afd_dispatch_plan, dispatch.cu: pos, expert_counts, verdict):
//   afd_dedup_rows     row_map[t, j] (row of token t in rank j's message, -1: not sent there),
//                      shared_rank[t], num_rows[j], shared_rows[j]
//   afd_dedup_scatter  route table + one payload row per (t, j), headers (FLAG_DEDUP, num_rows
//                      trailer), flags, into each peer's window or, for a put peer, the own
//                      staging slot; expected / expected_counts [F, 3] for the wait
//   afd_wait_replies   (combine.cu, dedup = 1), then
//   afd_dedup_combine  out[t] = out_scale * sum_{j ascending, row_map[t, j] >= 0} reply_j[row]
// Numpy references: afd_cupy/testing/dedup_reference.py (plan_reference, scatter_reference,
// combine_reference).
#include "wire.cuh"
#include "reply_check.cuh"  // combine_wait, store_nan_row, finish_combine
#include "publish.cuh"      // publish_dispatch
#include "plan_block.cuh"   // plan_in_block, store_block_plan (afd_dedup_dispatch_fused)

using namespace afd;

static_assert(CHUNK <= 256, "rows_local packs a chunk-local rank into 8 bits");

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

// Rows of each message: a stable two-class compaction of the (token, rank) pairs. Each pair is
// represented by the token's first partial on that rank and keyed 2j (t's shared experts run on
// j: the message's first rows) or 2j + 1 (the other rows); the row is then, as in the plan,
//   row = (key odd ? shared_rows[j] : 0) + chunk base of the key + rank among equal keys in the chunk.
// grid = max(1, ceil(T*K / CHUNK)), block = PLAN_THREADS (one thread per partial of a chunk).
// With a verdict other than STATUS_OK the ids are not read: row_map and shared_rank are -1 and
// the counts 0. Safe in graph capture.
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
afd_dedup_rows(const afd_i32* __restrict__ topk_ids,  // [num_tokens * top_k], flat t*K+k
               afd_i32 num_tokens, afd_i32 top_k, afd_i32 expert_per_rank, afd_i32 num_ffn_ranks,
               afd_i32 has_shared,
               const afd_i32* __restrict__ verdict,  // [1] the plan's: STATUS_OK = ids are valid
               afd_i32* __restrict__ rows_hist,      // [num_chunks, 2F] scratch
               afd_i32* __restrict__ rows_local,     // [num_tokens * top_k] scratch
               afd_i32* __restrict__ row_map,        // [num_tokens, F] out
               afd_i32* __restrict__ shared_rank,    // [num_tokens] out, -1 without shared experts
               afd_i32* __restrict__ num_rows,       // [F] out
               afd_i32* __restrict__ shared_rows,    // [F] out
               unsigned int* done_counter) {
  __shared__ afd_i32 s_hist[2 * MAX_FFN_RANKS];
  __shared__ __align__(16) afd_i32 s_keys[CHUNK];
  const int tid = threadIdx.x;
  const afd_i32 num_keys = 2 * num_ffn_ranks;
  const afd_i64 num_partials = static_cast<afd_i64>(num_tokens) * top_k;
  const afd_i64 num_chunks = (num_partials + CHUNK - 1) / CHUNK;
  const int chunk = blockIdx.x;
  const bool ok = (*verdict == STATUS_OK);
  const afd_i64 p = static_cast<afd_i64>(chunk) * CHUNK + tid;
  const bool has_partial = chunk < num_chunks && p < num_partials;

  for (int key = tid; key < num_keys; key += PLAN_THREADS) s_hist[key] = 0;
  afd_i32 key = -1;
  if (has_partial) {
    const afd_i64 t = p / top_k;
    const afd_i32 k = static_cast<afd_i32>(p % top_k);
    // -1 everywhere first (the last block writes the rows): partial k clears columns k, k+K, ...
    for (afd_i32 j = k; j < num_ffn_ranks; j += top_k) row_map[t * num_ffn_ranks + j] = -1;
    afd_i32 srank = -1;
    if (ok) {
      const afd_i32* ids = topk_ids + t * top_k;
      const afd_i32 j = ids[k] / expert_per_rank;
      bool first = true;
      for (afd_i32 kk = 0; kk < k && first; ++kk) first = (ids[kk] / expert_per_rank != j);
      if (has_shared) srank = dedup_shared_rank(ids, top_k, expert_per_rank, num_ffn_ranks, t);
      if (first) key = 2 * j + (srank == j ? 0 : 1);
    }
    if (k == 0) shared_rank[t] = srank;
  }
  s_keys[tid] = key;
  __syncthreads();
  const afd_i32 local = block_rank_of_key(s_keys, key);  // among the chunk's equal keys
  if (key >= 0) {
    atomicAdd(&s_hist[key], 1);
    rows_local[p] = (key << 8) | local;
  } else if (has_partial) {
    rows_local[p] = -1;
  }
  __syncthreads();
  if (chunk < num_chunks) {
    afd_i32* row = rows_hist + static_cast<afd_i64>(chunk) * num_keys;
    for (int k = tid; k < num_keys; k += PLAN_THREADS) row[k] = s_hist[k];
  }

  if (!last_block_done(done_counter, /*system_scope=*/false)) return;

  // Last block: per key, exclusive scan of the chunk histograms (in place) and totals.
  for (int k = tid; k < num_keys; k += PLAN_THREADS) {
    afd_i32* column = rows_hist + k;
    afd_i32 run = 0;
    for (afd_i64 c = 0; c < num_chunks; ++c) {
      const afd_i32 v = __ldcg(column + c * num_keys);
      column[c * num_keys] = run;
      run += v;
    }
    s_hist[k] = run;  // totals: shared rows (even keys) and other rows (odd keys) per rank
  }
  __syncthreads();
  for (int j = tid; j < num_ffn_ranks; j += PLAN_THREADS) {
    shared_rows[j] = s_hist[2 * j];
    num_rows[j] = s_hist[2 * j] + s_hist[2 * j + 1];
  }
  for (afd_i64 q = tid; q < num_partials; q += PLAN_THREADS) {
    const afd_i32 packed = __ldcg(rows_local + q);
    if (packed < 0) continue;  // not the first partial of its (token, rank), or a bad verdict
    const afd_i32 k = packed >> 8, local = packed & 0xff;
    const afd_i32 j = k >> 1;
    const afd_i32 base = (k & 1) ? s_hist[k - 1] : 0;  // the other rows follow the shared rows
    row_map[(q / top_k) * num_ffn_ranks + j] =
        base + __ldcg(rows_hist + (q / CHUNK) * num_keys + k) + local;
  }
  reset_done_counter(done_counter);
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
      seq = seq_counters[j] + 1;
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

// grid = max(1, min(ceil(T*F / ROWS_PER_BLOCK), MAX_BLOCKS)), block = SCATTER_THREADS; a warp per
// (token, rank) cell, cells with row_map < 0 skipped. Each message row gets its route-table row
// (token, shared flag, staging rows pos[t, k] of the token's partials on the rank in k order,
// -1 pad, their fp32 weight bits, 0 pad) and a copy of hidden[t]. Then, as afd_dispatch_scatter,
// the last block bumps seq_counters of the ranks with rows (every rank with always_send), writes
// expected[F] and expected_counts[F, 3] = (routed, shared, rows), the headers (flags = hdr_flags |
// FLAG_DEDUP, num_rows at HDR_FIXED_WORDS + epr), fences and stores the flags.
// A zero peer_windows[j] marks a rank reached by puts: its message and flag go to staging slot
// (j, ring), as in afd_dispatch_scatter (docs/design/put-transport.md).
// NOTE: the send decision is the plan's `verdict` (see afd_dispatch_scatter); on a bad verdict
// nothing is written to any peer and `expected` is all 0. pos[t, k] is computed from the plan's
// arrays with the formula of afd_dispatch_scatter (it is never materialized in dedup mode).
template <int DT>
__global__ void __launch_bounds__(SCATTER_THREADS)
afd_dedup_scatter(afd_u64 hidden,  // payload [num_tokens, hidden_size], row-major
                  afd_i32 num_tokens, afd_i32 hidden_size,
                  const afd_i32* __restrict__ topk_ids,    // [num_tokens * top_k]
                  const float* __restrict__ topk_weights,  // [num_tokens * top_k]
                  afd_i32 top_k, afd_i32 expert_per_rank, afd_i32 num_ffn_ranks,
                  const afd_i32* __restrict__ chunk_hist,  // plan outputs
                  const afd_i32* __restrict__ local_rank,
                  const afd_i32* __restrict__ expert_start,
                  const afd_i32* __restrict__ rank_offsets,
                  const afd_i32* __restrict__ expert_counts,
                  const afd_i32* __restrict__ verdict,      // [1] the plan's: STATUS_OK = send
                  const afd_i32* __restrict__ row_map,      // afd_dedup_rows outputs
                  const afd_i32* __restrict__ shared_rank,
                  const afd_i32* __restrict__ num_rows,
                  const afd_i32* __restrict__ shared_rows,
                  const afd_u64* __restrict__ peer_windows,  // [num_ffn_ranks], 0: put peer
                  afd_u64 staging,  // own symmetric put staging (0 without put peers)
                  SlotGeometry geo,
                  afd_i32 ring,  // slot (region = src_rank, ring) of every peer
                  afd_i32 always_send,  // 1: header-only messages to empty peers too (lockstep)
                  afd_i32 src_rank, afd_i32 layer_idx, afd_i32 stage_idx, afd_i32 hdr_flags,
                  afd_i64* seq_counters,     // [num_ffn_ranks], this ring's row
                  afd_i64* expected,         // [num_ffn_ranks] out: seq sent, 0 = not sent
                  afd_i32* expected_counts,  // [num_ffn_ranks, 3] out: (routed, shared, rows)
                  unsigned int* done_counter) {
  __shared__ afd_i64 s_seq[MAX_FFN_RANKS];
  __shared__ afd_i32 s_routed[MAX_FFN_RANKS];
  __shared__ afd_i32 s_shared[MAX_FFN_RANKS];
  __shared__ afd_i32 s_rows[MAX_FFN_RANKS];

  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i32 num_experts = num_ffn_ranks * expert_per_rank;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const afd_i64 num_cells = static_cast<afd_i64>(num_tokens) * num_ffn_ranks;
  const bool ok = (*verdict == STATUS_OK);  // no writer while the scatter runs: one value

  if (ok) {
    // a warp per (cell, part of its row): part 0 also writes the route-table row
    const afd_i64 parts = row_parts(row_bytes);
    const afd_i64 part_bytes = ((row_bytes + parts - 1) / parts + 15) & ~static_cast<afd_i64>(15);
    const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
    for (afd_i64 item = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5);
         item < num_cells * parts; item += warp_stride) {
      const afd_i64 cell = item / parts, part = item % parts;
      const afd_i32 row = row_map[cell];  // the same in every lane: the branch is warp-uniform
      if (row < 0) continue;
      const afd_i64 t = cell / num_ffn_ranks;
      const afd_i32 j = static_cast<afd_i32>(cell % num_ffn_ranks);
      char* slot = geo.send_slot(peer_windows[j], staging, j, src_rank, ring);
      const auto pos_of = [&](afd_i64 p, afd_i32 e) {  // the plan's formula (afd_dispatch_scatter)
        return expert_start[e] + chunk_hist[(p / CHUNK) * num_experts + e] + local_rank[p] -
               rank_offsets[j];
      };
      write_dedup_cell(geo, slot, hidden, row_bytes, part, part_bytes, t, j, row,
                       shared_rank[t] == j, topk_ids + t * top_k, topk_weights, top_k,
                       expert_per_rank, pos_of, lane);
    }
  }

  // Every block's rows and route-table rows are released at system scope here.
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;

  // Last block: headers, then (after a system fence) the flags of the peers sent to.
  record_dedup_sends(num_ffn_ranks, rank_offsets,
                     [&](int j) { return DedupRows{shared_rows[j], num_rows[j]}; }, ok,
                     always_send, seq_counters, s_seq, s_routed, s_shared, s_rows, expected,
                     expected_counts);
  if (ok) {
    // As afd_dispatch_scatter: headers (FLAG_DEDUP, num_rows trailer), then per rank a system
    // fence and the flag (a put peer: the local staging flag word).
    const DispatchHeader hdr{src_rank, layer_idx, stage_idx, num_tokens, top_k,
                             hdr_flags | static_cast<afd_i32>(FLAG_DEDUP)};
    publish_dispatch</*DEDUP=*/true>(geo, peer_windows, staging, ring, num_ffn_ranks,
                                     expert_per_rank, hdr, s_seq, s_routed, s_shared, s_rows,
                                     expert_counts);
  }
  reset_done_counter(done_counter);
}

// grid = max(1, min(T, MAX_BLOCKS)), block = COMBINE_THREADS; blocks stride over tokens, threads
// over hidden. The first warp of each block re-runs the wait (dedup mode) unless
// afd_wait_replies left its pass mark (combine_wait); on any error the block writes NaN rows. Per token the first warp
// lists the reply rows in rank order (row_map[t, j] >= 0: row of rank j's reply in region j's
// routed_x), then out[t] = out_scale * (fp32 sum over that list), rounded once. The last block
// (GPU scope) records the accepted flags in last_seen, as afd_combine.
template <int DT>
__global__ void __launch_bounds__(COMBINE_THREADS)
afd_dedup_combine(afd_u64 out,  // payload [num_tokens, hidden_size]
                  afd_i32 num_tokens, afd_i32 hidden_size,
                  const afd_i32* __restrict__ row_map,  // [num_tokens, num_ffn_ranks]
                  afd_u64 window,  // this rank's own window
                  SlotGeometry geo, afd_i32 num_ffn_ranks, afd_i32 ring,
                  const afd_i64* __restrict__ expected,         // [num_ffn_ranks]
                  const afd_i32* __restrict__ expected_counts,  // [num_ffn_ranks, 3]
                  afd_i32 layer_idx, afd_i32 stage_idx,
                  afd_i64* last_seen,    // [num_slots]
                  afd_i64* reply_flags,  // [num_ffn_ranks + 1]: flags the wait consumed, pass mark
                  afd_i64 timeout_ns, float out_scale, unsigned int* done_counter,
                  afd_i64* status) {
  constexpr unsigned int ALL = 0xffffffffu;
  __shared__ const char* s_row[MAX_FFN_RANKS];
  __shared__ int s_num_rows;
  const int tid = threadIdx.x;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();

  const bool ok = combine_wait(window, geo, num_ffn_ranks, ring, expected, expected_counts,
                               layer_idx, stage_idx, last_seen, reply_flags, timeout_ns, status,
                               /*dedup=*/true);
  char* out_base = static_cast<char*>(byte_ptr(out, 0));
  const afd_u64 misalign = out | window | static_cast<afd_u64>(geo.flags_bytes) |
                           static_cast<afd_u64>(geo.slot_bytes) |
                           static_cast<afd_u64>(geo.off_routed_x) | static_cast<afd_u64>(row_bytes);
  const bool use_vec = (misalign & 15) == 0;
  constexpr int VEC = vec_elems<DT>();

  for (afd_i64 t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    char* out_row = out_base + t * row_bytes;
    if (!ok) {
      store_nan_row<DT>(out_row, hidden_size);
      continue;
    }
    if (tid < 32) {  // the reply rows of token t, in rank order
      int count = 0;
      for (int j0 = 0; j0 < num_ffn_ranks; j0 += 32) {
        const int j = j0 + tid;
        const afd_i32 row = (j < num_ffn_ranks) ? row_map[t * num_ffn_ranks + j] : -1;
        const unsigned int mask = __ballot_sync(ALL, row >= 0);
        if (row >= 0) {
          s_row[count + __popc(mask & ((1u << tid) - 1u))] =
              geo.routed_row(geo.slot(window, j, ring), row, row_bytes);
        }
        count += __popc(mask);
      }
      if (tid == 0) s_num_rows = count;
    }
    __syncthreads();
    const int n = s_num_rows;
    if (use_vec) {
      const afd_i64 num_vec = hidden_size / VEC;
      for (afd_i64 v = tid; v < num_vec; v += COMBINE_THREADS) {
        float acc[VEC], x[VEC];
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] = 0.0f;
        for (int i = 0; i < n; ++i) {
          unpack16<DT>(reinterpret_cast<const uint4*>(s_row[i])[v], x);
#pragma unroll
          for (int u = 0; u < VEC; ++u) acc[u] += x[u];
        }
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] *= out_scale;
        reinterpret_cast<uint4*>(out_row)[v] = pack16<DT>(acc);
      }
    } else {
      for (afd_i64 h = tid; h < hidden_size; h += COMBINE_THREADS) {
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) acc += load_elem<DT>(s_row[i], h);
        store_elem<DT>(out_row, h, acc * out_scale);
      }
    }
    __syncthreads();  // s_row / s_num_rows are rewritten for the next token
  }

  // Last block (GPU scope): last_seen from the flags the wait accepted.
  finish_combine(done_counter, geo, num_ffn_ranks, ring, expected, reply_flags, last_seen, status);
}

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
