// Masking of the score block S of FA3's Algorithm 1 (arXiv 2407.08608), as in FlashAttention-2/3:
// K/V blocks entirely outside a row block's mask are never loaded, only blocks that cross a mask
// edge or the sequence end are masked element by element.
//
// Masks (FA3's causal and local, bottom-right aligned; off = seqlen_k - seqlen_q): causal: query
// row i sees the keys j <= i + off; local (a band with runtime bounds, FA3's sliding window): the
// keys j with i + off - left <= j <= i + off + right, an unbounded side passed as seqlen_k (left)
// or seqlen_q (right), which reaches past every key. The runtime normalises FA3's window_size
// into these (flashgen.core.mask_spec). Unmasked variants mask only the sequence end (keys j <
// seqlen_k). Causal and local are separate kernels: the band's element test made the causal
// kernels 2-7 % slower (H200, head_dim 64 and 256), so causal keeps its one-limit test.
//
// Accumulator layout (m64nN fp32, one thread of a warpgroup): rows row0 and row0 + 8, where row0 is
// the warp's 16-row slice + lane / 4; columns 8j + 2(lane % 4) + e at register 4j + 2 * half + e.
#pragma once

namespace flashgen {

// floor(a / b) for b > 0 and any a.
__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((b - 1 - a) / b); }

struct IndexRange {
  int begin;
  int end;  // exclusive; end <= begin: empty
  __device__ __forceinline__ int count() const { return max(0, end - begin); }
};

// Split-KV (flash-decoding): split s takes the s-th share of `per` blocks of the key blocks [begin, end), per =
// ceil(count / splits) (the last shares short or empty; one split: per = count, s = 0, all of them).
__device__ __forceinline__ IndexRange split_blocks(IndexRange r, int s, int per) {
  const int begin = min(r.begin + s * per, r.end);
  return {begin, min(begin + per, r.end)};
}

// The band of keys each query row sees (see the top of this file).
struct Band {
  int seqlen_q;
  int seqlen_k;
  int left;
  int right;

  __device__ __forceinline__ int key_lo(int query) const { return query + seqlen_k - seqlen_q - left; }
  __device__ __forceinline__ int key_hi(int query) const { return query + seqlen_k - seqlen_q + right; }  // inclusive

  // Blocks [begin, end) of size B along one axis overlapping the band of the rows [r0, r1] of the
  // other block size: the key blocks of query rows [r0, r1], or (transposed) the query blocks of
  // key rows [r0, r1], whose band is the inverse one (lo = r0 - off - right, hi = r1 - off + left).
  template <int B>
  __device__ __forceinline__ IndexRange key_blocks(int q0, int q1, int num_blocks) const {
    return {max(0, floor_div(key_lo(q0), B)), min(num_blocks, floor_div(key_hi(q1), B) + 1)};
  }
  template <int B>
  __device__ __forceinline__ IndexRange query_blocks(int k0, int k1, int num_blocks) const {
    const int off = seqlen_k - seqlen_q;
    return {max(0, floor_div(k0 - off - right, B)), min(num_blocks, floor_div(k1 - off + left, B) + 1)};
  }

  // Whether the block of query rows [q0, q1] and keys [k0, k1] crosses an edge of the band.
  __device__ __forceinline__ bool crosses(int q0, int q1, int k0, int k1) const {
    return k1 > key_hi(q0) || k0 < key_lo(q1);
  }
};

// One sequence of a varlen call (FA3's SeqlenInfo): its first row in the token dim of Q / O and of
// K / V, and its lengths. Sequences packed along one dim (cu_seqlens: batch + 1 offsets) start at
// their offsets; a padded batch (no cu_seqlens) starts each sequence at row 0 of its batch entry.
// The length is seqused[b] when given (the rows used of the sequence), else the offsets' difference,
// else the call's uniform length.
struct SeqRange {
  int offset_q;
  int seqlen_q;
  int offset_k;
  int seqlen_k;
  int n_begin = 0;  // the forward's slot: the tile's K/V blocks [n_begin, n_end) (split-KV: its split's share)
  int n_end = 0;
};

