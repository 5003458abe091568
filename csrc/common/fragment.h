// Register fragments as both tiers' kernels use them: an MMA accumulator seen as (rows, cols), and a fragment
// converted to another element type in one vectorized step.
#pragma once

#include <cute/tensor.hpp>
#include <cuda_fp16.h>
#include <cutlass/numeric_conversion.h>

#include <cstdint>
#include <type_traits>

namespace flash {

// An accumulator seen as (rows, cols): m16n8's ((2 cols, 2 rows), MMA_M, MMA_N) as ((2, MMA_M), (2, MMA_N)), and
// wgmma's m64nN ((2 cols, 2 rows, N / 8), MMA_M, MMA_N) as ((2, MMA_M), (2, N / 8, MMA_N)).
template <class Layout>
__device__ __forceinline__ constexpr auto rowcol_layout(Layout const& acc) {
    static_assert(decltype(cute::rank(acc))::value == 3);
    if constexpr (decltype(cute::rank(cute::get<0>(acc)))::value == 2) {
        return cute::make_layout(cute::make_layout(cute::get<0, 1>(acc), cute::get<1>(acc)),
                                 cute::make_layout(cute::get<0, 0>(acc), cute::get<2>(acc)));
    } else {
        return cute::make_layout(cute::make_layout(cute::get<0, 1>(acc), cute::get<1>(acc)),
                                 cute::make_layout(cute::get<0, 0>(acc), cute::get<0, 2>(acc), cute::get<2>(acc)));
    }
}

template <class Tensor_>
__device__ __forceinline__ auto rowcol_view(Tensor_&& t) {
    return cute::make_tensor(t.data(), rowcol_layout(t.layout()));
}

// Converts `src` into the registers of `dst` in storage order (element i of src's storage becomes element i of
// dst's), whatever dst's layout says: a view whose layout permutes a compact fragment, such as an accumulator read as
// an MMA's A operand, takes the result without a copy. Copying a converted fragment into such a view instead moves
// 16-bit values one at a time, which ptxas assembles with byte permutes (a third of the SM90 softmax's instructions).
template <class TensorSrc, class TensorDst>
__device__ __forceinline__ void convert_fragment_into(TensorSrc const& src, TensorDst& dst) {
    using From = typename std::decay_t<TensorSrc>::value_type;
    using To = typename std::decay_t<TensorDst>::value_type;
    constexpr int N = decltype(cute::size(src))::value;
    static_assert(decltype(cute::cosize(src.layout()))::value == N && decltype(cute::size(dst))::value == N &&
                  decltype(cute::cosize(dst.layout()))::value == N);
    cutlass::NumericArrayConverter<To, From, N> convert;
    *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
        convert(*reinterpret_cast<cutlass::Array<From, N> const*>(src.data()));
}

// Element i of 16-bit floats packed two to a 32-bit word (element 2j in word j's low half), as fp32, from its word:
// no 16-bit value is moved into a register of its own.
template <typename T>
__device__ __forceinline__ float packed_element(uint32_t const* words, int i) {
    uint32_t const w = words[i / 2];
    if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
        return __uint_as_float(i % 2 ? w & 0xffff0000u : w << 16);
    } else {
        static_assert(std::is_same_v<T, cutlass::half_t>);
        return __half2float(__ushort_as_half(static_cast<unsigned short>(i % 2 ? w >> 16 : w & 0xffffu)));
    }
}

// `t` converted to To, in a new fragment of the same layout.
template <typename To, class Tensor_>
__device__ __forceinline__ auto convert_fragment(Tensor_ const& t) {
    auto out = cute::make_tensor<To>(t.layout());
    convert_fragment_into(t, out);
    return out;
}

}  // namespace flash
