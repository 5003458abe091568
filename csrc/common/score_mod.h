// What happens to the raw scores x = q.k before the softmax: softcap, ALiBi bias, and the causal / local / length
// mask. All work on (row, col) register views with a matching view of each element's (row, col) coordinate in the tile.
#pragma once

#include <cute/tensor.hpp>

#include <climits>
#include <cmath>

#include "fwd_params.h"

namespace flash {

// Keys [lo, hi) that some query row in [row_first, row_last] can see under the causal / local window; host and device
// use it, to skip key blocks and to size the work of a query tile.
struct KeyRange {
    int lo, hi;
};

__host__ __device__ inline KeyRange visible_keys(FwdParams const& p, int row_first, int row_last) {
    int const diag_offset = p.sk - p.sq;  // bottom-right alignment
    int const lo = p.window_left >= 0 ? cute::max(0, row_first + diag_offset - p.window_left) : 0;
    int const hi = p.window_right >= 0 ? cute::min(p.sk, row_last + diag_offset + p.window_right + 1) : p.sk;
    return {lo, cute::max(lo, hi)};
}

// x <- tanh(x * pre); the softcap factor itself is folded into the softmax scale. tanh(y) = 1 - 2 / (e^{2y} + 1)
// is exact to a few ulps in absolute terms (what the softmax sees) and saturates cleanly for large |y|.
template <class TensorS>
__device__ __forceinline__ void apply_softcap(TensorS& s, float pre) {
    CUTE_UNROLL
    for (int i = 0; i < cute::size(s); ++i) {
        s(i) = 1.f - __fdividef(2.f, __expf(2.f * pre * s(i)) + 1.f);
    }
}

// ALiBi: x += -slope * |i + sk - sq - j|, with the slope already divided by the logit scale.
template <class TensorS, class TensorC>
__device__ __forceinline__ void apply_alibi(TensorS& s, TensorC const& coord, int row0, int col0, int diag_offset,
                                            float slope) {
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(s); ++r) {
        int const diag = row0 + cute::get<0>(coord(r, 0)) + diag_offset;
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(s); ++c) {
            int const col = col0 + cute::get<1>(coord(r, c));
            s(r, c) -= slope * float(abs(diag - col));
        }
    }
}

// Sets to -inf every score whose key is past sk or outside the row's window [i + off - left, i + off + right].
template <class TensorS, class TensorC>
__device__ __forceinline__ void apply_mask(TensorS& s, TensorC const& coord, int row0, int col0, int sk,
                                           int diag_offset, int window_left, int window_right) {
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(s); ++r) {
        int const diag = row0 + cute::get<0>(coord(r, 0)) + diag_offset;
        int const lo = window_left >= 0 ? diag - window_left : INT_MIN;
        int const hi = window_right >= 0 ? min(diag + window_right, sk - 1) : sk - 1;
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(s); ++c) {
            int const col = col0 + cute::get<1>(coord(r, c));
            if (col < lo || col > hi) { s(r, c) = -INFINITY; }
        }
    }
}

}  // namespace flash
