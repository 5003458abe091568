// PyTorch binding: turns validated tensors into FwdParams and calls the registered kernel. The Python layer
// (flash_attention/_checks.py) gives the user-facing errors; the checks here only guard the kernel's preconditions.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <tuple>
#include <vector>

#include "../common/fwd_params.h"
#include "../common/kernel_registry.h"

namespace {

constexpr int kKernelHeadDims[] = {32, 64, 96, 128, 192, 256};

int kernel_head_dim(int d) {
    for (int hd : kKernelHeadDims) {
        if (d <= hd) { return hd; }
    }
    TORCH_CHECK(false, "flash_attention: head dim ", d, " exceeds 256");
}

// FLASH_ATTN_SMEM_BUDGET (bytes) caps the shared memory a tile may use, so that the smaller tiles chosen on GPUs with
// less shared memory (99 KB on sm86/89/120, 163 KB on the A100) can be tested on an H100/H200.
int smem_budget(int device_optin) {
    char const* env = std::getenv("FLASH_ATTN_SMEM_BUDGET");
    return env != nullptr && *env != '\0' ? std::min(device_optin, std::atoi(env)) : device_optin;
}

char const* dtype_name(flash::DType t) { return t == flash::DType::kFloat16 ? "fp16" : "bf16"; }

void check_strides(at::Tensor const& t, char const* name) {
    TORCH_CHECK(t.stride(-1) == 1, "flash_attention: ", name, " must be contiguous in the last dimension");
    for (int i = 0; i < t.dim() - 1; ++i) {
        TORCH_CHECK(t.stride(i) % 8 == 0 || t.size(i) == 1, "flash_attention: ", name,
                    " strides must be multiples of 8 elements");
    }
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flash_attention: ", name,
                " must be 16-byte aligned");
}

void fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor& out, at::Tensor& lse,
         double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
         std::optional<at::Tensor> const& alibi_slopes, int64_t tier) {
    TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && out.is_cuda() && lse.is_cuda(),
                "flash_attention: tensors must be on a CUDA device");
    auto const dtype = q.scalar_type();
    TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "flash_attention: q must be float16 or bfloat16");
    TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && out.scalar_type() == dtype,
                "flash_attention: q, k, v and out must share a dtype");
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous(), "flash_attention: lse must be contiguous fp32");
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && out.dim() == 4, "flash_attention: expected 4-D q/k/v");
    int const b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3);
    int const sk = k.size(1), hk = k.size(2);
    TORCH_CHECK(d % 8 == 0 && d <= 256, "flash_attention: head dim must be a multiple of 8 and at most 256");
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == b && k.size(3) == d, "flash_attention: k/v shape mismatch");
    TORCH_CHECK(out.sizes() == q.sizes(), "flash_attention: out must have q's shape");
    TORCH_CHECK(lse.size(0) == b && lse.size(1) == h && lse.size(2) == sq, "flash_attention: lse must be (b, h, sq)");
    TORCH_CHECK(hk > 0 && h % hk == 0, "flash_attention: h must be a multiple of hk");
    TORCH_CHECK(b > 0 && sq > 0 && sk > 0, "flash_attention: empty sequences are handled in Python");
    check_strides(q, "q");
    check_strides(k, "k");
    check_strides(v, "v");
    check_strides(out, "out");

    flash::DType const dt = dtype == at::kHalf ? flash::DType::kFloat16 : flash::DType::kBFloat16;
    int const hd = kernel_head_dim(d);
    flash::FwdLauncher launcher = flash::find_fwd_kernel(int(tier), hd, dt);
    TORCH_CHECK(launcher != nullptr, "flash_attention: no sm", tier, " forward kernel for head dim ", hd, " and ",
                dtype_name(dt), " in this build (see FLASH_ATTN_HEAD_DIMS / FLASH_ATTN_CUDA_ARCHS)");

    flash::FwdParams p{};
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
    p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
    p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
    p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
    p.b = b, p.h = h, p.hk = hk, p.sq = sq, p.sk = sk, p.d = d, p.h_per_hk = h / hk;

    p.has_softcap = softcap > 0.0;
    p.softcap_pre = p.has_softcap ? float(softmax_scale / softcap) : 1.f;
    p.logit_scale = p.has_softcap ? float(softcap) : float(softmax_scale);
    p.scale_log2 = float(double(p.logit_scale) * M_LOG2E);
    p.window_left = int(window_left);
    p.window_right = int(window_right);

    p.alibi_slopes = nullptr;
    p.alibi_batch_stride = 0;
    if (alibi_slopes.has_value()) {
        auto const& a = *alibi_slopes;
        TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kFloat && a.is_contiguous(),
                    "flash_attention: alibi_slopes must be a contiguous fp32 CUDA tensor");
        TORCH_CHECK((a.dim() == 1 && a.size(0) == h) || (a.dim() == 2 && a.size(0) == b && a.size(1) == h),
                    "flash_attention: alibi_slopes must be (h,) or (b, h)");
        p.alibi_slopes = a.data_ptr<float>();
        p.alibi_batch_stride = a.dim() == 2 ? h : 0;
    }

    c10::cuda::CUDAGuard guard(q.device());
    p.max_smem_per_block = smem_budget(int(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin));
    cudaError_t err = launcher(p, at::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, "flash_attention: kernel launch failed: ", cudaGetErrorString(err));
}

std::vector<std::tuple<int64_t, std::string, int64_t, std::string>> available_kernels() {
    std::vector<std::tuple<int64_t, std::string, int64_t, std::string>> out;
    for (auto const& e : flash::registered_kernels()) {
        out.emplace_back(e.tier, e.direction, e.head_dim, dtype_name(e.dtype));
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "flash-attention-cute kernels";
    m.def("fwd", &fwd, "Attention forward into preallocated out and lse", py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("out"), py::arg("lse"), py::arg("softmax_scale"), py::arg("window_left"), py::arg("window_right"),
          py::arg("softcap"), py::arg("alibi_slopes"), py::arg("tier"));
    m.def("available_kernels", &available_kernels, "(tier, direction, head_dim, dtype) of every compiled kernel");
}
