// combine.cu: Attention-side wait for the expected FFN replies + weighted combine (DESIGN §6).
//
//   out[t] = out_scale * ( sum_k w[t,k] * routed_x[region dest(t,k)][pos[t,k]]
//                          + (has_shared ? shared_x[region t % F][t / F] : 0) )
// fp32 accumulation in a fixed k order (deterministic, no atomics). afd_wait_replies (one
// block) spins first; every combine block then re-checks the flags and headers (bounded by
// timeout_ns, immediate once the wait succeeded) before reading; on any error the block
// writes NaN rows and the first error is latched in the status block.
#include "wire.cuh"

using namespace afd;

constexpr int COMBINE_THREADS = 256;
constexpr int MAX_TOPK = 64;
constexpr int STATUS_POLL_EVERY = 256;  // spin iterations between looks at the status block

// Thread 0: wait until every expected reply arrived and its header is valid. Returns false on
// error (latched in status, possibly by another block).
__device__ bool wait_replies(afd_u64 window, afd_i32 num_ffn, afd_i64 flags_bytes,
                             afd_i64 slot_bytes, afd_i32 ring_depth, afd_i32 ring,
                             afd_i64 off_header, const afd_i64* expected,
                             const afd_i64* last_seen, afd_i64 timeout_ns, afd_i64* status) {
  if (status_code(status) != STATUS_OK) return false;
  const afd_i64* flags = static_cast<const afd_i64*>(byte_ptr(window, 0));
  const afd_i64 start = globaltimer_ns();
  for (int j = 0; j < num_ffn; ++j) {
    const afd_i64 want = expected[j];
    if (want == 0) continue;
    const int slot = j * ring_depth + ring;
    const afd_i64 seen = last_seen[slot];
    afd_i64 flag = load_volatile(flags + slot);
    for (int spin = 1; flag == seen; ++spin) {
      if (globaltimer_ns() - start > timeout_ns) {
        report_status(status, STATUS_TIMEOUT, j, slot, ring, want, flag, -1, -1);
        return false;
      }
      if (spin % STATUS_POLL_EVERY == 0 && status_code(status) != STATUS_OK) return false;
      flag = load_volatile(flags + slot);
    }
    __threadfence_system();  // acquire: header and rows were written before the flag
    const afd_i32* header = static_cast<const afd_i32*>(
        byte_ptr(window, flags_bytes + slot * slot_bytes + off_header));
    const afd_i64 magic = static_cast<afd_u32>(load_volatile32(header + HDR_MAGIC));
    const afd_i64 version = load_volatile32(header + HDR_VERSION);
    if (magic != MAGIC) {
      report_status(status, STATUS_BAD_HEADER, j, slot, ring, MAGIC, magic, HDR_MAGIC, -1);
      return false;
    }
    if (version != VERSION) {
      report_status(status, STATUS_BAD_HEADER, j, slot, ring, VERSION, version, HDR_VERSION, -1);
      return false;
    }
    if (load_volatile32(header + HDR_FLAGS) & FLAG_SHUTDOWN) {
      report_status(status, STATUS_SHUTDOWN, j, slot, ring, want, flag, -1, -1);
      return false;
    }
    const afd_i64 echo = static_cast<afd_u32>(load_volatile32(header + HDR_ECHO_SEQ));
    if (echo != (want & 0xffffffffll)) {
      report_status(status, STATUS_REPLY_MISMATCH, j, slot, ring, want & 0xffffffffll, echo, HDR_ECHO_SEQ, -1);
      return false;
    }
  }
  return status_code(status) == STATUS_OK;
}

// One block of 32 threads: only thread 0 spins until every expected reply arrived (bounded
// by timeout_ns) and validates the headers; errors are latched in the status block.
// NOTE: the spin lives in its own one-block kernel, launched right before afd_combine on the
// same stream: if every combine block spun, a combine of >= #SM blocks would hold every SM,
// and a peer's kernel that needs a whole SM (a large-shared-memory GEMM in another MPS
// client) could never be scheduled. afd_combine then re-checks without waiting.
extern "C" __global__ void __launch_bounds__(32)
afd_wait_replies(afd_u64 window, afd_i32 num_ffn, afd_i64 flags_bytes, afd_i64 slot_bytes,
                 afd_i32 ring_depth, afd_i32 ring, afd_i64 off_header,
                 const afd_i64* __restrict__ expected, const afd_i64* __restrict__ last_seen,
                 afd_i64 timeout_ns, afd_i64* status) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  wait_replies(window, num_ffn, flags_bytes, slot_bytes, ring_depth, ring, off_header, expected,
               last_seen, timeout_ns, status);
}

