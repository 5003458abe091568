// Launch of flash_attn_with_kvcache's append and rotary kernel (common/kernels/append_kv.h): portable code, so the SM80
// tier registers it and the tiers above take it through their fallback. One instantiation per dtype serves every head
// dim up to 256 (the kernel reads d at run time).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../common/kernel_registry.h"
#include "../common/kernels/append_kv.h"
#include "../common/params.h"

namespace flash::sm80 {

template <int kHeadDim>
char const* unsupported_append(AppendParams const& params, LaunchHints const&) {
    static_assert(kHeadDim <= 32 * 8, "a warp copies 8 dims per lane");
    return params.d <= kHeadDim ? nullptr : "head dim above the kernel's";
}

template <typename Element>
cudaError_t run_append(AppendParams const& params, LaunchHints const&, void*, cudaStream_t stream) {
    int64_t const vectors = (params.k_new != nullptr ? int64_t(params.b) * params.s_new * params.hk : 0) +
                            (params.cos != nullptr ? int64_t(params.b) * params.sq * params.h : 0);
    int64_t const blocks = (vectors + kAppendWarps - 1) / kAppendWarps;
    if (blocks > INT_MAX) { return cudaErrorInvalidConfiguration; }
    if (blocks == 0) { return cudaSuccess; }
    append_kv_kernel<Element><<<unsigned(blocks), kAppendWarps * 32, 0, stream>>>(params);
    return cudaGetLastError();
}

template <int kHeadDim, typename Element, typename ElementOut>
KernelDescriptor<AppendParams> append_descriptor() {
    static_assert(std::is_same_v<Element, ElementOut>, "the append writes the cache's dtype");
    return {&unsupported_append<kHeadDim>, &no_workspace<AppendParams>, &run_append<Element>};
}

}  // namespace flash::sm80
