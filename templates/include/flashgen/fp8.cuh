// FP8 forward pieces (FA3, arXiv 2407.08608, §3.3): the in-shared-memory transpose of V that the
// e4m3 P V GEMM needs (WGMMA reads 8-bit B operands K-major only, and V arrives by TMA with
// head_dim contiguous), the same transpose done in global memory by a preprocess kernel for the
// vt_global variants, and the descales that FA3's and block quantization's scale tensors give.
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

// vt_global's preprocess (fwd.cu.j2, kernel `vt`): V (batch, seqlen_k, heads_k, head_dim_v) e4m3
// at the given strides (bytes) -> V^T (batch, heads_k, head_dim_v, vt_seqlen) contiguous, rows in
// head_dim order, and within each 16 keys the columns in the order acc_to_a_frag_e4m3 (softmax.cuh)
// gives P's k positions: column 4q + t holds key 2q + (t >> 1) + 8 (t & 1), as the transposer's.
// Keys past seqlen_k are written as 0 (0 x NaN must not reach O).
// One CTA of 256 threads per tile of kKeys keys x kBytes head_dim bytes (16 KB; kBytes 128, or 64
// where head_dim_v <= 64) of one (batch, head_k) (blockIdx x: key tile, y: head_dim tile, z: batch x
// heads_k + head):
// 1. 16-byte loads of whole V rows (4 per thread; rows 16-byte aligned, as TMA needs; an 8-byte load
//    at the end of a head_dim_v that is a multiple of 8 only) into shared memory, word w of row r at word (w + 4 (r / 16)) % (kBytes
//    / 4) of its line, so that step 2's reads of one word of 16-key groups g = 0..7 hit 8 banks;
// 2. thread (w, g) (g fastest) reads word w of rows 16g..16g+15, byte-permutes them into head_dim
//    rows 4w..4w+3 of V^T (16 keys each) and stores them: a warp's 16-byte stores fill whole 128- (or
//    256-) byte runs of 4 (8) V^T rows.
// kTileBytes, kThreads: fwd.py VT_TILE and VT_THREADS (the CTA's tile of V and its threads).
template <int kBytes, int kTileBytes, int kThreads>
__device__ __forceinline__ void write_vt_tile(const uint8_t* v, int64_t stride_batch, int64_t stride_seq,
                                              int64_t stride_head, uint8_t* vt, int vt_seqlen, int seqlen_k,
                                              int heads_k, int head_dim_v, uint32_t* tile) {
  static_assert(kBytes == 128 || kBytes == 64, "128 or 64 head_dim bytes per tile");
  constexpr int kWords = kBytes / 4;
  constexpr int kKeys = kTileBytes / kBytes;  // 16 KB tiles: 128 or 256 keys
  constexpr int kGroups = kKeys / 16;
  static_assert(kWords * kGroups == kThreads, "one (word, 16-key group) item per thread");
  const int tid = threadIdx.x;
  const int key0 = blockIdx.x * kKeys;
  const int col0 = blockIdx.y * kBytes;
  const int b = blockIdx.z / heads_k;
  const int h = blockIdx.z % heads_k;
  const uint8_t* src = v + b * stride_batch + h * stride_head + col0;
  auto slot = [](int r, int w) { return r * kWords + (w + 4 * (r / 16)) % kWords; };
#pragma unroll
  for (int i = 0; i < kKeys * kBytes / 16 / kThreads; ++i) {
    const int c = i * kThreads + tid;  // 16-byte chunk: row c / (kBytes / 16), words 4 (c % (kBytes / 16)) on
    const int r = c / (kBytes / 16);
    const int w = 4 * (c % (kBytes / 16));
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (key0 + r < seqlen_k) {
      const uint8_t* at = src + (key0 + r) * stride_seq + 4 * w;
      if (col0 + 4 * w + 16 <= head_dim_v) {
        x = __ldg(reinterpret_cast<const uint4*>(at));
      } else if (col0 + 4 * w + 8 <= head_dim_v) {  // a head_dim_v that is a multiple of 8 only
        const uint2 y = __ldg(reinterpret_cast<const uint2*>(at));
        x.x = y.x;
        x.y = y.y;
      }
    }
    *reinterpret_cast<uint4*>(tile + slot(r, w)) = x;
  }
  __syncthreads();
  const int g = tid % kGroups;
  const int w = tid / kGroups;
  const int key = key0 + 16 * g;
  const int row = col0 + 4 * w;  // V^T rows row..row+3
  if (key >= vt_seqlen || row >= head_dim_v) return;
  uint32_t x[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = tile[slot(16 * g + i, w)];
  uint8_t* dst = vt + ((static_cast<int64_t>(b) * heads_k + h) * head_dim_v + row) * vt_seqlen + key;
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // V^T row: head_dim byte row + j
    const uint32_t sel = j | ((4 + j) << 4);
    uint32_t o[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)  // columns 4q..4q+3: keys 2q, 2q + 8, 2q + 1, 2q + 9
      o[q] = __byte_perm(__byte_perm(x[2 * q], x[2 * q + 8], sel), __byte_perm(x[2 * q + 1], x[2 * q + 9], sel), 0x5410);
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(j) * vt_seqlen) = make_uint4(o[0], o[1], o[2], o[3]);
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
