// dedup_ffn.cu: the FFN side of the dedup wire mode (docs/design.md §3.5, §5).
//
// afd_dedup_expand<DT>: after wait_any, copy the slot's route table into local memory, check
// it row by row (the rules of wire.check_route_table) and scatter each received row into the
// slot's local grouped staging, one copy per staging row pos[t, k] of its route-table row.
// afd_dedup_reply<DT>: after the worker, reduce the grouped outputs back to one row per received
// row, out[r] = sum_s w_s * routed_out[pos_s] (+ shared_out[r], r < S), in fp32 in slot order,
// rounded once, straight into the Attention peer's window (a put peer: the own staging slot, as
// afd_reply); then header, system fence, flag.
#include "wire.cuh"

using namespace afd;

namespace {

// Route-table rules, in the order wire.check_route_table applies them (mirrored by
// wire.ROUTE_FAULT_*; tests/test_kernels_cpu.py compares both). The verdict is the smallest
// (rule, row, column) that fails, so it names the row the host check names.
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

// The last block of afd_dedup_expand: the count rule, the column of a duplicate, the status
// record (thread 0), and the scratch left as the next launch needs it.
__device__ void expand_finish(afd_u64* fault, afd_u32* num_claimed, afd_i32* claims,
                              const afd_i32* route_copy, int width, afd_i32 num_rows,
                              afd_i32 num_tokens, afd_i32 num_routed, afd_i32 num_shared,
                              afd_i32 top_k, afd_i32 region, afd_i32 ring, afd_i32 layer_idx,
                              afd_i64* status) {
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
        for (int s = 0; s < top_k && column == NO_COLUMN; ++s) {
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
      // ST_SLOT holds the route-table column, ST_CAP the rule (docs/design.md §5)
      report_status(status, STATUS_BAD_HEADER, region, column, ring, expected, observed, row, rule,
                    layer_idx);
    }
    *fault = NO_FAULT;
    *num_claimed = 0u;
  }
  __syncthreads();  // thread 0 has read the claims
  for (afd_i64 p = threadIdx.x; p < num_routed; p += blockDim.x) claims[p] = UNCLAIMED;
}

}  // namespace

// grid = max(1, min(ceil(R / ROWS_PER_BLOCK), MAX_BLOCKS)), block = REPLY_THREADS; a warp per
// route-table row. On return the scratch (claims, fault, num_claimed, done_counter) is back in
// its initial state. A bad table latches STATUS_BAD_HEADER in `status` (ST_PEER = region,
// ST_SLOT = route-table column, ST_RING = ring, ST_COUNT = the row, ST_CAP = ROUTE_FAULT_*); no
// write leaves staging rows [0, num_routed) or route_copy rows [0, num_rows).
template <int DT>
__global__ void __launch_bounds__(REPLY_THREADS)
afd_dedup_expand(afd_u64 window,  // own window
                 SlotGeometry geo,
                 afd_i32 region, afd_i32 ring,  // the arrival's slot
                 afd_i32 num_rows, afd_i32 num_tokens, afd_i32 num_routed, afd_i32 num_shared,
                 afd_i32 top_k, afd_i32 hidden_size,
                 afd_u64 staging,         // payload [>= num_routed, hidden_size], device
                 afd_i32* route_copy,     // int32 [>= num_rows, 2 + 2 * top_k], device
                 afd_i32* claims,         // int32 [>= num_routed], all UNCLAIMED, device
                 afd_u64* fault,          // uint64 [1], NO_FAULT, device
                 afd_u32* num_claimed,    // uint32 [1], 0, device
                 afd_i32 layer_idx,
                 afd_u64 status,          // int64 [STATUS_WORDS]
                 unsigned int* done_counter) {
  __shared__ afd_i32 s_dst[ROWS_PER_BLOCK][MAX_TOP_K];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int width = ROUTE_FIXED_WORDS + 2 * top_k;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  char* slot = geo.slot(window, region, ring);
  const afd_i32* table = reinterpret_cast<const afd_i32*>(slot + geo.off_route);
  char* staging_base = static_cast<char*>(byte_ptr(staging, 0));
  const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;

  for (afd_i64 r = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + warp; r < num_rows;
       r += warp_stride) {
    // Copy, then check the copy: the reply reduces through exactly the words checked here,
    // whatever a sender writes into the window later.
    afd_i32* words = route_copy + r * width;
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
        s_dst[warp][s] = pos;
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
    if (key == NO_FAULT) {
      const char* src = geo.routed_row(slot, r, row_bytes);
      warp_scatter_row(staging_base, s_dst[warp], num_dst, src, row_bytes, lane);
    }
    __syncwarp();  // s_dst[warp] is rewritten by the next row
  }

  if (!last_block_done(done_counter, /*system_scope=*/false)) return;
  expand_finish(fault, num_claimed, claims, route_copy, width, num_rows, num_tokens, num_routed,
                num_shared, top_k, region, ring, layer_idx,
                static_cast<afd_i64*>(byte_ptr(status, 0)));
  __syncthreads();
  if (tid == 0) *done_counter = 0u;
}

// grid = max(1, min(ceil(R * row_parts(row bytes) / ROWS_PER_BLOCK), MAX_BLOCKS)), block =
// REPLY_THREADS; a warp per (reply row, part): a wide row is cut into row_parts (wire.cuh) contiguous
// column ranges so that a decode-size reply (R = 128 rows of 14 KiB) still keeps enough warps
// in flight (one warp per row: 128 warps, ~225 GB/s). route_copy is the table afd_dedup_expand
// accepted (a staging row outside [0, num_routed) ends the row's slots: never the case for an
// accepted table).

