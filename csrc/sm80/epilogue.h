// SM80-tier epilogues: an fp32 accumulator tile goes registers -> shared memory -> global memory in 16-byte
// row-contiguous chunks, predicated on the sequence end and the head dim. The forward's output (plus lse), the
// backward's dK and dV, and the dQ conversion all store through store_tile.
#pragma once

#include <cute/tensor.hpp>

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

}  // namespace flash::sm80
