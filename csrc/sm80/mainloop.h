// SM80-tier mainloop pieces: predicated cp.async tile loads, the two GEMMs (S = Q K^T from shared memory, O += P V
// with P in registers) with ldmatrix software-pipelined one k-slice ahead, and accumulator layout views.
#pragma once

#include <cute/tensor.hpp>

namespace flash::sm80 {

using namespace cute;

// Copies a (CPY, CPY_ROWS, CPY_COLS) partition of a kRows-row tile from global to shared memory with zero-filling
// cp.async: a chunk whose row lies past `rows_left` or whose column lies past `cols` reads nothing and writes zeros, so
// padded keys never inject NaN into P V and padded head-dim columns add nothing. The predicates do not branch, so the
// loads keep one address chain per tile. kCheckRows = false promises that every row exists (all key blocks but the
// last one): the row coordinates then need no registers, and a thread whose columns all exist copies unpredicated.
template <bool kCheckRows, class TiledCopy, class TensorG, class TensorS, class TensorC>
__device__ __forceinline__ void load_tile(TiledCopy const& tiled_copy, TensorG const& g, TensorS&& s,
                                          TensorC const& coord, int rows_left, int cols) {
    if (!kCheckRows && get<1>(coord(0, 0, size<2>(s) - 1)) < cols) {
        copy(tiled_copy, g, s);
        return;
    }
    CUTE_UNROLL
    for (int m = 0; m < size<1>(s); ++m) {
        bool const row_ok = !kCheckRows || get<0>(coord(0, m, 0)) < rows_left;
        CUTE_UNROLL
        for (int k = 0; k < size<2>(s); ++k) {
            copy(tiled_copy.with(row_ok && get<1>(coord(0, m, k)) < cols), g(_, m, k), s(_, m, k));
        }
    }
}

// The same copy as load_tile, as a branch: whole tiles copy unpredicated, others copy or zero each chunk. Kept for the
// head dims where it measured faster in the key loop (d = 128: 4% on an H200, benchmark/RESULTS.md); it holds one
// 64-bit offset per row chunk for the slow path, which costs registers elsewhere.
template <int kRows, int kCols, class TiledCopy, class TensorG, class TensorS, class TensorC>
__device__ __forceinline__ void load_tile_branching(TiledCopy const& tiled_copy, TensorG const& g, TensorS&& s,
                                                    TensorC const& coord, int rows_left, int cols) {
    if (rows_left >= kRows && cols == kCols) {
        copy(tiled_copy, g, s);
        return;
    }
    CUTE_UNROLL
    for (int m = 0; m < size<1>(s); ++m) {
        bool const row_ok = get<0>(coord(0, m, 0)) < rows_left;
        CUTE_UNROLL
        for (int k = 0; k < size<2>(s); ++k) {
            if (row_ok && get<1>(coord(0, m, k)) < cols) {
                copy(tiled_copy, g(_, m, k), s(_, m, k));
            } else {
                clear(s(_, m, k));
            }
        }
    }
}

// acc += A B^T with both operands in shared memory; the ldmatrix of slice k+1 is issued before the MMAs of slice k.
template <class TiledMma, class Acc, class RegA, class RegB, class SmemA, class SmemB, class CopyA, class CopyB>
__device__ __forceinline__ void gemm_ss(TiledMma const& mma, Acc& acc, RegA& rA, RegB& rB, SmemA const& sA,
                                        SmemB const& sB, CopyA const& copy_a, CopyB const& copy_b, int tid) {
    auto thr_copy_a = copy_a.get_thread_slice(tid);
    auto thr_copy_b = copy_b.get_thread_slice(tid);
    auto rA_view = thr_copy_a.retile_D(rA);
    auto rB_view = thr_copy_b.retile_D(rB);
    copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
    copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rA); ++k) {
        if (k + 1 < size<2>(rA)) {
            copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
            copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
        }
        gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    }
}

// acc += A B^T with A already in registers (the probabilities P) and B in shared memory.
template <class TiledMma, class Acc, class RegA, class RegB, class SmemB, class CopyB>
__device__ __forceinline__ void gemm_rs(TiledMma const& mma, Acc& acc, RegA const& rA, RegB& rB, SmemB const& sB,
                                        CopyB const& copy_b, int tid) {
    auto thr_copy_b = copy_b.get_thread_slice(tid);
    auto rB_view = thr_copy_b.retile_D(rB);
    copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rA); ++k) {
        if (k + 1 < size<2>(rA)) { copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1)); }
        gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    }
}

// The m16n8 accumulator ((2 cols, 2 rows), MMA_M, MMA_N) seen as (rows, cols) = ((2, MMA_M), (2, MMA_N)).
template <class Layout>
__device__ __forceinline__ constexpr auto rowcol_layout(Layout const& acc) {
    static_assert(decltype(rank(acc))::value == 3);
    return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

template <class Tensor_>
__device__ __forceinline__ auto rowcol_view(Tensor_&& t) {
    return make_tensor(t.data(), rowcol_layout(t.layout()));
}

// The same accumulator registers read as the A operand of m16n8k16: two n8 tiles form one k16 slice, so P never
// leaves registers. ((2, 2), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, MMA_N / 2).
template <class Layout>
__device__ __forceinline__ constexpr auto acc_as_a_operand(Layout const& acc) {
    auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
    return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

template <typename To, class Tensor_>
__device__ __forceinline__ auto convert_fragment(Tensor_ const& t) {
    using From = typename std::decay_t<Tensor_>::value_type;
    constexpr int N = decltype(size(t))::value;
    cutlass::NumericArrayConverter<To, From, N> convert;
    auto out = make_tensor<To>(t.layout());
    *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
        convert(*reinterpret_cast<cutlass::Array<From, N> const*>(t.data()));
    return out;
}

}  // namespace flash::sm80
