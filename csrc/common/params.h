// Arguments of one attention call, shared by every architecture tier: what both directions read (AttnParams), and
// what each direction adds. Strides are in elements; the last dimension is always contiguous.
//
// Batched: tensors are (b, sq or sk, heads, d). Varlen: cu_seqlens_q / cu_seqlens_k are set, tensors are packed
// (total rows, heads, d) with batch strides 0, sq / sk hold the total rows, and sequence i is rows
// [cu_seqlens[i], cu_seqlens[i + 1]). seqused (either layout) keeps the first seqused[i] rows of sequence i.
// common/seqlen.h resolves one sequence's rows from these.
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
    // lse (forward output, backward input), dlse and D index [batch * lse_batch_stride + head * lse_head_stride + row],
    // row counted from the first row of the tensor's batch entry: (b, h, sq) batched, (h, total_q) varlen.
    int64_t lse_batch_stride, lse_head_stride;

    int const* __restrict__ cu_seqlens_q;  // (b + 1), or nullptr when batched
    int const* __restrict__ cu_seqlens_k;
    int const* __restrict__ seqused_q;  // (b), or nullptr
    int const* __restrict__ seqused_k;

    int b, h, hk, sq, sk;  // b: sequences; sq, sk: rows per batch entry (batched) or total rows (varlen)
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

    // Host-only facts (shared memory, SM count, the longest sequences) travel beside the params, in LaunchHints.
};

struct FwdParams : AttnParams {
    void* __restrict__ o;
    float* __restrict__ lse;
    int64_t o_batch_stride, o_row_stride, o_head_stride;

    // Split-KV (SM80-tier kernels): with o_partial set, num_splits (>= 1) CTAs (blockIdx.y) share each query tile's
    // visible key blocks in contiguous chunks (split_chunk), and each writes, instead of o and lse, its output
    // normalised by its own sum in fp32 to o_partial and its lse (-inf for an empty chunk) to lse_partial: split s at
    // s * the split stride, then o's element strides and lse's layout. Without o_partial (SM80-tier decode kernels,
    // sm_90 code), a query tile's num_splits CTAs form a thread-block cluster that merges their outputs into o and lse
    // through distributed shared memory: no partials, no combine kernel.
    int num_splits;
    float* __restrict__ o_partial;
    float* __restrict__ lse_partial;
    int64_t o_partial_split_stride, lse_partial_split_stride;

    // Paged K/V (SM80-tier kernels, batched calls; nullptr: none): k and v are pools of num_pages pages of page_size
    // rows, k/v_batch_stride their page strides, and key j of sequence b lies in page block_table[b *
    // block_table_stride + j / page_size], row j % page_size; sk is the table's capacity in rows. Page ids are
    // clamped to the pool.
    int const* __restrict__ block_table;
    int64_t block_table_stride;
    int page_size, num_pages;
    int page_shift = -1;  // log2(page_size) where it is a power of two (a shift in place of each row's division)

    // Per sequence, key rows before leftpad_k[b] are not attended to (flash_attn_with_kvcache's cache_leftpad; SM80-tier
    // kernels, batched calls; nullptr: none): the keys are rows [leftpad_k[b], the sequence's end), clamped.
    int const* __restrict__ leftpad_k;

    // GQA-packed queries (SM80-tier decode kernels; 1: none): the rows of kv head j are, per query position, its
    // packed_heads query heads: row r is query r / packed_heads of the group's head r % packed_heads, so masks and key
    // ranges follow r / packed_heads. q, o (or the partials) and lse advance by their row strides per query and by
    // their group strides per head of the group (packed_row_offset); q_head_stride and o_head_stride step whole
    // groups, and lse_head_stride is packed_heads * the queries. Unpacked, lse_row_stride is 1.
    int packed_heads = 1;
    int64_t q_group_stride = 0, o_group_stride = 0;
    int64_t lse_row_stride = 1, lse_group_stride = 0;

    // Set by the launch (SM80 tier): the grid puts at most one CTA on each SM, so no other CTA overlaps a CTA's loads.
    bool single_cta_per_sm = false;
};

struct BwdParams : AttnParams {
    void const* __restrict__ o;
    void const* __restrict__ dout;
    float const* __restrict__ lse;   // from the forward
    float const* __restrict__ dlse;  // gradient of the returned lse, or nullptr
    void* __restrict__ dq;
    void* __restrict__ dk;
    void* __restrict__ dv;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t do_batch_stride, do_row_stride, do_head_stride;
    int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

