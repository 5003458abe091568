// What the tiers' epilogues share: the lse of a tile's rows, from the accumulator's (row, col) coordinates, and
// register stores of adjacent column pairs.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include "params.h"
#include "seqlen.h"

namespace flash {

// coord_rc: this thread's (row, col) coordinates in the tile, seen as (rows, cols); lse: one value per row, stored
// into `dest` in the layout of params.lse (the lse, or one split's partial lse). The first lane of each quad holds
// column 0 of its rows and writes them; rows at or past the sequence's end are skipped.
template <class CoordRC, int kRows>
__device__ __forceinline__ void store_lse(float* dest, CoordRC const& coord_rc, float const (&lse)[kRows],
                                          FwdParams const& params, SeqlenInfo const& seq, int head, int row0) {
    if (cute::get<1>(coord_rc(0, 0)) != 0) { return; }
    float* lse_row = dest + seq.row_stats_index(params, head) + row0;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
        int const row = cute::get<0>(coord_rc(r, 0));
        if (row0 + row < seq.q.len) { lse_row[row] = lse[r]; }
    }
}

// Stores a fragment seen as (rows, cols) from registers, each value through to_element, in pairs of adjacent columns
// (c, c + 1), c even: rows below rows_left, columns below cols, of the tile at `base`.
template <class CoordRC, class FragRC, typename Element, class ToElement>
__device__ __forceinline__ void store_row_pairs(CoordRC const& coord_rc, FragRC const& frag_rc, Element* base,
                                                int64_t row_stride, int rows_left, int cols, ToElement to_element) {
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(frag_rc); ++r) {
        int const row = cute::get<0>(coord_rc(r, 0));
        if (row < rows_left) {
            CUTE_UNROLL
            for (int c = 0; c < cute::size<1>(frag_rc); c += 2) {
                int const col = cute::get<1>(coord_rc(r, c));
                if (col < cols) {
                    cutlass::AlignedArray<Element, 2> pair;
                    pair[0] = to_element(frag_rc(r, c));
                    pair[1] = to_element(frag_rc(r, c + 1));
                    Element* dest = base + int64_t(row) * row_stride + col;
                    *reinterpret_cast<cutlass::AlignedArray<Element, 2>*>(dest) = pair;
                }
            }
        }
    }
}

}  // namespace flash
