// Applies an AttnWindow to a register tile of scores seen as (row, col), with a matching view of each element's
// (row, col) coordinate in the tile. Both directions hold scores as (query, key) tiles, so one mask serves both.
#pragma once

#include <cute/tensor.hpp>

#include <climits>
#include <cmath>

#include "block_range.h"

namespace flash {

// Sets to -inf every score whose key is past sk or outside its row's window. A caller that knows the tile lies
// inside every row's left window edge passes kLeftEdge = false, which saves one compare per score. With kPackedRows,
// tile row r is query (row0 + r) / packed_heads (GQA-packed queries, FwdParams::packed_heads).
template <bool kLeftEdge = true, bool kPackedRows = false, class TensorS, class TensorC>
__device__ __forceinline__ void apply_mask(TensorS& s, TensorC const& coord, AttnWindow const& w, int row0,
                                           int col0, int packed_heads = 1) {
    // Bounds are taken relative to this thread's first column, so that each score compares a register with a
    // compile-time offset (its column's distance from the first), not with a column computed per score.
    int const col_base = col0 + cute::get<1>(coord(0, 0));
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(s); ++r) {
        int const row = row0 + cute::get<0>(coord(r, 0));
        int const diag = (kPackedRows ? row / packed_heads : row) + w.diag_offset();
        int const lo = kLeftEdge && w.left >= 0 ? diag - w.left - col_base : INT_MIN;
        int const hi = (w.right >= 0 ? min(diag + w.right, w.sk - 1) : w.sk - 1) - col_base;
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(s); ++c) {
            int const dc = cute::get<1>(coord(r, c)) - cute::get<1>(coord(0, 0));
            if ((kLeftEdge && dc < lo) || dc > hi) { s(r, c) = -INFINITY; }
        }
    }
}

}  // namespace flash
