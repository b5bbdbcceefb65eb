// wait_any.cu: FFN-side arrival detection over every (region, ring) flag of the own window
// (docs/design/kernels.md). One warp scans the flags in rotated order from *scan_start; the first slot
// whose flag differs from last_seen wins, its header is copied into a doorbell in pinned host
// memory, and the ticket is written last: the host spins on doorbell[DB_TICKET] == ticket.
// The header's expert counts go, from the same loads, into counts_snapshot[slot] (device): the
// FFN's grouped GEMM reads its group sizes there, i.e. exactly the counts the host validated in
// the doorbell, never the live window header a sender could rewrite after a timeout.
#include "common/wire.cuh"
#include "ffn/wait_any.cuh"  // scan_flags

using namespace afd;

// grid = 1, block = WAIT_ANY_THREADS (one warp).
extern "C" __global__ void __launch_bounds__(WAIT_ANY_THREADS)
afd_wait_any(afd_u64 window,  // own window
             SlotGeometry geo,
             afd_i64* last_seen,   // [num_slots], device
             afd_i32* scan_start,  // [1], device
             afd_i32* counts_snapshot,  // [num_slots, header_words - HDR_FIXED_WORDS], device
             afd_i64 timeout_ns,
             afd_u64 doorbell,  // pinned host: int64 [DB_HEADER + ceil(header_words / 2)]
             afd_i64 ticket) {
  const int lane = threadIdx.x;
  afd_i64* bell = static_cast<afd_i64*>(byte_ptr(doorbell, 0));
  afd_i64 won_flag = 0;
  const int won_slot = scan_flags(window, geo, last_seen, *scan_start, timeout_ns, &won_flag);
  const int num_slots = static_cast<int>(geo.num_slots());
  if (won_slot < 0) {
    if (lane == 0) {
      store_volatile(bell + DB_SLOT, -1);
      store_volatile(bell + DB_FLAG, 0);
      store_volatile(bell + DB_STATUS, STATUS_TIMEOUT);
      __threadfence_system();
      store_volatile(bell + DB_TICKET, ticket);
    }
    return;
  }

  const afd_i32* header = geo.header(geo.slot_at(window, won_slot));
  volatile afd_i32* bell_words = reinterpret_cast<volatile afd_i32*>(bell + DB_HEADER);
  const int num_counts = static_cast<int>(geo.header_words) - HDR_FIXED_WORDS;
  afd_i32* snapshot = counts_snapshot + static_cast<afd_i64>(won_slot) * num_counts;
  for (int w = lane; w < geo.header_words; w += 32) {
    const afd_i32 word = load_volatile32(header + w);
    bell_words[w] = word;
    if (w >= HDR_FIXED_WORDS) snapshot[w - HDR_FIXED_WORDS] = word;
  }
  if (lane == 0) {
    store_volatile(bell + DB_SLOT, won_slot);
    store_volatile(bell + DB_FLAG, won_flag);
    store_volatile(bell + DB_STATUS, STATUS_OK);
    last_seen[won_slot] = won_flag;
    *scan_start = (won_slot + 1 == num_slots) ? 0 : won_slot + 1;
  }
  // One release for the whole doorbell: __syncwarp orders every lane's header words before
  // lane 0's fence, which is cumulative, so the ticket store after it is the last write the
  // host can observe. One fence, because each system fence waits for the posted PCIe writes
  // before it (~1 us).
  __syncwarp();
  if (lane == 0) {
    __threadfence_system();
    store_volatile(bell + DB_TICKET, ticket);
  }
}