    // Workspace. dq_accum: zeroed fp32, kernel head dim floats per row; a sequence's rows of one head start at row
    // batch * dq_accum_batch_stride + head * dq_accum_head_stride (+ the sequence's padded start when varlen, see
    // dq_accum_row), a multiple of kBwdRowAlign, so that every tile height divides it. dpsum: like lse, or with
    // row statistics per accumulator row (BwdWorkspace), like dq_accum's rows, as is lse2.
    // dq_semaphore: zeroed ints, one per 16 rows of dq_accum (deterministic only). dkv_sums and dkv_parts_done
    // (the SM90 tier's split last-wave tiles, see WaveTail): per split tile, fp32 dK and dV sums and the count of its
    // parts that have added into them. tile_counter (the SM90 tier's persistent backward): block indices taken past
    // the grid's own. All are zeroed by the preprocess kernel: dq_zero_words 16-byte words from dq_accum on.
    float* __restrict__ dq_accum;
    float* __restrict__ dpsum;  // D = rowsum(dO * O) - dlse; 0 on the padding rows
    float* __restrict__ lse2;   // with row statistics per accumulator row: lse * log2(e), +inf where P must be 0
    int* __restrict__ dq_semaphore;
    float* __restrict__ dkv_sums;
    int* __restrict__ dkv_parts_done;
    int* __restrict__ tile_counter;
    int64_t dq_accum_batch_stride, dq_accum_head_stride;  // in rows
    bool deterministic;
    int64_t dq_zero_words;
};

constexpr int kBwdRowAlign = 128;

// flash_attn_combine: per (batch, row, head), out = sum_s exp(lse_s - lse) out_s and lse = log sum_s exp(lse_s) over
// the splits s of the keys. out_partial (splits, batch, rows, heads, d) and lse_partial (splits, batch, rows, heads):
// any strides in elements, d contiguous; out (batch, rows, heads, d); lse, when set, (batch, heads, rows) contiguous.
// A row whose splits all saw no key (lse -inf) gets out 0 and lse -inf.
struct CombineParams {
    void const* __restrict__ out_partial;
    float const* __restrict__ lse_partial;
    void* __restrict__ out;
    float* __restrict__ lse;
    int64_t op_split_stride, op_batch_stride, op_row_stride, op_head_stride;
    int64_t lp_split_stride, lp_batch_stride, lp_row_stride, lp_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int splits, b, rows, h, d;
    bool fp32_partials;  // out_partial in fp32 (a split forward's), else in out's dtype
};

// flash_attn_with_kvcache's in-place append of the new keys and values into the cache, with the rotary embedding of
// the new keys and of the queries (common/kernels/append_kv.h). Sequence i's cache rows are those of entry
// cache_batch_idx[i] (or i), or the pages of block_table row i; the new rows go at rows filled + t, filled =
// cache_seqlens[i] clamped to [0, cache_len], each clamped to the last row. With cos (and sin) set, the first rotary_dim
// dims are rotated: new keys at their cache row, query row r at filled (+ r when q_steps), positions clamped to the
// table's rows; pairs (2j, 2j + 1) when interleaved, else (j, j + rotary_dim / 2); in fp32, rounded once.
struct AppendParams {
    void const* __restrict__ q;  // (b, sq, h, d), rotated into q_rot
    void* __restrict__ q_rot;
    void const* __restrict__ k_new;  // (b, s_new, hk, d), or nullptr
    void const* __restrict__ v_new;
    void* __restrict__ k_cache;
    void* __restrict__ v_cache;
    void const* __restrict__ cos;  // (seqlen_ro, rotary_dim / 2) with rows cos_row_stride apart, q's dtype; or nullptr
    void const* __restrict__ sin;
    int const* __restrict__ cache_seqlens;
    int const* __restrict__ cache_batch_idx;  // or nullptr
    int const* __restrict__ block_table;      // or nullptr
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t qr_batch_stride, qr_row_stride, qr_head_stride;
    int64_t kn_batch_stride, kn_row_stride, kn_head_stride;
    int64_t vn_batch_stride, vn_row_stride, vn_head_stride;
    int64_t kc_batch_stride, kc_row_stride, kc_head_stride;  // batch: per cache entry, or per page
    int64_t vc_batch_stride, vc_row_stride, vc_head_stride;
    int64_t cos_row_stride, block_table_stride;
    int b, sq, s_new, h, hk, d;
    int cache_len, cache_entries, page_size;  // cache_entries: entries, or pages, of the caches
    int rotary_dim, seqlen_ro;
    bool interleaved, q_steps;
};

// flash_attn_with_kvcache's paged cache gathered into contiguous copies (common/kernels/gather_pages.h), for a
// forward that would otherwise copy the pages' rows itself: sequence i's rows [0, min(used[i], cache_len)) of k_cache
// and v_cache (pools (pages, page_size, hk, d), rows of block_table row i) into k_out and v_out (b, cache_len, hk, d),
// contiguous. Rows past used[i] are left as they were: the forward masks the keys there and zeroes the values.
struct GatherParams {
    void const* __restrict__ k_cache;
    void const* __restrict__ v_cache;
    void* __restrict__ k_out;
    void* __restrict__ v_out;
    int const* __restrict__ used;         // (b)
    int const* __restrict__ block_table;  // (b, cache_len / page_size), rows block_table_stride apart
    int64_t kc_page_stride, kc_row_stride, kc_head_stride;
    int64_t vc_page_stride, vc_row_stride, vc_head_stride;
    int64_t block_table_stride;
    int b, hk, d, cache_len, page_size, num_pages;
    int rows_per_cta;  // of the b * cache_len rows, in order (set by the launch)
};

}  // namespace flash
