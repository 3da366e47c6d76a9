// Kernel parameter block shared by every forward variant. Mirrored field for field by the ctypes
// Structure `FwdParams` in runtime/launch.py: change both together (docs/CONTRACTS.md §2).
#pragma once

namespace flashgen {

struct FwdParams {
  float* lse;          // (batch, heads, seqlen_q) fp32, natural log; contiguous
  int seqlen_q;
  int seqlen_k;
  int heads;
  int heads_k;         // divides heads (GQA/MQA)
  int batch;
  int num_m_blocks;    // ceil(seqlen_q / block_m)
  int num_tiles;       // num_m_blocks * heads * batch
  float scale_log2;    // softmax_scale * log2(e); any sign
  float softmax_scale; // softmax_scale (natural units), for the LSE
};

}  // namespace flashgen
