// Online softmax over the m64nN fp32 score accumulator (FA3, arXiv 2407.08608, Algorithm 1 lines
// 18-19 and 24, Algorithm 2: the running row max m and row sum l, O rescaled when m grows, P
// converted to the RS-WGMMA A operand in registers; at the end O / l and L = m + log l), in the
// exp2 domain: softmax_scale * log2(e) folds into one FFMA per element.
//
// Accumulator layout (one thread of a warpgroup): 2 rows (registers 4j + {0,1} and 4j + {2,3});
// the 4 threads of a quad share a row. Row maxima are quad-reduced at once; row sums stay
// thread-partial until finalize.
#pragma once

#include <type_traits>

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

// Multiply the columns of an m64nN accumulator (R = N/2 registers) group by group: Groups groups
// of N / Groups adjacent columns, group g by f[g] (FP8 with softcap: each 64-key block's descales,
// which must scale the scores before the tanh).
template <int Groups, int R>
__device__ __forceinline__ void scale_column_groups(float (&s)[R], const float (&f)[Groups]) {
  static_assert((R / 4) % Groups == 0, "groups of whole 8-column blocks");
  constexpr int kJ = R / 4 / Groups;  // 8-column blocks (4 registers each) per group
#pragma unroll
  for (int j = 0; j < R / 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * j + e] *= f[j / kJ];
  }
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

// FP8 P (m64nN fp32 accumulator, R = N/2 registers) -> RS-WGMMA A fragments of e4m3, k32 step kk in
// registers 4kk..4kk+3 (PTX ISA, wgmma register fragments for .e4m3: register 0 holds 4 bytes of
// row r at k = 4c..4c+3, register 1 the same of row r + 8, registers 2/3 the same at k + 16; c =
// lane % 4). The accumulator holds this thread's columns 8j + 2c, 8j + 2c + 1 instead, so the k
// order is permuted within each 16 keys: A position 4c + t holds key 2c + 8 (t & 1) + (t >> 1)
// (pairs (key i, key i + 8) side by side). transpose_v (fp8.cuh) writes V^T's columns in the same
// order, so the product is unchanged (FA3, arXiv 2407.08608 §3.3: the accumulator byte permute
// matched by the V transpose's row order). Values saturate to +-448.
// R % 16 == 8 (S's left half of an N = 224 block): the last k32 step's first k16 half alone (registers
// 4kk, 4kk + 1; the caller zeroes the rest).
template <int R>
__device__ __forceinline__ void acc_to_a_frag_e4m3(const float (&s)[R], uint32_t (&a)[R / 4]) {
  static_assert(R % 8 == 0, "whole k16 halves of k32 steps");
#pragma unroll
  for (int kk = 0; kk < (R + 8) / 16; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // register r: row r % 2 (0: r, 1: r + 8), k half r / 2
      if (16 * kk + 8 * (r / 2) >= R) continue;
      const float* x = s + 16 * kk + 8 * (r / 2) + 2 * (r % 2);
      a[4 * kk + r] = pack4_e4m3(x[0], x[4], x[1], x[5]);
    }
  }
}

