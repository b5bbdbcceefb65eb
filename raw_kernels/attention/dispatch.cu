// dispatch.cu: Attention-side routing plan and one-sided scatter to every FFN rank (docs/design/kernels.md).
//
// afd_dispatch_plan computes, on the device and without a host round trip, the same wire order
// as planner.plan_dispatch_reference (a stable sort of the flat partials by global expert):
//   wire slot of partial i = expert_start[e] + chunk_hist[i / CHUNK][e] + local_rank[i]
// and its verdict: STATUS_OK, or the status code that stops this dispatch (capacity, bad expert
// id, an error latched earlier). afd_dispatch_scatter then writes route table, routed rows,
// shared rows, header and flag into each non-empty FFN rank's window, flags last, or nothing at
// all when the verdict is not STATUS_OK. With FLAG_FP8 in hdr_flags both dispatch kernels
// quantize the rows into FP8 wire rows on the way (common/fp8.cuh).
#include "common/wire.cuh"
#include "common/payload.cuh"
#include "common/fp8.cuh"           // FLAG_FP8 rows: dispatch_row_bytes, warp_quantize_row_part
#include "common/block.cuh"
#include "common/publish.cuh"        // publish_dispatch
#include "attention/plan_block.cuh"  // plan_in_block, store_block_plan (afd_dispatch_fused)

using namespace afd;

// grid = max(1, ceil(num_partials / CHUNK)), block = PLAN_THREADS (= CHUNK),
// dynamic shared memory = num_experts * 4 bytes.
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
afd_dispatch_plan(const afd_i32* __restrict__ topk_ids,  // [num_partials], flat t*K+k
                  afd_i32 num_partials,
                  afd_i32 num_experts,  // num_ffn_ranks * expert_per_rank (padded)
                  afd_i32 expert_per_rank, afd_i32 num_ffn_ranks, afd_i32 routed_cap,
                  afd_i32 layer_idx,  // named in a latched error
                  afd_i32* __restrict__ chunk_hist,     // [num_chunks, num_experts]
                  afd_i32* __restrict__ local_rank,     // [num_partials]
                  afd_i32* __restrict__ expert_counts,  // [num_experts]
                  afd_i32* __restrict__ expert_start,   // [num_experts]
                  afd_i32* __restrict__ rank_offsets,   // [num_ffn_ranks + 1]
                  afd_i32* __restrict__ verdict,        // [1] out: STATUS_OK = send
                  unsigned int* done_counter, afd_i64* status) {
  extern __shared__ afd_i32 s_hist[];  // [num_experts]
  __shared__ __align__(16) afd_i32 s_ids[CHUNK];
  const int tid = threadIdx.x;
  const int num_chunks = (num_partials + CHUNK - 1) / CHUNK;
  const int chunk = blockIdx.x;
  const afd_i64 begin = static_cast<afd_i64>(chunk) * CHUNK;

  for (int e = tid; e < num_experts; e += PLAN_THREADS) s_hist[e] = 0;
  const afd_i64 i = begin + tid;
  afd_i32 expert = -1;
  if (chunk < num_chunks && i < num_partials) {
    expert = topk_ids[i];
    if (expert < 0 || expert >= num_experts) {
      report_status(status, STATUS_BAD_EXPERT, -1, i, -1, num_experts, expert, -1, -1, layer_idx);
      expert = -1;  // not counted: keeps every index below in bounds
    }
  }
  s_ids[tid] = expert;
  __syncthreads();

  const afd_i32 rank = block_rank_of_key(s_ids, expert);  // stable order within the chunk
  if (expert >= 0) {
    atomicAdd(&s_hist[expert], 1);
    local_rank[i] = rank;
  }
  __syncthreads();
  if (chunk < num_chunks) {
    afd_i32* row = chunk_hist + static_cast<afd_i64>(chunk) * num_experts;
    for (int e = tid; e < num_experts; e += PLAN_THREADS) row[e] = s_hist[e];
  }

  if (!last_block_done(done_counter, /*system_scope=*/false)) return;

  // Last block: per expert, exclusive scan of the chunk histograms (in place) and totals.
  // SCAN_BATCH chunk rows are loaded before any is stored: one store-then-load per chunk
  // (the compiler cannot rule out aliasing) made this a chain of num_chunks L2 round trips.
  constexpr int SCAN_BATCH = 8;
  for (int e = tid; e < num_experts; e += PLAN_THREADS) {
    afd_i32* column = chunk_hist + e;
    afd_i32 run = 0;
    for (int c0 = 0; c0 < num_chunks; c0 += SCAN_BATCH) {
      afd_i32 v[SCAN_BATCH];
#pragma unroll
      for (int u = 0; u < SCAN_BATCH; ++u) {
        const afd_i64 cell = static_cast<afd_i64>(c0 + u) * num_experts;
        v[u] = (c0 + u < num_chunks) ? __ldcg(column + cell) : 0;
      }
#pragma unroll
      for (int u = 0; u < SCAN_BATCH; ++u) {
        if (c0 + u < num_chunks) column[static_cast<afd_i64>(c0 + u) * num_experts] = run;
        run += v[u];
      }
    }
    s_hist[e] = run;
    expert_counts[e] = run;
  }
  __syncthreads();

  const afd_i32 total = block_scan_expert_counts(s_hist, num_experts, [&](int e, afd_i32 start) {
    expert_start[e] = start;
    s_hist[e] = start;  // s_hist now holds expert_start
  });
  __syncthreads();
  for (int r = tid; r <= num_ffn_ranks; r += PLAN_THREADS) {
    rank_offsets[r] = (r < num_ffn_ranks) ? s_hist[r * expert_per_rank] : total;
  }
  __syncthreads();

  if (tid == 0) {
    // The verdict of this dispatch, decided once (see afd_dispatch_scatter). A bad id was
    // reported by the block that saw it and left out of the counts, so the total falls short.
    afd_i64 code = (total != num_partials) ? STATUS_BAD_EXPERT : STATUS_OK;
    for (int r = 0; code == STATUS_OK && r < num_ffn_ranks; ++r) {
      // Deterministic report: the lowest over-full rank.
      const afd_i32 end = (r + 1 < num_ffn_ranks) ? s_hist[(r + 1) * expert_per_rank] : total;
      const afd_i32 count = end - s_hist[r * expert_per_rank];
      if (count > routed_cap) {
        report_status(status, STATUS_CAPACITY, r, -1, -1, -1, -1, count, routed_cap, layer_idx);
        code = STATUS_CAPACITY;
      }
    }
    if (code == STATUS_OK) code = status_code(status);  // an earlier error: send nothing
    *verdict = static_cast<afd_i32>(code);
    *done_counter = 0u;  // read by the next launch only (stream order): no fence
  }
}

