// Combine of split-KV partials (CombineParams), for every tier: each row (batch, row, head) is read by kHeadDim / 8
// lanes of a warp, 8 values each per split (16 bytes of 16-bit partials, 32 of fp32 ones), so that a warp takes
// 32 / (kHeadDim / 8) rows. Splits are merged online (LseMerge), kBatch at a time: every lane of a row loads the
// batch's lse values (broadcast loads) together with its partials. A decode step's combine is a few rows against
// many splits, so its time is the chain of load latencies: one round per kBatch splits (a decode step's 16 or fewer:
// one round), with no separate round for the max. It is launched to start while the forward that writes the
// partials still runs (dependent_launch.h), so that its launch is not one more step of that chain.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include <cmath>

#include "../dependent_launch.h"
#include "../lse_merge.h"
#include "../params.h"

namespace flash {

constexpr int kCombineWarps = 4;
constexpr int kBatch = 16;  // splits whose loads are in flight at once

// Eight values moved in 16-byte accesses: the compiler does not merge an Array's 4-byte storage words into one.
template <typename T>
__device__ __forceinline__ cutlass::Array<T, 8> load8(T const* src) {
    cutlass::Array<T, 8> v;
    static_assert(sizeof(v) % 16 == 0);
    CUTE_UNROLL
    for (int i = 0; i < int(sizeof(v) / 16); ++i) {
        reinterpret_cast<uint4*>(&v)[i] = reinterpret_cast<uint4 const*>(src)[i];
    }
    return v;
}

template <typename T>
__device__ __forceinline__ void store8(T* dest, cutlass::Array<T, 8> const& v) {
    static_assert(sizeof(v) == 16);
    uint32_t const* w = reinterpret_cast<uint32_t const*>(&v);
    // A uint4 assignment here comes out as four 4-byte stores.
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dest), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
}

template <typename Partial, typename Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32) fwd_combine_kernel(__grid_constant__ CombineParams const p) {
    constexpr int kLanesPerRow = kHeadDim / 8;
    constexpr int kRowsPerWarp = 32 / kLanesPerRow;
    static_assert(kHeadDim % 8 == 0 && kLanesPerRow <= 32);
    wait_for_prior_grid();
    int const lane = threadIdx.x % 32;
    if (lane >= kRowsPerWarp * kLanesPerRow) { return; }  // past the warp's last whole row
    int64_t const id = (int64_t(blockIdx.x) * kCombineWarps + threadIdx.x / 32) * kRowsPerWarp + lane / kLanesPerRow;
    if (id >= int64_t(p.b) * p.rows * p.h) { return; }
    int const head = int(id % p.h);
    int const row = int(id / p.h % p.rows);
    int const batch = int(id / p.h / p.rows);
    int const col = lane % kLanesPerRow * 8;

    float const* lse = p.lse_partial + batch * p.lp_batch_stride + row * p.lp_row_stride + head * p.lp_head_stride;
    cutlass::NumericArrayConverter<float, Partial, 8> to_float;
    auto const* partial = static_cast<Partial const*>(p.out_partial) + batch * p.op_batch_stride +
                          row * p.op_row_stride + head * p.op_head_stride + col;
    bool const active = col < p.d;
    LseMerge<8> merge;
    for (int s0 = 0; s0 < p.splits; s0 += kBatch) {
        // All of the batch's loads are issued before any is used: one at a time, their latencies would add up.
        float l[kBatch];
        cutlass::Array<Partial, 8> v[kBatch];
        CUTE_UNROLL
        for (int i = 0; i < kBatch; ++i) {
            bool const here = s0 + i < p.splits;
            l[i] = here ? lse[(s0 + i) * p.lp_split_stride] : -INFINITY;  // a missing split weighs 0
            if (active && here) { v[i] = load8(partial + (s0 + i) * p.op_split_stride); }
        }
        merge.add(l, active ? p.splits - s0 : 0, [&](int i) { return to_float(v[i]); });
    }
    if (active) {
        cutlass::NumericArrayConverter<Element, float, 8> to_element;
        Element* out = static_cast<Element*>(p.out) + batch * p.o_batch_stride + row * p.o_row_stride +
                       head * p.o_head_stride + col;
        store8(out, to_element(merge.output()));
    }
    if (p.lse != nullptr && col == 0) { p.lse[(int64_t(batch) * p.h + head) * p.rows + row] = merge.lse(); }
}

}  // namespace flash