__device__ __forceinline__ int seq_offset(const int* cu_seqlens, int b) { return cu_seqlens ? cu_seqlens[b] : 0; }
__device__ __forceinline__ int seq_length(const int* cu_seqlens, const int* seqused, int b, int uniform) {
  return seqused ? seqused[b] : cu_seqlens ? cu_seqlens[b + 1] - cu_seqlens[b] : uniform;
}
// leftpad_k (a KV cache's cache_leftpad): sequence b's keys start at row leftpad_k[b] of its entry, and its
// seqused_k counts them from row 0 (FA3's).
template <typename Params>
__device__ __forceinline__ SeqRange seq_range(const Params& p, int b) {
  const int pad = p.leftpad_k ? p.leftpad_k[b] : 0;
  return {seq_offset(p.cu_seqlens_q, b), seq_length(p.cu_seqlens_q, p.seqused_q, b, p.seqlen_q),
          seq_offset(p.cu_seqlens_k, b) + pad, seq_length(p.cu_seqlens_k, p.seqused_k, b, p.seqlen_k) - pad};
}

#ifndef FLASHGEN_HD
#define FLASHGEN_HD __host__ __device__ __forceinline__
#endif

// A paged K / V block as TMA boxes (FA3's page_table: key j of a sequence is row j % page_size of page
// page_table[b, j / page_size]): the boxes of `box` rows (gcd(page_size, block_n), so box <= page_size and a box
// never crosses a page) from key key0 on, walked box by box without a division per box. entry / row: the
// current box's page entry (its index in the sequence's page list) and first row in that page; clamped(): the
// entry clamped to the last key's (last: seqlen_k - 1), which boxes past the keys read (rows masked or never
// used). The same (entry, row) as min(key, last) / page_size and key % page_size for key = key0 + i * box.
struct PageWalk {
  int entry;
  int row;
  int last_entry;
  int box;
  int page_size;
  FLASHGEN_HD PageWalk(int key0, int last, int box_rows, int page_rows)
      : entry(key0 / page_rows), row(key0 - key0 / page_rows * page_rows), last_entry(last / page_rows),
        box(box_rows), page_size(page_rows) {}
  FLASHGEN_HD int clamped() const { return entry < last_entry ? entry : last_entry; }
  FLASHGEN_HD void next() {
    row += box;
    if (row >= page_size) row -= page_size, ++entry;
  }
};

// The forward's view: S (rows queries, columns keys) of query block m and key block n.
// PackGqa (FA3's PackGQA): a tile holds the query heads of one K/V head, `group` of them; its row r
// is query position m * q_per_tile + r / group of head r % group of the group, q_per_tile =
// BlockM / group positions per tile (the last BlockM % group rows are padding, never stored).
// Otherwise row r of tile m is query m * BlockM + r.
template <int BlockM, int BlockN, bool Causal, bool Local, bool PackGqa = false>
struct BlockMask {
  Band band;  // left / right are read by Local only
  int group = 1;            // PackGqa only: query heads per K/V head
  int q_per_tile = BlockM;  // PackGqa only: BlockM / group

  // The query position of row r (0 <= r < BlockM) of tile m.
  __device__ __forceinline__ int query(int m, int r) const {
    return PackGqa ? m * q_per_tile + r / group : m * BlockM + r;
  }
  // apply()'s dq for a thread's first row r of tile m.
  __device__ __forceinline__ int second_row_step(int m, int r) const {
    return PackGqa ? query(m, r + 8) - query(m, r) : 8;
  }

  // Tile m attends to K/V blocks [begin, end).
  __device__ __forceinline__ IndexRange n_range(int m) const {
    return PackGqa ? n_range_of(m * q_per_tile, (m + 1) * q_per_tile) : n_range_of(m * BlockM, (m + 1) * BlockM);
  }

