// ffn_graph_stage.cu: the first node of a graph-driven FFN replay (docs/design/cuda-graphs.md,
// ffn_graph.cuh): what the replay does (GS_*), the grouped-GEMM group offsets, the reserved reply
// seq and header, and the replay's record. afd_graph_wait_stage waits for the arrival itself
// (afd_wait_any's flag scan, wait_any.cuh); afd_graph_stage reads it from afd_wait_any's device
// doorbell. Reference: afd_cupy/ffn/graph.py (stage_reference).
#include "common/wire.cuh"
#include "common/block.cuh"
#include "ffn/ffn_graph.cuh"  // GS_*, STATE_*, REC_*
#include "ffn/wait_any.cuh"   // scan_flags

using namespace afd;

namespace {

// wire.decode_header's checks, in its order; returns -1 if the header passes, else the index of
// the failing header word (the host re-decodes and raises the same WireError the eager path
// raises). The counts (words [HDR_FIXED_WORDS, HDR_FIXED_WORDS + epr)) come pre-reduced by the
// block: `first_negative` (epr when none is negative) and `sum` (of all of them; used only when
// none is negative).
// Then the row format of a dispatch (wire.dispatch_rows_fault: FLAG_FP8 set exactly when
// is_fp8; a shutdown has no rows), which the host's decode does not check: the host raises
// wire.check_dispatch_rows' WireError for it.
__device__ int check_header(const afd_i32* w, int epr, int is_dedup, int is_fp8, int token_cap,
                            int routed_cap, int shared_cap, int first_negative, afd_i64 sum) {
  if (static_cast<afd_u32>(w[HDR_MAGIC]) != static_cast<afd_u32>(MAGIC)) return HDR_MAGIC;
  if (w[HDR_VERSION] != VERSION) return HDR_VERSION;
  const afd_i32 flags = w[HDR_FLAGS];
  if (((flags & FLAG_DEDUP) != 0) != (is_dedup != 0)) return HDR_FLAGS;
  if ((flags & FLAG_SHUTDOWN) == 0 && ((flags & FLAG_FP8) != 0) != (is_fp8 != 0)) return HDR_FLAGS;
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
                                  afd_i32 expert_per_rank, afd_i32 is_dedup, afd_i32 is_fp8,
                                  afd_i32 src_rank, afd_i32 num_attn_ranks, afd_i32 token_cap,
                                  afd_i32 routed_cap, afd_i32 shared_cap, afd_i32 routed_bucket,
                                  afd_i32 shared_bucket,
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
      detail = check_header(s_words, epr, is_dedup, is_fp8, token_cap, routed_cap, shared_cap,
                            s_first_negative, static_cast<afd_i64>(s_count_sum));
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
      seq = next_seq(prev_seq);
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

  // The replay's record, into the pinned ring. No fence: the host reads a record only after the
  // replay's event completed (GraphFFNServer._collect_oldest), which orders every write of the
  // replay before it; a system fence here waited for the PCIe writes on the round trip's
  // critical path (the gather or reply starts when this kernel ends).
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
    store_volatile(rec + REC_REPLAY, replay);
  }
}

// grid = 1, block = REPLY_THREADS. Runs right after afd_wait_any in the graph (the two-kernel
// path; afd_graph_wait_stage below is both in one): the arrival from the DEVICE doorbell that
// afd_wait_any wrote, then stage_item.
extern "C" __global__ void __launch_bounds__(REPLY_THREADS)
afd_graph_stage(afd_u64 doorbell,  // device int64 [DB_HEADER + ...]: afd_wait_any's output
                SlotGeometry geo,
                afd_i32 expert_per_rank, afd_i32 is_dedup, afd_i32 is_fp8, afd_i32 src_rank,
                afd_i32 num_attn_ranks,
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
             is_fp8, src_rank, num_attn_ranks, token_cap, routed_cap, shared_cap, routed_bucket,
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
                     afd_i32 expert_per_rank, afd_i32 is_dedup, afd_i32 is_fp8,
                     afd_i32 src_rank, afd_i32 num_attn_ranks, afd_i32 token_cap, afd_i32 routed_cap,
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
             is_dedup, is_fp8, src_rank, num_attn_ranks, token_cap, routed_cap, shared_cap, routed_bucket,
             shared_bucket, num_layers, layers_per_chunk, routed_offs, shared_offs, reply_seqs,
             state, replay_counter, records, num_records, record_words);
}
