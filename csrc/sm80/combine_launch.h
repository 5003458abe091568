// Launch of the split-KV combine (common/kernels/fwd_combine.h): portable code, so the SM80 tier registers it and the
// tiers above take it through their fallback.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../common/dependent_launch.h"
#include "../common/kernel_registry.h"
#include "../common/kernels/fwd_combine.h"
#include "../common/params.h"

namespace flash::sm80 {

template <int kHeadDim, typename Element>
cudaError_t run_combine(CombineParams const& params, LaunchHints const& hints, void*, cudaStream_t stream) {
    constexpr int kRowsPerBlock = kCombineWarps * (32 / (kHeadDim / 8));
    int64_t const blocks = (int64_t(params.b) * params.rows * params.h + kRowsPerBlock - 1) / kRowsPerBlock;
    if (blocks > INT_MAX) { return cudaErrorInvalidConfiguration; }
    if (blocks == 0) { return cudaSuccess; }
    unsigned const threads = kCombineWarps * 32;
    if (params.fp32_partials) {
        return launch_after_prior<&fwd_combine_kernel<float, Element, kHeadDim>>(unsigned(blocks), threads, 0, stream,
                                                                                 hints.device, params);
    }
    return launch_after_prior<&fwd_combine_kernel<Element, Element, kHeadDim>>(unsigned(blocks), threads, 0, stream,
                                                                               hints.device, params);
}

template <int kHeadDim, typename Element, typename ElementOut>
KernelDescriptor<CombineParams> combine_descriptor() {
    static_assert(std::is_same_v<Element, ElementOut>, "the combine writes the partials' dtype");
    return {&unsupported_head_dim<kHeadDim, CombineParams>, &no_workspace<CombineParams>,
            &run_combine<kHeadDim, Element>};
}

}  // namespace flash::sm80
