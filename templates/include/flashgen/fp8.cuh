// FP8 forward pieces (FA3, arXiv 2407.08608, §3.3): the in-shared-memory transpose of V that the
// e4m3 P V GEMM needs (WGMMA reads 8-bit B operands K-major only, and V arrives by TMA with
// head_dim contiguous), and the descales that FA3's and block quantization's scale tensors give.
#pragma once

#include "flashgen/ptx.cuh"

namespace flashgen {

// V (SrcTile: rows = keys, columns = head_dim bytes, as TMA wrote it) -> V^T (DstTile: rows =
// head_dim, columns = keys), the K-major B operand of O += P V. Within each 16 keys, V^T's
// columns come in the order acc_to_a_frag_e4m3 (softmax.cuh) gives P's k positions: b16 element i
// holds (key i, key i + 8). Unit u = 16 keys x 32 head_dim bytes: one ldmatrix.x4 reads keys
// 16g + {0..7} and 16g + {8..15} of two 16-byte column blocks; a byte permute pairs key i with key
// i + 8 (PRMT); one stmatrix.x4.trans writes the pairs transposed (FA3's LDSM / STSM transpose).
// The warps `warp` of `warps` (a warp each) split the units. The caller fences the generic-proxy
// writes (fence_proxy_async_smem) before WGMMA reads V^T.
template <typename SrcTile, typename DstTile>
__device__ __forceinline__ void transpose_v(const SrcTile& v, const DstTile& vt, int warp, int warps) {
  static_assert(SrcTile::kRows % 16 == 0 && SrcTile::kCols % 32 == 0, "16 keys x 32 bytes units");
  static_assert(DstTile::kRows == SrcTile::kCols && DstTile::kCols >= SrcTile::kRows, "V^T holds V");
  constexpr int kKeyGroups = SrcTile::kRows / 16;
  constexpr int kUnits = kKeyGroups * (SrcTile::kCols / 32);
  const int lane = threadIdx.x % 32;
  const int m = lane / 8;  // the matrix this lane addresses
  const int j = lane % 8;  // its row
  for (int u = warp; u < kUnits; u += warps) {
    const int g = u % kKeyGroups;
    const int d0 = 32 * (u / kKeyGroups) + 16 * (m >> 1);  // the matrix's 16-byte column block
    uint32_t x[4];
    ldmatrix_x4(v.addr + SrcTile::offset(16 * g + j + 8 * (m & 1), d0), x);
    // x0/x1: keys i, i + 8 (i = lane / 4) at bytes 4c..4c+3 of block 0; x2/x3 the same of block 1.
    const uint32_t w[4] = {__byte_perm(x[0], x[1], 0x5140), __byte_perm(x[0], x[1], 0x7362),
                           __byte_perm(x[2], x[3], 0x5140), __byte_perm(x[2], x[3], 0x7362)};
    // w[m]'s element (i, 2c + e) is head_dim byte d0 + 4c + 2 (m & 1) + e: its transposed row.
    stmatrix_x4_trans(vt.addr + DstTile::offset(d0 + 2 * (m & 1) + 4 * (j / 2) + j % 2, 16 * g), w);
  }
}

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
