// flashgen device primitives for sm_90a.
//
// CCCL's cuda::ptx covers mbarriers, TMA (cp.async.bulk.tensor) and proxy fences; this header
// wraps those in the few shapes the kernels use, and adds one-line inline-PTX wrappers for what
// CCCL does not cover: wgmma fences/commit/wait, setmaxnreg, named barriers, and the WGMMA
// shared-memory matrix descriptor. The wgmma.mma_async instructions themselves are generated per
// variant by templates/macros/wgmma.j2 (their operand lists depend on N).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace flashgen {
namespace ptx = cuda::ptx;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint8_t* smem_ptr(uint32_t addr) {
  return static_cast<uint8_t*>(__cvta_shared_to_generic(addr));
}
// A 32-bit word at a shared-memory address (one register for the address where a generic pointer takes two).
__device__ __forceinline__ void st_shared_u32(uint32_t addr, int v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_shared_u32(uint32_t addr) {
  int v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// x, through a volatile asm that the compiler cannot see through or move: what a loop derives from
// it is computed in the loop, not hoisted out of it and held (or spilled) across every iteration.
// For the producer of the wide e4m3 tiles (24 registers per thread).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}
template <typename T>
__device__ __forceinline__ const T* opaque(const T* x) {
  asm volatile("" : "+l"(x));
  return x;
}
// true, in a form that neither NVVM nor ptxas folds (a grid has at least one CTA): a branch on it
// starts a basic block that survives into SASS (an empty asm, as in opaque(), leaves nothing in the
// PTX, and ptxas folds a constant). OnlineSoftmax::rescale_after.
__device__ __forceinline__ bool opaque_true() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
  return n != 0;
}

// ---------------------------------------------------------------- mbarrier (cuda::ptx)
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) { ptx::mbarrier_init(bar, count); }

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { (void)ptx::mbarrier_arrive(bar); }
// `count` arrivals at once (one thread standing for others whose accesses a barrier ordered before).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar, uint32_t count) {
  (void)ptx::mbarrier_arrive(ptx::sem_release, ptx::scope_cta, ptx::space_shared, bar, count);
}

// ---------------------------------------------------------------- clusters: distributed shared memory (cuda::ptx)
// The same object in the shared memory of the cluster's CTA `rank` (a generic address, which the
// shared::cluster operations below take).
template <typename T>
__device__ __forceinline__ T* peer_smem(T* p, uint32_t rank) {
  return static_cast<T*>(__cluster_map_shared_rank(p, rank));
}
// One arrival on a barrier of another CTA of the cluster (peer_smem), relaxed: it orders none of
// this thread's memory accesses (a release.cluster arrive costs a MEMBAR.ALL.GPU). For telling the
// peer that a buffer it will write is no longer read here: reads that a bar.sync has completed
// cannot see a later write.
__device__ __forceinline__ void mbar_arrive_peer(uint64_t* peer_bar) {
  ptx::mbarrier_arrive(ptx::sem_relaxed, ptx::scope_cluster, ptx::space_cluster, peer_bar, 1u);
}
// 1-D bulk copy of this CTA's shared memory into another CTA's (peer_smem addresses), counted as
// complete-tx bytes on the peer's barrier `peer_bar`; bytes a multiple of 16. One thread.
__device__ __forceinline__ void bulk_copy_to_peer(void* peer_dst, const void* src, uint32_t bytes, uint64_t* peer_bar) {
  ptx::cp_async_bulk(ptx::space_cluster, ptx::space_shared, peer_dst, src, bytes, peer_bar);
}
// Every thread of the cluster's CTAs meets here; relaxed arrival (a release one costs a
// MEMBAR.ALL.GPU per thread). What it orders: execution (a CTA does not exit while its peer may
// still copy from it), and mbarrier initialisation, which fence_mbarrier_init (release, cluster
// scope) before the arrival publishes, as CUTLASS's cluster start does.
__device__ __forceinline__ void cluster_sync() {
  ptx::barrier_cluster_arrive(ptx::sem_relaxed);
  ptx::barrier_cluster_wait();
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  (void)ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, bar, bytes);
}

// A TMA descriptor (a __grid_constant__ kernel parameter) fetched ahead of its first copy, as CUTLASS's
// prefetch_tma_descriptor does (CCCL's cuda::ptx has no prefetch.tensormap).
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" : : "l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---------------------------------------------------------------- TMA (cuda::ptx)
// 4-D tile load (coords innermost first: head_dim, seqlen, head, batch), completing on `bar`.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  const int32_t coords[4] = {c0, c1, c2, c3};
  ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, dst, map, coords, bar);
}

// 5-D tile load (PackGQA's Q: head_dim, head in group, seqlen, K/V head, batch), completing on `bar`.
__device__ __forceinline__ void tma_load_5d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3, int c4,
                                            uint64_t* bar) {
  const int32_t coords[5] = {c0, c1, c2, c3, c4};
  ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, dst, map, coords, bar);
}

__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  const int32_t coords[4] = {c0, c1, c2, c3};
  ptx::cp_async_bulk_tensor(ptx::space_global, ptx::space_shared, map, coords, src);
}

// Generic-proxy smem writes must be fenced before the async proxy (TMA store, wgmma) reads them.
__device__ __forceinline__ void fence_proxy_async_smem() { ptx::fence_proxy_async(ptx::space_shared); }

// ---------------------------------------------------------------- own wrappers (no CCCL equivalent)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Tag: only the PTX comment differs, so that two otherwise identical waits in the two arms of a
// branch are not merged into one before the branch (OnlineSoftmax::rescale_after).
template <int N, int Tag = 0>
__device__ __forceinline__ void wgmma_wait() {
  if constexpr (Tag == 0) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
  } else {
    asm volatile("wgmma.wait_group.sync.aligned %0; // %1\n" ::"n"(N), "n"(Tag) : "memory");
  }
}

