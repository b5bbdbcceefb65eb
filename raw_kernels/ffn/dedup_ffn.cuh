// dedup_ffn.cuh: device steps of the dedup wire mode's FFN side (docs/design/dedup.md, docs/design/kernels.md), shared
// by dedup_ffn.cu (afd_dedup_expand, afd_dedup_reply: the eager path) and ffn_graph_rows.cu
// (afd_graph_dedup_expand, afd_graph_dedup_reply: the graph-driven FFN, docs/design/cuda-graphs.md).
//
// - expand_row: one warp copies one route-table row into local memory, checks the copy with the
//   rules of wire.check_route_table, claims its staging rows and scatters the received row;
// - expand_finish: the last block's verdict (the smallest (rule, row, column) over the grid) and
//   the scratch reset;
// - load_route_slots / reduce_row_part: one warp reduces (part of) one reply row,
//   out = sum_s w_s * routed_out[pos_s] (+ shared_out[r]) in fp32 in slot order, rounded once.
#pragma once

#include "common/wire.cuh"
#include "common/payload.cuh"

namespace afd {

// Route-table rules, in the order wire.check_route_table applies them (mirrored by
// wire.ROUTE_FAULT_*; tests/unit/test_dedup_expand_verdict.py compares both). The verdict is the
// smallest (rule, row, column) that fails, so it names the row the host check names.
constexpr afd_i64 ROUTE_FAULT_TOKEN = 1;      // token outside [0, num_tokens)
constexpr afd_i64 ROUTE_FAULT_SHARED = 2;     // shared flag != (row < num_shared)
constexpr afd_i64 ROUTE_FAULT_PACKING = 3;    // no staging row, or one after a -1 pad
constexpr afd_i64 ROUTE_FAULT_RANGE = 4;      // staging row >= num_routed
constexpr afd_i64 ROUTE_FAULT_DUPLICATE = 5;  // staging row already taken by an earlier row
constexpr afd_i64 ROUTE_FAULT_COUNT = 6;      // the table names != num_routed staging rows

// fault key: rule << 48 | row << 8 | column (all-ones: no fault). Column NO_COLUMN: to be found.
constexpr afd_u64 NO_FAULT = ~0ull;
constexpr afd_u64 NO_COLUMN = 0xff;
constexpr afd_i32 UNCLAIMED = 0x7fffffff;

__device__ __forceinline__ afd_u64 fault_key(afd_i64 rule, afd_i64 row, afd_u64 column) {
  return (static_cast<afd_u64>(rule) << 48) | (static_cast<afd_u64>(row) << 8) | column;
}

// One warp copies one source row to `num_dst` staging rows (`dst_rows`, in shared memory): each
// 16-byte vector (else 4-, else 2-byte word) is loaded once and stored num_dst times.
__device__ __forceinline__ void warp_scatter_row(char* staging, const afd_i32* dst_rows, int num_dst,
                                                 const void* src, afd_i64 row_bytes, int lane) {
  const afd_u64 misalign = reinterpret_cast<afd_u64>(staging) | reinterpret_cast<afd_u64>(src) |
                           static_cast<afd_u64>(row_bytes);
  if ((misalign & 15) == 0) {
    const uint4* s = static_cast<const uint4*>(src);
    for (afd_i64 i = lane; i < (row_bytes >> 4); i += 32) {
      const uint4 v = s[i];
      for (int d = 0; d < num_dst; ++d)
        reinterpret_cast<uint4*>(staging + dst_rows[d] * row_bytes)[i] = v;
    }
  } else if ((misalign & 3) == 0) {
    const afd_u32* s = static_cast<const afd_u32*>(src);
    for (afd_i64 i = lane; i < (row_bytes >> 2); i += 32) {
      const afd_u32 v = s[i];
      for (int d = 0; d < num_dst; ++d)
        reinterpret_cast<afd_u32*>(staging + dst_rows[d] * row_bytes)[i] = v;
    }
  } else {
    const unsigned short* s = static_cast<const unsigned short*>(src);
    for (afd_i64 i = lane; i < (row_bytes >> 1); i += 32) {
      const unsigned short v = s[i];
      for (int d = 0; d < num_dst; ++d)
        reinterpret_cast<unsigned short*>(staging + dst_rows[d] * row_bytes)[i] = v;
    }
  }
}

// One warp expands route-table row r: copies its `width` words from `table` (the window) into
// `words` (its row of the local copy), then checks the copy (never a second read of the window,
// so the reply reduces through exactly what was checked), claims its staging rows in `claims`,
// counts them into *num_claimed and folds the row's fault key into *fault. A row that passes is
// scattered from `src` to each of its staging rows (skipped when `staging` is null: a check
// only). `dst_rows`: this warp's MAX_TOP_K ints of shared memory. Returns the row's fault key,
// the same in every lane (NO_FAULT: the row passed its own checks).
__device__ __forceinline__ afd_u64 expand_row(const afd_i32* table, afd_i32* words, afd_i64 r, int width,
                                              afd_i32 num_tokens, afd_i32 num_routed,
                                              afd_i32 num_shared, afd_i32 top_k, afd_i32* claims,
                                              afd_u64* fault, afd_u32* num_claimed,
                                              afd_i32* dst_rows, char* staging, const char* src,
                                              afd_i64 row_bytes, int lane) {
  for (int w = lane; w < width; w += 32) words[w] = table[r * width + w];
  __syncwarp();
  const afd_i32 token = words[ROUTE_TOKEN];
  const afd_i32 flag = words[ROUTE_SHARED];
  afd_u64 key = NO_FAULT;
  if (token < 0 || token >= num_tokens) {
    key = fault_key(ROUTE_FAULT_TOKEN, r, ROUTE_TOKEN);
  } else if (flag != static_cast<afd_i32>(r < num_shared)) {
    key = fault_key(ROUTE_FAULT_SHARED, r, ROUTE_SHARED);
  }
  // top_k <= 64: slot s is read by lane s and lane s - 32 of a second pass
  int num_dst = 0;
  bool gap = false;  // a -1 pad seen before this slot
  for (int base = 0; base < top_k; base += 32) {
    const int s = base + lane;
    const afd_i32 pos = s < top_k ? words[ROUTE_SLOTS + s] : -1;
    const unsigned int valid = __ballot_sync(0xffffffffu, pos >= 0);
    const unsigned int pad = __ballot_sync(0xffffffffu, s < top_k && pos < 0);
    const unsigned int below = (1u << lane) - 1u;
    const bool after_pad = gap || (pad & below) != 0u;
    afd_u64 mine = NO_FAULT;
    if (pos >= 0 && after_pad) {
      mine = fault_key(ROUTE_FAULT_PACKING, r, ROUTE_SLOTS + s);
    } else if (s == 0 && pos < 0) {
      mine = fault_key(ROUTE_FAULT_PACKING, r, ROUTE_SLOTS);
    } else if (pos >= num_routed) {
      mine = fault_key(ROUTE_FAULT_RANGE, r, ROUTE_SLOTS + s);
    } else if (pos >= 0) {
      // claim the staging row: the smallest row wins; a later claimer (this row or the
      // earlier claimant) is a duplicate. The smallest such key over the grid is the
      // second-smallest claimer of some staging row, whatever the arrival order.
      const afd_i32 prev = atomicMin(claims + pos, static_cast<afd_i32>(r));
      if (prev != UNCLAIMED) {
        const afd_i64 later = prev > r ? prev : r;
        mine = fault_key(ROUTE_FAULT_DUPLICATE, later, NO_COLUMN);
      }
      dst_rows[s] = pos;
    }
    key = mine < key ? mine : key;
    const unsigned int in_range = __ballot_sync(0xffffffffu, pos >= 0 && pos < num_routed);
    if (lane == 0) atomicAdd(num_claimed, static_cast<afd_u32>(__popc(in_range)));
    if (!gap) num_dst = base + __popc(valid & ~(valid + 1u));  // the packed prefix
    gap = gap || pad != 0u;
  }
  // warp-wide minimum of the fault keys, one atomic per warp
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const afd_u64 other = __shfl_xor_sync(0xffffffffu, key, d);
    key = other < key ? other : key;
  }
  if (lane == 0 && key != NO_FAULT) atomicMin(reinterpret_cast<unsigned long long*>(fault), key);
  __syncwarp();
  // A row that passed its own checks is expanded (all its slots are < num_routed).
  if (key == NO_FAULT && staging != nullptr) {
    warp_scatter_row(staging, dst_rows, num_dst, src, row_bytes, lane);
  }
  __syncwarp();  // dst_rows is rewritten by the warp's next row
  return key;
}

