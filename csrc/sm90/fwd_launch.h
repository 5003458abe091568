// SM90-tier forward launch: TMA descriptors built on the host from the params, the tile per head dim, the launch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "../common/block_scheduler.h"
#include "../common/kernel_registry.h"
#include "../common/params.h"
#include "fwd_kernel.h"
#include "tile_traits.h"

namespace flash::sm90 {

// Whether a paged cache's key blocks of block_n keys straddle pages that TMA boxes of kPageBoxRows rows do not tile
// either: the producer warpgroup copies their rows (load_page_rows).
inline bool copies_page_rows(FwdParams const& params, int block_n) {
    return params.block_table != nullptr && params.page_size % block_n != 0 && params.page_size % kPageBoxRows != 0;
}

// A forward call's query tiles of block_m rows (times its splits, for split-KV partials).
inline int64_t fwd_tile_count(FwdParams const& params, int block_m) {
    return tile_count(params.sq, params.b, block_m, params.cu_seqlens_q != nullptr) * params.h *
           (params.o_partial != nullptr ? params.num_splits : 1);
}

// Whether a call's tiles take a persistent grid fed by a tile counter: causal and local tiles differ in length, so a
// static assignment balances badly (H100, d 128, causal 2k: 410 against 430 TFLOPS with one CTA per tile); taken from
// a counter, each SM's next tile is the next one in the order, as with one CTA per tile, and the producer loads it
// under the current tile's end (H200, causal 2k: +5 to +9% over one CTA per tile at d 64 to 192, equal at 8k;
// RESULTS.md session 67; paged caches read by TMA alike, up to +3% at causal 4k, session 71). Only where the tile has
// it (FwdTile::tile_counter), with more tiles than SMs, not for split-KV partials (decode shapes), and not where the
// producer warpgroup copies page rows (0.3-0.9% slower with it, session 71).
inline bool fwd_takes_tile_counter(FwdTile const& tile, FwdParams const& params, LaunchHints const& hints) {
    bool const masked = params.window_left >= 0 || params.window_right >= 0;
    return tile.tile_counter && masked && params.o_partial == nullptr && !copies_page_rows(params, tile.block_n) &&
           hints.num_sms > 0 && fwd_tile_count(params, tile.block_m) > hints.num_sms;
}

template <class Traits, bool kPaged = false>
cudaError_t launch_fwd(FwdParams const& params, LaunchHints const& hints, void* workspace, cudaStream_t stream) {
    using Element = typename Traits::Element;
    int const entries = tensor_batches(params);
    auto gmem = [&](void const* ptr, int rows, int heads, int64_t row_stride, int64_t head_stride,
                    int64_t batch_stride, int batches) {
        return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), make_shape(rows, params.d, heads, batches),
                           make_stride(row_stride, _1{}, head_stride, batch_stride));
    };
    // K or V as TMA reads it, a key block at a time: (rows, d, kv heads, batches), batches the entries or the pages.
    auto tma_kv = [&](void const* ptr, int rows, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                      int batches) {
        return make_tma_copy(SM90_TMA_LOAD{},
                             gmem(ptr, rows, params.hk, row_stride, head_stride, batch_stride, batches),
                             take<0, 2>(typename Traits::SmemLayoutKV{}),
                             Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{});
    };
    int64_t const num_tiles = fwd_tile_count(params, Traits::kBlockM);
    if (num_tiles > INT_MAX) { return cudaErrorInvalidConfiguration; }
    // Split partials (fp32) leave from registers: their unused output descriptor is built on q, a valid 16-bit
    // tensor of the same shape.
    struct Output {
        void* ptr;
        int64_t row_stride, head_stride, batch_stride;
    };
    Output const o = params.o_partial == nullptr
                         ? Output{params.o, params.o_row_stride, params.o_head_stride, params.o_batch_stride}
                         : Output{const_cast<void*>(params.q), params.q_row_stride, params.q_head_stride,
                                  params.q_batch_stride};
    FwdKernelParams<Traits, kPaged> args{
        params,
        make_tma_copy(SM90_TMA_LOAD{},
                      gmem(params.q, params.sq, params.h, params.q_row_stride, params.q_head_stride,
                           params.q_batch_stride, entries),
                      typename Traits::SmemLayoutQ{}, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, _1{}),
        tma_kv(params.k, params.sk, params.k_row_stride, params.k_head_stride, params.k_batch_stride, entries),
        tma_kv(params.v, params.sk, params.v_row_stride, params.v_head_stride, params.v_batch_stride, entries),
        make_tma_copy(SM90_TMA_STORE{},
                      make_tensor(make_gmem_ptr(static_cast<Element*>(o.ptr)),
                                  make_shape(params.sq, params.d, params.h, entries),
                                  make_stride(o.row_stride, _1{}, o.head_stride, o.batch_stride)),
                      typename Traits::SmemLayoutOSlab{}, Shape<_64, Int<Traits::kHeadDim>>{}, _1{}),
        int(num_tiles),
        1,
        {}};
    if constexpr (kPaged) {  // the pools: k and v's batch stride is their page stride
        args.pages.k = tma_kv(params.k, params.page_size, params.k_row_stride, params.k_head_stride,
                              params.k_batch_stride, params.num_pages);
        args.pages.v = tma_kv(params.v, params.page_size, params.v_row_stride, params.v_head_stride,
                              params.v_batch_stride, params.num_pages);
        // Blocks that straddle pages: TMA boxes of kPageBoxRows rows where the page size is a multiple of that (d 128:
        // two boxes per block, 5-7% over the contiguous cache; rows 7-11%; H100, RESULTS.md), else rows.
        args.pages.rows = copies_page_rows(params, Traits::kBlockN);
        if (params.page_size % Traits::kBlockN != 0 && !args.pages.rows) {
            auto tma_boxes = [&](void const* ptr, int64_t row_stride, int64_t head_stride, int64_t page_stride) {
                return make_tma_copy(SM90_TMA_LOAD{},
                                     gmem(ptr, params.page_size, params.hk, row_stride, head_stride, page_stride,
                                          params.num_pages),
                                     typename Traits::SmemLayoutPageBox{},
                                     Shape<Int<kPageBoxRows>, Int<Traits::kHeadDim>>{}, _1{});
            };
            args.pages.k_box = tma_boxes(params.k, params.k_row_stride, params.k_head_stride, params.k_batch_stride);
            args.pages.v_box = tma_boxes(params.v, params.v_row_stride, params.v_head_stride, params.v_batch_stride);
        }
    }

    constexpr int kSmem = Traits::kSmemBytes;
    if (cudaError_t err = allow_smem<&fwd_kernel<Traits, kPaged>>(kSmem, hints.device); err != cudaSuccess) {
        return err;
    }
    // A persistent grid of one CTA per SM (the shared memory allows no second) overlaps each tile's epilogue and its
    // successor's first loads. Unmasked tiles all cost the same: CTA i takes tiles i, i + grid, ... Causal and local
    // tiles (fwd_takes_tile_counter) take them from a counter, else one CTA per tile.
    // Masked tiles go longest first across L2-sized sections of (batch, head) pairs, so that the last tiles to start
    // are the shortest (FlashAttention-3's and -4's order).
    int grid = int(num_tiles);
    if (params.window_left < 0 && params.window_right < 0) {
        grid = std::min(grid, hints.num_sms);
    } else {
        if (params.cu_seqlens_q == nullptr) {
            // K and V of one kv head, shared by params.h_per_hk consecutive query heads.
            int64_t const kv_bytes = 2 * int64_t(params.sk) * params.d * int64_t(sizeof(Element));
            args.section = section_of(int64_t(hints.l2_bytes) * params.h_per_hk / std::max<int64_t>(kv_bytes, 1),
                                      int64_t(params.b) * params.h);
        }
        if (fwd_takes_tile_counter(Traits::kTile, params, hints)) {
            // The one memset of a forward call: no kernel runs before this one to zero the counter.
            args.tile_counter = static_cast<int*>(workspace);
            if (cudaError_t err = cudaMemsetAsync(workspace, 0, sizeof(int), stream); err != cudaSuccess) {
                return err;
            }
            grid = hints.num_sms;
        }
    }
    if (grid == 0) { return cudaSuccess; }
    fwd_kernel<Traits, kPaged><<<dim3(unsigned(grid)), Traits::kNThreads, kSmem, stream>>>(args);
    return cudaGetLastError();
}

