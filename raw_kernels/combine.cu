// combine.cu: Attention-side wait for the expected FFN replies + weighted combine (docs/design.md §5).
//
//   out[t] = out_scale * ( sum_k w[t,k] * routed_x[region dest(t,k)][pos[t,k]]
//                          + (has_shared ? shared_x[region t % F][t / F] : 0) )
// fp32 accumulation in a fixed k order (deterministic, no atomics). afd_wait_replies (one
// warp) spins first; the first warp of every combine block then re-checks the flags and
// headers (bounded by timeout_ns, immediate once the wait succeeded) before reading; on any
// error the block writes NaN rows and the first error is latched in the status block.
#include "wire.cuh"

using namespace afd;

constexpr int STATUS_POLL_EVERY = 256;  // spin iterations between looks at the status block

// What the reply of one FFN rank must be: where it lands and what it must echo.
struct ReplyWant {
  afd_i64 peer, slot, ring, seq, seen_flag;
  afd_i64 layer_idx, stage_idx, routed, shared;
};

// The checks of wire.decode_header then wire.check_reply, in their order (lane 0 only):
// magic, version, negative sizes, sum(expert_counts) == routed (STATUS_BAD_HEADER), the
// shutdown flag (STATUS_SHUTDOWN), then the echoed seq, layer, stage, routed and shared rows
// (STATUS_REPLY_MISMATCH). ST_COUNT names the header word (HDR_*) that failed. The expert
// counts were summed by the whole warp: `counts_sum`, `counts_negative`. Returns false after
// latching the first failing check.
__device__ bool check_reply(const afd_i32* header, afd_i64 counts_sum, bool counts_negative,
                            const ReplyWant& want, afd_i64* status) {
  const auto fail = [&](afd_i64 code, afd_i64 word, afd_i64 expected, afd_i64 observed) {
    report_status(status, code, want.peer, want.slot, want.ring, expected, observed, word, -1,
                  want.layer_idx);
    return false;
  };
  const afd_i64 magic = static_cast<afd_u32>(load_volatile32(header + HDR_MAGIC));
  if (magic != MAGIC) return fail(STATUS_BAD_HEADER, HDR_MAGIC, MAGIC, magic);
  const afd_i64 version = load_volatile32(header + HDR_VERSION);
  if (version != VERSION) return fail(STATUS_BAD_HEADER, HDR_VERSION, VERSION, version);
  const afd_i64 routed = load_volatile32(header + HDR_ROUTED_TOKENS);
  const afd_i64 shared = load_volatile32(header + HDR_SHARED_TOKENS);
  if (routed < 0 || counts_negative) {
    return fail(STATUS_BAD_HEADER, HDR_ROUTED_TOKENS, routed, counts_sum);
  }
  if (shared < 0) return fail(STATUS_BAD_HEADER, HDR_SHARED_TOKENS, want.shared, shared);
  if (counts_sum != routed) return fail(STATUS_BAD_HEADER, HDR_ROUTED_TOKENS, routed, counts_sum);
  if (load_volatile32(header + HDR_FLAGS) & FLAG_SHUTDOWN) {
    report_status(status, STATUS_SHUTDOWN, want.peer, want.slot, want.ring, want.seq,
                  want.seen_flag, -1, -1, want.layer_idx);
    return false;
  }
  const afd_i64 echo = static_cast<afd_u32>(load_volatile32(header + HDR_ECHO_SEQ));
  const afd_i64 want_echo = want.seq & 0xffffffffll;
  if (echo != want_echo) return fail(STATUS_REPLY_MISMATCH, HDR_ECHO_SEQ, want_echo, echo);
  const afd_i64 layer = load_volatile32(header + HDR_LAYER);
  if (layer != want.layer_idx) return fail(STATUS_REPLY_MISMATCH, HDR_LAYER, want.layer_idx, layer);
  const afd_i64 stage = load_volatile32(header + HDR_STAGE);
  if (stage != want.stage_idx) return fail(STATUS_REPLY_MISMATCH, HDR_STAGE, want.stage_idx, stage);
  if (routed != want.routed) return fail(STATUS_REPLY_MISMATCH, HDR_ROUTED_TOKENS, want.routed, routed);
  if (shared != want.shared) return fail(STATUS_REPLY_MISMATCH, HDR_SHARED_TOKENS, want.shared, shared);
  return true;
}

