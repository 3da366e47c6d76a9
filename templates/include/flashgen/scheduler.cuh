// Persistent tile scheduler: the loop over work tiles (query block, head, batch) around FA3's
// Algorithm 1 (arXiv 2407.08608; persistent kernels: §5). CTA x runs tile x first. Static: then
// x + gridDim.x, ...; with a grid of num_tiles CTAs that is one tile per CTA (the non-persistent
// launch). Dynamic (FA3's causal scheduler): each further tile is claimed from a counter that is 0
// when the launch starts and that the launch leaves at 0 (next(); the host passes none when there
// are no more tiles than CTAs, and then the order is the static one), so a CTA that finished its
// tiles early takes the next one in the order below: causal tiles differ in length, and a fixed
// round-robin left some SMs with up to 1.4x the mean work (sections of L2 below) where claiming
// balances to within a tile.
#pragma once

#ifndef FLASHGEN_HD
#define FLASHGEN_HD __host__ __device__ __forceinline__
#endif

namespace flashgen {

// gridDim.x, read where it is used: a volatile read is not hoisted, so the persistent loop of a
// 24-register producer (e4m3 head_dim 256 at block_n 128) does not keep it live (ptxas spilled it).
__device__ __forceinline__ int grid_ctas() {
  unsigned n;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
  return static_cast<int>(n);
}

// x / d for 0 <= x < 2^31 without a division: (mul, shift) from the host (runtime/core.py fast_div: mul =
// ceil(2^(31 + l) / d), shift = l - 1, l = ceil(log2 d); mul 0 for d = 1). Granlund and Montgomery, "Division
// by invariant integers using multiplication" (PLDI 1994), with 31-bit dividends. Both come from the
// kernel's parameters, so a loop that divides at every step holds no divisor state in registers (the
// backward's 24-register producer: bwd.cu.j2 unit_cta).
__device__ __forceinline__ int fast_div(int x, unsigned mul, unsigned shift) {
  return mul == 0 ? x : static_cast<int>(__umulhi(static_cast<unsigned>(x), mul) >> shift);
}

// A tile of work: query block m_block of (batch, head). The forward's producer publishes each one
// decoded in shared memory (fwd.cu.j2's tile slots; m_block -1: the stop), so that the consumers do
// not repeat the divisions of tile() at every tile start (three runtime divisions, about 170
// instructions per consumer thread: 8 % of the consumers' stall samples at head_dim 64 causal 512, H100).
struct WorkTile {
  int m_block;
  int head;
  int batch;
};

// Non-causal: m fastest, so CTAs running together share K/V in L2.
// Causal: longest rows first (m descending) within L2 sections (FA3's LPT order): the (batch, head)
// pairs are cut into sections of `section_heads` consecutive pairs whose K/V fit in L2 together
// (the host sizes them: core.py L2_SECTION_BYTES, L2_SECTION_KV_HEADS); a section runs all its
// tiles, longest first with the pairs fastest, before the next section starts. With one section
// of all pairs (section_heads = heads * batch) this is the plain longest-first order, which at
// short seqlen_k re-read every head's K/V from HBM once per query block (the other pairs' tiles
// evicted it in between); so did sections of 32 MiB of short K/V (128 heads at seqlen 512).
// The last section, number `tail_section` (tile()'s argument), runs every pair from tail_section *
// section_heads on: the host makes it up to two sections long where their K/V still fit in L2
// (core.py tail_heads), so that the launch ends on the shortest tiles of more pairs. With sections
// of one size the last wave started long tiles of the last section while other CTAs ran out of
// work (scripts/schedule_model.py: max / mean work per CTA 1.080 -> 1.031 at head_dim 256 causal 512).
template <bool Causal, bool Dynamic = false>
struct TileScheduler {
  int num_m_blocks;
  int heads;
  int batch;
  int num_tiles;
  int section_heads;  // causal: (batch, head) pairs per L2 section, in [1, heads * batch]
  // Dynamic: the stream's tile counter (0 at launch; the launch's last claim leaves it at 0: next()),
  // or null: static (no more tiles than CTAs)
  int* counter;

  __device__ __forceinline__ int first() const { return blockIdx.x; }
  FLASHGEN_HD bool valid(int t) const { return t < num_tiles; }
  // The tile after t, for the one thread that runs the loop (the producer); a dynamic claim is a
  // global atomic (its latency is the caller's to hide). Every CTA's producer claims until a claim
  // lands past the last tile and then stops, so a launch makes num_tiles claims in all
  // (num_tiles - gridDim.x tiles, then gridDim.x stops), which return 0 .. num_tiles - 1 in the
  // word's order. The claim is an atomicInc that wraps at num_tiles - 1: the launch's last claim
  // leaves the counter at 0, as the launch found it, with no instruction of its own (a separate
  // reset in the producer's stop branch made 12 of the 255 causal variants spill or serialize
  // their WGMMAs), so the next launch on the stream starts from 0 (runtime/launch.py: the counter
  // belongs to the stream).
  __device__ __forceinline__ int next(int t) const {
    if constexpr (Dynamic) {
      // no counter: no more tiles than CTAs, so any tile after the first is past the last
      return counter != nullptr
                 ? grid_ctas() + static_cast<int>(atomicInc(reinterpret_cast<unsigned*>(counter),
                                                             static_cast<unsigned>(num_tiles - 1)))
                 : num_tiles;
    } else {
      return t + grid_ctas();
    }
  }

  // tail_section: an argument read from the kernel's parameters at the call, not a member: as a member
  // (made at the kernel's top) it made ptxas serialize the WGMMAs of 4 causal variants, and a first form
  // that compared t with the last section's first tile spilled 16-48 bytes in 18 (the 24-register producer)
  FLASHGEN_HD WorkTile tile(int t, int tail_section) const {
    if constexpr (Causal) {
      const int per_section = section_heads * num_m_blocks;
      const int sec = min(t / per_section, tail_section);
      const int r = t - sec * per_section;
      const int hb0 = sec * section_heads;
      const int rest = heads * batch - hb0;
      const int pairs = sec < tail_section ? section_heads : rest;  // the last section: the rest
      const int m_rev = r / pairs;
      const int hb = hb0 + (r - m_rev * pairs);
      return {num_m_blocks - 1 - m_rev, hb % heads, hb / heads};
    } else {
      const int r = t / num_m_blocks;
      return {t % num_m_blocks, r % heads, r / heads};
    }
  }
};

}  // namespace flashgen
