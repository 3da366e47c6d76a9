// Typed shared-memory tiles in the swizzled layouts that TMA writes and WGMMA reads (FA3,
// arXiv 2407.08608, §2.2 and Algorithm 1: the Q, K, V tiles of the circular buffer and the O
// staging tile).
//
// A Rows x Cols tile of T is stored as column chunks of RowBytes bytes (RowBytes / sizeof(T)
// columns), each chunk Rows rows of RowBytes bytes. RowBytes 128 (the 128-byte swizzle): inside a
// chunk, 16-byte unit u of row r sits at unit u ^ (r % 8) (8-row, 1024-byte atoms). RowBytes 64 (the
// 64-byte swizzle, for 8-bit rows of at most 64 elements: e4m3 head_dim 64 without padding to 128):
// unit u of row r at u ^ ((r / 2) % 4) (8-row, 512-byte atoms). RowBytes 32 (the 32-byte swizzle:
// the backward's dS^T at block_m 80, 16-column chunks, written by the consumers, read by WGMMA only):
// unit u of row r at u ^ ((r / 4) % 2) (8-row, 256-byte atoms). All are the address-bit swizzle
// "bits 4.. XOR bits 7..", which TMA's SWIZZLE_128B / SWIZZLE_64B / SWIZZLE_32B and the WGMMA
// descriptor's modes 1 / 2 / 3 share. TMA writes one chunk per box. A tile is a view: the shared-window
// address of its first byte (1024-byte aligned, so the descriptors' base offset is 0) plus
// compile-time geometry. It holds the 32-bit address rather than a pointer so that descriptor and
// stage arithmetic stays 32-bit; ptr() converts back where a generic pointer is needed (it folds away).
#pragma once

#include <cuda/std/type_traits>
#include <cuda_fp16.h>

#include "flashgen/ptx.cuh"

namespace flashgen {

// The first 1024-byte-aligned address of the dynamic shared memory (the SW128 tiles' alignment;
// each kernel's layout reserves 1024 bytes of slack for it).
__device__ __forceinline__ uint8_t* align_1024(uint8_t* smem_raw) {
  const uint32_t raw_addr = smem_u32(smem_raw);
  return smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
}

template <typename T, int Rows, int Cols, int RowBytes = 128>
struct SmemTileSW {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2, "16-bit (f16/bf16) or 8-bit (e4m3/e5m2) elements");
  static_assert(RowBytes == 128 || RowBytes == 64 || RowBytes == 32, "the 128-, 64- or 32-byte swizzle");
  static constexpr int kRows = Rows;
  static constexpr int kCols = Cols;
  static constexpr int kRowBytes = RowBytes;
  // The swizzle mode in WGMMA's descriptor (1 = 128B, 2 = 64B, 3 = 32B) and the bytes of an 8-row atom.
  static constexpr uint32_t kDescMode = RowBytes == 128 ? 1u : RowBytes == 64 ? 2u : 3u;
  static constexpr int kAtomBytes = 8 * RowBytes;
  static constexpr int kChunkCols = kRowBytes / static_cast<int>(sizeof(T));
  static constexpr int kChunks = Cols / kChunkCols;
  static constexpr int kChunkBytes = Rows * kRowBytes;
  static constexpr int kBytes = kChunks * kChunkBytes;
  // K of one WGMMA is 32 bytes: k16 for 16-bit types, k32 for 8-bit ones.
  static constexpr int kKStep = 32 / static_cast<int>(sizeof(T));
  static constexpr int kKStepsPerChunk = kChunkCols / kKStep;
  static_assert(Rows % 8 == 0 && Cols % kChunkCols == 0, "whole swizzle atoms: 8-row groups, 128-byte chunks");

  uint32_t addr;

  __device__ __forceinline__ uint8_t* ptr() const { return smem_ptr(addr); }

  // Tile s of a ring of such tiles laid out back to back from this one.
  __device__ __forceinline__ SmemTileSW stage(int s) const { return {addr + s * kBytes}; }

  // The C columns from column chunk `chunk` on, as a tile of their own (same rows, same layout).
  template <int C>
  __device__ __forceinline__ SmemTileSW<T, Rows, C, RowBytes> cols(int chunk) const {
    static_assert(C % kChunkCols == 0 && C <= Cols, "whole chunks of this tile");
    return {addr + chunk * kChunkBytes};
  }

  // Byte offset of element (row, col) from the tile's first byte.
  __device__ __forceinline__ static int offset(int row, int col) {
    const int byte = (col % kChunkCols) * static_cast<int>(sizeof(T));
    const int phase = (row * kRowBytes / 128) % (kRowBytes / 16);  // address bits 7.. of the row
    return (col / kChunkCols) * kChunkBytes + row * kRowBytes + (((byte / 16) ^ phase) << 4) + byte % 16;
  }

  // K-major operand (rows are M or N, columns are K; Q and K of S = Q K^T): k-step ks of the rows
  // from `row` (a multiple of 8) on. SBO = the 8-row atom; LBO is unused with these swizzles.
  __device__ __forceinline__ uint64_t desc_k_major(int ks, int row = 0) const {
    return make_smem_desc(addr, 16, kAtomBytes,
                          row * kRowBytes + (ks / kKStepsPerChunk) * kChunkBytes + (ks % kKStepsPerChunk) * 32,
                          kDescMode);
  }

