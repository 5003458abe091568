// SM80-tier forward kernel: one CTA computes a kBlockM x d output tile, walking its visible key blocks from the last
// to the first (masked blocks come first, so the unmasked steady state needs no mask work).
//
// cp.async pipeline, two schedules:
// - kStages >= 2: K and V of each key block form one commit group, kStages - 1 blocks are in flight ahead of the one
//   being consumed. Per block: wait K, V -> barrier -> issue the loads of block i + kStages - 1 into the stage freed
//   by block i - 1 -> S = Q K^T -> softcap / ALiBi / mask -> online softmax -> O += P V. One barrier per block lets
//   one warp's softmax overlap another warp's MMAs.
// - kStages == 1: one K and one V buffer; block 0's K and V come with Q, later loads are one commit group each. Per
//   block: wait K -> barrier -> issue V(i) -> S = Q K^T -> wait V -> barrier -> issue K(i + 1) -> softmax ->
//   O += P V. Each load hides behind the other GEMM; the smaller footprint lets two CTAs share an SM, so one CTA's
//   prologue and epilogue overlap the other's loop. The 16-row decode tile alone on its SM issues V(i + 1) after
//   O += P V(i) instead (a barrier more), so that K(i + 1) and V(i + 1) are in flight together; where its grid
//   allows, the launch takes its ring of three stages instead (fwd_launch.h, RingDecodeTraits).
// Warps split the rows (16 or more each), or, in the 16-row decode tile (FwdTile::warps_over_keys), each key block:
// warp w multiplies its own keys with its own softmax state and output, merged across the warps after the loop
// (merge_warp_outputs), so that a few query rows cost a quarter of the MMA and ldmatrix work per key.
// Split-KV (decode kernels): blockIdx.y is the chunk of the tile's keys; its output goes to fp32 partials for the
// combine kernel, or, where the tile's chunks form a cluster (sm_90), is merged in place (merge_splits_in_cluster).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "../common/block_range.h"
#include "../common/block_scheduler.h"
#include "../common/dependent_launch.h"
#include "../common/mask.h"
#include "../common/params.h"
#include "../common/score_mod.h"
#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "epilogue.h"
#include "gemm.h"

namespace flash::sm80 {

using namespace cute;

// The sequence's keys without its first leftpad_k rows (flash_attn_with_kvcache's cache_leftpad), clamped to them.
__device__ __forceinline__ SeqlenInfo with_leftpad(FwdParams const& params, SeqlenInfo seq) {
    if (params.leftpad_k != nullptr) {
        int const pad = min(max(params.leftpad_k[seq.batch], 0), seq.k.len);
        seq.k.start += pad;
        seq.k.len -= pad;
    }
    return seq;
}

// A paged kernel's shared memory past Traits::kSmemBytes: each lane's page-table entries (one per row whose address
// it makes in load_rows) for kSlots key blocks. Those of block i + kLead are copied with V(i), kLead being how far
// the loads run ahead (one block with one K and one V buffer, kStages - 1 with a ring), and a slot is free again once
// its block's loads are issued.
template <class Traits>
struct PagedTableSlots {
    static constexpr int kLead = Traits::kStages == 1 ? 1 : Traits::kStages - 1;
    static constexpr int kSlots = kLead + 1;
    static constexpr int kRowsPerThread = Traits::kBlockN * Traits::kThreadsPerRow / Traits::kNThreads;
    static constexpr int kEntriesPerLane = (kRowsPerThread + Traits::kThreadsPerRow - 1) / Traits::kThreadsPerRow;
    static constexpr int kBytes = kSlots * Traits::kNThreads * kEntriesPerLane * int(sizeof(int));
};

template <class Traits, bool kPaged>
constexpr int fwd_smem_bytes() {
    return Traits::kSmemBytes + (kPaged ? PagedTableSlots<Traits>::kBytes : 0);
}

// kPaged: K and V come from a paged cache (params.block_table), row by row; a kernel of its own, since the row
// addressing next to the dense loads made ptxas spill three times as much in the dense loop.
// kPackedRows: the queries may be GQA-packed (params.packed_heads > 1), their masks and key ranges those of query
// row / packed_heads, and the keys left-padded (params.leftpad_k): the decode kernels; the others skip this work.
template <class Traits, bool kPaged, bool kPackedRows>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(__grid_constant__ FwdParams const params) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kStages = Traits::kStages;
    constexpr int kNWarps = Traits::kNThreads / 32;
    constexpr int kPrefetch = kStages - 1;
    // One K and one V buffer, loads alternating with the two GEMMs (not split-KV, which splits the keys across CTAs).
    constexpr bool kAlternatingKV = kStages == 1;
    // The 16-row decode tile, whose key blocks carry the least compute, loads V(i + 1) as soon as every warp is done
    // with V(i), beside K(i + 1), where no second CTA on the SM overlaps its loads (params.single_cta_per_sm): both
    // in flight at once, not one after the other. (The 64-row tile's paged kernel would spill.)
    bool const kv_together = kAlternatingKV && kPackedRows && Traits::kWarpsOverKeys && params.single_cta_per_sm;

