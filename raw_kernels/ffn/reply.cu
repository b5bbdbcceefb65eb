// reply.cu: FFN-side one-sided write of the expert outputs back into the Attention sender's
// window (docs/design/kernels.md): routed rows, shared rows, then (last block, after a system fence) the
// header prepared by the host in pinned memory, a second fence, and the flag = seq. For a peer
// reached by puts (dst_window 0) the same bytes go to the own staging slot and the host's
// put-with-signal sets the flag (docs/design/put-transport.md).
#include "common/wire.cuh"
#include "common/payload.cuh"
#include "common/block.cuh"
#include "common/publish.cuh"  // publish_reply

using namespace afd;

// grid = max(1, min(ceil((R + S) / ROWS_PER_BLOCK), MAX_BLOCKS)), block = REPLY_THREADS;
// a warp per row.
template <int DT>
__global__ void __launch_bounds__(REPLY_THREADS)
afd_reply(afd_u64 dst_window,  // the Attention peer's window as mapped here; 0: put peer
          afd_u64 staging,     // own symmetric put staging (used when dst_window is 0)
          afd_i32 dst_peer,    // the Attention peer's role rank: its staging slot (dst_peer, ring)
          SlotGeometry geo,
          afd_i32 src_rank, afd_i32 ring,  // slot (region = src_rank, ring): own FFN rank
          afd_u64 routed_out, afd_i32 num_routed,  // payload [num_routed, hidden_size]
          afd_u64 shared_out, afd_i32 num_shared,  // payload [num_shared, hidden_size]
          afd_i32 hidden_size,
          afd_u64 header_src,  // pinned host int32 [geo.header_words]
          afd_i64 seq, unsigned int* done_counter) {
  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  char* slot = geo.send_slot(dst_window, staging, dst_peer, src_rank, ring);
  const afd_i64 num_rows = static_cast<afd_i64>(num_routed) + num_shared;
  const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;

  for (afd_i64 r = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5); r < num_rows;
       r += warp_stride) {
    const bool is_routed = r < num_routed;
    const afd_i64 row = is_routed ? r : r - num_routed;
    const char* src = static_cast<const char*>(byte_ptr(is_routed ? routed_out : shared_out, row * row_bytes));
    char* dst = is_routed ? geo.routed_row(slot, row, row_bytes) : geo.shared_row(slot, row, row_bytes);
    warp_copy_row(dst, src, row_bytes, lane);
  }

  // Every block's rows are released at system scope here; then the header from the pinned
  // staging row, a system fence and the flag (a put peer: no flag).
  if (!last_block_done(done_counter, /*system_scope=*/true)) return;
  publish_reply(geo, slot, dst_window, src_rank, ring,
                static_cast<const afd_i32*>(byte_ptr(header_src, 0)), /*pinned_src=*/true, seq,
                done_counter);
}
