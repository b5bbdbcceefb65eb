// wait_any.cuh: the FFN side's scan over every (region, ring) flag of the own window, shared by
// afd_wait_any (wait_any.cu: the eager path's doorbell) and afd_graph_wait_stage (ffn_graph_stage.cu:
// the graph-driven FFN, wait and stage in one kernel).
#pragma once

#include "common/wire.cuh"

namespace afd {

// Warp-collective (every lane of one warp calls it and gets the same result): scan the flags in
// rotated order from `start` until a slot's flag differs from last_seen (returns that slot and its
// flag in *won_flag, acquired at system scope: every lane may read the slot's header after it)
// or `timeout_ns` passed (returns -1). Reads last_seen, writes nothing.
// The flags are polled with acquire loads (wire.cuh: no fence on arrival). With at most 32
// slots each lane keeps its slot and its last_seen in registers for the whole wait: an acquire
// load invalidates the SM's L1, so a last_seen read per poll would cost an L2 round trip.
__device__ inline int scan_flags(afd_u64 window, const SlotGeometry& geo, const afd_i64* last_seen,
                                 int start, afd_i64 timeout_ns, afd_i64* won_flag) {
  const int lane = threadIdx.x & 31;
  const int num_slots = static_cast<int>(geo.num_slots());
  const afd_i64* flags = geo.flag_at(window, 0);
  if (start < 0 || start >= num_slots) start = 0;
  const afd_i64 t0 = globaltimer_ns();
  const bool one_round = num_slots <= 32;
  int my_slot = start + lane;  // one_round: this lane's slot (idx = lane) and its last_seen
  if (my_slot >= num_slots) my_slot -= num_slots;
  const afd_i64 my_seen = (one_round && lane < num_slots) ? last_seen[my_slot] : 0;
  int won_slot = -1;
  afd_i64 flag_won = 0;
  while (true) {
    for (int base = 0; base < num_slots && won_slot < 0; base += 32) {
      const int idx = base + lane;
      int slot = start + idx;
      if (slot >= num_slots) slot -= num_slots;
      afd_i64 flag = 0;
      bool arrived = false;
      if (idx < num_slots) {
        flag = load_acquire_sys(flags + slot);  // acquire: the winner's message is readable after it
        arrived = flag != (one_round ? my_seen : last_seen[slot]);
      }
      const unsigned int ballot = __ballot_sync(0xffffffffu, arrived);
      if (ballot != 0u) {
        const int winner = __ffs(ballot) - 1;  // first in rotated order
        won_slot = __shfl_sync(0xffffffffu, slot, winner);
        flag_won = __shfl_sync(0xffffffffu, flag, winner);
      }
    }
    if (won_slot >= 0) break;
    // Lane 0's clock decides for the whole warp (uniform exit).
    afd_i64 elapsed = (lane == 0) ? globaltimer_ns() - t0 : 0;
    elapsed = __shfl_sync(0xffffffffu, elapsed, 0);
    if (elapsed > timeout_ns) return -1;
  }
  // The header was written before the flag and the winning lane's load of the flag was an
  // acquire; the warp barrier hands that order to the lanes that read the header.
  __syncwarp();
  *won_flag = flag_won;
  return won_slot;
}

}  // namespace afd
