// Maps a flat block index to the tile a CTA owns. A flat grid has no 65535 limit on heads or batch.
#pragma once

namespace flash {

struct BlockCoord {
    int m_block, head, batch;
};

// Forward: (m block, head, batch). m blocks are handed out last-first: under a causal mask the last rows do the most
// work, so they start in the first wave.
__device__ __forceinline__ BlockCoord decode_block(int idx, int num_m_blocks, int num_heads) {
    int const m_rev = idx % num_m_blocks;
    int const bh = idx / num_m_blocks;
    return {num_m_blocks - 1 - m_rev, bh % num_heads, bh / num_heads};
}

struct BwdBlockCoord {
    int n_block, head_kv, batch;
};

// Backward: (key block, kv head, batch), key blocks fastest so that the CTAs of one head share Q, dO and dQ in L2.
// Under a causal mask the first key blocks see the most query tiles, so ascending order starts the longest first;
// `reverse` hands them out last-first instead (the deterministic dQ order needs launch order = accumulation order).
__device__ __forceinline__ BwdBlockCoord decode_bwd_block(int idx, int num_n_blocks, int num_heads_kv, bool reverse) {
    int const n = idx % num_n_blocks;
    int const bh = idx / num_n_blocks;
    return {reverse ? num_n_blocks - 1 - n : n, bh % num_heads_kv, bh / num_heads_kv};
}

// blockIdx.x and threadIdx.x read through volatile asm. The epilogue re-derives its coordinates from these after the
// mainloop: plain reads would be merged with the kernel's first ones, and everything derived from them would stay
// live across the loop (and spill when the loop needs all 255 registers).
__device__ __forceinline__ int block_index_reread() {
    int idx;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(idx));
    return idx;
}

__device__ __forceinline__ int thread_index_reread() {
    int idx;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(idx));
    return idx;
}

}  // namespace flash
