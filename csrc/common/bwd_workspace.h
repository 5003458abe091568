// The backward's workspace, for every tier: the fp32 dQ accumulator (with the semaphores of the deterministic mode)
// and D, sized on the host and addressed in the kernels. Each tier adds into a query tile's accumulator rows in its
// own order (its dQ MMA's fragments) and converts them with a kernel that reads that order back.
#pragma once

#include <cute/tensor.hpp>

#include <cstddef>
#include <cstdint>

#include "kernel_registry.h"
#include "params.h"
#include "seqlen.h"

namespace flash {

// The workspace, one allocation: the fp32 dQ accumulator (rows x kernel head dim, zeroed), when deterministic one int
// per 16 accumulator rows, for a tier that splits tiles of keys (the SM90 tier's WaveTail) fp32 dK and dV sums and a
// count per split tile, for a persistent kernel its tile counter (all zeroed by the preprocess kernel, see
// zero_dq_workspace), then the row statistics: D
// like lse or, per_accum_row, D and lse2 per accumulator row, so that a query tile's statistics are one aligned run
// that a bulk copy can load (padding rows included).
// Accumulator rows: batched, sq rounded up to kBwdRowAlign per (b, h); varlen, per head, total_q plus kBwdRowAlign
// rows per sequence (see dq_accum_row), rounded up likewise.
struct BwdWorkspace {
    int64_t rows_per_head;
    bool per_accum_row;
    size_t accum_bytes, semaphore_bytes, split_sums_bytes, split_counts_bytes, counter_bytes, dpsum_bytes, lse2_bytes;

    static constexpr size_t kAlign = 256;
    static size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

    // split_tiles tiles of keys whose dK and dV are summed over parts, split_tile_floats floats of sums each.
    BwdWorkspace(BwdParams const& p, int kernel_head_dim, bool stats_per_accum_row = false, int64_t split_tiles = 0,
                 int64_t split_tile_floats = 0, bool tile_counter = false)
        : per_accum_row(stats_per_accum_row) {
        bool const varlen = p.cu_seqlens_q != nullptr;
        auto round_up = [](int64_t x) { return (x + kBwdRowAlign - 1) / kBwdRowAlign * kBwdRowAlign; };
        rows_per_head = varlen ? round_up(int64_t(p.sq) + int64_t(kBwdRowAlign) * (p.b + 1)) : round_up(p.sq);
        int64_t const rows = int64_t(varlen ? 1 : p.b) * p.h * rows_per_head;
        accum_bytes = aligned(size_t(rows) * kernel_head_dim * sizeof(float));
        semaphore_bytes = p.deterministic ? aligned(size_t(rows / 16) * sizeof(int)) : 0;
        split_sums_bytes = aligned(size_t(split_tiles * split_tile_floats) * sizeof(float));
        split_counts_bytes = aligned(size_t(split_tiles) * sizeof(int));
        counter_bytes = tile_counter ? aligned(sizeof(int)) : 0;
        size_t const stats_rows = per_accum_row ? size_t(rows) : size_t(tensor_batches(p)) * p.h * p.sq;
        dpsum_bytes = aligned(stats_rows * sizeof(float));
        lse2_bytes = per_accum_row ? dpsum_bytes : 0;
    }

    size_t zeroed_bytes() const {
        return accum_bytes + semaphore_bytes + split_sums_bytes + split_counts_bytes + counter_bytes;
    }

    Workspace sizes() const { return {zeroed_bytes() + dpsum_bytes + lse2_bytes}; }

    // params with the workspace's pointers and strides filled in.
    BwdParams bind(BwdParams params, void* workspace) const {
        char* base = static_cast<char*>(workspace);
        params.dq_accum = reinterpret_cast<float*>(base);
        params.dq_semaphore = params.deterministic ? reinterpret_cast<int*>(base + accum_bytes) : nullptr;
        char* const split = base + accum_bytes + semaphore_bytes;
        params.dkv_sums = split_sums_bytes != 0 ? reinterpret_cast<float*>(split) : nullptr;
        params.dkv_parts_done = split_counts_bytes != 0 ? reinterpret_cast<int*>(split + split_sums_bytes) : nullptr;
        params.tile_counter =
            counter_bytes != 0 ? reinterpret_cast<int*>(split + split_sums_bytes + split_counts_bytes) : nullptr;
        params.dpsum = reinterpret_cast<float*>(base + zeroed_bytes());
        params.lse2 = per_accum_row ? params.dpsum + dpsum_bytes / sizeof(float) : nullptr;
        params.dq_accum_head_stride = rows_per_head;
        params.dq_accum_batch_stride = params.cu_seqlens_q != nullptr ? 0 : params.h * rows_per_head;
        params.dq_zero_words = int64_t(zeroed_bytes() / 16);
        return params;
    }
};

// The descriptor's workspace function of a backward kernel of this head dim.
template <int kHeadDim, bool kStatsPerAccumRow = false>
Workspace bwd_workspace(BwdParams const& params, LaunchHints const&) {
    return BwdWorkspace(params, kHeadDim, kStatsPerAccumRow).sizes();
}

// A query tile's accumulator rows hold kBlockM * kHeadDim floats in the order of the dQ MMA's fragments: thread tid
// of kNThreads owns four consecutive values per group of four of its fragment, so a warp's 16-byte accesses cover
// 512 contiguous bytes. The tier's convert kernel reads the same order.
template <int kNThreads>
__device__ __forceinline__ int dq_workspace_index(int i, int tid) {
    return ((i / 4) * kNThreads + tid) * 4 + i % 4;
}

// Adds a dQ fragment into a query tile's accumulator rows from registers (or any fp32 fragment into a run of sums in
// the same order): each thread adds four consecutive fragment values with one 16-byte vector reduction on sm_90 and
// newer (see dq_workspace_index).
template <int kNThreads, class Frag>
__device__ __forceinline__ void add_dq(float* tile, Frag const& acc, int tid) {
    static_assert(decltype(cute::size(acc))::value % 4 == 0);
    CUTE_UNROLL
    for (int i = 0; i < cute::size(acc); i += 4) {
        float* p = tile + dq_workspace_index<kNThreads>(i, tid);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(acc(i)), "f"(acc(i + 1)),
                     "f"(acc(i + 2)), "f"(acc(i + 3))
                     : "memory");
#else
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) { atomicAdd(p + j, acc(i + j)); }
#endif
    }
}

__device__ __forceinline__ int load_acquire(int const* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// First dQ workspace row of (sequence, head). A varlen sequence starts at its first row plus kBwdRowAlign per earlier
// sequence, rounded down to kBwdRowAlign: aligned, and past the previous sequence's rows rounded up to kBwdRowAlign.
__device__ __forceinline__ int64_t dq_accum_row(BwdParams const& params, SeqlenInfo const& seq, int head) {
    int64_t const start =
        params.cu_seqlens_q == nullptr
            ? 0
            : (int64_t(seq.q.start) + int64_t(seq.batch) * kBwdRowAlign) / kBwdRowAlign * kBwdRowAlign;
    return seq.batch * params.dq_accum_batch_stride + head * params.dq_accum_head_stride + start;
}

}  // namespace flash
