// Online softmax over register tiles seen as (row, col). Each row's columns are spread over the 4 lanes of a quad,
// the accumulator layout of both mma.sync and wgmma, so row reductions are two xor-shuffles.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace flash {

__device__ __forceinline__ float quad_allreduce_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
}

__device__ __forceinline__ float quad_allreduce_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 2);
    return x + __shfl_xor_sync(0xffffffff, x, 1);
}

template <int kNRows>
struct OnlineSoftmax {
    float row_max[kNRows];  // running max of the scores x (not yet scaled)
    float row_sum[kNRows];  // this thread's share of the running sum of exp; reduced over the quad at the end

    // Turns the scores `s` of one key block into probabilities, rescaling the running output `o` when the max grows.
    // Starts from row_max = -inf and row_sum = 0; the first block's rescale factor is then exp2(-inf) = 0.
    __device__ __forceinline__ void init() {
        CUTE_UNROLL
        for (int r = 0; r < kNRows; ++r) {
            row_max[r] = -INFINITY;
            row_sum[r] = 0.f;
        }
    }

    template <class TensorS, class TensorO>
    __device__ __forceinline__ void update(TensorS& s, TensorO& o, float scale_log2) {
        static_assert(decltype(cute::size<0>(s))::value == kNRows);
        CUTE_UNROLL
        for (int r = 0; r < kNRows; ++r) {
            float m = row_max[r];
            CUTE_UNROLL
            for (int c = 0; c < cute::size<1>(s); ++c) { m = fmaxf(m, s(r, c)); }
            m = quad_allreduce_max(m);
            // A row with every key masked so far keeps max -inf; exp2(-inf - 0) = 0 keeps it at zero, not NaN.
            float const m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
            float const alpha = exp2f(row_max[r] * scale_log2 - m_scaled);
            float sum = row_sum[r] * alpha;
            CUTE_UNROLL
            for (int c = 0; c < cute::size<1>(o); ++c) { o(r, c) *= alpha; }
            row_max[r] = m;
            CUTE_UNROLL
            for (int c = 0; c < cute::size<1>(s); ++c) {
                s(r, c) = exp2f(s(r, c) * scale_log2 - m_scaled);
                sum += s(r, c);
            }
            row_sum[r] = sum;
        }
    }

    // Normalises `o` and returns each row's log-sum-exp (natural log of the logits, -inf for a row that saw no key).
    template <class TensorO>
    __device__ __forceinline__ void finalize(TensorO& o, float logit_scale, float (&lse)[kNRows]) {
        CUTE_UNROLL
        for (int r = 0; r < kNRows; ++r) {
            float const sum = quad_allreduce_sum(row_sum[r]);
            // Only a fully masked row has sum 0 (its output is defined as 0); NaN from bad input propagates.
            float const inv = sum == 0.f ? 0.f : 1.f / sum;
            lse[r] = sum == 0.f ? -INFINITY : row_max[r] * logit_scale + __logf(sum);
            CUTE_UNROLL
            for (int c = 0; c < cute::size<1>(o); ++c) { o(r, c) *= inv; }
        }
    }
};

}  // namespace flash
