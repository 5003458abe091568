// PyTorch binding: turns validated tensors into FwdParams / BwdParams and calls the registered kernel. The Python layer
// (flash_attention/_checks.py, _ops.py) gives the user-facing errors and picks the kernel head dim; the checks here
// only guard the kernels' preconditions. Batched tensors are (b, s, heads, d); with cu_seqlens they are varlen,
// packed (total, heads, d), with lse (h, total_q).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <climits>
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

// The optional varlen arguments of both directions.
struct SeqArgs {
    std::optional<at::Tensor> const& cu_seqlens_q;
    std::optional<at::Tensor> const& cu_seqlens_k;
    std::optional<at::Tensor> const& seqused_q;
    std::optional<at::Tensor> const& seqused_k;
    int64_t max_seqlen_q, max_seqlen_k;

    bool varlen() const { return cu_seqlens_q.has_value(); }
    int rank() const { return varlen() ? 3 : 4; }
};

void check_operand(at::Tensor const& t, char const* name, at::Tensor const& like, int rank) {
    TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "flash_attention: ", name, " must be on q's CUDA device");
    TORCH_CHECK(t.scalar_type() == like.scalar_type(), "flash_attention: ", name, " must have q's dtype");
    TORCH_CHECK(t.dim() == rank, "flash_attention: ", name, " must be ", rank, "-D");
    TORCH_CHECK(t.stride(-1) == 1, "flash_attention: ", name, " must be contiguous in the last dimension");
    for (int i = 0; i < t.dim() - 1; ++i) {
        TORCH_CHECK(t.stride(i) % 8 == 0 || t.size(i) == 1, "flash_attention: ", name,
                    " strides must be multiples of 8 elements");
    }
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flash_attention: ", name,
                " must be 16-byte aligned");
}

// (batch, row, head) strides of an operand; a varlen operand has no batch dimension.
struct Strides {
    int64_t batch, row, head;
};

Strides strides_of(at::Tensor const& t, bool varlen) {
    return varlen ? Strides{0, t.stride(0), t.stride(1)} : Strides{t.stride(0), t.stride(1), t.stride(2)};
}

void check_lse(at::Tensor const& t, char const* name, flash::AttnParams const& p, at::Tensor const& q, bool varlen) {
    TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "flash_attention: ", name, " must be contiguous fp32 on q's device");
    if (varlen) {
        TORCH_CHECK(t.dim() == 2 && t.size(0) == p.h && t.size(1) == p.sq, "flash_attention: ", name,
                    " must be (h, total_q)");
    } else {
        TORCH_CHECK(t.dim() == 3 && t.size(0) == p.b && t.size(1) == p.h && t.size(2) == p.sq, "flash_attention: ",
                    name, " must be (b, h, sq)");
    }
}

int const* seq_tensor(std::optional<at::Tensor> const& t, char const* name, int64_t size, at::Tensor const& q) {
    if (!t.has_value()) { return nullptr; }
    TORCH_CHECK(t->is_cuda() && t->device() == q.device() && t->scalar_type() == at::kInt && t->dim() == 1 &&
                    t->is_contiguous() && t->size(0) == size,
                "flash_attention: ", name, " must be a contiguous int32 CUDA tensor of ", size, " elements on q's device");
    return t->data_ptr<int>();
}

template <class Params>
flash::Launcher<Params> find_launcher(at::Tensor const& q, int64_t kernel_head_dim, int64_t tier) {
    flash::DType const dt = q.scalar_type() == at::kHalf ? flash::DType::kFloat16 : flash::DType::kBFloat16;
    TORCH_CHECK(q.size(-1) <= kernel_head_dim, "flash_attention: head dim ", q.size(-1), " exceeds kernel head dim ",
                kernel_head_dim);
    auto launcher = flash::KernelRegistry<Params>::find(int(tier), int(kernel_head_dim), dt);
    TORCH_CHECK(launcher != nullptr, "flash_attention: no sm", tier, " ", flash::Direction<Params>::kName,
                " kernel for head dim ", kernel_head_dim, " and ", dtype_name(dt),
                " in this build (see FLASH_ATTN_HEAD_DIMS / FLASH_ATTN_CUDA_ARCHS)");
    return launcher;
}