// Running softmax state of one thread's two rows of S (m64nN): fresh per work tile.
// Offset (FP8, FA3's max offset): P = exp2(s - max + Offset) <= 2^Offset, so P uses e4m3's range
// (max 448) rather than [0, 1]; the row sum carries the same factor, so O / l and lse are unchanged.
// Groups: scale_log2 values per row, one per group of N / Groups adjacent columns (FP8 block
// quantization: each 64-key block of K has its own descale). Varying: the scales may differ from
// one update to the next (FP8 again). With one fixed scale the row maximum is kept in raw score
// units and scaled when used (one FMUL per row); otherwise it is kept scaled (log2 units), since
// raw scores of differently scaled columns are not comparable.
// Lazy (FA4's conditional rescaling): a row keeps its running max until a block's max exceeds it
// by more than Lazy (log2 units), so P <= 2^Lazy; O and l are rescaled only then, and finalize's
// O / l and lse are unchanged (both carry the same stale max). 0: the max follows every increase.
// 16-bit P only (P <= 2^8 is far inside bf16/fp16 range); FP8 keeps 0 (P's range is its Offset).
// TensorSum (the forward's rowsum_mma): O's row sums come from the tensor cores instead, l_mma (an
// m64n8 accumulator that the caller's P V GEMM adds P 1 into: gemm.cuh mma_rowsum), rescaled with O,
// and the exponentials have no FADD chains (one FADD per score fewer). O / l_mma is then a weighted
// mean of V's rows with P as the GEMM read it (rounded to P's type: e4m3 moves a sum by up to a few %).
// The lse wants the exact sum: with exact_sum (the caller asked for the lse) the fp32 row sums are
// also kept, in a pass of their own after the exponentials, and finalize's lse uses them; O is the
// same either way.
template <int N, int Offset = 0, int Groups = 1, bool Varying = false, int Lazy = 0, bool TensorSum = false>
struct OnlineSoftmax {
  static_assert(Lazy == 0 || Offset == 0, "lazy rescaling widens P's range: 16-bit P only");
  static constexpr bool kRawMax = Groups == 1 && !Varying;
  static_assert((N / 8) % Groups == 0, "groups of whole 8-column blocks");
  static constexpr int kJ = N / 8 / Groups;  // 8-column blocks per group
  float row_max[2] = {-INFINITY, -INFINITY};  // kRawMax: raw scores; else scaled scores (log2 units)
  float row_sum[2] = {0.f, 0.f};  // thread-partial (TensorSum: kept only with exact_sum, for the lse)
  float l_mma[4] = {0.f, 0.f, 0.f, 0.f};  // TensorSum: rows r (registers 0, 1) and r + 8 (2, 3), quad-complete
  bool exact_sum = true;                  // TensorSum: row_sum kept too (for the lse); uniform
  // After update: the factor the O accumulator must be multiplied by (exp2 of the max's change;
  // exactly 1 when the max did not change, or when nothing was attended before: O is still 0).
  // After finalize: o_factor / row sum (0 for a row that attended to nothing), already applied to O.
  float scale[2];