template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

// Named barriers: id 0 is __syncthreads; count is a multiple of 32 threads.
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// The AND of `pred` over the `count` threads that reach named barrier `id` (bar.red.and.pred: a
// barrier, so those threads also synchronize). The result is the same in every one of them, so a
// branch on it is uniform over them (a .aligned instruction such as wgmma may sit inside).
__device__ __forceinline__ bool named_bar_all(bool pred, int id, int count) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred q, a;\n setp.ne.u32 q, %1, 0;\n bar.red.and.pred a, %2, %3, q;\n selp.u32 %0, 1, 0, a;\n}\n"
      : "=r"(r) : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(count) : "memory");
  return r != 0u;
}

// Pin registers at this point of the program: the compiler may not move reads of an async
// wgmma's accumulator above the wgmma.wait that completes it (CuTe's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// WGMMA shared-memory matrix descriptor of a swizzled tile (PTX ISA "Matrix Descriptor Format"):
// bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
// 62-63 swizzle mode (1 = 128B, 2 = 64B). Tiles are 1024-byte aligned, so the base offset is 0.
//  K-major (Q, K): rows of 128 (64) bytes, 8-row atoms, SBO = 1024 (512); LBO unused (16).
//  MN-major (V with trans-b, 128B only): LBO = bytes between 64-element MN chunks, SBO = 1024 (8 K-rows).
// The address field is (smem_addr + offset) >> 4, smem_addr the shared::cta offset (< 2^18). In a
// cluster launch the shared addresses that cvta gives carry the CTA's rank from bit 24 on (ptxas:
// ULEA of SR_CgaCtaId << 24), which unmasked lands in LBO: the rank-1 CTAs of the backward's 2-CTA
// clusters read wrong MN-major operands that span several chunks (dV's dO, dK's Q), while K-major
// ones, which ignore LBO, read right (docs/PERF.md, ds_pairs). The source of a variant with a kernel
// launched in clusters defines FLASHGEN_CLUSTER_LAUNCH first (generator/render.py), and the rank bits
// are masked off; other kernels are left without the mask (it does not fold everywhere, and cost
// one forward tile its asynchronous WGMMAs: ptxas C7511). With offset (a multiple of 16) passed
// apart from the tile's address, the descriptors of one tile's k-steps share the masked base and differ by one
// add of an immediate (no per-k-step shift and mask: fewer issue slots in the GEMM-issuing warps).
__device__ __forceinline__ uint64_t make_smem_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                                   uint32_t offset, uint32_t mode) {
#ifdef FLASHGEN_CLUSTER_LAUNCH
  smem_addr &= 0x3FFFFu;
#endif
  const uint32_t lo = (smem_addr >> 4) + (offset >> 4) + (((lbo_bytes >> 4) & 0x3FFF) << 16);
  const uint32_t hi = ((sbo_bytes >> 4) & 0x3FFF) | (mode << 30);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// ---------------------------------------------------------------- math
// tanh(x) by the MUFU unit (PTX tanh.approx.f32, sm_75+; max relative error about 2^-11): softcap.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------- global reductions and flags
// Four adjacent fp32 additions to global memory in one vector reduction (PTX ISA 8.1+, sm_90):
// the backward's dQ accumulation. Relaxed, gpu scope; p 16-byte aligned.
__device__ __forceinline__ void red_add_v4_f32(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Spin until *flag >= target (acquire, gpu scope): the wait half of an ordered hand-off between CTAs.
__device__ __forceinline__ void wait_flag_at_least(const int* flag, int target) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  } while (v < target);
}

// old = *counter, *counter += 1, acquire and release (gpu scope): a ticket that publishes the writes this
// thread has observed (its CTA's, after a barrier: the release is cumulative) and, to the one that
// draws the last ticket, acquires the writes published by the earlier ones.
__device__ __forceinline__ int take_ticket(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// *flag += n with release semantics (gpu scope): the signal half; the caller fences its prior writes.
__device__ __forceinline__ void signal_flag(int* flag, int n = 1) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(flag), "r"(n) : "memory");
}

// 1-D bulk reduction shared -> global: dst[i] += src[i] over `bytes` of fp32 (a multiple of 16,
// both 16-byte aligned), committed as one bulk group. One thread; wait with
// cp_async_bulk_wait_group_read (source read) or cp_async_bulk_wait_group (additions done).
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, uint32_t bytes) {
  ptx::cp_reduce_async_bulk(ptx::space_global, ptx::space_shared, ptx::op_add, dst, src, bytes);
  ptx::cp_async_bulk_commit_group();
}

// 1-D bulk copy global -> shared (no tensor map) completing on `bar`; bytes a multiple of 16,
// both addresses 16-byte aligned. One thread.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, dst, src, bytes, bar);
}

// ---------------------------------------------------------------- 8-bit data (FP8 forward)
// Four fp32 values -> four e4m3 bytes in one register (byte 0 = a), round to nearest even,
// saturating to +-448 (PTX ISA cvt: for .f32 sources, the first operand goes to the upper byte).
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

// ldmatrix / stmatrix (sm_90) on 8x8 matrices of 16-bit elements: 4 matrices; lane 8m + j gives
// the shared address of row j of matrix m; thread t holds row t / 4, elements 2 (t % 4), +1 of
// each matrix in register m (stmatrix .trans: that fragment is written transposed).
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&x)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&x)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x[0]),
               "r"(x[1]), "r"(x[2]), "r"(x[3])
               : "memory");
}

// Two fp32 values -> one 32-bit register holding two 16-bit values (low half = first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace flashgen
