// publish.cuh: how a sender publishes a message (docs/design.md §4.3, §5): the last block writes
// the header words, one system-scope release fence, then the flag. Shared by the dispatch
// scatters (dispatch.cu, dedup_attn.cu) and the replies (reply.cu, dedup_ffn.cu, ffn_graph.cu).
//
// NOTE: every helper is inlined into a kernel whose blocks all call it (it holds barriers), and
// it keeps the stores, fences and their order of the code it replaced.
#pragma once

#include "wire.cuh"

namespace afd {

// The last block of a reply kernel (block = REPLY_THREADS; every thread of it, once
// last_block_done(.., system_scope=true) released every block's rows and returned true): copies
// the header words into `slot`; a barrier puts them before thread 0's system fence (cumulative
// over header and rows), which precedes flag = seq in slot (src_rank, ring) of dst_window; then
// the done counter is reset. dst_window 0 (a put peer): no flag, the host's put-with-signal
// queued behind this kernel sets it (§6.1). header_src: pinned host words (read volatile) when
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
    __threadfence_system();  // release, cumulative over the header and every block's rows
    if (dst_window) store_volatile(geo.flag(dst_window, src_rank, ring), seq);
    __threadfence();
    *done_counter = 0u;
  }
}

}  // namespace afd
