// ffn_graph_rows.cu: the row kernels of a graph-driven FFN replay (docs/design/cuda-graphs.md,
// ffn_graph.cuh), each reading what afd_graph_stage left in the replay's state: the gather into
// the grouped GEMMs' staging and the reply (afd_graph_gather, afd_graph_reply), and in the dedup
// wire mode the route-table expand and the reducing reply (afd_graph_dedup_expand,
// afd_graph_dedup_reply; device code of dedup_ffn.cuh). References: afd_cupy/ffn/graph.py
// (dedup_expand_reference, dedup_reply_reference; gather/reply in the cuda tests).
#include "common/wire.cuh"
#include "common/payload.cuh"
#include "common/block.cuh"
#include "common/publish.cuh"  // publish_reply
#include "common/fp8.cuh"      // fp8_row_bytes, warp_dequantize_row (FP8 dispatch rows)
#include "ffn/dedup_ffn.cuh"   // expand_row, expand_finish, load_route_slots, reduce_row_part
#include "ffn/ffn_graph.cuh"   // STATE_*, REC_*, GS_BAD_ROUTE

using namespace afd;

// grid = reply_grid(routed_bucket + shared_bucket) (frozen at capture), block = REPLY_THREADS;
// a warp per row. Copies the served item's routed and shared rows from its window slot into
// the fixed staging rows the grouped GEMMs read; nothing when the replay serves nothing.
// fp8_rows (an FP8 dispatch connector, whose stage accepts FLAG_FP8 messages only): the slot
// holds FP8 wire rows (common/fp8.cuh), decoded into the staging rows as afd_fp8_dequant_rows
// decodes them (reference: wire.fp8.dequantize_wire_rows, rounded to the payload dtype).
template <int DT>
__global__ void __launch_bounds__(REPLY_THREADS)
afd_graph_gather(afd_u64 window,  // own window
                 SlotGeometry geo,
                 const afd_i64* state,  // device: afd_graph_stage's output
                 afd_i32 hidden_size,
                 afd_u64 routed_staging,  // payload [routed_bucket, hidden_size], device
                 afd_u64 shared_staging,  // payload [shared_bucket, hidden_size], or 0
                 afd_i32 fp8_rows) {      // 1: FP8 wire rows (hidden_size % FP8_GROUP == 0)
  if (state[STATE_ACTIVE] == 0) return;
  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const afd_i64 wire_row_bytes = fp8_rows ? fp8_row_bytes(hidden_size) : row_bytes;
  char* slot = geo.slot_at(window, state[STATE_SLOT]);
  const afd_i64 num_routed = state[STATE_ROUTED];
  const afd_i64 num_rows = num_routed + (shared_staging != 0ull ? state[STATE_SHARED] : 0);
  const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
  for (afd_i64 r = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5); r < num_rows;
       r += warp_stride) {
    const bool is_routed = r < num_routed;
    const afd_i64 row = is_routed ? r : r - num_routed;
    const char* src = is_routed ? geo.routed_row(slot, row, wire_row_bytes)
                                : geo.shared_row(slot, row, wire_row_bytes);
    char* dst = static_cast<char*>(byte_ptr(is_routed ? routed_staging : shared_staging, row * row_bytes));
    if (fp8_rows) {
      warp_dequantize_row<DT>(dst, src, hidden_size, lane);
    } else {
      warp_copy_row(dst, src, row_bytes, lane);
    }
  }
}