// Tiles. d 64 and 96: three consumer warpgroups (192 query rows), since their GEMMs are short beside the softmax and
// a third warpgroup's GEMMs fill the gaps; d 96 in key blocks of 96, the widest that leaves no spills in 160 registers
// (H200, 2026-11-28: +6 to +10% over 128 x 128 tiles; 192 x 112, 132 B spilled, within 1% of it). d 128: two, key
// blocks of 128 (176, as FlashAttention-3 uses for unmasked tiles, measured 3-8% slower here at 2k, equal at 8k, and
// spills). d 192 and 256: two, the widest key block whose two K and V stages fit beside Q (216 and 224 KB; the output
// stages in V's ring). d 256 takes no tile counter: its consumers have no register to spare, and the counter's
// hand-over spills their loop (ptxas 92/120 B against 36/44), at causal 8k 3.5% slower, at 2k equal (H200).
template <int kHeadDim>
constexpr FwdTile kFwdTile =
    kHeadDim == 256   ? FwdTile{.block_m = 128, .block_n = 80, .kv_stages = 2}
    : kHeadDim == 192 ? FwdTile{.block_m = 128, .block_n = 112, .kv_stages = 2, .tile_counter = true}
    : kHeadDim == 128 ? FwdTile{.block_m = 128, .block_n = 128, .kv_stages = 2, .tile_counter = true}
    : kHeadDim == 96  ? FwdTile{.block_m = 192, .block_n = 96, .kv_stages = 2, .tile_counter = true}
                      : FwdTile{.block_m = 192, .block_n = 128, .kv_stages = 2, .tile_counter = true};

