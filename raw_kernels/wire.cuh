// wire.cuh: device mirror of afd_cupy/wire.py (docs/design/wire-format.md) and helpers shared by every kernel.
//
// The constants below mirror wire.py and the limit table of afd_cupy/kernels/specs.py;
// tests/kernels/test_kernels_cpu.py parses this file and tests/kernels/test_kernels_cuda.py reads them back
// through raw_kernels/probes/wire_constants.cu. Byte offsets of window fields are computed once,
// by wire.WindowLayout, and reach the kernels as one SlotGeometry value (kernel_geometry()).
//
// NOTE: compiled by NVRTC without system headers: no <cstdint>, no cuda_bf16.h / cuda_fp16.h.
// Integer types are spelled with the afd_* typedefs; 16-bit floats are raw words converted
// with inline PTX.
#pragma once

typedef int afd_i32;
typedef unsigned int afd_u32;
typedef long long afd_i64;
typedef unsigned long long afd_u64;

namespace afd {

// ---- wire format (afd_cupy/wire.py) ----------------------------------------------------------
constexpr afd_i64 MAGIC = 0x41464447;  // "AFDG"
constexpr afd_i64 VERSION = 1;
constexpr afd_i64 ALIGN = 256;
constexpr afd_i64 FLAG_SHUTDOWN = 2;  // 1 << 1
constexpr afd_i64 FLAG_DEDUP = 4;     // 1 << 2: a dedup-mode message (docs/design/dedup.md)
constexpr afd_i64 FLAG_KEPT_REPLY = 8;  // 1 << 3: with FLAG_SHUTDOWN, the FFN's last reply kept
// flag value (and header seq) of a shutdown message: above every data seq
constexpr afd_i64 SHUTDOWN_SEQ = 0x7fffffffffffffff;

constexpr int HDR_MAGIC = 0;
constexpr int HDR_VERSION = 1;
constexpr int HDR_SEQ = 2;
constexpr int HDR_SRC_RANK = 3;
constexpr int HDR_LAYER = 4;
constexpr int HDR_STAGE = 5;
constexpr int HDR_NUM_TOKENS = 6;
constexpr int HDR_ROUTED_TOKENS = 7;
constexpr int HDR_SHARED_TOKENS = 8;
constexpr int HDR_TOPK = 9;
constexpr int HDR_FLAGS = 10;
constexpr int HDR_ECHO_SEQ = 11;
constexpr int HDR_FIXED_WORDS = 12;  // expert_counts[expert_per_rank] follow
// (dedup mode: then one more word, num_rows, at HDR_FIXED_WORDS + expert_per_rank)

// dedup route table row (int32): token, shared flag, top_k staging rows (-1 pad), top_k fp32
// weight bit patterns (0 pad); ROUTE_FIXED_WORDS + 2 * top_k words
constexpr int ROUTE_TOKEN = 0;
constexpr int ROUTE_SHARED = 1;
constexpr int ROUTE_SLOTS = 2;
constexpr int ROUTE_FIXED_WORDS = 2;

// ---- status block: int64 status[8] in device memory (afd_cupy/kernels/status.py) -----------
constexpr int STATUS_OK = 0;
constexpr int STATUS_CAPACITY = 1;
constexpr int STATUS_TIMEOUT = 2;
constexpr int STATUS_BAD_HEADER = 3;
constexpr int STATUS_REPLY_MISMATCH = 4;
constexpr int STATUS_SHUTDOWN = 5;
constexpr int STATUS_BAD_EXPERT = 6;  // a topk id outside [0, F*epr): nothing is sent

constexpr int ST_CODE = 0;
constexpr int ST_PEER = 1;
constexpr int ST_SLOT = 2;
constexpr int ST_RING = 3;
constexpr int ST_EXPECTED = 4;
constexpr int ST_OBSERVED = 5;
constexpr int ST_COUNT = 6;
constexpr int ST_CAP = 7;
constexpr int ST_LAYER = 8;  // layer of the dispatch or receive that failed, -1 if none
constexpr int STATUS_WORDS = 9;

// ---- wait_any doorbell: int64 words in pinned host memory ------------------------------------
constexpr int DB_TICKET = 0;
constexpr int DB_STATUS = 1;  // STATUS_OK on arrival, STATUS_TIMEOUT
constexpr int DB_SLOT = 2;
constexpr int DB_FLAG = 3;
constexpr int DB_HEADER = 4;  // header words packed as int32 from int64 word 4 on

// ---- payload dtype codes (template argument DT) ---------------------------------------------
constexpr int DT_BF16 = 0;
constexpr int DT_F16 = 1;
constexpr int DT_F32 = 2;

// ---- limits (afd_cupy/kernels/specs.py KERNEL_LIMITS; the specs check them) ---------------
constexpr int CHUNK = 256;           // partials per afd_dispatch_plan block
constexpr int MAX_BLOCKS = 1024;     // grid cap of the row-copy and combine kernels
constexpr int MAX_FFN_RANKS = 256;   // static shared arrays of afd_dispatch_scatter
constexpr int MAX_TOP_K = 64;        // static shared arrays of afd_combine
constexpr int MAX_EXPERTS = 8192;    // dynamic shared memory of afd_dispatch_plan (4 B each)
constexpr int ROWS_PER_BLOCK = 8;    // warps (one row each) of afd_dispatch_scatter / afd_reply
constexpr int PLAN_THREADS = 256;
constexpr int SCATTER_THREADS = 256;
constexpr int WAIT_REPLIES_THREADS = 32;
constexpr int COMBINE_THREADS = 256;
constexpr int WAIT_ANY_THREADS = 32;
constexpr int REPLY_THREADS = 256;
constexpr int GATE_THREADS = 256;        // afd_gate_topk: 8 warps, one token each
constexpr int GATE_MAX_EXPERTS = 1024;   // afd_gate_topk: 32 experts per lane, in registers
constexpr int GATE_MAX_TOP_K = 32;       // afd_gate_topk: one lane writes one of a token's top_k
static_assert(PLAN_THREADS == CHUNK, "one plan thread per partial of its chunk");
static_assert(PLAN_THREADS == 256, "block_exclusive_scan_256 needs 256 threads");
static_assert(SCATTER_THREADS == 32 * ROWS_PER_BLOCK && REPLY_THREADS == 32 * ROWS_PER_BLOCK,
              "one warp per row");
static_assert(WAIT_REPLIES_THREADS == 32 && WAIT_ANY_THREADS == 32, "one-warp kernels");
static_assert(GATE_THREADS % 32 == 0 && GATE_MAX_EXPERTS % 32 == 0 && GATE_MAX_EXPERTS <= 32 * 32 &&
              GATE_MAX_TOP_K <= 32, "a warp per token, one taken-bit per lane slot, one lane per top_k");

// ---- window geometry (afd_cupy/wire.py WindowLayout.kernel_geometry) -------------------------
// One value per window layout, passed by value to every kernel that addresses a window.
// NOTE: plain 8-byte-aligned fields in this order: the numpy dtype on the Python side has the
// same C layout (checked on the CPU by parsing this struct, on the GPU by the probe's
// sizeof/offsets). Slot (region, ring) is slot number region * ring_depth + ring.
struct SlotGeometry {
  afd_i64 flags_bytes;     // flag words (int64 per slot), padded to ALIGN
  afd_i64 slot_bytes;
  afd_i64 off_header;      // field offsets from the start of a slot
  afd_i64 off_route;
  afd_i64 off_routed_x;
  afd_i64 off_shared_idx;
  afd_i64 off_shared_x;
  afd_i32 num_regions;
  afd_i32 ring_depth;
  afd_i32 header_words;    // HDR_FIXED_WORDS + expert_per_rank

