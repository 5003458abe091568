// Arguments of one attention call, shared by every architecture tier: what both directions read (AttnParams), and
// what each direction adds. Strides are in elements; the last dimension is always contiguous.
#pragma once

#include <cstdint>

namespace flash {

struct AttnParams {
    void const* __restrict__ q;
    void const* __restrict__ k;
    void const* __restrict__ v;
    float const* __restrict__ alibi_slopes;  // nullptr, or slopes indexed [b * alibi_batch_stride + h]

    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t alibi_batch_stride;

    int b, h, hk, sq, sk;
    int d;         // head dim of the tensors (a multiple of 8, <= the kernel's head dim)
    int h_per_hk;  // GQA group size

    // The kernel works on x = q.k (or tanh(q.k * softcap_pre) with softcap); the logit is x * logit_scale.
    float softmax_scale;
    float softcap_pre;  // softmax_scale / softcap, used only with softcap
    float logit_scale;  // softcap if softcap is on, else softmax_scale
    float scale_log2;   // logit_scale * log2(e): softmax is computed with exp2
    bool has_softcap;

    // -1 means unbounded. Query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right.
    int window_left, window_right;

    int max_smem_per_block;  // opt-in shared memory of the device, to pick a tile that fits
};

struct FwdParams : AttnParams {
    void* __restrict__ o;
    float* __restrict__ lse;  // (b, h, sq), contiguous
    int64_t o_batch_stride, o_row_stride, o_head_stride;
};

struct BwdParams : AttnParams {
    void const* __restrict__ o;
    void const* __restrict__ dout;
    float const* __restrict__ lse;   // (b, h, sq) from the forward
    float const* __restrict__ dlse;  // (b, h, sq) gradient of the returned lse, or nullptr
    void* __restrict__ dq;
    void* __restrict__ dk;
    void* __restrict__ dv;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t do_batch_stride, do_row_stride, do_head_stride;
    int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

    // Workspace, per (b, h): dq_accum holds sq_rounded * kernel head dim fp32 (zeroed), dpsum sq floats, and
    // dq_semaphore sq_rounded / 16 zeroed ints (deterministic only).
    float* __restrict__ dq_accum;
    float* __restrict__ dpsum;  // D = rowsum(dO * O) - dlse
    int* __restrict__ dq_semaphore;
    int sq_rounded;  // sq rounded up to kBwdRowAlign, so that every tile height divides it
    bool deterministic;
};

constexpr int kBwdRowAlign = 128;

}  // namespace flash
