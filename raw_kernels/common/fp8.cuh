// fp8.cuh: FP8 (E4M3) wire rows on the device (docs/design/fp8.md): the warp-wide quantizer
// of the dispatch kernels and the dequantizer of the FFN's receive. The numpy reference is
// afd_cupy/wire/fp8.py; both compute the same IEEE operations in the same order, so the bytes
// and the dequantized rows are bit-exact twins (the cuda tests compare them).
//
// A row of a dispatch whose header carries FLAG_FP8 is fp8_row_bytes(H) bytes:
//   | codes: E4M3 [H] | scales: fp32 [H / FP8_GROUP] | zero pad to 16 B |
// group g = channels [128 g, 128 g + 128): scale = amax / 448, codes = e4m3(x * (448 / amax))
// (round to nearest even, saturated); amax 0 gives scale 0 and codes 0 (decodes to zeros).
// NOTE: the E4M3 conversions (cvt ... e4m3x2) need sm_89 or newer.
#pragma once

#include "common/wire.cuh"
#include "common/payload.cuh"

namespace afd {

constexpr int FP8_GROUP = 128;      // channels per fp32 scale (wire.fp8.FP8_GROUP)
constexpr float E4M3_MAX = 448.0f;  // largest finite E4M3 (fn) value
constexpr int FP8_LANE_ELEMS = 8;   // channels per lane: a group is 16 lanes, a warp 2 groups

__device__ __forceinline__ afd_i64 fp8_row_bytes(afd_i64 hidden_size) {
  return (hidden_size + 4 * (hidden_size / FP8_GROUP) + 15) & ~static_cast<afd_i64>(15);
}

// Bytes of one dispatched row: an FP8 wire row when the message's header flags carry FLAG_FP8,
// else a payload row. The header flag decides, so the rows and the header never disagree.
template <int DT>
__device__ __forceinline__ afd_i64 dispatch_row_bytes(afd_i64 hidden_size, afd_i32 hdr_flags) {
  return (hdr_flags & FLAG_FP8) ? fp8_row_bytes(hidden_size) : hidden_size * itemsize<DT>();
}

// Two fp32 -> two E4M3 codes, `lo` in the low byte (first in memory). PTX puts its first
// source operand in the upper half.
__device__ __forceinline__ afd_u32 f32x2_to_e4m3x2(float lo, float hi) {
  unsigned short codes;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(codes) : "f"(hi), "f"(lo));
  return codes;
}

// Two E4M3 codes (low byte first) -> two fp32, exactly (every E4M3 value is an f16 value).
__device__ __forceinline__ void e4m3x2_to_f32x2(afd_u32 codes, float* out) {
  afd_u32 halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<unsigned short>(codes)));
  out[0] = f16_to_f32(static_cast<unsigned short>(halves & 0xffffu));
  out[1] = f16_to_f32(static_cast<unsigned short>(halves >> 16));
}

// FP8_LANE_ELEMS payload elements from `src` into fp32 (16-byte vectors when aligned).
template <int DT>
__device__ __forceinline__ void load_lane_elems(const char* src, float* v) {
  if ((reinterpret_cast<afd_u64>(src) & 15) == 0) {
    const uint4* p = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int i = 0; i < FP8_LANE_ELEMS / vec_elems<DT>(); ++i) unpack16<DT>(p[i], v + i * vec_elems<DT>());
  } else {
#pragma unroll
    for (int i = 0; i < FP8_LANE_ELEMS; ++i) v[i] = load_elem<DT>(src, i);
  }
}