// The verdict of an expansion: rule 0 = the table is accepted, else wire.ROUTE_FAULT_* with the
// words of the status record afd_dedup_expand latches (docs/design/kernels.md: ST_COUNT = row,
// ST_SLOT = column, ST_EXPECTED, ST_OBSERVED; -1 where a word does not apply).
struct RouteVerdict {
  afd_i64 rule, row, column, expected, observed;
};

// The last block of an expansion (every thread calls it): the count rule, the column of a
// duplicate, and the scratch (fault, num_claimed, claims) left as the next launch needs it.
// The verdict is valid in thread 0 only.
__device__ RouteVerdict expand_finish(afd_u64* fault, afd_u32* num_claimed, afd_i32* claims,
                                      const afd_i32* route_copy, int width, afd_i32 num_tokens,
                                      afd_i32 num_routed, afd_i32 num_shared, afd_i32 top_k) {
  RouteVerdict v{0, -1, -1, -1, -1};
  if (threadIdx.x == 0) {
    const afd_u32 claimed = *num_claimed;
    afd_u64 key = *fault;
    if (key == NO_FAULT && claimed != static_cast<afd_u32>(num_routed)) {
      key = fault_key(ROUTE_FAULT_COUNT, 0, 0);
    }
    if (key != NO_FAULT) {
      const afd_i64 rule = static_cast<afd_i64>(key >> 48);
      afd_i64 row = static_cast<afd_i64>((key >> 8) & 0xffffffffffull);
      afd_i64 column = static_cast<afd_i64>(key & 0xff);
      const afd_i32* words = route_copy + row * width;
      afd_i64 expected = -1, observed = -1;
      if (rule == ROUTE_FAULT_TOKEN) {
        expected = num_tokens;
        observed = words[ROUTE_TOKEN];
      } else if (rule == ROUTE_FAULT_SHARED) {
        expected = row < num_shared;
        observed = words[ROUTE_SHARED];
      } else if (rule == ROUTE_FAULT_PACKING) {
        observed = words[column];
      } else if (rule == ROUTE_FAULT_RANGE) {
        expected = num_routed;
        observed = words[column];
      } else if (rule == ROUTE_FAULT_DUPLICATE) {
        // `row` repeats a staging row of an earlier row, or of an earlier slot of its own:
        // find the first such slot (every slot of it is packed and in range here).
        for (int s = 0; s < top_k && column == static_cast<afd_i64>(NO_COLUMN); ++s) {
          const afd_i32 pos = words[ROUTE_SLOTS + s];
          if (pos < 0 || pos >= num_routed) break;
          bool repeated = claims[pos] != row;
          for (int e = 0; e < s; ++e) repeated = repeated || words[ROUTE_SLOTS + e] == pos;
          if (repeated) {
            column = ROUTE_SLOTS + s;
            expected = claims[pos];  // the smallest row that named it
            observed = pos;
          }
        }
      } else {  // ROUTE_FAULT_COUNT
        row = -1;
        column = -1;
        expected = num_routed;
        observed = claimed;
      }
      v = RouteVerdict{rule, row, column, expected, observed};
    }
    *fault = NO_FAULT;
    *num_claimed = 0u;
  }
  __syncthreads();  // thread 0 has read the claims
  for (afd_i64 p = threadIdx.x; p < num_routed; p += blockDim.x) claims[p] = UNCLAIMED;
  return v;
}