// Warp-collective (every lane of one warp calls it and gets the same result): wait until every
// rank with expected[j] != 0 replied in slot (j, ring) and its reply passes check_reply.
// Lane 0 spins and decides; the lanes only help sum the expert counts. Returns false on error
// (latched in status, possibly by another block).
__device__ bool wait_replies(afd_u64 window, const SlotGeometry& geo, afd_i32 num_ffn_ranks,
                             afd_i32 ring, const afd_i64* expected, const afd_i32* expected_counts,
                             afd_i32 layer_idx, afd_i32 stage_idx, const afd_i64* last_seen,
                             afd_i64* reply_flags, afd_i64 timeout_ns, afd_i64* status) {
  constexpr unsigned int ALL = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  int ok = (lane == 0) ? status_code(status) == STATUS_OK : 0;
  if (!__shfl_sync(ALL, ok, 0)) return false;
  const afd_i64 start = globaltimer_ns();
  for (int j = 0; j < num_ffn_ranks; ++j) {
    const afd_i64 want_seq = expected[j];  // written by the scatter: the same in every lane
    if (want_seq == 0) continue;
    const afd_i64 slot = geo.slot_index(j, ring);
    afd_i64 flag = 0;
    const afd_i32* header = geo.header(geo.slot_at(window, slot));
    if (lane == 0) {
      afd_i64 seen = last_seen[slot];
      const afd_i64* flag_word = geo.flag_at(window, slot);
      for (int spin = 1; ok; ++spin) {
        flag = load_volatile(flag_word);
        if (flag != seen) {
          __threadfence_system();  // acquire: header and rows were written before the flag
          if (!is_late_reply(header, want_seq)) break;
          seen = flag;  // answers a dispatch whose wait timed out: dropped, keep waiting
          continue;
        }
        if (globaltimer_ns() - start > timeout_ns) {
          report_status(status, STATUS_TIMEOUT, j, slot, ring, want_seq, flag, -1, -1, layer_idx);
          ok = 0;
        } else if (spin % STATUS_POLL_EVERY == 0 && status_code(status) != STATUS_OK) {
          ok = 0;
        }
      }
    }
    __syncwarp();  // shares lane 0's acquire with the lanes that read the header below
    if (!__shfl_sync(ALL, ok, 0)) return false;

    afd_i64 counts_sum = 0;
    bool negative = false;
    for (int w = HDR_FIXED_WORDS + lane; w < geo.header_words; w += 32) {
      const afd_i32 count = load_volatile32(header + w);
      counts_sum += count;
      negative |= count < 0;
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) counts_sum += __shfl_xor_sync(ALL, counts_sum, d);
    negative = __any_sync(ALL, negative);
    if (lane == 0) {
      const ReplyWant want{j, slot, ring, want_seq, flag, layer_idx, stage_idx,
                           expected_counts[2 * j], expected_counts[2 * j + 1]};
      ok = check_reply(header, counts_sum, negative, want, status);
      if (ok) reply_flags[j] = flag;  // the flag consumed: the combine's last block records it
    }
    if (!__shfl_sync(ALL, ok, 0)) return false;
  }
  if (lane == 0) ok = status_code(status) == STATUS_OK;
  return __shfl_sync(ALL, ok, 0);
}

// grid = 1, block = WAIT_REPLIES_THREADS (one warp): spins until every expected reply arrived
// (bounded by timeout_ns) and validates the headers; errors are latched in the status block.
// NOTE: the spin lives in its own one-block kernel, launched right before afd_combine on the
// same stream: if every combine block spun, a combine of >= #SM blocks would hold every SM,
// and a peer's kernel that needs a whole SM (a large-shared-memory GEMM in another MPS
// client) could never be scheduled. afd_combine then re-checks without waiting.
extern "C" __global__ void __launch_bounds__(WAIT_REPLIES_THREADS)
afd_wait_replies(afd_u64 window,  // this rank's own window
                 SlotGeometry geo, afd_i32 num_ffn_ranks, afd_i32 ring,
                 const afd_i64* __restrict__ expected,         // [num_ffn_ranks]
                 const afd_i32* __restrict__ expected_counts,  // [num_ffn_ranks, 2]
                 afd_i32 layer_idx, afd_i32 stage_idx,
                 const afd_i64* __restrict__ last_seen,  // [num_slots], read only
                 afd_i64* reply_flags,                   // [num_ffn_ranks] out: flags consumed
                 afd_i64 timeout_ns, afd_i64* status) {
  if (blockIdx.x != 0 || threadIdx.x >= 32) return;
  wait_replies(window, geo, num_ffn_ranks, ring, expected, expected_counts, layer_idx, stage_idx,
               last_seen, reply_flags, timeout_ns, status);
}

