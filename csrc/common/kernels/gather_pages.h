// A paged cache's used rows gathered into contiguous copies (GatherParams), for the SM90 forward, whose row copies of
// small pages cost more than one gather pass before it where the attention reuses each row enough (kvcache.py). A CTA
// moves rows_per_cta rows of K (blockIdx.y 0) or V (1) in 16-byte vectors: their source offsets are looked up once
// (page table, used count) into shared memory, so that each thread's kGatherVectors loads go out back to back. Rows
// past a sequence's used count are skipped: the pass costs what the used rows cost, not the table's capacity.
#pragma once

#include <cutlass/numeric_types.h>

#include <cstdint>

#include "../params.h"

namespace flash {

constexpr int kGatherThreads = 256;
constexpr int kGatherVectors = 4;  // per thread and round: the loads are issued before the stores
constexpr int kGatherMaxRows = kGatherThreads;  // rows_per_cta's bound: one offset lookup per thread

template <typename Element>
__global__ void __launch_bounds__(kGatherThreads) gather_pages_kernel(__grid_constant__ GatherParams const p) {
    static_assert(16 % sizeof(Element) == 0);
    constexpr int kPerVector = 16 / int(sizeof(Element));
    __shared__ int64_t source[kGatherMaxRows];  // a row's first byte in the pool, or -1: unused
    bool const is_v = blockIdx.y == 1;
    char const* cache = static_cast<char const*>(is_v ? p.v_cache : p.k_cache);
    uint4* out = static_cast<uint4*>(is_v ? p.v_out : p.k_out);
    int64_t const first_row = int64_t(blockIdx.x) * p.rows_per_cta;  // of the (batch, row) rows, flattened
    int const rows = int(min(int64_t(p.rows_per_cta), int64_t(p.b) * p.cache_len - first_row));
    if (int(threadIdx.x) < rows) {
        int64_t const row_all = first_row + threadIdx.x;
        int const batch = int(row_all / p.cache_len), row = int(row_all - int64_t(batch) * p.cache_len);
        int64_t offset = -1;
        if (row < p.used[batch]) {
            int const slot = row / p.page_size;
            int const page = min(max(p.block_table[batch * p.block_table_stride + slot], 0), p.num_pages - 1);
            offset = (int64_t(page) * (is_v ? p.vc_page_stride : p.kc_page_stride) +
                      int64_t(row - slot * p.page_size) * (is_v ? p.vc_row_stride : p.kc_row_stride)) *
                     int64_t(sizeof(Element));
        }
        source[threadIdx.x] = offset;
    }
    __syncthreads();
    // The CTA's vectors in the output's order: (row, head, vector of the head dim).
    int64_t const head_bytes = (is_v ? p.vc_head_stride : p.kc_head_stride) * int64_t(sizeof(Element));
    int const per_head = p.d / kPerVector;
    int const per_row = p.hk * per_head;
    int const vectors = rows * per_row;
    uint4* const out_cta = out + first_row * per_row;
    for (int base = 0; base < vectors; base += kGatherThreads * kGatherVectors) {
        uint4 data[kGatherVectors];
        int dest[kGatherVectors];
#pragma unroll
        for (int i = 0; i < kGatherVectors; ++i) {
            int const v = base + i * kGatherThreads + int(threadIdx.x);
            int const r = v / per_row, rest = v - r * per_row;
            int const head = rest / per_head, vec = rest - head * per_head;
            int64_t const offset = v < vectors ? source[r] : -1;
            dest[i] = offset < 0 ? -1 : v;
            if (offset >= 0) {
                data[i] = *reinterpret_cast<uint4 const*>(cache + offset + head * head_bytes + vec * 16);
            }
        }
#pragma unroll
        for (int i = 0; i < kGatherVectors; ++i) {
            if (dest[i] >= 0) { out_cta[dest[i]] = data[i]; }
        }
    }
}

}  // namespace flash