// grid = reply_grid(routed_bucket + shared_bucket, row_bytes) (frozen at capture), block =
// REPLY_THREADS; a warp per (row, part of it). afd_reply with everything it needs read from the
// stage's state: the served
// item's rows, then (last block) the reply header built by the stage, a system fence and
// flag = the reply seq, into slot (own FFN rank, ring) of the sender's window.
// routed_outs[STATE_CHUNK] is the routed output of the arrived layer's chunk; an entry of 0 (and
// shared_out = 0) means "the rows of the own window slot" (identity experts: nothing copied
// before). Nothing is written when the replay serves nothing.
template <int DT>
__global__ void __launch_bounds__(REPLY_THREADS)
afd_graph_reply(afd_u64 own_window,
                const afd_u64* peer_windows,  // device [num_regions]: Attention rank i's window, 0 if none
                SlotGeometry geo,
                afd_i32 src_rank,  // own FFN rank: the region of the sender's window written
                const afd_i64* state,
                const afd_u64* routed_outs,  // device [num_chunks]: payload [routed_bucket, H] each
                afd_u64 shared_out,  // payload [shared_bucket, H], or 0
                afd_i32 hidden_size,
                unsigned int* done_counter) {
  if (state[STATE_ACTIVE] == 0) return;  // uniform: no block counts in
  const afd_u64 dst_window = peer_windows[state[STATE_REGION]];
  if (dst_window == 0ull) return;  // the stage never serves such a region (defensive)
  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const afd_i32 ring = static_cast<afd_i32>(state[STATE_RING]);
  char* own_slot = geo.slot_at(own_window, state[STATE_SLOT]);
  char* slot = geo.slot(dst_window, src_rank, ring);
  const afd_u64 routed_out = routed_outs[state[STATE_CHUNK]];
  const afd_i64 num_routed = state[STATE_ROUTED];
  const afd_i64 num_rows = num_routed + state[STATE_SHARED];
  const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
  const afd_i64 parts = few_row_parts(row_bytes, num_rows);  // a warp per (row, part)
  for (afd_i64 item = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5);
       item < num_rows * parts; item += warp_stride) {
    const afd_i64 r = item / parts, part = item % parts;
    const bool is_routed = r < num_routed;
    const afd_i64 row = is_routed ? r : r - num_routed;
    const afd_u64 src_base = is_routed ? routed_out : shared_out;
    const char* src = src_base != 0ull ? static_cast<const char*>(byte_ptr(src_base, row * row_bytes))
                      : (is_routed ? geo.routed_row(own_slot, row, row_bytes) : geo.shared_row(own_slot, row, row_bytes));
    char* dst = is_routed ? geo.routed_row(slot, row, row_bytes) : geo.shared_row(slot, row, row_bytes);
    warp_copy_row_part(dst, src, row_bytes, part, parts, lane);
  }

  // Every block's rows are released at system scope here; then the stage's reply header, a
  // system fence and flag = the reserved seq (as afd_reply).
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;
  publish_reply(geo, slot, dst_window, src_rank, ring,
                reinterpret_cast<const afd_i32*>(state + STATE_HEADER), /*pinned_src=*/false,
                state[STATE_SEQ], done_counter);
}

// ---- dedup wire mode (docs/design/dedup.md, docs/design/cuda-graphs.md) ----------------------------------------------

