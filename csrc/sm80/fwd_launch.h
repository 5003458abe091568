// SM80-tier launch: tile configuration per head dim (by shared memory, and for d 192 / 256 by query-tile length) and
// the launch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "../common/block_range.h"
#include "../common/block_scheduler.h"
#include "../common/dependent_launch.h"
#include "../common/kernel_registry.h"
#include "../common/params.h"
#include "fwd_kernel.h"
#include "launch_util.h"
#include "tile_traits.h"

namespace flash::sm80 {

// The launch attributes of a grid whose query tiles' splits are clusters (FwdParams, num_splits without o_partial):
// the cluster shape, and the scheduling policy that balances CTAs over the SMs (H100, RESULTS.md: the default
// policy's decode steps were 1.07-1.25x slower than with a combine kernel).
struct ClusterLaunch {
    cudaLaunchAttribute attrs[2]{};

    explicit ClusterLaunch(int splits) {
        attrs[0].id = cudaLaunchAttributeClusterDimension;
        attrs[0].val.clusterDim.x = 1;
        attrs[0].val.clusterDim.y = unsigned(splits);
        attrs[0].val.clusterDim.z = 1;
        attrs[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
        attrs[1].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicyLoadBalancing;
    }
};

template <class Traits>
int64_t fwd_tiles(FwdParams const& params) {
    return tile_count(params.sq, params.b, Traits::kBlockM, params.cu_seqlens_q != nullptr) * params.h;
}

template <class Traits, bool kPaged = false, bool kPackedRows = false>
cudaError_t launch_fwd(FwdParams const& params, LaunchHints const& hints, cudaStream_t stream) {
    constexpr auto kKernel = &fwd_kernel<Traits, kPaged, kPackedRows>;
    constexpr int kSmem = fwd_smem_bytes<Traits, kPaged>();
    if (cudaError_t err = allow_smem<kKernel>(kSmem, hints.device); err != cudaSuccess) { return err; }
    int64_t const num_blocks = fwd_tiles<Traits>(params);
    if (num_blocks > INT_MAX) { return cudaErrorInvalidConfiguration; }
    unsigned const splits = params.num_splits > 1 ? unsigned(params.num_splits) : 1u;
    dim3 const grid(unsigned(num_blocks), splits);
    FwdParams launched = params;
    launched.single_cta_per_sm = num_blocks * splits <= hints.num_sms;
    if constexpr (kPackedRows) {
        if (splits > 1 && params.o_partial == nullptr) {  // a query tile's splits are one cluster
            ClusterLaunch cluster{int(splits)};
            return launch_with<kKernel>(cluster.attrs, 2, grid, dim3(Traits::kNThreads), kSmem, stream, launched);
        }
    }
    kKernel<<<grid, Traits::kNThreads, kSmem, stream>>>(launched);
    return cudaGetLastError();
}

// How many clusters of `splits` CTAs of Kernel the GPU holds at once (0 without sm_90 code, whose cluster merge is
// compiled in): asked once per device and cluster size.
template <auto Kernel>
int active_clusters(int device, int splits, int threads, int smem) {
    static std::atomic<int> known[64][kMaxClusterSplits + 1];  // 0: not asked yet, else 1 + the answer
    if (device < 0 || device >= 64 || splits < 2 || splits > kMaxClusterSplits) { return 0; }
    int state = known[device][splits].load(std::memory_order_relaxed);
    if (state == 0) {
        ClusterLaunch cluster{splits};
        cudaLaunchConfig_t config{};
        config.gridDim = dim3(1, unsigned(splits));
        config.blockDim = dim3(unsigned(threads));
        config.dynamicSmemBytes = size_t(smem);
        config.attrs = cluster.attrs;
        config.numAttrs = 2;
        int clusters = 0;
        bool const asked = runs_sm90_code<Kernel>(device) && allow_smem<Kernel>(smem, device) == cudaSuccess &&
                           cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
                               cudaSuccess &&
                           cudaOccupancyMaxActiveClusters(&clusters, Kernel, &config) == cudaSuccess;
        if (!asked) {
            cudaGetLastError();  // a refused query is an answer, not an error for the next launch
            clusters = 0;
        }
        state = 1 + clusters;
        known[device][splits].store(state, std::memory_order_relaxed);
    }
    return state - 1;
}

// Keys that the query tile of block_m rows in the middle of the longest sequence visits: the mean over the tiles
// under any causal or local window (the visible range moves linearly along the diagonal), with no loop over tiles.
inline int keys_of_middle_tile(FwdParams const& params, LaunchHints const& hints, int block_m) {
    AttnWindow const window{hints.max_seqlen_q, hints.max_seqlen_k, params.window_left, params.window_right};
    int const r0 = std::max(0, hints.max_seqlen_q / 2 - block_m / 2);
    Interval const keys = window.keys_of_rows(r0, std::min(hints.max_seqlen_q, r0 + block_m) - 1);
    return keys.hi - keys.lo;
}

// Large head dims: a 64-row tile when two of its CTAs fit one SM and the query tiles are short (a 128-row tile sees
// up to 2k keys), else the first of Larger..., Small that fits. With two CTAs per SM, one CTA's prologue and
// epilogue overlap the other's key loop; on long tiles the larger tile's fewer K/V reads per query win instead.
template <class Small, class... Larger>
cudaError_t launch_by_tile_length(FwdParams const& params, LaunchHints const& hints, cudaStream_t stream) {
    if (ctas_per_sm(hints, Small::kSmemBytes) >= 2 && keys_of_middle_tile(params, hints, 128) <= 2048) {
        return launch_fwd<Small>(params, hints, stream);
    }
    return launch_first_fitting<Larger..., Small>(hints, [&](auto traits) {
        return launch_fwd<decltype(traits)>(params, hints, stream);
    });
}

// Tile shapes, measured on an H200 (benchmark/RESULTS.md): 32 query rows per warp halve the shared-memory reads per
// MMA, and narrow key blocks with three stages beat wider ones with two, which spill. Up to d = 192 the largest tile
// fits the 99 KB of sm86/89/120.
// Decode-shaped calls (split-KV partials, a paged cache, query tiles of at most 64 rows; and the GQA-packed or
// left-padded calls, which only these kernels take) take one tile per head dim:
// few query rows (GQA-packed) over many keys, so 64-row tiles (16 rows per warp, the least wasted MMA work) and wide
// key blocks, whose loads put the most bytes in flight per CTA (FlashAttention-2's split-KV tile; H100, RESULTS.md).
// Calls of at most 16 (packed) rows, a decode step's, take a 16-row tile whose warps split the keys: a 64-row tile's
// warps would each multiply (and read from shared memory) the whole key block for rows that are mostly padding.
template <int kHeadDim, typename Element, int kRows, int kStages = 1>
using DecodeTraits =
    FwdTraits<kHeadDim,
              FwdTile{.block_m = kRows, .block_n = kHeadDim <= 128 ? 128 : 64, .warps = 4, .kv_stages = kStages,
                      .warps_over_keys = kRows == 16},
              Element>;

// The 16-row tile alone on its SM with a ring of three K/V stages (two key blocks in flight ahead of the one it
// computes), so that one CTA keeps the bytes in flight that its SM's share of HBM needs: the decode kernel of a
// cache whose tiles fill a third of the SMs or more, in one or two chunks (split_count aims there). At head dim 64
// the dense one fits the 99 KB of sm86/89/120 (the paged one, with its table slots, does not). H100 (RESULTS.md,
// session 53): at d 64 in one or two chunks on up to every SM 2-7% faster than three CTAs an SM in 3-6 chunks (no
// cluster merge or a pair's, and no chunks of unequal key blocks); at d 128 in one chunk on at most half the SMs, up
// to 8k keys, 1-3% faster than two one-buffer CTAs (on all the SMs 1% slower); in more chunks, clusters of CTAs that
// each fill an SM do not all fit in the GPCs at once. A paged cache takes it since its lanes' page-table entries land
// with the loads a block ahead (PagedTableSlots; session 54: pages of 16 at d 64 1.05x the dense cache's time, where
// three one-buffer CTAs an SM took 1.11x).
template <int kHeadDim, typename Element>
using RingDecodeTraits = DecodeTraits<kHeadDim, Element, 16, 3>;

template <class Traits, bool kPaged>
bool takes_ring_kernel(FwdParams const& params, LaunchHints const& hints) {
    int const splits = std::max(params.num_splits, 1);
    int64_t const ctas = fwd_tiles<Traits>(params) * splits;
    int const max_ctas = Traits::kHeadDim <= 64 ? hints.num_sms : hints.num_sms / 2;
    return splits <= 2 && ctas <= max_ctas && ctas_per_sm(hints, fwd_smem_bytes<Traits, kPaged>()) >= 1;
}

// f(traits, paged) with the decode kernel that a call takes: its tile by the query rows, paged or not.
template <int kHeadDim, typename Element, class F>
decltype(auto) with_decode_kernel(FwdParams const& params, LaunchHints const& hints, F&& f) {
    auto by_rows = [&](auto paged) {
        if (hints.max_seqlen_q <= 16) {
            if constexpr (kHeadDim <= 128) {
                using Ring = RingDecodeTraits<kHeadDim, Element>;
                if (takes_ring_kernel<Ring, decltype(paged)::value>(params, hints)) { return f(Ring{}, paged); }
            }
            return f(DecodeTraits<kHeadDim, Element, 16>{}, paged);
        }
        return f(DecodeTraits<kHeadDim, Element, 64>{}, paged);
    };
    return params.block_table != nullptr ? by_rows(std::true_type{}) : by_rows(std::false_type{});
}

template <int kHeadDim, typename Element>
cudaError_t run_fwd(FwdParams const& params, LaunchHints const& hints, void*, cudaStream_t stream) {
    if (params.block_table != nullptr || params.num_splits > 1 || params.packed_heads > 1 ||
        params.leftpad_k != nullptr || hints.max_seqlen_q <= 64) {
        return with_decode_kernel<kHeadDim, Element>(params, hints, [&](auto traits, auto paged) {
            return launch_fwd<decltype(traits), decltype(paged)::value, true>(params, hints, stream);
        });
    }
    if constexpr (kHeadDim == 32) {
        return launch_fwd<FwdTraits<32, FwdTile{.block_m = 128, .block_n = 64, .warps = 4, .kv_stages = 3}, Element>>(
            params, hints, stream);
    } else if constexpr (kHeadDim == 64) {
        return launch_fwd<FwdTraits<64, FwdTile{.block_m = 128, .block_n = 64, .warps = 4, .kv_stages = 3}, Element>>(
            params, hints, stream);
    } else if constexpr (kHeadDim == 96) {
        return launch_fwd<FwdTraits<96, FwdTile{.block_m = 128, .block_n = 32, .warps = 4, .kv_stages = 3}, Element>>(
            params, hints, stream);
    } else if constexpr (kHeadDim == 128) {
        return launch_fwd<FwdTraits<128, FwdTile{.block_m = 128, .block_n = 32, .warps = 4, .kv_stages = 3}, Element>>(
            params, hints, stream);
    } else if constexpr (kHeadDim == 192) {
        // 96 KB and 72 KB.
        return launch_by_tile_length<
            FwdTraits<192, FwdTile{.block_m = 64, .block_n = 64, .warps = 4, .kv_stages = 1}, Element>,
            FwdTraits<192, FwdTile{.block_m = 128, .block_n = 64, .warps = 8, .kv_stages = 1}, Element>>(params, hints,
                                                                                                          stream);
    } else {
        static_assert(kHeadDim == 256, "no forward tile for this head dim");
        // 192 KB (H100/H200), 128 KB (A100), 96 KB (sm86/89/120, and the short tiles of the H100/H200).
        return launch_by_tile_length<
            FwdTraits<256, FwdTile{.block_m = 64, .block_n = 64, .warps = 4, .kv_stages = 1}, Element>,
            FwdTraits<256, FwdTile{.block_m = 128, .block_n = 64, .warps = 8, .kv_stages = 2}, Element>,
            FwdTraits<256, FwdTile{.block_m = 128, .block_n = 64, .warps = 8, .kv_stages = 1}, Element>>(params, hints,
                                                                                                          stream);
    }
}

// Splits merged inside clusters run only where every cluster of the grid is resident at once: a second wave of
// clusters (their CTAs placed a GPC at a time) was 1.2x slower than the partials and the combine kernel (H100,
// RESULTS.md).
template <int kHeadDim, typename Element>
char const* unsupported_fwd(FwdParams const& params, LaunchHints const& hints) {
    if (params.num_splits > 1 && params.o_partial == nullptr &&
        !with_decode_kernel<kHeadDim, Element>(params, hints, [&](auto traits, auto paged) {
            using Traits = decltype(traits);
            return active_clusters<&fwd_kernel<Traits, decltype(paged)::value, true>>(
                       hints.device, params.num_splits, Traits::kNThreads,
                       fwd_smem_bytes<Traits, decltype(paged)::value>()) >=
                   fwd_tiles<Traits>(params);
        })) {
        return "splits merged inside clusters need sm_90 code, at most 16 splits, and one wave of clusters";
    }
    return unsupported_head_dim<kHeadDim, FwdParams>(params, hints);
}

template <int kHeadDim, typename Element, typename ElementOut>
KernelDescriptor<FwdParams> fwd_descriptor() {
    static_assert(std::is_same_v<Element, ElementOut>, "the SM80 forward writes out in the input dtype");
    return {&unsupported_fwd<kHeadDim, Element>, &no_workspace<FwdParams>, &run_fwd<kHeadDim, Element>};
}

}  // namespace flash::sm80
