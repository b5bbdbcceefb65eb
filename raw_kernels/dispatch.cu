// dispatch.cu: Attention-side routing plan and one-sided scatter to every FFN rank (DESIGN §6).
//
// afd_dispatch_plan computes, on the device and without a host round trip, the same wire order
// as planner.plan_dispatch_reference (a stable sort of the flat partials by global expert):
//   wire slot of partial i = expert_start[e] + chunk_hist[i / CHUNK][e] + local_rank[i]
// afd_dispatch_scatter then writes route table, routed rows, shared rows, header and flag into
// each non-empty FFN rank's window, flags last. A status error latched before the scatter
// (capacity, bad expert id, an earlier failure) makes it write nothing to any peer.
#include "wire.cuh"

using namespace afd;

// grid = max(1, ceil(num_partials / CHUNK)), block = CHUNK,
// dynamic shared memory = num_experts * 4 bytes.
extern "C" __global__ void __launch_bounds__(CHUNK)
afd_dispatch_plan(const afd_i32* __restrict__ topk_ids,  // [num_partials], flat t*K+k
                  afd_i32 num_partials, afd_i32 num_experts,  // num_experts = F * epr (padded)
                  afd_i32 epr, afd_i32 num_ffn, afd_i32 routed_cap,
                  afd_i32* __restrict__ chunk_hist,     // [num_chunks, num_experts]
                  afd_i32* __restrict__ local_rank,     // [num_partials]
                  afd_i32* __restrict__ expert_counts,  // [num_experts]
                  afd_i32* __restrict__ expert_start,   // [num_experts]
                  afd_i32* __restrict__ rank_offsets,   // [num_ffn + 1]
                  unsigned int* done_counter, afd_i64* status) {
  extern __shared__ afd_i32 s_hist[];  // [num_experts]
  __shared__ afd_i32 s_ids[CHUNK];
  const int tid = threadIdx.x;
  const int num_chunks = (num_partials + CHUNK - 1) / CHUNK;
  const int chunk = blockIdx.x;
  const afd_i64 begin = static_cast<afd_i64>(chunk) * CHUNK;

  for (int e = tid; e < num_experts; e += CHUNK) s_hist[e] = 0;
  const afd_i64 i = begin + tid;
  afd_i32 expert = -1;
  if (chunk < num_chunks && i < num_partials) {
    expert = topk_ids[i];
    if (expert < 0 || expert >= num_experts) {
      report_status(status, STATUS_BAD_EXPERT, -1, i, -1, num_experts, expert, -1, -1);
      expert = -1;  // not counted: keeps every index below in bounds
    }
  }
  s_ids[tid] = expert;
  __syncthreads();

  if (expert >= 0) {
    atomicAdd(&s_hist[expert], 1);
    afd_i32 rank = 0;
    for (int j = 0; j < tid; ++j) rank += (s_ids[j] == expert);
    local_rank[i] = rank;
  }
  __syncthreads();
  if (chunk < num_chunks) {
    afd_i32* row = chunk_hist + static_cast<afd_i64>(chunk) * num_experts;
    for (int e = tid; e < num_experts; e += CHUNK) row[e] = s_hist[e];
  }

  if (!last_block_done(done_counter, /*system_scope=*/false)) return;

  // Last block: per expert, exclusive scan of the chunk histograms (in place) and totals.
  // SCAN_BATCH chunk rows are loaded before any is stored: one store-then-load per chunk
  // (the compiler cannot rule out aliasing) made this a chain of num_chunks L2 round trips.
  constexpr int SCAN_BATCH = 8;
  for (int e = tid; e < num_experts; e += CHUNK) {
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

  // Exclusive scan over experts: each thread owns a contiguous run of experts.
  const int per_thread = (num_experts + CHUNK - 1) / CHUNK;
  const int e_begin = min(tid * per_thread, num_experts);
  const int e_end = min(e_begin + per_thread, num_experts);
  afd_i32 local_sum = 0;
  for (int e = e_begin; e < e_end; ++e) local_sum += s_hist[e];
  afd_i32 total;
  afd_i32 run = block_exclusive_scan_256(local_sum, &total);
  for (int e = e_begin; e < e_end; ++e) {
    const afd_i32 v = s_hist[e];
    expert_start[e] = run;
    s_hist[e] = run;  // s_hist now holds expert_start
    run += v;
  }
  __syncthreads();
  for (int r = tid; r <= num_ffn; r += CHUNK) rank_offsets[r] = (r < num_ffn) ? s_hist[r * epr] : total;
  __syncthreads();

  if (tid == 0) {
    // Deterministic report: the lowest over-full rank.
    for (int r = 0; r < num_ffn; ++r) {
      const afd_i32 end = (r + 1 < num_ffn) ? s_hist[(r + 1) * epr] : total;
      const afd_i32 count = end - s_hist[r * epr];
      if (count > routed_cap) {
        report_status(status, STATUS_CAPACITY, r, -1, -1, -1, -1, count, routed_cap);
        break;
      }
    }
    __threadfence();
    *done_counter = 0u;
  }
}

// Rows of FFN rank j's round-robin shared slice: |{t in [0, T) : t % F == j}|.
__device__ __forceinline__ afd_i32 shared_rows_of(afd_i32 num_tokens, afd_i32 num_ffn, afd_i32 j) {
  return num_tokens > j ? (num_tokens - j + num_ffn - 1) / num_ffn : 0;
}

constexpr int SCATTER_THREADS = 256;
constexpr int SCATTER_WARPS = SCATTER_THREADS / 32;
constexpr int MAX_FFN = 256;

// grid = min(ceil((NK + T) / 8), 1024) (at least 1), block = 256; a warp per row.
template <int DT>
__global__ void __launch_bounds__(SCATTER_THREADS)
afd_dispatch_scatter(afd_u64 hidden,  // payload [num_tokens, hidden_size], row-major
                     afd_i32 num_tokens, afd_i32 hidden_size,
                     const afd_i32* __restrict__ topk_ids,  // [num_partials]
                     afd_i32 num_partials, afd_i32 top_k, afd_i32 epr, afd_i32 num_ffn,
                     const afd_i32* __restrict__ chunk_hist,  // plan outputs
                     const afd_i32* __restrict__ local_rank,
                     const afd_i32* __restrict__ expert_start,
                     const afd_i32* __restrict__ rank_offsets,
                     const afd_i32* __restrict__ expert_counts,
                     const afd_u64* __restrict__ peer_windows,  // [num_ffn]
                     afd_i64 slot_offset, afd_i32 flags_index,
                     afd_i64 off_header, afd_i64 off_route, afd_i64 off_routed_x,
                     afd_i64 off_shared_idx, afd_i64 off_shared_x,
                     afd_i32 hdr_words, afd_i32 has_shared,
                     afd_i32 always_send,  // 1: header-only messages to empty peers too (lockstep)
                     afd_i32* __restrict__ pos_out,  // [num_partials]
                     afd_i32 src_rank, afd_i32 layer_idx, afd_i32 stage_idx, afd_i32 hdr_flags,
                     afd_i64* seq_counters,  // [num_ffn], this ring's row
                     afd_i64* expected,      // [num_ffn] out
                     unsigned int* done_counter, afd_i64* status) {
  __shared__ afd_i64 s_seq[MAX_FFN];
  __shared__ afd_i32 s_routed[MAX_FFN];
  __shared__ afd_i32 s_shared[MAX_FFN];
  __shared__ bool s_ok;

  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i32 num_experts = num_ffn * epr;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const afd_i64 num_shared_rows = has_shared ? num_tokens : 0;
  const afd_i64 num_rows = static_cast<afd_i64>(num_partials) + num_shared_rows;

  if (tid == 0) s_ok = (status_code(status) == STATUS_OK);
  __syncthreads();

  if (s_ok) {
    const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * SCATTER_WARPS;
    for (afd_i64 r = static_cast<afd_i64>(blockIdx.x) * SCATTER_WARPS + (tid >> 5); r < num_rows;
         r += warp_stride) {
      afd_i64 token;
      char* dst_row;
      if (r < num_partials) {
        const afd_i32 e = topk_ids[r];
        const afd_i32 dest = e / epr;
        const afd_i32 slot = expert_start[e] +
                             chunk_hist[(r / CHUNK) * num_experts + e] + local_rank[r];
        const afd_i32 pos = slot - rank_offsets[dest];
        token = r / top_k;
        char* base = static_cast<char*>(byte_ptr(peer_windows[dest], slot_offset));
        if (lane == 0) {
          pos_out[r] = pos;
          int2* route = reinterpret_cast<int2*>(base + off_route) + pos;
          *route = make_int2(static_cast<afd_i32>(token), static_cast<afd_i32>(r % top_k));
        }
        dst_row = base + off_routed_x + static_cast<afd_i64>(pos) * row_bytes;
      } else {
        token = r - num_partials;
        const afd_i32 dest = static_cast<afd_i32>(token % num_ffn);
        const afd_i64 j = token / num_ffn;
        char* base = static_cast<char*>(byte_ptr(peer_windows[dest], slot_offset));
        if (lane == 0) reinterpret_cast<afd_i32*>(base + off_shared_idx)[j] = static_cast<afd_i32>(token);
        dst_row = base + off_shared_x + j * row_bytes;
      }
      const char* src_row = static_cast<const char*>(byte_ptr(hidden, token * row_bytes));
      warp_copy_row(dst_row, src_row, row_bytes, lane);
    }
  }

  // Every block's rows, route entries and shared indices are released at system scope here.
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;

  // Last block: headers, then (after a system fence) the flags of the non-empty peers.
  const bool ok = (status_code(status) == STATUS_OK);
  for (int j = tid; j < num_ffn; j += SCATTER_THREADS) {
    const afd_i32 routed = rank_offsets[j + 1] - rank_offsets[j];
    const afd_i32 shared = has_shared ? shared_rows_of(num_tokens, num_ffn, j) : 0;
    afd_i64 seq = 0;
    if (ok && (routed + shared > 0 || always_send)) {
      seq = seq_counters[j] + 1;
      seq_counters[j] = seq;
    }
    s_seq[j] = seq;
    s_routed[j] = routed;
    s_shared[j] = shared;
    expected[j] = seq;
  }
  __syncthreads();
  if (ok) {
    const afd_i64 total_words = static_cast<afd_i64>(num_ffn) * hdr_words;
    for (afd_i64 idx = tid; idx < total_words; idx += SCATTER_THREADS) {
      const int j = static_cast<int>(idx / hdr_words), w = static_cast<int>(idx % hdr_words);
      const afd_i64 seq = s_seq[j];
      if (seq == 0) continue;
      afd_i32 value;
      switch (w) {
        case HDR_MAGIC: value = static_cast<afd_i32>(MAGIC); break;
        case HDR_VERSION: value = static_cast<afd_i32>(VERSION); break;
        case HDR_SEQ: value = static_cast<afd_i32>(static_cast<afd_u32>(seq & 0xffffffffll)); break;
        case HDR_SRC_RANK: value = src_rank; break;
        case HDR_LAYER: value = layer_idx; break;
        case HDR_STAGE: value = stage_idx; break;
        case HDR_NUM_TOKENS: value = num_tokens; break;
        case HDR_ROUTED_TOKENS: value = s_routed[j]; break;
        case HDR_SHARED_TOKENS: value = s_shared[j]; break;
        case HDR_TOPK: value = top_k; break;
        case HDR_FLAGS: value = hdr_flags; break;
        case HDR_ECHO_SEQ: value = 0; break;
        default: value = expert_counts[j * epr + (w - HDR_FIXED_WORDS)]; break;
      }
      afd_i32* header = static_cast<afd_i32*>(byte_ptr(peer_windows[j], slot_offset + off_header));
      header[w] = value;
    }
    __syncthreads();  // every header word of the block precedes the fences below
    for (int j = tid; j < num_ffn; j += SCATTER_THREADS) {
      if (s_seq[j] != 0) {
        // Release in the storing thread itself: cumulative over the headers (bar.sync above)
        // and over every block's payload (last_block_done), so all precede the flag.
        __threadfence_system();
        afd_i64* flags = static_cast<afd_i64*>(byte_ptr(peer_windows[j], 0));
        store_volatile(flags + flags_index, s_seq[j]);
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    *done_counter = 0u;
  }
}