// The fields both directions share: q, k, v, sequences, sizes, scales, window, ALiBi, the tile-choice hints.
void set_attn_params(flash::AttnParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                     double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
                     std::optional<at::Tensor> const& alibi_slopes, SeqArgs const& seqs) {
    auto const dtype = q.scalar_type();
    TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "flash_attention: q must be float16 or bfloat16");
    bool const varlen = seqs.varlen();
    TORCH_CHECK(varlen == seqs.cu_seqlens_k.has_value(),
                "flash_attention: cu_seqlens_q and cu_seqlens_k must be given together");
    check_operand(q, "q", q, seqs.rank());
    check_operand(k, "k", q, seqs.rank());
    check_operand(v, "v", q, seqs.rank());
    int const r = varlen ? 0 : 1;  // the row dimension
    int64_t const b = varlen ? seqs.cu_seqlens_q->size(0) - 1 : q.size(0);
    int64_t const sq = q.size(r), h = q.size(r + 1), d = q.size(r + 2);
    int64_t const sk = k.size(r), hk = k.size(r + 1);
    TORCH_CHECK(d % 8 == 0 && d <= 256, "flash_attention: head dim must be a multiple of 8 and at most 256");
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(r + 2) == d && (varlen || k.size(0) == b),
                "flash_attention: k/v shape mismatch");
    TORCH_CHECK(hk > 0 && h % hk == 0, "flash_attention: h must be a multiple of hk");
    TORCH_CHECK(b > 0 && sq > 0 && sk > 0, "flash_attention: empty sequences are handled in Python");
    TORCH_CHECK(sq <= INT_MAX && sk <= INT_MAX && b <= INT_MAX, "flash_attention: too many rows");

    p.cu_seqlens_q = seq_tensor(seqs.cu_seqlens_q, "cu_seqlens_q", b + 1, q);
    p.cu_seqlens_k = seq_tensor(seqs.cu_seqlens_k, "cu_seqlens_k", b + 1, q);
    p.seqused_q = seq_tensor(seqs.seqused_q, "seqused_q", b, q);
    p.seqused_k = seq_tensor(seqs.seqused_k, "seqused_k", b, q);
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    Strides const qs = strides_of(q, varlen), ks = strides_of(k, varlen), vs = strides_of(v, varlen);
    p.q_batch_stride = qs.batch, p.q_row_stride = qs.row, p.q_head_stride = qs.head;
    p.k_batch_stride = ks.batch, p.k_row_stride = ks.row, p.k_head_stride = ks.head;
    p.v_batch_stride = vs.batch, p.v_row_stride = vs.row, p.v_head_stride = vs.head;
    p.b = int(b), p.h = int(h), p.hk = int(hk), p.sq = int(sq), p.sk = int(sk), p.d = int(d), p.h_per_hk = int(h / hk);
    p.lse_batch_stride = varlen ? 0 : h * sq;
    p.lse_head_stride = sq;
    // A varlen call's max_seqlen only steers the tile choice, so a wrong one costs speed, never correctness.
    auto hint = [](int64_t max_seqlen, int64_t rows) { return int(max_seqlen > 0 ? std::min(max_seqlen, rows) : rows); };
    p.max_seqlen_q = varlen ? hint(seqs.max_seqlen_q, sq) : int(sq);
    p.max_seqlen_k = varlen ? hint(seqs.max_seqlen_k, sk) : int(sk);

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
         std::optional<at::Tensor> const& alibi_slopes, int64_t kernel_head_dim, int64_t tier,
         std::optional<at::Tensor> const& cu_seqlens_q, std::optional<at::Tensor> const& cu_seqlens_k,
         std::optional<at::Tensor> const& seqused_q, std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q,
         int64_t max_seqlen_k) {
    c10::cuda::CUDAGuard guard(q.device());
    SeqArgs const seqs{cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k};
    flash::FwdParams p{};
    set_attn_params(p, q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, seqs);
    check_operand(out, "out", q, seqs.rank());
    TORCH_CHECK(out.sizes() == q.sizes(), "flash_attention: out must have q's shape");
    check_lse(lse, "lse", p, q, seqs.varlen());
    p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    Strides const os = strides_of(out, seqs.varlen());
    p.o_batch_stride = os.batch, p.o_row_stride = os.row, p.o_head_stride = os.head;
    launch(find_launcher<flash::FwdParams>(q, kernel_head_dim, tier), p);
}