  // Whether block n of tile m has a masked element: it crosses the sequence end, the diagonal or
  // a band edge (rows past seqlen_q do not count: their output is never stored).
  __device__ __forceinline__ bool needs_mask(int n, int m) const {
    return PackGqa ? needs_mask_of(n, m * q_per_tile, (m + 1) * q_per_tile)
                   : needs_mask_of(n, m * BlockM, (m + 1) * BlockM);
  }

  // The same for the tile of queries [q0, q1). (Spelled with the bounds as arguments: with the
  // bounds from inline functions, ptxas allocated the unpacked hd64 local kernel differently and
  // it spilled 16-24 bytes.)
  __device__ __forceinline__ IndexRange n_range_of(int q0, int q1) const {
    const int num_n = (band.seqlen_k + BlockN - 1) / BlockN;
    if constexpr (Local) return band.key_blocks<BlockN>(q0, q1 - 1, num_n);
    if constexpr (Causal) {
      const int x = q1 + band.seqlen_k - band.seqlen_q;
      return {0, min(num_n, x <= 0 ? 0 : (x + BlockN - 1) / BlockN)};
    }
    return {0, num_n};
  }
  __device__ __forceinline__ bool needs_mask_of(int n, int q0, int q1) const {
    const bool ragged = (n + 1) * BlockN > band.seqlen_k;
    if constexpr (Local)
      return ragged || band.crosses(q0, min(q1, band.seqlen_q) - 1, n * BlockN, (n + 1) * BlockN - 1);
    if constexpr (Causal) return ragged || ((n + 1) * BlockN - 1 > q0 + band.seqlen_k - band.seqlen_q);
    return ragged;
  }

  // Whether a query up to q_last (a warpgroup's last row: its largest query) sees a key of the
  // right half of block n (from n * BlockN + BlockN / 2 on). If not, that warpgroup's S of block n
  // is the left half alone (the tile's first block under a causal diagonal or a ragged seqlen_k).
  __device__ __forceinline__ bool sees_right_half(int n, int q_last) const {
    return sees_key(n * BlockN + BlockN / 2, q_last);
  }
  // Whether a query row up to q_last sees key j (a right edge: the sequence end, the causal diagonal,
  // the window's right side; the rows up to q_last see no key at or past the first one q_last does not).
  __device__ __forceinline__ bool sees_key(int j, int q_last) const {
    int limit = band.seqlen_k;  // keys below limit are seen
    if constexpr (Local) limit = min(limit, band.key_hi(q_last) + 1);
    if constexpr (Causal) limit = min(limit, q_last + 1 + band.seqlen_k - band.seqlen_q);
    return j < limit;
  }

  // S[i][j] = -inf where key j is past the sequence end or not seen by query i.
  // S: the m64nBlockN accumulator of block n, or its first R registers (the first 2R columns);
  // n: the K/V block of S; q0: the query of this thread's first row (accumulator row r0), dq: the
  // query of its second (row r0 + 8) minus q0 (8 unpacked). (Local tests key - query against two
  // constants, so no per-row bound stays live across the main loop: with per-row bounds hoisted,
  // head_dim 256 spilled.)
  template <int R>
  __device__ __forceinline__ void apply(float (&s)[R], int n, int q0, int dq, int lane) const {
    static_assert(R % 4 == 0 && R <= BlockN / 2, "whole 8-column blocks of S");
    const int col0 = n * BlockN + 2 * (lane % 4);
    const int diag = col0 - q0;  // key - query of register 0
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int limit = band.seqlen_k;
      if constexpr (Causal) limit = min(limit, q0 + (h ? dq : 0) + 1 + band.seqlen_k - band.seqlen_q);
#pragma unroll
      for (int j = 0; j < R / 4; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          bool out = col0 + 8 * j + e >= limit;
          if constexpr (Local) {
            const int d = diag + 8 * j + e - (h ? dq : 0);  // key - query
            out = out || d > band.seqlen_k - band.seqlen_q + band.right || d < band.seqlen_k - band.seqlen_q - band.left;
          }
          if (out) s[4 * j + 2 * h + e] = -INFINITY;
        }
      }
    }
  }
};

