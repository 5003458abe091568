// Maps a flat block index to the tile a CTA owns, for batched and varlen calls alike. Tiles are numbered batch-major,
// then head, then block (fastest), so the CTAs running together share one head's operands in L2. A flat grid has no
// 65535 limit on heads or batch.
#pragma once

#include <algorithm>
#include <cstdint>

#include "seqlen.h"

namespace flash {

struct TileCoord {
    int block, head, batch;
    bool valid;  // false for the grid's spare CTAs (varlen) and tiles past seqused
};

// Host: the grid's tiles per head. Batched it is exact. Varlen it is an upper bound that needs no device sync: the
// sequences' ceil(len / block) sum to at most (total + b * (block - 1)) / block.
inline int64_t tile_count(int rows, int b, int block, bool varlen) {
    return varlen ? (int64_t(rows) + int64_t(b) * (block - 1)) / block : int64_t(b) * ((rows + block - 1) / block);
}

// Host: decode_tile's section, the largest power of two of (batch, head) pairs at most `fit` (the launches size it
// by what the pairs share in L2, or by what one wave holds) and at most `pairs`.
inline int section_of(int64_t fit, int64_t pairs) {
    int section = 1;
    while (2 * int64_t(section) <= std::min(fit, pairs)) { section *= 2; }
    return section;
}

// Host: the section of a deterministic backward, whose dQ takes the key blocks of each (batch, kv head) pair one after
// another, in launch order. Pair after pair, a wave's CTAs of one pair wait on each other; in sections of as many
// pairs as one wave holds whole (one CTA per SM), block by block, they do not: on an H100 (2026-11-26) the SM90
// backward's deterministic mode went from 0.85x to 0.90x of the default without a mask (2k: d 64 1.20x, d 128 1.07x,
// d 256 1.14x faster), the SM80 tier's d 64 2k 1.07x. Where the causal order is reversed, sections lost (SM90, d 256
// causal 16k in sections of 16 pairs: 0.32x of the default, 0.73x pair by pair), so those, varlen calls and sequences
// whose blocks fill a wave keep the pair-major order (section 1).
inline int deterministic_section(BwdParams const& params, int block_n, int num_sms) {
    if (!params.deterministic || params.window_right >= 0 || params.cu_seqlens_q != nullptr) { return 1; }
    int64_t const blocks_per_pair = std::max<int64_t>((params.sk + block_n - 1) / block_n, 1);
    return section_of(num_sms / blocks_per_pair, int64_t(params.b) * params.hk);
}

// Tile idx of blocks of kBlock rows (queries in the forward, keys in the backward), `reverse` handing each
// sequence's blocks out last-first. Batched, the (batch, head) pairs are taken in sections of `section` pairs (the
// last one may be smaller), and a section's tiles go block by block, its pairs fastest: with `reverse` and causal
// tiles that is longest first across the section, while the section's K and V stay in L2. A section of 1 is the
// head-major order. Batched this is a few divisions. Varlen, each warp scans the sequences' tile counts 32 at a time
// with a warp prefix sum (no workspace, no extra launch); every warp reaches the same answer.
template <int kBlock>
__device__ __forceinline__ TileCoord decode_tile(int idx, int const* cu_seqlens, int const* seqused, int rows,
                                                 int batches, int heads, bool reverse, int section = 1) {
    if (cu_seqlens == nullptr) {
        int const num_blocks = (rows + kBlock - 1) / kBlock;
        int const first_bh = idx / (section * num_blocks) * section;
        int const pairs = min(section, batches * heads - first_bh);
        int const local = idx - first_bh * num_blocks;
        int const blk = local / pairs;
        int const bh = first_bh + local % pairs;
        TileCoord t{reverse ? num_blocks - 1 - blk : blk, bh % heads, bh / heads, true};
        if (seqused != nullptr) { t.valid = t.block * kBlock < seq_rows(nullptr, seqused, rows, t.batch).len; }
        return t;
    }
    constexpr unsigned kAll = 0xffffffffu;
    int const lane = threadIdx.x % 32;
    int64_t first = 0;  // index of the first tile of sequence b0
    for (int b0 = 0; b0 < batches; b0 += 32) {
        int const b = b0 + lane;
        int const blocks = b < batches ? (seq_rows(cu_seqlens, seqused, rows, b).len + kBlock - 1) / kBlock : 0;
        int64_t end = int64_t(blocks) * heads;  // inclusive prefix sum over the lanes: end of sequence b's tiles
        CUTE_UNROLL
        for (int offset = 1; offset < 32; offset *= 2) {
            int64_t const x = __shfl_up_sync(kAll, end, offset);
            if (lane >= offset) { end += x; }
        }
        unsigned const hit = __ballot_sync(kAll, first + end > idx);
        if (hit != 0) {
            int const l = __ffs(hit) - 1;
            int const n = __shfl_sync(kAll, blocks, l);
            int const local = int(idx - (first + __shfl_sync(kAll, end, l) - int64_t(n) * heads));
            int const blk = local % n;
            return {reverse ? n - 1 - blk : blk, local / n, b0 + l, true};
        }
        first += __shfl_sync(kAll, end, 31);
    }
    return {0, 0, 0, false};
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

// The same for an index that a loop gives rather than the launch: values derived from the result are computed again
// instead of being kept live from an earlier derivation from x.
__device__ __forceinline__ int reread(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

}  // namespace flash
