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
// A decode-size dispatch runs plan, rows and scatter as one kernel instead
// (afd_dedup_dispatch_fused, dedup_attn_fused.cu).
// Numpy references: afd_cupy/testing/dedup_reference.py (plan_reference, scatter_reference,
// combine_reference).
#include "common/wire.cuh"
#include "common/payload.cuh"
#include "common/block.cuh"
#include "common/publish.cuh"         // publish_dispatch
#include "attention/reply_check.cuh"  // combine_wait, combine_part, store_nan_part, finish_combine
#include "attention/dedup_attn.cuh"   // dedup_shared_rank, write_dedup_cell, record_dedup_sends

using namespace afd;

static_assert(CHUNK <= 256, "rows_local packs a chunk-local rank into 8 bits");

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

// grid = max(1, min(T * parts, MAX_BLOCKS)) with parts = combine_parts(row bytes, T), block =
// COMBINE_THREADS; blocks stride over (token, part) items, threads over the part's 16-byte
// vectors (as afd_combine). The first warp of each block re-runs the wait (dedup mode) unless
// afd_wait_replies left its pass mark (combine_wait); on any error the block writes NaN into its
// part. Per item the first warp lists the token's reply rows in rank order (row_map[t, j] >= 0:
// row of rank j's reply in region j's routed_x), then out[t] = out_scale * (fp32 sum over that
// list), rounded once; a thread loads up to DEDUP_LOAD_BATCH of those rows in one round. The
// last block (GPU scope) records the accepted flags in last_seen, as afd_combine.
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
  // reply rows a thread loads in one round: a token's rows come from distinct FFN ranks, few
  constexpr int DEDUP_LOAD_BATCH = 4;
  __shared__ const char* s_row[MAX_FFN_RANKS];
  __shared__ int s_num_rows;
  const int tid = threadIdx.x;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const afd_i64 parts = combine_parts(row_bytes, num_tokens);
  const afd_i64 num_items = static_cast<afd_i64>(num_tokens) * parts;
  // The block's first token's row_map entries (ranks 0..31) do not depend on the replies:
  // loaded before the wait, so that their round trip overlaps it (decode: one item a block).
  const afd_i32 first_row = (tid < num_ffn_ranks && blockIdx.x < num_items)
                                ? row_map[(static_cast<afd_i64>(blockIdx.x) / parts) * num_ffn_ranks + tid]
                                : -1;

  const bool ok = combine_wait(window, geo, num_ffn_ranks, ring, expected, expected_counts,
                               layer_idx, stage_idx, last_seen, reply_flags, timeout_ns, status,
                               /*dedup=*/true);
  char* out_base = static_cast<char*>(byte_ptr(out, 0));
  const afd_u64 misalign = out | window | static_cast<afd_u64>(geo.flags_bytes) |
                           static_cast<afd_u64>(geo.slot_bytes) |
                           static_cast<afd_u64>(geo.off_routed_x) | static_cast<afd_u64>(row_bytes);
  const bool use_vec = (misalign & 15) == 0;
  constexpr int VEC = vec_elems<DT>();

  for (afd_i64 item = blockIdx.x; item < num_items; item += gridDim.x) {
    const CombinePart c = combine_part<DT>(item, parts, hidden_size);
    const afd_i64 t = c.t;
    char* out_row = out_base + t * row_bytes;
    if (!ok) {
      store_nan_part<DT>(out_row, c);
      continue;
    }
    if (tid < 32) {  // the reply rows of token t, in rank order
      int count = 0;
      for (int j0 = 0; j0 < num_ffn_ranks; j0 += 32) {
        const int j = j0 + tid;
        const afd_i32 row = (j0 == 0 && item == blockIdx.x) ? first_row
                            : (j < num_ffn_ranks) ? row_map[t * num_ffn_ranks + j] : -1;
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
      for (afd_i64 v = c.begin / VEC + tid; v < c.end / VEC; v += COMBINE_THREADS) {
        float acc[VEC], x[VEC];
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] = 0.0f;
        for (int i0 = 0; i0 < n; i0 += DEDUP_LOAD_BATCH) {
          uint4 rows[DEDUP_LOAD_BATCH];
#pragma unroll
          for (int b = 0; b < DEDUP_LOAD_BATCH; ++b) {
            if (i0 + b < n) rows[b] = reinterpret_cast<const uint4*>(s_row[i0 + b])[v];
          }
#pragma unroll
          for (int b = 0; b < DEDUP_LOAD_BATCH; ++b) {
            if (i0 + b < n) {
              unpack16<DT>(rows[b], x);
#pragma unroll
              for (int u = 0; u < VEC; ++u) acc[u] += x[u];
            }
          }
        }
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] *= out_scale;
        reinterpret_cast<uint4*>(out_row)[v] = pack16<DT>(acc);
      }
    } else {
      for (afd_i64 h = c.begin + tid; h < c.end; h += COMBINE_THREADS) {
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) acc += load_elem<DT>(s_row[i], h);
        store_elem<DT>(out_row, h, acc * out_scale);
      }
    }
    __syncthreads();  // s_row / s_num_rows are rewritten for the next item
  }

  // Last block (GPU scope): last_seen from the flags the wait accepted.
  finish_combine(done_counter, geo, num_ffn_ranks, ring, expected, reply_flags, last_seen, status);
}