// One warp reads the slots of one route-copy row (`words`): staging rows into pos[], fp32
// weights into weight[] (this warp's MAX_TOP_K entries of shared memory each). Returns the
// number of leading slots with a staging row in [0, num_routed): the row's slots (a staging
// row outside that range ends them: never the case for an accepted table).
__device__ __forceinline__ int load_route_slots(const afd_i32* words, afd_i32 top_k,
                                                afd_i32 num_routed, afd_i32* pos, float* weight,
                                                int lane) {
  int num_slots = top_k;
  for (int base = 0; base < top_k; base += 32) {
    const int s = base + lane;
    const afd_i32 p = s < top_k ? words[ROUTE_SLOTS + s] : -1;
    const bool ok = s < top_k && p >= 0 && p < num_routed;
    if (ok) {
      pos[s] = p;
      weight[s] = __int_as_float(words[ROUTE_SLOTS + top_k + s]);
    }
    const unsigned int bad = __ballot_sync(0xffffffffu, s < top_k && !ok);
    if (bad != 0u && num_slots == top_k) num_slots = base + __ffs(bad) - 1;
  }
  __syncwarp();
  return num_slots;
}

// One warp writes part `part` of `parts` (row_parts) of one reply row:
// dst = round(sum_s weight[s] * src_s (+ shared_row)), fp32 in slot order with
// __fmul_rn / __fadd_rn (no FMA contraction: bitwise dedup_reference.reduce_reference rounded
// once), src_s = routed + pos[s] * routed_stride: routed_stride = row bytes for grouped outputs,
// 0 when every slot reads the same row (identity experts: the received row). shared_row: the
// row's shared output, or null. `vectors`: dst, routed, shared_row and row_bytes 16-B aligned.
template <int DT>
__device__ __forceinline__ void reduce_row_part(char* dst, const char* routed, afd_i64 routed_stride,
                                                const afd_i32* pos, const float* weight,
                                                int num_slots, const char* shared_row,
                                                afd_i64 row_bytes, afd_i32 hidden_size,
                                                afd_i64 part, afd_i64 parts, bool vectors, int lane) {
  if (vectors) {
    constexpr int V = vec_elems<DT>();
    const afd_i64 vecs = row_bytes >> 4, per_part = (vecs + parts - 1) / parts;
    const afd_i64 v_end = min(vecs, (part + 1) * per_part);
    for (afd_i64 i = part * per_part + lane; i < v_end; i += 32) {
      float acc[V];
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] = 0.0f;
      for (int s = 0; s < num_slots; ++s) {
        const float w = weight[s];
        float x[V];
        unpack16<DT>(reinterpret_cast<const uint4*>(routed + pos[s] * routed_stride)[i], x);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, x[e]));
      }
      if (shared_row != nullptr) {
        float x[V];
        unpack16<DT>(reinterpret_cast<const uint4*>(shared_row)[i], x);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = __fadd_rn(acc[e], x[e]);
      }
      reinterpret_cast<uint4*>(dst)[i] = pack16<DT>(acc);
    }
  } else {
    const afd_i64 per_part = (static_cast<afd_i64>(hidden_size) + parts - 1) / parts;
    const afd_i64 h_end = min(static_cast<afd_i64>(hidden_size), (part + 1) * per_part);
    for (afd_i64 h = part * per_part + lane; h < h_end; h += 32) {
      float acc = 0.0f;
      for (int s = 0; s < num_slots; ++s) {
        acc = __fadd_rn(acc, __fmul_rn(weight[s], load_elem<DT>(routed + pos[s] * routed_stride, h)));
      }
      if (shared_row != nullptr) acc = __fadd_rn(acc, load_elem<DT>(shared_row, h));
      store_elem<DT>(dst, h, acc);
    }
  }
}

}  // namespace afd