// One warp writes groups [g_begin, g_end) of the FP8 wire row `dst` from the payload row
// `src` (hidden_size DT elements): two groups per pass, 16 lanes per group, 8 channels per
// lane; lane 0 of a group's half-warp writes its scale. The warp that writes the last group
// also zeroes the row's pad. `dst` is 16-B aligned (slot fields are 256-B aligned and wire
// rows a multiple of 16 B).
template <int DT>
__device__ __forceinline__ void warp_quantize_groups(char* dst, const char* src, afd_i64 hidden_size,
                                                     afd_i64 g_begin, afd_i64 g_end, int lane) {
  float* scales = reinterpret_cast<float*>(dst + hidden_size);
  const int half = lane >> 4, sub = lane & 15;
  for (afd_i64 g0 = g_begin; g0 < g_end; g0 += 2) {  // uniform over the warp: shuffles below
    const afd_i64 g = g0 + half;
    const bool active = g < g_end;
    const afd_i64 first = g * FP8_GROUP + sub * FP8_LANE_ELEMS;
    float v[FP8_LANE_ELEMS];
    if (active) {
      load_lane_elems<DT>(src + first * itemsize<DT>(), v);
    } else {
#pragma unroll
      for (int i = 0; i < FP8_LANE_ELEMS; ++i) v[i] = 0.0f;
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < FP8_LANE_ELEMS; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) {  // within the half-warp of the group
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const float inv = amax > 0.0f ? __fdiv_rn(E4M3_MAX, amax) : 0.0f;
    if (!active) continue;
    afd_u32 words[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const float* q = v + 4 * w;
      words[w] = f32x2_to_e4m3x2(__fmul_rn(q[0], inv), __fmul_rn(q[1], inv)) |
                 (f32x2_to_e4m3x2(__fmul_rn(q[2], inv), __fmul_rn(q[3], inv)) << 16);
    }
    *reinterpret_cast<uint2*>(dst + first) = make_uint2(words[0], words[1]);
    if (sub == 0) scales[g] = __fdiv_rn(amax, E4M3_MAX);
  }
  const afd_i64 num_groups = hidden_size / FP8_GROUP;
  if (g_end == num_groups && g_begin < g_end) {
    const afd_i64 used = hidden_size + 4 * num_groups;
    for (afd_i64 b = used + lane; b < fp8_row_bytes(hidden_size); b += 32) dst[b] = 0;
  }
}

// Part `part` of `parts` of a quantized row by one warp (a row split like warp_copy_row_part:
// an even number of groups per part, so the last part may be short or empty).
template <int DT>
__device__ __forceinline__ void warp_quantize_row_part(char* dst, const char* src, afd_i64 hidden_size,
                                                       afd_i64 part, afd_i64 parts, int lane) {
  const afd_i64 num_groups = hidden_size / FP8_GROUP;
  const afd_i64 per_part = (((num_groups + parts - 1) / parts) + 1) & ~static_cast<afd_i64>(1);
  const afd_i64 begin = part * per_part;
  const afd_i64 end = begin + per_part < num_groups ? begin + per_part : num_groups;
  if (begin < end) warp_quantize_groups<DT>(dst, src, hidden_size, begin, end, lane);
}

// One warp decodes the FP8 wire row `src` into the payload row `dst` (hidden_size DT
// elements): value * scale in fp32, rounded once to DT. Both rows 16-B aligned.
template <int DT>
__device__ __forceinline__ void warp_dequantize_row(char* dst, const char* src, afd_i64 hidden_size,
                                                    int lane) {
  const float* scales = reinterpret_cast<const float*>(src + hidden_size);
  for (afd_i64 first = static_cast<afd_i64>(lane) * FP8_LANE_ELEMS; first < hidden_size;
       first += 32 * FP8_LANE_ELEMS) {
    const uint2 codes = *reinterpret_cast<const uint2*>(src + first);
    const float scale = scales[first / FP8_GROUP];
    float v[FP8_LANE_ELEMS];
    e4m3x2_to_f32x2(codes.x & 0xffffu, v);
    e4m3x2_to_f32x2(codes.x >> 16, v + 2);
    e4m3x2_to_f32x2(codes.y & 0xffffu, v + 4);
    e4m3x2_to_f32x2(codes.y >> 16, v + 6);
#pragma unroll
    for (int i = 0; i < FP8_LANE_ELEMS; ++i) v[i] = __fmul_rn(v[i], scale);
    uint4* out = reinterpret_cast<uint4*>(dst + first * itemsize<DT>());
#pragma unroll
    for (int i = 0; i < FP8_LANE_ELEMS / vec_elems<DT>(); ++i) out[i] = pack16<DT>(v + i * vec_elems<DT>());
  }
}

}  // namespace afd
