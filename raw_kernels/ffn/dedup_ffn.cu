// dedup_ffn.cu: the FFN side of the dedup wire mode (docs/design/dedup.md, docs/design/kernels.md).
//
// afd_dedup_expand<DT>: after wait_any, copy the slot's route table into local memory, check
// it row by row (the rules of wire.check_route_table) and scatter each received row into the
// slot's local grouped staging, one copy per staging row pos[t, k] of its route-table row.
// afd_dedup_reply<DT>: after the worker, reduce the grouped outputs back to one row per received
// row, out[r] = sum_s w_s * routed_out[pos_s] (+ shared_out[r], r < S), in fp32 in slot order,
// rounded once, straight into the Attention peer's window (a put peer: the own staging slot, as
// afd_reply); then header, system fence, flag.
#include "common/wire.cuh"
#include "common/payload.cuh"
#include "common/block.cuh"
#include "ffn/dedup_ffn.cuh"   // expand_row, expand_finish, load_route_slots, reduce_row_part
#include "common/publish.cuh"  // publish_reply

using namespace afd;

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
    expand_row(table, route_copy + r * width, r, width, num_tokens, num_routed, num_shared, top_k,
               claims, fault, num_claimed, s_dst[warp], staging_base,
               geo.routed_row(slot, r, row_bytes), row_bytes, lane);
  }

  if (!last_block_done(done_counter, /*system_scope=*/false)) return;
  const RouteVerdict v = expand_finish(fault, num_claimed, claims, route_copy, width, num_tokens,
                                       num_routed, num_shared, top_k);
  if (tid == 0 && v.rule != 0) {
    // ST_SLOT holds the route-table column, ST_CAP the rule (docs/design/kernels.md)
    report_status(static_cast<afd_i64*>(byte_ptr(status, 0)), STATUS_BAD_HEADER, region, v.column,
                  ring, v.expected, v.observed, v.row, v.rule, layer_idx);
  }
  __syncthreads();
  if (tid == 0) *done_counter = 0u;
}

// grid = max(1, min(ceil(R * row_parts(row bytes) / ROWS_PER_BLOCK), MAX_BLOCKS)), block =
// REPLY_THREADS; a warp per (reply row, part): a wide row is cut into row_parts (wire.cuh) contiguous
// column ranges so that a decode-size reply (R = 128 rows of 14 KiB) still keeps enough warps
// in flight (one warp per row: 128 warps, ~225 GB/s). route_copy is the table afd_dedup_expand
// accepted (a staging row outside [0, num_routed) ends the row's slots: never the case for an
// accepted table). The reduce is dedup_ffn.cuh's load_route_slots / reduce_row_part, shared with
// afd_graph_dedup_reply (ffn_graph_rows.cu).
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
    const int num_slots = load_route_slots(route_copy + r * width, top_k, num_routed, s_pos[warp],
                                           s_weight[warp], lane);
    const char* shared_row = r < num_shared ? shared + r * row_bytes : nullptr;
    reduce_row_part<DT>(geo.routed_row(slot, r, row_bytes), routed, row_bytes, s_pos[warp],
                        s_weight[warp], num_slots, shared_row, row_bytes, hidden_size, part, parts,
                        vectors, lane);
    __syncwarp();  // s_pos / s_weight of this warp are rewritten by the next row
  }

  // Every block's rows are released at system scope here; then, as afd_reply, the header from
  // the pinned staging row, a system fence and the flag (a put peer: no flag).
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;
  publish_reply(geo, slot, dst_window, src_rank, ring,
                static_cast<const afd_i32*>(byte_ptr(header_src, 0)), /*pinned_src=*/true, seq,
                done_counter);
}
