// SM80-tier epilogues: an fp32 accumulator tile goes registers -> shared memory -> global memory in 16-byte
// row-contiguous chunks, predicated on the sequence end and the head dim. The forward's output (plus lse), the
// backward's dK and dV, and the dQ conversion all store through store_tile.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include <cmath>

#include "../common/epilogue.h"
#include "../common/lse_merge.h"
#include "../common/params.h"
#include "../common/seqlen.h"
#include "gemm.h"

namespace flash::sm80 {

using namespace cute;

// Stores `acc`, tiled_mma's C fragment of a tile shaped like `s`, converted to Element, through the shared-memory
// tile `s` into the global tile `g`: rows below rows_left, columns below cols.
template <class Traits, class TiledMma, class Acc, class SmemTile, class GmemTile>
__device__ __forceinline__ void store_tile(TiledMma const& tiled_mma, Acc const& acc, SmemTile&& s, GmemTile&& g,
                                           int rows_left, int cols, int tid) {
    Tensor r = convert_fragment<typename Traits::Element>(acc);
    // `s` reuses an operand tile of the main loop (Q in the forward, K and V in the backward) that other threads may
    // still be reading.
    __syncthreads();
    auto smem_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
    auto smem_thr = smem_copy.get_thread_slice(tid);
    copy(smem_copy, smem_thr.retile_S(r), smem_thr.partition_D(s));
    __syncthreads();

    typename Traits::GmemTiledCopyO gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tid);
    Tensor tS = gmem_thr.partition_S(s);
    Tensor tG = gmem_thr.partition_D(g);
    Tensor tC = gmem_thr.partition_D(make_identity_tensor(product_each(shape(s))));
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tG); ++m) {
        if (get<0>(tC(0, m, 0)) < rows_left) {
            CUTE_UNROLL
            for (int k = 0; k < size<2>(tG); ++k) {
                if (get<1>(tC(0, m, k)) < cols) { copy(gmem_copy, tS(_, m, k), tG(_, m, k)); }
            }
        }
    }
}

// The forward's normalised output and its lse (one lane per row).
template <class Traits, class TiledMma, class AccO, int kRows>
__device__ __forceinline__ void store_output(TiledMma const& tiled_mma, AccO const& acc_o, float const (&lse)[kRows],
                                             char* smem, FwdParams const& params, SeqlenInfo const& seq, int m_block,
                                             int head, int tid) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kHeadDim = Traits::kHeadDim;

    int const row0 = m_block * kBlockM;
    Tensor coord_rc = rowcol_view(
        tiled_mma.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    store_lse(params.lse, coord_rc, lse, params, seq, head, row0);

    Tensor sO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
    Tensor mO = head_rows<kHeadDim>(static_cast<Element*>(params.o) + seq.q_offset(params.o_batch_stride,
                                                                                   params.o_row_stride,
                                                                                   params.o_head_stride, head),
                                    seq.q.len, params.o_row_stride);
    Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
    store_tile<Traits>(tiled_mma, acc_o, sO, gO, seq.q.len - row0, params.d, tid);
}

