// Online softmax over the m64nN fp32 score accumulator (FA3, arXiv 2407.08608, Algorithm 1 lines
// 18-19 and 24, Algorithm 2: the running row max m and row sum l, O rescaled when m grows, P
// converted to the RS-WGMMA A operand in registers; at the end O / l and L = m + log l), in the
// exp2 domain: softmax_scale * log2(e) folds into one FFMA per element.
//
// Accumulator layout (one thread of a warpgroup): 2 rows (registers 4j + {0,1} and 4j + {2,3});
// the 4 threads of a quad share a row. Row maxima are quad-reduced at once; row sums stay
// thread-partial until finalize.
#pragma once

#include "flashgen/ptx.cuh"

namespace flashgen {

// A negative softmax scale is a negated Q: flip S (before masking) and use |scale|.
template <int R>
__device__ __forceinline__ void negate_if(float (&s)[R], bool neg) {
  if (neg) {
#pragma unroll
    for (int i = 0; i < R; ++i) s[i] = -s[i];
  }
}

// Softcap (FA3; Gemma 2's logit soft-capping): S <- tanh(S * softcap_scale), softcap_scale =
// softmax_scale / softcap, before masking; the softmax then runs with scale_log2 = softcap * log2(e),
// so the logits are softcap * tanh(softmax_scale * q.k / softcap).
template <int R>
__device__ __forceinline__ void apply_softcap(float (&s)[R], float softcap_scale) {
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = tanh_approx(s[i] * softcap_scale);
}

// Multiply each row of an m64nN accumulator (R = N/2 registers) by its factor.
template <int R>
__device__ __forceinline__ void rescale_rows(float (&acc)[R], const float (&f)[2]) {
#pragma unroll
  for (int j = 0; j < R / 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[4 * j + e] *= f[e / 2];
  }
}

// P (m64nN fp32 accumulator, R = N/2 registers) -> RS-WGMMA A fragments of a 16-bit T, k16 step kk
// in registers 4kk..4kk+3: the accumulator's register order is already the A fragment's, packed in pairs.
template <typename T, int R>
__device__ __forceinline__ void acc_to_a_frag(const float (&s)[R], uint32_t (&a)[R / 2]) {
#pragma unroll
  for (int i = 0; i < R / 2; ++i) a[i] = pack2<T>(s[2 * i], s[2 * i + 1]);
}

// Running softmax state of one thread's two rows of S (m64nN): fresh per work tile.
template <int N>
struct OnlineSoftmax {
  float row_max[2] = {-INFINITY, -INFINITY};  // raw scores (not scaled)
  float row_sum[2] = {0.f, 0.f};
  // After update: the factor the O accumulator must be multiplied by (exp2 of the max's change).
  // After finalize: 1 / row sum (0 for a row that attended to nothing), already applied to O.
  float scale[2];

  // S -> unnormalised P = exp2(S * scale_log2 - max * scale_log2), in place.
  __device__ __forceinline__ void update(float (&s)[N / 2], float scale_log2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[h];
#pragma unroll
      for (int j = 0; j < N / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float ms = (mx == -INFINITY) ? 0.f : mx * scale_log2;  // a fully masked row stays exp2(-inf) = 0
      scale[h] = (row_max[h] == -INFINITY) ? 0.f : exp2f(row_max[h] * scale_log2 - ms);
      row_max[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = exp2f(fmaf(s[4 * j + 2 * h + e], scale_log2, -ms));
          s[4 * j + 2 * h + e] = x;
          sum += x;
        }
      }
      row_sum[h] = row_sum[h] * scale[h] + sum;
    }
  }

  // End of the row: O /= row sum (reduced over the quad) and lse = natural-log sum-exp of the
  // scaled scores. sink_log2: a learnable sink's logit times log2(e) (-inf: none), one more term
  // exp(sink) of every row's denominator that adds nothing to O (gpt-oss; FA4's learnable_sink).
  // A row with nothing attended and no sink (or a NaN sum) gets O = 0 and lse = -inf; with a sink,
  // O = 0 and lse = sink.
  template <int R>
  __device__ __forceinline__ void finalize(float (&o)[R], float scale_log2, float (&lse)[2],
                                           float sink_log2 = -INFINITY) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = row_sum[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      float m = row_max[h] == -INFINITY ? -INFINITY : row_max[h] * scale_log2;
      float a = 1.f;  // O's and l's factor for the new maximum max(m, sink)
      if (sink_log2 != -INFINITY) {
        const float mx = fmaxf(m, sink_log2);
        a = exp2f(m - mx);  // 0 when m = -inf
        l = l * a + exp2f(sink_log2 - mx);
        m = mx;
      }
      const bool empty = !(l > 0.f);
      scale[h] = empty ? 0.f : a / l;
      lse[h] = empty ? -INFINITY : (m + __log2f(l)) * 0.6931471805599453f;
    }
    rescale_rows(o, scale);
  }
};

}  // namespace flashgen
