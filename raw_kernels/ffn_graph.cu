// ffn_graph.cu: the device steps of the graph-driven FFN (docs/design/cuda-graphs.md). One CUDA graph
// per size bucket replays, with no host step per item:
//
//   afd_graph_wait_stage -> afd_graph_gather<DT>
//   -> grouped GEMMs over the stacked layers (torch) -> afd_graph_reply<DT>
//
// and in the dedup wire mode (docs/design/dedup.md):
//
//   afd_graph_wait_stage -> afd_graph_dedup_expand<DT> -> grouped GEMMs
//   -> afd_graph_dedup_reply<DT>
//
// afd_graph_wait_stage is afd_wait_any (its flag scan, wait_any.cuh) and afd_graph_stage in one
// kernel; the two-kernel form (afd_wait_any into a DEVICE doorbell, then afd_graph_stage) stays
// for comparison (GraphFFNServer(fused_wait_stage=False)) and for the stage's own tests.
//
// Nothing the graph needs is frozen at capture except buffers: the stage reads which slot
// arrived, its header and counts from what the wait found (shared memory in the fused kernel,
// the device doorbell in the two-kernel form),
// checks the header as wire.decode_header does, decides what this replay does (GS_*), writes
// the grouped-GEMM group offsets of the stacked-layer problem list (zero-size groups for every
// layer but the arrived one, all zero when nothing is served), reserves the reply seq of the
// slot, builds the reply header as wire.reply_header does, and writes one record per replay
// into a ring in pinned host memory (the host reads it after the replay's event completed).
// The gather copies the arrived rows into the fixed staging rows the GEMMs read; the reply
// copies the output rows into the sender's window, then header, system fence, flag = seq.
// Dedup: the expand copies and checks the route table (dedup_ffn.cuh, as afd_dedup_expand) and
// scatters the rows into the grouped staging; a rejected table turns the replay's record into
// GS_BAD_ROUTE with the verdict, gives the reserved reply seq back and stops the reply. The
// dedup reply reduces the grouped outputs to one row per received row (fused, as
// afd_dedup_reply) before header, fence and flag.
// References: afd_cupy/ffn_graph.py (stage_reference, dedup_expand_reference,
// dedup_reply_reference; gather/reply in the cuda tests).
#include "wire.cuh"
#include "dedup_ffn.cuh"  // expand_row, expand_finish, load_route_slots, reduce_row_part
#include "publish.cuh"    // publish_reply
#include "wait_any.cuh"   // scan_flags

using namespace afd;