// grid = dedup_expand_grid(bucket rows) (frozen at capture), block = REPLY_THREADS; a warp per
// route-table row. afd_dedup_expand with everything it needs read from the stage's state (slot,
// R = num_rows, T, P, S, layer from the echoed header words): copies the slot's route table into
// `route_copy` and checks the copy, scatters each received row into the grouped staging rows
// [0, P) the GEMMs read (`routed_staging`; 0: identity experts, check and copy only) and copies
// rows r < S into `shared_staging` row r (0: none). Nothing when the replay serves nothing.
// A rejected table (the last block's verdict): the record of this replay (STATE_RECORD) gets the
// verdict as a status block (STATUS_BAD_HEADER; ST_PEER = region, ST_SLOT = route-table column,
// ST_RING, ST_EXPECTED, ST_OBSERVED, ST_COUNT = row, ST_CAP = wire.ROUTE_FAULT_*, ST_LAYER)
// after its header words, REC_STATUS = GS_BAD_ROUTE and REC_SEQ = 0; reply_seqs[slot] goes back
// to the seq before the stage's reservation (as the eager path, which counts replies only), and
// STATE_ACTIVE = 0, so the reply writes nothing. The scratch (claims, fault, num_claimed,
// done_counter) is left as the next launch needs it.
template <int DT>
__global__ void __launch_bounds__(REPLY_THREADS)
afd_graph_dedup_expand(afd_u64 window,  // own window
                       SlotGeometry geo,
                       afd_i64* state,  // device: afd_graph_stage's output
                       afd_i32 top_k, afd_i32 hidden_size,
                       afd_u64 routed_staging,  // payload [routed_bucket, H], or 0
                       afd_u64 shared_staging,  // payload [shared_bucket, H], or 0
                       afd_i32* route_copy,     // int32 [token_cap, 2 + 2 * top_k], device
                       afd_i32* claims,         // int32 [routed_cap], all UNCLAIMED, device
                       afd_u64* fault,          // uint64 [1], NO_FAULT, device
                       afd_u32* num_claimed,    // uint32 [1], 0, device
                       afd_i64* reply_seqs,     // device int64 [num_slots] (the stage's)
                       unsigned int* done_counter) {
  if (state[STATE_ACTIVE] == 0) return;  // uniform: no block counts in
  __shared__ afd_i32 s_dst[ROWS_PER_BLOCK][MAX_TOP_K];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int width = ROUTE_FIXED_WORDS + 2 * top_k;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const afd_i32* words = reinterpret_cast<const afd_i32*>(state + STATE_HEADER);
  const afd_i32 num_rows = words[geo.header_words - 1];  // the dedup trailer word
  const afd_i32 num_tokens = words[HDR_NUM_TOKENS];
  const afd_i32 num_routed = static_cast<afd_i32>(state[STATE_ROUTED]);
  const afd_i32 num_shared = static_cast<afd_i32>(state[STATE_SHARED]);
  char* slot = geo.slot_at(window, state[STATE_SLOT]);
  const afd_i32* table = reinterpret_cast<const afd_i32*>(slot + geo.off_route);
  char* staging = routed_staging != 0ull ? static_cast<char*>(byte_ptr(routed_staging, 0)) : nullptr;
  const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;

  for (afd_i64 r = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + warp; r < num_rows;
       r += warp_stride) {
    const char* src = geo.routed_row(slot, r, row_bytes);
    const afd_u64 key = expand_row(table, route_copy + r * width, r, width, num_tokens, num_routed,
                                   num_shared, top_k, claims, fault, num_claimed, s_dst[warp],
                                   staging, src, row_bytes, lane);
    // the shared experts' input: rows r < S (this rank runs those tokens' shared experts)
    if (key == NO_FAULT && r < num_shared && shared_staging != 0ull) {
      warp_copy_row(byte_ptr(shared_staging, r * row_bytes), src, row_bytes, lane);
    }
  }

  // only this GPU reads the staging and the copy; the verdict is fenced on its own below
  if (!last_block_done(done_counter, /*system_scope=*/false)) return;
  const RouteVerdict v = expand_finish(fault, num_claimed, claims, route_copy, width, num_tokens,
                                       num_routed, num_shared, top_k);
  if (tid == 0 && v.rule != 0) {
    afd_i64* rec = reinterpret_cast<afd_i64*>(state[STATE_RECORD]);
    afd_i64* verdict = rec + REC_HEADER + (geo.header_words + 1) / 2;
    store_volatile(verdict + ST_CODE, STATUS_BAD_HEADER);
    store_volatile(verdict + ST_PEER, state[STATE_REGION]);
    store_volatile(verdict + ST_SLOT, v.column);
    store_volatile(verdict + ST_RING, state[STATE_RING]);
    store_volatile(verdict + ST_EXPECTED, v.expected);
    store_volatile(verdict + ST_OBSERVED, v.observed);
    store_volatile(verdict + ST_COUNT, v.row);
    store_volatile(verdict + ST_CAP, v.rule);
    store_volatile(verdict + ST_LAYER, words[HDR_LAYER]);
    store_volatile(rec + REC_STATUS, GS_BAD_ROUTE);
    store_volatile(rec + REC_SEQ, 0);
    reply_seqs[state[STATE_SLOT]] = state[STATE_SEQ] - 1;
    state[STATE_ACTIVE] = 0;  // the reply answers nothing
    __threadfence_system();
  }
  __syncthreads();
  if (tid == 0) *done_counter = 0u;
}

