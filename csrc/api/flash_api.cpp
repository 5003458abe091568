// PyTorch binding: turns validated tensors into FwdParams / BwdParams / CombineParams, and runs the registered kernel
// of the key the caller resolved (flash_attention/_dispatch.py), with the workspace its descriptor asks for. It holds
// no tier facts.
// The Python layer (flash_attention/_checks.py) gives the user-facing errors; the checks here guard the kernels'
// memory accesses, since the ops can be called directly. Batched tensors are (b, s, heads, d); with cu_seqlens they
// are varlen, packed (total, heads, d), with lse (h, total_q).
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

// The registry's dtype of a tensor the kernels take.
flash::DType dtype_of(at::Tensor const& t) {
    TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
                "flash_attention: q must be float16 or bfloat16");
    return t.scalar_type() == at::kHalf ? flash::DType::kFloat16 : flash::DType::kBFloat16;
}

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
}

// The kernels access 16-byte vectors: the last dimension contiguous, every other stride (also of a dimension of size
// 1: TMA descriptors take every stride) a multiple of 16 bytes and the base pointer 16-byte aligned.
bool vector_aligned(at::Tensor const& t) {
    int64_t bytes = reinterpret_cast<uintptr_t>(t.data_ptr());
    for (int i = 0; i < t.dim() - 1; ++i) { bytes |= t.stride(i) * int64_t(t.element_size()); }
    return t.stride(-1) == 1 && bytes % 16 == 0;
}

// An operand the kernels read: anything not vector_aligned is copied, as autograd's broadcast gradient of out.sum()
// (stride 0 everywhere) must be; clone rather than .contiguous(), which keeps a misaligned view that torch already
// considers contiguous. A view broadcast along a dimension (stride 0, size above 1) is copied too: the SM90 tier's
// TMA descriptors are not built for zero strides.
at::Tensor kernel_operand(at::Tensor const& t) {
    bool broadcast = false;
    for (int i = 0; i < t.dim() - 1; ++i) { broadcast |= t.stride(i) == 0 && t.size(i) > 1; }
    if (!vector_aligned(t) || broadcast) { return t.clone(at::MemoryFormat::Contiguous); }
    return t;
}