namespace {

// What one replay did (REC_STATUS; afd_cupy/ffn_graph.py GS_*).
constexpr int GS_IDLE = 0;      // wait_any timed out: nothing consumed
constexpr int GS_SERVED = 1;    // computed and answered inside the graph
constexpr int GS_SHUTDOWN = 2;  // a shutdown message was consumed (src rank in the header copy)
constexpr int GS_EAGER = 3;     // a valid item the graph does not serve (larger than the bucket,
                                // layer outside the stacked weights): the host serves it on the
                                // eager path with the reply seq reserved in REC_SEQ
constexpr int GS_REJECTED = 4;  // the header fails a check: the host decodes it and raises
constexpr int GS_BAD_ROUTE = 5;  // dedup: the route table fails a check (afd_graph_dedup_expand):
                                 // the verdict follows the record's header words, the reserved
                                 // reply seq is given back, nothing is answered

// Device state of the current replay, written by the stage, read by gather and reply
// (int64 words; the reply header follows as int32 words from int64 word STATE_HEADER).
constexpr int STATE_ACTIVE = 0;  // 1: gather and reply run
constexpr int STATE_SLOT = 1;
constexpr int STATE_REGION = 2;
constexpr int STATE_RING = 3;
constexpr int STATE_ROUTED = 4;
constexpr int STATE_SHARED = 5;
constexpr int STATE_SEQ = 6;
constexpr int STATE_CHUNK = 7;  // layer chunk holding the arrived layer (its GEMM output is read)
constexpr int STATE_RECORD = 8;  // address of this replay's record (pinned host memory)
constexpr int STATE_HEADER = 9;

// One record per replay in a pinned host ring (int64 words; header as int32 from REC_HEADER).
constexpr int REC_REPLAY = 0;  // replay number (device counter), written last
constexpr int REC_STATUS = 1;  // GS_*
constexpr int REC_SLOT = 2;    // slot consumed, -1 when idle
constexpr int REC_FLAG = 3;    // its flag value
constexpr int REC_SEQ = 4;     // reply seq used (SERVED) or reserved for the host (EAGER), else 0
constexpr int REC_DETAIL = 5;  // REJECTED: header word that failed (wire.HDR_*), else -1
constexpr int REC_HEADER = 6;  // the dispatch header words as consumed; dedup: the route-table
                               // verdict (STATUS_WORDS, as a status block) after them, at int64
                               // word REC_HEADER + ceil(header_words / 2), when GS_BAD_ROUTE

// wire.decode_header's checks, in its order; returns -1 if the header passes, else the index of
// the failing header word (the host re-decodes and raises the same WireError the eager path
// raises). The counts (words [HDR_FIXED_WORDS, HDR_FIXED_WORDS + epr)) come pre-reduced by the
// block: `first_negative` (epr when none is negative) and `sum` (of all of them; used only when
// none is negative).
__device__ int check_header(const afd_i32* w, int epr, int is_dedup, int token_cap,
                            int routed_cap, int shared_cap, int first_negative, afd_i64 sum) {
  if (static_cast<afd_u32>(w[HDR_MAGIC]) != static_cast<afd_u32>(MAGIC)) return HDR_MAGIC;
  if (w[HDR_VERSION] != VERSION) return HDR_VERSION;
  if (((w[HDR_FLAGS] & FLAG_DEDUP) != 0) != (is_dedup != 0)) return HDR_FLAGS;
  const afd_i32 routed = w[HDR_ROUTED_TOKENS], shared = w[HDR_SHARED_TOKENS];
  const afd_i32 num_rows = is_dedup ? w[HDR_FIXED_WORDS + epr] : 0;
  if (first_negative < epr) return HDR_FIXED_WORDS + first_negative;
  if (routed < 0) return HDR_ROUTED_TOKENS;
  if (shared < 0) return HDR_SHARED_TOKENS;
  if (num_rows < 0) return HDR_FIXED_WORDS + epr;
  if (sum != routed) return HDR_ROUTED_TOKENS;
  if (is_dedup) {
    const afd_i64 top_k = w[HDR_TOPK] > 0 ? w[HDR_TOPK] : 0;
    if (shared > num_rows || routed < num_rows || routed > num_rows * top_k) return HDR_FIXED_WORDS + epr;
  }
  if (w[HDR_NUM_TOKENS] > token_cap) return HDR_NUM_TOKENS;
  if (routed > routed_cap) return HDR_ROUTED_TOKENS;
  if (shared > shared_cap) return HDR_SHARED_TOKENS;
  if (is_dedup && num_rows > token_cap) return HDR_FIXED_WORDS + epr;
  return -1;
}

}  // namespace