// The backward's view (FA3's backward, one CTA per K/V block): the transposed score block S^T
// (rows are keys, columns queries) of key block n and query block m.
template <int BlockM, int BlockN, bool Causal, bool Local>
struct BwdBlockMask {
  Band band;  // left / right are read by Local only

  // Key block n (of num_m query blocks) is seen by query blocks [begin, end): under the causal
  // mask the first query row that sees key n * BlockN is n * BlockN - (seqlen_k - seqlen_q).
  __device__ __forceinline__ IndexRange m_range(int n, int num_m) const {
    if constexpr (Local) return band.query_blocks<BlockM>(n * BlockN, (n + 1) * BlockN - 1, num_m);
    if constexpr (Causal) {
      const int first_row = n * BlockN - (band.seqlen_k - band.seqlen_q);
      return {first_row <= 0 ? 0 : first_row / BlockM, num_m};
    }
    return {0, num_m};
  }

  // The key blocks (of num_n) whose CTAs visit query block m: the inverse of m_range (key block n
  // visits m iff n is in n_range(m), padded query rows included, as m_range counts them).
  __device__ __forceinline__ IndexRange n_range(int m, int num_n) const {
    if constexpr (Local) return band.key_blocks<BlockN>(m * BlockM, (m + 1) * BlockM - 1, num_n);
    if constexpr (Causal) {
      const int x = (m + 1) * BlockM + band.seqlen_k - band.seqlen_q;  // key blocks starting below x
      return {0, min(num_n, (x + BlockN - 1) / BlockN)};
    }
    return {0, num_n};
  }

  // Whether block (n, m) has a masked element: it crosses the sequence end, the diagonal or a band edge.
  __device__ __forceinline__ bool needs_mask(int n, int m) const {
    const bool ragged = (n + 1) * BlockN > band.seqlen_k;
    if constexpr (Local) return ragged || band.crosses(m * BlockM, (m + 1) * BlockM - 1, n * BlockN, (n + 1) * BlockN - 1);
    if constexpr (Causal) return ragged || ((n + 1) * BlockN - 1 > m * BlockM + band.seqlen_k - band.seqlen_q);
    return ragged;
  }

  // S^T[i][j] = -inf where query j does not see key i (key past the sequence end, or after the
  // query's diagonal / outside its band). key0: this thread's first key row (global), m: the query
  // block of S^T. Queries past seqlen_q are left alone: their LSE, which the backward's preprocess
  // sets to +inf, gives P = 0.
  __device__ __forceinline__ void apply(float (&s)[BlockM / 2], int m, int key0, int lane) const {
    const int col0 = m * BlockM + 2 * (lane % 4);  // query of register 0
    const int diag = key0 - col0;                  // key - query of register 0
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool past_end = key0 + 8 * h >= band.seqlen_k;
      int first = 0;  // causal: the first query that sees key key0 + 8h
      if constexpr (Causal) first = key0 + 8 * h - (band.seqlen_k - band.seqlen_q);
#pragma unroll
      for (int j = 0; j < BlockM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          bool out = past_end;
          if constexpr (Causal) out = out || col0 + 8 * j + e < first;
          if constexpr (Local) {
            const int d = diag + 8 * h - 8 * j - e;
            out = out || d > band.seqlen_k - band.seqlen_q + band.right || d < band.seqlen_k - band.seqlen_q - band.left;
          }
          if (out) s[4 * j + 2 * h + e] = -INFINITY;
        }
      }
    }
  }
};

}  // namespace flashgen
