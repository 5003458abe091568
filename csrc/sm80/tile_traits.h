// Tile shapes, shared-memory layouts, MMA and copy atoms of the SM80-tier kernels: what both directions share
// (TileBase), then each direction's tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "../common/params.h"

namespace flash::sm80 {

using namespace cute;

// The (cols, rows[, stage]) view of a (rows, cols[, stage]) shared-memory layout: the operand that a transposing
// ldmatrix reads, over the same bytes.
template <class Layout_>
constexpr auto transposed_view(Layout_ const& l) {
    constexpr int kRows = size<0>(Layout_{}), kCols = size<1>(Layout_{});
    if constexpr (rank_v<Layout_> == 2) {
        return composition(l, make_layout(Shape<Int<kCols>, Int<kRows>>{}, Stride<Int<kRows>, _1>{}));
    } else {
        constexpr int kStages = size<2>(Layout_{});
        return composition(l, make_layout(Shape<Int<kCols>, Int<kRows>, Int<kStages>>{},
                                          Stride<Int<kRows>, _1, Int<kRows * kCols>>{}));
    }
}

template <int kHeadDim_, int kNWarps_, typename Element_>
struct TileBase {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    static_assert(kHeadDim % 32 == 0);

    // m16n8k16 with fp32 accumulation.
    using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                     SM80_16x8x16_F32BF16BF16F32_TN>;
    // kWarpsM x kWarpsN warps, each owning 16 x 16 blocks of the output, so that a B operand is one ldmatrix.x4.
    template <int kWarpsM>
    using TiledMmaWarps = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kWarpsM>, Int<kNWarps / kWarpsM>, _1>>,
                                   Tile<Int<16 * kWarpsM>, Int<16 * (kNWarps / kWarpsM)>, _16>>;

    // Rows of 64 elements (128 B) swizzled so that both the 16-byte cp.async writes and the ldmatrix reads (normal and
    // transposed) hit distinct banks.
    template <int kCols>
    using SmemLayoutAtomFor = decltype(composition(
        Swizzle<kCols % 64 == 0 ? 3 : 2, 3, 3>{},
        Layout<Shape<_8, Int<kCols % 64 == 0 ? 64 : 32>>, Stride<Int<kCols % 64 == 0 ? 64 : 32>, _1>>{}));
    using SmemLayoutAtom = SmemLayoutAtomFor<kHeadDim>;
    static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;

    // gmem <-> smem: 16 bytes per thread per copy (zero-filling cp.async on loads, see load_tile), a row of
    // kSmemRowElems covered by consecutive threads.
    static constexpr int kThreadsPerRow = kSmemRowElems / 8;
    static_assert(kNThreads % kThreadsPerRow == 0);
    // Rows one copy covers (thread t copies row t / kThreadsPerRow): a tile of fewer rows would have the others'
    // threads write past it (CuTe extends the partition), see fwd_kernel's Q load.
    static constexpr int kCopyRows = kNThreads / kThreadsPerRow;
    using GmemThreadLayout = Layout<Shape<Int<kCopyRows>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
    using GmemTiledCopyQKV =
        decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
                                 GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));
    using GmemTiledCopyO = decltype(make_tiled_copy(
        Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{}, GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));

    using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
    using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
    // Accumulator fragments hold pairs of adjacent columns: 32-bit stores into shared memory.
    using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<2 * sizeof_bits_v<Element>>, Element>;
};

// A forward tile: block_m query rows over `warps` warps, key blocks of block_n columns, and a K/V ring of kv_stages
// blocks (block n + kv_stages - 1 is loading while block n is consumed; 1: single K and V buffers whose loads
// alternate with the two GEMMs, see fwd_kernel.h). warps_over_keys: the warps split each key block instead of the
// rows (block_m = 16, one MMA row tile), each keeping its own softmax state and output, merged at the end: a decode
// tile of few query rows then does a quarter of the MMA and shared-memory work per key that 16-row warps would.
struct FwdTile {
    int block_m, block_n, warps, kv_stages;
    bool warps_over_keys = false;
};

