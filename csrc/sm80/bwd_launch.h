// SM80-tier backward launch: the tile table per head dim (by shared memory), the workspace, and the three kernels in
// order: D = rowsum(dO * O) - dlse, the main kernel (dK, dV, and dQ into the fp32 workspace), the dQ conversion.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../common/block_scheduler.h"
#include "../common/bwd_workspace.h"
#include "../common/kernel_registry.h"
#include "../common/kernels/bwd_preprocess.h"
#include "../common/params.h"
#include "bwd_convert_dq.h"
#include "bwd_kernel.h"
#include "launch_util.h"
#include "tile_traits.h"

namespace flash::sm80 {

template <class Traits>
cudaError_t launch_bwd(BwdParams const& params, LaunchHints const& hints, cudaStream_t stream) {
    using Element = typename Traits::Element;
    bool const varlen = params.cu_seqlens_q != nullptr;
    int64_t const rows = int64_t(tensor_batches(params)) * params.sq * params.h;
    constexpr int kPreRows = RowGroup<Traits::kHeadDim>::kRowsPerCta;
    int64_t const pre_blocks = (rows + kPreRows - 1) / kPreRows;
    int64_t const main_blocks = tile_count(params.sk, params.b, Traits::kBlockN, varlen) * params.hk;
    int64_t const convert_blocks = tile_count(params.sq, params.b, Traits::kBlockM, varlen) * params.h;
    if (pre_blocks > INT_MAX || main_blocks > INT_MAX || convert_blocks > INT_MAX) {
        return cudaErrorInvalidConfiguration;
    }

    bwd_preprocess_kernel<Element, Traits::kHeadDim><<<unsigned(pre_blocks), kPreprocessThreads, 0, stream>>>(params);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) { return err; }

    if (cudaError_t err = allow_smem<&bwd_kernel<Traits>>(Traits::kSmemBytes, hints.device); err != cudaSuccess) {
        return err;
    }
    int const section = deterministic_section(params, Traits::kBlockN, hints.num_sms);
    bwd_kernel<Traits><<<unsigned(main_blocks), Traits::kNThreads, Traits::kSmemBytes, stream>>>(params, section);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) { return err; }

    constexpr int kConvertSmem = Traits::kSmemdOElems * int(sizeof(Element));
    if (cudaError_t err = allow_smem<&bwd_convert_dq_kernel<Traits>>(kConvertSmem, hints.device);
        err != cudaSuccess) {
        return err;
    }
    bwd_convert_dq_kernel<Traits><<<unsigned(convert_blocks), Traits::kNThreads, kConvertSmem, stream>>>(params);
    return cudaGetLastError();
}