// Rows of FFN rank j's round-robin shared slice: |{t in [0, T) : t % F == j}|.
__device__ __forceinline__ afd_i32 shared_rows_of(afd_i32 num_tokens, afd_i32 num_ffn_ranks, afd_i32 j) {
  return num_tokens > j ? (num_tokens - j + num_ffn_ranks - 1) / num_ffn_ranks : 0;
}

// Part `part` of `parts` of row r of a pair dispatch, by a warp (afd_dispatch_scatter: one part,
// afd_dispatch_fused: row_parts): a routed partial (r < num_partials) at staging row `pos` of
// rank `dest` (part 0's lane 0: pos_out[r] and its route entry), or the shared row of token
// r - num_partials (rank t % F, row t / F; part 0's lane 0: its shared index); then that part of
// the token's payload row, copied, or quantized into an FP8 wire row when `hdr_flags` carry
// FLAG_FP8 (fp8.cuh; rows of dispatch_row_bytes then). `dest` and `pos` are unused for a
// shared row.
template <int DT>
__device__ __forceinline__ void write_pair_row(const SlotGeometry& geo,
                                               const afd_u64* __restrict__ peer_windows,
                                               afd_u64 staging, afd_i32 src_rank, afd_i32 ring,
                                               afd_u64 hidden, afd_i32 hidden_size, afd_i32 hdr_flags,
                                               afd_i32 top_k, afd_i32 num_ffn_ranks,
                                               afd_i32 num_partials, afd_i64 r, afd_i32 dest,
                                               afd_i32 pos, afd_i32* __restrict__ pos_out, int lane,
                                               afd_i64 part = 0, afd_i64 parts = 1) {
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const afd_i64 wire_row_bytes = dispatch_row_bytes<DT>(hidden_size, hdr_flags);
  afd_i64 token;
  char* dst_row;
  if (r < num_partials) {
    token = r / top_k;
    char* slot = geo.send_slot(peer_windows[dest], staging, dest, src_rank, ring);
    if (lane == 0 && part == 0) {
      pos_out[r] = pos;
      geo.route(slot)[pos] = make_int2(static_cast<afd_i32>(token), static_cast<afd_i32>(r % top_k));
    }
    dst_row = geo.routed_row(slot, pos, wire_row_bytes);
  } else {
    token = r - num_partials;
    const afd_i32 shared_dest = static_cast<afd_i32>(token % num_ffn_ranks);
    const afd_i64 j = token / num_ffn_ranks;
    char* slot = geo.send_slot(peer_windows[shared_dest], staging, shared_dest, src_rank, ring);
    if (lane == 0 && part == 0) geo.shared_idx(slot)[j] = static_cast<afd_i32>(token);
    dst_row = geo.shared_row(slot, j, wire_row_bytes);
  }
  const char* src_row = static_cast<const char*>(byte_ptr(hidden, token * row_bytes));
  if (hdr_flags & FLAG_FP8) {
    warp_quantize_row_part<DT>(dst_row, src_row, hidden_size, part, parts, lane);
  } else {
    warp_copy_row_part(dst_row, src_row, row_bytes, part, parts, lane);
  }
}

