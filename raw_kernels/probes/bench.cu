// bench.cu: probes used only by tools/bench_poll.py (arrival-detection latency).
#include "wire.cuh"

using namespace afd;

// Stamp %globaltimer into stamps[index], make it visible, then store the flag (one thread).
// The stamp is taken immediately before the system fence and the flag store, so it marks the
// moment the arrival becomes observable.
extern "C" __global__ void afd_bench_stamp(afd_u64 flag_addr, afd_i64 value, afd_i64* stamps,
                                           afd_i32 index) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  stamps[index] = globaltimer_ns();
  __threadfence_system();
  store_volatile(static_cast<afd_i64*>(byte_ptr(flag_addr, 0)), value);
}

// Publish %globaltimer into pinned host memory continuously for duration_ns, so the host can
// align its clock with the device clock (offset = host time - device time when read).
extern "C" __global__ void afd_bench_clock(afd_u64 pinned, afd_i64 duration_ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  afd_i64* out = static_cast<afd_i64*>(byte_ptr(pinned, 0));
  const afd_i64 start = globaltimer_ns();
  afd_i64 now = start;
  while (now - start < duration_ns) {
    now = globaltimer_ns();
    store_volatile(out, now);
    __threadfence_system();
  }
}
