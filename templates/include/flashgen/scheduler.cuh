// Persistent static tile scheduler: the loop over work tiles (query block, head, batch) around FA3's
// Algorithm 1 (arXiv 2407.08608; persistent kernels: §5). CTA x runs tiles x, x + gridDim.x, ...;
// with a grid of num_tiles CTAs the same code runs one tile per CTA (the non-persistent launch).
#pragma once

namespace flashgen {

struct WorkTile {
  int m_block;
  int head;
  int batch;
};

// Non-causal: m fastest, so CTAs running together share K/V in L2. Causal: longest rows first
// (m descending), so the long rows of the triangle start first.
template <bool Causal>
struct StaticTileScheduler {
  int num_m_blocks;
  int heads;
  int batch;
  int num_tiles;

  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ bool valid(int t) const { return t < num_tiles; }
  __device__ __forceinline__ int next(int t) const { return t + gridDim.x; }

  __device__ __forceinline__ WorkTile tile(int t) const {
    if constexpr (Causal) {
      const int hb = heads * batch;
      const int r = t % hb;
      return {num_m_blocks - 1 - t / hb, r % heads, r / heads};
    } else {
      const int r = t / num_m_blocks;
      return {t % num_m_blocks, r % heads, r / heads};
    }
  }
};

}  // namespace flashgen