  __device__ __forceinline__ afd_i64 num_slots() const {
    return static_cast<afd_i64>(num_regions) * ring_depth;
  }
  __device__ __forceinline__ afd_i64 slot_index(afd_i32 region, afd_i32 ring) const {
    return static_cast<afd_i64>(region) * ring_depth + ring;
  }
  // Flag word / first byte of slot number `slot` of the window at `base`.
  __device__ __forceinline__ afd_i64* flag_at(afd_u64 base, afd_i64 slot) const {
    return reinterpret_cast<afd_i64*>(base) + slot;
  }
  __device__ __forceinline__ char* slot_at(afd_u64 base, afd_i64 slot) const {
    return reinterpret_cast<char*>(base) + flags_bytes + slot * slot_bytes;
  }
  __device__ __forceinline__ afd_i64* flag(afd_u64 base, afd_i32 region, afd_i32 ring) const {
    return flag_at(base, slot_index(region, ring));
  }
  __device__ __forceinline__ char* slot(afd_u64 base, afd_i32 region, afd_i32 ring) const {
    return slot_at(base, slot_index(region, ring));
  }
  // Where a sender writes its message for `peer` (docs/design/put-transport.md). A non-zero `window`
  // is the peer's window mapped here (direct transport): slot (region = own role rank, ring)
  // of it. A zero `window` marks a peer reached by NVSHMEM puts: the sender's own symmetric
  // `staging`, slot (region = peer, ring), laid out like the receiver's slot; the host then
  // copies it and the flag word (send_flag) to the peer.
  __device__ __forceinline__ char* send_slot(afd_u64 window, afd_u64 staging, afd_i32 peer,
                                             afd_i32 own_region, afd_i32 ring) const {
    return window ? slot(window, own_region, ring) : slot(staging, peer, ring);
  }
  __device__ __forceinline__ afd_i64* send_flag(afd_u64 window, afd_u64 staging, afd_i32 peer,
                                                afd_i32 own_region, afd_i32 ring) const {
    return window ? flag(window, own_region, ring) : flag(staging, peer, ring);
  }
  // Fields of a slot (`slot` from slot() / slot_at()).
  __device__ __forceinline__ afd_i32* header(char* slot) const {
    return reinterpret_cast<afd_i32*>(slot + off_header);
  }
  __device__ __forceinline__ int2* route(char* slot) const {
    return reinterpret_cast<int2*>(slot + off_route);
  }
  __device__ __forceinline__ char* routed_row(char* slot, afd_i64 row, afd_i64 row_bytes) const {
    return slot + off_routed_x + row * row_bytes;
  }
  __device__ __forceinline__ afd_i32* shared_idx(char* slot) const {
    return reinterpret_cast<afd_i32*>(slot + off_shared_idx);
  }
  __device__ __forceinline__ char* shared_row(char* slot, afd_i64 row, afd_i64 row_bytes) const {
    return slot + off_shared_x + row * row_bytes;
  }
};

template <int DT>
__device__ __forceinline__ constexpr int itemsize() { return DT == DT_F32 ? 4 : 2; }

// ---- dtype conversion (raw words <-> fp32) ---------------------------------------------------
__device__ __forceinline__ float bf16_to_f32(unsigned short u) {
  return __uint_as_float(static_cast<afd_u32>(u) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
  unsigned short u;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(u) : "f"(f));
  return u;
}
__device__ __forceinline__ float f16_to_f32(unsigned short u) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
  return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
  unsigned short u;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(u) : "f"(f));
  return u;
}

