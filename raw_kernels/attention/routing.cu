// routing.cu: the caller's routing into the ring's own buffers, the first kernel of every send
// of the cuda backend (docs/design/kernels.md): the dispatch and its combine then read int32 ids
// and fp32 weights at fixed addresses, and torch runs no conversion or copy per call.
#include "common/wire.cuh"
#include "common/payload.cuh"  // load_elem

using namespace afd;

// The routing a dispatch and its combine read, into the ring's own buffers (one launch instead
// of torch's conversions and copies per call: kernels.own_routing_spec). For i < num_partials:
//   ids_out[i] = ids[i] as int32 (ids int64 when ids_int64), -1 when `mask` and ids[i] lies
//                outside [0, num_experts) (an id an int32 cast would wrap, or a padding expert:
//                the plan then rejects it as STATUS_BAD_EXPERT);
//   weights_out[i] = weights[i] (dtype DT) as fp32.
// grid = max(1, ceil(num_partials / PLAN_THREADS)), block = PLAN_THREADS; a thread per partial.
// Numpy reference: afd_cupy.kernels.specs.dispatch.own_routing_reference.
template <int DT>
__global__ void __launch_bounds__(PLAN_THREADS)
afd_own_routing(afd_u64 ids,  // int32 or int64 [num_partials]
                afd_i32 ids_int64, afd_i32 mask, afd_i32 num_experts,
                afd_u64 weights,  // DT [num_partials]
                afd_i32 num_partials,
                afd_i32* __restrict__ ids_out,     // [num_partials]
                float* __restrict__ weights_out) {  // [num_partials]
  const afd_i64 stride = static_cast<afd_i64>(gridDim.x) * PLAN_THREADS;
  for (afd_i64 i = static_cast<afd_i64>(blockIdx.x) * PLAN_THREADS + threadIdx.x; i < num_partials;
       i += stride) {
    afd_i64 id = ids_int64 ? static_cast<const afd_i64*>(byte_ptr(ids, 0))[i]
                           : static_cast<afd_i64>(static_cast<const afd_i32*>(byte_ptr(ids, 0))[i]);
    if (mask && (id < 0 || id >= num_experts)) id = -1;
    ids_out[i] = static_cast<afd_i32>(id);
    weights_out[i] = load_elem<DT>(byte_ptr(weights, 0), i);
  }
}
