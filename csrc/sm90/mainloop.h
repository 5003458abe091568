// SM90-tier forward main loop, by role. The producer (one thread) loads Q and streams K and V blocks through their
// rings with TMA, in the order the consumers use them: K(n), then V(n + 1) (from pages that a block straddles, the
// producer warpgroup's 128 threads copy the rows instead: load_page_rows). Each consumer warpgroup runs, per key block
// n (last-first, so the masked diagonal blocks come first):
//     S(n) = Q K(n)^T issued, O += P(n + 1) V(n + 1) issued      (in the warpgroups' GEMM turns)
//     wait for S(n); scores, mask, row max and exponentials        (overlaps the O GEMM)
//     wait for the O GEMM; rescale O; P(n) = S(n) in registers
// so the softmax of one block hides under the P V GEMM of the previous one, and under the other warpgroup's GEMMs.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/block_range.h"
#include "../common/mask.h"
#include "../common/params.h"
#include "../common/score_mod.h"
#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "../common/fragment.h"
#include "gemm.h"
#include "pipeline.h"
#include "tile_traits.h"

namespace flash::sm90 {

using namespace cute;

// The page pools of a paged cache as (page rows, head dim, kv heads, pages), the page the batch entry (kPaged kernels
// only): read a key block at a time where it lies in one page, else in boxes of kPageBoxRows rows or (rows) by
// load_page_rows.
template <class Traits, bool kPaged>
struct PageTmas {
    typename Traits::TmaKV k, v;
    typename Traits::TmaPage k_box, v_box;
    bool rows;  // pages that a key block straddles are copied row by row (load_page_rows), not in boxes
};
template <class Traits>
struct PageTmas<Traits, false> {};

template <class Traits, bool kPaged = false>
struct FwdKernelParams {
    FwdParams p;
    typename Traits::TmaQ tma_q;
    typename Traits::TmaKV tma_k;
    typename Traits::TmaKV tma_v;
    typename Traits::TmaO tma_o;
    int num_tiles;  // a bound on the tiles of the grid (see tile_count)
    int section;    // (batch, head) pairs per L2 section of the tile order (see decode_tile)
    PageTmas<Traits, kPaged> pages;
    int* tile_counter = nullptr;  // zeroed: tiles taken past the grid's own (persistent causal or local tiles)
};

// The position of a CTA's producer or consumers in the Q buffer and the K / V rings, kept across its tiles.
template <int kStages>
struct PipelineState {
    RingState<kStages> k, v;
    uint32_t q_phase = 0;  // flips with every tile that loads Q
    uint32_t o_phase = 0;  // flips with every tile that loads Q (with Traits::kOAliasesV)
};

// Producer (one thread): the tile's Q, by TMA (coordinates (row, col, head, batch entry), this sequence's rows first;
// read once per tile).
template <class Traits, bool kPaged>
__device__ __forceinline__ void load_q(FwdKernelParams<Traits, kPaged> const& args,
                                       typename Traits::SharedStorage& shared, SeqlenInfo const& seq,
                                       TileCoord const& blk, PipelineState<Traits::kStages>& state) {
    FwdParams const& params = args.p;
    int const entry = params.cu_seqlens_q == nullptr ? seq.batch : 0;
    Tensor mQ = args.tma_q.get_tma_tensor(make_shape(params.sq, params.d, params.h, tensor_batches(params)));
    Tensor gQ = local_tile(domain_offset(make_coord(seq.q.start, _0{}), mQ(_, _, blk.head, entry)),
                           Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, make_coord(blk.block, _0{}));
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    auto tma_q = args.tma_q.get_slice(_0{});
    // Q's buffer is free once the consumers have issued their last S GEMM of the previous tile and it completed.
    cutlass::arch::ClusterBarrier::wait(&shared.q_empty, state.q_phase ^ 1);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&shared.q_full, Traits::kQBytes);
    copy(args.tma_q.with(shared.q_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tma_q.partition_S(gQ),
         tma_q.partition_D(sQ));
    state.q_phase ^= 1;
}

// The producers' order over a tile's key blocks n_range, last-first, as the consumers use them: K(n), then V(n + 1),
// and V(n_range.lo) last (load_v's second argument: whether it is that one, a compile-time bool). With
// Traits::kOAliasesV the tile's first V waits until the previous tile's output stores have read V's ring.
template <class Traits, class LoadK, class LoadV>
__device__ __forceinline__ void for_each_kv_block(typename Traits::SharedStorage& shared, Interval n_range,
                                                  PipelineState<Traits::kStages>& state, LoadK&& load_k,
                                                  LoadV&& load_v) {
    auto v_block = [&](int n_block, auto last) __attribute__((always_inline)) {
        if constexpr (Traits::kOAliasesV) {
            if (n_block == n_range.hi - 1) {
                cutlass::arch::ClusterBarrier::wait(&shared.o_free, state.o_phase ^ 1);
                state.o_phase ^= 1;
            }
        }
        load_v(n_block, last);
    };
    for (int n_block = n_range.hi - 1; n_block >= n_range.lo; --n_block) {
        load_k(n_block);
        if (n_block + 1 < n_range.hi) { v_block(n_block + 1, cute::false_type{}); }
    }
    v_block(n_range.lo, cute::true_type{});
}

// Producer (one thread): Q, then K(n) and V(n + 1) for every key block n of the tile, last-first. Rows past the
// tensor arrive as zeros; rows of the next packed sequence are masked (keys) or zeroed (values, see consume()).
// kPaged: each K and V block comes from the page that params.block_table names for its rows.
template <class Traits, bool kPaged>
__device__ __forceinline__ void load(FwdKernelParams<Traits, kPaged> const& args,
                                     typename Traits::SharedStorage& shared,
                                     SeqlenInfo const& seq, TileCoord const& blk, Interval n_range,
                                     PipelineState<Traits::kStages>& state) {
    constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    FwdParams const& params = args.p;
    int const head_kv = blk.head / params.h_per_hk;
    int const entry = params.cu_seqlens_q == nullptr ? seq.batch : 0;
    Tensor mK = args.tma_k.get_tma_tensor(make_shape(params.sk, params.d, params.hk, tensor_batches(params)));
    Tensor mV = args.tma_v.get_tma_tensor(make_shape(params.sk, params.d, params.hk, tensor_batches(params)));
    Tensor gK = local_tile(domain_offset(make_coord(seq.k.start, _0{}), mK(_, _, head_kv, entry)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, D, n)
    Tensor gV = local_tile(domain_offset(make_coord(seq.k.start, _0{}), mV(_, _, head_kv, entry)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
    auto tma_k = args.tma_k.get_slice(_0{});
    auto tma_v = args.tma_v.get_slice(_0{});
    Tensor tKgK = tma_k.partition_S(gK);  // (TMA, 1, 1, n)
    Tensor tKsK = tma_k.partition_D(sK);  // (TMA, 1, 1, stage)
    Tensor tVgV = tma_v.partition_S(gV);
    Tensor tVsV = tma_v.partition_D(sV);

    // K and V blocks are shared by the query tiles of a head, so they stay in L2.
    constexpr auto kKeep = TMA::CacheHintSm90::EVICT_LAST;
    load_q(args, shared, seq, blk, state);
    RingState<Traits::kStages>& k_state = state.k;
    RingState<Traits::kStages>& v_state = state.v;
    // Block n_block of K or V into stage `stage`, on `full`'s transaction count; a paged block from its page.
    auto load_block = [&](auto const& tma, auto const& tXgX, auto const& tXsX, int which, uint64_t& full,
                          int n_block, int stage) {
        if constexpr (kPaged) {
            int const* table = params.block_table + int64_t(seq.batch) * params.block_table_stride;
            int const last_slot = params.sk / params.page_size - 1;  // sk: the table's rows
            // The table slot of a key's page; a key past the table's rows gets the last slot, and a box from it lies
            // past its page's rows: TMA fills it with zeros.
            auto slot_of = [&](int key) {
                return min(page_slot(params, key), last_slot);
            };
            auto const shape = make_shape(params.page_size, params.d, params.hk, params.num_pages);
            Tensor sX = make_tensor(make_smem_ptr(which == 0 ? shared.k.data() : shared.v.data()),
                                    typename Traits::SmemLayoutKV{})(_, _, stage);
            // The block as kBlockN / kRows boxes of kRows rows, each from its page; every box's page is read before
            // the first copy, so that the table loads overlap.
            auto load_boxes = [&](auto const& tma_pages, auto rows) {
                constexpr int kRows = decltype(rows)::value, kBoxes = kBlockN / kRows;
                int slot[kBoxes], page[kBoxes];
                CUTE_UNROLL
                for (int box = 0; box < kBoxes; ++box) {
                    slot[box] = slot_of(n_block * kBlockN + box * kRows);
                    page[box] = table[slot[box]];
                }
                auto thr = tma_pages.get_slice(_0{});
                CUTE_UNROLL
                for (int box = 0; box < kBoxes; ++box) {
                    int const row = n_block * kBlockN + box * kRows - slot[box] * params.page_size;
                    Tensor g = local_tile(
                        tma_pages.get_tma_tensor(shape)(_, _, head_kv, pool_page(params, page[box])),
                        Shape<Int<kRows>, Int<kHeadDim>>{}, make_coord(row / kRows, _0{}));
                    Tensor sbox = local_tile(sX, Shape<Int<kRows>, Int<kHeadDim>>{}, make_coord(box, _0{}));
                    copy(tma_pages.with(full, 0, kKeep), thr.partition_S(g), thr.partition_D(sbox));
                }
            };
            if (kBlockN == kPageBoxRows || params.page_size % kBlockN == 0) {  // the block lies in one page
                load_boxes(which == 0 ? args.pages.k : args.pages.v, Int<kBlockN>{});
            } else {
                load_boxes(which == 0 ? args.pages.k_box : args.pages.v_box, Int<kPageBoxRows>{});
            }
        } else {
            copy(tma.with(full, 0, kKeep), tXgX(_, _, _, n_block), tXsX(_, _, _, stage));
        }
    };
    for_each_kv_block<Traits>(
        shared, n_range, state,
        [&](int n_block) {
            load_block(args.tma_k, tKgK, tKsK, 0, shared.k_ring.acquire(k_state, Traits::kKVBytes), n_block,
                       k_state.index);
            k_state.advance();
        },
        [&](int n_block, auto) {
            load_block(args.tma_v, tVgV, tVsV, 1, shared.v_ring.acquire(v_state, Traits::kKVBytes), n_block,
                       v_state.index);
            v_state.advance();
        });
}

// Producer warpgroup (ptid: its thread index), for a paged cache whose key blocks straddle pages (page sizes a
// multiple of kPageMultiple, not of kBlockN): Q by TMA from thread 0, then K and V in for_each_kv_block's order,
// copied with cp.async by all 128 threads, each completing its share of a stage's `full` barrier
// (cp.async.mbarrier.arrive.noinc; the rings then count 128 arrivals). A block's 16-row groups each lie in one
// page: warp w copies groups w, w + 4, ..., one table entry per group, its lanes Traits::kPageRowLanes to a row
// (lane / lanes: the row in each step of 32 / lanes rows; lane % lanes: the first of the 16-byte chunks it copies,
// every lanes-th), so that each row's address is made once per lane and each copy's source and destination are that
// address plus a constant. With 8 lanes a copy instruction reads whole 128-byte lines (2-3% faster at d 128 than 4
// lanes, given the registers). 16-row TMA boxes cost about 70 ns of the SM's TMA unit each, which outweighs the copy
// instructions (RESULTS.md). What this path costs over TMA is the bytes it moves, not its instructions: layouts with
// fewer instructions ran no faster, copying half the rows as fast as TMA (RESULTS.md, sessions 48 and 56).
template <class Traits>
__device__ __forceinline__ void load_page_rows(FwdKernelParams<Traits, true> const& args,
                                               typename Traits::SharedStorage& shared, SeqlenInfo const& seq,
                                               TileCoord const& blk, Interval n_range,
                                               PipelineState<Traits::kStages>& state, int ptid) {
    using Element = typename Traits::Element;
    constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    constexpr int kChunks = kHeadDim * int(sizeof(Element)) / 16;  // 16-byte chunks per row
    constexpr int kLanes = Traits::kPageRowLanes;                  // lanes per row
    constexpr int kStepRows = 32 / kLanes;                         // rows per copy instruction of a warp
    constexpr int kGroupsPerWarp = kBlockN / kPageMultiple / 4;
    static_assert(kBlockN % (4 * kPageMultiple) == 0 && kChunks % 8 == 0 && kPageMultiple == 16);
    static_assert(kLanes == 4 || kLanes == 8);
    FwdParams const& params = args.p;
    if (ptid == 0) {
        load_q(args, shared, seq, blk, state);
    } else {
        state.q_phase ^= 1;  // kept in step with thread 0's, though only it waits on Q's barriers
    }

    int const warp = ptid / 32, lane = ptid % 32;
    int const row = lane / kLanes, sub = lane % kLanes;
    int const head_kv = blk.head / params.h_per_hk;
    int const* table = params.block_table + int64_t(seq.batch) * params.block_table_stride;
    int const last_slot = params.sk / params.page_size - 1;  // sk: the table's rows
    // The table entries of 32 consecutive slots from `window`, one a lane: a group takes its page by a shuffle, and
    // the warp reads the table once per 32 slots (4 key blocks of pages of 16), not once per group and block. Read
    // per group, the table cost 2-3% at pages of 16 (not through its latency: loading it a block ahead gained
    // nothing); the window wins 2 points of it (H200, RESULTS.md, sessions 75-76).
    int window = -32, window_entry = 0;  // no window yet: every slot lies past it
    auto entry_of = [&](int slot) __attribute__((always_inline)) {  // slot: warp-uniform, in [0, last_slot]
        if (slot < window || slot >= window + 32) {  // the blocks go last-first: the window ends at this slot
            window = max(slot - 31, 0);
            window_entry = table[min(window + lane, last_slot)];
        }
        return __shfl_sync(0xffffffffu, window_entry, slot - window);
    };
    // Shared-memory bytes of (row, chunk sub) within a stage, for this lane's row in its warp's first group. The
    // 128-byte swizzle XORs a row's 16-byte chunk index with row % 8; a step of 4 rows (8 lanes) or a chunk 4 further
    // on (4 lanes) flips its bit 2, the rest of each copy's offset is a constant: `flipped` is this lane's address
    // with that bit flipped.
    uint32_t const dst = uint32_t((warp * kPageMultiple + row) * 128 + ((sub ^ row) * 16));
    uint32_t const flipped = dst ^ 64u;
    // This lane's first row of each of its warp's groups in a block: its page, its row in the page, and the sequence's
    // keys from that row on. Rows past the keys (the last block's, some past the table's rows) arrive as zeros, so
    // that the consumers need not zero V's (0 * NaN is NaN). Looked up before the wait for K's stage, and kept for
    // V's.
    struct Rows {
        uint32_t page[kGroupsPerWarp];
        uint32_t page_row[kGroupsPerWarp];
        int keys_left[kGroupsPerWarp];
    };
    auto look_up = [&](int n_block) __attribute__((always_inline)) {
        Rows rows;
        CUTE_UNROLL
        for (int gi = kGroupsPerWarp - 1; gi >= 0; --gi) {  // the block's last slot first, as entry_of's window ends
            int const key = n_block * kBlockN + (warp + 4 * gi) * kPageMultiple;
            int const slot = page_slot(params, key);
            rows.page[gi] = uint32_t(pool_page(params, entry_of(min(slot, last_slot))));
            rows.page_row[gi] = uint32_t(slot <= last_slot ? key - slot * params.page_size + row : row);
            rows.keys_left[gi] = seq.k.len - key - row;
        }
        return rows;
    };
    // K and V blocks are shared by the query tiles of a head: kept in L2, as load() keeps its TMA blocks.
    constexpr uint64_t kKeep = uint64_t(TMA::CacheHintSm90::EVICT_LAST);
    // Rows `rows` of K or V (pool: the kv head's rows in page 0) into stage `stage`, completing `full`.
    auto copy_block = [&](Rows const& rows, Element const* pool, int64_t page_stride, int64_t row_stride,
                          Element* buffer, uint64_t* full, int stage) __attribute__((always_inline)) {
        uint32_t const base = cute::cast_smem_ptr_to_uint(buffer) + uint32_t(stage * kBlockN * kHeadDim) *
                                                                          uint32_t(sizeof(Element));
        CUTE_UNROLL
        for (int gi = 0; gi < kGroupsPerWarp; ++gi) {
            Element const* src = pool + uint64_t(rows.page[gi]) * page_stride +
                                 uint64_t(rows.page_row[gi]) * row_stride + sub * 8;
            CUTE_UNROLL
            for (int step = 0; step < kPageMultiple / kStepRows; ++step) {
                uint32_t const bytes = rows.keys_left[gi] > step * kStepRows ? 16u : 0u;
                CUTE_UNROLL
                for (int c = 0; c < kChunks / kLanes; ++c) {
                    int const chunk = c * kLanes;  // this copy's chunk, less sub
                    bool const flip = ((chunk ^ (step * kStepRows)) & 4) != 0;
                    uint32_t const to = base + (flip ? flipped : dst) +
                                        uint32_t(((chunk / 8) * kBlockN + gi * 4 * kPageMultiple + step * kStepRows) *
                                                 128);
                    Element const* from = src + step * kStepRows * row_stride + chunk * 8;
                    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(to),
                                 "l"(from), "r"(bytes), "l"(kKeep));
                }
            }
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(full);
    };
    Element const* k_pool = static_cast<Element const*>(params.k) + head_kv * params.k_head_stride;
    Element const* v_pool = static_cast<Element const*>(params.v) + head_kv * params.v_head_stride;
    RingState<Traits::kStages>& k_state = state.k;
    RingState<Traits::kStages>& v_state = state.v;
    // The last K block's rows, and those of the block before it (n_block + 1), for its V.
    Rows newest{}, previous{};
    for_each_kv_block<Traits>(
        shared, n_range, state,
        [&](int n_block) __attribute__((always_inline)) {
            previous = newest;
            newest = look_up(n_block);
            shared.k_ring.wait_free(k_state);
            copy_block(newest, k_pool, params.k_batch_stride, params.k_row_stride, shared.k.data(),
                       &shared.k_ring.full[k_state.index], k_state.index);
            k_state.advance();
        },
        [&](int, auto last) __attribute__((always_inline)) {
            shared.v_ring.wait_free(v_state);
            copy_block(decltype(last)::value ? newest : previous, v_pool, params.v_batch_stride, params.v_row_stride,
                       shared.v.data(), &shared.v_ring.full[v_state.index], v_state.index);
            v_state.advance();
        });
}

// Consumer warpgroups (ctid: thread index among them): accumulates this tile's unnormalised output in acc_o and the
// running row max / sum in softmax, over key blocks n_range (not empty).
template <class Traits, class Turns, class AccO, class Softmax>
__device__ __forceinline__ void consume(FwdParams const& params, typename Traits::SharedStorage& shared,
                                        AttnWindow const& window, int m_block, Interval n_range, float alibi_slope,
                                        int ctid, PipelineState<Traits::kStages>& state, Turns const& turns,
                                        bool v_tail_zeroed, AccO& acc_o, Softmax& softmax) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
    constexpr int kStages = Traits::kStages;
    using Range = BlockRange<kBlockM, kBlockN>;

    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutVt{});
    typename Traits::TiledMmaS mma_s;
    typename Traits::TiledMmaO mma_o;
    // Shared-memory operands are sliced per warpgroup, from an index the compiler knows is warp-uniform, so that
    // their descriptors live in uniform registers rather than in 2 x MMA_K of the consumers' registers.
    int const wg = __shfl_sync(0xffffffff, ctid / 128, 0);
    auto wg_s = mma_s.get_slice(wg * 128);
    auto wg_o = mma_o.get_slice(wg * 128);
    Tensor tSrQ = wg_s.partition_fragment_A(sQ);
    Tensor tSrK = wg_s.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, stage)
    Tensor tOrVt = wg_o.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor coord_s_rc = rowcol_view(
        mma_s.get_thread_slice(ctid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
    auto acc_o_rc = rowcol_view(acc_o);
    constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
    int const row0 = m_block * kBlockM;
    using AccSLayout = decltype(partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{}).layout());
    // P of the previous key block, kept in registers as the A operand of the next O GEMM.
    Tensor tOrP = make_tensor<Element>(acc_as_a_operand(AccSLayout{}));
    float alpha[kRows];

    RingState<kStages>& k_state = state.k;
    RingState<kStages>& v_state = state.v;
    int n_block = n_range.hi - 1;

    cutlass::arch::ClusterTransactionBarrier::wait(&shared.q_full, state.q_phase);
    state.q_phase ^= 1;
    // The first block's V rows past this sequence's keys hold the next sequence's rows (varlen) or, past seqused,
    // anything (NaN * 0 is NaN): zero them before any O GEMM reads the stage. Batched without seqused they lie past
    // the tensor, and TMA has filled them with zeros; waiting for V here would also hold up the first S GEMM.
    // v_tail_zeroed: the producer has zero-filled them (load_page_rows).
    bool const v_tail_foreign = (params.cu_seqlens_k != nullptr || params.seqused_k != nullptr) && !v_tail_zeroed;
    if (v_tail_foreign && n_block * kBlockN + kBlockN > window.sk) {
        shared.v_ring.wait(v_state);
        zero_tail_rows<Traits::kConsumerThreads>(sV(_, _, v_state.index), window.sk - n_block * kBlockN, ctid);
        cutlass::arch::fence_view_async_shared();
        sync_consumers<Traits::kConsumerThreads>();
    }

    // Score mods and mask of S(n_block); `masked` and `mods` (whether a softcap or ALiBi may apply) are bools or
    // compile-time constants, `left_edge` (whether the mask tests the left window edge) a compile-time constant.
    bool const has_mods = params.has_softcap || params.alibi_slopes != nullptr;
    auto scores = [&](auto& acc_s, int n_block, auto masked, auto left_edge, auto mods) __attribute__((always_inline)) {
        auto s_rc = rowcol_view(acc_s);
        int const col0 = n_block * kBlockN;
        if (mods && params.has_softcap) { apply_softcap(acc_s, params.softcap_pre); }
        if (mods && params.alibi_slopes != nullptr) {
            apply_alibi(s_rc, coord_s_rc, row0, col0, window.diag_offset(), alibi_slope);
        }
        if (masked) { apply_mask<decltype(left_edge)::value>(s_rc, coord_s_rc, window, row0, col0); }
        softmax.max_and_scale(s_rc, params.scale_log2, alpha);
        softmax.exponentiate(s_rc, params.scale_log2);
    };
    // tOrP's storage is in accumulator order (its layout only re-reads it as the A operand), so the conversion writes
    // it directly.
    auto keep_p = [&](auto const& acc_s) __attribute__((always_inline)) { convert_fragment_into(acc_s, tOrP); };

    {  // The first block: S only.
        Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
        shared.k_ring.wait(k_state);  // before taking the turn, as FlashAttention-3 and -4 do
        turns.wait();
        gemm<true>(mma_s, tSrQ, tSrK(_, _, _, k_state.index), acc_s);
        turns.pass();
        warpgroup_wait<0>();
        shared.k_ring.release(k_state);
        k_state.advance();
        scores(acc_s, n_block, Range::needs_mask(window, m_block, n_block), cute::true_type{}, has_mods);
        keep_p(acc_s);
    }
    auto step = [&](int n_block, auto masked, auto left_edge, auto mods) __attribute__((always_inline)) {
        Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
        shared.k_ring.wait(k_state);  // before taking the turn, as FlashAttention-3 and -4 do
        turns.wait();
        gemm<true>(mma_s, tSrQ, tSrK(_, _, _, k_state.index), acc_s);
        if constexpr (Traits::kRescaleBeforeGemm) { softmax.rescale(acc_o_rc, alpha); }
        shared.v_ring.wait(v_state);
        gemm<false>(mma_o, tOrP, tOrVt(_, _, _, v_state.index), acc_o);
        turns.pass();
        warpgroup_wait<1>();  // S(n) is done (wgmma batches complete in order)
        shared.k_ring.release(k_state);
        k_state.advance();
        scores(acc_s, n_block, masked, left_edge, mods);
        warpgroup_wait<0>();
        shared.v_ring.release(v_state);
        v_state.advance();
        if constexpr (!Traits::kRescaleBeforeGemm) { softmax.rescale(acc_o_rc, alpha); }
        keep_p(acc_s);
    };
    // Masked blocks come first (keys past the end, the causal or right window edge), then unmasked ones, then the
    // blocks the left window edge crosses. The first run's blocks lie at or past unmasked.lo, inside every row's left
    // edge, so their mask tests the right edge only. The loops come in two copies, with and without score mods,
    // chosen once per tile: a branch on the mods inside a step splits the softmax from the O GEMM's wait, and ptxas
    // then hoists the wait over the softmax, which then no longer overlaps the O GEMM.
    Interval const unmasked = Range::unmasked_n_blocks(window, m_block);
    int const unmasked_hi = cute::max(n_range.lo, cute::min(unmasked.hi, n_range.hi));
    int const unmasked_lo = cute::max(n_range.lo, cute::min(unmasked.lo, unmasked_hi));
    auto key_loops = [&](auto mods) __attribute__((always_inline)) {
        for (--n_block; n_block >= unmasked_hi; --n_block) {
            step(n_block, cute::true_type{}, cute::false_type{}, mods);
        }
        for (; n_block >= unmasked_lo; --n_block) { step(n_block, cute::false_type{}, cute::false_type{}, mods); }
        for (; n_block >= n_range.lo; --n_block) { step(n_block, cute::true_type{}, cute::true_type{}, mods); }
    };
    if (has_mods) {
        key_loops(cute::true_type{});
    } else {
        key_loops(cute::false_type{});
    }
    // Every S GEMM of this tile has completed: the producer may load the next tile's Q.
    if (cute::elect_one_sync()) { cutlass::arch::ClusterBarrier::arrive(&shared.q_empty); }

    if constexpr (Traits::kRescaleBeforeGemm) { softmax.rescale(acc_o_rc, alpha); }
    shared.v_ring.wait(v_state);
    gemm<false>(mma_o, tOrP, tOrVt(_, _, _, v_state.index), acc_o);
    warpgroup_wait<0>();
    shared.v_ring.release(v_state);
    v_state.advance();
}

}  // namespace flash::sm90
