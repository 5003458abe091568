// SM90-tier tiles. Forward: the warp roles and their register budgets, wgmma (GMMA) atoms for S = Q K^T (both
// operands in shared memory) and O += P V (P in registers), shared-memory layouts in the 128-byte-swizzled GMMA atoms
// (64-byte where the head dim asks) that TMA reads and writes, the TMA copy types, the K / V rings and the output's
// staging buffer. Backward: the same for its five GEMMs, the Q and dO rings, and the dQ staging buffer.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "pipeline.h"

namespace flash::sm90 {

using namespace cute;

// A forward tile: block_m query rows (64 per consumer warpgroup), key blocks of block_n columns, K and V rings of
// kv_stages blocks; tile_counter: a kernel whose causal and local calls may take their tiles from a tile counter
// (fwd_takes_tile_counter), compiled out where false.
// setmaxnreg moves registers within what the launch bound gave the CTA (65536 over its threads, in multiples of 8):
// a consumer increase beyond it never returns. One producer warpgroup, `consumer_wgs` consumer warpgroups.
constexpr bool register_split_fits(int threads, int producer_registers, int consumer_wgs, int consumer_registers) {
    return 128 * (producer_registers + consumer_wgs * consumer_registers) <= threads * (65536 / threads / 8 * 8);
}

struct FwdTile {
    int block_m, block_n, kv_stages;
    bool tile_counter = false;
};

// The page sizes that the paged forward reads are multiples of this (the catalog's Kind.page_multiple): a paged
// key block arrives whole from its page where the page size is a multiple of the block, else row by row
// (load_page_rows) or as TMA boxes of kPageBoxRows rows (the catalog's Kind.page_box_rows), each from its page.
constexpr int kPageMultiple = 16;
constexpr int kPageBoxRows = 64;
// The row copies (load_page_rows) assume rows of whole 128-byte swizzle atoms: the paged forward runs at the kernel
// head dims that are multiples of 64 (the catalog's Kind.paged_head_dims).
constexpr bool reads_pages(int head_dim) { return head_dim % 64 == 0; }

// The K-major swizzle atom for tiles whose column slices (a warpgroup's, a GEMM's) are kSliceCols wide: the widest of
// 128-byte (64 columns), 64-byte (32) and 32-byte (16) atoms that divides them, so that every slice starts on an atom
// (wgmma's descriptors and stmatrix need that).
template <class Element, int kSliceCols>
using SmemAtomFor = std::conditional_t<
    kSliceCols % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
    std::conditional_t<kSliceCols % 32 == 0, GMMA::Layout_K_SW64_Atom<Element>, GMMA::Layout_K_SW32_Atom<Element>>>;

template <int kHeadDim_, FwdTile kTile_, typename Element_>
struct FwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr FwdTile kTile = kTile_;
    static constexpr int kBlockM = kTile.block_m;
    static constexpr int kBlockN = kTile.block_n;
    static constexpr int kStages = kTile.kv_stages;
    // Warpgroup 0 loads (one thread issues every TMA); each consumer warpgroup owns 64 query rows.
    static constexpr int kConsumerWarpGroups = kBlockM / 64;
    static constexpr int kConsumerThreads = kConsumerWarpGroups * 128;
    static constexpr int kNThreads = kConsumerThreads + 128;
    static_assert(kBlockM % 64 == 0 && kHeadDim % 32 == 0 && kBlockN % 16 == 0);
    static_assert(kConsumerWarpGroups == 2 || kConsumerWarpGroups == 3);
    using SmemAtom = SmemAtomFor<Element, kHeadDim>;
    // setmaxnreg budgets, multiples of 8 within 64K registers: 128 * (24 + 2 * 240), 128 * (32 + 3 * 160). The
    // producer needs few.
    static constexpr int kProducerRegisters = kConsumerWarpGroups == 2 ? 24 : 32;
    static constexpr int kConsumerRegisters = kConsumerWarpGroups == 2 ? 240 : 160;
    static_assert(register_split_fits(kNThreads, kProducerRegisters, kConsumerWarpGroups, kConsumerRegisters));
    // The paged kernels' producer warpgroup may copy rows (load_page_rows): with two consumer warpgroups it takes 40
    // registers from theirs, and copies with 8 lanes to a row (ptxas at d 128: 356/508 B spilled with a 24-register
    // producer and 4 lanes; 24/28 B at 56 with the table window, none at 64; the consumers spill none at 216 at d 128,
    // 60/124 B at d 256, which ran no slower than at 224; the dense kernel's 24/240 was slower even for 64-row boxes,
    // H100; RESULTS.md, sessions 48-76); three (d 64) have none to spare (152 spilled), and there 4 lanes to a row keep
    // the producer's spills lower than 8.
    static constexpr int kPagedProducerRegisters = kConsumerWarpGroups == 2 ? 64 : 32;
    static constexpr int kPagedConsumerRegisters = kConsumerWarpGroups == 2 ? 216 : 160;
    static_assert(register_split_fits(kNThreads, kPagedProducerRegisters, kConsumerWarpGroups,
                                      kPagedConsumerRegisters));
    static constexpr int kPageRowLanes = kConsumerWarpGroups == 2 ? 8 : 4;
    // Consumer warpgroups take turns issuing their GEMMs, so that one's softmax runs under the other's GEMMs. Past
    // d 128 the O GEMM is long enough to hide the softmax within a warpgroup, and the turns only add waits.
    static constexpr bool kPingPong = kHeadDim <= 128;
    // With a wide O accumulator, rescaling it right after the O GEMM would sit on the critical path; rescale it
    // before the next one instead, while the S GEMM runs.
    static constexpr bool kRescaleBeforeGemm = kHeadDim > 128;