// The stage's work (every thread of a REPLY_THREADS block, once): the arrival is known and its
// header words are in shared memory (`s_words`, header_words of them; `arrived`: a message was
// consumed from `slot` with flag `flag`), `replay` = *replay_counter and `prev_seq` =
// reply_seqs[slot] (0 when nothing arrived) were read by the caller, before its barrier.
// Offsets: routed_offs int32 [num_layers * epr] in stacked-group order (layer-major); chunk c
// owns layers [c * layers_per_chunk, ...) and its groups' offsets are cumulative end rows
// WITHIN the chunk (one torch._grouped_mm per chunk, fewer than 1024 groups each). For the
// chunk of the arrived layer: 0 for earlier layers, cumsum(counts) for the arrived one, R for
// later ones; every other chunk and every non-served replay: all 0 (all groups empty).
// shared_offs int32 [num_layers] (or 0 without shared experts): 0 before the layer, S from it.
// NOTE: no thread walks the counts alone: a one-thread loop over 64 shared words is ~1 us,
// and this work is on the round trip's critical path. The block reduces them (first negative,
// sum) and scans them (group ends).
__device__ inline void stage_item(const afd_i32* s_words, afd_i64 slot, bool arrived, afd_i64 flag,
                                  afd_i64 replay, afd_i64 prev_seq, const SlotGeometry& geo,
                                  afd_i32 expert_per_rank, afd_i32 is_dedup, afd_i32 src_rank,
                                  afd_i32 num_attn_ranks, afd_i32 token_cap, afd_i32 routed_cap,
                                  afd_i32 shared_cap, afd_i32 routed_bucket, afd_i32 shared_bucket,
                                  afd_i32 num_layers, afd_i32 layers_per_chunk,
                                  afd_i32* routed_offs, afd_i32* shared_offs, afd_i64* reply_seqs,
                                  afd_i64* state, afd_i64* replay_counter, afd_u64 records,
                                  afd_i32 num_records, afd_i32 record_words) {
  __shared__ int s_status, s_layer, s_chunk, s_detail, s_first_negative;
  __shared__ unsigned long long s_count_sum;
  __shared__ afd_i32 s_ends[1024];  // served: inclusive cumsum of the arrived layer's counts
  const int tid = threadIdx.x;
  const int epr = expert_per_rank;
  const int hw = geo.header_words;
  if (tid == 0) {
    s_first_negative = epr;
    s_count_sum = 0ull;
  }
  __syncthreads();
  // Counts: thread tid owns experts [e_begin, e_end), REPLY_THREADS threads cover up to 1024.
  const int per_thread = (epr + REPLY_THREADS - 1) / REPLY_THREADS;
  const int e_begin = min(tid * per_thread, epr), e_end = min(e_begin + per_thread, epr);
  afd_i64 local_sum = 0;
  int local_negative = epr;
  for (int e = e_begin; e < e_end; ++e) {
    const afd_i32 c = s_words[HDR_FIXED_WORDS + e];
    if (c < 0 && local_negative == epr) local_negative = e;
    local_sum += c;
  }
  if (local_negative < epr) atomicMin(&s_first_negative, local_negative);
  // The sum matters only when no count is negative; summed per warp first: one shared atomic per
  // thread (64 at 64 experts, all on one word) serialized to ~3 us.
  afd_i64 warp_sum = (local_negative < epr) ? 0 : local_sum;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) warp_sum += __shfl_down_sync(0xffffffffu, warp_sum, d);
  if ((tid & 31) == 0 && warp_sum != 0) atomicAdd(&s_count_sum, static_cast<unsigned long long>(warp_sum));
  __syncthreads();
  const afd_i32 routed = s_words[HDR_ROUTED_TOKENS], shared = s_words[HDR_SHARED_TOKENS];
  if (tid == 0) {
    int status = GS_IDLE, detail = -1, layer = -1;
    if (arrived) {
      const int region = static_cast<int>(slot / geo.ring_depth);
      detail = check_header(s_words, epr, is_dedup, token_cap, routed_cap, shared_cap, s_first_negative,
                            static_cast<afd_i64>(s_count_sum));
      layer = s_words[HDR_LAYER];
      if (detail >= 0) {
        status = GS_REJECTED;
      } else if (s_words[HDR_FLAGS] & FLAG_SHUTDOWN) {
        status = GS_SHUTDOWN;
      } else if (s_words[HDR_SRC_RANK] != region || region >= num_attn_ranks) {
        status = GS_REJECTED;
        detail = HDR_SRC_RANK;
      } else if (layer < 0 || layer >= num_layers || routed > routed_bucket || shared > shared_bucket) {
        status = GS_EAGER;
      } else {
        status = GS_SERVED;
      }
    }
    s_status = status;
    s_detail = detail;
    s_layer = layer;
    s_chunk = (status == GS_SERVED) ? layer / layers_per_chunk : -1;
  }
  __syncthreads();
  const int status = s_status, layer = s_layer, chunk = s_chunk;

  // Group ends of the arrived layer: a block scan of the per-thread count sums (served: every
  // count is >= 0 and they sum to routed <= routed_cap, so int32 holds them).
  afd_i32 total;
  afd_i32 run = block_exclusive_scan_256(status == GS_SERVED ? static_cast<afd_i32>(local_sum) : 0, &total);
  if (status == GS_SERVED) {
    for (int e = e_begin; e < e_end; ++e) {
      run += s_words[HDR_FIXED_WORDS + e];
      s_ends[e] = run;
    }
  }
  __syncthreads();

  // Group offsets: one thread per group.
  for (int g = tid; g < num_layers * epr; g += blockDim.x) {
    const int l = g / epr, e = g - l * epr;
    afd_i32 end = 0;
    if (status == GS_SERVED && l / layers_per_chunk == chunk && l >= layer) end = (l > layer) ? routed : s_ends[e];
    routed_offs[g] = end;
  }
  if (shared_offs != nullptr) {
    for (int l = tid; l < num_layers; l += blockDim.x) {
      shared_offs[l] = (status == GS_SERVED && l >= layer) ? shared : 0;
    }
  }

  // Reply header (wire.reply_header): echo everything but seq, src_rank, flags, echo_seq.
  afd_i32* reply_words = reinterpret_cast<afd_i32*>(state + STATE_HEADER);
  __shared__ afd_i64 s_seq;
  if (tid == 0) {
    afd_i64 seq = 0;
    if (status == GS_SERVED || status == GS_EAGER) {
      seq = prev_seq + 1;
      reply_seqs[slot] = seq;
    }
    s_seq = seq;
    state[STATE_ACTIVE] = (status == GS_SERVED) ? 1 : 0;
    state[STATE_SLOT] = slot;
    state[STATE_REGION] = arrived ? slot / geo.ring_depth : -1;
    state[STATE_RING] = arrived ? slot % geo.ring_depth : -1;
    state[STATE_ROUTED] = (status == GS_SERVED) ? routed : 0;
    state[STATE_SHARED] = (status == GS_SERVED) ? shared : 0;
    state[STATE_SEQ] = seq;
    state[STATE_CHUNK] = chunk;
    state[STATE_RECORD] = static_cast<afd_i64>(
        records + static_cast<afd_u64>((replay % num_records) * record_words) * sizeof(afd_i64));
  }
  __syncthreads();
  for (int i = tid; i < hw; i += blockDim.x) {
    afd_i32 word = s_words[i];
    if (i == HDR_SEQ) word = static_cast<afd_i32>(s_seq & 0xffffffffll);
    if (i == HDR_SRC_RANK) word = src_rank;
    if (i == HDR_FLAGS) word = s_words[HDR_FLAGS] & static_cast<afd_i32>(FLAG_DEDUP);
    if (i == HDR_ECHO_SEQ) word = s_words[HDR_SEQ];
    if (i == HDR_MAGIC) word = static_cast<afd_i32>(MAGIC);
    if (i == HDR_VERSION) word = static_cast<afd_i32>(VERSION);
    reply_words[i] = word;
  }

  // The replay's record, into the pinned ring; the replay number last (after the barrier, one
  // system fence by thread 0 is cumulative over every thread's record words).
  afd_i64* rec = reinterpret_cast<afd_i64*>(records) + (replay % num_records) * record_words;
  volatile afd_i32* rec_words = reinterpret_cast<volatile afd_i32*>(rec + REC_HEADER);
  for (int i = tid; i < hw; i += blockDim.x) rec_words[i] = s_words[i];
  if (tid == 0) {
    *replay_counter = replay + 1;
    store_volatile(rec + REC_STATUS, status);
    store_volatile(rec + REC_SLOT, arrived ? slot : -1);
    store_volatile(rec + REC_FLAG, arrived ? flag : 0);
    store_volatile(rec + REC_SEQ, s_seq);
    store_volatile(rec + REC_DETAIL, s_detail);
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();
    store_volatile(rec + REC_REPLAY, replay);
  }
}

