// What happens to the raw scores x = q.k before the softmax, besides the mask (mask.h): softcap and the ALiBi bias.
// Both work on (row, col) register views with a matching view of each element's (row, col) coordinate in the tile.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "block_range.h"
#include "params.h"

namespace flash {

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

// ALiBi's slope for (batch, head), divided by the logit scale.
__device__ __forceinline__ float alibi_slope(AttnParams const& params, int batch, int head) {
    return params.alibi_slopes[batch * params.alibi_batch_stride + head] / params.logit_scale;
}

// The backward's score mods, on S (raw scores) and dP (already minus D), before the mask: softcap makes S tanh(S pre)
// and multiplies dP by the tanh derivative 1 - tanh^2, since dS is taken w.r.t. q.k (taken before any mask makes S
// -inf); ALiBi adds its bias to S, seen as (query, key) in s_rc with coordinates coord_rc.
template <class AccS, class AccDP, class TensorS, class TensorC>
__device__ __forceinline__ void apply_score_mods_bwd(AttnParams const& params, AccS& acc_s, AccDP& acc_dp,
                                                     TensorS& s_rc, TensorC const& coord_rc, int batch, int head,
                                                     int row0, int col0, AttnWindow const& window) {
    if (params.has_softcap) {
        apply_softcap(acc_s, params.softcap_pre);
        CUTE_UNROLL
        for (int i = 0; i < cute::size(acc_s); ++i) { acc_dp(i) *= 1.f - acc_s(i) * acc_s(i); }
    }
    if (params.alibi_slopes != nullptr) {
        apply_alibi(s_rc, coord_rc, row0, col0, window.diag_offset(), alibi_slope(params, batch, head));
    }
}

}  // namespace flash