void bwd(at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
         at::Tensor const& out, at::Tensor const& lse, std::optional<at::Tensor> const& dlse, at::Tensor& dq,
         at::Tensor& dk, at::Tensor& dv, double softmax_scale, int64_t window_left, int64_t window_right,
         double softcap, std::optional<at::Tensor> const& alibi_slopes, bool deterministic, int64_t kernel_head_dim,
         int64_t tier, std::optional<at::Tensor> const& cu_seqlens_q, std::optional<at::Tensor> const& cu_seqlens_k,
         std::optional<at::Tensor> const& seqused_q, std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q,
         int64_t max_seqlen_k) {
    c10::cuda::CUDAGuard guard(q.device());
    SeqArgs const seqs{cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k};
    bool const varlen = seqs.varlen();
    flash::BwdParams p{};
    set_attn_params(p, q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, seqs);
    auto launcher = find_launcher<flash::BwdParams>(q, kernel_head_dim, tier);
    for (auto const& [t, name] : {std::pair{&out, "out"}, {&dout, "dout"}, {&dq, "dq"}}) {
        check_operand(*t, name, q, seqs.rank());
        TORCH_CHECK(t->sizes() == q.sizes(), "flash_attention: ", name, " must have q's shape");
    }
    for (auto const& [t, name] : {std::pair{&dk, "dk"}, {&dv, "dv"}}) {
        check_operand(*t, name, q, seqs.rank());
        TORCH_CHECK(t->sizes() == k.sizes(), "flash_attention: ", name, " must have k's shape");
    }
    check_lse(lse, "lse", p, q, varlen);
    p.o = out.data_ptr();
    p.dout = dout.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.dlse = nullptr;
    if (dlse.has_value()) {
        check_lse(*dlse, "dlse", p, q, varlen);
        p.dlse = dlse->data_ptr<float>();
    }
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    Strides const os = strides_of(out, varlen), dos = strides_of(dout, varlen), dqs = strides_of(dq, varlen);
    Strides const dks = strides_of(dk, varlen), dvs = strides_of(dv, varlen);
    p.o_batch_stride = os.batch, p.o_row_stride = os.row, p.o_head_stride = os.head;
    p.do_batch_stride = dos.batch, p.do_row_stride = dos.row, p.do_head_stride = dos.head;
    p.dq_batch_stride = dqs.batch, p.dq_row_stride = dqs.row, p.dq_head_stride = dqs.head;
    p.dk_batch_stride = dks.batch, p.dk_row_stride = dks.row, p.dk_head_stride = dks.head;
    p.dv_batch_stride = dvs.batch, p.dv_row_stride = dvs.row, p.dv_head_stride = dvs.head;

    // Workspace beside flash-attn's own: the fp32 dQ accumulator (rows x kernel head dim), D (like lse) and, when
    // deterministic, one int per 16 accumulator rows. Batched: sq rounded up to 128 rows per (b, h). Varlen: per head,
    // total_q plus 128 rows per sequence (see dq_accum_row), rounded up to 128.
    constexpr int64_t kAlign = flash::kBwdRowAlign;
    auto round_up = [&](int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; };
    int64_t const rows_per_head = varlen ? round_up(int64_t(p.sq) + kAlign * (p.b + 1)) : round_up(p.sq);
    int64_t const rows = int64_t(varlen ? 1 : p.b) * p.h * rows_per_head;
    p.dq_accum_head_stride = rows_per_head;
    p.dq_accum_batch_stride = varlen ? 0 : p.h * rows_per_head;
    auto const f32 = q.options().dtype(at::kFloat);
    at::Tensor dq_accum = at::zeros({rows * kernel_head_dim}, f32);
    at::Tensor dpsum = at::empty(lse.sizes(), f32);
    at::Tensor semaphore;
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dpsum = dpsum.data_ptr<float>();
    p.dq_semaphore = nullptr;
    p.deterministic = deterministic;
    if (deterministic) {
        semaphore = at::zeros({rows / 16}, q.options().dtype(at::kInt));
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
          py::arg("softcap"), py::arg("alibi_slopes"), py::arg("kernel_head_dim"), py::arg("tier"),
          py::arg("cu_seqlens_q") = py::none(), py::arg("cu_seqlens_k") = py::none(), py::arg("seqused_q") = py::none(),
          py::arg("seqused_k") = py::none(), py::arg("max_seqlen_q") = 0, py::arg("max_seqlen_k") = 0);
    m.def("bwd", &bwd, "Attention backward into preallocated dq, dk, dv", py::arg("dout"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dlse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
          py::arg("softmax_scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
          py::arg("alibi_slopes"), py::arg("deterministic"), py::arg("kernel_head_dim"), py::arg("tier"),
          py::arg("cu_seqlens_q") = py::none(), py::arg("cu_seqlens_k") = py::none(), py::arg("seqused_q") = py::none(),
          py::arg("seqused_k") = py::none(), py::arg("max_seqlen_q") = 0, py::arg("max_seqlen_k") = 0);
    m.def("available_kernels", &available_kernels, "(tier, direction, head_dim, dtype) of every compiled kernel");
}