// Tiles, largest first; the first that fits the device's shared memory runs. Registers bind first: dK and dV stay in
// fp32 registers for the whole kernel. The first tile fits the H100/H200 (227 KB), the last sm86/89/120 (99 KB); the
// A100 (163 KB) takes the first one up to d 192. Measured on an H100 (benchmark/RESULTS.md): for d 64 the 128 x 128
// tile beats the spill-free 64 x 128 one by 15% despite its spills, for d 128 the 64 x 128 tile beats 128 x 64 and
// 64 x 64.
template <int kHeadDim, typename Element>
cudaError_t run_bwd(BwdParams const& params, LaunchHints const& hints, void* workspace, cudaStream_t stream) {
    BwdParams const bound = BwdWorkspace(params, kHeadDim).bind(params, workspace);
    auto launch = [&](auto traits) { return launch_bwd<decltype(traits)>(bound, hints, stream); };
    if constexpr (kHeadDim == 32) {
        // 106 KB, 97 KB
        return launch_first_fitting<
            BwdTraits<32, BwdTile{.block_m = 128, .block_n = 128, .warps = 8, .warps_m_sdp = 4, .warps_n_dkv = 4,
                                  .warps_m_dq = 4, .q_stages = 2}, Element>,
            BwdTraits<32, BwdTile{.block_m = 128, .block_n = 128, .warps = 8, .warps_m_sdp = 4, .warps_n_dkv = 4,
                                  .warps_m_dq = 4, .q_stages = 1}, Element>>(hints, launch);
    } else if constexpr (kHeadDim == 64) {
        // 146 KB, 81 KB
        return launch_first_fitting<
            BwdTraits<64, BwdTile{.block_m = 128, .block_n = 128, .warps = 8, .warps_m_sdp = 4, .warps_n_dkv = 4,
                                  .warps_m_dq = 4, .q_stages = 2}, Element>,
            BwdTraits<64, BwdTile{.block_m = 64, .block_n = 128, .warps = 8, .warps_m_sdp = 2, .warps_n_dkv = 4,
                                  .warps_m_dq = 4, .q_stages = 1}, Element>>(hints, launch);
    } else if constexpr (kHeadDim == 96) {
        // 117 KB, 77 KB
        return launch_first_fitting<
            BwdTraits<96, BwdTile{.block_m = 64, .block_n = 128, .warps = 8, .warps_m_sdp = 2, .warps_n_dkv = 4,
                                  .warps_m_dq = 4, .q_stages = 2}, Element>,
            BwdTraits<96, BwdTile{.block_m = 64, .block_n = 64, .warps = 8, .warps_m_sdp = 2, .warps_n_dkv = 4,
                                  .warps_m_dq = 4, .q_stages = 2}, Element>>(hints, launch);
    } else if constexpr (kHeadDim == 128) {
        // 145 KB, 97 KB
        return launch_first_fitting<
            BwdTraits<128, BwdTile{.block_m = 64, .block_n = 128, .warps = 8, .warps_m_sdp = 2, .warps_n_dkv = 4,
                                  .warps_m_dq = 2, .q_stages = 2}, Element>,
            BwdTraits<128, BwdTile{.block_m = 64, .block_n = 64, .warps = 8, .warps_m_sdp = 4, .warps_n_dkv = 2,
                                  .warps_m_dq = 2, .q_stages = 2}, Element>>(hints, launch);
    } else if constexpr (kHeadDim == 192) {
        // 137 KB, 81 KB
        return launch_first_fitting<
            BwdTraits<192, BwdTile{.block_m = 64, .block_n = 64, .warps = 8, .warps_m_sdp = 4, .warps_n_dkv = 2,
                                  .warps_m_dq = 2, .q_stages = 2}, Element>,
            BwdTraits<192, BwdTile{.block_m = 64, .block_n = 32, .warps = 8, .warps_m_sdp = 4, .warps_n_dkv = 2,
                                  .warps_m_dq = 2, .q_stages = 1}, Element>>(hints, launch);
    } else {
        static_assert(kHeadDim == 256, "no backward tile for this head dim");
        // 177 KB, 145 KB, 85 KB
        return launch_first_fitting<
            BwdTraits<256, BwdTile{.block_m = 64, .block_n = 64, .warps = 8, .warps_m_sdp = 4, .warps_n_dkv = 2,
                                  .warps_m_dq = 2, .q_stages = 2}, Element>,
            BwdTraits<256, BwdTile{.block_m = 64, .block_n = 64, .warps = 8, .warps_m_sdp = 4, .warps_n_dkv = 2,
                                  .warps_m_dq = 2, .q_stages = 1}, Element>,
            BwdTraits<256, BwdTile{.block_m = 32, .block_n = 32, .warps = 4, .warps_m_sdp = 2, .warps_n_dkv = 2,
                                  .warps_m_dq = 2, .q_stages = 2}, Element>>(hints, launch);
    }
}

template <int kHeadDim, typename Element, typename ElementOut>
KernelDescriptor<BwdParams> bwd_descriptor() {
    static_assert(std::is_same_v<Element, ElementOut>, "the SM80 backward writes gradients in the input dtype");
    return {&unsupported_head_dim<kHeadDim, BwdParams>, &bwd_workspace<kHeadDim>, &run_bwd<kHeadDim, Element>};
}

}  // namespace flash::sm80
