// combine.cu: Attention-side wait for the expected FFN replies + weighted combine (docs/design/kernels.md).
//
//   out[t] = out_scale * ( sum_k w[t,k] * routed_x[region dest(t,k)][pos[t,k]]
//                          + (has_shared ? shared_x[region t % F][t / F] : 0) )
// fp32 accumulation in a fixed k order (deterministic, no atomics). afd_wait_replies (one
// warp) spins first and leaves a pass mark; a combine block that does not find it (the wait
// failed or did not run) re-checks the flags and headers with its first warp (bounded by
// timeout_ns) before reading; on any error the block writes NaN rows and the first error is
// latched in the status block. The wait and its checks (reply_check.cuh) are shared with the
// dedup combine (dedup_attn.cu).
#include "common/wire.cuh"
#include "common/payload.cuh"
#include "attention/reply_check.cuh"  // wait_replies, combine_wait, combine_part, store_nan_part,
                                      // finish_combine

using namespace afd;

// grid = 1, block = WAIT_REPLIES_THREADS (one warp): spins until every expected reply arrived
// (bounded by timeout_ns) and validates the headers; errors are latched in the status block.
// On success it leaves the dispatch's pass mark in reply_flags[F] (reply_check.cuh: the
// combine's blocks then skip their re-check), else 0 there.
// NOTE: the spin lives in its own one-block kernel, launched right before afd_combine on the
// same stream: if every combine block spun, a combine of >= #SM blocks would hold every SM,
// and a peer's kernel that needs a whole SM (a large-shared-memory GEMM in another MPS
// client) could never be scheduled.
extern "C" __global__ void __launch_bounds__(WAIT_REPLIES_THREADS)
afd_wait_replies(afd_u64 window,  // this rank's own window
                 SlotGeometry geo, afd_i32 num_ffn_ranks, afd_i32 ring,
                 const afd_i64* __restrict__ expected,  // [num_ffn_ranks]
                 // [num_ffn_ranks, 2] (routed, shared); dedup: [num_ffn_ranks, 3] (+ num_rows)
                 const afd_i32* __restrict__ expected_counts,
                 afd_i32 layer_idx, afd_i32 stage_idx,
                 const afd_i64* __restrict__ last_seen,  // [num_slots], read only
                 afd_i64* reply_flags,  // [num_ffn_ranks + 1] out: flags consumed, pass mark
                 afd_i64 timeout_ns, afd_i64* status,
                 afd_i32 dedup) {  // 1: dedup-mode replies (docs/design/dedup.md), 0: pair
  if (blockIdx.x != 0 || threadIdx.x >= 32) return;
  afd_i64 mark = 0;  // lane 0's: wait_pass_mark(expected), from the wait's own loads
  const bool ok = wait_replies(window, geo, num_ffn_ranks, ring, expected, expected_counts,
                               layer_idx, stage_idx, last_seen, reply_flags, timeout_ns, status,
                               dedup != 0, &mark);
  if (threadIdx.x == 0) reply_flags[num_ffn_ranks] = ok ? mark : 0;
}

