// gate.cu: the greedy MoE gate in one kernel (afd_cupy/moe/gates.py select_experts, docs/design/kernels.md).
//
// What torch does in ~7 kernels (float cast, softmax or sigmoid, optional bias, top-k, gather,
// renormalize, int32 cast), per token in one warp: the scores in fp32, the selection (scores
// plus an optional per-expert bias), the top_k best by selection, their unbiased scores as
// weights, optionally divided by their sum. Rows ordered by decreasing selection; equal
// selections go to the lower expert id; a NaN selection ranks below every number (a row of
// NaN logits still yields top_k distinct ids in range, with NaN weights). The numpy twin is
// afd_cupy/moe/gates.py gate_topk_reference.
#include "common/wire.cuh"
#include "common/payload.cuh"

using namespace afd;

// GATE_THREADS, GATE_MAX_EXPERTS and GATE_MAX_TOP_K live in wire.cuh with the other limits.
constexpr int GATE_PER_LANE = GATE_MAX_EXPERTS / 32;

// scoring codes (afd_cupy/kernels/specs/gate.py GATE_SCORING)
constexpr int SCORE_SOFTMAX = 0;
constexpr int SCORE_SIGMOID = 1;

// (selection, expert) a beats b: larger selection, then lower expert id.
__device__ __forceinline__ bool gate_beats(float a_sel, int a_id, float b_sel, int b_id) {
  return a_sel > b_sel || (a_sel == b_sel && a_id < b_id);
}

// grid = gate_grid(num_tokens) (ceil(T / 8), at most MAX_BLOCKS, tokens grid-strided),
// block = GATE_THREADS. topk_weights float [T, K] and topk_ids int32 [T, K] are written whole.
template <int DT>
__global__ void __launch_bounds__(GATE_THREADS)
afd_gate_topk(afd_u64 logits,           // [num_tokens, num_experts] of DT, row-major
              afd_i32 num_tokens,
              afd_i32 num_experts,      // 1 .. GATE_MAX_EXPERTS
              afd_i32 top_k,            // 1 .. min(num_experts, GATE_MAX_TOP_K)
              afd_i32 scoring,          // SCORE_SOFTMAX or SCORE_SIGMOID
              afd_u64 bias,             // float [num_experts] added to the selection only; 0: none
              afd_i32 renormalize,      // 1: weights / sum(weights)
              afd_u64 topk_weights,     // float [num_tokens, top_k]
              afd_u64 topk_ids) {       // int32 [num_tokens, top_k]
  constexpr unsigned int ALL = 0xffffffffu;
  const float NEG_INF = __int_as_float(0xff800000);
  const int lane = threadIdx.x & 31;
  const int warps = GATE_THREADS / 32;
  const float* bias_f = bias ? static_cast<const float*>(byte_ptr(bias, 0)) : nullptr;
  const void* base = byte_ptr(logits, 0);
  float* weights_out = static_cast<float*>(byte_ptr(topk_weights, 0));
  afd_i32* ids_out = static_cast<afd_i32*>(byte_ptr(topk_ids, 0));

  for (afd_i64 t = static_cast<afd_i64>(blockIdx.x) * warps + (threadIdx.x >> 5); t < num_tokens;
       t += static_cast<afd_i64>(gridDim.x) * warps) {
    float score[GATE_PER_LANE];
    float sel[GATE_PER_LANE];
    const afd_i64 row = t * num_experts;

    float row_max = NEG_INF;
#pragma unroll
    for (int j = 0; j < GATE_PER_LANE; ++j) {
      if (j * 32 >= num_experts) break;  // warp-uniform: past the last expert
      const int e = j * 32 + lane;
      score[j] = e < num_experts ? load_elem<DT>(base, row + e) : NEG_INF;
      row_max = fmaxf(row_max, score[j]);
    }
    if (scoring == SCORE_SOFTMAX) {
      for (int d = 16; d > 0; d >>= 1) row_max = fmaxf(row_max, __shfl_xor_sync(ALL, row_max, d));
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < GATE_PER_LANE; ++j) {
        if (j * 32 >= num_experts) break;  // warp-uniform: past the last expert
        score[j] = j * 32 + lane < num_experts ? expf(score[j] - row_max) : 0.f;
        sum += score[j];
      }
      for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(ALL, sum, d);
#pragma unroll
      for (int j = 0; j < GATE_PER_LANE; ++j) {
        if (j * 32 >= num_experts) break;
        score[j] = score[j] / sum;
      }
    } else if (scoring == SCORE_SIGMOID) {
#pragma unroll
      for (int j = 0; j < GATE_PER_LANE; ++j) {
        if (j * 32 >= num_experts) break;
        score[j] = 1.f / (1.f + expf(-score[j]));
      }
    }
#pragma unroll
    for (int j = 0; j < GATE_PER_LANE; ++j) {
      if (j * 32 >= num_experts) break;  // warp-uniform: past the last expert
      const int e = j * 32 + lane;
      float s = e < num_experts ? score[j] + (bias_f ? bias_f[e] : 0.f) : NEG_INF;
      sel[j] = s != s ? NEG_INF : s;  // NaN ranks below every number
    }

    unsigned int taken = 0;  // bit j: expert j * 32 + lane already chosen
    float my_weight = 0.f, weight_sum = 0.f;
    int my_id = 0;
    for (int k = 0; k < top_k; ++k) {
      float best_sel = NEG_INF, best_score = 0.f;
      int best_id = 0x7fffffff;
#pragma unroll
      for (int j = 0; j < GATE_PER_LANE; ++j) {
        if (j * 32 >= num_experts) break;  // warp-uniform
        const int e = j * 32 + lane;
        if (e < num_experts && !((taken >> j) & 1u) && gate_beats(sel[j], e, best_sel, best_id)) {
          best_sel = sel[j];
          best_id = e;
          best_score = score[j];
        }
      }
      for (int d = 16; d > 0; d >>= 1) {
        const float o_sel = __shfl_xor_sync(ALL, best_sel, d);
        const int o_id = __shfl_xor_sync(ALL, best_id, d);
        const float o_score = __shfl_xor_sync(ALL, best_score, d);
        if (gate_beats(o_sel, o_id, best_sel, best_id)) {
          best_sel = o_sel;
          best_id = o_id;
          best_score = o_score;
        }
      }
      // every lane holds the winner now; its owner marks it taken
      if ((best_id & 31) == lane) taken |= 1u << (best_id >> 5);
      if (lane == k) {
        my_id = best_id;
        my_weight = best_score;
      }
      weight_sum += best_score;  // in k order, the same in every lane
    }
    if (lane < top_k) {
      ids_out[t * top_k + lane] = my_id;
      weights_out[t * top_k + lane] = renormalize ? my_weight / weight_sum : my_weight;
    }
  }
}
