// publish.cuh: how a sender publishes a message (docs/design/protocol.md, docs/design/kernels.md): the last block writes
// the header words, one system-scope release fence, then the flag. Shared by the dispatch
// scatters (dispatch.cu, dedup_attn.cu, dedup_attn_fused.cu) and the replies (reply.cu, dedup_ffn.cu,
// ffn_graph_rows.cu).
//
// NOTE: every thread of the last block calls these helpers (they hold barriers); they are
// inlined and keep the stores, fences and their order of the code they replaced.
#pragma once

#include "common/wire.cuh"

namespace afd {

// The words every header of one dispatch shares (wire.encode_header); seq, routed, shared, the
// expert counts and (dedup) num_rows are per rank.
struct DispatchHeader {
  afd_i32 src_rank, layer_idx, stage_idx, num_tokens, top_k;
  afd_i32 flags;  // HDR_FLAGS (dedup mode: with FLAG_DEDUP)
};

// The last block of a dispatch scatter (block = SCATTER_THREADS; every thread of it, once
// last_block_done(.., system_scope=true) released every block's rows and a barrier published
// the per-rank words). Ordering: writes the header of every rank j with seqs[j] != 0, a barrier,
// then per such rank a system fence and flag = seqs[j] in the storing thread (cumulative over
// the headers and every block's rows, so all precede the flag). Rank j's message goes to slot
// (src_rank, ring) of peer_windows[j], or for a put peer (peer_windows[j] 0) to the own staging
// slot (j, ring), whose flag word the host's flag put copies (docs/design/put-transport.md). seqs, routed, shared,
// rows: per-rank words in shared memory; DEDUP: rows[j] is the num_rows trailer word at
// HDR_FIXED_WORDS + epr (pair mode: rows unused, null). expert_counts: the plan's [F * epr].
template <bool DEDUP>
__device__ __forceinline__ void publish_dispatch(const SlotGeometry& geo, const afd_u64* peer_windows,
                                                 afd_u64 staging, afd_i32 ring,
                                                 afd_i32 num_ffn_ranks, afd_i32 expert_per_rank,
                                                 const DispatchHeader& hdr, const afd_i64* seqs,
                                                 const afd_i32* routed, const afd_i32* shared,
                                                 const afd_i32* rows,
                                                 const afd_i32* expert_counts) {
  const int tid = threadIdx.x;
  const afd_i32 hdr_words = geo.header_words;  // dedup: HDR_FIXED_WORDS + epr + 1 (num_rows)
  const afd_i32 num_rows_word = HDR_FIXED_WORDS + expert_per_rank;
  const afd_i64 total_words = static_cast<afd_i64>(num_ffn_ranks) * hdr_words;
  for (afd_i64 idx = tid; idx < total_words; idx += SCATTER_THREADS) {
    const int j = static_cast<int>(idx / hdr_words), w = static_cast<int>(idx % hdr_words);
    const afd_i64 seq = seqs[j];
    if (seq == 0) continue;
    afd_i32 value;
    switch (w) {
      case HDR_MAGIC: value = static_cast<afd_i32>(MAGIC); break;
      case HDR_VERSION: value = static_cast<afd_i32>(VERSION); break;
      case HDR_SEQ: value = static_cast<afd_i32>(static_cast<afd_u32>(seq & 0xffffffffll)); break;
      case HDR_SRC_RANK: value = hdr.src_rank; break;
      case HDR_LAYER: value = hdr.layer_idx; break;
      case HDR_STAGE: value = hdr.stage_idx; break;
      case HDR_NUM_TOKENS: value = hdr.num_tokens; break;
      case HDR_ROUTED_TOKENS: value = routed[j]; break;
      case HDR_SHARED_TOKENS: value = shared[j]; break;
      case HDR_TOPK: value = hdr.top_k; break;
      case HDR_FLAGS: value = hdr.flags; break;
      case HDR_ECHO_SEQ: value = 0; break;
      default:
        if constexpr (DEDUP) {
          value = (w == num_rows_word) ? rows[j]
                                       : expert_counts[j * expert_per_rank + (w - HDR_FIXED_WORDS)];
        } else {
          value = expert_counts[j * expert_per_rank + (w - HDR_FIXED_WORDS)];
        }
        break;
    }
    geo.header(geo.send_slot(peer_windows[j], staging, j, hdr.src_rank, ring))[w] = value;
  }
  __syncthreads();  // every header word of the block precedes the fences below
  for (int j = tid; j < num_ffn_ranks; j += SCATTER_THREADS) {
    if (seqs[j] != 0) {
      // Release in the storing thread itself: cumulative over the headers (bar.sync above) and
      // over every block's rows (last_block_done), so all precede the flag.
      fence_release_sys();
      store_volatile(geo.send_flag(peer_windows[j], staging, j, hdr.src_rank, ring), seqs[j]);
    }
  }
}

// The last block of a reply kernel (block = REPLY_THREADS; every thread of it, once
// last_block_done(.., system_scope=true) released every block's rows and returned true): copies
// the header words into `slot`; a barrier puts them before thread 0's system fence (cumulative
// over header and rows), which precedes flag = seq in slot (src_rank, ring) of dst_window; then
// the done counter is reset. dst_window 0 (a put peer): no flag, the host's put-with-signal
// queued behind this kernel sets it (docs/design/put-transport.md). header_src: pinned host words (read volatile) when
// `pinned_src`, else device words of an earlier kernel.
// NOTE: `seq` by reference: thread 0 reads it after its fence, as the graph replies (which pass
// the stage's state word) always did.
__device__ __forceinline__ void publish_reply(const SlotGeometry& geo, char* slot, afd_u64 dst_window,
                                              afd_i32 src_rank, afd_i32 ring,
                                              const afd_i32* header_src, bool pinned_src,
                                              const afd_i64& seq, unsigned int* done_counter) {
  afd_i32* header = geo.header(slot);
  for (int w = threadIdx.x; w < geo.header_words; w += REPLY_THREADS) {
    header[w] = pinned_src ? load_volatile32(header_src + w) : header_src[w];
  }
  __syncthreads();  // every header word of the block precedes thread 0's fence
  if (threadIdx.x == 0) {
    fence_release_sys();  // release, cumulative over the header and every block's rows
    if (dst_window) store_volatile(geo.flag(dst_window, src_rank, ring), seq);
    *done_counter = 0u;  // read by the next launch only (stream order): no fence
  }
}

}  // namespace afd
