// SM90-tier forward epilogue: each consumer thread stores its own rows of the normalised output straight from
// registers (pairs of adjacent columns, 4 bytes) and their lse. No shared memory and no barrier, so a persistent CTA's
// next tile can start loading while this one is stored; the output is small beside the tile's GEMMs.
#pragma once

#include <cute/tensor.hpp>

#include "../common/epilogue.h"
#include "../common/params.h"
#include "../common/seqlen.h"
#include "../common/fragment.h"

namespace flash::sm90 {

using namespace cute;

template <class Traits, class TiledMma, class AccO, int kRows>
__device__ __forceinline__ void store_output(TiledMma const& tiled_mma, AccO const& acc_o, float const (&lse)[kRows],
                                             FwdParams const& params, SeqlenInfo const& seq, int m_block, int head,
                                             int ctid) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
    int const row0 = m_block * kBlockM;
    int const rows_left = seq.q.len - row0;
    Tensor coord_rc = rowcol_view(
        tiled_mma.get_thread_slice(ctid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    store_lse(coord_rc, lse, params, seq, head, row0);
    Tensor o_rc = rowcol_view(convert_fragment<Element>(acc_o));
    Element* o = static_cast<Element*>(params.o) +
                 seq.q_offset(params.o_batch_stride, params.o_row_stride, params.o_head_stride, head) +
                 int64_t(row0) * params.o_row_stride;
    // The accumulator layout gives each thread pairs of adjacent columns (c, c + 1), c even.
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
        int const row = get<0>(coord_rc(r, 0));
        if (row < rows_left) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(o_rc); c += 2) {
                int const col = get<1>(coord_rc(r, c));
                if (col < params.d) {
                    cutlass::Array<Element, 2> pair;
                    pair[0] = o_rc(r, c);
                    pair[1] = o_rc(r, c + 1);
                    *reinterpret_cast<cutlass::Array<Element, 2>*>(o + int64_t(row) * params.o_row_stride + col) =
                        pair;
                }
            }
        }
    }
}

}  // namespace flash::sm90