// grid = dedup_reply_grid(bucket rows, row bytes) (frozen at capture), block = REPLY_THREADS; a
// warp per (reply row, part of the row). afd_dedup_reply with everything it needs read from the
// stage's state: reply row r = round(sum_s w_s * routed_out[pos_s] (+ shared_out[r], r < S)),
// fp32 in slot order (dedup_ffn.cuh reduce_row_part: bitwise afd_dedup_reply), for r < R, into
// routed_x of slot (own FFN rank, ring) of the sender's window; then (last block) the reply
// header the stage built (num_rows included), a system fence and flag = the reply seq.
// routed_outs[STATE_CHUNK] is the grouped output of the arrived layer's chunk ([routed_bucket, H]
// in staging order); an entry of 0 means identity experts: every slot of row r reads the
// received row r of the own window slot. shared_out: [shared_bucket, H], or 0 (identity: the
// received row). `route_copy`: the table afd_graph_dedup_expand accepted in this replay.
// Nothing is written when the replay serves nothing (or its route table was rejected).
template <int DT>
__global__ void __launch_bounds__(REPLY_THREADS)
afd_graph_dedup_reply(afd_u64 own_window,
                      const afd_u64* peer_windows,  // device [num_regions]: Attention rank i's window, 0 if none
                      SlotGeometry geo,
                      afd_i32 src_rank,  // own FFN rank: the region of the sender's window written
                      const afd_i64* state,
                      const afd_i32* route_copy,  // int32 [token_cap, 2 + 2 * top_k], device
                      afd_i32 top_k,
                      const afd_u64* routed_outs,  // device [num_chunks]
                      afd_u64 shared_out,          // payload [shared_bucket, H], or 0
                      afd_i32 hidden_size,
                      unsigned int* done_counter) {
  if (state[STATE_ACTIVE] == 0) return;  // uniform: no block counts in
  const afd_u64 dst_window = peer_windows[state[STATE_REGION]];
  if (dst_window == 0ull) return;  // the stage never serves such a region (defensive)
  __shared__ afd_i32 s_pos[ROWS_PER_BLOCK][MAX_TOP_K];
  __shared__ float s_weight[ROWS_PER_BLOCK][MAX_TOP_K];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int width = ROUTE_FIXED_WORDS + 2 * top_k;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  const afd_i32 ring = static_cast<afd_i32>(state[STATE_RING]);
  const afd_i32* words = reinterpret_cast<const afd_i32*>(state + STATE_HEADER);
  const afd_i64 num_rows = words[geo.header_words - 1];
  const afd_i32 num_routed = static_cast<afd_i32>(state[STATE_ROUTED]);
  const afd_i64 num_shared = state[STATE_SHARED];
  char* own_slot = geo.slot_at(own_window, state[STATE_SLOT]);
  char* slot = geo.slot(dst_window, src_rank, ring);
  const afd_u64 routed_out = routed_outs[state[STATE_CHUNK]];
  const afd_u64 own_rows = reinterpret_cast<afd_u64>(geo.routed_row(own_slot, 0, row_bytes));
  const bool vectors = ((routed_out | shared_out | own_rows | static_cast<afd_u64>(row_bytes) |
                         reinterpret_cast<afd_u64>(geo.routed_row(slot, 0, row_bytes))) & 15) == 0;
  const afd_i64 parts = row_parts(row_bytes);
  const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
  for (afd_i64 item = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + warp;
       item < num_rows * parts; item += warp_stride) {
    const afd_i64 r = item / parts, part = item % parts;
    const int num_slots = load_route_slots(route_copy + r * width, top_k, num_routed, s_pos[warp],
                                           s_weight[warp], lane);
    const char* own_row = geo.routed_row(own_slot, r, row_bytes);
    const char* routed = routed_out != 0ull ? static_cast<const char*>(byte_ptr(routed_out, 0)) : own_row;
    const afd_i64 stride = routed_out != 0ull ? row_bytes : 0;
    const char* shared_row = r >= num_shared ? nullptr
                             : (shared_out != 0ull ? static_cast<const char*>(byte_ptr(shared_out, r * row_bytes))
                                                   : own_row);
    reduce_row_part<DT>(geo.routed_row(slot, r, row_bytes), routed, stride, s_pos[warp],
                        s_weight[warp], num_slots, shared_row, row_bytes, hidden_size, part, parts,
                        vectors, lane);
    __syncwarp();  // s_pos / s_weight of this warp are rewritten by the next row
  }

  // Every block's rows are released at system scope here; then, as afd_graph_reply, the
  // stage's reply header, a system fence and flag = the reserved seq.
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;
  publish_reply(geo, slot, dst_window, src_rank, ring, words, /*pinned_src=*/false,
                state[STATE_SEQ], done_counter);
}
