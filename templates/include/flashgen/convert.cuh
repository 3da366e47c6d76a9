// flashgen element conversion and typed global memory access.
//
// Output stores from fp32 values to a float / bfloat16 / half array (one element or four
// adjacent ones), read-once loads of fp32 data and of 16-byte vectors, 16-bit pairs to fp32,
// and saturating fp32 -> e4m3 packing. Used by families that compute in fp32 and write a
// selectable output dtype (combine) or fp8 (quant).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "flashgen/ptx.cuh"  // pack2

namespace flashgen {

// ---------------------------------------------------------------- loads of read-once fp32 data
// Non-coherent (read-only for the kernel's lifetime) global loads that do not allocate in L1:
// every element of a streamed input is read exactly once, so caching it in L1 would only evict
// data that is reused (PTX ISA, ld: .nc and the L1::no_allocate eviction priority).
//
// Guarded form: returns *p when `take`, else 0. The load itself is unconditional, from p when
// `take` and from `fallback` otherwise (an address that is always valid, e.g. one the kernel
// reads anyway): p is never dereferenced when !take (it may be past the end, or hold NaN that
// must not leak). Why not a predicated or branched load: ptxas then interleaves each load with
// its consumers (measured on sm_90a SASS, CUDA 13.0), leaving one or two loads in flight per
// thread, while a straight run of unconditional loads is issued back to back. Not volatile:
// both addresses are valid and the data is read-only, so the compiler may schedule it freely.
__device__ __forceinline__ float4 ldg_stream_f4_or_zero(const float* p, const float* fallback, bool take) {
  float4 v;
  asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];\n"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "l"(take ? p : fallback));
  return take ? v : make_float4(0.f, 0.f, 0.f, 0.f);
}

__device__ __forceinline__ float ldg_stream_f1_or_zero(const float* p, const float* fallback, bool take) {
  float v;
  asm("ld.global.nc.L1::no_allocate.f32 %0, [%1];\n" : "=f"(v) : "l"(take ? p : fallback));
  return take ? v : 0.f;
}

// 16 bytes of any element type (e.g. 8 bf16 / fp16 values), read once; p 16-byte aligned. The
// caller picks a valid address for every thread (see above) so that runs of these loads stay
// unconditional.
__device__ __forceinline__ uint4 ldg_stream_u4(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// ---------------------------------------------------------------- 16-bit vectors
// Two T (half or bfloat16) packed in 32 bits (the lower address in the low half) -> fp32 (exact).
// bfloat16 is the upper half of an fp32, so its conversion is a shift / mask (written out, so the
// compiler can fuse it with what follows, e.g. a sign flip into one LOP3).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  } else {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
  }
}

// 8 T packed in 16 bytes -> x[0..7] in fp32, in address order.
template <typename T>
__device__ __forceinline__ void unpack8(uint4 v, float (&x)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack2<T>(w[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// Dot product in fp32 of two vectors of 8 T (half or bfloat16) packed in 16 bytes each.
template <typename T>
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = unpack2<T>(av[i]), y = unpack2<T>(bv[i]);
    s = fmaf(x.x, y.x, fmaf(x.y, y.y, s));
  }
  return s;
}

// ---------------------------------------------------------------- division by a fixed divisor
// a / d correctly rounded (IEEE div.rn, what torch's `/` gives), for many a and one d, with
// r = __frcp_rn(d) computed once: q = a r, then one Newton correction with the exact residual
// a - q d (one fma). Correct for normal a, d and quotients (Markstein's theorem; no special
// cases: not for infinities, NaN, denormals or overflow). 3 instructions instead of div.rn's ~10.
__device__ __forceinline__ float div_rn_by(float a, float d, float r) {
  const float q = a * r;
  return fmaf(fmaf(-q, d, a), r, q);
}

// ---------------------------------------------------------------- fp8 (e4m3)
// ---------------------------------------------------------------- typed output stores
// OutT is float, __nv_bfloat16 or __half; fp32 values are rounded to nearest even.
// store_out4 writes out[0..3]; `out` must be aligned to 4 elements (16 bytes for float,
// 8 bytes for the 16-bit types).
template <typename OutT>
__device__ __forceinline__ void store_out1(OutT* out, float v);
template <>
__device__ __forceinline__ void store_out1<float>(float* out, float v) { *out = v; }
template <>
__device__ __forceinline__ void store_out1<__nv_bfloat16>(__nv_bfloat16* out, float v) {
  *out = __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ void store_out1<__half>(__half* out, float v) { *out = __float2half_rn(v); }

// 16-bit types: two packed pairs (pack2, ptx.cuh) in one 8-byte store.
template <typename OutT>
__device__ __forceinline__ void store_out4(OutT* out, float4 v) {
  *reinterpret_cast<uint2*>(out) = make_uint2(pack2<OutT>(v.x, v.y), pack2<OutT>(v.z, v.w));
}
template <>
__device__ __forceinline__ void store_out4<float>(float* out, float4 v) {
  *reinterpret_cast<float4*>(out) = v;
}

}  // namespace flashgen
