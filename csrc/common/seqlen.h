// The one place where a sequence's rows are resolved, for batched and varlen calls alike (see params.h): the
// schedulers count tiles with seq_rows, and the kernels address their operands through SeqlenInfo.
#pragma once

#include <cstdint>

#include "block_range.h"
#include "params.h"

namespace flash {

// Batch entries of the tensors: one when varlen (packed rows).
__host__ __device__ __forceinline__ int tensor_batches(AttnParams const& params) {
    return params.cu_seqlens_q == nullptr ? params.b : 1;
}

struct SeqRows {
    int start;  // first row in the tensor's batch entry (0 when batched)
    int len;
};

// Rows of sequence b in a tensor of `rows` rows per batch entry. cu_seqlens values are clamped to the tensor, so
// malformed ones (which the host cannot check without a device sync) cannot reach outside it.
__device__ __forceinline__ SeqRows seq_rows(int const* cu_seqlens, int const* seqused, int rows, int b) {
    int start = 0, end = rows;
    if (cu_seqlens != nullptr) {
        start = min(max(cu_seqlens[b], 0), rows);
        end = min(max(cu_seqlens[b + 1], start), rows);
    }
    int len = end - start;
    if (seqused != nullptr) { len = min(len, max(seqused[b], 0)); }
    return {start, len};
}

struct SeqlenInfo {
    int batch;
    SeqRows q, k;

    __device__ __forceinline__ SeqlenInfo(AttnParams const& p, int b)
        : batch(b),
          q(seq_rows(p.cu_seqlens_q, p.seqused_q, p.sq, b)),
          k(seq_rows(p.cu_seqlens_k, p.seqused_k, p.sk, b)) {}

    // Masks align bottom-right per sequence.
    __device__ __forceinline__ AttnWindow window(AttnParams const& p) const {
        return {q.len, k.len, p.window_left, p.window_right};
    }

    // Element offset of (row 0 of this sequence, head) in a query-side or key-side tensor.
    __device__ __forceinline__ int64_t q_offset(int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                                                int head) const {
        return batch * batch_stride + int64_t(q.start) * row_stride + head * head_stride;
    }
    __device__ __forceinline__ int64_t k_offset(int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                                                int head) const {
        return batch * batch_stride + int64_t(k.start) * row_stride + head * head_stride;
    }

    // Index of row 0 of this sequence in lse, dlse and D.
    __device__ __forceinline__ int64_t row_stats_index(AttnParams const& p, int head) const {
        return batch * p.lse_batch_stride + head * p.lse_head_stride + q.start;
    }
};

// A paged cache (FwdParams::block_table): the table slot of the page that holds key row `key` (a shift where the page
// size is a power of two), and a table entry as a page of the pool (clamped to it: entries are not checked).
__device__ __forceinline__ int page_slot(FwdParams const& p, int key) {
    return p.page_shift >= 0 ? key >> p.page_shift : key / p.page_size;
}
__device__ __forceinline__ int pool_page(FwdParams const& p, int entry) { return min(max(entry, 0), p.num_pages - 1); }

// Where row `row` of a kv head's GQA-packed rows (FwdParams::packed_heads: `group`) lies from its first: query
// row / group, head row % group of the kv head's group.
__device__ __forceinline__ int64_t packed_row_offset(int row, int group, int64_t row_stride, int64_t group_stride) {
    unsigned const query = unsigned(row) / unsigned(group);  // unsigned: fewer instructions than a signed division
    return int64_t(query) * row_stride + int64_t(unsigned(row) - query * unsigned(group)) * group_stride;
}

// The stride between `rows` rows where one stride spans them all, else 0: unpacked rows (group 1: row_stride), or
// the GQA-packed rows of a single query, which are its group's heads (group_stride). Such rows load and store as a
// plain tile, with none of packed_row_offset's divisions (a decode step's one query row).
__device__ __forceinline__ int64_t uniform_row_stride(int group, int rows, int64_t row_stride, int64_t group_stride) {
    return group == 1 ? row_stride : rows <= group ? group_stride : 0;
}

}  // namespace flash
