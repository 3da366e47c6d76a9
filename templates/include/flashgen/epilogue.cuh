// Epilogue of FA3 (arXiv 2407.08608, Algorithm 1 lines 24-25: write O_i and L_i) for one consumer
// warpgroup's 64 rows: the normalised fp32 O accumulator -> its rows of a swizzled staging tile ->
// TMA store, and the log-sum-exp from registers.
#pragma once

#include "flashgen/ptx.cuh"

namespace flashgen {

// A varlen call's rows past its last sequence, which no tile covers (a packed tensor of `total` rows of
// `row_elems` contiguous 16-bit elements each, the rows [first_row, total)), set to 0 by thread t of n (a stride
// over whatever threads the caller gives it), 16 bytes a store: the varlen backward's dq, dk, dv (bwd.cu.j2's
// preprocess; the caller need not zero the whole tensors first). first_row past total (offsets broken): nothing.
__device__ __forceinline__ void zero_rows_past(void* base, int first_row, int total, int64_t row_elems, int64_t t,
                                               int64_t n) {
  const int64_t units = (total - first_row) * row_elems / 8;
  uint4* const dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + first_row * row_elems);
#pragma unroll 1
  for (int64_t i = t; i < units; i += n) dst[i] = make_uint4(0u, 0u, 0u, 0u);
}

// The column of O that accumulator columns 8j + 2c (c = lane % 4) and +1 hold, and +1. kFp8Order: O
// came from an e4m3 P V GEMM, whose V^T rows are in the transposer's order (fp8.cuh VTransposer).
template <bool kFp8Order>
__device__ __forceinline__ int o_col(int j, int c) {
  return kFp8Order ? 16 * (j / 2) + 2 * (j % 2) + 4 * c : 8 * j + 2 * c;
}

// A warpgroup's m64nN accumulator, as packed 16-bit pairs (pair i = registers 2i, 2i + 1; `pair(i)`
// returns it), -> rows [tile_row, tile_row + 64) of a swizzled tile, each pair at its column
// o_col<kFp8Order>: the generic-proxy stores only (the caller fences and synchronises before an
// async-proxy reader). `pairs` = N / 4.
template <bool kFp8Order = false, typename Tile, typename Pair>
__device__ __forceinline__ void stage_pairs(const Tile& tile, int tile_row, int pairs, Pair&& pair) {
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32;
  const int lane = tid % 32;
#pragma unroll
  for (int j = 0; j < pairs / 2; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = tile_row + warp * 16 + lane / 4 + 8 * h;
      *reinterpret_cast<uint32_t*>(tile.ptr() + Tile::offset(r, o_col<kFp8Order>(j, lane % 4))) = pair(2 * j + h);
    }
  }
}

// O (m64nN accumulator, R = N/2 registers, already normalised) -> rows [tile_row, tile_row + 64) of
// `tile` -> TMA store to rows [row, row + 64) of the map (its box: 64 rows x one chunk), issued and
// committed by the warpgroup's thread 0. bar_id: a named barrier of this warpgroup alone.
// OwnBuffer: the tile is the epilogue's own, reused tile after tile, so the previous store must have
// read it before it is overwritten. Otherwise it is an input's buffer (Q's): the caller has
// finished its GEMMs on it, and `release` (thread 0) hands it back once this store has read it.
// kFp8Order: O's accumulator columns are in the e4m3 transposer's order (o_col), put back in place here.
template <typename T, bool OwnBuffer, bool kFp8Order = false, int R, typename Tile, typename Release>
__device__ __forceinline__ void store_o(const float (&o)[R], const Tile& tile, int tile_row, int bar_id,
                                        const CUtensorMap* map, int row, int head, int batch, Release&& release,
                                        int col0 = 0) {
  static_assert(!kFp8Order || R % 8 == 0, "whole 16-column groups");
  const int tid = threadIdx.x % 128;
  if (OwnBuffer && tid == 0) ptx::cp_async_bulk_wait_group_read(ptx::n32_t<0>{});
  named_bar_sync(bar_id, 128);
  stage_pairs<kFp8Order>(tile, tile_row, R / 2, [&](int i) { return pack2<T>(o[2 * i], o[2 * i + 1]); });
  fence_proxy_async_smem();  // the generic-proxy stores above, before the TMA store reads them
  named_bar_sync(bar_id, 128);
  if (tid == 0) {
    tile.tma_store(map, tile_row, row, head, batch, col0);
    ptx::cp_async_bulk_commit_group();
    if constexpr (!OwnBuffer) {
      ptx::cp_async_bulk_wait_group_read(ptx::n32_t<0>{});
      release();
    }
  }
}