// grid = max(1, min(T, MAX_BLOCKS)), block = COMBINE_THREADS; blocks stride over tokens,
// threads over hidden.
template <int DT>
__global__ void __launch_bounds__(COMBINE_THREADS)
afd_combine(afd_u64 out,  // payload [num_tokens, hidden_size]
            afd_i32 num_tokens, afd_i32 hidden_size,
            const afd_i32* __restrict__ topk_ids,    // [num_tokens * top_k]
            const float* __restrict__ topk_weights,  // [num_tokens * top_k]
            const afd_i32* __restrict__ pos,         // [num_tokens * top_k]
            afd_i32 top_k, afd_i32 expert_per_rank, afd_i32 num_ffn_ranks, afd_i32 has_shared,
            afd_u64 window,  // this rank's own window
            SlotGeometry geo, afd_i32 ring,
            const afd_i64* __restrict__ expected,         // [num_ffn_ranks]
            const afd_i32* __restrict__ expected_counts,  // [num_ffn_ranks, 2]
            afd_i32 layer_idx, afd_i32 stage_idx,
            afd_i64* last_seen,    // [num_slots]
            afd_i64* reply_flags,  // [num_ffn_ranks]: the flags the wait consumed
            afd_i64 timeout_ns, float out_scale, unsigned int* done_counter, afd_i64* status) {
  __shared__ bool s_ok;
  __shared__ float s_weight[MAX_TOP_K];
  __shared__ const char* s_row[MAX_TOP_K];
  __shared__ const char* s_shared_row;
  const int tid = threadIdx.x;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();

  if (tid < 32) {
    const bool ok = wait_replies(window, geo, num_ffn_ranks, ring, expected, expected_counts,
                                 layer_idx, stage_idx, last_seen, reply_flags, timeout_ns, status);
    if (tid == 0) s_ok = ok;
  }
  __syncthreads();
  const bool ok = s_ok;
  char* out_base = static_cast<char*>(byte_ptr(out, 0));
  const afd_u64 misalign = out | window | static_cast<afd_u64>(geo.flags_bytes) |
                           static_cast<afd_u64>(geo.slot_bytes) |
                           static_cast<afd_u64>(geo.off_routed_x) |
                           static_cast<afd_u64>(geo.off_shared_x) | static_cast<afd_u64>(row_bytes);
  const bool use_vec = (misalign & 15) == 0;
  constexpr int VEC = vec_elems<DT>();

  for (afd_i64 t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    char* out_row = out_base + t * row_bytes;
    if (!ok) {
      for (afd_i64 h = tid; h < hidden_size; h += COMBINE_THREADS) store_elem<DT>(out_row, h, __int_as_float(0x7fc00000));
      continue;
    }
    if (tid < top_k) {
      const afd_i64 p = t * top_k + tid;
      const int dest = topk_ids[p] / expert_per_rank;
      s_weight[tid] = topk_weights[p];
      s_row[tid] = geo.routed_row(geo.slot(window, dest, ring), pos[p], row_bytes);
    }
    if (tid == 0 && has_shared) {
      const int dest = static_cast<int>(t % num_ffn_ranks);
      s_shared_row = geo.shared_row(geo.slot(window, dest, ring), t / num_ffn_ranks, row_bytes);
    }
    __syncthreads();
    if (use_vec) {
      const afd_i64 num_vec = hidden_size / VEC;
      for (afd_i64 v = tid; v < num_vec; v += COMBINE_THREADS) {
        float acc[VEC], x[VEC];
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] = 0.0f;
        for (int k = 0; k < top_k; ++k) {
          unpack16<DT>(reinterpret_cast<const uint4*>(s_row[k])[v], x);
          const float w = s_weight[k];
#pragma unroll
          for (int u = 0; u < VEC; ++u) acc[u] = fmaf(w, x[u], acc[u]);
        }
        if (has_shared) {
          unpack16<DT>(reinterpret_cast<const uint4*>(s_shared_row)[v], x);
#pragma unroll
          for (int u = 0; u < VEC; ++u) acc[u] += x[u];
        }
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] *= out_scale;
        reinterpret_cast<uint4*>(out_row)[v] = pack16<DT>(acc);
      }
    } else {
      for (afd_i64 h = tid; h < hidden_size; h += COMBINE_THREADS) {
        float acc = 0.0f;
        for (int k = 0; k < top_k; ++k) acc = fmaf(s_weight[k], load_elem<DT>(s_row[k], h), acc);
        if (has_shared) acc += load_elem<DT>(s_shared_row, h);
        store_elem<DT>(out_row, h, acc * out_scale);
      }
    }
    __syncthreads();  // s_weight / s_row are rewritten for the next token
  }

  // GPU scope: the output rows and last_seen are read on this GPU only.
  if (!last_block_done(done_counter, /*system_scope=*/false)) return;
  if (status_code(status) == STATUS_OK) {
    for (int j = tid; j < num_ffn_ranks; j += COMBINE_THREADS) {
      if (expected[j] != 0) {
        const afd_i64 slot = geo.slot_index(j, ring);
        // NOTE: the flag the wait accepted, not a re-read: a message landing since (e.g. a
        // shutdown) must stay unseen for the next wait.
        last_seen[slot] = reply_flags[j];
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    *done_counter = 0u;
  }
}