// Warps over keys (FwdTile::warps_over_keys): each warp holds the normalised output and the lse of its share of the
// keys for the tile's rows, in the same fragment layout (one warp's MMA, by lane). Merged into warp 0's registers,
// as the combine merges splits: lse = log sum_w exp(lse_w), O = sum_w exp(lse_w - lse) O_w (a warp that saw no key
// of a row, lse_w = -inf, weighs 0). Returns false in the other warps, which are then done. Takes shared memory that
// the main loop's operands used. upper_rows: whether rows 8-15 hold any of the sequence's rows; a decode step's few
// rows do not, and their outputs are then neither exchanged nor summed (no store reads them).
template <int kWarps, class AccO, int kRows>
__device__ __forceinline__ bool merge_warp_outputs(AccO& acc_o, float (&lse)[kRows], char* smem, int tid,
                                                   bool upper_rows) {
    constexpr int kValues = decltype(size(acc_o))::value;
    constexpr int kTileRows = 8 * kRows;  // an m16 tile: lane / 4 + 8 r
    float* s_lse = reinterpret_cast<float*>(smem);  // [warp][row]
    // [warp - 1][value pair][lane], 8-byte pairs of adjacent columns: conflict-free.
    float2* s_o = reinterpret_cast<float2*>(s_lse + kWarps * kTileRows);
    int const warp = tid / 32, lane = tid % 32;
    __syncthreads();  // every warp is done with the operands
    if (lane % 4 == 0) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) { s_lse[warp * kTileRows + lane / 4 + 8 * r] = lse[r]; }
    }
    __syncthreads();
    auto acc_rc = rowcol_view(acc_o);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
        int const row = lane / 4 + 8 * r;
        float top = -INFINITY;
        CUTE_UNROLL
        for (int w = 0; w < kWarps; ++w) { top = fmaxf(top, s_lse[w * kTileRows + row]); }
        float total = -INFINITY;
        if (top != -INFINITY) {
            float sum = 0.f;
            CUTE_UNROLL
            for (int w = 0; w < kWarps; ++w) { sum += __expf(s_lse[w * kTileRows + row] - top); }
            total = top + __logf(sum);
        }
        float const weight = lse[r] == -INFINITY ? 0.f : __expf(lse[r] - total);  // NaN stays NaN
        lse[r] = total;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(acc_rc); ++c) { acc_rc(r, c) *= weight; }
    }
    // A fragment's values in fours: two adjacent columns of row lane / 4, then the same of row lane / 4 + 8.
    auto const merged = [upper_rows](int i) { return i % 4 < 2 || upper_rows; };
    if (warp > 0) {
        CUTE_UNROLL
        for (int i = 0; i < kValues; i += 2) {
            if (merged(i)) {
                s_o[((warp - 1) * kValues / 2 + i / 2) * 32 + lane] = make_float2(acc_o(i), acc_o(i + 1));
            }
        }
    }
    __syncthreads();
    if (warp > 0) { return false; }
    CUTE_UNROLL
    for (int w = 1; w < kWarps; ++w) {
        CUTE_UNROLL
        for (int i = 0; i < kValues; i += 2) {
            if (merged(i)) {
                float2 const x = s_o[((w - 1) * kValues / 2 + i / 2) * 32 + lane];
                acc_o(i) += x.x;
                acc_o(i + 1) += x.y;
            }
        }
    }
    return true;
}

// The most splits merged inside a cluster (FwdParams): H100s and H200s schedule clusters of up to 16 CTAs (8 without
// cudaFuncAttributeNonPortableClusterSizeAllowed).
constexpr int kMaxClusterSplits = 16;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A 32-bit or 16-byte load from the shared memory of the cluster's CTA `rank`, at the offset that `addr` has in this
// CTA's.
__device__ __forceinline__ float load_cluster_f32(uint32_t addr, uint32_t rank) {
    uint32_t const remote = cute::set_block_rank(addr, rank);
    float x;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(remote) : "memory");
    return x;
}

__device__ __forceinline__ float4 load_cluster_f32x4(uint32_t addr, uint32_t rank) {
    uint32_t const remote = cute::set_block_rank(addr, rank);
    float4 x;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                 : "r"(remote)
                 : "memory");
    return x;
}
#endif