    extern __shared__ __align__(128) char smem[];
    int const tid = threadIdx.x;
    // A decode kernel's split partials go to the combine, which may then start (and wait) beside this grid.
    if constexpr (kPackedRows) { allow_dependent_launch(); }

    // Query tiles are handed out last-first: under a causal mask the last rows do the most work, so they start in the
    // first wave.
    auto const decode = [&](int idx) {
        return decode_tile<kBlockM>(idx, params.cu_seqlens_q, params.seqused_q, params.sq, params.b, params.h, true);
    };
    TileCoord const blk = decode(blockIdx.x);
    if (!blk.valid) { return; }
    SeqlenInfo const seq =
        kPackedRows ? with_leftpad(params, SeqlenInfo(params, blk.batch)) : SeqlenInfo(params, blk.batch);
    int const head_kv = blk.head / params.h_per_hk;
    int const sq = seq.q.len, sk = seq.k.len, d = params.d;
    int const m_block = blk.block;
    int const row0 = m_block * kBlockM;
    int const packed = kPackedRows ? params.packed_heads : 1;
    // In query rows: the first and last query of this tile.
    AttnWindow const window{sq / packed, sk, params.window_left, params.window_right};
    int const query0 = row0 / packed, query1 = (min(sq, row0 + kBlockM) - 1) / packed;

