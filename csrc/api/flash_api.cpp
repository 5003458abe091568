// PyTorch binding: turns validated tensors into FwdParams / BwdParams and calls the registered kernel. The Python layer
// (flash_attention/_checks.py, _ops.py) gives the user-facing errors and picks the kernel head dim; the checks here
// only guard the kernels' preconditions.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <tuple>
#include <vector>

#include "../common/kernel_registry.h"
#include "../common/params.h"

namespace {

// FLASH_ATTN_SMEM_BUDGET (bytes) caps the shared memory a tile may use, so that the smaller tiles chosen on GPUs with
// less shared memory (99 KB on sm86/89/120, 163 KB on the A100) can be tested on an H100/H200.
int smem_budget(int device_optin) {
    char const* env = std::getenv("FLASH_ATTN_SMEM_BUDGET");
    return env != nullptr && *env != '\0' ? std::min(device_optin, std::atoi(env)) : device_optin;
}

char const* dtype_name(flash::DType t) { return t == flash::DType::kFloat16 ? "fp16" : "bf16"; }

void check_operand(at::Tensor const& t, char const* name, at::Tensor const& like) {
    TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "flash_attention: ", name, " must be on q's CUDA device");
    TORCH_CHECK(t.scalar_type() == like.scalar_type(), "flash_attention: ", name, " must have q's dtype");
    TORCH_CHECK(t.dim() == 4, "flash_attention: ", name, " must be 4-D");
    TORCH_CHECK(t.stride(-1) == 1, "flash_attention: ", name, " must be contiguous in the last dimension");
    for (int i = 0; i < t.dim() - 1; ++i) {
        TORCH_CHECK(t.stride(i) % 8 == 0 || t.size(i) == 1, "flash_attention: ", name,
                    " strides must be multiples of 8 elements");
    }
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flash_attention: ", name,
                " must be 16-byte aligned");
}

void check_lse(at::Tensor const& t, char const* name, at::Tensor const& q) {
    TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "flash_attention: ", name, " must be contiguous fp32 on q's device");
    TORCH_CHECK(t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(2) && t.size(2) == q.size(1),
                "flash_attention: ", name, " must be (b, h, sq)");
}

template <class Params>
flash::Launcher<Params> find_launcher(at::Tensor const& q, int64_t kernel_head_dim, int64_t tier) {
    flash::DType const dt = q.scalar_type() == at::kHalf ? flash::DType::kFloat16 : flash::DType::kBFloat16;
    TORCH_CHECK(q.size(3) <= kernel_head_dim, "flash_attention: head dim ", q.size(3), " exceeds kernel head dim ",
                kernel_head_dim);
    auto launcher = flash::KernelRegistry<Params>::find(int(tier), int(kernel_head_dim), dt);
    TORCH_CHECK(launcher != nullptr, "flash_attention: no sm", tier, " ", flash::Direction<Params>::kName,
                " kernel for head dim ", kernel_head_dim, " and ", dtype_name(dt),
                " in this build (see FLASH_ATTN_HEAD_DIMS / FLASH_ATTN_CUDA_ARCHS)");
    return launcher;
}

// The fields both directions share: q, k, v, sizes, scales, window, ALiBi, the device's shared memory.
void set_attn_params(flash::AttnParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                     double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
                     std::optional<at::Tensor> const& alibi_slopes) {
    auto const dtype = q.scalar_type();
    TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "flash_attention: q must be float16 or bfloat16");
    check_operand(q, "q", q);
    check_operand(k, "k", q);
    check_operand(v, "v", q);
    int const b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3);
    int const sk = k.size(1), hk = k.size(2);
    TORCH_CHECK(d % 8 == 0 && d <= 256, "flash_attention: head dim must be a multiple of 8 and at most 256");
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == b && k.size(3) == d, "flash_attention: k/v shape mismatch");
    TORCH_CHECK(hk > 0 && h % hk == 0, "flash_attention: h must be a multiple of hk");
    TORCH_CHECK(b > 0 && sq > 0 && sk > 0, "flash_attention: empty sequences are handled in Python");

    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
    p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
    p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
    p.b = b, p.h = h, p.hk = hk, p.sq = sq, p.sk = sk, p.d = d, p.h_per_hk = h / hk;

    p.softmax_scale = float(softmax_scale);
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
    p.max_smem_per_block = smem_budget(int(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin));
}

