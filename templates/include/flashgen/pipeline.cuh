// The TMA -> mbarrier load pipeline between the producer warpgroup and the consumers, and the
// pingpong order of the consumer warpgroups (FA3, arXiv 2407.08608, Algorithm 1: producer/consumer
// warp specialization over an s-stage circular buffer; §3.1 pingpong scheduling).
#pragma once

#include "flashgen/ptx.cuh"

namespace flashgen {

// The n-th use of a ring of Stages buffers: its stage and the parity of the barrier phase it waits
// for (flips each time the ring wraps). Stages == 1 is a single buffer used once per work tile.
template <int Stages>
struct PipeState {
  int stage;
  uint32_t phase;
  __device__ __forceinline__ static PipeState at(int n) {
    return {n % Stages, static_cast<uint32_t>((n / Stages) & 1)};
  }
  // The same for an unsigned count: a mask and a shift, no signed-division fix-ups (fewer live
  // registers: the 24-register producer of e4m3 head_dim 256 x 128 spilled with the signed form).
  __device__ __forceinline__ static PipeState at(uint32_t n) {
    return {static_cast<int>(n % Stages), (n / Stages) & 1u};
  }
};

// A ring of Stages buffers, each with a full barrier (one producer arrive + the TMA bytes) and an
// empty barrier (one arrive per consumer warpgroup). Stages == 1 is the single buffer (Q).
template <int Stages>
struct LoadPipeline {
  uint64_t* full;   // [Stages]
  uint64_t* empty;  // [Stages]

  // One thread, before the CTA-wide barrier that publishes the init. producers: arrivals that
  // complete a full barrier (1: the thread arming the TMA bytes; FP8's V^T: the transposer threads).
  __device__ __forceinline__ void init(uint32_t consumers, uint32_t producers = 1) const {
#pragma unroll
    for (int s = 0; s < Stages; ++s) {
      mbar_init(&full[s], producers);
      mbar_init(&empty[s], consumers);
    }
  }

  // Producer: wait until the consumers have released the stage (on the first round the parity
  // is the one a fresh barrier counts as already complete, so the wait falls through).
  __device__ __forceinline__ void producer_acquire(PipeState<Stages> st) const {
    mbar_wait(&empty[st.stage], st.phase ^ 1);
  }

  // Producer: arm the stage's full barrier with the bytes its loads deliver; returns the barrier
  // the loads complete on.
  __device__ __forceinline__ uint64_t* producer_expect_tx(PipeState<Stages> st, uint32_t bytes) const {
    mbar_expect_tx(&full[st.stage], bytes);
    return &full[st.stage];
  }

  // Producer: acquire the stage and TMA-load `tile` (rows [row, ...) and columns [col0, ...) of the map)
  // into it.
  template <typename Tile>
  __device__ __forceinline__ void producer_load(PipeState<Stages> st, const Tile& tile, const CUtensorMap* map, int row,
                                                int head, int batch, int col0 = 0) const {
    producer_acquire(st);
    tile.tma_load(map, row, head, batch, producer_expect_tx(st, Tile::kBytes), col0);
  }

  __device__ __forceinline__ void consumer_wait(PipeState<Stages> st) const { mbar_wait(&full[st.stage], st.phase); }

  // A producer made of threads (not TMA): each of the `producers` threads arrives once its
  // writes to the stage are done (and fenced for the async proxy where WGMMA reads them).
  __device__ __forceinline__ void producer_commit(PipeState<Stages> st) const { mbar_arrive(&full[st.stage]); }

  // One arrive, after the caller's last read of the stage (how many arrive per stage is the empty
  // barrier's count: one thread per consumer warpgroup, or every reading thread).
  __device__ __forceinline__ void consumer_release(PipeState<Stages> st) const { mbar_arrive(&empty[st.stage]); }
  // `count` consumers' releases by one thread (their accesses ordered before it by a barrier).
  __device__ __forceinline__ void consumer_release(PipeState<Stages> st, uint32_t count) const {
    mbar_arrive(&empty[st.stage], count);
  }
};

// Pingpong: the consumer warpgroups take turns issuing their GEMMs, so one's softmax runs while
// another's GEMMs hold the tensor cores. Warpgroup wg's turn is named barrier FirstBar + wg; it
// waits for its turn, issues, then passes the turn on (256 threads = the waiter and the passer).
template <int Warpgroups, int FirstBar, bool Enabled>
struct PingpongTurns {
  int wg;

  // The last warpgroup gives the first one its first turn.
  __device__ __forceinline__ void start() const {
    if constexpr (Enabled) {
      if (wg == Warpgroups - 1) named_bar_arrive(FirstBar, 256);
    }
  }
  __device__ __forceinline__ void wait() const {
    if constexpr (Enabled) named_bar_sync(FirstBar + wg, 256);
  }
  __device__ __forceinline__ void pass() const {
    if constexpr (Enabled) named_bar_arrive(FirstBar + (wg + 1) % Warpgroups, 256);
  }
  // Absorb the last warpgroup's final pass, so no arrive is left pending at exit.
  __device__ __forceinline__ void finish() const {
    if constexpr (Enabled) {
      if (wg == 0) named_bar_sync(FirstBar, 256);
    }
  }
};

// PingpongTurns around register-only work (the softmax's exponentials): ptxas moves arithmetic
// across bar.sync and bar.arrive (the exponentials of one turn landed on both sides of both, and the
// row max below the wait, SASS of e4m3 hd128 128x192), so the ring alone orders nothing. Here the
// barrier ids carry data: wait(a, b) and pass(a, b) add (a | b) & zero's bits to the id (zero: a 0.f
// read from shared memory once, which ptxas cannot fold), so the barrier instruction waits for a and
// b (wait: the rows' maxima; pass: their sums, hence every exponential). wait() returns that 0.f read
// again after the barrier, a shared load ptxas keeps below it: what adds the value starts after the
// turn. The zero word is written before the kernel's first __syncthreads and never again.
template <int Warpgroups, int FirstBar, bool Enabled>
struct FencedTurns {
  PingpongTurns<Warpgroups, FirstBar, Enabled> ring;
  uint32_t zero_addr;  // shared-memory address of a 32-bit 0
  float zero;

  __device__ __forceinline__ FencedTurns(int wg, uint32_t zero_address) : ring{wg}, zero_addr(zero_address), zero(load()) {}
  __device__ __forceinline__ float load() const {
    float z = 0.f;
    if constexpr (Enabled) asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(z) : "r"(zero_addr) : "memory");
    return z;
  }
  __device__ __forceinline__ int dep(float a, float b) const {  // 0, after a and b
    return (__float_as_int(a) | __float_as_int(b)) & __float_as_int(zero);
  }
  __device__ __forceinline__ void start() const { ring.start(); }
  __device__ __forceinline__ void finish() const { ring.finish(); }
  __device__ __forceinline__ float wait(float a, float b) const {
    if constexpr (Enabled) named_bar_sync(FirstBar + ring.wg + dep(a, b), 256);
    return load();
  }
  __device__ __forceinline__ void pass(float a, float b) const {
    if constexpr (Enabled) named_bar_arrive(FirstBar + (ring.wg + 1) % Warpgroups + dep(a, b), 256);
  }
};

}  // namespace flashgen