    using TiledMmaS = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
        Layout<Shape<Int<kConsumerWarpGroups>, _1, _1>>{}));
    // V is read MN-major (its head dim is contiguous), so no transpose is needed.
    using TiledMmaO = decltype(make_tiled_mma(
        GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                             GMMA::Major::MN>(),
        Layout<Shape<Int<kConsumerWarpGroups>, _1, _1>>{}));

    using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
    // V as the (head dim, key) B operand of O += P V over the same bytes.
    using SmemLayoutVt = decltype(composition(
        SmemLayoutKV{},
        make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

    // Global tensors as TMA sees them: (rows, head dim, heads, batch entries).
    using GmemShape = Shape<int, int, int, int>;
    using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
    using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{},
                                            GmemStride{}));
    using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                        Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
    using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutKV{}),
                                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
    // A paged cache's key block as kBlockN / kPageBoxRows boxes of kPageBoxRows rows, each from the page its rows
    // lie in: the box's smem is the stage's rows it fills (with d > 64, not contiguous: one TMA per 64 columns).
    using SmemLayoutPageBox = decltype(composition(take<0, 2>(SmemLayoutKV{}),
                                                   make_tile(Layout<Int<kPageBoxRows>>{}, Layout<Int<kHeadDim>>{})));
    using TmaPage = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutPageBox{},
                                           Shape<Int<kPageBoxRows>, Int<kHeadDim>>{}, _1{}));
    static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
    static constexpr int kKVBytes = kBlockN * kHeadDim * int(sizeof(Element));

    // The output tile is staged in shared memory and stored by TMA, one 64-row slab per consumer warpgroup (each
    // slab whole in the swizzled layout TMA reads), so the consumers hand it off in a few hundred cycles: writing it
    // from registers took ~8% of a d 128 tile at 2k. Rows are (row in slab, warpgroup).
    using SmemLayoutOSlab = decltype(tile_to_shape(SmemAtom{}, Shape<_64, Int<kHeadDim>>{}));
    using SmemLayoutO = decltype(composition(
        tile_to_shape(SmemAtom{}, Shape<_64, Int<kHeadDim>, Int<kConsumerWarpGroups>>{}),
        Layout<Shape<Shape<_64, Int<kConsumerWarpGroups>>, Int<kHeadDim>>,
               Stride<Stride<_1, Int<64 * kHeadDim>>, _64>>{}));
    using GmemTensorO = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{},
                                             GmemStride{}));
    using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorO{}, SmemLayoutOSlab{},
                                        Shape<_64, Int<kHeadDim>>{}, _1{}));
    // Registers to shared memory with stmatrix, in the accumulator's layout.
    using SmemCopyO = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmaO{}));
    // Where Q, K and V leave no room for it (d 256: 224 KB), the buffer is the V ring, free once both warpgroups'
    // last O GEMMs are done; the producer then waits for the stores to have read it (o_free) before loading V.
    static constexpr int kSmemLimit = 227 * 1024;
    static constexpr bool kOAliasesV =
        (cosize_v<SmemLayoutQ> + 2 * cosize_v<SmemLayoutKV> + cosize_v<SmemLayoutO>) * int(sizeof(Element)) + 1024 >
        kSmemLimit;
    static_assert(!kOAliasesV || cosize_v<SmemLayoutO> <= cosize_v<SmemLayoutKV>);

    struct NoBuffer {};
    struct SharedStorage {
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
        alignas(1024) std::conditional_t<kOAliasesV, NoBuffer, cute::array_aligned<Element, cosize_v<SmemLayoutO>>> o;
        uint64_t q_full;
        uint64_t q_empty;
        uint64_t o_free;  // with kOAliasesV: the consumer warpgroups' output stores have read the buffer
        uint64_t tile_full;   // with a tile counter: next_tile holds the consumers' next tile index
        uint64_t tile_empty;  // every consumer warp has read it
        int next_tile;
        TmaRing<kStages> k_ring;
        TmaRing<kStages> v_ring;

        __device__ __forceinline__ Element* o_buffer() {
            if constexpr (kOAliasesV) {
                return v.data();
            } else {
                return o.data();
            }
        }
    };
    static constexpr int kSmemBytes = int(sizeof(SharedStorage));
    static_assert(kSmemBytes <= kSmemLimit);
};

