// SM80-tier epilogues: an fp32 accumulator tile goes registers -> shared memory -> global memory in 16-byte
// row-contiguous chunks, predicated on the sequence end and the head dim. The forward's output (plus lse), the
// backward's dK and dV, and the dQ conversion all store through store_tile.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "../common/epilogue.h"
#include "../common/params.h"
#include "../common/seqlen.h"
#include "gemm.h"

namespace flash::sm80 {

using namespace cute;

// Stores `acc`, tiled_mma's C fragment of a tile shaped like `s`, converted to Element, through the shared-memory
// tile `s` into the global tile `g`: rows below rows_left, columns below cols.
template <class Traits, class TiledMma, class Acc, class SmemTile, class GmemTile>
__device__ __forceinline__ void store_tile(TiledMma const& tiled_mma, Acc const& acc, SmemTile&& s, GmemTile&& g,
                                           int rows_left, int cols, int tid) {
    Tensor r = convert_fragment<typename Traits::Element>(acc);
    // `s` reuses an operand tile of the main loop (Q in the forward, K and V in the backward) that other threads may
    // still be reading.
    __syncthreads();
    auto smem_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
    auto smem_thr = smem_copy.get_thread_slice(tid);
    copy(smem_copy, smem_thr.retile_S(r), smem_thr.partition_D(s));
    __syncthreads();

    typename Traits::GmemTiledCopyO gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tid);
    Tensor tS = gmem_thr.partition_S(s);
    Tensor tG = gmem_thr.partition_D(g);
    Tensor tC = gmem_thr.partition_D(make_identity_tensor(product_each(shape(s))));
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tG); ++m) {
        if (get<0>(tC(0, m, 0)) < rows_left) {
            CUTE_UNROLL
            for (int k = 0; k < size<2>(tG); ++k) {
                if (get<1>(tC(0, m, k)) < cols) { copy(gmem_copy, tS(_, m, k), tG(_, m, k)); }
            }
        }
    }
}

// The forward's normalised output and its lse (one lane per row).
template <class Traits, class TiledMma, class AccO, int kRows>
__device__ __forceinline__ void store_output(TiledMma const& tiled_mma, AccO const& acc_o, float const (&lse)[kRows],
                                             char* smem, FwdParams const& params, SeqlenInfo const& seq, int m_block,
                                             int head, int tid) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kHeadDim = Traits::kHeadDim;

    int const row0 = m_block * kBlockM;
    Tensor coord_rc = rowcol_view(
        tiled_mma.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    store_lse(params.lse, coord_rc, lse, params, seq, head, row0);

    Tensor sO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
    Tensor mO = head_rows<kHeadDim>(static_cast<Element*>(params.o) + seq.q_offset(params.o_batch_stride,
                                                                                   params.o_row_stride,
                                                                                   params.o_head_stride, head),
                                    seq.q.len, params.o_row_stride);
    Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
    store_tile<Traits>(tiled_mma, acc_o, sO, gO, seq.q.len - row0, params.d, tid);
}

// Warps over keys (FwdTile::warps_over_keys): each warp holds the normalised output and the lse of its share of the
// keys for the tile's rows, in the same fragment layout (one warp's MMA, by lane). Merged into warp 0's registers,
// as the combine merges splits: lse = log sum_w exp(lse_w), O = sum_w exp(lse_w - lse) O_w (a warp that saw no key
// of a row, lse_w = -inf, weighs 0). Returns false in the other warps, which are then done. Takes shared memory that
// the main loop's operands used.
template <int kWarps, class AccO, int kRows>
__device__ __forceinline__ bool merge_warp_outputs(AccO& acc_o, float (&lse)[kRows], char* smem, int tid) {
    constexpr int kValues = decltype(size(acc_o))::value;
    constexpr int kTileRows = 8 * kRows;  // an m16 tile: lane / 4 + 8 r
    float* s_lse = reinterpret_cast<float*>(smem);  // [warp][row]
    float* s_o = s_lse + kWarps * kTileRows;        // [warp - 1][value][lane]: conflict-free
    int const warp = tid / 32, lane = tid % 32;
    __syncthreads();  // every warp is done with the operands
    if (lane % 4 == 0) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) { s_lse[warp * kTileRows + lane / 4 + 8 * r] = lse[r]; }
    }
    __syncthreads();
    auto acc_rc = rowcol_view(acc_o);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
        int const row = lane / 4 + 8 * r;
        float top = -INFINITY;
        CUTE_UNROLL
        for (int w = 0; w < kWarps; ++w) { top = fmaxf(top, s_lse[w * kTileRows + row]); }
        float total = -INFINITY;
        if (top != -INFINITY) {
            float sum = 0.f;
            CUTE_UNROLL
            for (int w = 0; w < kWarps; ++w) { sum += __expf(s_lse[w * kTileRows + row] - top); }
            total = top + __logf(sum);
        }
        float const weight = lse[r] == -INFINITY ? 0.f : __expf(lse[r] - total);  // NaN stays NaN
        lse[r] = total;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(acc_rc); ++c) { acc_rc(r, c) *= weight; }
    }
    if (warp > 0) {
        CUTE_UNROLL
        for (int i = 0; i < kValues; ++i) { s_o[((warp - 1) * kValues + i) * 32 + lane] = acc_o(i); }
    }
    __syncthreads();
    if (warp > 0) { return false; }
    CUTE_UNROLL
    for (int w = 1; w < kWarps; ++w) {
        CUTE_UNROLL
        for (int i = 0; i < kValues; ++i) { acc_o(i) += s_o[((w - 1) * kValues + i) * 32 + lane]; }
    }
    return true;
}

}  // namespace flash::sm80
