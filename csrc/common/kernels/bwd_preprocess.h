// Backward preprocess, for every tier: D = rowsum(dO * O) - dlse per (batch entry, head, query row), in fp32, a group
// of lanes per row with 16-byte loads (RowGroup). Two layouts of the result:
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

constexpr int kPreprocessThreads = 256;

// The lanes that share a row of kHeadDim columns, 8 each (one 16-byte load of O and one of dO): a power of two, so
// that a warp covers 32 / kLanes rows at once with every lane loading, and the group reduces with xor shuffles.
template <int kHeadDim>
struct RowGroup {
    static constexpr int kLanes = kHeadDim <= 8 ? 1 : 1 << (32 - __builtin_clz(unsigned(kHeadDim / 8 - 1)));
    static constexpr int kRowsPerCta = kPreprocessThreads / kLanes;
    static_assert(kLanes <= 32 && kLanes * 8 >= kHeadDim);

    // This lane's 8 columns of one row of O and of dO (the row counted from the start of its tensor batch entry;
    // zeros where !valid).
    struct Pieces {
        uint4 o, dout;
    };
    __device__ __forceinline__ static Pieces load(BwdParams const& params, bool valid, int batch, int64_t row,
                                                  int head, int lane) {
        Pieces x{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
        if (valid && lane * 8 < params.d) {
            using Bits = uint16_t;  // the 16-bit elements' bytes, converted in dpsum
            auto const* o = static_cast<Bits const*>(params.o) + batch * params.o_batch_stride +
                            row * params.o_row_stride + head * params.o_head_stride + lane * 8;
            auto const* dout = static_cast<Bits const*>(params.dout) + batch * params.do_batch_stride +
                               row * params.do_row_stride + head * params.do_head_stride + lane * 8;
            x.o = *reinterpret_cast<uint4 const*>(o);
            x.dout = *reinterpret_cast<uint4 const*>(dout);
        }
        return x;
    }

    // The row's D from the group's pieces; every lane of the group returns it.
    template <typename Element>
    __device__ __forceinline__ static float dpsum(Pieces const& x) {
        using Vec = cutlass::Array<Element, 8>;
        cutlass::NumericArrayConverter<float, Element, 8> to_float;
        auto const of = to_float(reinterpret_cast<Vec const&>(x.o));
        auto const df = to_float(reinterpret_cast<Vec const&>(x.dout));
        float sum = 0.f;
        CUTE_UNROLL
        for (int i = 0; i < 8; ++i) { sum += of[i] * df[i]; }
        CUTE_UNROLL
        for (int offset = kLanes / 2; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, offset); }
        return sum;
    }
};

// The workspace's zeroed part (BwdWorkspace), in 16-byte stores spread over the grid.
__device__ __forceinline__ void zero_dq_workspace(BwdParams const& params) {
    auto* words = reinterpret_cast<uint4*>(params.dq_accum);
    int64_t const stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < params.dq_zero_words; i += stride) {
        words[i] = make_uint4(0u, 0u, 0u, 0u);
    }
}

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kPreprocessThreads) bwd_preprocess_kernel(__grid_constant__ BwdParams const params) {
    zero_dq_workspace(params);
    using Group = RowGroup<kHeadDim>;
    // (batch, row, head)
    int64_t const row_id = int64_t(blockIdx.x) * Group::kRowsPerCta + threadIdx.x / Group::kLanes;
    int const lane = threadIdx.x % Group::kLanes;
    bool const valid = row_id < int64_t(tensor_batches(params)) * params.sq * params.h;
    int const head = int(row_id % params.h);
    int64_t const batch_row = row_id / params.h;
    int const row = int(batch_row % params.sq);
    int const batch = int(batch_row / params.sq);

    float const sum = Group::template dpsum<Element>(Group::load(params, valid, batch, row, head, lane));
    if (valid && lane == 0) {
        int64_t const idx = batch * params.lse_batch_stride + head * params.lse_head_stride + row;
        params.dpsum[idx] = params.dlse == nullptr ? sum : sum - params.dlse[idx];
    }
}

// One CTA per (query tile, head, sequence), in decode_tile's order; the tile's rows in passes of kRowsPerCta, unrolled
// so that every pass's loads are in flight together.
template <typename Element, int kBlockM, int kHeadDim>
__global__ void __launch_bounds__(kPreprocessThreads)
    bwd_preprocess_tiles_kernel(__grid_constant__ BwdParams const params) {
    zero_dq_workspace(params);
    using Group = RowGroup<kHeadDim>;
    static_assert(kBlockM % Group::kRowsPerCta == 0);
    TileCoord const blk =
        decode_tile<kBlockM>(blockIdx.x, params.cu_seqlens_q, params.seqused_q, params.sq, params.b, params.h, false);
    if (!blk.valid) { return; }
    SeqlenInfo const seq(params, blk.batch);
    int const lane = threadIdx.x % Group::kLanes;
    int const row0 = blk.block * kBlockM;
    int64_t const accum_row = dq_accum_row(params, seq, blk.head) + row0;
    int64_t const stats = seq.row_stats_index(params, blk.head) + row0;
    int const entry = params.cu_seqlens_q == nullptr ? seq.batch : 0;
    constexpr int kPasses = kBlockM / Group::kRowsPerCta;
    // Every pass's loads in flight together, before any store (which the compiler would not move them past).
    typename Group::Pieces pieces[kPasses];
    CUTE_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
        int const r = pass * Group::kRowsPerCta + threadIdx.x / Group::kLanes;
        pieces[pass] = Group::load(params, row0 + r < seq.q.len, entry, int64_t(seq.q.start) + row0 + r, blk.head,
                                   lane);
    }
    float sum[kPasses];
    CUTE_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) { sum[pass] = Group::template dpsum<Element>(pieces[pass]); }
    if (lane == 0) {
        CUTE_UNROLL
        for (int pass = 0; pass < kPasses; ++pass) {
            int const r = pass * Group::kRowsPerCta + threadIdx.x / Group::kLanes;
            bool const valid = row0 + r < seq.q.len;
            // Rows past the sequence and rows that see no key (lse -inf) get +inf, so that P = 0 there.
            float const lse = valid ? params.lse[stats + r] : -INFINITY;
            params.lse2[accum_row + r] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
            params.dpsum[accum_row + r] =
                !valid ? 0.f : params.dlse == nullptr ? sum[pass] : sum[pass] - params.dlse[stats + r];
        }
    }
}

}  // namespace flash