// A backward tile: block_n keys (64 per consumer warpgroup, or 64 shared by both: BwdTraits::kSplitHeadDim) kept in
// shared memory for the whole CTA, query blocks of block_m rows streamed through rings of q_stages (Q, lse) and
// do_stages (dO, D) buffers. key_pair: a cluster of two CTAs on adjacent key blocks (BwdTraits::kKeyPair).
// kv_stages 2: a persistent CTA, whose next tile's K and V land in the second buffer while it works on the first.
struct BwdTile {
    int block_m, block_n, q_stages, do_stages;
    bool key_pair = false;
    int kv_stages = 1;
};

// The scores are computed transposed, S^T = K Q^T and dP^T = V dO^T, with the keys on wgmma's M: their accumulators
// are then, converted to 16 bits, the register A operands of dV += P^T dO and dK += dS^T Q, so P never leaves
// registers. dS also goes to shared memory (two buffers) for dQ = dS K, which splits the head dim between the
// warpgroups and so reads both warpgroups' dS. Q^T, dO^T, K^T and dS are MN-major views of the same swizzled buffers.
// Above head dim 128 (kSplitHeadDim) one warpgroup's dK and dV of 64 keys would take 2 * kHeadDim registers per thread:
// the two warpgroups then share the CTA's 64 keys and split the head dim of dK, dV and dQ, and the queries of S^T and
// dP^T; P^T and dS^T meet in shared memory (FA3's exchange at d 256, with the keys kept on M), from where dV and dK
// read them.
constexpr bool bwd_splits_head_dim(int head_dim) { return head_dim > 128; }

