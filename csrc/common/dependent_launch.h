// Kernel launches through cudaLaunchKernelEx: with attributes (launch_with), and by programmatic dependent launch
// (sm_90 and later): a kernel launched by launch_after_prior may be scheduled while the kernel before it on the stream
// still runs, so that its launch and CTA start-up hide behind that kernel's tail in place of following it. Such a
// kernel calls wait_for_prior_grid before its first access to global memory: that returns once the prior grid has
// finished and its writes are visible, so the pair computes what two plain launches do. A prior kernel that calls
// allow_dependent_launch lets the dependent be scheduled as soon as each of its CTAs has made that call, not only
// when they exit.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace flash {

__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether Kernel, as loaded for this device, was compiled for sm_90 or later, where wait_for_prior_grid waits (and
// cluster code is compiled in): code for an older arch (or JIT-compiled from its PTX) has no wait, so it must not
// start early. Asked once per device.
template <auto Kernel>
bool runs_sm90_code(int device) {
    static std::atomic<uint64_t> known{0}, waits{0};
    uint64_t const bit = device < 64 ? uint64_t(1) << device : 0;
    if (bit != 0 && (known.load(std::memory_order_acquire) & bit) != 0) {
        return (waits.load(std::memory_order_relaxed) & bit) != 0;
    }
    cudaFuncAttributes attr{};
    bool const yes = cudaFuncGetAttributes(&attr, Kernel) == cudaSuccess && attr.ptxVersion >= 90 &&
                     attr.binaryVersion >= 90;
    if (yes) { waits.fetch_or(bit, std::memory_order_relaxed); }
    known.fetch_or(bit, std::memory_order_release);
    return yes;
}

// Kernel<<<grid, block, smem, stream>>>(args...) with launch attributes (a cluster shape, programmatic serialization).
template <auto Kernel, class... Args>
cudaError_t launch_with(cudaLaunchAttribute* attrs, unsigned num_attrs, dim3 grid, dim3 block, size_t smem,
                        cudaStream_t stream, Args const&... args) {
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attrs;
    config.numAttrs = num_attrs;
    return cudaLaunchKernelEx(&config, Kernel, args...);
}

// Kernel<<<grid, block, smem, stream>>>(args...), free to start before the prior kernel ends where the kernel waits
// for it (runs_sm90_code).
template <auto Kernel, class... Args>
cudaError_t launch_after_prior(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int device,
                               Args const&... args) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    return launch_with<Kernel>(&attr, runs_sm90_code<Kernel>(device) ? 1 : 0, grid, block, smem, stream, args...);
}

}  // namespace flash
