// FP8 forward pieces (FA3, arXiv 2407.08608, §3.3): the in-shared-memory transpose of V that the
// e4m3 P V GEMM needs (WGMMA reads 8-bit B operands K-major only, and V arrives by TMA with
// head_dim contiguous), and the descales that FA3's and block quantization's scale tensors give.
#pragma once

#include "flashgen/ptx.cuh"

namespace flashgen {

// V (SrcTile: rows = keys, columns = head_dim bytes, as TMA wrote it) -> V^T (DstTile: rows =
// head_dim, columns = keys), the K-major B operand of O += P V. Within each 16 keys, V^T's
// columns come in the order acc_to_a_frag_e4m3 (softmax.cuh) gives P's k positions: b16 element i
// holds (key i, key i + 8). Unit (g, cb) = keys 16g..16g+15 x head_dim bytes 32cb..32cb+31: one
// ldmatrix.x4 reads keys 16g + {0..7} and 16g + {8..15} of two 16-byte column blocks; a byte
// permute pairs key i with key i + 8 (PRMT); one stmatrix.x4.trans writes the pairs transposed
// (FA3's LDSM / STSM transpose). V^T's rows are not in head_dim order: within each 16, rows 0-7 hold
// head_dim 0 1 4 5 8 9 12 13 and rows 8-15 hold 2 3 6 7 10 11 14 15 (the constructor's dst), the order in
// which one stmatrix's 8 rows are consecutive. So the P V GEMM's accumulator column 8j + 2c (+1) holds
// head_dim 16 (j / 2) + 2 (j % 2) + 4c (+1), and O is stored through that map (epilogue.cuh o_col).
// The swizzles XOR the 16-byte unit bits of an address (4-6 with 128-byte rows, 4-5 with V's 64-byte
// rows at head_dim 64) with a row constant that 16 rows do not change, and the tiles are 1024-byte
// aligned, so a lane's address for column block k of a source chunk is its address for block 0 XOR
// (k << 5), and for key block k of a V^T chunk its address for block 0 XOR (k << 4) (the lane's two addresses come from the tiles' offset()). kWarps warps (a warp
// each, `warp` = 0..kWarps-1) split the units:
// - kGroupLoop false: round robin over all units, every one unrolled: per unit one LOP3 per access
//   plus immediates, but ptxas keeps the XOR variants of both addresses live (12 at head_dim 256);
// - kGroupLoop true (a 24-register producer: e4m3 head_dim 256 at block_n 128, FA3's split): round
//   robin over the 16-key groups, a loop, each group's column blocks unrolled in the order that
//   finishes one source XOR before the next; about 20 live registers. The warps' shares differ by up
//   to one group (8 groups: 3 / 3 / 2).
// The caller fences the generic-proxy writes (fence_proxy_async_smem) before WGMMA reads V^T.
template <typename SrcTile, typename DstTile, int kWarps, bool kGroupLoop>
struct VTransposer {
  static_assert(SrcTile::kRows % 16 == 0 && SrcTile::kCols % 32 == 0, "16 keys x 32 bytes units");
  static_assert(SrcTile::kChunkCols == SrcTile::kRowBytes && DstTile::kChunkCols == 128, "8-bit elements, 128-byte V^T rows");
  static constexpr int kSrcBlocks = SrcTile::kRowBytes / 32;  // 32-byte column blocks per source row
  static_assert(DstTile::kRows == SrcTile::kCols && DstTile::kCols >= SrcTile::kRows, "V^T holds V");
  static constexpr int kKeyGroups = SrcTile::kRows / 16;
  static constexpr int kColBlocks = SrcTile::kCols / 32;
  static_assert(kColBlocks % kSrcBlocks == 0, "whole source chunks");
  static constexpr int kUnits = kKeyGroups * kColBlocks;

  uint32_t src;  // offset of this lane's ldmatrix row: key group 0, column block 0
  uint32_t dst;  // offset of this lane's stmatrix row: head_dim block 0, key block 0
  uint32_t warp;

