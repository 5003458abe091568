// What both tiers' forward epilogues share: the lse of a tile's rows, from the accumulator's (row, col) coordinates.
#pragma once

#include <cute/tensor.hpp>

#include "params.h"
#include "seqlen.h"

namespace flash {

// coord_rc: this thread's (row, col) coordinates in the tile, seen as (rows, cols); lse: one value per row. The first
// lane of each quad holds column 0 of its rows and writes them; rows at or past the sequence's end are skipped.
template <class CoordRC, int kRows>
__device__ __forceinline__ void store_lse(CoordRC const& coord_rc, float const (&lse)[kRows], FwdParams const& params,
                                          SeqlenInfo const& seq, int head, int row0) {
    if (cute::get<1>(coord_rc(0, 0)) != 0) { return; }
    float* lse_row = params.lse + seq.row_stats_index(params, head) + row0;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
        int const row = cute::get<0>(coord_rc(r, 0));
        if (row0 + row < seq.q.len) { lse_row[row] = lse[r]; }
    }
}

}  // namespace flash
