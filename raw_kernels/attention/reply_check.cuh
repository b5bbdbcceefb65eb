// reply_check.cuh: the Attention side's reply wait and checks (docs/design/protocol.md, docs/design/kernels.md), shared by
// the pair combine (combine.cu) and the dedup combine (dedup_attn.cu).
//
// wait_replies spins (one warp) until every FFN rank with expected[j] != 0 replied in slot
// (j, ring) of the own window, skips late replies (wire.is_late_reply) and checks each header like
// wire.decode_header then wire.check_reply, in their order; the first error is latched in the
// status block. `dedup` selects the receiver's wire mode (docs/design/dedup.md): FLAG_DEDUP must be
// set exactly in dedup mode, the header has one more word (num_rows at geo.header_words - 1, not
// an expert count) and expected_counts has three columns (routed, shared, rows) instead of two.
// The combines' common frame is here too: combine_wait (the first warp re-runs the wait unless
// afd_wait_replies left its pass mark), store_nan_row (a token's row after an error) and
// finish_combine (the last block's last_seen).
//
// reply_flags int64 [F + 1]: words 0..F-1 the flag each accepted reply was consumed with; word F
// the pass mark (wait_pass_mark) afd_wait_replies leaves when it accepted every expected reply of
// this dispatch, 0 otherwise. A combine block that finds the mark of its own dispatch there (and
// an OK status) skips the re-check: ~3 us of dependent header reads per block on an H200. The
// combine's last block clears it.
#pragma once

#include "common/wire.cuh"
#include "common/payload.cuh"
#include "common/block.cuh"

