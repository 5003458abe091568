// Maps a flat block index to (m block, head, batch). A flat grid has no 65535 limit on heads or batch, and m blocks
// are handed out last-first: under a causal mask the last rows do the most work, so they start in the first wave.
#pragma once

namespace flash {

struct BlockCoord {
    int m_block, head, batch;
};

__device__ __forceinline__ BlockCoord decode_block(int num_m_blocks, int num_heads) {
    int const idx = blockIdx.x;
    int const m_rev = idx % num_m_blocks;
    int const bh = idx / num_m_blocks;
    return {num_m_blocks - 1 - m_rev, bh % num_heads, bh / num_heads};
}

}  // namespace flash
