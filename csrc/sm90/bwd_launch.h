// SM90-tier backward launch: the tile per head dim, the workspace (the SM80 tier's rows, in this tier's fragment
// order, with the row statistics per accumulator row), TMA descriptors built on the host, and the three kernels in
// order: D and lse2 per query tile, the main kernel (dK, dV, and dQ into the fp32 workspace), the dQ conversion.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "../common/block_scheduler.h"
#include "../common/bwd_workspace.h"
#include "../common/dependent_launch.h"
#include "../common/kernel_registry.h"
#include "../common/kernels/bwd_preprocess.h"
#include "../common/params.h"
#include "bwd_convert_dq.h"
#include "bwd_kernel.h"
#include "tile_traits.h"

namespace flash::sm90 {

// Host: the WaveTail of a call's tiles of block_n keys and block_m-row query blocks (one CTA per SM: the kernels'
// shared memory and registers allow no second). Split are only calls without a mask whose tiles are all alike (not
// varlen, no seqused) outside deterministic mode, whose dQ order is one CTA per tile. The parts: the count that
// minimises the tail's waves times a part's steps plus its fixed cost in steps (K and V arriving, the epilogue and
// the sums). Measured on an H100 (2026-11-27) against whole tiles: d 64 (4 tiles past 31 waves, 16 parts) +2..+4% at
// 2k-16k; d 128 (68 tiles past 15 waves) +0.5% at 2k (3 parts) and +1.6% at 4k (5 parts) with the fixed cost at
// d / 32 steps, where two steps chose 3 parts at 4k and lost 1-2%; the GQA shape (b 4, 4k, h 32, hk 8) +1.2%.
inline WaveTail wave_tail(BwdParams const& params, int num_sms, int block_m, int block_n, int fixed_steps) {
    bool const alike = !params.deterministic && params.window_left < 0 && params.window_right < 0 &&
                       params.cu_seqlens_q == nullptr && params.seqused_q == nullptr && params.seqused_k == nullptr;
    int64_t const tiles = tile_count(params.sk, params.b, block_n, false) * params.hk;
    int64_t const last_wave = num_sms > 0 ? tiles % num_sms : 0;
    int64_t const steps = int64_t((params.sq + block_m - 1) / block_m) * params.h_per_hk;
    if (!alike || last_wave == 0 || steps < 2) { return {}; }
    constexpr int64_t kMaxParts = 16;
    int64_t best_parts = 1, best_cost = steps + fixed_steps;
    for (int64_t parts = 2; parts <= std::min(kMaxParts, steps); ++parts) {
        int64_t const cost = (last_wave * parts + num_sms - 1) / num_sms * ((steps + parts - 1) / parts + fixed_steps);
        if (cost < best_cost) {
            best_parts = parts;
            best_cost = cost;
        }
    }
    return best_parts == 1 ? WaveTail{} : WaveTail{int(tiles - last_wave), int(best_parts), int(last_wave)};
}

template <class Traits>
cudaError_t launch_bwd(BwdParams const& params, LaunchHints const& hints, WaveTail tail, cudaStream_t stream) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    bool const varlen = params.cu_seqlens_q != nullptr;
    int const entries = tensor_batches(params);
    // kKeyPair: clusters of two CTAs, one per key block of a 2 * kBlockN tile.
    constexpr int kPairSize = Traits::kKeyPair ? 2 : 1;
    int64_t const tiles = tile_count(params.sk, params.b, kPairSize * kBlockN, varlen) * params.hk * kPairSize;
    int64_t const main_blocks = tiles + int64_t(tail.tiles) * (tail.parts - 1);
    int64_t const convert_blocks = tile_count(params.sq, params.b, kBlockM, varlen) * params.h;
    if (main_blocks > INT_MAX || convert_blocks > INT_MAX) {
        return cudaErrorInvalidConfiguration;
    }
    if constexpr (Traits::kPersistent) {
        // kKVStages 2: a persistent kernel, one CTA per SM, each walking tiles, where a tile's fixed cost (K and V
        // arriving, the dK / dV store) is a large part of it: a persistent CTA loads the next tile's K and V under
        // the current tile and leaves the store to its store warp. Measured at d 64 on an H100 (2026-11-27) against
        // one CTA per tile, non-causal / causal: 2k (16 steps of 128 query rows a tile) +3.1% / +5.9%, 4k +3.6% /
        // +6.1%, 8k causal +3.9%; 16k -1.7% / -1.8%. Deterministic calls keep one CTA per tile, whose launch order is
        // the dQ order. Other calls take Traits::OneTile, whose single K/V buffer leaves more of the SM's memory to
        // L1 (the second buffer cost the one-tile kernel 1-3%).
        int64_t const steps = int64_t((params.sq + kBlockM - 1) / kBlockM) * params.h_per_hk;
        bool const masked = params.window_left >= 0 || params.window_right >= 0;
        if (params.deterministic || hints.num_sms <= 0 || main_blocks <= hints.num_sms ||
            steps > (masked ? 64 : 32)) {
            return launch_bwd<typename Traits::OneTile>(params, hints, tail, stream);
        }
    }