// grid = 1, block = REPLY_THREADS. Runs right after afd_wait_any in the graph (the two-kernel
// path; afd_graph_wait_stage below is both in one): the arrival from the DEVICE doorbell that
// afd_wait_any wrote, then stage_item.
extern "C" __global__ void __launch_bounds__(REPLY_THREADS)
afd_graph_stage(afd_u64 doorbell,  // device int64 [DB_HEADER + ...]: afd_wait_any's output
                SlotGeometry geo,
                afd_i32 expert_per_rank, afd_i32 is_dedup, afd_i32 src_rank, afd_i32 num_attn_ranks,
                afd_i32 token_cap, afd_i32 routed_cap, afd_i32 shared_cap,
                afd_i32 routed_bucket, afd_i32 shared_bucket,
                afd_i32 num_layers, afd_i32 layers_per_chunk,
                afd_i32* routed_offs,  // device int32 [num_layers * expert_per_rank]
                afd_i32* shared_offs,  // device int32 [num_layers], or null
                afd_i64* reply_seqs,   // device int64 [num_slots]: this rank's reply seq per slot
                afd_i64* state,        // device int64 [STATE_HEADER + ceil(header_words / 2)]
                afd_i64* replay_counter,  // device int64 [1]
                afd_u64 records,       // pinned int64 [num_records, record_words]
                afd_i32 num_records, afd_i32 record_words) {
  // NOTE: expert_per_rank + is_dedup <= 1024 (the spec checks it: a torch._grouped_mm problem
  // list has fewer than 1024 groups, so one layer's experts must fit one).
  __shared__ afd_i32 s_words[HDR_FIXED_WORDS + 1024];
  __shared__ afd_i64 s_replay, s_prev_seq;
  const int tid = threadIdx.x;
  const afd_i64* bell = reinterpret_cast<const afd_i64*>(doorbell);
  const afd_i32* bell_words = reinterpret_cast<const afd_i32*>(bell + DB_HEADER);
  for (int i = tid; i < geo.header_words; i += blockDim.x) s_words[i] = bell_words[i];
  const afd_i64 slot = bell[DB_SLOT];
  const afd_i64 flag = bell[DB_FLAG];
  const bool arrived = bell[DB_STATUS] == STATUS_OK && slot >= 0;
  if (tid == 0) {  // the dependent reads first, with the header copy
    s_replay = *replay_counter;
    s_prev_seq = arrived ? reply_seqs[slot] : 0;
  }
  __syncthreads();
  stage_item(s_words, slot, arrived, flag, s_replay, s_prev_seq, geo, expert_per_rank, is_dedup,
             src_rank, num_attn_ranks, token_cap, routed_cap, shared_cap, routed_bucket,
             shared_bucket, num_layers, layers_per_chunk, routed_offs, shared_offs, reply_seqs,
             state, replay_counter, records, num_records, record_words);
}

