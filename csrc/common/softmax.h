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

// The update of one key block comes in separable steps, so that a tier can place them around its GEMMs (SM90 issues
// the next block's S GEMM before rescaling O): max_and_scale (row max, and the factor by which the running output
// and sum shrink), exponentiate (scores to probabilities, row sums), rescale (the running output). update() runs
// them in the SM80 tier's order.
template <int kNRows>
struct OnlineSoftmax {
    float row_max[kNRows];  // running max of the scores x (not yet scaled)
    float row_sum[kNRows];  // this thread's share of the running sum of exp; reduced over the quad at the end

    // Starts from row_max = -inf and row_sum = 0; the first block's rescale factor is then exp2(-inf) = 0.
    __device__ __forceinline__ void init() {
        CUTE_UNROLL
        for (int r = 0; r < kNRows; ++r) {
            row_max[r] = -INFINITY;
            row_sum[r] = 0.f;
        }
    }

    // A row with every key masked so far keeps max -inf; subtracting 0 instead gives exp2(-inf) = 0, not NaN.
    __device__ __forceinline__ float scaled_max(int r, float scale_log2) const {
        return row_max[r] == -INFINITY ? 0.f : row_max[r] * scale_log2;
    }

    // Folds the scores `s` of one key block into the running max; alpha gets the factor by which the running output
    // must shrink (the running sum is shrunk here).
    template <class TensorS>
    __device__ __forceinline__ void max_and_scale(TensorS const& s, float scale_log2, float (&alpha)[kNRows]) {
        static_assert(decltype(cute::size<0>(s))::value == kNRows);
        // Independent partial maxima per row: a chain of one fmaxf per column would be latency-bound. The max is
        // exact, so the order changes nothing.
        constexpr int kCols = decltype(cute::size<1>(s))::value;
        constexpr int kWays = kCols % 4 == 0 ? 4 : (kCols % 2 == 0 ? 2 : 1);
        CUTE_UNROLL
        for (int r = 0; r < kNRows; ++r) {
            float part[kWays];
            CUTE_UNROLL
            for (int w = 0; w < kWays; ++w) { part[w] = s(r, w); }
            CUTE_UNROLL
            for (int c = kWays; c < kCols; ++c) { part[c % kWays] = fmaxf(part[c % kWays], s(r, c)); }
            float m = row_max[r];
            CUTE_UNROLL
            for (int w = 0; w < kWays; ++w) { m = fmaxf(m, part[w]); }
            float const old_max = row_max[r];
            row_max[r] = quad_allreduce_max(m);
            alpha[r] = exp2f(old_max * scale_log2 - scaled_max(r, scale_log2));
            row_sum[r] *= alpha[r];
        }
    }

    // Turns the scores `s` into probabilities against the running max and adds them to the row sums.
    template <class TensorS>
    __device__ __forceinline__ void exponentiate(TensorS& s, float scale_log2) {
        CUTE_UNROLL
        for (int r = 0; r < kNRows; ++r) {
            float const m_scaled = scaled_max(r, scale_log2);
            float sum = row_sum[r];
            CUTE_UNROLL
            for (int c = 0; c < cute::size<1>(s); ++c) {
                s(r, c) = exp2f(s(r, c) * scale_log2 - m_scaled);
                sum += s(r, c);
            }
            row_sum[r] = sum;
        }
    }

    template <class TensorO>
    __device__ __forceinline__ static void rescale(TensorO& o, float const (&alpha)[kNRows]) {
        CUTE_UNROLL
        for (int r = 0; r < kNRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < cute::size<1>(o); ++c) { o(r, c) *= alpha[r]; }
        }
    }

    // The whole update of one key block: `s` becomes probabilities, the running output `o` is rescaled.
    template <class TensorS, class TensorO>
    __device__ __forceinline__ void update(TensorS& s, TensorO& o, float scale_log2) {
        float alpha[kNRows];
        max_and_scale(s, scale_log2, alpha);
        rescale(o, alpha);
        exponentiate(s, scale_log2);
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