    bwd_preprocess_tiles_kernel<Element, kBlockM, kHeadDim>
        <<<unsigned(convert_blocks), kPreprocessThreads, 0, stream>>>(params);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) { return err; }

    auto gmem = [&](void const* ptr, int rows_, int heads, int64_t row_stride, int64_t head_stride,
                    int64_t batch_stride) {
        return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), make_shape(rows_, params.d, heads, entries),
                           make_stride(row_stride, _1{}, head_stride, batch_stride));
    };
    auto tma_rows = [&](auto const& g, auto smem_layout, auto tile) {
        return make_tma_copy(SM90_TMA_LOAD{}, g, smem_layout, tile, _1{});
    };
    // dK / dV: (sk, d, hk, entries), stored by key block.
    auto tma_store_rows = [&](void* ptr, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                              auto smem_layout) {
        Tensor g = make_tensor(make_gmem_ptr(static_cast<Element*>(ptr)),
                               make_shape(params.sk, params.d, params.hk, entries),
                               make_stride(row_stride, _1{}, head_stride, batch_stride));
        return make_tma_copy(SM90_TMA_STORE{}, g, smem_layout, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
    };
    BwdKernelParams<Traits> args{
        params,
        tma_rows(gmem(params.q, params.sq, params.h, params.q_row_stride, params.q_head_stride, params.q_batch_stride),
                 take<0, 2>(typename Traits::SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}),
        tma_rows(gmem(params.dout, params.sq, params.h, params.do_row_stride, params.do_head_stride,
                      params.do_batch_stride),
                 take<0, 2>(typename Traits::SmemLayoutdO{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}),
        tma_rows(gmem(params.k, params.sk, params.hk, params.k_row_stride, params.k_head_stride, params.k_batch_stride),
                 typename Traits::SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}),
        tma_rows(gmem(params.v, params.sk, params.hk, params.v_row_stride, params.v_head_stride, params.v_batch_stride),
                 typename Traits::SmemLayoutV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}),
        tma_store_rows(params.dk, params.dk_row_stride, params.dk_head_stride, params.dk_batch_stride,
                       typename Traits::SmemLayoutK{}),
        tma_store_rows(params.dv, params.dv_row_stride, params.dv_head_stride, params.dv_batch_stride,
                       typename Traits::SmemLayoutV{})};
    args.tail = tail;
    args.blocks = int(main_blocks);
    if constexpr (Traits::kKeyPair) {
        args.tma_k_half = tma_rows(
            gmem(params.k, params.sk, params.hk, params.k_row_stride, params.k_head_stride, params.k_batch_stride),
            typename Traits::SmemLayoutKHalf{}, Shape<Int<kBlockN>, Int<Traits::kPeerKCols>>{});
    }

    // Deterministic calls take deterministic_section's order. Otherwise causal key blocks differ in length: longest
    // first across sections of (batch, kv head) pairs, so that the last CTAs to start are the shortest, each section
    // as many pairs as fit in half the L2 with a query head's Q, dO and fp32 dQ accumulator (a CTA walks its group's
    // heads one after another). Sized by Q and dO in all of it, the d 64 2k section (64 pairs) read 2.4x the
    // non-causal call's bytes from DRAM (ncu: L2 hits 60% against 90%) and ran 8% slower; counting every head of a
    // GQA group, that shape's section (1 pair) ran 6.5% slower than 4 (H100, 2026-11-26).
    if (params.deterministic) {
        args.section = deterministic_section(params, kBlockN, hints.num_sms);
    } else if (params.window_right >= 0 && !varlen) {
        int64_t const head_bytes =
            int64_t(params.sq) * params.d * (2 * int64_t(sizeof(Element)) + int64_t(sizeof(float)));
        args.section = section_of(hints.l2_bytes / 2 / std::max<int64_t>(head_bytes, 1), int64_t(params.b) * params.hk);
    }
    constexpr int kSmem = Traits::kSmemBytes;
    if (cudaError_t err = allow_smem<&bwd_kernel<Traits>>(kSmem, hints.device); err != cudaSuccess) { return err; }
    if constexpr (Traits::kKeyPair) {
        cudaLaunchAttribute pair{};
        pair.id = cudaLaunchAttributeClusterDimension;
        pair.val.clusterDim.x = 2;
        pair.val.clusterDim.y = 1;
        pair.val.clusterDim.z = 1;
        if (cudaError_t err = launch_with<&bwd_kernel<Traits>>(&pair, 1, unsigned(main_blocks), Traits::kNThreads, kSmem,
                                                               stream, args);
            err != cudaSuccess) {
            return err;
        }
    } else {
        // Traits::kPersistent: one CTA per SM walking the tiles (see the choice above).
        unsigned const grid = Traits::kPersistent ? unsigned(hints.num_sms) : unsigned(main_blocks);
        bwd_kernel<Traits><<<grid, Traits::kNThreads, kSmem, stream>>>(args);
        if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) { return err; }
    }

    // The workspace's order does not depend on key pairs: one conversion kernel per tile.
    using ConvertTraits = BwdTraits<kHeadDim,
                                    BwdTile{.block_m = kBlockM, .block_n = kBlockN, .q_stages = Traits::kQStages,
                                            .do_stages = Traits::kdOStages},
                                    Element>;
    bwd_convert_dq_kernel<ConvertTraits><<<unsigned(convert_blocks), Traits::kConsumerThreads, 0, stream>>>(params);
    return cudaGetLastError();
}

