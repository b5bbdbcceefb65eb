// wire_constants.cu: reads the wire.cuh constants, limits and SlotGeometry layout back so a
// test compares them with wire.py and afd_cupy/kernels/specs/limits.py. The order is
// tests/helpers/kernels.py WIRE_CONSTANT_NAMES; keep both in sync (a CPU test checks it).
#include "common/wire.cuh"
#include "common/payload.cuh"

using namespace afd;

// Byte offset of a SlotGeometry field (offsetof needs <cstddef>, which NVRTC lacks).
#define AFD_GEO_OFFSET(field) \
  static_cast<afd_i64>(reinterpret_cast<const char*>(&geo.field) - reinterpret_cast<const char*>(&geo))

// grid = 1, block = 1; out: int64 [len(WIRE_CONSTANT_NAMES)], device.
extern "C" __global__ void afd_read_wire_constants(afd_i64* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const SlotGeometry geo{};
  const afd_i64 values[] = {
      MAGIC, VERSION, ALIGN, FLAG_SHUTDOWN, FLAG_DEDUP, FLAG_KEPT_REPLY, FLAG_FP8, SHUTDOWN_SEQ,
      HDR_MAGIC, HDR_VERSION, HDR_SEQ, HDR_SRC_RANK, HDR_LAYER, HDR_STAGE, HDR_NUM_TOKENS,
      HDR_ROUTED_TOKENS, HDR_SHARED_TOKENS, HDR_TOPK, HDR_FLAGS, HDR_ECHO_SEQ, HDR_FIXED_WORDS,
      ROUTE_TOKEN, ROUTE_SHARED, ROUTE_SLOTS, ROUTE_FIXED_WORDS,
      STATUS_OK, STATUS_CAPACITY, STATUS_TIMEOUT, STATUS_BAD_HEADER, STATUS_REPLY_MISMATCH,
      STATUS_SHUTDOWN, STATUS_BAD_EXPERT,
      ST_CODE, ST_PEER, ST_SLOT, ST_RING, ST_EXPECTED, ST_OBSERVED, ST_COUNT, ST_CAP, ST_LAYER, STATUS_WORDS,
      DB_TICKET, DB_STATUS, DB_SLOT, DB_FLAG, DB_HEADER,
      DT_BF16, DT_F16, DT_F32,
      CHUNK, MAX_BLOCKS, MAX_FFN_RANKS, MAX_TOP_K, MAX_EXPERTS, ROWS_PER_BLOCK,
      PLAN_THREADS, SCATTER_THREADS, WAIT_REPLIES_THREADS, COMBINE_THREADS, WAIT_ANY_THREADS,
      REPLY_THREADS, GATE_THREADS, GATE_MAX_EXPERTS, GATE_MAX_TOP_K,
      // element sizes seen by the templates, and the bf16/fp16 conversions of 1.5 and -2.25
      itemsize<DT_BF16>(), itemsize<DT_F16>(), itemsize<DT_F32>(),
      f32_to_bf16(1.5f), f32_to_f16(1.5f),
      static_cast<afd_i64>(bf16_to_f32(0xC010) * 4.0f), static_cast<afd_i64>(f16_to_f32(0xC080) * 4.0f),
      // struct SlotGeometry: size, then the offset of each field in declaration order
      static_cast<afd_i64>(sizeof(SlotGeometry)),
      AFD_GEO_OFFSET(flags_bytes), AFD_GEO_OFFSET(slot_bytes), AFD_GEO_OFFSET(off_header),
      AFD_GEO_OFFSET(off_route), AFD_GEO_OFFSET(off_routed_x), AFD_GEO_OFFSET(off_shared_idx),
      AFD_GEO_OFFSET(off_shared_x), AFD_GEO_OFFSET(num_regions), AFD_GEO_OFFSET(ring_depth),
      AFD_GEO_OFFSET(header_words),
  };
  for (int i = 0; i < static_cast<int>(sizeof(values) / sizeof(values[0])); ++i) out[i] = values[i];
}
