// SM80-tier epilogue: the normalised output goes registers -> shared memory (reusing Q's tile) -> global memory in
// 16-byte row-contiguous chunks, predicated on the sequence end and the head dim; lse is written by one lane per row.
#pragma once

#include <cute/tensor.hpp>

#include "../common/fwd_params.h"
#include "mainloop.h"

namespace flash::sm80 {

using namespace cute;

template <class Traits, class TiledMma, class AccO, int kRows>
__device__ __forceinline__ void store_output(TiledMma const& tiled_mma, AccO const& acc_o, float const (&lse)[kRows],
                                             char* smem, FwdParams const& params, int m_block, int head, int batch,
                                             int tid) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kHeadDim = Traits::kHeadDim;

    Tensor rO = convert_fragment<Element>(acc_o);
    Tensor sO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
    auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
    auto smem_thr_o = smem_copy_o.get_thread_slice(tid);
    copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));

    int const row0 = m_block * kBlockM;
    Tensor coord_rc = rowcol_view(
        tiled_mma.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    if (get<1>(coord_rc(0, 0)) == 0) {  // the first lane of each quad holds column 0 of its rows
        float* lse_row = params.lse + (int64_t(batch) * params.h + head) * params.sq + row0;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            int const row = get<0>(coord_rc(r, 0));
            if (row0 + row < params.sq) { lse_row[row] = lse[r]; }
        }
    }
    __syncthreads();

    Tensor mO = make_tensor(
        make_gmem_ptr(static_cast<Element*>(params.o) + batch * params.o_batch_stride + head * params.o_head_stride),
        make_shape(params.sq, Int<kHeadDim>{}), make_stride(params.o_row_stride, _1{}));
    Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
    typename Traits::GmemTiledCopyO gmem_copy_o;
    auto gmem_thr_o = gmem_copy_o.get_thread_slice(tid);
    Tensor tOsO = gmem_thr_o.partition_S(sO);
    Tensor tOgO = gmem_thr_o.partition_D(gO);
    Tensor tOcO = gmem_thr_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    int const rows_left = params.sq - row0;
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tOgO); ++m) {
        if (get<0>(tOcO(0, m, 0)) < rows_left) {
            CUTE_UNROLL
            for (int k = 0; k < size<2>(tOgO); ++k) {
                if (get<1>(tOcO(0, m, k)) < params.d) { copy(gmem_copy_o, tOsO(_, m, k), tOgO(_, m, k)); }
            }
        }
    }
}

}  // namespace flash::sm80