  __device__ __forceinline__ explicit VTransposer(uint32_t warp_) : warp(warp_) {
    const int lane = threadIdx.x % 32;
    const int m = lane / 8;  // the matrix this lane addresses
    const int j = lane % 8;  // its row
    src = SrcTile::offset(j + 8 * (m & 1), 16 * (m >> 1));
    // w[m]'s element (i, 2c + e) is head_dim byte 32cb + 16 (m >> 1) + 4c + 2 (m & 1) + e. It goes to
    // V^T row 32cb + 16 (m >> 1) + 8 (m & 1) + 2c + e (the row order above): a matrix's 8 rows are
    // consecutive, so they have 8 different swizzle phases (in head_dim order rows r and r + 8 of a
    // matrix shared one: every store was 2-way bank-conflicted).
    dst = DstTile::offset(16 * (m >> 1) + 8 * (m & 1) + j, 0);
  }

  // V tile -> V^T tile (both 1024-byte aligned).
  __device__ __forceinline__ void operator()(const SrcTile& v, const DstTile& vt) const {
    if constexpr (kGroupLoop) {
      groups(v.addr + src, vt.addr + dst);
    } else {
      dispatch<0>(v.addr + src, vt.addr + dst);
    }
  }

 private:
  // Unit (g, cb), given the lane's addresses of key group g (source) and of column block 0 of key
  // group g (V^T).
  __device__ __forceinline__ static void unit(uint32_t v_g, uint32_t vt_g, int cb) {
    uint32_t x[4];
    ldmatrix_x4((v_g ^ ((cb % kSrcBlocks) << 5)) + (cb / kSrcBlocks) * SrcTile::kChunkBytes, x);
    // x0/x1: keys i, i + 8 (i = lane / 4) at bytes 4c..4c+3 of block 0; x2/x3 the same of block 1.
    const uint32_t w[4] = {__byte_perm(x[0], x[1], 0x5140), __byte_perm(x[0], x[1], 0x7362),
                           __byte_perm(x[2], x[3], 0x5140), __byte_perm(x[2], x[3], 0x7362)};
    stmatrix_x4_trans(vt_g + 32 * cb * DstTile::kRowBytes, w);
  }
  __device__ __forceinline__ static uint32_t vt_group(uint32_t vt, uint32_t g) {
    return (vt ^ ((g % 8) << 4)) + (g / 8) * DstTile::kChunkBytes;
  }

  template <int W>
  __device__ __forceinline__ void dispatch(uint32_t v, uint32_t vt) const {
    if constexpr (W + 1 < kWarps) {
      if (warp != W) return dispatch<W + 1>(v, vt);
    }
#pragma unroll
    for (int u = W; u < kUnits; u += kWarps) {
      const int g = u % kKeyGroups;  // 16-key group
      unit(v + 16 * g * SrcTile::kRowBytes, vt_group(vt, g), u / kKeyGroups);
    }
  }

  __device__ __forceinline__ void groups(uint32_t v, uint32_t vt) const {
    constexpr int kPerXor = kColBlocks / kSrcBlocks;
#pragma unroll 1
    for (uint32_t g = warp; g < kKeyGroups; g += kWarps) {
      const uint32_t v_g = v + 16 * g * SrcTile::kRowBytes;
      const uint32_t vt_g = vt_group(vt, g);
#pragma unroll
      for (int u = 0; u < kColBlocks; ++u) unit(v_g, vt_g, (u % kPerXor) * kSrcBlocks + u / kPerXor);
    }
  }
};

// One fp32 descale of a (batch, head, 64-row block) scale tensor given by strides (elements):
// FA3's (batch, heads_k) form has block stride 0 and head_div = heads / heads_k (query head h reads
// key head h / head_div); block quantization's (batch, heads, blocks) form has head_div 1. blk is
// clamped to the last block (rows past the sequence read it; their results are never stored).
struct Descale {
  const float* ptr;  // null: 1
  int stride_batch, stride_head, stride_block, head_div, blocks;

  __device__ __forceinline__ float at(int batch, int head, int blk) const {
    if (ptr == nullptr) return 1.f;
    return __ldg(ptr + static_cast<size_t>(batch) * stride_batch + (head / head_div) * stride_head +
                 min(blk, blocks - 1) * stride_block);
  }
};

}  // namespace flashgen