    using Range = BlockRange<kBlockM, kBlockN>;
    Interval n_range = Range::n_blocks_of_rows(window, query0, query1);
    if (params.num_splits > 1) { n_range = split_chunk(n_range, int(blockIdx.y), params.num_splits); }
    int const n_blocks = n_range.hi - n_range.lo;
    int const n_block_max = n_range.hi;

    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tid);
    // The output's MMA: the CTA's, or over keys each warp's own (by lane).
    typename Traits::TiledMmaO tiled_mma_o;
    int const o_tid = Traits::kWarpsOverKeys ? tid % 32 : tid;
    Tensor acc_o = partition_fragment_C(tiled_mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_o);
    auto acc_o_rc = rowcol_view(acc_o);
    constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
    OnlineSoftmax<kRows> softmax;
    softmax.init();

    if (n_blocks > 0) {
        // GQA-packed rows load as a tile where one stride spans them (one query), else row by row.
        int64_t const q_uniform =
            kPackedRows ? uniform_row_stride(packed, sq, params.q_row_stride, params.q_group_stride)
                        : params.q_row_stride;
        Tensor mQ = head_rows<kHeadDim>(static_cast<Element const*>(params.q) +
                                            seq.q_offset(params.q_batch_stride, params.q_row_stride,
                                                         params.q_head_stride, blk.head),
                                        sq, q_uniform != 0 ? q_uniform : params.q_row_stride);
        Tensor mK = head_rows<kHeadDim>(static_cast<Element const*>(params.k) +
                                            seq.k_offset(params.k_batch_stride, params.k_row_stride,
                                                         params.k_head_stride, head_kv),
                                        sk, params.k_row_stride);
        Tensor mV = head_rows<kHeadDim>(static_cast<Element const*>(params.v) +
                                            seq.k_offset(params.v_batch_stride, params.v_row_stride,
                                                         params.v_head_stride, head_kv),
                                        sk, params.v_row_stride);
        Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
        Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n_block)
        Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));

        Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
        // (N, D, stage)
        Tensor sK = make_tensor(sQ.data() + Int<Traits::kSmemQElems>{}, typename Traits::SmemLayoutKV{});
        Tensor sV = make_tensor(sK.data() + Int<Traits::kSmemKVElems>{}, typename Traits::SmemLayoutKV{});
        // (D, N, stage); over keys (D, N of a warp, (warp, stage)), see v_stage.
        Tensor sVt = [&] {
            if constexpr (Traits::kWarpsOverKeys) {
                return make_tensor(sV.data(), typename Traits::SmemLayoutVtWarps{});
            } else {
                return make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
            }
        }();

        typename Traits::GmemTiledCopyQKV gmem_copy;
        auto gmem_thr = gmem_copy.get_thread_slice(tid);
        Tensor tQgQ = gmem_thr.partition_S(gQ);
        Tensor tQsQ = gmem_thr.partition_D(sQ);
        Tensor tKgK = gmem_thr.partition_S(gK);
        Tensor tKsK = gmem_thr.partition_D(sK);
        Tensor tVgV = gmem_thr.partition_S(gV);
        Tensor tVsV = gmem_thr.partition_D(sV);
        Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
        Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

        // A paged cache: the table entries of the rows whose addresses this lane makes in load_rows (LaneRows) for
        // key block i (in visited order). Those of block i + Table::kLead are copied into shared memory with V(i),
        // so that they have landed, like V(i), by the time that block's loads are issued. The first CTA to
        // reach a block's entries misses L2, and under the K/V stream that wait, read when the loads need it, would
        // stall every load behind it (as an L1 prefetch or a register loaded a block ahead still did, where ptxas
        // moves that register within the loop). The first Table::kLead blocks read the table directly.
        using PageLanes = LaneRows<Traits::kThreadsPerRow, decltype(tKVcKV)>;
        using Table = PagedTableSlots<Traits>;
        static_assert(PageLanes::kCount == Table::kEntriesPerLane);
        int const* table = kPaged ? params.block_table + blk.batch * params.block_table_stride : nullptr;
        int* const table_slots = reinterpret_cast<int*>(smem + Traits::kSmemBytes) + tid * PageLanes::kCount;
        // This lane's j-th entry of block i, in the slot that block i takes.
        auto entry_slot = [&](int i, int j) {
            return table_slots + (i % Table::kSlots) * Traits::kNThreads * PageLanes::kCount + j;
        };
        auto n_block_of = [&](int i) { return n_block_max - 1 - i; };  // block i in visited order: last first
        auto table_key = [&](int i, int row) { return seq.k.start + n_block_of(i) * kBlockN + row; };
        auto copy_entries = [&](int i) {
            if constexpr (kPaged) {
                CUTE_UNROLL
                for (int j = 0; j < PageLanes::kCount; ++j) {
                    int const row = PageLanes::row(tKVcKV, j);
                    if (i < n_blocks && row >= 0 && n_block_of(i) * kBlockN + row < sk) {
                        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(
                                         uint32_t(__cvta_generic_to_shared(entry_slot(i, j)))),
                                     "l"(table + page_slot(params, table_key(i, row))));
                    }
                }
            }
        };

        // Loads key block i (in visited order) of K or V into its stage. Only the first block visited (the last key
        // block) can lack rows. A paged cache is read row by row from its pages.
        auto load_block = [&](auto const& tXgX, auto& tXsX, int i, auto check_rows, auto is_v) {
            int const n_block = n_block_of(i);
            int const stage = i % kStages;
            if constexpr (kPaged) {
                constexpr bool kV = decltype(is_v)::value;
                Element const* pool = static_cast<Element const*>(kV ? params.v : params.k) +
                                      blk.head / params.h_per_hk * (kV ? params.v_head_stride : params.k_head_stride);
                int64_t const page_stride = kV ? params.v_batch_stride : params.k_batch_stride;
                int64_t const row_stride = kV ? params.v_row_stride : params.k_row_stride;
                auto row_ptr = [&](int row, int j) -> Element const* {
                    if (n_block * kBlockN + row >= sk) { return nullptr; }
                    int const key = table_key(i, row);  // the table's rows start at leftpad
                    int const slot = page_slot(params, key);
                    int const entry = i < Table::kLead ? table[slot] : *entry_slot(i, j);
                    return pool + pool_page(params, entry) * page_stride + (key - slot * params.page_size) * row_stride;
                };
                load_rows<Traits::kThreadsPerRow>(gmem_copy, tXgX(_, _, _, 0), tXsX(_, _, _, stage), tKVcKV, row_ptr,
                                                  pool, d);
                if constexpr (kV) { copy_entries(i + Table::kLead); }
            } else {
                load_tile<decltype(check_rows)::value>(gmem_copy, tXgX(_, _, _, n_block), tXsX(_, _, _, stage),
                                                       tKVcKV, sk - n_block * kBlockN, d);
            }
        };
        // One commit group per key block; past the last block the group is empty, which keeps the wait counts
        // constant.
        auto load_kv = [&](int i, auto check_rows) {
            if (i < n_blocks) {
                load_block(tKgK, tKsK, i, check_rows, cute::false_type{});
                load_block(tVgV, tVsV, i, check_rows, cute::true_type{});
            }
            cp_async_fence();
        };

        // Q joins the first K/V group. The 16-row tile at d % 64 != 0 is half of a copy's 32 rows: the threads of the
        // other half would zero-fill rows past it, over Q's next column block and K's first stage, racing the loads
        // of both.
        bool const copies_q = kBlockM % Traits::kCopyRows == 0 || tid < kBlockM * Traits::kThreadsPerRow;
        if (copies_q && kPackedRows && q_uniform == 0) {
            Element const* q_first = static_cast<Element const*>(params.q) +
                                     seq.q_offset(params.q_batch_stride, params.q_row_stride, params.q_head_stride,
                                                  blk.head);
            auto row_ptr = [&](int row, int) -> Element const* {
                if (row0 + row >= sq) { return nullptr; }
                return q_first + packed_row_offset(row0 + row, packed, params.q_row_stride, params.q_group_stride);
            };
            load_rows<Traits::kThreadsPerRow>(gmem_copy, tQgQ, tQsQ, tQcQ, row_ptr, q_first, d);
        } else if (copies_q) {
            load_tile<true>(gmem_copy, tQgQ, tQsQ, tQcQ, sq - row0, d);
        }
        // With one K and one V buffer, K(0) (with Q) and V(0) are a group each, so that the loop may wait for K alone.
        if constexpr (kAlternatingKV) {
            load_block(tKgK, tKsK, 0, cute::true_type{}, cute::false_type{});
            cp_async_fence();
            load_block(tVgV, tVsV, 0, cute::true_type{}, cute::true_type{});
            cp_async_fence();
        } else {
            CUTE_UNROLL
            for (int i = 0; i < kPrefetch; ++i) { load_kv(i, cute::true_type{}); }
        }

        Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
        Tensor tSrK = thr_mma.partition_fragment_B(sK(_, _, 0));
        Tensor tOrVt = tiled_mma_o.get_thread_slice(o_tid).partition_fragment_B(sVt(_, _, 0));
        auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
        auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
        auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_o);
        auto const tSsQ = make_xor_operand(smem_copy_q.get_thread_slice(tid), sQ);
        auto const tSsK = make_xor_operand(smem_copy_k.get_thread_slice(tid), sK);    // (CPY, N, K, stage)
        auto const tOsVt = make_xor_operand(smem_copy_v.get_thread_slice(o_tid), sVt);  // (CPY, D, N, stage)

        Tensor coord_s_rc =
            rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
        float const slope = params.alibi_slopes == nullptr ? 0.f : alibi_slope(params, blk.batch, blk.head);

        // The loop exists twice: with and without softcap / ALiBi. Left as runtime branches inside one loop, the
        // compiler if-converts them and every iteration pays for their instructions.
        auto mainloop = [&](auto with_score_mods) {
            for (int i = 0; i < n_blocks; ++i) {
                int const n_block = n_block_of(i);
                int const stage = i % kStages;
                int const col0 = n_block * kBlockN;

                Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
                clear(acc_s);
                if constexpr (kAlternatingKV) {
                    // K(i) landed. Loads one after the other: every warp is done with V(i - 1), so its buffer takes
                    // V(i); block 0's V came with the prologue, so the loop never loads a partial block. Loads
                    // together: V(i) was issued after O += P V(i - 1) and may still be on its way.
                    if (kv_together) {
                        cp_async_wait<1>();
                    } else {
                        cp_async_wait<0>();
                    }
                    __syncthreads();
                    if (!kv_together && i > 0) { load_block(tVgV, tVsV, i, cute::false_type{}, cute::true_type{}); }
                    cp_async_fence();
                } else {
                    // This block's K and V were issued a whole block earlier: one barrier per block publishes them
                    // and also frees the stage that the next loads overwrite.
                    cp_async_wait<kPrefetch - 1>();
                    __syncthreads();
                    load_kv(i + kPrefetch, cute::false_type{});
                }
                gemm_ss(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK.stage(stage), smem_copy_q, smem_copy_k, tid);
                if constexpr (kAlternatingKV) {
                    // V(i) landed, and every warp is done with K(i): its buffer takes K(i + 1).
                    cp_async_wait<0>();
                    __syncthreads();
                    if (i + 1 < n_blocks) { load_block(tKgK, tKsK, i + 1, cute::false_type{}, cute::false_type{}); }
                    cp_async_fence();
                }

                auto s_rc = rowcol_view(acc_s);
                if constexpr (decltype(with_score_mods)::value) {
                    if (params.has_softcap) { apply_softcap(acc_s, params.softcap_pre); }
                    if (params.alibi_slopes != nullptr) {
                        apply_alibi(s_rc, coord_s_rc, row0, col0, window.diag_offset(), slope);
                    }
                }
                if (Range::needs_mask_of_rows(window, query0, (row0 + kBlockM - 1) / packed, n_block)) {
                    apply_mask<true, kPackedRows>(s_rc, coord_s_rc, window, row0, col0, packed);
                }
                softmax.update(s_rc, acc_o_rc, params.scale_log2);

                Tensor rP = convert_fragment<Element>(acc_s);
                Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
                int const v_stage = Traits::kWarpsOverKeys ? tid / 32 + kNWarps * stage : stage;
                gemm_rs(tiled_mma_o, acc_o, tOrP, tOrVt, tOsVt.stage(v_stage), smem_copy_v, o_tid);
                if (kv_together) {
                    // Every warp is done with V(i): its buffer takes V(i + 1), beside K(i + 1) in flight.
                    __syncthreads();
                    if (i + 1 < n_blocks) { load_block(tVgV, tVsV, i + 1, cute::false_type{}, cute::true_type{}); }
                    cp_async_fence();
                }
            }
        };
        if (params.has_softcap || params.alibi_slopes != nullptr) {
            mainloop(cute::true_type{});
        } else {
            mainloop(cute::false_type{});
        }
        cp_async_wait<0>();
    }

    float lse[kRows];
    softmax.finalize(acc_o_rc, params.logit_scale, lse);
    // Splits merged inside the cluster: every thread takes part, including those that hold no output.
    bool const cluster_merge = kPackedRows && params.num_splits > 1 && params.o_partial == nullptr;
    bool holds_output = true;
    if constexpr (Traits::kWarpsOverKeys) {
        holds_output = merge_warp_outputs<kNWarps>(acc_o, lse, smem, tid, sq - row0 > 8);  // warp 0 stores
        if (!holds_output && !cluster_merge) { return; }
    }
    TileCoord const out_blk = decode(block_index_reread());
    int const store_tid = Traits::kWarpsOverKeys ? thread_index_reread() % 32 : thread_index_reread();
    if constexpr (kPackedRows) {
        if (cluster_merge) {
            merge_splits_in_cluster<Traits>(tiled_mma_o, acc_o, lse, holds_output, smem, params,
                                            SeqlenInfo(params, out_blk.batch), out_blk.block, out_blk.head,
                                            store_tid);
            return;
        }
    }
    if (params.o_partial != nullptr) {
        store_partial<Traits, kPackedRows>(tiled_mma_o, acc_o, lse, params, SeqlenInfo(params, out_blk.batch),
                                           out_blk.block, out_blk.head, int(blockIdx.y), store_tid);
        return;
    }
    // From registers: the warps-over-keys tile's warp 0 holds the output, and GQA-packed rows lie apart.
    if (Traits::kWarpsOverKeys || (kPackedRows && params.packed_heads > 1)) {
        store_output_rows<Traits, kPackedRows>(tiled_mma_o, acc_o, lse, params, SeqlenInfo(params, out_blk.batch),
                                               out_blk.block, out_blk.head, store_tid);
    } else {
        store_output<Traits>(tiled_mma, acc_o, lse, smem, params, SeqlenInfo(params, out_blk.batch), out_blk.block,
                             out_blk.head, store_tid);
    }
}

}  // namespace flash::sm80