// Tiles: 128 keys (64 per consumer warpgroup) by query blocks of 64 rows, or 128 at head dim 64 without softcap
// (whose tanh derivative needs S^T and dP^T in registers together, which 128 rows do not leave room for: see
// BwdTraits::kdPAfterP); Q and dO double-buffered. Accumulators per consumer thread: dK + dV kHeadDim, S^T and dP^T
// block_m / 2 each, dQ block_m * kHeadDim / 256 (d 96: 184 in all, and dQ's 48-column halves read K in 32-byte atoms;
// on an H100 1.65-1.78x the SM80 tier, RESULTS.md session 62). Head dims 192 and 256 (BwdTraits::kSplitHeadDim): 64
// keys shared by both warpgroups; at 256 dK + dV 128 and S^T + dP^T 64 registers, dQ in two slices of 32 registers,
// and 208 KB of shared memory with Q double-buffered and dO single; at 192, dQ in two slices of 24 registers (48
// columns), and dO double-buffered too. Outside deterministic mode both come in key pairs (run_bwd).
template <int kHeadDim, bool kSoftcap>
constexpr BwdTile kBwdTile = bwd_splits_head_dim(kHeadDim)
    ? BwdTile{.block_m = 64, .block_n = 64, .q_stages = 2, .do_stages = kHeadDim == 256 ? 1 : 2}
    : BwdTile{.block_m = kHeadDim == 64 && !kSoftcap ? 128 : 64, .block_n = 128, .q_stages = 2, .do_stages = 2,
              .kv_stages = kHeadDim == 64 ? 2 : 1};

