// SM90-tier forward kernel: a CTA of one producer warpgroup (one thread issues every TMA, or for a paged cache whose
// blocks straddle pages, all 128 copy rows; setmaxnreg gives its other registers to the consumers) and kBlockM / 64
// consumer warpgroups (wgmma, softmax, epilogue) computes kBlockM x d output tiles. CTA i takes tiles i, i + gridDim.x,
// ... in the order of decode_tile (query blocks last-first, so causal tiles come longest first); with a persistent grid
// its producer loads the next tile's Q, K and V while the consumers finish the current one. With split-KV partials,
// each query tile's keys are cut into params.num_splits chunks, tiles of their own whose fp32 outputs the combine
// kernel merges. The roles' code is in mainloop.h and epilogue.h.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/block_range.h"
#include "../common/block_scheduler.h"
#include "../common/params.h"
#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "epilogue.h"
#include "mainloop.h"
#include "pipeline.h"
#include "tile_traits.h"

namespace flash::sm90 {

using namespace cute;

// kPaged: K and V come from a paged cache (params.block_table), a kernel of its own so that the others skip the
// page lookups.
template <class Traits, bool kPaged = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_kernel(__grid_constant__ FwdKernelParams<Traits, kPaged> const args) {
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    FwdParams const& params = args.p;

    extern __shared__ __align__(1024) char smem_buf[];
    auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
    int const tid = threadIdx.x;

    bool page_rows = false;
    if constexpr (kPaged) { page_rows = args.pages.rows; }
    if (tid == 0) {
        cutlass::arch::ClusterTransactionBarrier::init(&shared.q_full, 1);
        cutlass::arch::ClusterBarrier::init(&shared.q_empty, Traits::kConsumerThreads / 32);
        cutlass::arch::ClusterBarrier::init(&shared.o_free, Traits::kConsumerWarpGroups);
        cutlass::arch::ClusterBarrier::init(&shared.tile_full, 1);
        cutlass::arch::ClusterBarrier::init(&shared.tile_empty, Traits::kConsumerThreads / 32);
        // Rows copied by the producer warpgroup complete a stage with one arrival per thread, TMA with one.
        int const producer_arrivals = page_rows ? 128 : 1;
        shared.k_ring.init(Traits::kConsumerThreads / 32, producer_arrivals);
        shared.v_ring.init(Traits::kConsumerThreads / 32, producer_arrivals);
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();

    // Every lane of a warp decodes (varlen decoding is a warp scan). An invalid tile (a varlen grid's spare, or a
    // batched tile past seqused_q) is skipped by the producer and the consumers alike.
    // Split-KV (params.o_partial): tile idx is chunk idx % num_splits of query tile idx / num_splits, so that a
    // query tile's chunks run side by side.
    struct Tile {
        TileCoord blk;
        SeqlenInfo seq;
        AttnWindow window;
        Interval n_range;
        int split;
    };
    auto tile_at = [&](int idx) {
        int const splits = params.o_partial != nullptr ? params.num_splits : 1;
        int const split = idx % splits;
        TileCoord const blk = decode_tile<kBlockM>(idx / splits, params.cu_seqlens_q, params.seqused_q, params.sq,
                                                   params.b, params.h, true, args.section);
        SeqlenInfo const seq(params, blk.batch);
        AttnWindow const window = seq.window(params);
        Interval const n_range = BlockRange<kBlockM, kBlockN>::n_blocks(window, blk.block);
        return Tile{blk, seq, window, splits > 1 ? split_chunk(n_range, split, splits) : n_range, split};
    };
    PipelineState<Traits::kStages> state;
    // CTA i takes tiles i, i + gridDim.x, ... or, with args.tile_counter (causal and local tiles, which differ in
    // length), tile i and then whichever the counter hands out next: the producer takes each next index once it has
    // issued the current tile's loads and passes it to the consumers through shared memory (tile_full / tile_empty).
    // racecheck reports each consumer read and the producer's next write as a hazard: it does so for a minimal correct
    // mbarrier hand-over too (benchmark/racecheck/handover.cu), and reports nothing else in this kernel.
    // Never with page rows (launch_fwd): only producer warp 0 takes part in the hand-over.
    bool const dynamic = Traits::kTile.tile_counter && args.tile_counter != nullptr;

    if (tid < 128) {
        cutlass::arch::warpgroup_reg_dealloc<kPaged ? Traits::kPagedProducerRegisters : Traits::kProducerRegisters>();
        if constexpr (kPaged) {
            if (page_rows) {
                for (int idx = blockIdx.x; idx < args.num_tiles; idx += gridDim.x) {
                    Tile const t = tile_at(idx);
                    if (t.blk.valid && !t.n_range.empty()) {
                        load_page_rows<Traits>(args, shared, t.seq, t.blk, t.n_range, state, tid);
                    }
                }
                return;
            }
        }
        if (tid < 32) {
            bool const leader = cute::elect_one_sync();
            uint32_t phase = 0;
            auto hand_over = [&](int idx) {
                if (dynamic && leader) {
                    cutlass::arch::ClusterBarrier::wait(&shared.tile_empty, phase ^ 1);
                    shared.next_tile = idx;
                    cutlass::arch::ClusterBarrier::arrive(&shared.tile_full);
                }
                phase ^= 1;
            };
            hand_over(blockIdx.x);
            for (int idx = blockIdx.x; idx < args.num_tiles;) {
                Tile const t = tile_at(idx);
                if (leader && t.blk.valid && !t.n_range.empty()) {
                    load<Traits, kPaged>(args, shared, t.seq, t.blk, t.n_range, state);
                }
                // Taken once the current tile's loads are issued: the index is not live across them (it spilled).
                int next = idx + gridDim.x;
                if (dynamic) {
                    if (tid == 0) { next = int(gridDim.x) + atomicAdd(args.tile_counter, 1); }
                    next = __shfl_sync(0xffffffffu, next, 0);
                }
                hand_over(next);
                idx = next;
            }
        }
        return;
    }

    cutlass::arch::warpgroup_reg_alloc<kPaged ? Traits::kPagedConsumerRegisters : Traits::kConsumerRegisters>();
    int const ctid = tid - 128;
    GemmTurns<Traits::kConsumerWarpGroups, Traits::kPingPong> const turns{ctid / 128};
    turns.init();
    typename Traits::TiledMmaO mma_o;
    uint32_t tile_phase = 0;
    auto tile_after = [&](int idx) {  // the CTA's next tile, after idx
        if (!dynamic) { return idx + int(gridDim.x); }
        cutlass::arch::ClusterBarrier::wait(&shared.tile_full, tile_phase);
        tile_phase ^= 1;
        int const next = shared.next_tile;
        __syncwarp();
        if (cute::elect_one_sync()) { cutlass::arch::ClusterBarrier::arrive(&shared.tile_empty); }
        return next;
    };
    for (int idx = tile_after(int(blockIdx.x) - int(gridDim.x)); idx < args.num_tiles; idx = tile_after(idx)) {
        Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        clear(acc_o);
        auto acc_o_rc = rowcol_view(acc_o);
        constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
        OnlineSoftmax<kRows> softmax;
        softmax.init();
        {
            Tile const t = tile_at(idx);
            if (!t.blk.valid) { continue; }
            if (!t.n_range.empty()) {
                float const slope =
                    params.alibi_slopes == nullptr ? 0.f : alibi_slope(params, t.blk.batch, t.blk.head);
                consume<Traits>(params, shared, t.window, t.blk.block, t.n_range, slope, ctid, state, turns,
                                page_rows, acc_o, softmax);
            }
        }
        float lse[kRows];
        softmax.finalize(acc_o_rc, params.logit_scale, lse);
        // Decoded again for the epilogue: kept live across the key loop, the tile's coordinates spilled (d 256).
        Tile const t = tile_at(reread(idx));
        // A tile without keys loaded nothing, so the producer does not wait for its output buffer: it stores from
        // registers, as do split-KV partials (fp32, few valid rows).
        bool const via_tma = params.cu_seqlens_q == nullptr && params.seqused_q == nullptr && !t.n_range.empty() &&
                             params.o_partial == nullptr;
        if (params.o_partial != nullptr) {
            store_partial<Traits>(mma_o, acc_o, lse, params, t.seq, t.blk.block, t.blk.head, t.split, ctid);
        } else {
            store_output<Traits>(args.tma_o, shared, acc_o, lse, params, t.seq, t.blk.block, t.blk.head, ctid,
                                 via_tma);
        }
        if constexpr (Traits::kOAliasesV) {
            if (!via_tma && !t.n_range.empty() && ctid % 128 == 0) {
                cutlass::arch::ClusterBarrier::arrive(&shared.o_free);
            }
        }
    }
    // The shared memory must outlive the stores' reads of it.
    if (ctid % 128 == 0) { tma_store_wait<0>(); }
}

}  // namespace flash::sm90