// The last block of a pair dispatch (every thread): per rank j its routed rows (from
// rank_offsets, global or shared), shared rows and, when `send` and the rank has rows (or
// always_send), the next seq; into the block's s_seq / s_routed / s_shared for
// publish_dispatch, and expected / expected_counts [F, 2] for the reply wait. Ends with a
// block barrier.
__device__ __forceinline__ void record_pair_sends(afd_i32 num_ffn_ranks, const afd_i32* rank_offsets,
                                                  afd_i32 num_tokens, afd_i32 has_shared,
                                                  bool send, afd_i32 always_send,
                                                  afd_i64* seq_counters, afd_i64* s_seq,
                                                  afd_i32* s_routed, afd_i32* s_shared,
                                                  afd_i64* expected, afd_i32* expected_counts) {
  for (int j = threadIdx.x; j < num_ffn_ranks; j += SCATTER_THREADS) {
    const afd_i32 routed = rank_offsets[j + 1] - rank_offsets[j];
    const afd_i32 shared = has_shared ? shared_rows_of(num_tokens, num_ffn_ranks, j) : 0;
    afd_i64 seq = 0;
    if (send && (routed + shared > 0 || always_send)) {
      seq = next_seq(seq_counters[j]);
      seq_counters[j] = seq;
    }
    s_seq[j] = seq;
    s_routed[j] = routed;
    s_shared[j] = shared;
    expected[j] = seq;
    expected_counts[2 * j] = routed;  // what the reply must echo (afd_wait_replies)
    expected_counts[2 * j + 1] = shared;
  }
  __syncthreads();
}

// grid = min(ceil((NK + T) / ROWS_PER_BLOCK), MAX_BLOCKS) (at least 1),
// block = SCATTER_THREADS; a warp per row.
// NOTE: whether to send is the plan's `verdict`, written once per dispatch into this ring's
// scratch and read here by every block. The shared status block is not read: another stream
// (a combine latching an error, the host clearing one) may change it between two reads, and
// blocks that decided differently would flag a message whose rows were never written.
template <int DT>
__global__ void __launch_bounds__(SCATTER_THREADS)
afd_dispatch_scatter(afd_u64 hidden,  // payload [num_tokens, hidden_size], row-major
                     afd_i32 num_tokens, afd_i32 hidden_size,
                     const afd_i32* __restrict__ topk_ids,  // [num_partials]
                     afd_i32 num_partials, afd_i32 top_k, afd_i32 expert_per_rank,
                     afd_i32 num_ffn_ranks,
                     const afd_i32* __restrict__ chunk_hist,  // plan outputs
                     const afd_i32* __restrict__ local_rank,
                     const afd_i32* __restrict__ expert_start,
                     const afd_i32* __restrict__ rank_offsets,
                     const afd_i32* __restrict__ expert_counts,
                     const afd_i32* __restrict__ verdict,       // [1] the plan's: STATUS_OK = send
                     const afd_u64* __restrict__ peer_windows,  // [num_ffn_ranks], 0: put peer
                     afd_u64 staging,  // own symmetric put staging (0 without put peers)
                     SlotGeometry geo,
                     afd_i32 ring,  // slot (region = src_rank, ring) of every peer
                     afd_i32 has_shared,
                     afd_i32 always_send,  // 1: header-only messages to empty peers too (lockstep)
                     afd_i32* __restrict__ pos_out,  // [num_partials]
                     afd_i32 src_rank, afd_i32 layer_idx, afd_i32 stage_idx, afd_i32 hdr_flags,
                     afd_i64* seq_counters,     // [num_ffn_ranks], this ring's row
                     afd_i64* expected,         // [num_ffn_ranks] out: seq sent, 0 = not sent
                     afd_i32* expected_counts,  // [num_ffn_ranks, 2] out: (routed, shared) rows
                     unsigned int* done_counter) {
  __shared__ afd_i64 s_seq[MAX_FFN_RANKS];
  __shared__ afd_i32 s_routed[MAX_FFN_RANKS];
  __shared__ afd_i32 s_shared[MAX_FFN_RANKS];

  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i32 num_experts = num_ffn_ranks * expert_per_rank;
  const afd_i64 num_shared_rows = has_shared ? num_tokens : 0;
  const afd_i64 num_rows = static_cast<afd_i64>(num_partials) + num_shared_rows;
  const bool ok = (*verdict == STATUS_OK);  // no writer while the scatter runs: one value

  if (ok) {
    const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
    for (afd_i64 r = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5); r < num_rows;
         r += warp_stride) {
      afd_i32 dest = 0, pos = 0;
      if (r < num_partials) {
        const afd_i32 e = topk_ids[r];
        dest = e / expert_per_rank;
        pos = expert_start[e] + chunk_hist[(r / CHUNK) * num_experts + e] + local_rank[r] -
              rank_offsets[dest];
      }
      write_pair_row<DT>(geo, peer_windows, staging, src_rank, ring, hidden, hidden_size, hdr_flags,
                         top_k, num_ffn_ranks, num_partials, r, dest, pos, pos_out, lane);
    }
  }

  // Every block's rows, route entries and shared indices are released at system scope here.
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;

  // Last block: headers, then (after a system fence) the flags of the non-empty peers.
  record_pair_sends(num_ffn_ranks, rank_offsets, num_tokens, has_shared, ok, always_send,
                    seq_counters, s_seq, s_routed, s_shared, expected, expected_counts);
  if (ok) {
    // Headers, then per rank a system fence and the flag. A put peer's flag goes to the local
    // staging flag word: the host's flag put, queued behind this kernel and a quiet, copies it
    // (docs/design/put-transport.md).
    const DispatchHeader hdr{src_rank, layer_idx, stage_idx, num_tokens, top_k, hdr_flags};
    publish_dispatch</*DEDUP=*/false>(geo, peer_windows, staging, ring, num_ffn_ranks,
                                      expert_per_rank, hdr, s_seq, s_routed, s_shared,
                                      /*rows=*/nullptr, expert_counts);
  }
  reset_done_counter(done_counter);
}

