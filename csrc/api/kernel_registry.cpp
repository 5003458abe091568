#include "../common/kernel_registry.h"

namespace flash {

namespace {
// Function-local so that registrars in other translation units never run before it exists.
std::vector<KernelEntry>& registry() {
    static std::vector<KernelEntry> entries;
    return entries;
}
}  // namespace

void register_kernel(KernelEntry entry) { registry().push_back(std::move(entry)); }

std::vector<KernelEntry> const& registered_kernels() { return registry(); }

FwdLauncher find_fwd_kernel(int tier, int head_dim, DType dtype) {
    for (auto const& e : registry()) {
        if (e.tier == tier && e.direction == "fwd" && e.head_dim == head_dim && e.dtype == dtype) { return e.fwd; }
    }
    return nullptr;
}

}  // namespace flash
