// Maps a flat block index to (m block, head, batch). A flat grid has no 65535 limit on heads or batch, and m blocks
// are handed out last-first: under a causal mask the last rows do the most work, so they start in the first wave.
#pragma once

namespace flash {

struct BlockCoord {
    int m_block, head, batch;
};

__device__ __forceinline__ BlockCoord decode_block(int idx, int num_m_blocks, int num_heads) {
    int const m_rev = idx % num_m_blocks;
    int const bh = idx / num_m_blocks;
    return {num_m_blocks - 1 - m_rev, bh % num_heads, bh / num_heads};
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