template <int kHeadDim_, FwdTile kTile, typename Element_>
struct FwdTraits : TileBase<kHeadDim_, kTile.warps, Element_> {
    using Base = TileBase<kHeadDim_, kTile.warps, Element_>;
    using Element = Element_;
    using typename Base::SmemLayoutAtom;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kTile.block_m;
    static constexpr int kBlockN = kTile.block_n;
    static constexpr int kNThreads = Base::kNThreads;
    static constexpr int kStages = kTile.kv_stages;
    static_assert(kStages >= 1);
    static constexpr bool kWarpsOverKeys = kTile.warps_over_keys;
    static_assert(kWarpsOverKeys ? kBlockM == 16 && kBlockN % (16 * kTile.warps) == 0
                                 : kBlockM % (16 * kTile.warps) == 0, "each warp owns whole 16-row MMA tiles");
    static_assert(kBlockN % 32 == 0);
    static_assert(kBlockN % Base::kCopyRows == 0, "K and V copies cover whole key blocks");

    // S = Q K^T. Warps tile M, each owning kBlockM / kNWarps rows, so the softmax of a row stays inside one warp (a
    // quad of lanes); or, over keys, warp w owns columns 16 w + [0, 16) of every 16 * warps (the N permutation maps
    // the MMA's n = c + 8 (w + warps j) to c + 16 w + 8 j, j < 2: one ldmatrix.x4 per 16 keys), and its softmax
    // covers those columns alone.
    using TiledMma = std::conditional_t<
        kWarpsOverKeys,
        TiledMMA<MMA_Atom<typename Base::MmaOp>, Layout<Shape<_1, Int<kTile.warps>, _1>>,
                 Tile<_16, Layout<Shape<_8, Int<kTile.warps>, _2>, Stride<_1, _16, _8>>, _16>>,
        TiledMMA<MMA_Atom<typename Base::MmaOp>, Layout<Shape<Int<kTile.warps>, _1, _1>>,
                 Tile<Int<16 * kTile.warps>, _16, _16>>>;
    // O += P V: the same warps, or over keys one warp's MMA per warp (its P times its keys' rows of V, into an output
    // of its own).
    using TiledMmaO = std::conditional_t<
        kWarpsOverKeys, TiledMMA<MMA_Atom<typename Base::MmaOp>, Layout<Shape<_1, _1, _1>>, Tile<_16, _16, _16>>,
        TiledMma>;

    using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
    // V seen as (d, n, stage): the B operand of O = P V, read with transposing ldmatrix; over keys as (d, a warp's
    // keys (16 of every 16 * warps), (warp, stage)), so that a warp's keys are a trailing index like a stage.
    using SmemLayoutVt = decltype(transposed_view(SmemLayoutKV{}));
    static constexpr int kKeyGroups = kBlockN / (16 * kTile.warps);
    using SmemLayoutVtWarps = decltype(composition(
        SmemLayoutVt{},
        make_layout(Shape<Int<kHeadDim>, Shape<_16, Int<kKeyGroups>>, Shape<Int<kTile.warps>, Int<kStages>>>{},
                    Stride<_1, Stride<Int<kHeadDim>, Int<kHeadDim * 16 * kTile.warps>>,
                           Stride<Int<kHeadDim * 16>, Int<kHeadDim * kBlockN>>>{})));

    static constexpr int kSmemQElems = cosize_v<SmemLayoutQ>;
    static constexpr int kSmemKVElems = cosize_v<SmemLayoutKV>;
    // Q, then K stages, then V stages; the output tile reuses Q's space.
    static constexpr int kSmemBytes = (kSmemQElems + 2 * kSmemKVElems) * int(sizeof(Element));
    // Over keys, merge_warp_outputs takes every warp's lse and all but one warp's fp32 output from that space.
    static_assert(!kWarpsOverKeys || (16 * kTile.warps + (kTile.warps - 1) * 16 * kHeadDim) * 4 <= kSmemBytes);
};

