// plan_block.cuh: the pair plan of a whole dispatch in one block's shared memory, for the
// one-kernel dispatches (afd_dispatch_fused in dispatch.cu, afd_dedup_dispatch_fused in
// dedup_attn_fused.cu; docs/design/kernels.md). Every block of those kernels plans the same dispatch from
// the ids, so no block waits for another; the counts, starts, rank offsets and verdict are the
// ones afd_dispatch_plan (dispatch.cu) computes with a grid.
#pragma once

#include "common/wire.cuh"
#include "common/block.cuh"

namespace afd {

// What plan_in_block decided: the same in every thread of the block.
struct BlockPlan {
  afd_i32 code;     // from the ids alone: STATUS_OK, STATUS_BAD_EXPERT (the lowest bad index)
                    // or STATUS_CAPACITY (the lowest over-full rank); block 0 reports them
  bool skip;        // the ids are fine but an error was latched before: send nothing
  afd_i64 earlier;  // the status code latched before this dispatch (read once per block)
};

// Every thread of a SCATTER_THREADS block calls it (it holds barriers and ends with one).
// Fills the caller's shared arrays: s_ids [num_partials] (the ids, -1 for a bad one), s_hist
// [E] (counts), s_start [E] (exclusive starts) and s_rank_off [F + 1] (each rank's first
// staging row, then the total).
__device__ __forceinline__ BlockPlan plan_in_block(const afd_i32* topk_ids, afd_i32 num_partials,
                                                   afd_i32 expert_per_rank, afd_i32 num_ffn_ranks,
                                                   afd_i32 routed_cap, afd_i32 layer_idx,
                                                   afd_i64* status, afd_i32* s_ids,
                                                   afd_i32* s_hist, afd_i32* s_start,
                                                   afd_i32* s_rank_off) {
  __shared__ afd_i32 s_first_bad, s_code, s_skip;
  __shared__ afd_i64 s_earlier;
  const int tid = threadIdx.x;
  const afd_i32 num_experts = num_ffn_ranks * expert_per_rank;
  for (int e = tid; e < num_experts; e += SCATTER_THREADS) s_hist[e] = 0;
  if (tid == 0) {
    s_first_bad = num_partials;
    s_earlier = status_code(status);  // an error latched before this dispatch: send nothing
  }
  __syncthreads();
  for (int i = tid; i < num_partials; i += SCATTER_THREADS) {
    afd_i32 e = topk_ids[i];
    if (e < 0 || e >= num_experts) {
      atomicMin(&s_first_bad, i);
      e = -1;
    } else {
      atomicAdd(&s_hist[e], 1);
    }
    s_ids[i] = e;
  }
  __syncthreads();
  const afd_i32 total =
      block_scan_expert_counts(s_hist, num_experts, [&](int e, afd_i32 start) { s_start[e] = start; });
  __syncthreads();
  for (int r = tid; r <= num_ffn_ranks; r += SCATTER_THREADS) {
    s_rank_off[r] = (r < num_ffn_ranks) ? s_start[r * expert_per_rank] : total;
  }
  __syncthreads();
  if (tid == 0) {
    // The verdict from the ids, as afd_dispatch_plan decides it (lowest bad index; lowest
    // over-full rank); reported by block 0 only.
    afd_i64 code = STATUS_OK;
    if (s_first_bad < num_partials) {
      code = STATUS_BAD_EXPERT;
      if (blockIdx.x == 0) {
        report_status(status, STATUS_BAD_EXPERT, -1, s_first_bad, -1, num_experts,
                      topk_ids[s_first_bad], -1, -1, layer_idx);
      }
    }
    for (int r = 0; code == STATUS_OK && r < num_ffn_ranks; ++r) {
      const afd_i32 count = s_rank_off[r + 1] - s_rank_off[r];
      if (count > routed_cap) {
        code = STATUS_CAPACITY;
        if (blockIdx.x == 0) {
          report_status(status, STATUS_CAPACITY, r, -1, -1, -1, -1, count, routed_cap, layer_idx);
        }
      }
    }
    s_code = static_cast<afd_i32>(code);
    s_skip = (code == STATUS_OK && s_earlier != STATUS_OK) ? 1 : 0;
  }
  __syncthreads();
  return BlockPlan{s_code, s_skip != 0, s_earlier};
}

// Block 0's copy of the plan, for the host and the tests (every thread of block 0 calls it):
// expert_counts / expert_start [E], rank_offsets [F + 1] and the verdict (the ids' code, else
// the error latched before).
__device__ __forceinline__ void store_block_plan(const BlockPlan& plan, const afd_i32* s_hist,
                                                 const afd_i32* s_start, const afd_i32* s_rank_off,
                                                 afd_i32 num_experts, afd_i32 num_ffn_ranks,
                                                 afd_i32* expert_counts, afd_i32* expert_start,
                                                 afd_i32* rank_offsets, afd_i32* verdict) {
  const int tid = threadIdx.x;
  for (int e = tid; e < num_experts; e += SCATTER_THREADS) {
    expert_counts[e] = s_hist[e];
    expert_start[e] = s_start[e];
  }
  for (int r = tid; r <= num_ffn_ranks; r += SCATTER_THREADS) rank_offsets[r] = s_rank_off[r];
  if (tid == 0) *verdict = (plan.code != STATUS_OK) ? plan.code : static_cast<afd_i32>(plan.earlier);
}

}  // namespace afd