namespace afd {

constexpr int STATUS_POLL_EVERY = 256;  // spin iterations between looks at the status block

// What the reply of one FFN rank must be: where it lands and what it must echo.
struct ReplyWant {
  afd_i64 peer, slot, ring, seq, seen_flag;
  afd_i64 layer_idx, stage_idx, routed, shared;
  afd_i64 rows;  // dedup: rows of the dispatch (num_rows); unused in pair mode
};

// The checks of wire.decode_header then wire.check_reply, in their order (lane 0 only):
// magic, version, the wire-mode flag, negative sizes, sum(expert_counts) == routed, (dedup) sizes
// no dedup message can have (STATUS_BAD_HEADER), the shutdown flag (STATUS_SHUTDOWN), then the
// echoed seq, layer, stage, routed rows, shared rows and (dedup) num_rows (STATUS_REPLY_MISMATCH).
// ST_COUNT names the header word that failed (HDR_*, or num_rows_word). The expert counts were
// summed by the whole warp: `counts_sum`, `counts_negative`. `num_rows_word`: header word of
// num_rows in dedup mode, -1 in pair mode. Returns false after latching the first failing check.
// NOTE: the dedup size check reports ST_EXPECTED = the nearest num_rows the other sizes allow
// (num_rows <= routed <= num_rows * top_k, shared <= num_rows), ST_OBSERVED = num_rows.
__device__ inline bool check_reply(const afd_i32* header, afd_i64 counts_sum, bool counts_negative,
                                   int num_rows_word, const ReplyWant& want, afd_i64* status) {
  const auto fail = [&](afd_i64 code, afd_i64 word, afd_i64 expected, afd_i64 observed) {
    report_status(status, code, want.peer, want.slot, want.ring, expected, observed, word, -1,
                  want.layer_idx);
    return false;
  };
  const bool dedup = num_rows_word >= 0;
  const afd_i64 magic = static_cast<afd_u32>(load_volatile32(header + HDR_MAGIC));
  if (magic != MAGIC) return fail(STATUS_BAD_HEADER, HDR_MAGIC, MAGIC, magic);
  const afd_i64 version = load_volatile32(header + HDR_VERSION);
  if (version != VERSION) return fail(STATUS_BAD_HEADER, HDR_VERSION, VERSION, version);
  const afd_i64 flags = load_volatile32(header + HDR_FLAGS);
  const afd_i64 want_mode = dedup ? FLAG_DEDUP : 0;
  if ((flags & FLAG_DEDUP) != want_mode) {
    return fail(STATUS_BAD_HEADER, HDR_FLAGS, want_mode, flags & FLAG_DEDUP);
  }
  const afd_i64 routed = load_volatile32(header + HDR_ROUTED_TOKENS);
  const afd_i64 shared = load_volatile32(header + HDR_SHARED_TOKENS);
  const afd_i64 rows = dedup ? load_volatile32(header + num_rows_word) : 0;
  if (routed < 0 || counts_negative) {
    return fail(STATUS_BAD_HEADER, HDR_ROUTED_TOKENS, routed, counts_sum);
  }
  if (shared < 0) return fail(STATUS_BAD_HEADER, HDR_SHARED_TOKENS, want.shared, shared);
  if (rows < 0) return fail(STATUS_BAD_HEADER, num_rows_word, want.rows, rows);
  if (counts_sum != routed) return fail(STATUS_BAD_HEADER, HDR_ROUTED_TOKENS, routed, counts_sum);
  if (dedup) {
    const afd_i64 top_k = load_volatile32(header + HDR_TOPK);
    const afd_i64 max_partials = rows * (top_k > 0 ? top_k : 0);
    if (rows > routed) return fail(STATUS_BAD_HEADER, num_rows_word, routed, rows);
    if (shared > rows || routed > max_partials) {
      const afd_i64 min_rows = top_k > 0 ? (routed + top_k - 1) / top_k : -1;
      return fail(STATUS_BAD_HEADER, num_rows_word, shared > min_rows ? shared : min_rows, rows);
    }
  }
  const afd_i64 echo = static_cast<afd_u32>(load_volatile32(header + HDR_ECHO_SEQ));
  const afd_i64 want_echo = want.seq & 0xffffffffll;
  // a shutdown that kept the reply to this dispatch (FLAG_KEPT_REPLY, wire.answers) is the reply
  if ((flags & FLAG_SHUTDOWN) && !((flags & FLAG_KEPT_REPLY) && echo == want_echo)) {
    report_status(status, STATUS_SHUTDOWN, want.peer, want.slot, want.ring, want.seq,
                  want.seen_flag, -1, -1, want.layer_idx);
    return false;
  }
  if (echo != want_echo) return fail(STATUS_REPLY_MISMATCH, HDR_ECHO_SEQ, want_echo, echo);
  const afd_i64 layer = load_volatile32(header + HDR_LAYER);
  if (layer != want.layer_idx) return fail(STATUS_REPLY_MISMATCH, HDR_LAYER, want.layer_idx, layer);
  const afd_i64 stage = load_volatile32(header + HDR_STAGE);
  if (stage != want.stage_idx) return fail(STATUS_REPLY_MISMATCH, HDR_STAGE, want.stage_idx, stage);
  if (routed != want.routed) return fail(STATUS_REPLY_MISMATCH, HDR_ROUTED_TOKENS, want.routed, routed);
  if (shared != want.shared) return fail(STATUS_REPLY_MISMATCH, HDR_SHARED_TOKENS, want.shared, shared);
  if (dedup && rows != want.rows) return fail(STATUS_REPLY_MISMATCH, num_rows_word, want.rows, rows);
  return true;
}

// Warp-collective (every lane of one warp calls it and gets the same result): wait until every
// rank with expected[j] != 0 replied in slot (j, ring) and its reply passes check_reply.
// Lane 0 spins and decides; the lanes only help sum the expert counts. `dedup`: the receiver's
// wire mode (expected_counts [F, 3] and a num_rows trailer word when true, [F, 2] otherwise).
// Returns false on error (latched in status, possibly by another block).
__device__ inline bool wait_replies(afd_u64 window, const SlotGeometry& geo, afd_i32 num_ffn_ranks,
                                    afd_i32 ring, const afd_i64* expected,
                                    const afd_i32* expected_counts, afd_i32 layer_idx,
                                    afd_i32 stage_idx, const afd_i64* last_seen,
                                    afd_i64* reply_flags, afd_i64 timeout_ns, afd_i64* status,
                                    bool dedup) {
  constexpr unsigned int ALL = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  // dedup: the last header word is num_rows, not an expert count
  const int counts_end = dedup ? geo.header_words - 1 : geo.header_words;
  const int num_rows_word = dedup ? counts_end : -1;
  const int count_cols = dedup ? 3 : 2;
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
      if (seen == SHUTDOWN_SEQ) {  // the peer's shutdown was consumed on this slot: at once
        report_status(status, STATUS_SHUTDOWN, j, slot, ring, want_seq, seen, -1, -1, layer_idx);
        ok = 0;
      }
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
    for (int w = HDR_FIXED_WORDS + lane; w < counts_end; w += 32) {
      const afd_i32 count = load_volatile32(header + w);
      counts_sum += count;
      negative |= count < 0;
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) counts_sum += __shfl_xor_sync(ALL, counts_sum, d);
    negative = __any_sync(ALL, negative);
    if (lane == 0) {
      const afd_i32* counts = expected_counts + count_cols * j;
      const ReplyWant want{j, slot, ring, want_seq, flag, layer_idx, stage_idx,
                           counts[0], counts[1], dedup ? counts[2] : 0};
      ok = check_reply(header, counts_sum, negative, num_rows_word, want, status);
      if (ok) reply_flags[j] = flag;  // the flag consumed: the combine's last block records it
    }
    if (!__shfl_sync(ALL, ok, 0)) return false;
  }
  if (lane == 0) ok = status_code(status) == STATUS_OK;
  return __shfl_sync(ALL, ok, 0);
}

