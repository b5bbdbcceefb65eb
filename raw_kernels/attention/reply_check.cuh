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
// afd_wait_replies left its pass mark), combine_part (a block's token and columns),
// store_nan_part (its elements after an error) and finish_combine (the last block's last_seen).
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

// The header words a reply check reads (wire.decode_header, wire.check_reply), as values: the
// warp loads a header in one round of independent loads (load_reply_words) instead of a chain of
// dependent ones (each early exit of a check waited for its own load: ~15 L2 round trips).
struct ReplyWords {
  afd_i64 magic, version, layer, stage, routed, shared, top_k, flags, echo;
  afd_i64 rows;        // dedup: num_rows (the trailer word); pair: 0
  afd_i64 counts_sum;  // sum of the expert counts
  bool counts_negative;
};

// Warp-collective (every lane of one warp, after the acquire of the reply's flag): lane w loads
// header words w, w + 32, ... (volatile: the slot is rewritten by every reply) and the fixed
// words reach every lane by shuffle; the expert counts [HDR_FIXED_WORDS, counts_end) are summed
// by the warp. `num_rows_word`: the dedup trailer's index, -1 in pair mode. Every lane returns
// the same values.
__device__ inline ReplyWords load_reply_words(const afd_i32* header, int counts_end, int num_rows_word) {
  constexpr unsigned int ALL = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  static_assert(HDR_FIXED_WORDS <= 32, "the fixed words fit one word per lane");
  const afd_i32 mine = lane < counts_end ? load_volatile32(header + lane) : 0;
  const afd_i32 rows = num_rows_word >= 0 ? load_volatile32(header + num_rows_word) : 0;
  afd_i64 sum = 0;
  bool negative = false;
  if (lane >= HDR_FIXED_WORDS && lane < counts_end) {
    sum = mine;
    negative = mine < 0;
  }
  for (int w = 32 + lane; w < counts_end; w += 32) {
    const afd_i32 count = load_volatile32(header + w);
    sum += count;
    negative |= count < 0;
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(ALL, sum, d);
  ReplyWords r;
  r.magic = static_cast<afd_u32>(__shfl_sync(ALL, mine, HDR_MAGIC));
  r.version = __shfl_sync(ALL, mine, HDR_VERSION);
  r.layer = __shfl_sync(ALL, mine, HDR_LAYER);
  r.stage = __shfl_sync(ALL, mine, HDR_STAGE);
  r.routed = __shfl_sync(ALL, mine, HDR_ROUTED_TOKENS);
  r.shared = __shfl_sync(ALL, mine, HDR_SHARED_TOKENS);
  r.top_k = __shfl_sync(ALL, mine, HDR_TOPK);
  r.flags = __shfl_sync(ALL, mine, HDR_FLAGS);
  r.echo = static_cast<afd_u32>(__shfl_sync(ALL, mine, HDR_ECHO_SEQ));
  r.rows = rows;
  r.counts_sum = sum;
  r.counts_negative = __any_sync(ALL, negative);
  return r;
}

// wire.is_late_reply on loaded words: a reply (not a shutdown) whose echo_seq lies in the 2**31
// seqs before `want_seq` (modulo 2**32) answers an earlier dispatch whose wait timed out.
__device__ __forceinline__ bool is_late_reply_words(const ReplyWords& r, afd_i64 want_seq) {
  if (r.flags & FLAG_SHUTDOWN) return false;
  const afd_u32 behind = static_cast<afd_u32>(want_seq & 0xffffffffll) - static_cast<afd_u32>(r.echo);
  return behind != 0u && behind < 0x80000000u;
}

// The checks of wire.decode_header then wire.check_reply, in their order, on loaded words (lane
// 0 only): magic, version, the wire-mode flag, negative sizes, sum(expert_counts) == routed,
// (dedup) sizes no dedup message can have (STATUS_BAD_HEADER), the shutdown flag
// (STATUS_SHUTDOWN), then the echoed seq, layer, stage, routed rows, shared rows and (dedup)
// num_rows (STATUS_REPLY_MISMATCH). ST_COUNT names the header word that failed (HDR_*, or
// num_rows_word). `num_rows_word`: header word of num_rows in dedup mode, -1 in pair mode.
// Returns false after latching the first failing check.
// NOTE: the dedup size check reports ST_EXPECTED = the nearest num_rows the other sizes allow
// (num_rows <= routed <= num_rows * top_k, shared <= num_rows), ST_OBSERVED = num_rows.
__device__ inline bool check_reply(const ReplyWords& r, int num_rows_word, const ReplyWant& want,
                                   afd_i64* status) {
  const auto fail = [&](afd_i64 code, afd_i64 word, afd_i64 expected, afd_i64 observed) {
    report_status(status, code, want.peer, want.slot, want.ring, expected, observed, word, -1,
                  want.layer_idx);
    return false;
  };
  const bool dedup = num_rows_word >= 0;
  if (r.magic != MAGIC) return fail(STATUS_BAD_HEADER, HDR_MAGIC, MAGIC, r.magic);
  if (r.version != VERSION) return fail(STATUS_BAD_HEADER, HDR_VERSION, VERSION, r.version);
  const afd_i64 want_mode = dedup ? FLAG_DEDUP : 0;
  if ((r.flags & FLAG_DEDUP) != want_mode) {
    return fail(STATUS_BAD_HEADER, HDR_FLAGS, want_mode, r.flags & FLAG_DEDUP);
  }
  const afd_i64 routed = r.routed, shared = r.shared, rows = dedup ? r.rows : 0;
  if (routed < 0 || r.counts_negative) {
    return fail(STATUS_BAD_HEADER, HDR_ROUTED_TOKENS, routed, r.counts_sum);
  }
  if (shared < 0) return fail(STATUS_BAD_HEADER, HDR_SHARED_TOKENS, want.shared, shared);
  if (rows < 0) return fail(STATUS_BAD_HEADER, num_rows_word, want.rows, rows);
  if (r.counts_sum != routed) return fail(STATUS_BAD_HEADER, HDR_ROUTED_TOKENS, routed, r.counts_sum);
  if (dedup) {
    const afd_i64 top_k = r.top_k;
    const afd_i64 max_partials = rows * (top_k > 0 ? top_k : 0);
    if (rows > routed) return fail(STATUS_BAD_HEADER, num_rows_word, routed, rows);
    if (shared > rows || routed > max_partials) {
      const afd_i64 min_rows = top_k > 0 ? (routed + top_k - 1) / top_k : -1;
      return fail(STATUS_BAD_HEADER, num_rows_word, shared > min_rows ? shared : min_rows, rows);
    }
  }
  const afd_i64 want_echo = want.seq & 0xffffffffll;
  // a shutdown that kept the reply to this dispatch (FLAG_KEPT_REPLY, wire.answers) is the reply
  if ((r.flags & FLAG_SHUTDOWN) && !((r.flags & FLAG_KEPT_REPLY) && r.echo == want_echo)) {
    report_status(status, STATUS_SHUTDOWN, want.peer, want.slot, want.ring, want.seq,
                  want.seen_flag, -1, -1, want.layer_idx);
    return false;
  }
  if (r.echo != want_echo) return fail(STATUS_REPLY_MISMATCH, HDR_ECHO_SEQ, want_echo, r.echo);
  if (r.layer != want.layer_idx) return fail(STATUS_REPLY_MISMATCH, HDR_LAYER, want.layer_idx, r.layer);
  if (r.stage != want.stage_idx) return fail(STATUS_REPLY_MISMATCH, HDR_STAGE, want.stage_idx, r.stage);
  if (routed != want.routed) return fail(STATUS_REPLY_MISMATCH, HDR_ROUTED_TOKENS, want.routed, routed);
  if (shared != want.shared) return fail(STATUS_REPLY_MISMATCH, HDR_SHARED_TOKENS, want.shared, shared);
  if (dedup && rows != want.rows) return fail(STATUS_REPLY_MISMATCH, num_rows_word, want.rows, rows);
  return true;
}

// Warp-collective: the pass mark of one round of up to 32 ranks from j0, lane l holding
// `seq_l` = expected[j0 + l] and `sent` the warp's ballot of seq_l != 0: seq * MAX_FFN_RANKS + j
// of the lowest rank j sent to, 0 when the round sent to none (sent is warp-uniform).
__device__ __forceinline__ afd_i64 round_pass_mark(afd_i64 seq_l, unsigned int sent, int j0) {
  if (sent == 0u) return 0;
  const int first = __ffs(sent) - 1;
  return __shfl_sync(0xffffffffu, seq_l, first) * MAX_FFN_RANKS + j0 + first;
}

// Warp-collective: what identifies the dispatch whose replies `expected` (written by its scatter)
// waits for: seq * MAX_FFN_RANKS + j of the lowest rank j it sent to, 0 when it sent to none.
// NOTE: seqs count up per (ring, rank) and reply_flags is per ring: a mark left by the wait of an
// earlier dispatch on this ring names an older (rank, seq) and never matches a later dispatch.
__device__ inline afd_i64 wait_pass_mark(const afd_i64* expected, afd_i32 num_ffn_ranks) {
  const int lane = threadIdx.x & 31;
  for (int j0 = 0; j0 < num_ffn_ranks; j0 += 32) {
    const int j = j0 + lane;
    const afd_i64 seq = (j < num_ffn_ranks) ? expected[j] : 0;
    const afd_i64 mark = round_pass_mark(seq, __ballot_sync(0xffffffffu, seq != 0), j0);
    if (mark != 0) return mark;
  }
  return 0;
}

// Warp-collective (every lane of one warp calls it and gets the same result): wait until every
// rank with expected[j] != 0 replied in slot (j, ring) and its reply passes check_reply.
// Lane 0 spins and decides; the warp loads each header in one round (load_reply_words). What
// does not depend on a reply (the status, expected[j], last_seen of every slot waited on) is
// loaded up front, 32 ranks a round, so that a rank's chain is: its flag, one system fence, its
// header. `dedup`: the receiver's wire mode (expected_counts [F, 3] and a num_rows trailer word
// when true, [F, 2] otherwise). Returns false on error (latched in status, possibly by another
// block); `*pass_mark` (lane 0's, may be null): wait_pass_mark of `expected`, computed from
// the same loads.
__device__ inline bool wait_replies(afd_u64 window, const SlotGeometry& geo, afd_i32 num_ffn_ranks,
                                    afd_i32 ring, const afd_i64* expected,
                                    const afd_i32* expected_counts, afd_i32 layer_idx,
                                    afd_i32 stage_idx, const afd_i64* last_seen,
                                    afd_i64* reply_flags, afd_i64 timeout_ns, afd_i64* status,
                                    bool dedup, afd_i64* pass_mark = nullptr) {
  constexpr unsigned int ALL = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  // dedup: the last header word is num_rows, not an expert count
  const int counts_end = dedup ? geo.header_words - 1 : geo.header_words;
  const int num_rows_word = dedup ? counts_end : -1;
  const int count_cols = dedup ? 3 : 2;
  int ok = (lane == 0) ? status_code(status) == STATUS_OK : 0;
  afd_i64 mark = 0;
  const afd_i64 start = globaltimer_ns();
  for (int j0 = 0; j0 < num_ffn_ranks; j0 += 32) {
    // this round's ranks, one a lane, loaded together (none depends on another's value)
    const int jl = j0 + lane;
    const bool in = jl < num_ffn_ranks;
    const afd_i64 seq_l = in ? expected[jl] : 0;
    const afd_i64 seen_l = in ? last_seen[geo.slot_index(jl, ring)] : 0;
    const afd_i32 routed_l = in ? expected_counts[count_cols * jl] : 0;
    const afd_i32 shared_l = in ? expected_counts[count_cols * jl + 1] : 0;
    const afd_i32 rows_l = (in && dedup) ? expected_counts[count_cols * jl + 2] : 0;
    const unsigned int sent = __ballot_sync(ALL, seq_l != 0);
    if (mark == 0) mark = round_pass_mark(seq_l, sent, j0);
    if (!__shfl_sync(ALL, ok, 0)) break;
    for (unsigned int todo = sent; todo != 0u; todo &= todo - 1u) {  // warp-uniform
      const int l = __ffs(todo) - 1, j = j0 + l;
      const afd_i64 want_seq = __shfl_sync(ALL, seq_l, l);
      afd_i64 seen = __shfl_sync(ALL, seen_l, l);
      const afd_i64 slot = geo.slot_index(j, ring);
      const afd_i64* flag_word = geo.flag_at(window, slot);
      const afd_i32* header = geo.header(geo.slot_at(window, slot));
      afd_i64 flag = 0;
      if (lane == 0 && seen == SHUTDOWN_SEQ) {  // the peer's shutdown was consumed on this slot
        report_status(status, STATUS_SHUTDOWN, j, slot, ring, want_seq, seen, -1, -1, layer_idx);
        ok = 0;
      }
      ReplyWords words;
      while (__shfl_sync(ALL, ok, 0)) {
        if (lane == 0) {
          for (int spin = 1;; ++spin) {
            flag = load_acquire_sys(flag_word);  // acquire: header and rows were written before it
            if (flag != seen) break;
            if (globaltimer_ns() - start > timeout_ns) {
              report_status(status, STATUS_TIMEOUT, j, slot, ring, want_seq, flag, -1, -1, layer_idx);
              ok = 0;
              break;
            }
            if (spin % STATUS_POLL_EVERY == 0 && status_code(status) != STATUS_OK) {
              ok = 0;
              break;
            }
          }
        }
        __syncwarp();  // shares lane 0's acquire with the lanes that read the header below
        if (!__shfl_sync(ALL, ok, 0)) break;
        flag = __shfl_sync(ALL, flag, 0);
        words = load_reply_words(header, counts_end, num_rows_word);
        if (!is_late_reply_words(words, want_seq)) break;
        seen = flag;  // answers a dispatch whose wait timed out: dropped, keep waiting
      }
      if (!__shfl_sync(ALL, ok, 0)) break;
      const afd_i32 routed = __shfl_sync(ALL, routed_l, l);
      const afd_i32 shared = __shfl_sync(ALL, shared_l, l);
      const afd_i32 rows = __shfl_sync(ALL, rows_l, l);
      if (lane == 0) {
        const ReplyWant want{j, slot, ring, want_seq, flag, layer_idx, stage_idx, routed, shared, rows};
        ok = check_reply(words, num_rows_word, want, status);
        if (ok) reply_flags[j] = flag;  // the flag consumed: the combine's last block records it
      }
      if (!__shfl_sync(ALL, ok, 0)) break;
    }
    if (!__shfl_sync(ALL, ok, 0)) break;
  }
  if (pass_mark != nullptr && lane == 0) *pass_mark = mark;
  if (!__shfl_sync(ALL, ok, 0)) return false;
  if (lane == 0) ok = status_code(status) == STATUS_OK;
  return __shfl_sync(ALL, ok, 0);
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
    // the mark left, the status and expected: one round of independent loads
    afd_i64 posted = 0, code = STATUS_OK;
    if (tid == 0) {
      posted = __ldcg(reply_flags + num_ffn_ranks);
      code = status_code(status);
    }
    const afd_i64 mark = wait_pass_mark(expected, num_ffn_ranks);
    int passed = 0;
    if (tid == 0) passed = mark != 0 && posted == mark && code == STATUS_OK;
    const bool ok = __shfl_sync(0xffffffffu, passed, 0) ||
                    wait_replies(window, geo, num_ffn_ranks, ring, expected, expected_counts,
                                 layer_idx, stage_idx, last_seen, reply_flags, timeout_ns, status,
                                 dedup);
    if (tid == 0) s_ok = ok;
  }
  __syncthreads();
  return s_ok;
}

// One block's share of a combine: token `t` and its output elements [begin, end), whole 16-byte
// vectors but the row's last, for work item `item` of num_tokens * parts (combine_parts cuts
// each row into `parts`; an item past the row's end gets an empty range).
struct CombinePart {
  afd_i64 t, begin, end;
};
template <int DT>
__device__ __forceinline__ CombinePart combine_part(afd_i64 item, afd_i64 parts, afd_i32 hidden_size) {
  constexpr afd_i64 VEC = vec_elems<DT>();
  const afd_i64 per_part = ((hidden_size + VEC - 1) / VEC + parts - 1) / parts * VEC;
  CombinePart c;
  c.t = item / parts;
  c.begin = (item % parts) * per_part;
  c.end = c.begin + per_part < hidden_size ? c.begin + per_part : hidden_size;
  if (c.begin > c.end) c.begin = c.end;
  return c;
}

// A combine block's part of one token's output row after an error (every thread of the
// block): NaN in elements [begin, end), so that no stale or partial row passes for a result.
// Plain stores, no ordering.
template <int DT>
__device__ __forceinline__ void store_nan_part(char* out_row, const CombinePart& c) {
  for (afd_i64 h = c.begin + threadIdx.x; h < c.end; h += COMBINE_THREADS) {
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