// (col0: the first column of the map the tile's column 0 goes to.)

// O (m64nN accumulator, R = N/2 registers, already normalised) -> global memory without staging:
// this thread's rows h = 0, 1 (accumulator rows row0 and row0 + 8) at row_ptr(h) (null: dropped),
// columns o_col(j, lane % 4) and +1 below `cols` (a multiple of 8), one 4-byte store each (T float: 8 bytes,
// split-KV's fp32 partials). The FP8
// forward stores O this way where its shared memory has no room for a 16-bit O tile beside the e4m3
// rings and V^T (fwd.py smem_layout: head_dim 256 with the transposer, say), and so does PackGQA (a
// tile's rows are of several heads).
template <typename T, bool kFp8Order = false, int R, typename RowPtr>
__device__ __forceinline__ void store_o_rows(const float (&o)[R], RowPtr&& row_ptr, int cols, int lane) {
  static_assert(!kFp8Order || R % 8 == 0, "whole 16-column groups");
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    T* dst = row_ptr(h);
    if (dst != nullptr) {
#pragma unroll
      for (int j = 0; j < R / 4; ++j) {
        const int col = o_col<kFp8Order>(j, lane % 4);
        if (col < cols) {
          if constexpr (sizeof(T) == 4) {  // fp32 (split-KV's partial O): two floats, 8-byte aligned
            *reinterpret_cast<float2*>(dst + col) = make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
          } else {
            *reinterpret_cast<uint32_t*>(dst + col) = pack2<T>(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
          }
        }
      }
    }
  }
}

// store_o_rows for rows of one (batch, head): `out` points at row 0, column 0; rows are stride_row
// elements apart (a multiple of 2); rows at or past `rows` are dropped.
template <typename T, bool kFp8Order = false, int R>
__device__ __forceinline__ void store_o_direct(const float (&o)[R], T* out, int64_t stride_row, int row0, int rows,
                                               int cols, int lane) {
  store_o_rows<T, kFp8Order>(
      o, [&](int h) -> T* { return row0 + 8 * h < rows ? out + (row0 + 8 * h) * stride_row : nullptr; }, cols, lane);
}

// Before the CTA exits: its TMA stores must have completed (one thread per warpgroup that stored).
__device__ __forceinline__ void store_o_drain() { ptx::cp_async_bulk_wait_group(ptx::n32_t<0>{}); }

// LSE of this thread's rows h = 0, 1 at lse_ptr(h) (null: dropped), written by one thread of each quad.
template <typename LsePtr>
__device__ __forceinline__ void write_lse_rows(const float (&lse)[2], LsePtr&& lse_ptr, int lane) {
  if (lane % 4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* dst = lse_ptr(h);
      if (dst != nullptr) *dst = lse[h];
    }
  }
}

// LSE of this thread's rows row0 and row0 + 8 (global rows of one (batch, head)); rows at or past
// seqlen_q are dropped.
__device__ __forceinline__ void write_lse(float* lse_rows, const float (&lse)[2], int row0, int seqlen_q, int lane) {
  write_lse_rows(lse, [&](int h) -> float* { return row0 + 8 * h < seqlen_q ? lse_rows + row0 + 8 * h : nullptr; },
                 lane);
}

}  // namespace flashgen