template <int DT>
__device__ __forceinline__ float load_elem(const void* base, afd_i64 idx) {
  if constexpr (DT == DT_F32) {
    return static_cast<const float*>(base)[idx];
  } else if constexpr (DT == DT_BF16) {
    return bf16_to_f32(static_cast<const unsigned short*>(base)[idx]);
  } else {
    return f16_to_f32(static_cast<const unsigned short*>(base)[idx]);
  }
}

template <int DT>
__device__ __forceinline__ void store_elem(void* base, afd_i64 idx, float v) {
  if constexpr (DT == DT_F32) {
    static_cast<float*>(base)[idx] = v;
  } else if constexpr (DT == DT_BF16) {
    static_cast<unsigned short*>(base)[idx] = f32_to_bf16(v);
  } else {
    static_cast<unsigned short*>(base)[idx] = f32_to_f16(v);
  }
}

// Elements per 16-byte vector.
template <int DT>
__device__ __forceinline__ constexpr int vec_elems() { return 16 / itemsize<DT>(); }

// Unpack one 16-byte vector of DT elements into fp32 (vec_elems<DT>() values).
template <int DT>
__device__ __forceinline__ void unpack16(const uint4& v, float* out) {
  const afd_u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (DT == DT_F32) {
      out[i] = __uint_as_float(w[i]);
    } else if constexpr (DT == DT_BF16) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      out[2 * i] = f16_to_f32(static_cast<unsigned short>(w[i] & 0xffffu));
      out[2 * i + 1] = f16_to_f32(static_cast<unsigned short>(w[i] >> 16));
    }
  }
}

