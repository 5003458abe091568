// SM80-tier backward main kernel (FlashAttention-2's design): one CTA owns kBlockN keys of one kv head, keeps K and V
// in shared memory and dK, dV in fp32 registers, and walks the query tiles that see its keys, for every query head of
// its GQA group (so dK and dV are reduced over the group in registers, with no expanded copy and no atomics). Per
// query tile:
//   wait Q, dO -> barrier -> issue the next Q (other stage) -> S = Q K^T, dP = dO V^T -> P = exp2(S - lse),
//   dS = P (dP - D) -> P, dS to smem -> barrier -> dV += P^T dO -> barrier -> issue the next dO ->
//   dQ = dS K, added into the fp32 dQ workspace -> dK += dS^T Q.
// The softmax scale is applied once, to dK here and to dQ in the conversion kernel.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "../common/block_range.h"
#include "../common/block_scheduler.h"
#include "../common/bwd_workspace.h"
#include "../common/mask.h"
#include "../common/params.h"
#include "../common/score_mod.h"
#include "../common/seqlen.h"
#include "epilogue.h"
#include "gemm.h"

namespace flash::sm80 {

using namespace cute;

// Deterministic dQ: the CTAs that add into one query tile's dQ do so one at a time, in launch order (ascending key
// blocks, or descending when decode_tile reverses them), counted by a semaphore per (batch, head, query tile).
// A CTA only waits for CTAs launched before it, so the wait cannot deadlock. It waits for a count of at least its
// rank rather than exactly: the same for valid input (the count cannot pass a rank before that CTA adds), and no
// hang when malformed cu_seqlens make two sequences share semaphores.
struct DqOrder {
    int* semaphore;
    int rank;

    __device__ __forceinline__ void acquire(int tid) const {
        if (tid == 0) {
            while (load_acquire(semaphore) < rank) {}
        }
        __syncthreads();
    }

    // Every thread's adds are made visible before the count moves on.
    __device__ __forceinline__ void release(int tid) const {
        __threadfence();
        __syncthreads();
        if (tid == 0) { atomicAdd(semaphore, 1); }
    }
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(__grid_constant__ BwdParams const params,
                                                                    int section) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kQStages = Traits::kQStages;
    constexpr int kNThreads = Traits::kNThreads;
    using Range = BlockRange<kBlockM, kBlockN>;

    extern __shared__ __align__(128) char smem[];
    int const tid = threadIdx.x;
    // Under a causal mask the first key blocks see the most query tiles, so ascending order starts the longest first;
    // the deterministic dQ order hands them out last-first instead (launch order = accumulation order). `section`:
    // decode_tile's (batch, kv head) pairs taken together (launch_bwd).
    bool const reverse = params.deterministic && params.window_right >= 0;
    TileCoord const blk = decode_tile<kBlockN>(blockIdx.x, params.cu_seqlens_k, params.seqused_k, params.sk, params.b,
                                               params.hk, reverse, section);
    if (!blk.valid) { return; }
    SeqlenInfo const seq(params, blk.batch);
    int const sq = seq.q.len, sk = seq.k.len, d = params.d;
    AttnWindow const window = seq.window(params);
    int const n_block = blk.block, head_kv = blk.head, batch = blk.batch;

