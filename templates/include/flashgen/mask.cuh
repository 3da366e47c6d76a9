// Sequence-end and causal masking of the score block S of FA3's Algorithm 1 (arXiv 2407.08608),
// as in FlashAttention-2: K/V blocks fully past the diagonal are never loaded, only blocks that
// cross it or the sequence end are masked. Causal is bottom-right aligned: query row i sees keys
// up to i + seqlen_k - seqlen_q.
//
// Accumulator layout (m64nN fp32, one thread of a warpgroup): rows row0 and row0 + 8, where row0 is
// the warp's 16-row slice + lane / 4; columns 8j + 2(lane % 4) + e at register 4j + 2 * half + e.
#pragma once

namespace flashgen {

template <int BlockM, int BlockN, bool Causal>
struct BlockMask {
  int seqlen_q;
  int seqlen_k;

  // Tile m attends to K/V blocks [0, n_blocks(m)).
  __device__ __forceinline__ int n_blocks(int m) const {
    int n = (seqlen_k + BlockN - 1) / BlockN;
    if constexpr (Causal) {
      const int x = (m + 1) * BlockM + seqlen_k - seqlen_q;
      n = min(n, x <= 0 ? 0 : (x + BlockN - 1) / BlockN);
    }
    return n;
  }

  // Whether block n of tile m has a masked element: it crosses the sequence end or the diagonal.
  __device__ __forceinline__ bool needs_mask(int n, int m) const {
    const bool ragged = (n + 1) * BlockN > seqlen_k;
    if constexpr (Causal) return ragged || ((n + 1) * BlockN - 1 > m * BlockM + seqlen_k - seqlen_q);
    return ragged;
  }

  // S[i][j] = -inf where key j is past the sequence end or (causal) after query i's diagonal.
  // row0: this thread's first query row (global), n: the K/V block of S.
  __device__ __forceinline__ void apply(float (&s)[BlockN / 2], int n, int row0, int lane) const {
    const int col0 = n * BlockN + 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int limit = seqlen_k;
      if constexpr (Causal) limit = min(limit, row0 + 8 * h + 1 + seqlen_k - seqlen_q);
#pragma unroll
      for (int j = 0; j < BlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (col0 + 8 * j + e >= limit) s[4 * j + 2 * h + e] = -INFINITY;
        }
      }
    }
  }
};

// The backward's view (FA3's backward, one CTA per K/V block): the transposed score block S^T
// (rows are keys, columns queries) of key block n and query block m.
template <int BlockM, int BlockN, bool Causal>
struct BwdBlockMask {
  int seqlen_q;
  int seqlen_k;

  // Key block n is seen by query blocks [m_block_begin(n), num_m_blocks): under the causal mask
  // the first query row that sees key n * BlockN is n * BlockN - (seqlen_k - seqlen_q).
  __device__ __forceinline__ int m_block_begin(int n) const {
    if constexpr (Causal) {
      const int first_row = n * BlockN - (seqlen_k - seqlen_q);
      return first_row <= 0 ? 0 : first_row / BlockM;
    }
    return 0;
  }

  // The last of the num_n key blocks whose CTA visits query block m (the inverse of
  // m_block_begin: key block n visits m iff n <= last_n_block(m)).
  __device__ __forceinline__ int last_n_block(int m, int num_n) const {
    if constexpr (Causal) {
      const int x = (m + 1) * BlockM + seqlen_k - seqlen_q;  // key blocks starting below x
      return min(num_n - 1, (x + BlockN - 1) / BlockN - 1);
    }
    return num_n - 1;
  }

  // Whether block (n, m) has a masked element: it crosses the sequence end or the diagonal.
  __device__ __forceinline__ bool needs_mask(int n, int m) const {
    const bool ragged = (n + 1) * BlockN > seqlen_k;
    if constexpr (Causal) return ragged || ((n + 1) * BlockN - 1 > m * BlockM + seqlen_k - seqlen_q);
    return ragged;
  }

  // Whether query `query` sees key `key` (both global rows; queries past seqlen_q are handled by
  // their LSE, which the backward's preprocess sets to +inf).
  __device__ __forceinline__ bool visible(int key, int query) const {
    if constexpr (Causal) return key < seqlen_k && key <= query + seqlen_k - seqlen_q;
    return key < seqlen_k;
  }
};

}  // namespace flashgen