template <class Params>
void launch(flash::Launcher<Params> launcher, Params const& p) {
    cudaError_t err = launcher(p, at::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, "flash_attention: kernel launch failed: ", cudaGetErrorString(err));
}

void fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor& out, at::Tensor& lse,
         double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
         std::optional<at::Tensor> const& alibi_slopes, int64_t kernel_head_dim, int64_t tier) {
    c10::cuda::CUDAGuard guard(q.device());
    flash::FwdParams p{};
    set_attn_params(p, q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes);
    check_operand(out, "out", q);
    TORCH_CHECK(out.sizes() == q.sizes(), "flash_attention: out must have q's shape");
    check_lse(lse, "lse", q);
    p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
    launch(find_launcher<flash::FwdParams>(q, kernel_head_dim, tier), p);
}

void bwd(at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
         at::Tensor const& out, at::Tensor const& lse, std::optional<at::Tensor> const& dlse, at::Tensor& dq,
         at::Tensor& dk, at::Tensor& dv, double softmax_scale, int64_t window_left, int64_t window_right,
         double softcap, std::optional<at::Tensor> const& alibi_slopes, bool deterministic, int64_t kernel_head_dim,
         int64_t tier) {
    c10::cuda::CUDAGuard guard(q.device());
    flash::BwdParams p{};
    set_attn_params(p, q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes);
    auto launcher = find_launcher<flash::BwdParams>(q, kernel_head_dim, tier);
    for (auto const& [t, name] : {std::pair{&out, "out"}, {&dout, "dout"}, {&dq, "dq"}}) {
        check_operand(*t, name, q);
        TORCH_CHECK(t->sizes() == q.sizes(), "flash_attention: ", name, " must have q's shape");
    }
    for (auto const& [t, name] : {std::pair{&dk, "dk"}, {&dv, "dv"}}) {
        check_operand(*t, name, q);
        TORCH_CHECK(t->sizes() == k.sizes(), "flash_attention: ", name, " must have k's shape");
    }
    check_lse(lse, "lse", q);
    p.o = out.data_ptr();
    p.dout = dout.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.dlse = nullptr;
    if (dlse.has_value()) {
        check_lse(*dlse, "dlse", q);
        p.dlse = dlse->data_ptr<float>();
    }
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
    p.do_batch_stride = dout.stride(0), p.do_row_stride = dout.stride(1), p.do_head_stride = dout.stride(2);
    p.dq_batch_stride = dq.stride(0), p.dq_row_stride = dq.stride(1), p.dq_head_stride = dq.stride(2);
    p.dk_batch_stride = dk.stride(0), p.dk_row_stride = dk.stride(1), p.dk_head_stride = dk.stride(2);
    p.dv_batch_stride = dv.stride(0), p.dv_row_stride = dv.stride(1), p.dv_head_stride = dv.stride(2);

    // Workspace beside flash-attn's own: the fp32 dQ accumulator (b, h, sq rounded up to 128, kernel head dim), D
    // (b, h, sq) and, when deterministic, one int per (b, h, 16 query rows).
    p.sq_rounded = (p.sq + flash::kBwdRowAlign - 1) / flash::kBwdRowAlign * flash::kBwdRowAlign;
    auto const f32 = q.options().dtype(at::kFloat);
    at::Tensor dq_accum = at::zeros({int64_t(p.b) * p.h * p.sq_rounded * kernel_head_dim}, f32);
    at::Tensor dpsum = at::empty({p.b, p.h, p.sq}, f32);
    at::Tensor semaphore;
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dpsum = dpsum.data_ptr<float>();
    p.dq_semaphore = nullptr;
    p.deterministic = deterministic;
    if (deterministic) {
        semaphore = at::zeros({int64_t(p.b) * p.h * (p.sq_rounded / 16)}, q.options().dtype(at::kInt));
        p.dq_semaphore = semaphore.data_ptr<int>();
    }
    launch(launcher, p);
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
          py::arg("softcap"), py::arg("alibi_slopes"), py::arg("kernel_head_dim"), py::arg("tier"));
    m.def("bwd", &bwd, "Attention backward into preallocated dq, dk, dv", py::arg("dout"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dlse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
          py::arg("softmax_scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
          py::arg("alibi_slopes"), py::arg("deterministic"), py::arg("kernel_head_dim"), py::arg("tier"));
    m.def("available_kernels", &available_kernels, "(tier, direction, head_dim, dtype) of every compiled kernel");
}