    Interval const m_range = Range::m_blocks(window, n_block);
    int const m_count = m_range.hi - m_range.lo;
    int const iters = m_count * params.h_per_hk;

    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(sQ.data() + Int<Traits::kSmemQElems>{}, typename Traits::SmemLayoutdO{});
    Tensor sK = make_tensor(sdO.data() + Int<Traits::kSmemdOElems>{}, typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(sK.data() + Int<Traits::kSmemKVElems>{}, typename Traits::SmemLayoutKV{});
    Tensor sP = make_tensor(sV.data() + Int<Traits::kSmemKVElems>{}, typename Traits::SmemLayoutPdS{});
    Tensor sdS = make_tensor(sP.data() + Int<Traits::kSmemPdSElems>{}, typename Traits::SmemLayoutPdS{});
    Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutdOt{});
    Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
    Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});
    Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});

    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    auto thr_dkv = mma_dkv.get_thread_slice(tid);
    auto thr_dq = mma_dq.get_thread_slice(tid);

    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    clear(acc_dk);
    clear(acc_dv);

    if (iters > 0) {
        auto gmem_rows = [&](void const* base, int64_t offset, int64_t row_stride, int rows) {
            return head_rows<kHeadDim>(static_cast<Element const*>(base) + offset, rows, row_stride);
        };
        Tensor gK = local_tile(gmem_rows(params.k,
                                         seq.k_offset(params.k_batch_stride, params.k_row_stride,
                                                      params.k_head_stride, head_kv),
                                         params.k_row_stride, sk),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
        Tensor gV = local_tile(gmem_rows(params.v,
                                         seq.k_offset(params.v_batch_stride, params.v_row_stride,
                                                      params.v_head_stride, head_kv),
                                         params.v_row_stride, sk),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));

        typename Traits::GmemTiledCopyQKV gmem_copy;
        auto gmem_thr = gmem_copy.get_thread_slice(tid);
        Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
        Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
        load_tile<true>(gmem_copy, gmem_thr.partition_S(gK), gmem_thr.partition_D(sK), tKVcKV, sk - n_block * kBlockN,
                        d);
        load_tile<true>(gmem_copy, gmem_thr.partition_S(gV), gmem_thr.partition_D(sV), tKVcKV, sk - n_block * kBlockN,
                        d);

        // Rows of Q or dO of one (head, query tile) into a shared tile; rows past sq are zero-filled.
        auto load_rows = [&](void const* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride, int head,
                             int m_block, auto&& s) {
            Tensor g = local_tile(gmem_rows(base, seq.q_offset(batch_stride, row_stride, head_stride, head), row_stride,
                                            sq),
                                  Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
            load_tile<true>(gmem_copy, gmem_thr.partition_S(g), gmem_thr.partition_D(s), tQcQ, sq - m_block * kBlockM,
                            d);
        };
        // lse and D of a query tile's rows go to shared memory with its Q (one stage each, zero past sq) and are read
        // after the S and dP GEMMs, so they hold no registers across them.
        float* const s_lse = reinterpret_cast<float*>(smem + Traits::kSmemRowStatsOffset);  // (kBlockM, kQStages)
        float* const s_dpsum = s_lse + kQStages * kBlockM;
        auto load_q = [&](int head, int m_block, int stage) {
            load_rows(params.q, params.q_batch_stride, params.q_head_stride, params.q_row_stride, head, m_block,
                      sQ(_, _, stage));
            int const row = m_block * kBlockM + tid % kBlockM;
            int64_t const idx = seq.row_stats_index(params, head) + min(row, sq - 1);
            if (tid < 2 * kBlockM) {
                float const* src = tid < kBlockM ? params.lse + idx : params.dpsum + idx;
                float* dst = (tid < kBlockM ? s_lse : s_dpsum) + stage * kBlockM + tid % kBlockM;
                SM80_CP_ASYNC_CACHEALWAYS_ZFILL<float>::copy(*src, *dst, row < sq);
            }
        };
        auto load_do = [&](int head, int m_block) {
            load_rows(params.dout, params.do_batch_stride, params.do_head_stride, params.do_row_stride, head, m_block,
                      sdO);
        };
        // Iterations walk (query head of the group, query tile) pairs, tiles fastest. The next pair is stepped to
        // rather than divided out of the iteration count: integer divisions in this loop cost measurable time.
        int head = head_kv * params.h_per_hk, m_block = m_range.lo;
        load_q(head, m_block, 0);
        load_do(head, m_block);
        cp_async_fence();

        // shared -> register copies, one per operand role
        auto copy_a_sdp = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
        auto copy_b_sdp = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
        auto copy_a_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
        auto copy_b_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
        auto copy_a_dq = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
        auto copy_b_dq = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dq);
        // ldmatrix sources, each addressed from one held base per thread (see XorSmemOperand); Q's are per stage.
        auto const tSsQ = make_xor_operand(copy_a_sdp.get_thread_slice(tid), sQ);
        auto const tSsK = make_xor_operand(copy_b_sdp.get_thread_slice(tid), sK);
        auto const tdPsdO = make_xor_operand(copy_a_sdp.get_thread_slice(tid), sdO);
        auto const tdPsV = make_xor_operand(copy_b_sdp.get_thread_slice(tid), sV);
        auto const tdVsPt = make_xor_operand(copy_a_dkv.get_thread_slice(tid), sPt);
        auto const tdVsdOt = make_xor_operand(copy_b_dkv.get_thread_slice(tid), sdOt);
        auto const tdKsdSt = make_xor_operand(copy_a_dkv.get_thread_slice(tid), sdSt);
        auto const tdKsQt = make_xor_operand(copy_b_dkv.get_thread_slice(tid), sQt);
        auto const tdQsdS = make_xor_operand(copy_a_dq.get_thread_slice(tid), sdS);
        auto const tdQsKt = make_xor_operand(copy_b_dq.get_thread_slice(tid), sKt);

        Tensor tSrQ = thr_sdp.partition_fragment_A(sQ(_, _, 0));
        Tensor tSrK = thr_sdp.partition_fragment_B(sK);
        Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
        Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
        Tensor tdVrPt = thr_dkv.partition_fragment_A(sPt);
        Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);
        Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdSt);
        Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt(_, _, 0));
        Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
        Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);

        // register -> shared copies of P and dS
        auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, mma_sdp);
        auto thr_pds = copy_pds.get_thread_slice(tid);
        Tensor tPsP = thr_pds.partition_D(sP);
        Tensor tdSsdS = thr_pds.partition_D(sdS);

        Tensor coord_s_rc =
            rowcol_view(thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
        constexpr int kRows = decltype(size<0>(coord_s_rc))::value;
        int const col0 = n_block * kBlockN;

        // The loop exists twice, with and without softcap / ALiBi, so that the common case pays nothing for them.
        auto mainloop = [&](auto with_score_mods) __attribute__((always_inline)) {
            for (int it = 0; it < iters; ++it) {
                bool const has_next = it + 1 < iters;
                int const next_head = m_block + 1 == m_range.hi ? head + 1 : head;
                int const next_m_block = m_block + 1 == m_range.hi ? m_range.lo : m_block + 1;
                int const row0 = m_block * kBlockM;
                int const stage = it % kQStages;

                // Q(it) and dO(it) landed, and every warp is done with iteration it - 1: P, dS and the other Q stage
                // are free.
                cp_async_wait<0>();
                __syncthreads();
                if constexpr (kQStages == 2) {
                    if (has_next) { load_q(next_head, next_m_block, (it + 1) % kQStages); }
                    cp_async_fence();
                }

                Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
                Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
                clear(acc_s);
                clear(acc_dp);
                gemm_ss(mma_sdp, acc_s, tSrQ, tSrK, tSsQ.stage(stage), tSsK.opaque(), copy_a_sdp, copy_b_sdp, tid);
                gemm_ss(mma_sdp, acc_dp, tdPrdO, tdPrV, tdPsdO.opaque(), tdPsV.opaque(), copy_a_sdp, copy_b_sdp, tid);

                // lse in log2 units and D of this thread's rows. Rows past sq and rows that see no key (lse -inf) get
                // lse +inf, so P = 0 there.
                float lse2[kRows];
                auto s_rc = rowcol_view(acc_s);
                auto dp_rc = rowcol_view(acc_dp);
                CUTE_UNROLL
                for (int r = 0; r < kRows; ++r) {
                    int const row = get<0>(coord_s_rc(r, 0));
                    float const lse = s_lse[stage * kBlockM + row];
                    lse2[r] = row0 + row >= sq || lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
                    float const dpsum = s_dpsum[stage * kBlockM + row];
                    CUTE_UNROLL
                    for (int c = 0; c < size<1>(dp_rc); ++c) { dp_rc(r, c) -= dpsum; }
                }
                if constexpr (decltype(with_score_mods)::value) {
                    apply_score_mods_bwd(params, acc_s, acc_dp, s_rc, coord_s_rc, batch, head, row0, col0,
                                         window);
                }
                // Keys past sk must be masked too: their zero-filled scores would give P = exp2(-lse) > 0.
                if (Range::needs_mask(window, m_block, n_block)) { apply_mask(s_rc, coord_s_rc, window, row0, col0); }
                CUTE_UNROLL
                for (int r = 0; r < kRows; ++r) {
                    CUTE_UNROLL
                    for (int c = 0; c < size<1>(s_rc); ++c) {
                        float const p = exp2f(s_rc(r, c) * params.scale_log2 - lse2[r]);
                        s_rc(r, c) = p;
                        dp_rc(r, c) *= p;
                    }
                }
                copy(copy_pds, thr_pds.retile_S(convert_fragment<Element>(acc_s)), tPsP);
                copy(copy_pds, thr_pds.retile_S(convert_fragment<Element>(acc_dp)), tdSsdS);
                __syncthreads();

                gemm_ss(mma_dkv, acc_dv, tdVrPt, tdVrdOt, tdVsPt.opaque(), tdVsdOt.opaque(), copy_a_dkv, copy_b_dkv,
                        tid);
                // Every warp is done with dO: the next tile's dO loads under dQ and dK.
                __syncthreads();
                if (has_next) { load_do(next_head, next_m_block); }
                cp_async_fence();

                Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
                clear(acc_dq);
                gemm_ss(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS.opaque(), tdQsKt.opaque(), copy_a_dq, copy_b_dq, tid);
                int64_t const dq_row = dq_accum_row(params, seq, head) + row0;
                float* dq_tile = params.dq_accum + dq_row * kHeadDim;
                if (params.deterministic) {
                    Interval const n_range = Range::n_blocks(window, m_block);
                    DqOrder const order{params.dq_semaphore + dq_row / kBlockM,
                                        reverse ? n_range.hi - 1 - n_block : n_block - n_range.lo};
                    order.acquire(tid);
                    add_dq<kNThreads>(dq_tile, acc_dq, tid);
                    order.release(tid);
                } else {
                    add_dq<kNThreads>(dq_tile, acc_dq, tid);
                }

                gemm_ss(mma_dkv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt.opaque(), tdKsQt.stage(stage), copy_a_dkv,
                        copy_b_dkv, tid);
                if constexpr (kQStages == 1) {
                    // Every warp is done with Q.
                    __syncthreads();
                    if (has_next) { load_q(next_head, next_m_block, 0); }
                    cp_async_fence();
                }
                head = next_head;
                m_block = next_m_block;
            }
        };
        if (params.has_softcap || params.alibi_slopes != nullptr) {
            mainloop(cute::true_type{});
        } else {
            mainloop(cute::false_type{});
        }
    }

    // A key block that no query sees stores zeros.
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) { acc_dk(i) *= params.softmax_scale; }
    auto gmem_out = [&](void* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride) {
        Tensor m = head_rows<kHeadDim>(
            static_cast<Element*>(base) + seq.k_offset(batch_stride, row_stride, head_stride, head_kv), sk, row_stride);
        return local_tile(m, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
    };
    store_tile<Traits>(mma_dkv, acc_dk, sK, gmem_out(params.dk, params.dk_batch_stride, params.dk_head_stride,
                                                     params.dk_row_stride),
                       sk - n_block * kBlockN, d, tid);
    store_tile<Traits>(mma_dkv, acc_dv, sV, gmem_out(params.dv, params.dv_batch_stride, params.dv_head_stride,
                                                     params.dv_row_stride),
                       sk - n_block * kBlockN, d, tid);
}

}  // namespace flash::sm80
