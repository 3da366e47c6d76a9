// MUFU.EX2 phase probe (issue 10): cycles per exponential of the FP8 softmax's exponential phase,
// alone and beside other warps, to tell apart the MUFU pipe's rate, the row sums' FADD chains and
// the e4m3 packing (docs/PERF.md: the e4m3 hd128 128x256 tile's phase measured ~15 cycles per
// MUFU.EX2 per warp against ptxas's static 8).
// Build: nvcc -arch=sm_90a -O3 -use_fast_math -o mufu_probe mufu_probe.cu ; run: ./mufu_probe
// Each CTA: `exp_warps` warps (one per SMSP first) run ITERS rounds of the phase over 128 scores per
// thread (the tile's 64 x 256 per warpgroup); `side_warps` more warps run a row-max-like loop
// (FMNMX + quad shuffles) meanwhile. One CTA per SM, 132 CTAs. Prints cycles per MUFU.EX2 per warp.
#include <cstdio>
#include <cstdint>
#include <cuda_fp8.h>

constexpr int kN = 128;    // scores per thread
constexpr int kIters = 512;

template <int Mode>  // 0: ex2 only; 1: + FADD row sums; 2: + e4m3 packing; 3: both (the kernel's phase)
__device__ __forceinline__ uint32_t phase(float (&s)[kN], float scale, float m, float& sum0, float& sum1) {
  uint32_t packed = 0;
#pragma unroll
  for (int j = 0; j < kN / 4; ++j) {
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float a = fmaf(s[4 * j + e], scale, -m);
      asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(x[e]) : "f"(a));
    }
    if (Mode & 1) {
      sum0 += x[0]; sum0 += x[1];
      sum1 += x[2]; sum1 += x[3];
    }
    if (Mode & 2) {
      uint16_t lo, hi;
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x[1]), "f"(x[0]));
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x[3]), "f"(x[2]));
      packed ^= (uint32_t(hi) << 16) | lo;
    } else if (!(Mode & 1)) {
      packed ^= __float_as_uint(x[0]) ^ __float_as_uint(x[1]) ^ __float_as_uint(x[2]) ^ __float_as_uint(x[3]);
    } else {
      packed ^= __float_as_uint(x[0]) & 1u;  // keep the exponentials live
    }
  }
  return packed;
}

template <int Mode>
__global__ void probe(const float* in, uint32_t* out, long long* cycles, int exp_warps, int side_warps) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= exp_warps + side_warps) return;
  float s[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) s[i] = in[(i * 37 + lane) % 1024];
  __syncthreads();
  uint32_t acc = 0;
  long long t0 = clock64();
  if (warp < exp_warps) {
    float m = 0.5f, sum0 = 0.f, sum1 = 0.f;
    for (int it = 0; it < kIters; ++it) {
      acc ^= phase<Mode>(s, 1.4426950f, m, sum0, sum1);
      m = m + __uint_as_float((acc & 1u) | 0x2a800000u) + sum0 * 1e-30f;  // next round depends on this one
    }
    acc ^= __float_as_uint(sum0 + sum1);
  } else {
    float m = 0.f;
    for (int it = 0; it < kIters * 4; ++it) {
      float a = -INFINITY, b = -INFINITY;
#pragma unroll
      for (int i = 0; i < kN; i += 2) { a = fmaxf(a, s[i] + m); b = fmaxf(b, s[i + 1] + m); }
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
      m += (a + b) * 1e-30f;
    }
    acc = __float_as_uint(m);
  }
  long long t1 = clock64();
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (lane == 0) cycles[blockIdx.x * 64 + warp] = t1 - t0;
}

template <int Mode>
void run(const char* name, const float* in, uint32_t* out, long long* cyc, int exp_warps, int side_warps) {
  const int threads = 32 * (exp_warps + side_warps);
  probe<Mode><<<132, threads>>>(in, out, cyc, exp_warps, side_warps);
  probe<Mode><<<132, threads>>>(in, out, cyc, exp_warps, side_warps);
  cudaDeviceSynchronize();
  static long long h[132 * 64];
  cudaMemcpy(h, cyc, sizeof(h), cudaMemcpyDeviceToHost);
  double e = 0, sd = 0;
  int ne = 0, ns = 0;
  for (int b = 0; b < 132; ++b)
    for (int w = 0; w < exp_warps + side_warps; ++w)
      if (w < exp_warps) { e += h[b * 64 + w]; ++ne; } else { sd += h[b * 64 + w]; ++ns; }
  printf("%-34s exp_warps %d side_warps %d: %6.2f cycles per MUFU.EX2 per warp%s", name, exp_warps, side_warps,
         e / ne / (double(kIters) * kN), ns ? "" : "\n");
  if (ns) printf("; side loop %.0f cycles per round\n", sd / ns / (kIters * 4));
}

int main() {
  float* in; uint32_t* out; long long* cyc;
  cudaMalloc(&in, 1024 * 4); cudaMalloc(&out, 132 * 2048 * 4); cudaMalloc(&cyc, 132 * 64 * 8);
  float h[1024];
  for (int i = 0; i < 1024; ++i) h[i] = -float((i * 7919) % 1000) / 250.f;
  cudaMemcpy(in, h, sizeof(h), cudaMemcpyHostToDevice);
  cudaMemset(cyc, 0, 132 * 64 * 8);
  for (int w : {4, 8}) {
    run<0>("ex2 only", in, out, cyc, w, 0);
    run<1>("ex2 + row-sum FADDs", in, out, cyc, w, 0);
    run<2>("ex2 + e4m3 packing", in, out, cyc, w, 0);
    run<3>("ex2 + sums + packing (the phase)", in, out, cyc, w, 0);
  }
  run<3>("the phase beside row-max warps", in, out, cyc, 4, 4);
  run<0>("ex2 only beside row-max warps", in, out, cyc, 4, 4);
  cudaError_t err = cudaGetLastError();
  printf("%s\n", cudaGetErrorString(err));
  return err != cudaSuccess;
}