// Split-KV inside a cluster (FwdParams: num_splits > 1 without o_partial; sm_90 code, launched by launch_fwd): the
// num_splits CTAs of a query tile form one cluster. Each stages its chunk's output (normalised by its own sum, fp32)
// and lse in its shared memory; after a cluster barrier, each CTA merges 1 / num_splits of the tile's (row, 4-column)
// groups, reading every CTA's staged values through distributed shared memory, as the combine kernel merges partials
// from global memory, and stores o and lse. A second barrier keeps each CTA's shared memory until all have read it.
// holds_output: whether this thread holds part of acc_o (tid: its index in tiled_mma_o).
template <class Traits, class TiledMma, class AccO, int kRows>
__device__ __forceinline__ void merge_splits_in_cluster(TiledMma const& tiled_mma_o, AccO const& acc_o,
                                                        float const (&lse)[kRows], bool holds_output, char* smem,
                                                        FwdParams const& params, SeqlenInfo const& seq, int m_block,
                                                        int head, int tid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kThreads = Traits::kNThreads;
    // Floats per staged row: 8 more than the row skews the rows of a quad's 8-byte stores over all 32 banks.
    constexpr int kStride = kHeadDim + 8;
    static_assert((kBlockM + kBlockM * kStride) * sizeof(float) <= Traits::kSmemBytes);
    float* s_lse = reinterpret_cast<float*>(smem);
    float* s_o = s_lse + kBlockM;  // 16-byte aligned: kBlockM is a multiple of 16
    int const row0 = m_block * kBlockM;
    __syncthreads();  // the main loop (and the warps' merge) is done with this shared memory
    if (holds_output) {
        auto const coord_rc = rowcol_view(
            tiled_mma_o.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
        auto const acc_rc = rowcol_view(acc_o);
        CUTE_UNROLL
        for (int r = 0; r < size<0>(acc_rc); ++r) {
            int const row = get<0>(coord_rc(r, 0));
            if (get<1>(coord_rc(r, 0)) == 0) { s_lse[row] = lse[r]; }
            CUTE_UNROLL
            for (int c = 0; c < size<1>(acc_rc); c += 2) {
                *reinterpret_cast<float2*>(s_o + row * kStride + get<1>(coord_rc(r, c))) =
                    make_float2(acc_rc(r, c), acc_rc(r, c + 1));
            }
        }
    }
    cute::cluster_arrive();  // release: the staged values
    cute::cluster_wait();    // acquire: every CTA's

    int const splits = params.num_splits;
    int const groups = params.d / 4;  // d is a multiple of 8
    int const rows = min(kBlockM, seq.q.len - row0);
    uint32_t const lse_addr = uint32_t(__cvta_generic_to_shared(s_lse));
    uint32_t const o_addr = uint32_t(__cvta_generic_to_shared(s_o));
    // The sequence's first row of the head; its rows GQA-packed (FwdParams::packed_heads, 1 for none).
    Element* o = static_cast<Element*>(params.o) +
                 seq.q_offset(params.o_batch_stride, params.o_row_stride, params.o_head_stride, head);
    float* lse_out = params.lse + seq.row_stats_index(params, head);
    for (int u = int(cute::block_rank_in_cluster()) * kThreads + int(threadIdx.x); u < rows * groups;
         u += splits * kThreads) {
        int const row = u / groups, col = u % groups * 4;
        // Every split's loads are issued before any is used, as in the combine kernel.
        float l[kMaxClusterSplits];
        float4 x[kMaxClusterSplits];
        CUTE_UNROLL
        for (int s = 0; s < kMaxClusterSplits; ++s) {
            l[s] = -INFINITY;  // a missing split weighs 0
            if (s < splits) {
                l[s] = load_cluster_f32(lse_addr + row * sizeof(float), s);
                x[s] = load_cluster_f32x4(o_addr + (row * kStride + col) * sizeof(float), s);
            }
        }
        LseMerge<4> merge;
        merge.add(l, splits, [&](int s) { return cutlass::Array<float, 4>{x[s].x, x[s].y, x[s].z, x[s].w}; });
        cutlass::Array<float, 4> const merged = merge.output();
        cutlass::AlignedArray<Element, 4> out;
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) { out[j] = Element(merged[j]); }
        int const g = params.packed_heads;
        *reinterpret_cast<cutlass::AlignedArray<Element, 4>*>(
            o + packed_row_offset(row0 + row, g, params.o_row_stride, params.o_group_stride) + col) = out;
        if (col == 0) {
            lse_out[packed_row_offset(row0 + row, g, params.lse_row_stride, params.lse_group_stride)] = merge.lse();
        }
    }
    // This CTA is done reading the others' shared memory: relaxed, since each remote load's value has been stored to
    // global memory above (the loop reconverges before the arrive), so no load is in flight; a release arrive would
    // add a GPU-scope memory barrier behind those stores.
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
#endif
}

}  // namespace flash::sm80
