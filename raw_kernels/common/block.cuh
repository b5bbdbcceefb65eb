// block.cuh: block-wide steps shared by the kernels: the last-block-done protocol of the
// multi-block kernels (release, count in, reset), a stable rank of a key among a block's
// threads and the 256-thread exclusive scans of the plans.
#pragma once

#include "common/wire.cuh"

namespace afd {

// Last-block-done protocol. Every thread of every block calls it once, after its own writes.
// The block's writes are gathered by a barrier and released by one fence of thread 0, which then
// counts the block in; the block that completes the count gets true and must reset *counter to
// 0 when done. `system_scope` must be true when the blocks wrote peer or host memory that a
// reader elsewhere will acquire through a flag written after this (scatter, reply); false is
// enough when only this GPU reads the results (plan, combine).
// NOTE (memory model): bar.sync puts every thread's writes before thread 0's fence in
// causality order, and a fence is cumulative over what precedes it, so fence + atomicAdd by
// one thread releases the whole block's writes (the pattern of cooperative groups' grid
// sync); a fence in every thread would add a MEMBAR per warp for nothing. The last block
// acquires with atomicAdd + fence in thread 0 and shares it through bar.sync. The fences are
// fence.acq_rel (wire.cuh: fence_release_sys, fence_acq_rel_gpu), not fence.sc: a release and
// an acquire is all this pattern needs.
// NOTE: one counter per kernel in flight; the counter is left at 0 for the next launch.
__device__ __forceinline__ bool last_block_done(unsigned int* counter, bool system_scope) {
  __shared__ bool s_is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (system_scope) {
      fence_release_sys();
    } else {
      fence_acq_rel_gpu();
    }
    const unsigned int prev = atomicAdd(counter, 1u);
    const bool is_last = (prev == gridDim.x - 1);
    if (is_last) fence_acq_rel_gpu();  // acquire: every other block's writes precede its count
    s_is_last = is_last;
  }
  __syncthreads();
  return s_is_last;
}

// The end of a last block's work (every thread of it calls it once): *counter back to 0 for the
// next launch. No fence and no barrier: the next launch that reads the counter is a later
// kernel on the same stream (one counter per kernel in flight), ordered after this one's end.
__device__ __forceinline__ void reset_done_counter(unsigned int* counter) {
  if (threadIdx.x == 0) *counter = 0u;
}

// Stable rank of this thread's `key` in a block: how many threads before it (lower threadIdx.x)
// hold the same key in `keys` (shared memory, one key per thread, 16-byte aligned). Within the
// warp from the lanes that match (a warp vote: every lane of the warp must call this), then a
// count over the earlier warps' keys read four at a time: a one-key-at-a-time loop over up to
// 255 shared words cost the dispatch plan ~2 us. The result for a negative key is unused by
// the callers (not counted).
__device__ __forceinline__ afd_i32 block_rank_of_key(const afd_i32* keys, afd_i32 key) {
  const int tid = threadIdx.x, lane = tid & 31;
  const unsigned int same = __match_any_sync(0xffffffffu, key);
  afd_i32 rank = __popc(same & ((1u << lane) - 1u));
  const int4* keys4 = reinterpret_cast<const int4*>(keys);
  for (int j = 0; j < (tid >> 5) * 8; ++j) {
    const int4 v = keys4[j];
    rank += (v.x == key) + (v.y == key) + (v.z == key) + (v.w == key);
  }
  return rank;
}

// Exclusive scan over one value per thread of a block of exactly 256 threads; returns this
// thread's exclusive prefix and writes the block total to *total. Uses 8+1 ints of shared memory.
__device__ __forceinline__ afd_i32 block_exclusive_scan_256(afd_i32 value, afd_i32* total) {
  __shared__ afd_i32 s_warp[8];
  __shared__ afd_i32 s_total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  afd_i32 inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const afd_i32 other = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == 31) s_warp[warp] = inclusive;
  __syncthreads();
  if (threadIdx.x == 0) {
    afd_i32 run = 0;
    for (int w = 0; w < 8; ++w) {
      const afd_i32 v = s_warp[w];
      s_warp[w] = run;
      run += v;
    }
    s_total = run;
  }
  __syncthreads();
  const afd_i32 result = s_warp[warp] + inclusive - value;
  *total = s_total;
  __syncthreads();  // s_warp / s_total may be reused by a following call
  return result;
}

// Exclusive scan of counts[0, num_experts) (shared memory) by a block of exactly 256 threads,
// each thread owning a contiguous run of experts: start(e, exclusive_start) is called once per
// expert, after counts[e] was read (so start may overwrite it in place). Returns the total to
// every thread. Ends without a barrier: the caller syncs before reading what start wrote.
template <class Start>
__device__ __forceinline__ afd_i32 block_scan_expert_counts(const afd_i32* counts, int num_experts,
                                                            Start start) {
  const int per_thread = (num_experts + 255) / 256;
  const int e_begin = min(static_cast<int>(threadIdx.x) * per_thread, num_experts);
  const int e_end = min(e_begin + per_thread, num_experts);
  afd_i32 local_sum = 0;
  for (int e = e_begin; e < e_end; ++e) local_sum += counts[e];
  afd_i32 total;
  afd_i32 run = block_exclusive_scan_256(local_sum, &total);
  for (int e = e_begin; e < e_end; ++e) {
    const afd_i32 v = counts[e];
    start(e, run);
    run += v;
  }
  return total;
}

}  // namespace afd