// grid = 1, block = REPLY_THREADS. afd_wait_any and afd_graph_stage in one kernel (the graph's
// default first node): warp 0 scans the flags as afd_wait_any does (bounded by timeout_ns;
// updates last_seen, scan_start and the won slot's counts_snapshot row as it does, for the
// eager fallback) and puts the header words straight into shared memory; the other warps wait
// at the barrier (one block: no SM is held but this one). Then stage_item. An idle replay
// (timeout) stages nothing, as after afd_wait_any's timeout, and records zero header words.
// Saves a kernel boundary, the doorbell's round trip through global memory and one system fence.
extern "C" __global__ void __launch_bounds__(REPLY_THREADS)
afd_graph_wait_stage(afd_u64 window,  // own window
                     afd_i64* last_seen,        // [num_slots], device
                     afd_i32* scan_start,       // [1], device
                     afd_i32* counts_snapshot,  // [num_slots, header_words - HDR_FIXED_WORDS], device
                     afd_i64 timeout_ns,
                     SlotGeometry geo,
                     afd_i32 expert_per_rank, afd_i32 is_dedup, afd_i32 src_rank,
                     afd_i32 num_attn_ranks, afd_i32 token_cap, afd_i32 routed_cap,
                     afd_i32 shared_cap, afd_i32 routed_bucket, afd_i32 shared_bucket,
                     afd_i32 num_layers, afd_i32 layers_per_chunk,
                     afd_i32* routed_offs, afd_i32* shared_offs, afd_i64* reply_seqs,
                     afd_i64* state, afd_i64* replay_counter, afd_u64 records,
                     afd_i32 num_records, afd_i32 record_words) {
  __shared__ afd_i32 s_words[HDR_FIXED_WORDS + 1024];
  __shared__ afd_i64 s_replay, s_prev_seq, s_slot, s_flag;
  const int tid = threadIdx.x, lane = tid & 31;
  const int hw = geo.header_words;
  if (tid < 32) {
    afd_i64 flag = 0;
    const int slot = scan_flags(window, geo, last_seen, *scan_start, timeout_ns, &flag);
    if (slot >= 0) {
      const afd_i32* header = geo.header(geo.slot_at(window, slot));
      afd_i32* snapshot = counts_snapshot + static_cast<afd_i64>(slot) * (hw - HDR_FIXED_WORDS);
      for (int w = lane; w < hw; w += 32) {
        const afd_i32 word = load_volatile32(header + w);
        s_words[w] = word;
        if (w >= HDR_FIXED_WORDS) snapshot[w - HDR_FIXED_WORDS] = word;
      }
      if (lane == 0) {
        s_prev_seq = reply_seqs[slot];
        last_seen[slot] = flag;
        const int num_slots = static_cast<int>(geo.num_slots());
        *scan_start = (slot + 1 == num_slots) ? 0 : slot + 1;
      }
    } else {
      for (int w = lane; w < hw; w += 32) s_words[w] = 0;
      if (lane == 0) s_prev_seq = 0;
    }
    if (lane == 0) {
      s_slot = slot;
      s_flag = flag;
    }
  } else if (tid == 32) {
    s_replay = *replay_counter;  // read while warp 0 waits
  }
  __syncthreads();
  const afd_i64 slot = s_slot;
  stage_item(s_words, slot, slot >= 0, s_flag, s_replay, s_prev_seq, geo, expert_per_rank,
             is_dedup, src_rank, num_attn_ranks, token_cap, routed_cap, shared_cap, routed_bucket,
             shared_bucket, num_layers, layers_per_chunk, routed_offs, shared_offs, reply_seqs,
             state, replay_counter, records, num_records, record_words);
}

