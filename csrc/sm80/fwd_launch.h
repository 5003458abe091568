// SM80-tier launch: tile configuration per head dim (the first that fits the device's shared memory) and the launch.
#pragma once

#include <cuda_runtime.h>

#include <climits>

#include "../common/fwd_params.h"
#include "fwd_kernel.h"
#include "tile_traits.h"

namespace flash::sm80 {

template <class Traits>
cudaError_t launch_fwd(FwdParams const& params, cudaStream_t stream) {
    auto kernel = &fwd_kernel<Traits>;
    constexpr int kSmem = Traits::kSmemBytes;
    if constexpr (kSmem > 48 * 1024) {
        cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
        if (err != cudaSuccess) { return err; }
    }
    int64_t const num_m_blocks = (params.sq + Traits::kBlockM - 1) / Traits::kBlockM;
    int64_t const num_blocks = num_m_blocks * params.h * params.b;
    if (num_blocks > INT_MAX) { return cudaErrorInvalidConfiguration; }
    kernel<<<dim3(unsigned(num_blocks)), Traits::kNThreads, kSmem, stream>>>(params);
    return cudaGetLastError();
}

// Launches the first configuration whose shared memory fits the device (largest tile first).
template <class Traits, class... Fallbacks>
cudaError_t launch_first_fitting(FwdParams const& params, cudaStream_t stream) {
    if constexpr (sizeof...(Fallbacks) == 0) {
        return launch_fwd<Traits>(params, stream);
    } else {
        if (params.max_smem_per_block >= Traits::kSmemBytes) { return launch_fwd<Traits>(params, stream); }
        return launch_first_fitting<Fallbacks...>(params, stream);
    }
}

// Tile shapes (kBlockM, kBlockN, warps, K/V stages), measured on an H200 (benchmark/RESULTS.md): 32 query rows per
// warp halve the shared-memory reads per MMA, and narrow key blocks with three stages beat wider ones with two, which
// spill. Up to d = 128 one configuration fits the 99 KB of sm86/89/120; larger head dims fall back to smaller tiles.
template <int kHeadDim, typename Element>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream) {
    if constexpr (kHeadDim == 32) {
        return launch_fwd<FwdTraits<32, 128, 64, 4, 3, Element>>(params, stream);
    } else if constexpr (kHeadDim == 64) {
        return launch_fwd<FwdTraits<64, 128, 64, 4, 3, Element>>(params, stream);
    } else if constexpr (kHeadDim == 96) {
        return launch_fwd<FwdTraits<96, 128, 32, 4, 3, Element>>(params, stream);
    } else if constexpr (kHeadDim == 128) {
        return launch_fwd<FwdTraits<128, 128, 32, 4, 3, Element, /*kBranchingLoads=*/true>>(params, stream);
    } else if constexpr (kHeadDim == 192) {
        return launch_first_fitting<FwdTraits<192, 128, 64, 8, 2, Element>, FwdTraits<192, 64, 32, 4, 2, Element>>(
            params, stream);
    } else {
        static_assert(kHeadDim == 256, "kernel head dims are 32, 64, 96, 128, 192, 256");
        return launch_first_fitting<FwdTraits<256, 128, 64, 8, 2, Element>, FwdTraits<256, 128, 32, 8, 2, Element>,
                                    FwdTraits<256, 64, 32, 4, 2, Element>>(params, stream);
    }
}

}  // namespace flash::sm80