template <int kHeadDim_, BwdTile kTile, typename Element_>
struct BwdTraits {
    using Element = Element_;
    struct NoBuffer {};
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kTile.block_m;
    static constexpr int kBlockN = kTile.block_n;
    static constexpr int kQStages = kTile.q_stages;
    static constexpr int kdOStages = kTile.do_stages;
    static constexpr bool kSplitHeadDim = bwd_splits_head_dim(kHeadDim);
    // kKeyPair (split head dims): the two CTAs of a cluster take adjacent key blocks of one head and walk the same
    // query blocks. Each sends its dS^T to the other, and adds one half of dQ's head dim over both blocks' keys (its
    // own K's half and the other's, loaded once): half the dQ bytes per FLOP that a lone 64-key block adds, which
    // bound the d 256 kernel (see RESULTS.md). dQ goes from registers into the workspace, which leaves the staging
    // buffer's shared memory to the other block's K half and dS^T. A step's dQ slice runs in the next step, behind its
    // S^T and dP^T, so that the other CTA's dS^T has that long to arrive (H200: d 192 +4-5%, d 256 +1-4%, RESULTS.md
    // sessions 64-65).
    static constexpr bool kKeyPair = kTile.key_pair;
    static_assert(!kKeyPair || kSplitHeadDim);
    // kKVStages 2: the CTA loops over tiles (launch_bwd's persistent grid); tile t uses K/V buffer t % 2, and the store
    // warp stores its dK and dV out of that buffer while the consumers start tile t + 1.
    static constexpr int kKVStages = kTile.kv_stages;
    static_assert(kKVStages == 1 || (kKVStages == 2 && !kKeyPair));
    static constexpr bool kPersistent = kKVStages > 1;
    // The same tile with one K/V buffer, for the calls that launch_bwd gives one CTA per tile.
    using OneTile = BwdTraits<kHeadDim_,
                              BwdTile{.block_m = kTile.block_m, .block_n = kTile.block_n, .q_stages = kTile.q_stages,
                                      .do_stages = kTile.do_stages, .key_pair = kTile.key_pair, .kv_stages = 1},
                              Element_>;
    static constexpr int kConsumerWarpGroups = kSplitHeadDim ? 2 : kBlockN / 64;
    static constexpr int kConsumerThreads = kConsumerWarpGroups * 128;
    static constexpr int kNThreads = kConsumerThreads + 128;
    // dS is staged as (key, query) rows of 128-byte swizzle atoms, one per 64 queries.
    static_assert(kBlockM % 64 == 0 && kBlockN % 64 == 0 && kHeadDim % 32 == 0);
    static_assert(kConsumerWarpGroups == 2, "dQ splits its rows or the head dim in two");
    static_assert(!kSplitHeadDim || (kBlockN == 64 && kBlockM == 64),
                  "split head dims share one warpgroup's 64 keys, and dQ is one warpgroup's 64 rows");
    // With 128 query rows, S^T + dP^T (128 fp32 registers per thread) next to dK + dV leave ptxas too few registers:
    // it serializes the wgmmas and moves dK and dV to local memory. dP^T is then issued once P has left S^T's
    // registers (except under the score mods, which need both), so that the two never live together.
    static constexpr bool kdPAfterP = kBlockM > 64;
    static constexpr int kProducerRegisters = 24;
    static constexpr int kConsumerRegisters = 240;
    static_assert(register_split_fits(kNThreads, kProducerRegisters, kConsumerWarpGroups, kConsumerRegisters));