// grid = max(1, min(T, 1024)), block = 256; blocks stride over tokens, threads over hidden.
template <int DT>
__global__ void __launch_bounds__(COMBINE_THREADS)
afd_combine(afd_u64 out,  // payload [num_tokens, hidden_size]
            afd_i32 num_tokens, afd_i32 hidden_size,
            const afd_i32* __restrict__ topk_ids,    // [num_tokens * top_k]
            const float* __restrict__ topk_weights,  // [num_tokens * top_k]
            const afd_i32* __restrict__ pos,         // [num_tokens * top_k]
            afd_i32 top_k, afd_i32 epr, afd_i32 num_ffn, afd_i32 has_shared,
            afd_u64 window,  // this rank's own window
            afd_i64 flags_bytes, afd_i64 slot_bytes, afd_i32 ring_depth, afd_i32 ring,
            afd_i64 off_header, afd_i64 off_routed_x, afd_i64 off_shared_x, afd_i32 hdr_words,
            const afd_i64* __restrict__ expected,  // [num_ffn]
            afd_i64* last_seen,                    // [num_regions * ring_depth]
            afd_i64 timeout_ns, float out_scale, unsigned int* done_counter, afd_i64* status) {
  __shared__ bool s_ok;
  __shared__ float s_weight[MAX_TOPK];
  __shared__ const char* s_row[MAX_TOPK];
  __shared__ const char* s_shared_row;
  const int tid = threadIdx.x;
  const afd_i64 row_bytes = static_cast<afd_i64>(hidden_size) * itemsize<DT>();
  (void)hdr_words;

  if (tid == 0) {
    s_ok = wait_replies(window, num_ffn, flags_bytes, slot_bytes, ring_depth, ring, off_header,
                        expected, last_seen, timeout_ns, status);
  }
  __syncthreads();
  const bool ok = s_ok;
  char* out_base = static_cast<char*>(byte_ptr(out, 0));
  const char* win = static_cast<const char*>(byte_ptr(window, 0));
  const afd_u64 misalign = out | window | static_cast<afd_u64>(flags_bytes) |
                           static_cast<afd_u64>(slot_bytes) | static_cast<afd_u64>(off_routed_x) |
                           static_cast<afd_u64>(off_shared_x) | static_cast<afd_u64>(row_bytes);
  const bool use_vec = (misalign & 15) == 0;
  constexpr int VEC = vec_elems<DT>();

  for (afd_i64 t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    char* out_row = out_base + t * row_bytes;
    if (!ok) {
      for (afd_i64 h = tid; h < hidden_size; h += COMBINE_THREADS) store_elem<DT>(out_row, h, __int_as_float(0x7fc00000));
      continue;
    }
    if (tid < top_k) {
      const afd_i64 p = t * top_k + tid;
      const int dest = topk_ids[p] / epr;
      s_weight[tid] = topk_weights[p];
      s_row[tid] = win + flags_bytes + static_cast<afd_i64>(dest * ring_depth + ring) * slot_bytes +
                   off_routed_x + static_cast<afd_i64>(pos[p]) * row_bytes;
    }
    if (tid == 0 && has_shared) {
      const int dest = static_cast<int>(t % num_ffn);
      s_shared_row = win + flags_bytes + static_cast<afd_i64>(dest * ring_depth + ring) * slot_bytes +
                     off_shared_x + (t / num_ffn) * row_bytes;
    }
    __syncthreads();
    if (use_vec) {
      const afd_i64 num_vec = hidden_size / VEC;
      for (afd_i64 v = tid; v < num_vec; v += COMBINE_THREADS) {
        float acc[VEC], x[VEC];
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] = 0.0f;
        for (int k = 0; k < top_k; ++k) {
          unpack16<DT>(reinterpret_cast<const uint4*>(s_row[k])[v], x);
          const float w = s_weight[k];
#pragma unroll
          for (int u = 0; u < VEC; ++u) acc[u] = fmaf(w, x[u], acc[u]);
        }
        if (has_shared) {
          unpack16<DT>(reinterpret_cast<const uint4*>(s_shared_row)[v], x);
#pragma unroll
          for (int u = 0; u < VEC; ++u) acc[u] += x[u];
        }
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] *= out_scale;
        reinterpret_cast<uint4*>(out_row)[v] = pack16<DT>(acc);
      }
    } else {
      for (afd_i64 h = tid; h < hidden_size; h += COMBINE_THREADS) {
        float acc = 0.0f;
        for (int k = 0; k < top_k; ++k) acc = fmaf(s_weight[k], load_elem<DT>(s_row[k], h), acc);
        if (has_shared) acc += load_elem<DT>(s_shared_row, h);
        store_elem<DT>(out_row, h, acc * out_scale);
      }
    }
    __syncthreads();  // s_weight / s_row are rewritten for the next token
  }

  // GPU scope: the output rows and last_seen are read on this GPU only.
  if (!last_block_done(done_counter, /*system_scope=*/false)) return;
  if (status_code(status) == STATUS_OK) {
    const afd_i64* flags = static_cast<const afd_i64*>(byte_ptr(window, 0));
    for (int j = tid; j < num_ffn; j += COMBINE_THREADS) {
      if (expected[j] != 0) {
        const int slot = j * ring_depth + ring;
        last_seen[slot] = load_volatile(flags + slot);
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    *done_counter = 0u;
  }
}