// grid = reply_grid(routed_bucket + shared_bucket) (frozen at capture), block = REPLY_THREADS;
// a warp per row. Copies the served item's routed and shared rows from its window slot into
// the fixed staging rows the grouped GEMMs read; nothing when the replay serves nothing.
template <int DT>
__global__ void __launch_bounds__(REPLY_THREADS)
afd_graph_gather(afd_u64 window,  // own window
                 SlotGeometry geo,
                 const afd_i64* state,  // device: afd_graph_stage's output
                 afd_i32 hidden_size,
                 afd_u64 routed_staging,  // payload [routed_bucket, hidden_size], device
                 afd_u64 shared_staging) {  // payload [shared_bucket, hidden_size], or 0
  if (state[STATE_ACTIVE] == 0) return;
  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  char* slot = geo.slot_at(window, state[STATE_SLOT]);
  const afd_i64 num_routed = state[STATE_ROUTED];
  const afd_i64 num_rows = num_routed + (shared_staging != 0ull ? state[STATE_SHARED] : 0);
  const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
  for (afd_i64 r = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5); r < num_rows;
       r += warp_stride) {
    const bool is_routed = r < num_routed;
    const afd_i64 row = is_routed ? r : r - num_routed;
    const char* src = is_routed ? geo.routed_row(slot, row, row_bytes) : geo.shared_row(slot, row, row_bytes);
    char* dst = static_cast<char*>(byte_ptr(is_routed ? routed_staging : shared_staging, row * row_bytes));
    warp_copy_row(dst, src, row_bytes, lane);
  }
}

// grid = reply_grid(routed_bucket + shared_bucket) (frozen at capture), block = REPLY_THREADS;
// a warp per row. afd_reply with everything it needs read from the stage's state: the served
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
  for (afd_i64 r = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5); r < num_rows;
       r += warp_stride) {
    const bool is_routed = r < num_routed;
    const afd_i64 row = is_routed ? r : r - num_routed;
    const afd_u64 src_base = is_routed ? routed_out : shared_out;
    const char* src = src_base != 0ull ? static_cast<const char*>(byte_ptr(src_base, row * row_bytes))
                      : (is_routed ? geo.routed_row(own_slot, row, row_bytes) : geo.shared_row(own_slot, row, row_bytes));
    char* dst = is_routed ? geo.routed_row(slot, row, row_bytes) : geo.shared_row(slot, row, row_bytes);
    warp_copy_row(dst, src, row_bytes, lane);
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