std::optional<at::Tensor> contiguous(std::optional<at::Tensor> const& t) {
    return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

// An output: uninitialized when the kernel writes all of it, else filled with `fill`.
at::Tensor output(at::IntArrayRef shape, at::TensorOptions options, std::optional<double> fill) {
    return fill.has_value() ? at::full(shape, *fill, options) : at::empty(shape, options);
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

// A page table (flash_attn_with_kvcache's block_table): int32 (b, max_blocks) on q's device, rows contiguous.
int const* block_table_of(at::Tensor const& t, at::Tensor const& q, int64_t b) {
    TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kInt && t.dim() == 2 &&
                    t.size(0) == b && t.stride(1) == 1,
                "flash_attention: block_table must be int32 (b, max_blocks) on q's device, rows contiguous");
    return t.data_ptr<int>();
}

// The fields both directions share: q, k, v, sequences, sizes, scales, window, ALiBi.
// paged_rows > 0: k and v are page pools (num_pages, page_size, hk, d) of a batched call whose sequences have
// paged_rows rows of capacity (the caller sets the page fields).
void set_attn_params(flash::AttnParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                     double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
                     std::optional<at::Tensor> const& alibi_slopes, SeqArgs const& seqs, int64_t paged_rows = 0) {
    bool const varlen = seqs.varlen();
    TORCH_CHECK(varlen == seqs.cu_seqlens_k.has_value(),
                "flash_attention: cu_seqlens_q and cu_seqlens_k must be given together");
    check_operand(q, "q", q, seqs.rank());
    check_operand(k, "k", q, seqs.rank());
    check_operand(v, "v", q, seqs.rank());
    int const r = varlen ? 0 : 1;  // the row dimension
    int64_t const b = varlen ? seqs.cu_seqlens_q->size(0) - 1 : q.size(0);
    int64_t const sq = q.size(r), h = q.size(r + 1), d = q.size(r + 2);
    int64_t const sk = paged_rows > 0 ? paged_rows : k.size(r), hk = k.size(r + 1);
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(r + 2) == d && (varlen || paged_rows > 0 || k.size(0) == b),
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
}

// The device's facts (cached by ATen) and the call's longest sequences. A varlen call's max_seqlen only steers the tile
// choice, so a wrong one costs speed, never correctness.
flash::LaunchHints launch_hints(flash::AttnParams const& p, at::Tensor const& q, SeqArgs const& seqs) {
    cudaDeviceProp const* props = at::cuda::getDeviceProperties(q.device().index());
    auto hint = [](int64_t max_seqlen, int rows) {
        return int(max_seqlen > 0 ? std::min<int64_t>(max_seqlen, rows) : rows);
    };
    return {q.device().index(),
            smem_budget(int(props->sharedMemPerBlockOptin)),
            props->multiProcessorCount,
            props->l2CacheSize,
            seqs.varlen() ? hint(seqs.max_seqlen_q, p.sq) : p.sq,
            seqs.varlen() ? hint(seqs.max_seqlen_k, p.sk) : p.sk};
}

// The kernel registered under (tier, kind, kernel head dim, q's dtype for in and out), or nullptr.
template <class Params>
flash::KernelDescriptor<Params> const* find_kernel(char const* kind, int64_t tier, int64_t kernel_head_dim,
                                                   at::Tensor const& q) {
    flash::DType const dt = dtype_of(q);
    return flash::KernelRegistry<Params>::find(flash::KernelKey{int(tier), kind, int(kernel_head_dim), dt, dt});
}

// Launches kernel on params, which it supports (its descriptor's unsupported said so), with the workspace the
// descriptor asks for.
template <class Params>
void launch_supported(flash::KernelDescriptor<Params> const& kernel, at::Tensor const& q, Params const& params,
                      flash::LaunchHints const& hints) {
    cudaStream_t const stream = at::cuda::getCurrentCUDAStream().stream();
    flash::Workspace const ws = kernel.workspace(params, hints);
    at::Tensor workspace;
    if (ws.bytes > 0) { workspace = at::empty({int64_t(ws.bytes)}, q.options().dtype(at::kByte)); }
    cudaError_t const err = kernel.launch(params, hints, ws.bytes > 0 ? workspace.data_ptr() : nullptr, stream);
    TORCH_CHECK(err == cudaSuccess, "flash_attention: kernel launch failed: ", cudaGetErrorString(err));
}

// Runs kernel (found by find_kernel for these arguments) on params, or raises why it cannot.
template <class Params>
void run(flash::KernelDescriptor<Params> const* kernel, char const* kind, int64_t tier, int64_t kernel_head_dim,
         at::Tensor const& q, Params const& params, flash::LaunchHints const& hints) {
    TORCH_CHECK(kernel != nullptr, "flash_attention: no sm", tier, " ", kind, " kernel for head dim ", kernel_head_dim,
                " and ", dtype_name(dtype_of(q)), " in this build (see FLASH_ATTN_HEAD_DIMS / FLASH_ATTN_CUDA_ARCHS)");
    char const* why = kernel->unsupported(params, hints);
    TORCH_CHECK(why == nullptr, "flash_attention: the sm", tier, " ", kind, " kernel for head dim ", kernel_head_dim,
                " cannot run this call: ", why);
    launch_supported(*kernel, q, params, hints);
}

template <class Params>
void run(char const* kind, int64_t tier, int64_t kernel_head_dim, at::Tensor const& q, Params const& params,
         flash::LaunchHints const& hints) {
    run(find_kernel<Params>(kind, tier, kernel_head_dim, q), kind, tier, kernel_head_dim, q, params, hints);
}

// (out, lse) of the forward. Rows past seqused_q are left unwritten by the kernel, so then out starts at 0 and
// lse at -inf (fully masked).
std::tuple<at::Tensor, at::Tensor> fwd(
    at::Tensor const& q_in, at::Tensor const& k_in, at::Tensor const& v_in,
    std::optional<at::Tensor> const& cu_seqlens_q, std::optional<at::Tensor> const& cu_seqlens_k,
    std::optional<at::Tensor> const& seqused_q, std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
    std::optional<at::Tensor> const& alibi_slopes, int64_t kernel_head_dim, int64_t tier) {
    c10::cuda::CUDAGuard guard(q_in.device());
    SeqArgs const seqs{cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k};
    at::Tensor const q = kernel_operand(q_in), k = kernel_operand(k_in), v = kernel_operand(v_in);
    std::optional<at::Tensor> const alibi = contiguous(alibi_slopes);  // alive until the launch
    flash::FwdParams p{};
    set_attn_params(p, q, k, v, softmax_scale, window_left, window_right, softcap, alibi, seqs);
    bool const prefill = seqused_q.has_value();
    at::Tensor out = output(q.sizes(), q.options(), prefill ? std::optional<double>(0.0) : std::nullopt);
    std::vector<int64_t> const lse_shape =
        seqs.varlen() ? std::vector<int64_t>{p.h, p.sq} : std::vector<int64_t>{p.b, p.h, p.sq};
    at::Tensor lse = output(lse_shape, q.options().dtype(at::kFloat),
                            prefill ? std::optional<double>(-INFINITY) : std::nullopt);
    p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    Strides const os = strides_of(out, seqs.varlen());
    p.o_batch_stride = os.batch, p.o_row_stride = os.row, p.o_head_stride = os.head;
    run("fwd", tier, kernel_head_dim, q, p, launch_hints(p, q, seqs));
    return {out, lse};
}

// (dq, dk, dv) of the backward. The kernel leaves dq past seqused_q and dk, dv past seqused_k unwritten: those
// start at 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    at::Tensor const& dout_in, at::Tensor const& q_in, at::Tensor const& k_in, at::Tensor const& v_in,
    at::Tensor const& out_in, at::Tensor const& lse_in, std::optional<at::Tensor> const& dlse_in,
    std::optional<at::Tensor> const& cu_seqlens_q, std::optional<at::Tensor> const& cu_seqlens_k,
    std::optional<at::Tensor> const& seqused_q, std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
    std::optional<at::Tensor> const& alibi_slopes, bool deterministic, int64_t kernel_head_dim, int64_t tier) {
    c10::cuda::CUDAGuard guard(q_in.device());
    SeqArgs const seqs{cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k};
    bool const varlen = seqs.varlen();
    at::Tensor const q = kernel_operand(q_in), k = kernel_operand(k_in), v = kernel_operand(v_in);
    at::Tensor const out = kernel_operand(out_in), dout = kernel_operand(dout_in), lse = lse_in.contiguous();
    std::optional<at::Tensor> const dlse = contiguous(dlse_in), alibi = contiguous(alibi_slopes);
    flash::BwdParams p{};
    set_attn_params(p, q, k, v, softmax_scale, window_left, window_right, softcap, alibi, seqs);
    auto const zero_q = seqused_q.has_value() ? std::optional<double>(0.0) : std::nullopt;
    auto const zero_k = seqused_k.has_value() ? std::optional<double>(0.0) : std::nullopt;
    at::Tensor dq = output(q.sizes(), q.options(), zero_q);
    at::Tensor dk = output(k.sizes(), k.options(), zero_k), dv = output(v.sizes(), v.options(), zero_k);
    for (auto const& [t, name] : {std::pair{&out, "out"}, {&dout, "dout"}}) {
        check_operand(*t, name, q, seqs.rank());
        TORCH_CHECK(t->sizes() == q.sizes(), "flash_attention: ", name, " must have q's shape");
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
    p.deterministic = deterministic;
    run("bwd", tier, kernel_head_dim, q, p, launch_hints(p, q, seqs));
    return {dq, dk, dv};
}

// out (b, rows, h, d) and, when given, lse (b, h, rows) of split-KV partials: out_partial (splits, b, rows, h, d) in
// out's dtype or fp32, lse_partial (splits, b, rows, h) fp32; any strides (a partial the kernel cannot load is
// copied; out, which it writes, must take its 16-byte stores).
void combine(at::Tensor const& out_partial_in, at::Tensor const& lse_partial, at::Tensor const& out,
             std::optional<at::Tensor> const& lse, int64_t kernel_head_dim, int64_t tier) {
    c10::cuda::CUDAGuard guard(out_partial_in.device());
    TORCH_CHECK(out_partial_in.is_cuda() && out_partial_in.dim() == 5,
                "flash_attention: out_partial must be a 5-D CUDA tensor");
    at::Tensor const op = kernel_operand(out_partial_in);
    TORCH_CHECK(lse_partial.device() == op.device() && lse_partial.scalar_type() == at::kFloat &&
                    lse_partial.dim() == 4 && lse_partial.sizes() == op.sizes().slice(0, 4),
                "flash_attention: lse_partial must be fp32 (splits, b, rows, h) on out_partial's device");
    TORCH_CHECK(out.is_cuda() && out.device() == op.device() && out.dim() == 4,
                "flash_attention: out must be a 4-D tensor on out_partial's device");
    bool const fp32_partials = op.scalar_type() == at::kFloat;
    TORCH_CHECK(fp32_partials || op.scalar_type() == out.scalar_type(),
                "flash_attention: out_partial must be fp32 or have out's dtype");
    TORCH_CHECK(out.sizes() == op.sizes().slice(1) && vector_aligned(out),
                "flash_attention: out must be (b, rows, h, d) with its last dimension contiguous and 16-byte aligned "
                "rows");
    flash::CombineParams p{};
    p.splits = int(op.size(0)), p.b = int(op.size(1)), p.rows = int(op.size(2)), p.h = int(op.size(3));
    p.d = int(op.size(4));
    p.fp32_partials = fp32_partials;
    if (lse.has_value()) {
        TORCH_CHECK(lse->device() == op.device() && lse->scalar_type() == at::kFloat && lse->is_contiguous() &&
                        lse->dim() == 3 && lse->size(0) == p.b && lse->size(1) == p.h && lse->size(2) == p.rows,
                    "flash_attention: lse must be contiguous fp32 (b, h, rows)");
        p.lse = lse->data_ptr<float>();
    }
    p.out_partial = op.data_ptr();
    p.lse_partial = lse_partial.data_ptr<float>();
    p.out = out.data_ptr();
    p.op_split_stride = op.stride(0), p.op_batch_stride = op.stride(1), p.op_row_stride = op.stride(2);
    p.op_head_stride = op.stride(3);
    p.lp_split_stride = lse_partial.stride(0), p.lp_batch_stride = lse_partial.stride(1);
    p.lp_row_stride = lse_partial.stride(2), p.lp_head_stride = lse_partial.stride(3);
    p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
    flash::LaunchHints const hints{op.device().index(), 0, 0, 0, p.rows, 0};
    run("combine", tier, kernel_head_dim, out, p, hints);
}

// flash_attn_with_kvcache's append of k_new / v_new (b, s_new, hk, d) into the caches in place (AppendParams), with
// the rotary embedding (cos, sin: (seqlen_ro, rotary_dim / 2)) of the new keys and of q, whose rotated copy it returns
// (q itself without cos). kvcache.py validated the arguments; this checks what memory safety needs.
at::Tensor append_kv(at::Tensor const& q, at::Tensor const& k_cache, at::Tensor const& v_cache,
                     std::optional<at::Tensor> const& k_new, std::optional<at::Tensor> const& v_new,
                     std::optional<at::Tensor> const& cos, std::optional<at::Tensor> const& sin,
                     at::Tensor const& cache_seqlens, std::optional<at::Tensor> const& cache_batch_idx,
                     std::optional<at::Tensor> const& block_table, bool interleaved, bool q_steps,
                     int64_t kernel_head_dim, int64_t tier) {
    c10::cuda::CUDAGuard guard(q.device());
    auto same = [&](at::Tensor const& t) { return t.is_cuda() && t.device() == q.device(); };
    auto rows_of = [&](at::Tensor const& t) { return t.dim() == 4 && t.stride(3) == 1 && same(t); };
    TORCH_CHECK(rows_of(q) && rows_of(k_cache) && rows_of(v_cache) && k_cache.sizes() == v_cache.sizes() &&
                    k_cache.size(3) == q.size(3) && k_cache.scalar_type() == q.scalar_type() &&
                    v_cache.scalar_type() == q.scalar_type() && q.size(2) % k_cache.size(2) == 0,
                "flash_attention: append_kv takes q and the caches as 4-D CUDA tensors of one dtype, head dim and "
                "device, their last dims contiguous");
    int64_t const b = q.size(0);
    flash::AppendParams p{};
    p.cache_seqlens = seq_tensor(cache_seqlens, "cache_seqlens", b, q);
    p.cache_batch_idx = seq_tensor(cache_batch_idx, "cache_batch_idx", b, q);
    p.b = int(b), p.sq = int(q.size(1)), p.h = int(q.size(2)), p.d = int(q.size(3));
    p.hk = int(k_cache.size(2));
    p.cache_entries = int(k_cache.size(0));
    p.cache_len = int(k_cache.size(1));
    if (block_table) {
        p.block_table = block_table_of(*block_table, q, b);
        p.block_table_stride = block_table->stride(0);
        p.page_size = int(k_cache.size(1));
        p.cache_len = int(block_table->size(1) * k_cache.size(1));
    }
    TORCH_CHECK(p.cache_len > 0 && p.cache_entries > 0, "flash_attention: the caches must hold a row");
    p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
    p.kc_batch_stride = k_cache.stride(0), p.kc_row_stride = k_cache.stride(1), p.kc_head_stride = k_cache.stride(2);
    p.vc_batch_stride = v_cache.stride(0), p.vc_row_stride = v_cache.stride(1), p.vc_head_stride = v_cache.stride(2);
    TORCH_CHECK(k_new.has_value() == v_new.has_value(), "flash_attention: k_new and v_new go together");
    if (k_new) {
        TORCH_CHECK(rows_of(*k_new) && rows_of(*v_new) && k_new->sizes() == v_new->sizes() && k_new->size(0) == b &&
                        k_new->size(2) == p.hk && k_new->size(3) == p.d &&
                        k_new->scalar_type() == q.scalar_type() && v_new->scalar_type() == q.scalar_type(),
                    "flash_attention: k_new and v_new must be (b, s_new, hk, d) in q's dtype, last dims contiguous");
        p.k_new = k_new->data_ptr(), p.v_new = v_new->data_ptr();
        p.s_new = int(k_new->size(1));
        p.kn_batch_stride = k_new->stride(0), p.kn_row_stride = k_new->stride(1), p.kn_head_stride = k_new->stride(2);
        p.vn_batch_stride = v_new->stride(0), p.vn_row_stride = v_new->stride(1), p.vn_head_stride = v_new->stride(2);
    }
    TORCH_CHECK(cos.has_value() == sin.has_value(), "flash_attention: cos and sin go together");
    at::Tensor q_rot = q;
    if (cos) {
        TORCH_CHECK(same(*cos) && cos->dim() == 2 && cos->size(0) > 0 && 2 * cos->size(1) <= p.d &&
                        cos->stride(1) == 1 && sin->sizes() == cos->sizes() && sin->strides() == cos->strides() &&
                        same(*sin) && cos->scalar_type() == q.scalar_type() && sin->scalar_type() == q.scalar_type(),
                    "flash_attention: cos and sin must be (seqlen_ro, rotary_dim / 2) in q's dtype, rows contiguous, "
                    "with rotary_dim <= head dim");
        q_rot = at::empty(q.sizes(), q.options());
        p.cos = cos->data_ptr(), p.sin = sin->data_ptr();
        p.cos_row_stride = cos->stride(0);
        p.rotary_dim = int(2 * cos->size(1));
        p.seqlen_ro = int(cos->size(0));
        p.q = q.data_ptr(), p.q_rot = q_rot.data_ptr();
        p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
        p.qr_batch_stride = q_rot.stride(0), p.qr_row_stride = q_rot.stride(1), p.qr_head_stride = q_rot.stride(2);
    }
    p.interleaved = interleaved;
    p.q_steps = q_steps;
    flash::LaunchHints const hints{int(q.device().index()), 0, 0, 0, p.sq, 0};
    run("append", tier, kernel_head_dim, q, p, hints);
    return q_rot;
}

// A paged cache's used rows gathered into contiguous copies (k, v) of (b, max_blocks * page_size, hk, d): sequence i's
// first used[i] rows from its pages (GatherParams); the rows past them are left uninitialized.
std::vector<at::Tensor> gather_pages(at::Tensor const& k_cache, at::Tensor const& v_cache,
                                     at::Tensor const& block_table, at::Tensor const& used, int64_t kernel_head_dim,
                                     int64_t tier) {
    c10::cuda::CUDAGuard guard(k_cache.device());
    TORCH_CHECK(k_cache.is_cuda() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                    v_cache.device() == k_cache.device() && v_cache.scalar_type() == k_cache.scalar_type() &&
                    vector_aligned(k_cache) && vector_aligned(v_cache) &&
                    k_cache.size(3) * k_cache.element_size() % 16 == 0,
                "flash_attention: gather_pages takes k_cache and v_cache as page pools (num_pages, page_size, hk, d) "
                "of one shape, dtype and device, in 16-byte vectors (rows of a multiple of 16 bytes, 16-byte aligned)");
    int64_t const b = block_table.size(0);
    flash::GatherParams p{};
    p.block_table = block_table_of(block_table, k_cache, b);
    p.block_table_stride = block_table.stride(0);
    p.used = seq_tensor(used, "used", b, k_cache);
    p.b = int(b), p.hk = int(k_cache.size(2)), p.d = int(k_cache.size(3));
    p.page_size = int(k_cache.size(1)), p.num_pages = int(k_cache.size(0));
    p.cache_len = int(block_table.size(1) * k_cache.size(1));
    TORCH_CHECK(p.num_pages > 0, "flash_attention: the caches must hold a page");
    p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
    p.kc_page_stride = k_cache.stride(0), p.kc_row_stride = k_cache.stride(1), p.kc_head_stride = k_cache.stride(2);
    p.vc_page_stride = v_cache.stride(0), p.vc_row_stride = v_cache.stride(1), p.vc_head_stride = v_cache.stride(2);
    at::Tensor k = at::empty({b, p.cache_len, p.hk, p.d}, k_cache.options());
    at::Tensor v = at::empty({b, p.cache_len, p.hk, p.d}, k_cache.options());
    p.k_out = k.data_ptr(), p.v_out = v.data_ptr();
    flash::LaunchHints const hints{int(k_cache.device().index()), 0, 0, 0, p.cache_len, 0};
    run("gather", tier, kernel_head_dim, k_cache, p, hints);
    return {k, v};
}

// (out, lse (b, h, sq)) of a batched forward whose keys are split into num_splits chunks per query tile (split-KV, for
// decoding: the chunks fill the GPU where b * h query tiles cannot; negative: -num_splits, an automatic count that may
// be lowered): tier's forward merges the chunks inside a thread-block cluster where it can (SM80-tier decode kernels on
// sm_90, at most 16 chunks), else writes fp32 partials that combine_tier's combine kernel merges. With block_table, k
// and v are page pools (num_pages, page_size, hk, d), read in place. Each chunk is masked as the whole call is, so any
// mask splits exactly. packed_heads > 1: the kernel GQA-packs the query heads of each kv head as rows (row r: query
// r / packed_heads of head r % packed_heads, masked as that query) of q (b, sq, hk * packed_heads, d), whose out
// (b, sq, h, d) and lse (b, h, sq) come back unpacked. leftpad_k (int32 (b,)): sequence i's keys are its rows
// [leftpad_k[i], seqused_k[i]). seqused_q and ALiBi are not taken (flash_attn_with_kvcache, the caller, passes
// neither).
std::tuple<at::Tensor, at::Tensor> fwd_split(
    at::Tensor const& q_in, at::Tensor const& k_in, at::Tensor const& v_in, std::optional<at::Tensor> const& seqused_k,
    std::optional<at::Tensor> const& block_table, std::optional<at::Tensor> const& leftpad_k, double softmax_scale,
    int64_t window_left, int64_t window_right, double softcap, int64_t num_splits, int64_t packed_heads,
    int64_t kernel_head_dim, int64_t tier, int64_t combine_tier) {
    c10::cuda::CUDAGuard guard(q_in.device());
    bool const automatic = num_splits < 0;  // a count chosen by the caller's rule, which may be lowered (below)
    num_splits = std::abs(num_splits);
    TORCH_CHECK(num_splits >= 1 && num_splits <= 256,
                "flash_attention: num_splits must be in [1, 256] (negative: an automatic count)");
    TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4, "flash_attention: fwd_split takes batched q, k and v");
    int64_t const group = packed_heads;
    // Unpacked q: the kernel packs its rows (the copies of a packing in Python took 9 us of a 185 us decode step with
    // four query rows; H100, RESULTS.md).
    TORCH_CHECK(group >= 1 && (group == 1 || q_in.size(2) == k_in.size(2) * group),
                "flash_attention: packed_heads must be >= 1, and q's heads hk * packed_heads");
    std::optional<at::Tensor> const none;
    SeqArgs const seqs{none, none, none, seqused_k, 0, 0};
    at::Tensor const q = kernel_operand(q_in), k = kernel_operand(k_in), v = kernel_operand(v_in);
    flash::FwdParams p{};
    int64_t paged_rows = 0;
    if (block_table.has_value()) {
        auto const& t = *block_table;
        p.block_table = block_table_of(t, q, q.size(0));
        TORCH_CHECK(k.size(0) > 0, "flash_attention: the page pools must hold a page");
        paged_rows = t.size(1) * k.size(1);
        p.block_table_stride = t.stride(0);
        p.page_size = int(k.size(1));
        p.num_pages = int(k.size(0));
        if ((p.page_size & (p.page_size - 1)) == 0) { p.page_shift = __builtin_ctz(unsigned(p.page_size)); }
    }
    p.leftpad_k = seq_tensor(leftpad_k, "leftpad_k", q.size(0), q);
    set_attn_params(p, q, k, v, softmax_scale, window_left, window_right, softcap, none, seqs, paged_rows);
    // Packed rows: per kv head, query r / group of head r % group (FwdParams::packed_heads). The row strides step
    // queries, the group strides heads of a group; the head strides step kv heads.
    p.packed_heads = int(group);
    if (group > 1) {
        p.q_group_stride = p.q_head_stride;
        p.q_head_stride *= group;
        p.h /= int(group), p.h_per_hk = 1, p.sq *= int(group);
        p.lse_head_stride = p.sq;  // lse (b, h, sq): a kv head's group of heads
        p.lse_row_stride = 1, p.lse_group_stride = q.size(1);  // q.size(1): the queries
    }
    // o, or the partials laid out as o: (b, rows, heads, d), q's shape.
    auto set_o_strides = [&](at::Tensor const& o) {
        Strides const os = strides_of(o, false);
        p.o_batch_stride = os.batch, p.o_row_stride = os.row, p.o_head_stride = os.head;
        if (group > 1) {
            p.o_group_stride = p.o_head_stride;
            p.o_head_stride *= group;
        }
    };
    auto const fp32 = q.options().dtype(at::kFloat);
    at::Tensor const out = at::empty(q.sizes(), q.options());
    at::Tensor const lse = at::empty({q.size(0), q.size(2), q.size(1)}, fp32);
    flash::LaunchHints const hints = launch_hints(p, q, seqs);
    // One chunk, or chunks merged inside clusters where the kernel can: the forward stores the result itself. An
    // automatic count that cannot merge there takes the largest smaller one that can, down to a third of it: 2-6%
    // faster than the partials and the combine kernel on the H100 (RESULTS.md, session 36).
    p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    set_o_strides(out);
    auto const* kernel = find_kernel<flash::FwdParams>("fwd", tier, kernel_head_dim, q);
    int64_t const fewest = automatic && num_splits > 1 ? std::max<int64_t>(2, (num_splits + 2) / 3) : num_splits;
    for (int64_t s = num_splits; s >= fewest; --s) {
        p.num_splits = int(s);
        if (s == 1) {
            run(kernel, "fwd", tier, kernel_head_dim, q, p, hints);
            return {out, lse};
        }
        if (kernel != nullptr && kernel->unsupported(p, hints) == nullptr) {
            launch_supported(*kernel, q, p, hints);
            return {out, lse};
        }
    }
    p.num_splits = int(num_splits);
    // Laid out as out and lse, so that the combine merges them into out unpacked.
    at::Tensor const o_partial = at::empty({num_splits, q.size(0), q.size(1), q.size(2), p.d}, fp32);
    at::Tensor const lse_partial = at::empty({num_splits, q.size(0), q.size(2), q.size(1)}, fp32);
    p.o_partial = o_partial.data_ptr<float>();
    p.lse_partial = lse_partial.data_ptr<float>();
    p.o_partial_split_stride = o_partial.stride(0);
    p.lse_partial_split_stride = lse_partial.stride(0);
    set_o_strides(o_partial[0]);
    run(kernel, "fwd", tier, kernel_head_dim, q, p, hints);
    combine(o_partial, lse_partial.transpose(2, 3), out, lse, kernel_head_dim, combine_tier);
    return {out, lse};
}

