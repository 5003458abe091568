// Tile shapes, shared-memory layouts, MMA and copy atoms of the SM80-tier forward kernel.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flash::sm80 {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_, typename Element_>
struct FwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    // K/V ring depth: block n + kStages - 1 is loading while block n is consumed. 1: single K and V buffers whose
    // loads alternate with the two GEMMs (see fwd_kernel.h).
    static constexpr int kStages = kStages_;
    static_assert(kStages >= 1);
    static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row MMA tiles");
    static_assert(kHeadDim % 32 == 0 && kBlockN % 32 == 0);

    // m16n8k16 with fp32 accumulation; warps tile M, each owning kBlockM / kNWarps rows, so the softmax of a row stays
    // inside one warp (a quad of lanes).
    using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                     SM80_16x8x16_F32BF16BF16F32_TN>;
    using TiledMma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

    // Rows of 64 elements (128 B) swizzled so that both the 16-byte cp.async writes and the ldmatrix reads (normal and
    // transposed) hit distinct banks.
    static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
    static constexpr int kSwizzleBits = kSmemRowElems == 64 ? 3 : 2;
    using SmemLayoutAtom = decltype(composition(
        Swizzle<kSwizzleBits, 3, 3>{},
        Layout<Shape<_8, Int<kSmemRowElems>>, Stride<Int<kSmemRowElems>, _1>>{}));
    using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
    // V seen as (d, n, stage): the B operand of O = P V, read with transposing ldmatrix.
    using SmemLayoutVt = decltype(composition(
        SmemLayoutKV{},
        make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                    make_stride(Int<kBlockN>{}, _1{}, Int<kBlockN * kHeadDim>{}))));

    static constexpr int kSmemQElems = cosize_v<SmemLayoutQ>;
    static constexpr int kSmemKVElems = cosize_v<SmemLayoutKV>;
    // Q, then K stages, then V stages; the output tile reuses Q's space.
    static constexpr int kSmemBytes = (kSmemQElems + 2 * kSmemKVElems) * int(sizeof(Element));

    // gmem -> smem: 16 bytes per thread per copy (zero-filling cp.async, see load_tile), a row of kSmemRowElems covered
    // by consecutive threads.
    static constexpr int kThreadsPerRow = kSmemRowElems / 8;
    static_assert(kNThreads % kThreadsPerRow == 0);
    using GmemThreadLayout = Layout<Shape<Int<kNThreads / kThreadsPerRow>, Int<kThreadsPerRow>>,
                                    Stride<Int<kThreadsPerRow>, _1>>;
    using GmemTiledCopyQKV =
        decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
                                 GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));
    using GmemTiledCopyO = decltype(make_tiled_copy(
        Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{}, GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));

    using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
    using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
    // Accumulator fragments hold pairs of adjacent columns: 32-bit stores into the output tile.
    using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<2 * sizeof_bits_v<Element>>, Element>;
};

}  // namespace flash::sm80