// The call's WaveTail. Split head dims (192, 256; key pairs, clusters of two) are not split. A part's fixed
// cost grows with the head dim: two steps at 64.
template <int kHeadDim>
WaveTail bwd_wave_tail(BwdParams const& params, LaunchHints const& hints) {
    if constexpr (bwd_splits_head_dim(kHeadDim)) {
        return {};
    } else {
        constexpr BwdTile kTile = kBwdTile<kHeadDim, false>, kSoftcapTile = kBwdTile<kHeadDim, true>;
        BwdTile const& tile = params.has_softcap ? kSoftcapTile : kTile;
        return wave_tail(params, hints.num_sms, tile.block_m, tile.block_n, kHeadDim / 32);
    }
}

// The workspace, with the sums of the split tiles' dK and dV (the tile's keys by the head dim, twice), and the tile
// counter of a persistent kernel.
template <int kHeadDim>
BwdWorkspace bwd_workspace_layout(BwdParams const& params, WaveTail const& tail) {
    constexpr int kBlockN = kBwdTile<kHeadDim, false>.block_n;
    static_assert(kBwdTile<kHeadDim, true>.block_n == kBlockN &&
                  kBwdTile<kHeadDim, true>.kv_stages == kBwdTile<kHeadDim, false>.kv_stages);
    return BwdWorkspace(params, kHeadDim, true, tail.tiles, 2 * int64_t(kBlockN) * kHeadDim,
                        kBwdTile<kHeadDim, false>.kv_stages > 1);
}

template <int kHeadDim>
Workspace bwd_workspace_sm90(BwdParams const& params, LaunchHints const& hints) {
    return bwd_workspace_layout<kHeadDim>(params, bwd_wave_tail<kHeadDim>(params, hints)).sizes();
}

template <int kHeadDim, typename Element>
cudaError_t run_bwd(BwdParams const& params, LaunchHints const& hints, void* workspace, cudaStream_t stream) {
    static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                  "no SM90 backward tile for this head dim");
    WaveTail const tail = bwd_wave_tail<kHeadDim>(params, hints);
    BwdParams const bound = bwd_workspace_layout<kHeadDim>(params, tail).bind(params, workspace);
    if constexpr (bwd_splits_head_dim(kHeadDim)) {
        // Key pairs add dQ from registers in no fixed order: the deterministic mode keeps the lone key block.
        if (!params.deterministic) {
            constexpr BwdTile kPairTile{.block_m = 64, .block_n = 64, .q_stages = 2,
                                        .do_stages = kBwdTile<kHeadDim, false>.do_stages, .key_pair = true};
            return launch_bwd<BwdTraits<kHeadDim, kPairTile, Element>>(bound, hints, tail, stream);
        }
    }
    if constexpr (kBwdTile<kHeadDim, true>.block_m != kBwdTile<kHeadDim, false>.block_m) {
        if (params.has_softcap) {
            return launch_bwd<BwdTraits<kHeadDim, kBwdTile<kHeadDim, true>, Element>>(bound, hints, tail, stream);
        }
    }
    return launch_bwd<BwdTraits<kHeadDim, kBwdTile<kHeadDim, false>, Element>>(bound, hints, tail, stream);
}

template <int kHeadDim, typename Element, typename ElementOut>
KernelDescriptor<BwdParams> bwd_descriptor() {
    static_assert(std::is_same_v<Element, ElementOut>, "the SM90 backward writes gradients in the input dtype");
    return {&unsupported_head_dim<kHeadDim, BwdParams>, &bwd_workspace_sm90<kHeadDim>, &run_bwd<kHeadDim, Element>};
}

}  // namespace flash::sm90