template <int DT>
__global__ void __launch_bounds__(REPLY_THREADS)
afd_dedup_reply(afd_u64 dst_window,  // the Attention peer's window as mapped here; 0: put peer
                afd_u64 staging,     // own symmetric put staging (used when dst_window is 0)
                afd_i32 dst_peer,    // the Attention peer's role rank: its staging slot (dst_peer, ring)
                SlotGeometry geo,
                afd_i32 src_rank, afd_i32 ring,  // slot (region = src_rank, ring): own FFN rank
                const afd_i32* route_copy,       // int32 [num_rows, 2 + 2 * top_k], device
                afd_i32 num_rows, afd_i32 top_k,
                afd_u64 routed_out, afd_i32 num_routed,  // payload [num_routed, hidden_size]
                afd_u64 shared_out, afd_i32 num_shared,  // payload [num_shared, hidden_size]
                afd_i32 hidden_size,
                afd_u64 header_src,  // pinned host int32 [geo.header_words]
                afd_i64 seq, unsigned int* done_counter) {
  __shared__ afd_i32 s_pos[ROWS_PER_BLOCK][MAX_TOP_K];
  __shared__ float s_weight[ROWS_PER_BLOCK][MAX_TOP_K];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int width = ROUTE_FIXED_WORDS + 2 * top_k;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  char* slot = geo.send_slot(dst_window, staging, dst_peer, src_rank, ring);
  const char* routed = static_cast<const char*>(byte_ptr(routed_out, 0));
  const char* shared = static_cast<const char*>(byte_ptr(shared_out, 0));
  const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
  const bool vectors = ((routed_out | shared_out | static_cast<afd_u64>(row_bytes) |
                         reinterpret_cast<afd_u64>(geo.routed_row(slot, 0, row_bytes))) & 15) == 0;

  const afd_i64 parts = row_parts(row_bytes);
  for (afd_i64 item = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + warp;
       item < static_cast<afd_i64>(num_rows) * parts; item += warp_stride) {
    const afd_i64 r = item / parts, part = item % parts;
    const afd_i32* words = route_copy + r * width;
    int num_slots = top_k;
    for (int base = 0; base < top_k; base += 32) {
      const int s = base + lane;
      const afd_i32 pos = s < top_k ? words[ROUTE_SLOTS + s] : -1;
      const bool ok = s < top_k && pos >= 0 && pos < num_routed;
      if (ok) {
        s_pos[warp][s] = pos;
        s_weight[warp][s] = __int_as_float(words[ROUTE_SLOTS + top_k + s]);
      }
      const unsigned int bad = __ballot_sync(0xffffffffu, s < top_k && !ok);
      if (bad != 0u && num_slots == top_k) num_slots = base + __ffs(bad) - 1;
    }
    __syncwarp();
    const bool has_shared = r < num_shared;
    char* dst = geo.routed_row(slot, r, row_bytes);
    // NOTE: __fmul_rn / __fadd_rn: no FMA contraction, so the row is bitwise
    // dedup_reference.reduce_reference (and the host backend's numba reduce) rounded once.
    if (vectors) {
      constexpr int V = vec_elems<DT>();
      const afd_i64 vecs = row_bytes >> 4, per_part = (vecs + parts - 1) / parts;
      const afd_i64 v_end = min(vecs, (part + 1) * per_part);
      for (afd_i64 i = part * per_part + lane; i < v_end; i += 32) {
        float acc[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.0f;
        for (int s = 0; s < num_slots; ++s) {
          const float w = s_weight[warp][s];
          float x[V];
          unpack16<DT>(reinterpret_cast<const uint4*>(routed + s_pos[warp][s] * row_bytes)[i], x);
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, x[e]));
        }
        if (has_shared) {
          float x[V];
          unpack16<DT>(reinterpret_cast<const uint4*>(shared + r * row_bytes)[i], x);
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
          const afd_i64 src = static_cast<afd_i64>(s_pos[warp][s]) * hidden_size + h;
          acc = __fadd_rn(acc, __fmul_rn(s_weight[warp][s], load_elem<DT>(routed, src)));
        }
        if (has_shared) acc = __fadd_rn(acc, load_elem<DT>(shared, r * hidden_size + h));
        store_elem<DT>(dst, h, acc);
      }
    }
    __syncwarp();  // s_pos / s_weight of this warp are rewritten by the next row
  }

  // Every block's rows are released at system scope here (as afd_reply).
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;
  const afd_i32* src_words = static_cast<const afd_i32*>(byte_ptr(header_src, 0));
  afd_i32* header = geo.header(slot);
  for (int w = tid; w < geo.header_words; w += REPLY_THREADS) header[w] = load_volatile32(src_words + w);
  __syncthreads();  // every header word of the block precedes thread 0's fence
  if (tid == 0) {
    __threadfence_system();  // release, cumulative over the header and every block's rows
    // A put peer's flag is set by the host's put-with-signal queued behind this kernel.
    if (dst_window) store_volatile(geo.flag(dst_window, src_rank, ring), seq);
    __threadfence();
    *done_counter = 0u;
  }
}