    using WarpGroupsOnM = Layout<Shape<Int<kConsumerWarpGroups>, _1, _1>>;
    using WarpGroupsOnN = Layout<Shape<_1, Int<kConsumerWarpGroups>, _1>>;
    using OneWarpGroup = Layout<Shape<_1, _1, _1>>;
    // Per warpgroup: S^T and dP^T columns (queries), dK and dV columns (head dim).
    static constexpr int kSdPCols = kSplitHeadDim ? kBlockM / kConsumerWarpGroups : kBlockM;
    static constexpr int kdKVCols = kSplitHeadDim ? kHeadDim / kConsumerWarpGroups : kHeadDim;
    using SplitOrM = std::conditional_t<kSplitHeadDim, WarpGroupsOnN, WarpGroupsOnM>;
    using TiledMmaSdP = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kSdPCols>, Int<kHeadDim>>>(), SplitOrM{}));
    // P^T and dS^T from registers (RS), or (kSplitHeadDim) from shared memory, where both warpgroups' halves meet.
    using MmadKVShape = Shape<_64, Int<kdKVCols>, Int<kBlockM>>;
    using MmadKVOp = std::conditional_t<
        kSplitHeadDim,
        decltype(GMMA::ss_op_selector<Element, Element, float, MmadKVShape, GMMA::Major::K, GMMA::Major::MN>()),
        decltype(GMMA::rs_op_selector<Element, Element, float, MmadKVShape, GMMA::Major::K, GMMA::Major::MN>())>;
    using TiledMmadKV = decltype(make_tiled_mma(MmadKVOp{}, SplitOrM{}));
    // dQ = dS K: with 128 query rows each warpgroup takes 64 of them (wgmma N = the head dim, as FA3/FA4 at d 64),
    // with 64 rows half the head dim each.
    static constexpr bool kdQSplitsRows = kBlockM == 64 * kConsumerWarpGroups;
    static constexpr int kdQCols = kdQSplitsRows ? kHeadDim : kHeadDim / kConsumerWarpGroups;  // per warpgroup
    using TiledMmadQ = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kdQCols>, Int<kBlockN>>, GMMA::Major::MN,
                             GMMA::Major::MN>(),
        std::conditional_t<kdQSplitsRows, WarpGroupsOnM, WarpGroupsOnN>{}));
    // kSplitHeadDim: a warpgroup's dQ columns in kdQRounds slices of kdQSliceCols, each computed, staged and added on
    // its own (a whole d 256 tile's staging buffer does not fit beside the rings). Slice r of a warpgroup is values
    // [r, r + 1) * kdQSliceValues of its TiledMmadQ fragment (wgmma's fragment runs over 8-column groups last), so the
    // workspace keeps TiledMmadQ's order for the conversion kernel. Two slices a warpgroup (d 256: 64 columns, d 192:
    // 48, with K in 32-byte atoms so that each starts on one of K^T's swizzle atoms), so that key pairs can give one to
    // each warpgroup.
    static constexpr int kdQSliceCols = !kSplitHeadDim ? kdQCols : kdQCols / 2;
    static constexpr int kdQRounds = kdQCols / kdQSliceCols;
    static_assert(kdQCols % kdQSliceCols == 0);
    // kKeyPair: warpgroup wg of either CTA adds slice wg of that CTA's head-dim half.
    static_assert(!kKeyPair || kdQRounds == kConsumerWarpGroups);
    using TiledMmadQSlice = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kdQSliceCols>, Int<kBlockN>>, GMMA::Major::MN,
                             GMMA::Major::MN>(),
        OneWarpGroup{}));

    // Sliced along the head dim: Q^T and dO^T (dK's and dV's B, split between the warpgroups), V and K (dV and dK leave
    // through them), and K^T also in dQ's slices of kdQSliceCols (d 192: 96 columns a warpgroup, 64-byte atoms, and
    // dQ's slices of 48 put K in 32-byte atoms; d 96 likewise for dQ's 48 columns a warpgroup).
    using SmemAtomD = SmemAtomFor<Element, kdKVCols>;
    using SmemAtomK = SmemAtomFor<Element, cute::gcd(kdKVCols, kdQSliceCols)>;
    using SmemLayoutQ = decltype(tile_to_shape(SmemAtomD{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQStages>>{}));
    using SmemLayoutdO = decltype(tile_to_shape(SmemAtomD{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kdOStages>>{}));
    using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    using SmemLayoutV = decltype(tile_to_shape(SmemAtomD{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    // kKeyPair: the other block's half of K (the head-dim half this CTA adds), and its dS^T (two buffers).
    static constexpr int kPeerKCols = kKeyPair ? kHeadDim / 2 : kHeadDim;
    using SmemLayoutKHalf = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kPeerKCols>>{}));
    using SmemLayoutKHalft = decltype(composition(
        SmemLayoutKHalf{}, make_ordered_layout(Shape<Int<kPeerKCols>, Int<kBlockN>>{}, Step<_2, _1>{})));
    // dS^T as written from the accumulators: (key, query, buffer), queries contiguous; two buffers, and with
    // kSplitHeadDim two more for P^T (kPBuffer + buffer).
    static constexpr int kPBuffer = 2;
    static constexpr int kPdSBuffers = kSplitHeadDim ? 4 : 2;
    using SmemLayoutdS = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                Shape<Int<kBlockN>, Int<kBlockM>, Int<kPdSBuffers>>{}));
    // Transposed views: (head dim, query, stage), (head dim, key), (query, key, buffer).
    using SmemLayoutQt = decltype(composition(
        SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kQStages>>{}, Step<_2, _1, _3>{})));
    using SmemLayoutdOt = decltype(composition(
        SmemLayoutdO{},
        make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kdOStages>>{}, Step<_2, _1, _3>{})));
    using SmemLayoutKt = decltype(composition(
        SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
    using SmemLayoutdSt = decltype(composition(
        SmemLayoutdS{},
        make_ordered_layout(Shape<Int<kBlockM>, Int<kBlockN>, Int<kPdSBuffers>>{}, Step<_2, _1, _3>{})));
    // kKeyPair: the other block's dS^T, two buffers laid out as dS's first two (one bulk copy each).
    using SmemLayoutdSPeer = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                    Shape<Int<kBlockN>, Int<kBlockM>, _2>{}));
    using SmemLayoutdSPeert = decltype(composition(
        SmemLayoutdSPeer{}, make_ordered_layout(Shape<Int<kBlockM>, Int<kBlockN>, _2>{}, Step<_2, _1, _3>{})));
    static constexpr int kdSBytes = kBlockN * kBlockM * int(sizeof(Element));
    // Registers to shared memory with stmatrix, in the S^T accumulator's layout.
    using SmemCopydS = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmaSdP{}));

    using GmemShape = Shape<int, int, int, int>;  // (rows, head dim, heads, batch entries)
    using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
    using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{},
                                            GmemStride{}));
    using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                        Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
    using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                        Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
    using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutV{},
                                        Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
    using TmaKHalf = std::conditional_t<kKeyPair,
                                        decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKHalf{},
                                                               Shape<Int<kBlockN>, Int<kPeerKCols>>{}, _1{})),
                                        NoBuffer>;
    static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
    static constexpr int kKVBytes = kBlockN * kHeadDim * int(sizeof(Element));
    // dK and dV of batched calls leave through K's and V's buffers, written with stmatrix in the dK/dV accumulators'
    // layout and stored by TMA (clipping the rows past sk and the columns past d). Measured on an H100 beside register
    // stores: d 128 +0-6% (most under a causal mask); d 64 causal +1 to +4%, without a mask -1 to +0.3%.
    using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{},
                                               GmemStride{}));
    using TmadK = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutK{},
                                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
    using TmadV = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutV{},
                                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
    using SmemCopydKV = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmadKV{}));

    // One warpgroup's dQ partial tile: its fragment, in dq_workspace_index order, is one contiguous run of the tile's
    // accumulator rows, added into them with one bulk reduction per slice.
    static constexpr int kdQChunkFloats = kBlockM * kHeadDim / kConsumerWarpGroups;
    static constexpr int kdQStagedFloats = kdQChunkFloats / kdQRounds;

    template <class T, int kCount, bool kUsed, int kAlign>
    using BufferIf = std::conditional_t<kUsed, cute::array_aligned<T, kCount, kAlign>, NoBuffer>;
    struct SharedStorage {
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdO>> dout;
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK> * kKVStages> k;
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV> * kKVStages> v;
        alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>> ds;
        BufferIf<float, kConsumerWarpGroups * kdQStagedFloats, !kKeyPair, 128> dq;
        alignas(128) float lse2[kQStages][kBlockM];  // per Q stage (BwdParams::lse2)
        alignas(128) float dpsum[kdOStages][kBlockM];  // per dO stage (BwdParams::dpsum)
        TmaRing<kKVStages> kv_ring;  // empty: the store warp has stored the buffer's dK and dV (or had none to store)
        int tile_index[kKVStages];  // set by the producer: the block index of the stage's tile (past the last: none)
        TmaRing<kQStages> q_ring;
        TmaRing<kdOStages> do_ring;
        uint64_t peer_ds_full[2];   // kKeyPair: the other CTA's dS^T has landed in ds_peer (its bulk copy's bytes)
        uint64_t peer_ds_empty[2];  // kKeyPair: the other CTA's warpgroups have read what this CTA sent
        BufferIf<Element, cosize_v<SmemLayoutKHalf>, kKeyPair, 1024> k_peer;
        BufferIf<Element, cosize_v<SmemLayoutdSPeer>, kKeyPair, 1024> ds_peer;
    };
    static constexpr int kSmemBytes = int(sizeof(SharedStorage));
    static_assert(kSmemBytes <= 227 * 1024);

    // A K/V stage's buffers.
    __device__ __forceinline__ static Element* k_buffer(SharedStorage& shared, int stage) {
        return shared.k.data() + (kKVStages == 1 ? 0 : stage) * cosize_v<SmemLayoutK>;
    }
    __device__ __forceinline__ static Element* v_buffer(SharedStorage& shared, int stage) {
        return shared.v.data() + (kKVStages == 1 ? 0 : stage) * cosize_v<SmemLayoutV>;
    }
    // The stage, for a whole warp, from lane 0 (__shfl_sync): ptxas then sees it warp-uniform and keeps the wgmma
    // descriptors built from it in uniform registers.
    __device__ __forceinline__ static int uniform_stage(int stage) {
        return kKVStages == 1 ? 0 : __shfl_sync(0xffffffffu, stage, 0);
    }
};

}  // namespace flash::sm90
