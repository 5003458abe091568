// The lse-weighted merge of partial attention results over disjoint key sets (split-KV chunks): with l_s the lse of
// part s and x_s its output normalised by its own sum, the merged output is sum_s exp(l_s - lse) x_s and the merged
// lse = log sum_s exp(l_s). Shared by the combine kernel (partials in global memory) and the cluster merge (in the
// cluster's shared memory). A part that saw no key (l_s = -inf) weighs 0; with no key at all the output is 0 and the
// lse -inf; a NaN lse makes the result NaN.
#pragma once

#include <cute/config.hpp>
#include <cutlass/array.h>

#include <cmath>

namespace flash {

// Parts are added in batches, online: each batch's max becomes the running max, and what was summed before is
// rescaled to it, as the forward's softmax does over key blocks. kValues: the values per part that one thread merges.
template <int kValues>
struct LseMerge {
    float top = -INFINITY;  // running max of the lse values (-inf: no part has seen a key yet)
    float sum = 0.f;        // sum of exp(l_s - top)
    cutlass::Array<float, kValues> acc;  // sum of exp(l_s - top) x_s

    __device__ __forceinline__ LseMerge() { acc.fill(0.f); }

    // A batch: l[i] each part's lse (-inf for a missing part), value(i) its values, read only for i < present (every
    // part's weight enters the sum, so a thread that merges no values, present = 0, still gets the lse).
    template <int kBatch, class Value>
    __device__ __forceinline__ void add(float const (&l)[kBatch], int present, Value const& value) {
        float new_top = top;
        CUTE_UNROLL
        for (int i = 0; i < kBatch; ++i) { new_top = fmaxf(new_top, l[i]); }
        float const base = new_top == -INFINITY ? 0.f : new_top;  // no part saw a key: weights 0, not NaN
        float const shrink = __expf(top - base);                  // 0 on the first batch (top = -inf)
        sum *= shrink;
        CUTE_UNROLL
        for (int j = 0; j < kValues; ++j) { acc[j] *= shrink; }
        CUTE_UNROLL
        for (int i = 0; i < kBatch; ++i) {
            float const w = __expf(l[i] - base);
            sum += w;
            if (i < present) {
                cutlass::Array<float, kValues> const x = value(i);
                CUTE_UNROLL
                for (int j = 0; j < kValues; ++j) { acc[j] += w * x[j]; }
            }
        }
        top = new_top;
    }

    // The merged output (acc / sum; 0 where no part saw a key).
    __device__ __forceinline__ cutlass::Array<float, kValues> output() const {
        float const inv = sum > 0.f ? 1.f / sum : 0.f;
        cutlass::Array<float, kValues> out;
        CUTE_UNROLL
        for (int j = 0; j < kValues; ++j) { out[j] = acc[j] * inv; }
        return out;
    }

    __device__ __forceinline__ float lse() const { return logf(sum) + (top == -INFINITY ? 0.f : top); }
};

}  // namespace flash