// Pack vec_elems<DT>() fp32 values into one 16-byte vector of DT elements.
template <int DT>
__device__ __forceinline__ uint4 pack16(const float* in) {
  afd_u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (DT == DT_F32) {
      w[i] = __float_as_uint(in[i]);
    } else if constexpr (DT == DT_BF16) {
      w[i] = static_cast<afd_u32>(f32_to_bf16(in[2 * i])) |
             (static_cast<afd_u32>(f32_to_bf16(in[2 * i + 1])) << 16);
    } else {
      w[i] = static_cast<afd_u32>(f32_to_f16(in[2 * i])) |
             (static_cast<afd_u32>(f32_to_f16(in[2 * i + 1])) << 16);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- memory helpers --------------------------------------------------------------------------
__device__ __forceinline__ void* byte_ptr(afd_u64 addr, afd_i64 offset) {
  return reinterpret_cast<void*>(addr + static_cast<afd_u64>(offset));
}

__device__ __forceinline__ afd_i64 load_volatile(const afd_i64* p) {
  return *reinterpret_cast<const volatile afd_i64*>(p);
}
__device__ __forceinline__ void store_volatile(afd_i64* p, afd_i64 v) {
  *reinterpret_cast<volatile afd_i64*>(p) = v;
}
__device__ __forceinline__ afd_i32 load_volatile32(const afd_i32* p) {
  return *reinterpret_cast<const volatile afd_i32*>(p);
}

__device__ __forceinline__ afd_i64 globaltimer_ns() {
  afd_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<afd_i64>(t);
}

// Warps a wide payload row is split across by the dedup row kernels (afd_dedup_scatter,
// afd_dedup_reply; kernels.specs.row_parts mirrors it for their grids): one per ROW_PART_BYTES,
// 1..ROW_MAX_PARTS. A decode-size message has few rows (128 rows of 14 KiB), and one warp per
// row keeps too few loads in flight to approach HBM or link bandwidth.
constexpr afd_i64 ROW_PART_BYTES = 4096;
constexpr afd_i64 ROW_MAX_PARTS = 8;
__device__ __forceinline__ afd_i64 row_parts(afd_i64 row_bytes) {
  const afd_i64 parts = (row_bytes + ROW_PART_BYTES - 1) / ROW_PART_BYTES;
  return parts < 1 ? 1 : (parts > ROW_MAX_PARTS ? ROW_MAX_PARTS : parts);
}

// One warp copies `nbytes` (a multiple of 2) from src to dst: 16-byte vectors when both
// pointers and the size are 16-B aligned, else 4-byte, else 2-byte words. Plain (coherent)
// loads: src may be a window written by a peer.
__device__ __forceinline__ void warp_copy_row(void* dst, const void* src, afd_i64 nbytes, int lane) {
  const afd_u64 misalign = reinterpret_cast<afd_u64>(dst) | reinterpret_cast<afd_u64>(src) |
                           static_cast<afd_u64>(nbytes);
  if ((misalign & 15) == 0) {
    constexpr int UNROLL = 4;
    const afd_i64 n = nbytes >> 4;
    const uint4* s = static_cast<const uint4*>(src);
    uint4* d = static_cast<uint4*>(dst);
    for (afd_i64 base = lane; base < n; base += 32 * UNROLL) {
      uint4 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const afd_i64 i = base + u * 32;
        if (i < n) v[u] = s[i];
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const afd_i64 i = base + u * 32;
        if (i < n) d[i] = v[u];
      }
    }
  } else if ((misalign & 3) == 0) {
    const afd_i64 n = nbytes >> 2;
    const afd_u32* s = static_cast<const afd_u32*>(src);
    afd_u32* d = static_cast<afd_u32*>(dst);
    for (afd_i64 i = lane; i < n; i += 32) d[i] = s[i];
  } else {
    const afd_i64 n = nbytes >> 1;
    const unsigned short* s = static_cast<const unsigned short*>(src);
    unsigned short* d = static_cast<unsigned short*>(dst);
    for (afd_i64 i = lane; i < n; i += 32) d[i] = s[i];
  }
}

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
// acquires with atomicAdd + fence in thread 0 and shares it through bar.sync.
// NOTE: one counter per kernel in flight; the counter is left at 0 for the next launch.
__device__ __forceinline__ bool last_block_done(unsigned int* counter, bool system_scope) {
  __shared__ bool s_is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (system_scope) {
      __threadfence_system();
    } else {
      __threadfence();
    }
    const unsigned int prev = atomicAdd(counter, 1u);
    const bool is_last = (prev == gridDim.x - 1);
    if (is_last) __threadfence();  // acquire: every other block's writes precede its count
    s_is_last = is_last;
  }
  __syncthreads();
  return s_is_last;
}

