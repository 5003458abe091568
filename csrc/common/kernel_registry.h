// The kernel registry: each generated instantiation (csrc/generate_kernels.py, from flash_attention/_catalog.py)
// registers a descriptor under its key at load time, so the binding finds what was built and asks the kernel, not a
// table of its own, what it supports and what scratch memory it needs. A kind's params type is its launch signature;
// kinds that share one (fwd, later split-KV partials) are told apart by the key.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "params.h"

namespace flash {

enum class DType { kFloat16, kBFloat16 };

struct KernelKey {
    int tier;          // 80, 90, ...: the catalog's tier id
    char const* kind;  // "fwd", "bwd", ...
    int head_dim;      // the kernel's head dim (a call's head dim is at most this)
    DType in, out;

    bool operator==(KernelKey const& o) const {
        return tier == o.tier && head_dim == o.head_dim && in == o.in && out == o.out && std::strcmp(kind, o.kind) == 0;
    }
};

// What the host knows of the device and the call that only the choice and launch of a kernel need; kernels never read
// it. max_seqlen: the longest sequences (a varlen call's hint, else the rows).
struct LaunchHints {
    int device;
    int max_smem_per_block;  // opt-in shared memory per block (FLASH_ATTN_SMEM_BUDGET may lower it)
    int num_sms;
    int l2_bytes;
    int max_seqlen_q, max_seqlen_k;
};

// Scratch memory a kernel needs beside its operands, in one allocation (uninitialised: a kernel that needs zeros
// writes them itself, so that a call launches no memset of its own; the one exception is the SM90 forward's tile
// counter, which no earlier kernel of the call could zero).
struct Workspace {
    size_t bytes = 0;
};

template <class Params>
struct KernelDescriptor {
    // nullptr when the kernel can run these params, else why not.
    char const* (*unsupported)(Params const&, LaunchHints const&);
    Workspace (*workspace)(Params const&, LaunchHints const&);
    // workspace: workspace(params, hints).bytes bytes, 256-byte aligned.
    cudaError_t (*launch)(Params const&, LaunchHints const&, void* workspace, cudaStream_t);
};

template <class Params>
Workspace no_workspace(Params const&, LaunchHints const&) {
    return {};
}

// The check every kernel makes: the operands' head dim fits its tile and its 16-byte loads.
template <int kHeadDim, class Params>
char const* unsupported_head_dim(Params const& params, LaunchHints const&) {
    return params.d % 8 == 0 && params.d <= kHeadDim ? nullptr : "head dim not a multiple of 8 or above the kernel's";
}

// Every registered key, of every kind; function-local so that registrars in other translation units never run before
// it exists.
inline std::vector<KernelKey>& registered_kernels() {
    static std::vector<KernelKey> keys;
    return keys;
}

template <class Params>
struct KernelRegistry {
    struct Entry {
        KernelKey key;
        KernelDescriptor<Params> descriptor;
    };

    static std::vector<Entry>& entries() {
        static std::vector<Entry> list;
        return list;
    }

    static KernelDescriptor<Params> const* find(KernelKey const& key) {
        for (auto const& e : entries()) {
            if (e.key == key) { return &e.descriptor; }
        }
        return nullptr;
    }
};

template <class Params>
struct KernelRegistrar {
    KernelRegistrar(KernelKey key, KernelDescriptor<Params> descriptor) {
        KernelRegistry<Params>::entries().push_back({key, descriptor});
        registered_kernels().push_back(key);
    }
};

// Dynamic shared memory above 48 KB must be opted into per kernel and device; done once for each.
template <auto Kernel>
cudaError_t allow_smem(int bytes, int device) {
    static std::atomic<uint64_t> done{0};
    uint64_t const bit = device < 64 ? uint64_t(1) << device : 0;
    if (bytes <= 48 * 1024 || (done.load(std::memory_order_relaxed) & bit) != 0) { return cudaSuccess; }
    cudaError_t const err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err == cudaSuccess) { done.fetch_or(bit, std::memory_order_relaxed); }
    return err;
}

}  // namespace flash
