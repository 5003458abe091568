// Host-side helpers shared by the SM80-tier launchers: choosing a tile by shared memory.
#pragma once

#include "../common/kernel_registry.h"

namespace flash::sm80 {

// Calls launch(Traits{}) for the first configuration whose shared memory fits the device (largest tile first).
template <class Traits, class... Fallbacks, class Launch>
cudaError_t launch_first_fitting(LaunchHints const& hints, Launch&& launch) {
    if constexpr (sizeof...(Fallbacks) == 0) {
        return launch(Traits{});
    } else {
        if (hints.max_smem_per_block >= Traits::kSmemBytes) { return launch(Traits{}); }
        return launch_first_fitting<Fallbacks...>(hints, launch);
    }
}

// CTAs of this configuration that fit one SM's shared memory. Every GPU of the tier has 1 KB more per SM than per
// block (the driver reserves 1 KB per resident block), so the per-block budget gives the per-SM one.
inline int ctas_per_sm(LaunchHints const& hints, int smem_bytes) {
    return (hints.max_smem_per_block + 1024) / (smem_bytes + 1024);
}

}  // namespace flash::sm80
