// What the tiers' epilogues share: the lse of a tile's rows, from the accumulator's (row, col) coordinates, register
// stores of adjacent column pairs, and a split-KV CTA's partial output.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include <type_traits>

#include "fragment.h"
#include "params.h"
#include "seqlen.h"

namespace flash {

// coord_rc: this thread's (row, col) coordinates in the tile, seen as (rows, cols); lse: one value per row, stored
// into `dest` in the layout of params.lse (the lse, or one split's partial lse). The first lane of each quad holds
// column 0 of its rows and writes them; rows at or past the sequence's end are skipped. kPackedRows: the rows are
// GQA-packed (FwdParams::packed_heads).
template <bool kPackedRows = false, class CoordRC, int kRows>
__device__ __forceinline__ void store_lse(float* dest, CoordRC const& coord_rc, float const (&lse)[kRows],
                                          FwdParams const& params, SeqlenInfo const& seq, int head, int row0) {
    if (cute::get<1>(coord_rc(0, 0)) != 0) { return; }
    float* lse_first = dest + seq.row_stats_index(params, head);
    // Read before the stores, which could alias params for all the compiler knows.
    int const group = params.packed_heads;
    int64_t const row_stride = params.lse_row_stride, group_stride = params.lse_group_stride;
    int64_t const uniform = kPackedRows ? uniform_row_stride(group, seq.q.len, row_stride, group_stride) : 1;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
        int const row = row0 + cute::get<0>(coord_rc(r, 0));
        if (row < seq.q.len) {
            lse_first[uniform != 0 ? row * uniform : packed_row_offset(row, group, row_stride, group_stride)] = lse[r];
        }
    }
}

// A tile row's offset from the tile's first row: row * rows for a stride, or rows(row) for rows that lie apart.
template <class Rows>
__device__ __forceinline__ int64_t row_offset(Rows const& rows, int row) {
    if constexpr (std::is_integral_v<Rows>) {
        return int64_t(row) * rows;
    } else {
        return rows(row);
    }
}

// Stores a fragment seen as (rows, cols) from registers, each value through to_element, in pairs of adjacent columns
// (c, c + 1), c even: rows below rows_left, columns below cols, of the tile at `base` whose rows lie `rows` apart
// (row_offset).
template <class CoordRC, class FragRC, typename Element, class Rows, class ToElement>
__device__ __forceinline__ void store_row_pairs(CoordRC const& coord_rc, FragRC const& frag_rc, Element* base,
                                                Rows const& rows, int rows_left, int cols, ToElement to_element) {
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(frag_rc); ++r) {
        int const row = cute::get<0>(coord_rc(r, 0));
        if (row < rows_left) {
            Element* const row_base = base + row_offset(rows, row);
            CUTE_UNROLL
            for (int c = 0; c < cute::size<1>(frag_rc); c += 2) {
                int const col = cute::get<1>(coord_rc(r, c));
                if (col < cols) {
                    cutlass::AlignedArray<Element, 2> pair;
                    pair[0] = to_element(frag_rc(r, c));
                    pair[1] = to_element(frag_rc(r, c + 1));
                    *reinterpret_cast<cutlass::AlignedArray<Element, 2>*>(row_base + col) = pair;
                }
            }
        }
    }
}

// A tile's output and lse, straight from registers (each thread holds pairs of adjacent columns): for a decode tile
// of few (valid) rows these stores are few. store_partial: a split-KV CTA's output (normalised by its chunk's own
// sum) in fp32 and its lse, into split `split` of the partials; store_output_rows: the output in Element and the lse.
// o: the sequence's first row of the head; kPackedRows: its rows are GQA-packed (FwdParams::packed_heads), and o's
// and the lse's layouts those of params (o_row_stride and o_group_stride apart, the partials laid out as o).
template <class Traits, bool kPackedRows, class TiledMma, class AccO, int kRows, typename Out, class ToOut>
__device__ __forceinline__ void store_rows(TiledMma const& tiled_mma, AccO const& acc_o, float const (&lse)[kRows],
                                           float* lse_dest, Out* o, FwdParams const& params, SeqlenInfo const& seq,
                                           int m_block, int head, int tid, ToOut to_out) {
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kHeadDim = Traits::kHeadDim;
    int const row0 = m_block * kBlockM;
    auto const coord_rc = rowcol_view(tiled_mma.get_thread_slice(tid).partition_C(
        cute::make_identity_tensor(cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{})));
    store_lse<kPackedRows>(lse_dest, coord_rc, lse, params, seq, head, row0);
    int64_t const uniform = kPackedRows ? uniform_row_stride(params.packed_heads, seq.q.len, params.o_row_stride,
                                                             params.o_group_stride)
                                        : params.o_row_stride;
    if (uniform != 0) {
        store_row_pairs(coord_rc, rowcol_view(acc_o), o + row0 * uniform, uniform, seq.q.len - row0, params.d, to_out);
    } else {
        // By value: the stores between the calls could alias params for all the compiler knows.
        auto const rows = [row0, group = params.packed_heads, row_stride = params.o_row_stride,
                           group_stride = params.o_group_stride](int row) {
            return packed_row_offset(row0 + row, group, row_stride, group_stride);
        };
        store_row_pairs(coord_rc, rowcol_view(acc_o), o, rows, seq.q.len - row0, params.d, to_out);
    }
}

template <class Traits, bool kPackedRows = false, class TiledMma, class AccO, int kRows>
__device__ __forceinline__ void store_partial(TiledMma const& tiled_mma, AccO const& acc_o, float const (&lse)[kRows],
                                              FwdParams const& params, SeqlenInfo const& seq, int m_block, int head,
                                              int split, int tid) {
    float* o = params.o_partial + split * params.o_partial_split_stride +
               seq.q_offset(params.o_batch_stride, params.o_row_stride, params.o_head_stride, head);
    store_rows<Traits, kPackedRows>(tiled_mma, acc_o, lse, params.lse_partial + split * params.lse_partial_split_stride,
                                    o, params, seq, m_block, head, tid, [](float x) { return x; });
}

template <class Traits, bool kPackedRows = false, class TiledMma, class AccO, int kRows>
__device__ __forceinline__ void store_output_rows(TiledMma const& tiled_mma, AccO const& acc_o,
                                                  float const (&lse)[kRows], FwdParams const& params,
                                                  SeqlenInfo const& seq, int m_block, int head, int tid) {
    using Element = typename Traits::Element;
    Element* o = static_cast<Element*>(params.o) +
                 seq.q_offset(params.o_batch_stride, params.o_row_stride, params.o_head_stride, head);
    store_rows<Traits, kPackedRows>(tiled_mma, acc_o, lse, params.lse, o, params, seq, m_block, head, tid,
                                    [](float x) { return Element(x); });
}

}  // namespace flash