// Eager forward with its backward as a C++ autograd node, so that an eager training step pays no Python in the
// backward (the Python autograd.Function's node and argument handling cost more than the binding on small shapes).
// The caller resolved both kernels, so the backward needs no routing; torch.compile traces the custom ops instead.
struct EagerAttention : torch::autograd::Function<EagerAttention> {
    static torch::autograd::variable_list forward(
        torch::autograd::AutogradContext* ctx, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
        std::optional<at::Tensor> const& cu_seqlens_q, std::optional<at::Tensor> const& cu_seqlens_k,
        std::optional<at::Tensor> const& seqused_q, std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q,
        int64_t max_seqlen_k, double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
        std::optional<at::Tensor> const& alibi_slopes, bool deterministic, int64_t fwd_head_dim, int64_t fwd_tier,
        int64_t bwd_head_dim, int64_t bwd_tier) {
        auto [out, lse] = fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, window_left, window_right, softcap, alibi_slopes, fwd_head_dim, fwd_tier);
        auto or_undefined = [](std::optional<at::Tensor> const& t) { return t.value_or(at::Tensor()); };
        ctx->save_for_backward({q, k, v, out, lse, or_undefined(cu_seqlens_q), or_undefined(cu_seqlens_k),
                                or_undefined(seqused_q), or_undefined(seqused_k), or_undefined(alibi_slopes)});
        ctx->saved_data["ints"] = std::vector<int64_t>{max_seqlen_q, max_seqlen_k, window_left, window_right,
                                                       bwd_head_dim, bwd_tier};
        ctx->saved_data["softmax_scale"] = softmax_scale;
        ctx->saved_data["softcap"] = softcap;
        ctx->saved_data["deterministic"] = deterministic;
        // An output the loss does not use has gradient None, not zeros: an unused lse costs nothing.
        ctx->set_materialize_grads(false);
        return {out, lse};
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto const saved = ctx->get_saved_variables();
        auto optional = [](at::Tensor const& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
        auto const ints = ctx->saved_data["ints"].toIntVector();
        at::Tensor const& out = saved[3];
        at::Tensor const dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
        // The lse gradient flows into dq and dk: d lse_i / d s_ij is P_ij, which the kernel folds into D.
        auto [dq, dk, dv] = bwd(dout, saved[0], saved[1], saved[2], out, saved[4], optional(grads[1]),
                                optional(saved[5]), optional(saved[6]), optional(saved[7]), optional(saved[8]),
                                ints[0], ints[1], ctx->saved_data["softmax_scale"].toDouble(), ints[2], ints[3],
                                ctx->saved_data["softcap"].toDouble(), optional(saved[9]),
                                ctx->saved_data["deterministic"].toBool(), ints[4], ints[5]);
        torch::autograd::variable_list result(19);  // one per forward argument; none but q, k, v has a gradient
        result[0] = dq, result[1] = dk, result[2] = dv;
        return result;
    }
};