// Plan and scatter in ONE kernel, for decode-size dispatches (docs/design/kernels.md): every block
// plans the whole dispatch itself, in shared memory, from the ids (a few KiB at decode sizes),
// then writes its rows; no block waits for another before its rows, so the plan kernel's
// launch and its chain of global round trips (chunk histograms, the last-block atomic, fences)
// leave the round trip. Same wire order, outputs and publication as afd_dispatch_plan +
// afd_dispatch_scatter; block 0 also writes the plan's outputs (expert_counts, expert_start,
// rank_offsets, verdict) for the host and the tests.
// The verdict from the ids (BAD_EXPERT, CAPACITY) is the same in every block (the same ids).
// An error latched EARLIER (the status block) is read once per block at its start: a block that
// sees one writes no rows and marks `skipped`, and the last block publishes nothing when any
// block skipped (another stream may latch or clear the status mid-kernel, so blocks may
// disagree; rows without a flag are never read).
// grid = scatter_grid(T, K, has_shared, row_bytes), block = SCATTER_THREADS, dynamic shared
// memory = 4 * (round_up(num_partials, 4) + 2 * num_experts) bytes (dispatch_fused_spec).
template <int DT>
__global__ void __launch_bounds__(SCATTER_THREADS)
afd_dispatch_fused(afd_u64 hidden,  // payload [num_tokens, hidden_size], row-major
                   afd_i32 num_tokens, afd_i32 hidden_size,
                   const afd_i32* __restrict__ topk_ids,  // [num_partials], flat t*K+k
                   afd_i32 num_partials, afd_i32 top_k, afd_i32 expert_per_rank,
                   afd_i32 num_ffn_ranks, afd_i32 routed_cap,
                   afd_i32* __restrict__ expert_counts,  // [E] out (block 0)
                   afd_i32* __restrict__ expert_start,   // [E] out (block 0)
                   afd_i32* __restrict__ rank_offsets,   // [F + 1] out (block 0)
                   afd_i32* __restrict__ verdict,        // [1] out (block 0): STATUS_OK = sent
                   afd_i32* skipped,                     // [1] scratch, 0 between dispatches
                   const afd_u64* __restrict__ peer_windows,  // [num_ffn_ranks], 0: put peer
                   afd_u64 staging,  // own symmetric put staging (0 without put peers)
                   SlotGeometry geo, afd_i32 ring, afd_i32 has_shared, afd_i32 always_send,
                   afd_i32* __restrict__ pos_out,  // [num_partials]
                   afd_i32 src_rank, afd_i32 layer_idx, afd_i32 stage_idx, afd_i32 hdr_flags,
                   afd_i64* seq_counters,     // [num_ffn_ranks], this ring's row
                   afd_i64* expected,         // [num_ffn_ranks] out: seq sent, 0 = not sent
                   afd_i32* expected_counts,  // [num_ffn_ranks, 2] out: (routed, shared) rows
                   unsigned int* done_counter, afd_i64* status) {
  extern __shared__ __align__(16) afd_i32 s_dyn[];
  __shared__ afd_i64 s_seq[MAX_FFN_RANKS];
  __shared__ afd_i32 s_routed[MAX_FFN_RANKS];
  __shared__ afd_i32 s_shared[MAX_FFN_RANKS];
  __shared__ afd_i32 s_rank_off[MAX_FFN_RANKS + 1];
  __shared__ afd_i32 s_send;

  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i32 num_experts = num_ffn_ranks * expert_per_rank;
  afd_i32* s_ids = s_dyn;                                // [num_partials], -1 = bad id
  afd_i32* s_hist = s_dyn + ((num_partials + 3) & ~3);   // [E] counts
  afd_i32* s_start = s_hist + num_experts;               // [E] exclusive starts
  const afd_i64 row_bytes = dispatch_row_bytes<DT>(hidden_size, hdr_flags);  // on the wire
  const afd_i64 num_shared_rows = has_shared ? num_tokens : 0;
  const afd_i64 num_rows = static_cast<afd_i64>(num_partials) + num_shared_rows;

  // 1. The plan, in this block's shared memory.
  const BlockPlan plan = plan_in_block(topk_ids, num_partials, expert_per_rank, num_ffn_ranks,
                                       routed_cap, layer_idx, status, s_ids, s_hist, s_start,
                                       s_rank_off);
  if (blockIdx.x == 0) {  // the plan's outputs, for the host and the tests
    store_block_plan(plan, s_hist, s_start, s_rank_off, num_experts, num_ffn_ranks, expert_counts,
                     expert_start, rank_offsets, verdict);
  }

  // 2. This block's rows, a warp per (row, part of the row): few_row_parts spreads a small
  // batch's few long rows over more warps (the grid, scatter_grid with row_bytes, counts them).
  const bool ok = (plan.code == STATUS_OK) && !plan.skip;
  if (ok) {
    const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
    const afd_i64 parts = few_row_parts(row_bytes, num_rows);
    for (afd_i64 item = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5);
         item < num_rows * parts; item += warp_stride) {
      const afd_i64 r = item / parts, part = item % parts;
      afd_i32 dest = 0, pos = 0;
      if (r < num_partials) {
        const afd_i32 e = s_ids[r];
        // Stable rank of partial r among the partials of expert e before it: 32 ids per step.
        afd_i32 rank = 0;
        for (afd_i64 q0 = 0; q0 < r; q0 += 32) {
          const afd_i64 q = q0 + lane;
          rank += __popc(__ballot_sync(0xffffffffu, q < r && s_ids[q] == e));
        }
        dest = e / expert_per_rank;
        pos = s_start[e] + rank - s_rank_off[dest];
      }
      write_pair_row<DT>(geo, peer_windows, staging, src_rank, ring, hidden, hidden_size, hdr_flags,
                         top_k, num_ffn_ranks, num_partials, r, dest, pos, pos_out, lane, part, parts);
    }
  } else if (tid == 0 && plan.skip) {
    atomicOr(reinterpret_cast<unsigned int*>(skipped), 1u);  // released by last_block_done
  }

  // Every block's rows, route entries and shared indices are released at system scope here.
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;

  // 3. Last block: send only if no block skipped, then as afd_dispatch_scatter.
  if (tid == 0) {
    s_send = (plan.code == STATUS_OK && !plan.skip && __ldcg(skipped) == 0) ? 1 : 0;
    *skipped = 0;
  }
  __syncthreads();
  const bool send = s_send != 0;
  record_pair_sends(num_ffn_ranks, s_rank_off, num_tokens, has_shared, send, always_send,
                    seq_counters, s_seq, s_routed, s_shared, expected, expected_counts);
  if (send) {
    const DispatchHeader hdr{src_rank, layer_idx, stage_idx, num_tokens, top_k, hdr_flags};
    publish_dispatch</*DEDUP=*/false>(geo, peer_windows, staging, ring, num_ffn_ranks,
                                      expert_per_rank, hdr, s_seq, s_routed, s_shared,
                                      /*rows=*/nullptr, s_hist);
  }
  reset_done_counter(done_counter);
}