// grid = max(1, min(T * parts, MAX_BLOCKS)) with parts = combine_parts(row bytes, T), block =
// COMBINE_THREADS; blocks stride over (token, part) items, threads over the part's 16-byte
// vectors. A thread loads one vector of up to COMBINE_LOAD_BATCH reply rows (and the shared
// row) in one round before it adds any: one round of loads per vector instead of one per row.
template <int DT>
__global__ void __launch_bounds__(COMBINE_THREADS)
afd_combine(afd_u64 out,  // payload [num_tokens, hidden_size]
            afd_i32 num_tokens, afd_i32 hidden_size,
            const afd_i32* __restrict__ topk_ids,    // [num_tokens * top_k]
            const float* __restrict__ topk_weights,  // [num_tokens * top_k]
            const afd_i32* __restrict__ pos,         // [num_tokens * top_k]
            afd_i32 top_k, afd_i32 expert_per_rank, afd_i32 num_ffn_ranks, afd_i32 has_shared,
            afd_u64 window,  // this rank's own window
            SlotGeometry geo, afd_i32 ring,
            const afd_i64* __restrict__ expected,         // [num_ffn_ranks]
            const afd_i32* __restrict__ expected_counts,  // [num_ffn_ranks, 2]
            afd_i32 layer_idx, afd_i32 stage_idx,
            afd_i64* last_seen,    // [num_slots]
            afd_i64* reply_flags,  // [num_ffn_ranks + 1]: flags the wait consumed, pass mark
            afd_i64 timeout_ns, float out_scale, unsigned int* done_counter, afd_i64* status) {
  __shared__ float s_weight[MAX_TOP_K];
  __shared__ const char* s_row[MAX_TOP_K];
  __shared__ const char* s_shared_row;
  const int tid = threadIdx.x;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const afd_i64 parts = combine_parts(row_bytes, num_tokens);
  const afd_i64 num_items = static_cast<afd_i64>(num_tokens) * parts;
  // The block's first token's partials do not depend on the replies: loaded before the wait, so
  // that their round trip overlaps it (decode: one item a block).
  afd_i32 first_id = 0, first_pos = 0;
  float first_weight = 0.0f;
  if (tid < top_k && blockIdx.x < num_items) {
    const afd_i64 p = (static_cast<afd_i64>(blockIdx.x) / parts) * top_k + tid;
    first_id = topk_ids[p];
    first_weight = topk_weights[p];
    first_pos = pos[p];
  }

  const bool ok = combine_wait(window, geo, num_ffn_ranks, ring, expected, expected_counts,
                               layer_idx, stage_idx, last_seen, reply_flags, timeout_ns, status,
                               /*dedup=*/false);
  char* out_base = static_cast<char*>(byte_ptr(out, 0));
  const afd_u64 misalign = out | window | static_cast<afd_u64>(geo.flags_bytes) |
                           static_cast<afd_u64>(geo.slot_bytes) |
                           static_cast<afd_u64>(geo.off_routed_x) |
                           static_cast<afd_u64>(geo.off_shared_x) | static_cast<afd_u64>(row_bytes);
  const bool use_vec = (misalign & 15) == 0;
  constexpr int VEC = vec_elems<DT>();

  for (afd_i64 item = blockIdx.x; item < num_items; item += gridDim.x) {
    const CombinePart c = combine_part<DT>(item, parts, hidden_size);
    char* out_row = out_base + c.t * row_bytes;
    if (!ok) {
      store_nan_part<DT>(out_row, c);
      continue;
    }
    if (tid < top_k) {
      const afd_i64 p = c.t * top_k + tid;
      const bool first = item == blockIdx.x;
      const int dest = (first ? first_id : topk_ids[p]) / expert_per_rank;
      s_weight[tid] = first ? first_weight : topk_weights[p];
      s_row[tid] = geo.routed_row(geo.slot(window, dest, ring), first ? first_pos : pos[p], row_bytes);
    }
    if (tid == 0 && has_shared) {
      const int dest = static_cast<int>(c.t % num_ffn_ranks);
      s_shared_row = geo.shared_row(geo.slot(window, dest, ring), c.t / num_ffn_ranks, row_bytes);
    }
    __syncthreads();
    if (use_vec) {
      for (afd_i64 v = c.begin / VEC + tid; v < c.end / VEC; v += COMBINE_THREADS) {
        float acc[VEC], x[VEC];
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] = 0.0f;
        uint4 shared_v = make_uint4(0u, 0u, 0u, 0u);
        if (has_shared) shared_v = reinterpret_cast<const uint4*>(s_shared_row)[v];
        for (int k0 = 0; k0 < top_k; k0 += COMBINE_LOAD_BATCH) {
          uint4 rows[COMBINE_LOAD_BATCH];
#pragma unroll
          for (int b = 0; b < COMBINE_LOAD_BATCH; ++b) {
            if (k0 + b < top_k) rows[b] = reinterpret_cast<const uint4*>(s_row[k0 + b])[v];
          }
#pragma unroll
          for (int b = 0; b < COMBINE_LOAD_BATCH; ++b) {
            if (k0 + b < top_k) {
              unpack16<DT>(rows[b], x);
              const float w = s_weight[k0 + b];
#pragma unroll
              for (int u = 0; u < VEC; ++u) acc[u] = fmaf(w, x[u], acc[u]);
            }
          }
        }
        if (has_shared) {
          unpack16<DT>(shared_v, x);
#pragma unroll
          for (int u = 0; u < VEC; ++u) acc[u] += x[u];
        }
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] *= out_scale;
        reinterpret_cast<uint4*>(out_row)[v] = pack16<DT>(acc);
      }
    } else {
      for (afd_i64 h = c.begin + tid; h < c.end; h += COMBINE_THREADS) {
        float acc = 0.0f;
        for (int k = 0; k < top_k; ++k) acc = fmaf(s_weight[k], load_elem<DT>(s_row[k], h), acc);
        if (has_shared) acc += load_elem<DT>(s_shared_row, h);
        store_elem<DT>(out_row, h, acc * out_scale);
      }
    }
    __syncthreads();  // s_weight / s_row are rewritten for the next item
  }

  // Last block (GPU scope): last_seen from the flags the wait accepted.
  finish_combine(done_counter, geo, num_ffn_ranks, ring, expected, reply_flags, last_seen, status);
}