// A paged cache's tile: d 192's and 256's key blocks (112, 80) would straddle pages, so blocks of 64 there (two
// stages fit beside Q), else the dense kernel's (a third K / V stage bought nothing once the producer warpgroup copies
// whole lines: d 128, pages of 16, 64 and 128, equal or up to 3% slower with three; H100, RESULTS.md).
template <int kHeadDim>
constexpr FwdTile kPagedFwdTile =
    kFwdTile<kHeadDim>.block_n % kPageBoxRows == 0
        ? kFwdTile<kHeadDim>
        : FwdTile{.block_m = kFwdTile<kHeadDim>.block_m, .block_n = kPageBoxRows,
                  .kv_stages = kFwdTile<kHeadDim>.kv_stages};

// The workspace: the tile counter of a persistent grid of causal or local tiles (launch_fwd).
template <int kHeadDim>
Workspace fwd_workspace(FwdParams const& params, LaunchHints const& hints) {
    FwdTile const tile = params.block_table != nullptr ? kPagedFwdTile<kHeadDim> : kFwdTile<kHeadDim>;
    return {fwd_takes_tile_counter(tile, params, hints) ? sizeof(int) : 0};
}

// A paged cache's key block arrives whole from its page, or where the page size is no multiple of the block, as
// boxes of kPageBoxRows rows or row by row (mainloop.h).
template <int kHeadDim, typename Element>
cudaError_t run_fwd(FwdParams const& params, LaunchHints const& hints, void* workspace, cudaStream_t stream) {
    static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                  "no SM90 forward tile for this head dim");
    if (params.block_table == nullptr) {
        return launch_fwd<FwdTraits<kHeadDim, kFwdTile<kHeadDim>, Element>>(params, hints, workspace, stream);
    }
    if constexpr (!reads_pages(kHeadDim)) {
        return cudaErrorNotSupported;  // unsupported_fwd gives these paged calls to the SM80 tier
    } else {
        return launch_fwd<FwdTraits<kHeadDim, kPagedFwdTile<kHeadDim>, Element>, true>(params, hints, workspace,
                                                                                        stream);
    }
}

template <int kHeadDim>
char const* unsupported_fwd(FwdParams const& params, LaunchHints const& hints) {
    if (params.packed_heads > 1 || params.leftpad_k != nullptr) {
        return "GQA-packed queries and left padding are taken by the SM80 tier's forward";
    }
    if (params.num_splits > 1 && params.o_partial == nullptr) {
        return "splits merged inside a cluster are taken by the SM80 tier's decode kernels";
    }
    if (params.block_table != nullptr && params.page_size % kPageMultiple != 0) {
        return "pages of a size that is not a multiple of 16 are taken by the SM80 tier's forward";
    }
    if (params.block_table != nullptr && !reads_pages(kHeadDim)) {
        // Python gathers these pages into a contiguous copy or takes the SM80 tier.
        return "paged caches are not read in place at a kernel head dim that is not a multiple of 64";
    }
    return unsupported_head_dim<kHeadDim, FwdParams>(params, hints);
}

template <int kHeadDim, typename Element, typename ElementOut>
KernelDescriptor<FwdParams> fwd_descriptor() {
    static_assert(std::is_same_v<Element, ElementOut>, "the SM90 forward writes out in the input dtype");
    return {&unsupported_fwd<kHeadDim>, &fwd_workspace<kHeadDim>, &run_fwd<kHeadDim, Element>};
}

}  // namespace flash::sm90
