// bench.cu: probes used only by the tools: tools/bench_poll.py (arrival-detection latency) and
// tools/device_trace.py (device timestamps at kernel boundaries).
#include "common/wire.cuh"

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

// One device-trace stamp (one thread): %globaltimer into ring[(row % capacity) * num_points +
// point] with row = *counter; advance != 0 closes the row (*counter = row + 1). The stamps of one
// row come from one stream, whose kernels run in order, so the plain read of the counter sees the
// previous stamp's write. Inside a CUDA graph the row still comes from device memory.
extern "C" __global__ void afd_trace_stamp(afd_i64* ring, afd_i64* counter, afd_i32 point,
                                           afd_i32 num_points, afd_i64 capacity, afd_i32 advance) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const afd_i64 row = *counter;
  ring[(row % capacity) * num_points + point] = globaltimer_ns();
  if (advance) *counter = row + 1;
}