  // MN-major operand (rows are K, columns are N; V as the transposed B of O += P V): k-step ks,
  // N from column `col` on (a multiple of 8). LBO = bytes between column chunks, SBO = the 8-K-row
  // atom. A `col` inside a chunk starts the operand mid-row: the swizzle is of address bits, as
  // for a K-major k-step inside a chunk, so an N that ends at or before the chunk's end reads right
  // (the backward's dQ halves at head_dim 192: columns 64-95 and 96-127).
  __device__ __forceinline__ uint64_t desc_mn_major(int ks, int col = 0) const {
    static_assert(sizeof(T) == 2 && RowBytes != 64, "WGMMA reads transposed (MN-major) operands only for 16-bit types");
    return make_smem_desc(addr, kChunkBytes, kAtomBytes,
                          ks * kKStep * kRowBytes + (col / kChunkCols) * kChunkBytes +
                              (col % kChunkCols) * static_cast<int>(sizeof(T)),
                          kDescMode);
  }

  // Rows [row, Rows) of every chunk set to 0 by threads t of n, 16 bytes a store. Under each swizzle a
  // row's RowBytes-byte line holds that row alone, so the rows are contiguous lines whatever the phase.
  // The caller orders the stores before the async proxy's reads (fence_proxy_async_smem, then a barrier of
  // the readers).
  __device__ __forceinline__ void zero_rows_from(int row, int t, int n) const {
    const int units = (Rows - row) * kRowBytes / 16;  // 16-byte units of one chunk's rows from `row` on
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch)
#pragma unroll 1
      for (int u = t; u < units; u += n)  // (a loop: once per tile, off the main loop's path)
        *reinterpret_cast<uint4*>(ptr() + ch * kChunkBytes + row * kRowBytes + u * 16) = make_uint4(0u, 0u, 0u, 0u);
  }

  // TMA: load rows [row, row + Rows) and columns [col0, col0 + Cols) of a 4-D (dim, seq, head, batch)
  // tensor map whose box is one chunk, completing on `bar`. One thread.
  __device__ __forceinline__ void tma_load(const CUtensorMap* map, int row, int head, int batch, uint64_t* bar,
                                           int col0 = 0) const {
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch)
      tma_load_4d(ptr() + ch * kChunkBytes, map, col0 + ch * kChunkCols, row, head, batch, bar);
  }

  // TMA: tile rows [tile_row, tile_row + box rows) from rows [row, ...) of a 4-D map whose box is one chunk
  // of fewer rows than the tile (a paged K / V: one box per page's part), completing on `bar`. One thread.
  __device__ __forceinline__ void tma_load_rows(const CUtensorMap* map, int tile_row, int row, int head, int batch,
                                                uint64_t* bar) const {
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch)
      tma_load_4d(ptr() + ch * kChunkBytes + tile_row * kRowBytes, map, ch * kChunkCols, row, head, batch, bar);
  }

  // TMA: the same from a 5-D (dim, c1, c2, c3, c4) map whose box is one chunk of up to Rows rows
  // (PackGQA's Q: c1 the head in the group, c2 the query position; the box's rows land in order).
  __device__ __forceinline__ void tma_load_5d(const CUtensorMap* map, int c1, int c2, int c3, int c4,
                                              uint64_t* bar) const {
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch)
      flashgen::tma_load_5d(ptr() + ch * kChunkBytes, map, ch * kChunkCols, c1, c2, c3, c4, bar);
  }

  // TMA: store tile rows [tile_row, tile_row + box rows) to rows [row, ...) and columns [col0, ...)
  // of a 4-D tensor map, one box per chunk (not committed). One thread.
  __device__ __forceinline__ void tma_store(const CUtensorMap* map, int tile_row, int row, int head, int batch,
                                            int col0 = 0) const {
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch)
      tma_store_4d(map, ptr() + ch * kChunkBytes + tile_row * kRowBytes, col0 + ch * kChunkCols, row, head, batch);
  }
};

template <typename T, int Rows, int Cols>
using SmemTileSW128 = SmemTileSW<T, Rows, Cols, 128>;

// A K-major 8 x k32-byte tile of ones of T (the B operand of an m64n8 WGMMA, any k-step: 16-bit
// k16 or 8-bit k32), without swizzle: two 8 x 16-byte core matrices, LBO = SBO = 128 bytes. Every
// byte pattern is 1.0, so L += P 1 gives each row's sum of P in all 8 columns (the forward's
// rowsum_mma). 256 bytes, 128-byte aligned; written once per CTA (fill, then a proxy fence and a
// barrier before WGMMA reads it), never changed.
template <typename T>
struct SmemOnes {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2, "16-bit (f16/bf16) or 8-bit (e4m3) elements");
  static constexpr int kBytes = 256;
  uint32_t addr;

  // 1.0's bit pattern, repeated over 32 bits: bf16 0x3F80, fp16 0x3C00, e4m3 0x38.
  static constexpr uint32_t kWord =
      sizeof(T) == 1 ? 0x38383838u : cuda::std::is_same_v<T, __half> ? 0x3C003C00u : 0x3F803F80u;
  // Threads t < kBytes / 4 each write one word; the caller fences (fence_proxy_async_smem) and syncs.
  __device__ __forceinline__ void fill(int t) const {
    if (t < kBytes / 4) reinterpret_cast<uint32_t*>(smem_ptr(addr))[t] = kWord;
  }
  __device__ __forceinline__ uint64_t desc() const { return make_smem_desc(addr, 128, 128, 0, 0u); }
};

}  // namespace flashgen
