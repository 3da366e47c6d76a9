// flashgen fast Walsh-Hadamard transform (FWHT) in registers and warp shuffles.
//
// The Walsh-Hadamard matrix in natural (Sylvester) order: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]].
// y = H_B x (unnormalised; H_B is symmetric, so x H_B is the same) by log2(B) butterfly stages:
// for h = 1, 2, 4, ..., B/2, every pair (i, i + h) with (i & h) == 0 becomes (x_i + x_{i+h},
// x_i - x_{i+h}). Used for FA3's incoherent processing (arXiv 2407.08608, §3.3).
//
// Layout: a block of B consecutive values (B = 8 * 2^m, m = 0..5) is spread over 2^m lanes of
// one warp, 8 consecutive values per lane (value 8 * c + j is element j of chunk c); chunk c of
// the block sits on lane (l0 + c) where l0 is a multiple of 2^m. fwht8 does stages h = 1, 2, 4
// in a lane; fwht_lane_stage does h = 8 * m across lanes (partner lane ^ m).
#pragma once

namespace flashgen {

// Stages h = 1, 2, 4 of the FWHT on 8 values held by one thread (H_8 x).
__device__ __forceinline__ void fwht8(float (&x)[8]) {
#pragma unroll
  for (int h = 1; h < 8; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
}

// Stage h = 8 * m across lanes, for N values per lane: the lane holding chunk c pairs with lane
// ^ m (chunk c ^ m); `upper` = (c & m) != 0, i.e. this lane holds the second value of each
// pair and keeps the difference. Every lane of the warp must call it (full-mask shuffles).
template <int N>
__device__ __forceinline__ void fwht_lane_stage(float (&x)[N], int m, bool upper) {
  const float sign = upper ? -1.f : 1.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float other = __shfl_xor_sync(0xffffffffu, x[i], m);
    x[i] = fmaf(sign, x[i], other);  // lower: mine + other; upper: other - mine
  }
}

}  // namespace flashgen
