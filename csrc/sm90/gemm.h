// SM90-tier wgmma helpers for both directions: an accumulator read as the next GEMM's register A operand, and one
// warpgroup's GEMM over every k slice issued as one asynchronous batch.
#pragma once

#include <cute/tensor.hpp>

#include <type_traits>

namespace flash::sm90 {

using namespace cute;

// The registers of an m64nN accumulator ((2, 2, N / 8), MMA_M, MMA_N) read as the A operand of an m64nKk16 wgmma
// ((2, 2, 2), MMA_M, K / 16): two n8 blocks form one k16 slice, so P never leaves registers.
template <class Layout>
__device__ __forceinline__ constexpr auto acc_as_a_operand(Layout const& acc) {
    auto l = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
    return make_layout(make_layout(get<0>(l), get<1>(l), get<2, 0>(l)), get<1>(acc),
                       coalesce(make_layout(get<2, 1>(l), get<2>(acc))));
}

// Slice k of a shared-memory operand's descriptor fragment, its descriptor advanced by one 64-bit add. CuTe's
// DescriptorIterator adds to the low word and copies the high one, which ptxas re-materializes in a uniform register
// pair before every wgmma (a UIADD3 and a UMOV each); a 64-bit add is one UIADD3.64. The start address field (bits
// 0-13) holds a shared-memory address >> 4, below 2^14, so the add never carries into the fields above it.
template <class Frag>
__device__ __forceinline__ auto descriptor_slice(Frag const& frag, int k) {
    if constexpr (std::is_base_of_v<GMMA::DescriptorIterator, std::decay_t<decltype(frag.data())>>) {
        auto [layout, offset] = slice_and_offset(make_coord(_, _, k), frag.layout());
        GmmaDescriptor desc;
        desc.desc_ = frag.data().desc_.desc_ + uint64_t(offset);
        return make_tensor(GMMA::DescriptorIterator{desc}, layout);
    } else {
        return frag(_, _, k);
    }
}

// Issues acc (+)= A B over every k slice as one wgmma batch of this warpgroup; the caller waits with
// warpgroup_wait<N>, so that the GEMM runs while it works.
template <bool kZeroInit, class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void gemm(TiledMma& tiled_mma, FragA& a, FragB const& b, Acc& acc) {
    constexpr bool kAInRegisters = !std::is_base_of_v<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>;
    if constexpr (kAInRegisters) { warpgroup_fence_operand(a); }
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    tiled_mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a); ++k) {
        cute::gemm(tiled_mma, descriptor_slice(a, k), descriptor_slice(b, k), acc);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(acc);
    if constexpr (kAInRegisters) { warpgroup_fence_operand(a); }
}

}  // namespace flash::sm90
