// Host-side helpers shared by the SM80-tier launchers: choosing a tile by shared memory, and the opt-in limit.
#pragma once

#include <cuda_runtime.h>

#include "../common/params.h"

namespace flash::sm80 {

// Calls launch(Traits{}) for the first configuration whose shared memory fits the device (largest tile first).
template <class Traits, class... Fallbacks, class Launch>
cudaError_t launch_first_fitting(AttnParams const& params, Launch&& launch) {
    if constexpr (sizeof...(Fallbacks) == 0) {
        return launch(Traits{});
    } else {
        if (params.max_smem_per_block >= Traits::kSmemBytes) { return launch(Traits{}); }
        return launch_first_fitting<Fallbacks...>(params, launch);
    }
}

// CTAs of this configuration that fit one SM's shared memory. Every GPU of the tier has 1 KB more per SM than per
// block (the driver reserves 1 KB per resident block), so the per-block budget gives the per-SM one.
template <class Traits>
int ctas_per_sm(AttnParams const& params) {
    return (params.max_smem_per_block + 1024) / (Traits::kSmemBytes + 1024);
}

// Dynamic shared memory above 48 KB must be opted into per kernel.
template <class Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
    return bytes > 48 * 1024 ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)
                             : cudaSuccess;
}

}  // namespace flash::sm80
