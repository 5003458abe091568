// Each generated instantiation registers its launcher here at load time, so the API only lists what was built
// (builds restricted to some head dims or tiers simply register fewer kernels).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "fwd_params.h"

namespace flash {

enum class DType { kFloat16, kBFloat16 };

using FwdLauncher = cudaError_t (*)(FwdParams const&, cudaStream_t);

struct KernelEntry {
    int tier;        // 80, 90, 100
    std::string direction;
    int head_dim;
    DType dtype;
    FwdLauncher fwd;
};

void register_kernel(KernelEntry entry);
std::vector<KernelEntry> const& registered_kernels();
FwdLauncher find_fwd_kernel(int tier, int head_dim, DType dtype);

struct KernelRegistrar {
    explicit KernelRegistrar(KernelEntry entry) { register_kernel(std::move(entry)); }
};

}  // namespace flash
