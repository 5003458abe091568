// SM90-tier synchronisation: rings of shared-memory stages that TMA fills (mbarriers), and the named barriers of the
// consumer warpgroups (their common barrier, and the turns in which they issue GEMMs).
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>
#include <type_traits>

namespace flash::sm90 {

// A position in a ring of kStages buffers: the stage, and the parity of the pass over the ring.
template <int kStages>
struct RingState {
    int index = 0;
    uint32_t phase = 0;

    __device__ __forceinline__ void advance() {
        if (++index == kStages) {
            index = 0;
            phase ^= 1;
        }
    }
};

// kStages buffers filled by TMA: a stage's `full` barrier completes when its bytes have landed, its `empty` barrier
// when every consumer warp has released it. Lives in shared memory.
template <int kStages>
struct TmaRing {
    uint64_t full[kStages];
    uint64_t empty[kStages];

    __device__ __forceinline__ void init(int consumer_warps, int producer_arrivals = 1) {
        for (int s = 0; s < kStages; ++s) {
            cutlass::arch::ClusterTransactionBarrier::init(&full[s], producer_arrivals);
            cutlass::arch::ClusterBarrier::init(&empty[s], consumer_warps);
        }
    }

    // Producer: waits until the stage is free (the first pass finds every stage free), announces the bytes its TMA
    // will bring, and returns the barrier that the TMA completes.
    __device__ __forceinline__ uint64_t& acquire(RingState<kStages> const& s, int bytes) {
        wait_free(s);
        return announce(s, bytes);
    }
    // acquire in two halves, for a producer that writes into the stage between them.
    __device__ __forceinline__ void wait_free(RingState<kStages> const& s) {
        cutlass::arch::ClusterBarrier::wait(&empty[s.index], s.phase ^ 1);
    }
    __device__ __forceinline__ uint64_t& announce(RingState<kStages> const& s, int bytes) {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full[s.index], bytes);
        return full[s.index];
    }

    __device__ __forceinline__ void wait(RingState<kStages> const& s) {
        cutlass::arch::ClusterTransactionBarrier::wait(&full[s.index], s.phase);
    }

    // Consumer warp: its reads of the stage are complete.
    __device__ __forceinline__ void release(RingState<kStages> const& s) {
        if (cute::elect_one_sync()) { cutlass::arch::ClusterBarrier::arrive(&empty[s.index]); }
    }

    // The same for a warp whose lanes also read the stage with plain loads: the warp barrier orders every lane's
    // loads before the one lane's arrival (wgmma reads need none: the warpgroup's wait completes them).
    __device__ __forceinline__ void release_after_loads(RingState<kStages> const& s) {
        __syncwarp();
        release(s);
    }
};

// Named barrier ids (after CUTLASS's reserved ones): the consumers', one GEMM turn and one epilogue barrier per
// consumer warpgroup (at most 3). The producer warpgroup never takes part.
enum class NamedBarrierId : uint32_t { kConsumers = 0, kGemmTurn0 = 1, kEpilogue0 = 4 };
// The backward's: the consumers' (as above), per consumer warpgroup the two sides of its dQ staging buffer with the
// store warp (full: the warpgroup wrote it; empty: the store warp's reduction has read it), per K/V stage the
// consumers' hand-over of a tile's end to the store warp, and the split tiles' (WaveTail) exchange of the last part's
// turn with the store warp.
enum class BwdBarrierId : uint32_t { kConsumers = 0, kDqFull0 = 1, kDqEmpty0 = 3, kKeyGradients0 = 5, kSplitTile = 7 };

template <int kConsumerThreads>
__device__ __forceinline__ void sync_consumers() {
    cutlass::arch::NamedBarrier::arrive_and_wait(kConsumerThreads, uint32_t(NamedBarrierId::kConsumers));
}

// Zeroes rows [rows_left, rows) of a (rows, head dim) shared tile: rows that hold another sequence's data or, past
// seqused, anything (0 * NaN is NaN). The kThreads consumer threads (tid among them) share the work; the caller
// fences and synchronises.
template <int kThreads, class SmemTile>
__device__ __forceinline__ void zero_tail_rows(SmemTile&& s, int rows_left, int tid) {
    constexpr int kRows = decltype(cute::size<0>(s))::value, kCols = decltype(cute::size<1>(s))::value;
    using Element = typename std::decay_t<SmemTile>::value_type;
    for (int idx = max(rows_left, 0) * kCols + tid; idx < kRows * kCols; idx += kThreads) {
        s(idx / kCols, idx % kCols) = Element(0);
    }
}

__device__ __forceinline__ void sync_warpgroup(int wg) {
    cutlass::arch::NamedBarrier::arrive_and_wait(128, uint32_t(NamedBarrierId::kEpilogue0) + wg);
}

// Consumer warpgroups issue their GEMMs in turn, round-robin: each waits for its turn, issues, and passes the turn on,
// so that the tensor cores run one warpgroup's GEMMs while the other computes its softmax. Warpgroup 0 starts.
template <int kWarpGroups, bool kEnabled>
struct GemmTurns {
    int wg;

    __device__ __forceinline__ uint32_t barrier(int w) const { return uint32_t(NamedBarrierId::kGemmTurn0) + w; }

    __device__ __forceinline__ void init() const {
        if constexpr (kEnabled) {
            if (wg == kWarpGroups - 1) { cutlass::arch::NamedBarrier::arrive(2 * 128, barrier(0)); }
        }
    }
    __device__ __forceinline__ void wait() const {
        if constexpr (kEnabled) { cutlass::arch::NamedBarrier::arrive_and_wait(2 * 128, barrier(wg)); }
    }
    __device__ __forceinline__ void pass() const {
        if constexpr (kEnabled) {
            cutlass::arch::NamedBarrier::arrive(2 * 128, barrier(wg + 1 == kWarpGroups ? 0 : wg + 1));
        }
    }
};

}  // namespace flash::sm90
