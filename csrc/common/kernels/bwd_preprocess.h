// Backward preprocess, for every tier: D = rowsum(dO * O) - dlse per (batch entry, head, query row), in fp32, one warp
// per row with 16-byte loads (a head dim of up to 256 is one load per lane). Two layouts of the result:
// - bwd_preprocess_kernel walks the tensors' rows, which needs no sequence lookup (a varlen call is one batch entry
//   of total rows), and writes D like lse;
// - bwd_preprocess_tiles_kernel walks query tiles of kBlockM rows and writes D and lse2 = lse * log2(e) per
//   accumulator row (BwdWorkspace's per_accum_row), padding rows included (D 0, lse2 +inf), so that a main kernel
//   loads a tile's statistics with one bulk copy and needs no bounds or -inf checks.
// Both also zero the dQ accumulator and semaphores, which the main kernel (next on the stream) adds into: one launch
// fewer than a memset, which a small eager backward pays for in host time.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include <cmath>

#include "../block_scheduler.h"
#include "../bwd_workspace.h"
#include "../params.h"
#include "../seqlen.h"

namespace flash {

constexpr int kPreprocessWarps = 8;

// D of one row (row counted from the start of its tensor batch entry), reduced over the warp; every lane returns it.
template <typename Element>
__device__ __forceinline__ float row_dpsum(BwdParams const& params, int batch, int64_t row, int head, int lane) {
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
    return sum;
}

// The workspace's zeroed part (BwdWorkspace), in 16-byte stores spread over the grid.
__device__ __forceinline__ void zero_dq_workspace(BwdParams const& params) {
    auto* words = reinterpret_cast<uint4*>(params.dq_accum);
    int64_t const stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < params.dq_zero_words; i += stride) {
        words[i] = make_uint4(0u, 0u, 0u, 0u);
    }
}

template <typename Element>
__global__ void __launch_bounds__(kPreprocessWarps * 32)
    bwd_preprocess_kernel(__grid_constant__ BwdParams const params) {
    zero_dq_workspace(params);
    int64_t const row_id = int64_t(blockIdx.x) * kPreprocessWarps + threadIdx.x / 32;  // (batch, row, head)
    int const lane = threadIdx.x % 32;
    if (row_id >= int64_t(tensor_batches(params)) * params.sq * params.h) { return; }
    int const head = int(row_id % params.h);
    int64_t const batch_row = row_id / params.h;
    int const row = int(batch_row % params.sq);
    int const batch = int(batch_row / params.sq);

    float const sum = row_dpsum<Element>(params, batch, row, head, lane);
    if (lane == 0) {
        int64_t const idx = batch * params.lse_batch_stride + head * params.lse_head_stride + row;
        params.dpsum[idx] = params.dlse == nullptr ? sum : sum - params.dlse[idx];
    }
}

// One CTA per (query tile, head, sequence), in decode_tile's order.
template <typename Element, int kBlockM>
__global__ void __launch_bounds__(kPreprocessWarps * 32)
    bwd_preprocess_tiles_kernel(__grid_constant__ BwdParams const params) {
    zero_dq_workspace(params);
    TileCoord const blk =
        decode_tile<kBlockM>(blockIdx.x, params.cu_seqlens_q, params.seqused_q, params.sq, params.b, params.h, false);
    if (!blk.valid) { return; }
    SeqlenInfo const seq(params, blk.batch);
    int const lane = threadIdx.x % 32;
    int const row0 = blk.block * kBlockM;
    int64_t const accum_row = dq_accum_row(params, seq, blk.head) + row0;
    int64_t const stats = seq.row_stats_index(params, blk.head) + row0;
    int const entry = params.cu_seqlens_q == nullptr ? seq.batch : 0;
    for (int r = threadIdx.x / 32; r < kBlockM; r += kPreprocessWarps) {
        bool const valid = row0 + r < seq.q.len;
        float const sum = valid ? row_dpsum<Element>(params, entry, int64_t(seq.q.start) + row0 + r, blk.head, lane)
                                : 0.f;
        if (lane == 0) {
            // Rows past the sequence and rows that see no key (lse -inf) get +inf, so that P = 0 there.
            float const lse = valid ? params.lse[stats + r] : -INFINITY;
            params.lse2[accum_row + r] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
            params.dpsum[accum_row + r] = !valid ? 0.f : params.dlse == nullptr ? sum : sum - params.dlse[stats + r];
        }
    }
}

}  // namespace flash
