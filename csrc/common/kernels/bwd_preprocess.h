// Backward preprocess, for every tier: D = rowsum(dO * O) - dlse per (batch entry, head, query row), in fp32. One warp per row,
// 16-byte loads (a head dim of up to 256 is one load per lane). It walks the tensors' rows, which need no sequence
// lookup: a varlen call is one batch entry of total rows (D of rows outside every sequence is never read).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "../params.h"
#include "../seqlen.h"

namespace flash {

constexpr int kPreprocessWarps = 8;

template <typename Element>
__global__ void __launch_bounds__(kPreprocessWarps * 32)
    bwd_preprocess_kernel(__grid_constant__ BwdParams const params) {
    int64_t const row_id = int64_t(blockIdx.x) * kPreprocessWarps + threadIdx.x / 32;  // (batch, row, head)
    int const lane = threadIdx.x % 32;
    if (row_id >= int64_t(tensor_batches(params)) * params.sq * params.h) { return; }
    int const head = int(row_id % params.h);
    int64_t const batch_row = row_id / params.h;
    int const row = int(batch_row % params.sq);
    int const batch = int(batch_row / params.sq);

    float sum = 0.f;
    if (lane * 8 < params.d) {
        using Vec = cutlass::Array<Element, 8>;
        auto const* o = static_cast<Element const*>(params.o) + batch * params.o_batch_stride +
                        row * params.o_row_stride + head * params.o_head_stride + lane * 8;
        auto const* dout = static_cast<Element const*>(params.dout) + batch * params.do_batch_stride +
                           row * params.do_row_stride + head * params.do_head_stride + lane * 8;
        cutlass::NumericArrayConverter<float, Element, 8> to_float;
        auto const of = to_float(*reinterpret_cast<Vec const*>(o));
        auto const df = to_float(*reinterpret_cast<Vec const*>(dout));
        CUTE_UNROLL
        for (int i = 0; i < 8; ++i) { sum += of[i] * df[i]; }
    }
    CUTE_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, offset); }
    if (lane == 0) {
        int64_t const idx = batch * params.lse_batch_stride + head * params.lse_head_stride + row;
        params.dpsum[idx] = params.dlse == nullptr ? sum : sum - params.dlse[idx];
    }
}

}  // namespace flash