  // Row h of S -> exp2(S * scale_log2 - ms), in place; returns the row's (thread-partial) sum, added in
  // Chains interleaved FADD chains. S (here and below): the block's m64nN accumulator (M = N / 2
  // registers), or its first M registers alone: the block's first 2M columns (the rest masked).
  template <int Chains, int M>
  __device__ __forceinline__ static float exp_row(float (&s)[M], int h, const float (&scale_log2)[Groups],
                                                  float ms) {
    static_assert(M % 4 == 0 && M <= N / 2, "whole 8-column blocks of S");
    float acc[Chains] = {};
#pragma unroll
    for (int j = 0; j < M / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = exp2f(fmaf(s[4 * j + 2 * h + e], scale_log2[j / kJ], -ms));
        s[4 * j + 2 * h + e] = x;
        acc[j % Chains] += x;
      }
    }
    float sum = acc[0];
#pragma unroll
    for (int c = 1; c < Chains; ++c) sum += acc[c];
    return sum;
  }

  // TensorSum with exact_sum: row_sum = row_sum * scale + this thread's sum of P's row h (S holds P).
  template <int M>
  __device__ __forceinline__ void add_exact_sums(const float (&s)[M]) {
    if (!exact_sum) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float a = 0.f, b = 0.f;
#pragma unroll
      for (int j = 0; j < M / 4; ++j) {
        a += s[4 * j + 2 * h];
        b += s[4 * j + 2 * h + 1];
      }
      row_sum[h] = row_sum[h] * scale[h] + (a + b);
    }
  }

  // Row h's new max (quad-reduced) and O factor scale[h]; returns the exponent offset ms of its P.
  template <int M>
  __device__ __forceinline__ float max_step(const float (&s)[M], int h, const float (&scale_log2)[Groups]) {
    const float unit = kRawMax ? scale_log2[0] : 1.f;  // row_max * unit: log2 units
    float mx = row_max[h];  // quad-uniform, so it may join before the quad reduction
#pragma unroll
    for (int g = 0; g < Groups; ++g) {
      float m = kRawMax ? mx : -INFINITY;
#pragma unroll
      for (int j = g * kJ; j < (g + 1) * kJ && j < M / 4; ++j) m = fmaxf(m, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      mx = kRawMax ? m : fmaxf(mx, m * scale_log2[g]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Lazy: keep the running max while the new one exceeds it by at most Lazy (log2 units); a
    // row that attended to nothing yet takes the new one. (Lazy = 0: the max follows, and its
    // factor is exactly 1 when the max did not change.)
    bool keep = mx == row_max[h];
    if constexpr (Lazy != 0) {
      keep = row_max[h] != -INFINITY && (mx - row_max[h]) * unit <= static_cast<float>(Lazy);
      if (keep) mx = row_max[h];
    }
    const float ms = (mx == -INFINITY) ? 0.f : mx * unit - Offset;  // a fully masked row stays exp2(-inf) = 0
    scale[h] = (keep || row_max[h] == -INFINITY) ? 1.f : exp2f(row_max[h] * unit - Offset - ms);
    row_max[h] = mx;
    return ms;
  }

  // S -> unnormalised P = exp2(S * scale_log2 - max + Offset), in place; scale_log2 > 0.
  template <int M>
  __device__ __forceinline__ void update(float (&s)[M], const float (&scale_log2)[Groups]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float ms = max_step(s, h, scale_log2);
      if constexpr (TensorSum) {
        exp_row<1>(s, h, scale_log2, ms);  // (the sum unused: its FADDs are dead code)
      } else {
        row_sum[h] = row_sum[h] * scale[h] + exp_row<1>(s, h, scale_log2, ms);
      }
    }
    if constexpr (TensorSum) add_exact_sums(s);
  }

  // update with the exponentials in a turn of their own (`turn`: a FencedTurns, pipeline.cuh, whose
  // wait(max0, max1) waits for the maxima and returns a 0 that the exponent offsets add, and whose
  // pass(sum0, sum1) waits for the row sums): both rows' maxima, the turn, the exponentials, the pass.
  // The consumer warpgroups' exponential phases then alternate on the SM's MUFU pipes instead of
  // running together (docs/PERF.md: the FP8 loop's convoy; it paid only at 16-bit hd64 128x128).
  // Not with TensorSum: without the row sums the pass would wait on a few exponentials only, and ptxas
  // issued it before most of the others (fwd.py rowsum_mma; docs/PERF.md).
  template <int M, typename Turn>
  __device__ __forceinline__ void update(float (&s)[M], const float (&scale_log2)[Groups], const Turn& turn) {
    static_assert(!TensorSum, "exponential turns wait on the row sums in registers");
    float ms[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) ms[h] = max_step(s, h, scale_log2);
    const float zero = turn.wait(ms[0], ms[1]);
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] = row_sum[h] * scale[h] + exp_row<1>(s, h, scale_log2, ms[h] + zero);
    turn.pass(row_sum[0], row_sum[1]);
  }

  // Speculative update (16-bit P): FA3's online softmax with the row max taken after the exponentials
  // rather than before them. P = exp2(S * scale_log2 - m) with the running max m kept, so the
  // exponentials start as soon as S is read, and the max reduction (one FMNMX per score at 2 cycles
  // per warp instruction, then two quad shuffles; 13 % of the stall samples of the hd64 loop, H100
  // profile) leaves their path. It holds when no P exceeds what the P V GEMM and the fp32 sums take:
  // this thread's two row sums of the block at most 2^15 (each P is at most its row's sum, P >= 0;
  // fp16's largest is 65504), and the row attended something before (max not -inf). This thread's
  // verdict is returned, S then holds P and `sum` its rows' sums. The caller combines the verdicts
  // over the warpgroup, then commit_speculative(sum): the max did not move, O's factor is 1, and a
  // stale max is exact as in lazy rescaling; or, on any false, it recomputes S and runs update().
  // (e4m3 P, bounded by 448, was measured slower with the check a max over the exponents: 1-17 %.)
  // zero: 0.f (FencedTurns::wait's, with exp_turns: the exponentials start after the turn).
  __device__ __forceinline__ bool update_speculative(float (&s)[N / 2], const float (&scale_log2)[Groups],
                                                     float (&sum)[2], float zero = 0.f) const {
    static_assert(Offset == 0 && !TensorSum, "16-bit P, sums in registers");
    const float unit = kRawMax ? scale_log2[0] : 1.f;
    bool ok = true;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] = exp_row<2>(s, h, scale_log2, row_max[h] * unit + zero);
      ok = ok && row_max[h] != -INFINITY && sum[h] <= 32768.f;  // false for a NaN or infinite sum
    }
    return ok;
  }
  __device__ __forceinline__ void commit_speculative(const float (&sum)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_sum[h] += sum[h];
      scale[h] = 1.f;
    }
  }

  // O *= scale after an update, skipped when no row of the warp changed its max (every factor is
  // exactly 1, so skipping is exact): one vote instead of N_v / 2 FMULs on most blocks of a long row.
  template <int R>
  __device__ __forceinline__ void rescale(float (&o)[R]) {
    if (__any_sync(0xffffffffu, scale[0] != 1.f || scale[1] != 1.f)) {
      rescale_rows(o, scale);
      if constexpr (TensorSum) rescale_rows(l_mma, scale);
    }
  }

  // rescale, with O's pending GEMM completed in between: `wait(tag)` (wgmma_wait<0, tag> and
  // fence_regs(O)). ptxas hoists a wgmma.wait_group above the independent arithmetic of its basic
  // block: with the wait in the softmax's block (as FA3's Algorithm 2 writes it), the wait for
  // P V_{j-1} landed before the softmax of S_j in SASS, and the softmax no longer ran under that
  // GEMM. So the wait sits in both arms of a branch that every thread takes the same way
  // (opaque_true(), which neither compiler folds): blocks of their own, after the exponentials,
  // and a wait on every path (with one arm empty, ptxas serialized the GEMMs: C7514). The branch
  // must be uniform over the warpgroup: wgmma.wait_group is .aligned, and with the per-warp
  // rescale vote as its condition the warps of one warpgroup waited at two PCs (compute-sanitizer
  // synccheck, H100, e4m3 hd64 causal).
  template <int R, typename Wait>
  __device__ __forceinline__ void rescale_after(float (&o)[R], Wait&& wait) {
    const bool any = __any_sync(0xffffffffu, scale[0] != 1.f || scale[1] != 1.f);
    if (opaque_true()) {
      wait(std::integral_constant<int, 1>{});
    } else {
      wait(std::integral_constant<int, 2>{});
    }
    if (any) {
      rescale_rows(o, scale);
      if constexpr (TensorSum) rescale_rows(l_mma, scale);
    }
  }

  template <int M>
  __device__ __forceinline__ void update(float (&s)[M], float scale_log2) {
    static_assert(Groups == 1, "one scale for every column");
    const float one[1] = {scale_log2};
    update(s, one);
  }

  // End of the row: O *= o_factor / row sum (reduced over the quad; TensorSum: l_mma, the caller's P V GEMMs done) and lse = natural-log
  // sum-exp of the scaled scores. scale_log2: the updates' (kRawMax; unused otherwise).
  // sink_log2: a learnable sink's logit times log2(e) (-inf: none), one more term exp(sink) of
  // every row's denominator that adds nothing to O (gpt-oss; FA4's learnable_sink). o_factor:
  // FP8's V descale. A row with nothing attended and no sink (or a NaN sum) gets O = 0 and
  // lse = -inf; with a sink, O = 0 and lse = sink.
  // sink_rows_log2[h]: row h's sink (PackGQA: a thread's two rows may be of two query heads).
  template <int R>
  __device__ __forceinline__ void finalize(float (&o)[R], float scale_log2, float (&lse)[2],
                                           const float (&sink_rows_log2)[2], float o_factor = 1.f) {
    const float unit = kRawMax ? scale_log2 : 1.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sink_log2 = sink_rows_log2[h];
      float l = row_sum[h];  // the lse's sum (TensorSum without exact_sum: no lse is written)
      if (!TensorSum || exact_sum) {
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
      }
      float l_o = TensorSum ? l_mma[2 * h] : l;  // O's
      float m = row_max[h] == -INFINITY ? -INFINITY : row_max[h] * unit - Offset;  // P = exp2(s - m)
      float a = 1.f;  // O's and l's factor for the new maximum max(m, sink)
      if (sink_log2 != -INFINITY) {
        const float mx = fmaxf(m, sink_log2);
        a = exp2f(m - mx);  // 0 when m = -inf
        l = l * a + exp2f(sink_log2 - mx);
        l_o = l_o * a + exp2f(sink_log2 - mx);
        m = mx;
      }
      const bool empty = !(l_o > 0.f);
      scale[h] = empty ? 0.f : a / l_o * o_factor;
      lse[h] = empty || !(l > 0.f) ? -INFINITY : (m + __log2f(l)) * 0.6931471805599453f;
    }
    rescale_rows(o, scale);
  }
  template <int R>
  __device__ __forceinline__ void finalize(float (&o)[R], float scale_log2, float (&lse)[2],
                                           float sink_log2 = -INFINITY, float o_factor = 1.f) {
    const float sinks[2] = {sink_log2, sink_log2};
    finalize(o, scale_log2, lse, sinks, o_factor);
  }
};

}  // namespace flashgen