std::vector<at::Tensor> attention_autograd(
    at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, std::optional<at::Tensor> const& cu_seqlens_q,
    std::optional<at::Tensor> const& cu_seqlens_k, std::optional<at::Tensor> const& seqused_q,
    std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
    int64_t window_left, int64_t window_right, double softcap, std::optional<at::Tensor> const& alibi_slopes,
    bool deterministic, int64_t fwd_head_dim, int64_t fwd_tier, int64_t bwd_head_dim, int64_t bwd_tier) {
    return EagerAttention::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                 max_seqlen_k, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                                 deterministic, fwd_head_dim, fwd_tier, bwd_head_dim, bwd_tier);
}

std::vector<std::tuple<int64_t, std::string, int64_t, std::string, std::string>> available_kernels() {
    std::vector<std::tuple<int64_t, std::string, int64_t, std::string, std::string>> out;
    for (auto const& key : flash::registered_kernels()) {
        out.emplace_back(key.tier, key.kind, key.head_dim, dtype_name(key.in), dtype_name(key.out));
    }
    return out;
}

}  // namespace

// Positional arguments only: pybind's keyword matching costs more per call than the rest of the binding.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "flash-attention-cute kernels";
    m.def("fwd", &fwd,
          "(out, lse) of attention: q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, "
          "max_seqlen_k, softmax_scale, window_left, window_right, softcap, alibi_slopes, kernel_head_dim, tier");
    m.def("bwd", &bwd,
          "(dq, dk, dv) of attention: dout, q, k, v, out, lse, dlse, then fwd's arguments from cu_seqlens_q to "
          "alibi_slopes, deterministic, kernel_head_dim, tier");
    m.def("attention_autograd", &attention_autograd,
          "[out, lse] of fwd's arguments up to deterministic, then the forward's and the backward's kernel head dim "
          "and tier; differentiable, its backward a C++ autograd node running bwd");
    m.def("fwd_split", &fwd_split,
          "split-KV forward (out, lse): q, k, v, seqused_k, block_table, leftpad_k, softmax_scale, window_left, "
          "window_right, softcap, num_splits, packed_heads, kernel_head_dim, tier (the forward's), combine_tier");
    m.def("combine", &combine,
          "split-KV combine into out (and lse when given): out_partial, lse_partial, out, lse, kernel_head_dim, tier");
    m.def("append_kv", &append_kv,
          "append of the new keys and values into the caches in place, with the rotary embedding; returns q rotated: "
          "q, k_cache, v_cache, k_new, v_new, cos, sin, cache_seqlens, cache_batch_idx, block_table, interleaved, "
          "q_steps, kernel_head_dim, tier");
    m.def("gather_pages", &gather_pages,
          "(k, v): a paged cache's used rows gathered into contiguous copies: k_cache, v_cache, block_table, used, "
          "kernel_head_dim, tier");
    m.def("available_kernels", &available_kernels,
          "(tier, kind, kernel head dim, dtype in, dtype out) of every compiled kernel");
}
