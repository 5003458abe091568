// Each generated instantiation registers its launcher here at load time, so the API only lists what was built
// (builds restricted to some head dims or tiers simply register fewer kernels). A direction is its params type:
// one registry and one launcher signature per direction.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "params.h"

namespace flash {

enum class DType { kFloat16, kBFloat16 };

template <class Params>
struct Direction;
template <>
struct Direction<FwdParams> {
    static constexpr char const* kName = "fwd";
};
template <>
struct Direction<BwdParams> {
    static constexpr char const* kName = "bwd";
};

template <class Params>
using Launcher = cudaError_t (*)(Params const&, cudaStream_t);

struct KernelKey {
    int tier;  // 80, 90, 100
    std::string direction;
    int head_dim;
    DType dtype;
};

template <class Params>
struct KernelRegistry {
    struct Entry {
        int tier, head_dim;
        DType dtype;
        Launcher<Params> launch;
    };

    // Function-local, so that registrars in other translation units never run before it exists.
    static std::vector<Entry>& entries() {
        static std::vector<Entry> list;
        return list;
    }

    static Launcher<Params> find(int tier, int head_dim, DType dtype) {
        for (auto const& e : entries()) {
            if (e.tier == tier && e.head_dim == head_dim && e.dtype == dtype) { return e.launch; }
        }
        return nullptr;
    }
};

template <class Params>
struct KernelRegistrar {
    KernelRegistrar(int tier, int head_dim, DType dtype, Launcher<Params> launch) {
        KernelRegistry<Params>::entries().push_back({tier, head_dim, dtype, launch});
    }
};

// Every registered kernel of every direction.
inline std::vector<KernelKey> registered_kernels() {
    std::vector<KernelKey> out;
    auto add = [&out](auto const& entries, char const* direction) {
        for (auto const& e : entries) { out.push_back({e.tier, direction, e.head_dim, e.dtype}); }
    };
    add(KernelRegistry<FwdParams>::entries(), Direction<FwdParams>::kName);
    add(KernelRegistry<BwdParams>::entries(), Direction<BwdParams>::kName);
    return out;
}

}  // namespace flash