// The end of a last block's work (every thread of it calls it once): a barrier orders every
// thread's last-block writes before thread 0's GPU-scope fence, which precedes its reset of
// *counter to 0 for the next launch.
__device__ __forceinline__ void reset_done_counter(unsigned int* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    *counter = 0u;
  }
}

// wire.is_late_reply: a reply (not a shutdown) whose echo_seq lies in the 2**31 seqs before
// `want_seq` (modulo 2**32) answers an earlier dispatch whose wait timed out; it is dropped.
__device__ __forceinline__ bool is_late_reply(const afd_i32* header, afd_i64 want_seq) {
  if (load_volatile32(header + HDR_FLAGS) & FLAG_SHUTDOWN) return false;
  const afd_u32 echo = static_cast<afd_u32>(load_volatile32(header + HDR_ECHO_SEQ));
  const afd_u32 behind = static_cast<afd_u32>(want_seq & 0xffffffffll) - echo;
  return behind != 0u && behind < 0x80000000u;
}

__device__ __forceinline__ afd_i64 status_code(const afd_i64* status) {
  return load_volatile(status + ST_CODE);
}

// First error wins: CAS the code word from 0; the winner fills the details and fences.
// Returns true if this call recorded the error.
__device__ __forceinline__ bool report_status(afd_i64* status, afd_i64 code, afd_i64 peer,
                                              afd_i64 slot, afd_i64 ring, afd_i64 expected,
                                              afd_i64 observed, afd_i64 count, afd_i64 cap,
                                              afd_i64 layer) {
  const afd_u64 prev = atomicCAS(reinterpret_cast<afd_u64*>(status + ST_CODE), 0ull,
                                 static_cast<afd_u64>(code));
  if (prev != 0ull) return false;
  store_volatile(status + ST_PEER, peer);
  store_volatile(status + ST_SLOT, slot);
  store_volatile(status + ST_RING, ring);
  store_volatile(status + ST_EXPECTED, expected);
  store_volatile(status + ST_OBSERVED, observed);
  store_volatile(status + ST_COUNT, count);
  store_volatile(status + ST_CAP, cap);
  store_volatile(status + ST_LAYER, layer);
  __threadfence_system();
  return true;
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
