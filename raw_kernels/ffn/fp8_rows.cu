// fp8_rows.cu: the FFN side's receive of an FP8 dispatch (docs/design/fp8.md): decodes the
// slot's FP8 wire rows (common/fp8.cuh) into payload rows the experts read. Reference:
// afd_cupy/wire/fp8.py dequantize_wire_rows, then the payload rounding (wire.dtypes.f32_to_raw).
#include "common/wire.cuh"
#include "common/payload.cuh"
#include "common/fp8.cuh"  // fp8_row_bytes, warp_dequantize_row

using namespace afd;

// grid = reply_grid(num_routed + num_shared), block = REPLY_THREADS; a warp per row: routed
// row r of slot `slot` of the own window into row r of routed_out, then shared row s into row
// s of shared_out. Reads the window only (the slot stays the sender's until the reply).
template <int DT>
__global__ void __launch_bounds__(REPLY_THREADS)
afd_fp8_dequant_rows(afd_u64 window,  // own window
                     SlotGeometry geo,
                     afd_i64 slot,  // slot number (region * ring_depth + ring)
                     afd_i32 hidden_size,  // a multiple of FP8_GROUP
                     afd_i32 num_routed,
                     afd_i32 num_shared,
                     afd_u64 routed_out,   // payload [num_routed, hidden_size], device (0 if none)
                     afd_u64 shared_out) {  // payload [num_shared, hidden_size], device (0 if none)
  const int tid = threadIdx.x, lane = tid & 31;
  const afd_i64 wire_row_bytes = fp8_row_bytes(hidden_size);
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  char* src_slot = geo.slot_at(window, slot);
  const afd_i64 num_rows = static_cast<afd_i64>(num_routed) + num_shared;
  const afd_i64 warp_stride = static_cast<afd_i64>(gridDim.x) * ROWS_PER_BLOCK;
  for (afd_i64 r = static_cast<afd_i64>(blockIdx.x) * ROWS_PER_BLOCK + (tid >> 5); r < num_rows;
       r += warp_stride) {
    const bool is_routed = r < num_routed;
    const afd_i64 row = is_routed ? r : r - num_routed;
    const char* src = is_routed ? geo.routed_row(src_slot, row, wire_row_bytes)
                                : geo.shared_row(src_slot, row, wire_row_bytes);
    char* dst = static_cast<char*>(byte_ptr(is_routed ? routed_out : shared_out, row * row_bytes));
    warp_dequantize_row<DT>(dst, src, hidden_size, lane);
  }
}
