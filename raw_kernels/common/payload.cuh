// payload.cuh: payload rows on the device: the dtype template argument DT (DT_* in wire.cuh),
// element and 16-byte-vector conversions to and from fp32 (inline PTX, no CUDA headers) and the
// one-warp row copy shared by every kernel that moves rows.
#pragma once

#include "common/wire.cuh"

namespace afd {

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

// Part `part` of `parts` of a row (by one warp): bytes [part * part_bytes, ...) of `nbytes`, with
// part_bytes = ceil(nbytes / parts) rounded up to 16 (a vector boundary), so the last part may
// be short or empty. Spreads a few long rows over more warps: one warp alone copies a 14 KiB
// row in 7 dependent rounds of loads.
__device__ __forceinline__ void warp_copy_row_part(void* dst, const void* src, afd_i64 nbytes,
                                                   afd_i64 part, afd_i64 parts, int lane) {
  const afd_i64 part_bytes = ((nbytes + parts - 1) / parts + 15) & ~static_cast<afd_i64>(15);
  const afd_i64 begin = part * part_bytes;
  if (begin >= nbytes) return;
  const afd_i64 len = (nbytes - begin < part_bytes) ? nbytes - begin : part_bytes;
  warp_copy_row(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, len, lane);
}

}  // namespace afd