// A backward tile: one CTA owns block_n keys and walks block_m-row query tiles with `warps` warps. Five GEMMs per
// query tile, each with its own warp layout (warps along the first mode): S = Q K^T and dP = dO V^T (M x N,
// warps_m_sdp), dV += P^T dO and dK += dS^T Q (N x d, warps_n_dkv), dQ = dS K (M x d, warps_m_dq). q_stages = 2
// double-buffers Q, so the next tile's Q loads while dK reads this one.
struct BwdTile {
    int block_m, block_n, warps, warps_m_sdp, warps_n_dkv, warps_m_dq, q_stages;
};

template <int kHeadDim_, BwdTile kTile, typename Element_>
struct BwdTraits : TileBase<kHeadDim_, kTile.warps, Element_> {
    using Base = TileBase<kHeadDim_, kTile.warps, Element_>;
    using Element = Element_;
    using typename Base::SmemLayoutAtom;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kTile.block_m;
    static constexpr int kBlockN = kTile.block_n;
    static constexpr int kNThreads = Base::kNThreads;
    static constexpr int kQStages = kTile.q_stages;
    static_assert(kQStages == 1 || kQStages == 2);

    using TiledMmaSdP = typename Base::template TiledMmaWarps<kTile.warps_m_sdp>;
    using TiledMmadKV = typename Base::template TiledMmaWarps<kTile.warps_n_dkv>;
    using TiledMmadQ = typename Base::template TiledMmaWarps<kTile.warps_m_dq>;
    static_assert(kBlockM % (16 * kTile.warps_m_sdp) == 0 && kBlockN % (16 * (kTile.warps / kTile.warps_m_sdp)) == 0);
    static_assert(kBlockN % (16 * kTile.warps_n_dkv) == 0 && kHeadDim % (16 * (kTile.warps / kTile.warps_n_dkv)) == 0);
    static_assert(kBlockM % (16 * kTile.warps_m_dq) == 0 && kHeadDim % (16 * (kTile.warps / kTile.warps_m_dq)) == 0);
    static_assert(kBwdRowAlign % kBlockM == 0, "dQ workspace rows are padded to kBwdRowAlign");
    static_assert(kBlockM % Base::kCopyRows == 0 && kBlockN % Base::kCopyRows == 0, "copies cover whole tiles");

    using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQStages>>{}));
    using SmemLayoutdO = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    using SmemLayoutPdS = decltype(tile_to_shape(typename Base::template SmemLayoutAtomFor<kBlockN>{},
                                                 Shape<Int<kBlockM>, Int<kBlockN>>{}));
    // Transposed views over the same bytes: Q^T and dO^T (d, M) are the B operands of dK and dV, K^T (d, N) that of
    // dQ, P^T and dS^T (N, M) the A operands of dV and dK.
    using SmemLayoutQt = decltype(transposed_view(SmemLayoutQ{}));
    using SmemLayoutdOt = decltype(transposed_view(SmemLayoutdO{}));
    using SmemLayoutKt = decltype(transposed_view(SmemLayoutKV{}));
    using SmemLayoutPdSt = decltype(transposed_view(SmemLayoutPdS{}));

    static constexpr int kSmemQElems = cosize_v<SmemLayoutQ>;
    static constexpr int kSmemdOElems = cosize_v<SmemLayoutdO>;
    static constexpr int kSmemKVElems = cosize_v<SmemLayoutKV>;
    static constexpr int kSmemPdSElems = cosize_v<SmemLayoutPdS>;
    // Q stages, dO, K, V, P, dS, then lse and D of each Q stage's rows (fp32); the dK / dV epilogue reuses K's and V's
    // space.
    static constexpr int kSmemRowStatsOffset =
        (kSmemQElems + kSmemdOElems + 2 * kSmemKVElems + 2 * kSmemPdSElems) * int(sizeof(Element));
    static constexpr int kSmemBytes = kSmemRowStatsOffset + 2 * kQStages * kBlockM * int(sizeof(float));
};

}  // namespace flash::sm80
