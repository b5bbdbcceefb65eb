// wire.cuh: device mirror of afd_cupy/wire.py (docs/design/wire-format.md): constants, limits,
// struct SlotGeometry, the seq rule, the late-reply rule and the status block.
//
// The constants below mirror wire.py and the limit table of afd_cupy/kernels/specs/limits.py;
// tests/kernels/test_kernels_cpu.py parses this file and tests/kernels/test_kernels_cuda.py reads them back
// through raw_kernels/probes/wire_constants.cu. Byte offsets of window fields are computed once,
// by wire.WindowLayout, and reach the kernels as one SlotGeometry value (kernel_geometry()).
// Payload dtypes and row copies are in payload.cuh, block-wide steps in block.cuh.
//
// NOTE: compiled by NVRTC without system headers: no <cstdint>, no cuda_bf16.h / cuda_fp16.h.
// Integer types are spelled with the afd_* typedefs; 16-bit floats are raw words converted
// with inline PTX (payload.cuh).
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
constexpr afd_i64 FLAG_FP8 = 16;        // 1 << 4: a dispatch of FP8 wire rows (common/fp8.cuh)
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

// ---- limits (afd_cupy/kernels/specs/limits.py KERNEL_LIMITS; the specs check them) --------
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
constexpr int COMBINE_LOAD_BATCH = 8;  // reply rows a combine thread loads in one round
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
// The pair row kernels (afd_dispatch_fused, afd_graph_reply; kernels.specs.few_row_parts mirrors
// it) cut rows into row_parts only while the rows are few: up to ROW_PART_WARPS warps in all.
// A 128-token pair message has 1152 rows, a warp each already; parts there only add blocks
// beyond what an MPS share keeps resident.
constexpr afd_i64 ROW_PART_WARPS = 1024;
__device__ __forceinline__ afd_i64 few_row_parts(afd_i64 row_bytes, afd_i64 num_rows) {
  const afd_i64 parts = row_parts(row_bytes);
  const afd_i64 room = num_rows > 0 ? ROW_PART_WARPS / num_rows : parts;
  return room < 1 ? 1 : (room < parts ? room : parts);
}

// The combines (afd_combine, afd_dedup_combine; kernels.specs.combine_parts mirrors it) cut
// each token's output row into parts of whole 16-byte vectors, a block a part, while tokens are
// few: up to one vector a thread (a 14 KiB bf16 row: 4 parts of 256 threads), at most
// COMBINE_PART_BLOCKS blocks in all (more blocks cost more than they save: at 128 tokens, 4
// parts made the combine 1.7-2.3 us slower on an H200). A thread then loads one vector of each
// of the token's reply rows in one round.
constexpr afd_i64 COMBINE_PART_BLOCKS = 128;
__device__ __forceinline__ afd_i64 combine_parts(afd_i64 row_bytes, afd_i64 num_tokens) {
  const afd_i64 vecs = (row_bytes + 15) / 16;
  const afd_i64 full = (vecs + COMBINE_THREADS - 1) / COMBINE_THREADS;
  const afd_i64 room = num_tokens > 0 ? COMBINE_PART_BLOCKS / num_tokens : full;
  const afd_i64 parts = room < full ? room : full;
  return parts < 1 ? 1 : parts;
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

// ---- memory order ------------------------------------------------------------------------------
// What the protocol's message passing needs (docs/design/protocol.md): a sender's writes released
// before its flag store, a receiver's reads acquired after its flag load. Acquire/release, not
// sequentially consistent: __threadfence_system() / __threadfence() are fence.sc (MEMBAR.SC.SYS
// / .GPU on sm_90), stronger than any pattern here needs. A flag is polled with an acquire load
// (ld.acquire.sys: a strong load and an L1 invalidate, no MEMBAR), so the read of a message
// needs no fence at all; the lanes of the polling warp read the message after a __syncwarp.
// Release before a store that publishes: every write of this thread, and of the threads ordered
// before it (a block barrier, an acquire), at system scope (peers, other GPUs, the host).
__device__ __forceinline__ void fence_release_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// The same at GPU scope: what only this GPU's threads read (a done counter, the GPU's scratch).
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// A flag word written by another process or GPU: acquire, every read after it sees what the
// writer released before the value read.
__device__ __forceinline__ afd_i64 load_acquire_sys(const afd_i64* p) {
  afd_i64 v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ afd_i64 globaltimer_ns() {
  afd_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<afd_i64>(t);
}

// wire.py's seq rule, the one device home of it (dispatch.cu, dedup_attn.cuh, ffn_graph_stage.cu):
// a sender's messages to one (peer, ring) carry seqs 1, 2, 3, ... (0: nothing sent yet), each its
// predecessor + 1; the flag word of the slot is the seq. The caller owns the counter word.
__device__ __forceinline__ afd_i64 next_seq(afd_i64 prev_seq) { return prev_seq + 1; }

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

}  // namespace afd
