// SM80-tier GEMM and copy primitives that the kernels compose: predicated cp.async tile loads, ldmatrix operands
// (S = Q K^T from shared memory, O += P V with P in registers) with ldmatrix software-pipelined one k-slice ahead, and
// P's registers as an A operand.
#pragma once

#include <cute/tensor.hpp>

#include "../common/fragment.h"

namespace flash::sm80 {

using namespace cute;

// Copies a (CPY, CPY_ROWS, CPY_COLS) partition of a kRows-row tile from global to shared memory with zero-filling
// cp.async: a chunk whose row lies past `rows_left` or whose column lies past `cols` reads nothing and writes zeros, so
// padded keys never inject NaN into P V and padded head-dim columns add nothing. The predicates do not branch, so the
// loads keep one address chain per tile. kCheckRows = false promises that every row exists (all key blocks but the
// last one): the row coordinates then need no registers, and a thread whose columns all exist copies unpredicated.
// The rows of one sequence and head of an operand, from its first row (the operand's base plus SeqlenInfo::q_offset
// or k_offset), as a (rows, kHeadDim) global tensor, rows row_stride elements apart.
template <int kHeadDim, class Element>
__device__ __forceinline__ auto head_rows(Element* first_row, int rows, int64_t row_stride) {
    return make_tensor(make_gmem_ptr(first_row), make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
}

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

// The rows of a load_rows tile whose addresses one lane makes: its i-th (i < kCount) is tile row row(coord, i), or
// -1 where the lane makes fewer.
template <int kThreadsPerRow, class TensorC>
struct LaneRows {
    static constexpr int kRows = decltype(size<1>(std::declval<TensorC>()))::value;
    static constexpr int kCount = (kRows + kThreadsPerRow - 1) / kThreadsPerRow;
    static_assert(32 % kThreadsPerRow == 0, "a row's lanes within one warp");

    __device__ __forceinline__ static int row(TensorC const& coord, int i) {
        int const m = int(threadIdx.x % kThreadsPerRow) + i * kThreadsPerRow;
        return m < kRows ? int(get<0>(coord(0, m, 0))) : -1;
    }
};

// load_tile for a tile whose rows lie apart (a paged cache): row r of the tile starts at row_ptr(r, i), where r is
// this lane's i-th row of LaneRows, nullptr past the sequence (zero-filled, from the address `valid`, which a
// predicated-off cp.async does not read); g_like is a partition of a global tile of the same shape, for its copy
// layout. A row's address costs a division, a page-table load and 64-bit arithmetic (~60 instructions), and the
// kThreadsPerRow consecutive lanes that copy a row would each compute it: instead lane i of them computes rows i,
// i + kThreadsPerRow, ... of their rows, and each lane takes the addresses it needs by warp shuffle.
template <int kThreadsPerRow, class TiledCopy, class TensorG, class TensorS, class TensorC, class RowPtr, typename T>
__device__ __forceinline__ void load_rows(TiledCopy const& tiled_copy, TensorG const& g_like, TensorS&& s,
                                          TensorC const& coord, RowPtr const& row_ptr, T const* valid, int cols) {
    using Lane = LaneRows<kThreadsPerRow, TensorC>;
    constexpr int kRows = decltype(size<1>(s))::value;
    static_assert(kRows == Lane::kRows);
    int const lane = int(threadIdx.x % 32);
    int const sub = lane % kThreadsPerRow;
    unsigned long long mine[Lane::kCount];
    CUTE_UNROLL
    for (int i = 0; i < Lane::kCount; ++i) {
        int const row = Lane::row(coord, i);
        mine[i] = row >= 0 ? reinterpret_cast<unsigned long long>(row_ptr(row, i)) : 0ull;
    }
    CUTE_UNROLL
    for (int m = 0; m < kRows; ++m) {
        auto const* src = reinterpret_cast<T const*>(
            __shfl_sync(0xffffffffu, mine[m / kThreadsPerRow], lane - sub + m % kThreadsPerRow));
        CUTE_UNROLL
        for (int k = 0; k < size<2>(s); ++k) {
            int const col = get<1>(coord(0, m, k));
            Tensor from = make_tensor(make_gmem_ptr(src != nullptr ? src + col : valid), g_like(_, m, k).layout());
            copy(tiled_copy.with(src != nullptr && col < cols), from, s(_, m, k));
        }
    }
}

// A thread's ldmatrix partition of a swizzled shared-memory tile, addressed from one held value per operand.
// The swizzle Sw is linear over XOR, and Sw(x + y) = Sw(x) + y when y is a multiple of its period P. A thread's own
// offset t in an ldmatrix partition is a row start plus 0 or 8 columns, while the operand's slices step by whole
// 16-column groups or by multiples of P, so t + s never carries below P and
//   Sw(t + s) = (Sw(t) ^ Sw(s mod P)) + (s - s mod P):
// one LOP3 per slice from Sw(t). Left to itself, the compiler hoists one address per XOR pattern out of the key loop
// (four per operand), and those registers are what made ptxas spill.
template <class Element, class Swizzle_, class Layout_>
struct XorSmemOperand {
    static constexpr int kPeriod = 1 << (Swizzle_::num_base + Swizzle_::num_shft + Swizzle_::num_bits);
    static constexpr int kChunk = 1 << Swizzle_::num_base;  // elements that the swizzle moves together
    static_assert(Swizzle_::num_shft >= Swizzle_::num_bits && is_static_v<Layout_>);

    Element* ptr;  // tile start, plus whole periods (stages)
    int base;      // Sw(t)

    // The ldmatrix source of slice (i, j): its copy mode, which must stay inside one chunk.
    __device__ __forceinline__ auto operator()(int i, int j) const {
        auto const [chunk, s] = slice_and_offset(make_coord(_, i, j), Layout_{});
        static_assert(cosize(std::decay_t<decltype(chunk)>{}) <= kChunk);
        int const s_lo = s & (kPeriod - 1);
        return make_tensor(make_smem_ptr(ptr + ((base ^ Swizzle_{}(s_lo)) + (s - s_lo))), chunk);
    }

    // The operand of one K/V stage (a trailing mode whose stride is a multiple of the period), taken once per key
    // block. Its base is made opaque there, so the slice addresses are derived inside the key loop instead of being
    // held across it; Q's, the same in every block, stay hoisted (the split measured spill-free on every tile).
    __device__ __forceinline__ auto stage(int i) const {
        static_assert(rank_v<Layout_> == 4);
        static_assert([] {
            for (int j = 0; j < size<3>(Layout_{}); ++j) {
                if (Layout_{}(0, 0, 0, j) % kPeriod != 0) { return false; }
            }
            return true;
        }());
        return XorSmemOperand<Element, Swizzle_, decltype(take<0, 3>(Layout_{}))>{ptr + Layout_{}(0, 0, 0, i),
                                                                                  opaque().base};
    }

    // The same operand with its base made opaque, taken inside a loop: the slice addresses are then derived there
    // instead of being held across the loop.
    __device__ __forceinline__ XorSmemOperand opaque() const {
        int opaque_base = base;
        asm volatile("" : "+r"(opaque_base));
        return {ptr, opaque_base};
    }
};

// The thread's ldmatrix partition of the swizzled smem tile `tile` (layout Sw o L, L static) under `thr_copy`.
// (CuTe's own partition of a swizzled tile turns the XOR into per-thread runtime strides, which the compiler combines
// into one held address per XOR pattern.)
template <class ThrCopy, class SmemTensor>
__device__ __forceinline__ auto make_xor_operand(ThrCopy const& thr_copy, SmemTensor const& tile) {
    using Element = typename std::decay_t<SmemTensor>::value_type;
    auto const& layout = tile.layout();
    Element* const ptr = raw_pointer_cast(tile.data());
    Tensor unswizzled = thr_copy.partition_S(make_tensor(tile.data(), layout.layout_b()));
    int const t = int(raw_pointer_cast(unswizzled.data()) - ptr);
    return XorSmemOperand<Element, std::decay_t<decltype(layout.layout_a())>, decltype(unswizzled.layout())>{
        ptr, layout.layout_a()(t)};
}

// Copies k-slice k of an smem operand into its register view (rank 3: copy mode, rows, k).
template <class Copy, class Operand, class RegView>
__device__ __forceinline__ void load_k_slice(Copy const& copy_op, Operand const& s, RegView& r, int k) {
    CUTE_UNROLL
    for (int i = 0; i < size<1>(r); ++i) { copy(copy_op, s(i, k), r(_, i, k)); }
}

// acc += A B^T with both operands in shared memory; the ldmatrix of slice k+1 is issued before the MMAs of slice k.
template <class TiledMma, class Acc, class RegA, class RegB, class SmemA, class SmemB, class CopyA, class CopyB>
__device__ __forceinline__ void gemm_ss(TiledMma const& mma, Acc& acc, RegA& rA, RegB& rB, SmemA const& sA,
                                        SmemB const& sB, CopyA const& copy_a, CopyB const& copy_b, int tid) {
    auto rA_view = copy_a.get_thread_slice(tid).retile_D(rA);
    auto rB_view = copy_b.get_thread_slice(tid).retile_D(rB);
    load_k_slice(copy_a, sA, rA_view, 0);
    load_k_slice(copy_b, sB, rB_view, 0);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rA); ++k) {
        if (k + 1 < size<2>(rA)) {
            load_k_slice(copy_a, sA, rA_view, k + 1);
            load_k_slice(copy_b, sB, rB_view, k + 1);
        }
        gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    }
}

// acc += A B^T with A already in registers (the probabilities P) and B in shared memory.
template <class TiledMma, class Acc, class RegA, class RegB, class SmemB, class CopyB>
__device__ __forceinline__ void gemm_rs(TiledMma const& mma, Acc& acc, RegA const& rA, RegB& rB, SmemB const& sB,
                                        CopyB const& copy_b, int tid) {
    auto rB_view = copy_b.get_thread_slice(tid).retile_D(rB);
    load_k_slice(copy_b, sB, rB_view, 0);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rA); ++k) {
        if (k + 1 < size<2>(rA)) { load_k_slice(copy_b, sB, rB_view, k + 1); }
        gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    }
}

// The same accumulator registers read as the A operand of m16n8k16: two n8 tiles form one k16 slice, so P never
// leaves registers. ((2, 2), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, MMA_N / 2).
template <class Layout>
__device__ __forceinline__ constexpr auto acc_as_a_operand(Layout const& acc) {
    auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
    return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

}  // namespace flash::sm80
