// Launch of the paged cache's gather into contiguous copies (common/kernels/gather_pages.h): portable code, so the
// SM80 tier registers it and the tiers above take it through their fallback. One instantiation per dtype serves every
// head dim up to 256 (the kernel reads d at run time).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "../common/kernel_registry.h"
#include "../common/kernels/gather_pages.h"
#include "../common/params.h"

namespace flash::sm80 {

template <int kHeadDim>
char const* unsupported_gather(GatherParams const& params, LaunchHints const&) {
    return params.d <= kHeadDim ? nullptr : "head dim above the kernel's";
}

template <typename Element>
cudaError_t run_gather(GatherParams const& params, LaunchHints const&, void*, cudaStream_t stream) {
    // About four rounds of every thread's vectors per CTA (64 KB of K or V), in whole rows.
    GatherParams p = params;
    int const per_row = p.hk * (p.d * int(sizeof(Element)) / 16);
    p.rows_per_cta = std::clamp(4 * kGatherThreads * kGatherVectors / std::max(per_row, 1), 1, kGatherMaxRows);
    int64_t const rows = int64_t(p.b) * p.cache_len;
    int64_t const ctas = (rows + p.rows_per_cta - 1) / p.rows_per_cta;
    if (ctas > INT_MAX || int64_t(p.rows_per_cta) * per_row > INT_MAX) { return cudaErrorInvalidConfiguration; }
    if (ctas == 0) { return cudaSuccess; }
    gather_pages_kernel<Element><<<dim3(unsigned(ctas), 2), kGatherThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

template <int kHeadDim, typename Element, typename ElementOut>
KernelDescriptor<GatherParams> gather_descriptor() {
    static_assert(std::is_same_v<Element, ElementOut>, "the gather copies the cache's dtype");
    return {&unsupported_gather<kHeadDim>, &no_workspace<GatherParams>, &run_gather<Element>};
}

}  // namespace flash::sm80
