// flash_attn_with_kvcache's append and rotary embedding in one launch (AppendParams): one warp per head vector, either
// a new key and value row (rotated key and value written into the cache) or a query row (rotated into q_rot). Lane l
// takes dims [8l, 8l + 8); a rotated dim reads its partner and its cos / sin row element by element, a few hundred
// bytes per vector. The arithmetic is apply_rotary's in kvcache.py, unfused and in the same order (x0 c - x1 s,
// x0 s + x1 c in fp32, one rounding), so both paths write the same bits.
#pragma once

#include <cutlass/numeric_types.h>

#include "../params.h"

namespace flash {

constexpr int kAppendWarps = 4;

template <typename Element>
__device__ __forceinline__ float rotated(Element const* x, Element const* cos_row, Element const* sin_row, int j,
                                         int half, bool interleaved) {
    // j's pair (x0, x1) and its cos / sin index.
    int const i = interleaved ? j / 2 : (j < half ? j : j - half);
    int const j0 = interleaved ? 2 * i : i;
    int const j1 = interleaved ? 2 * i + 1 : i + half;
    float const x0 = float(x[j0]), x1 = float(x[j1]);
    float const c = float(cos_row[i]), s = float(sin_row[i]);
    return j == j0 ? __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)) : __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Copies the d dims of x to y, the first rotary_dim rotated at table row `position` (no rotation without cos).
template <typename Element>
__device__ __forceinline__ void rotate_vector(AppendParams const& p, Element const* x, Element* y, int position,
                                              int lane) {
    int const end = min(p.d, lane * 8 + 8);
    if (p.cos == nullptr) {
        for (int j = lane * 8; j < end; ++j) { y[j] = x[j]; }
        return;
    }
    Element const* cos_row = static_cast<Element const*>(p.cos) + int64_t(position) * p.cos_row_stride;
    Element const* sin_row = static_cast<Element const*>(p.sin) + int64_t(position) * p.cos_row_stride;
    for (int j = lane * 8; j < end; ++j) {
        y[j] = j < p.rotary_dim ? Element(rotated(x, cos_row, sin_row, j, p.rotary_dim / 2, p.interleaved)) : x[j];
    }
}

template <typename Element>
__global__ void __launch_bounds__(kAppendWarps * 32) append_kv_kernel(__grid_constant__ AppendParams const p) {
    int const lane = threadIdx.x % 32;
    int64_t const vector = int64_t(blockIdx.x) * kAppendWarps + threadIdx.x / 32;
    int64_t const kv_vectors = p.k_new != nullptr ? int64_t(p.b) * p.s_new * p.hk : 0;
    int64_t const q_vectors = p.cos != nullptr ? int64_t(p.b) * p.sq * p.h : 0;
    if (vector >= kv_vectors + q_vectors) { return; }
    bool const is_kv = vector < kv_vectors;
    int64_t const id = is_kv ? vector : vector - kv_vectors;
    int const heads = is_kv ? p.hk : p.h;
    int const head = int(id % heads);
    int const row = int(id / heads % (is_kv ? p.s_new : p.sq));
    int const batch = int(id / heads / (is_kv ? p.s_new : p.sq));
    int const filled = min(max(p.cache_seqlens[batch], 0), p.cache_len);
    int const last_position = p.seqlen_ro - 1;

    if (!is_kv) {
        int const position = min(filled + (p.q_steps ? row : 0), last_position);
        rotate_vector(p,
                      static_cast<Element const*>(p.q) + batch * p.q_batch_stride + row * p.q_row_stride +
                          head * p.q_head_stride,
                      static_cast<Element*>(p.q_rot) + batch * p.qr_batch_stride + row * p.qr_row_stride +
                          head * p.qr_head_stride,
                      position, lane);
        return;
    }
    // New rows past the cache's end would all land on its last row: only the last new row is written there, so that
    // the result does not depend on the order of the warps.
    if (filled + row >= p.cache_len - 1 && row != p.s_new - 1) { return; }
    int const cache_row = min(filled + row, p.cache_len - 1);
    int64_t entry, entry_row;
    if (p.block_table != nullptr) {
        int const slot = cache_row / p.page_size;
        entry = min(max(p.block_table[batch * p.block_table_stride + slot], 0), p.cache_entries - 1);
        entry_row = cache_row - slot * p.page_size;
    } else {
        entry = p.cache_batch_idx != nullptr ? min(max(p.cache_batch_idx[batch], 0), p.cache_entries - 1) : batch;
        entry_row = cache_row;
    }
    Element const* k = static_cast<Element const*>(p.k_new) + batch * p.kn_batch_stride + row * p.kn_row_stride +
                       head * p.kn_head_stride;
    Element const* v = static_cast<Element const*>(p.v_new) + batch * p.vn_batch_stride + row * p.vn_row_stride +
                       head * p.vn_head_stride;
    Element* k_dest = static_cast<Element*>(p.k_cache) + entry * p.kc_batch_stride + entry_row * p.kc_row_stride +
                      head * p.kc_head_stride;
    Element* v_dest = static_cast<Element*>(p.v_cache) + entry * p.vc_batch_stride + entry_row * p.vc_row_stride +
                      head * p.vc_head_stride;
    rotate_vector(p, k, k_dest, min(cache_row, last_position), lane);
    for (int j = lane * 8; j < min(p.d, lane * 8 + 8); ++j) { v_dest[j] = v[j]; }
}

}  // namespace flash