// Warp-collective: what identifies the dispatch whose replies `expected` (written by its scatter)
// waits for: seq * MAX_FFN_RANKS + j of the lowest rank j it sent to, 0 when it sent to none.
// NOTE: seqs count up per (ring, rank) and reply_flags is per ring: a mark left by the wait of an
// earlier dispatch on this ring names an older (rank, seq) and never matches a later dispatch.
__device__ inline afd_i64 wait_pass_mark(const afd_i64* expected, afd_i32 num_ffn_ranks) {
  constexpr unsigned int ALL = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  for (int j0 = 0; j0 < num_ffn_ranks; j0 += 32) {
    const int j = j0 + lane;
    const afd_i64 seq = (j < num_ffn_ranks) ? expected[j] : 0;
    const unsigned int sent = __ballot_sync(ALL, seq != 0);
    if (sent != 0u) {
      const int first = __ffs(sent) - 1;
      return __shfl_sync(ALL, seq, first) * MAX_FFN_RANKS + j0 + first;
    }
  }
  return 0;
}

// Last block of a combine (every thread calls it): when the status is OK, record the flag each
// waited-for reply was accepted with as last_seen of its slot.
// NOTE: the flag the wait accepted, not a re-read: a message landing since (e.g. a shutdown) must
// stay unseen for the next wait. After an error last_seen stays behind and the next wait skips
// the stale reply as late.
__device__ inline void mark_replies_seen(const SlotGeometry& geo, afd_i32 num_ffn_ranks,
                                         afd_i32 ring, const afd_i64* expected,
                                         const afd_i64* reply_flags, afd_i64* last_seen,
                                         afd_i64* status, int num_threads) {
  if (status_code(status) != STATUS_OK) return;
  for (int j = threadIdx.x; j < num_ffn_ranks; j += num_threads) {
    if (expected[j] != 0) last_seen[geo.slot_index(j, ring)] = reply_flags[j];
  }
}

// The start of a combine block (block = COMBINE_THREADS; every thread calls it once): the first
// warp re-runs the wait (wait_replies; immediate once afd_wait_replies succeeded), unless
// reply_flags[F] holds this dispatch's pass mark and the status is OK; a barrier hands the
// verdict to every thread. Ordering: on the re-check lane 0 acquired the replies (its system
// fence after the flag) before the barrier; with the mark, afd_wait_replies acquired them in an
// earlier kernel of this stream, which finished before this one started. Either way, on true
// every thread may read the reply rows.
__device__ __forceinline__ bool combine_wait(afd_u64 window, const SlotGeometry& geo,
                                             afd_i32 num_ffn_ranks, afd_i32 ring,
                                             const afd_i64* expected,
                                             const afd_i32* expected_counts, afd_i32 layer_idx,
                                             afd_i32 stage_idx, const afd_i64* last_seen,
                                             afd_i64* reply_flags, afd_i64 timeout_ns,
                                             afd_i64* status, bool dedup) {
  __shared__ bool s_ok;
  const int tid = threadIdx.x;
  if (tid < 32) {
    const afd_i64 mark = wait_pass_mark(expected, num_ffn_ranks);
    int passed = 0;
    if (tid == 0 && mark != 0) {
      passed = __ldcg(reply_flags + num_ffn_ranks) == mark && status_code(status) == STATUS_OK;
    }
    const bool ok = __shfl_sync(0xffffffffu, passed, 0) ||
                    wait_replies(window, geo, num_ffn_ranks, ring, expected, expected_counts,
                                 layer_idx, stage_idx, last_seen, reply_flags, timeout_ns, status,
                                 dedup);
    if (tid == 0) s_ok = ok;
  }
  __syncthreads();
  return s_ok;
}

// A combine block's output row of one token after an error (every thread of the block): NaN in
// every element, so that no stale or partial row passes for a result. Plain stores, no ordering.
template <int DT>
__device__ __forceinline__ void store_nan_row(char* out_row, afd_i32 hidden_size) {
  const int tid = threadIdx.x;
  for (afd_i64 h = tid; h < hidden_size; h += COMBINE_THREADS) {
    store_elem<DT>(out_row, h, __int_as_float(0x7fc00000));
  }
}

// The end of a combine (every thread of every block calls it once, after its output rows).
// Ordering: last_block_done at GPU scope (the output rows and last_seen are read on this GPU
// only); the last block then records the accepted flags in last_seen (mark_replies_seen), clears
// the wait's pass mark (every block has read it) and resets the done counter
// (reset_done_counter).
__device__ __forceinline__ void finish_combine(unsigned int* done_counter, const SlotGeometry& geo,
                                               afd_i32 num_ffn_ranks, afd_i32 ring,
                                               const afd_i64* expected,
                                               afd_i64* reply_flags, afd_i64* last_seen,
                                               afd_i64* status) {
  if (!last_block_done(done_counter, /*system_scope=*/false)) return;
  mark_replies_seen(geo, num_ffn_ranks, ring, expected, reply_flags, last_seen, status,
                    COMBINE_THREADS);
  if (threadIdx.x == 0) reply_flags[num_ffn_ranks] = 0;
  reset_done_counter(done_counter);
}

}  // namespace afd
