// SM90-tier forward kernel (first version): one CTA of kBlockM / 64 warpgroups computes a kBlockM x d output tile.
// Thread 0 loads Q and a ring of kStages K / V blocks with TMA, each completing on its own mbarrier; every warpgroup
// runs S = Q K^T with wgmma from shared memory, the online softmax in registers, then O += P V with P from
// registers. Key blocks are visited last-first (masked blocks first), as in the SM80 tier. Not yet warp-specialized
// or ping-ponged.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/block_range.h"
#include "../common/block_scheduler.h"
#include "../common/mask.h"
#include "../common/params.h"
#include "../common/score_mod.h"
#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "../sm80/epilogue.h"
#include "../sm80/mainloop.h"
#include "tile_traits.h"

namespace flash::sm90 {

using namespace cute;
using Barrier = cutlass::arch::ClusterTransactionBarrier;

template <class Traits>
struct FwdKernelParams {
    FwdParams p;
    typename Traits::TmaQ tma_q;
    typename Traits::TmaKV tma_k;
    typename Traits::TmaKV tma_v;
};

// The registers of an m64nN accumulator ((2, 2, N / 8), MMA_M, MMA_N) read as the A operand of an m64nKk16 wgmma
// ((2, 2, 2), MMA_M, K / 16): two n8 blocks form one k16 slice, so P never leaves registers.
template <class Layout>
__device__ __forceinline__ constexpr auto acc_as_a_operand(Layout const& acc) {
    auto l = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
    return make_layout(make_layout(get<0>(l), get<1>(l), get<2, 0>(l)), get<1>(acc),
                       coalesce(make_layout(get<2, 1>(l), get<2>(acc))));
}

template <class TiledMma, class Acc, class FragA, class FragB>
__device__ __forceinline__ void wgmma(TiledMma& tiled_mma, FragA const& a, FragB const& b, Acc& acc) {
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a); ++k) {
        cute::gemm(tiled_mma, a(_, _, k), b(_, _, k), acc);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_kernel(__grid_constant__ FwdKernelParams<Traits> const args) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kStages = Traits::kStages;
    FwdParams const& params = args.p;

    extern __shared__ __align__(1024) char smem_buf[];
    auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
    int const tid = threadIdx.x;

    auto const decode = [&](int idx) {
        return decode_tile<kBlockM>(idx, params.cu_seqlens_q, params.seqused_q, params.sq, params.b, params.h, true);
    };
    TileCoord const blk = decode(blockIdx.x);
    if (!blk.valid) { return; }
    SeqlenInfo const seq(params, blk.batch);
    int const head_kv = blk.head / params.h_per_hk;
    int const sq = seq.q.len, sk = seq.k.len;
    AttnWindow const window = seq.window(params);
    int const m_block = blk.block;
    int const row0 = m_block * kBlockM;
    using Range = BlockRange<kBlockM, kBlockN>;
    Interval const n_range = Range::n_blocks(window, m_block);
    int const n_blocks = n_range.hi - n_range.lo;

    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutVt{});

    typename Traits::TiledMmaS mma_s;
    typename Traits::TiledMmaO mma_o;
    auto thr_s = mma_s.get_thread_slice(tid);
    auto thr_o = mma_o.get_thread_slice(tid);
    Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_o);
    auto acc_o_rc = sm80::rowcol_view(acc_o);
    constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
    OnlineSoftmax<kRows> softmax;
    softmax.init();

    if (n_blocks > 0) {
        if (tid == 0) {
            Barrier::init(&shared.bar_q, 1);
            CUTE_UNROLL
            for (int s = 0; s < kStages; ++s) {
                Barrier::init(&shared.bar_k[s], 1);
                Barrier::init(&shared.bar_v[s], 1);
            }
            cutlass::arch::fence_barrier_init();
        }
        __syncthreads();

        // TMA coordinates: (row, col, head, batch entry), this sequence's rows first. Rows past the tensor and
        // columns past d arrive as zeros; rows of the next packed sequence are masked (keys) or not stored (queries).
        int const entry = params.cu_seqlens_q == nullptr ? seq.batch : 0;
        Tensor mQ = args.tma_q.get_tma_tensor(make_shape(params.sq, params.d, params.h, tensor_batches(params)));
        Tensor mK = args.tma_k.get_tma_tensor(make_shape(params.sk, params.d, params.hk, tensor_batches(params)));
        Tensor mV = args.tma_v.get_tma_tensor(make_shape(params.sk, params.d, params.hk, tensor_batches(params)));
        Tensor gQ = local_tile(domain_offset(make_coord(seq.q.start, _0{}), mQ(_, _, blk.head, entry)),
                               Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));
        Tensor gK = local_tile(domain_offset(make_coord(seq.k.start, _0{}), mK(_, _, head_kv, entry)),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, D, n)
        Tensor gV = local_tile(domain_offset(make_coord(seq.k.start, _0{}), mV(_, _, head_kv, entry)),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
        auto tma_q = args.tma_q.get_slice(_0{});
        auto tma_k = args.tma_k.get_slice(_0{});
        auto tma_v = args.tma_v.get_slice(_0{});
        Tensor tQgQ = tma_q.partition_S(gQ);
        Tensor tQsQ = tma_q.partition_D(sQ);
        Tensor tKgK = tma_k.partition_S(gK);  // (TMA, 1, 1, n)
        Tensor tKsK = tma_k.partition_D(sK);  // (TMA, 1, 1, stage)
        Tensor tVgV = tma_v.partition_S(gV);
        Tensor tVsV = tma_v.partition_D(sV);

        int const n_block_max = n_range.hi;
        // Thread 0 issues key block i (in visited order) into its stage.
        auto load_kv = [&](int i) {
            int const stage = i % kStages;
            int const n_block = n_block_max - 1 - i;
            Barrier::arrive_and_expect_tx(&shared.bar_k[stage], Traits::kKVBytes);
            copy(args.tma_k.with(shared.bar_k[stage]), tKgK(_, _, _, n_block), tKsK(_, _, _, stage));
            Barrier::arrive_and_expect_tx(&shared.bar_v[stage], Traits::kKVBytes);
            copy(args.tma_v.with(shared.bar_v[stage]), tVgV(_, _, _, n_block), tVsV(_, _, _, stage));
        };
        if (tid == 0) {
            Barrier::arrive_and_expect_tx(&shared.bar_q, Traits::kQBytes);
            copy(args.tma_q.with(shared.bar_q), tQgQ, tQsQ);
            for (int i = 0; i < min(kStages, n_blocks); ++i) { load_kv(i); }
        }

        Tensor tSrQ = thr_s.partition_fragment_A(sQ);
        Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
        Tensor tOrVt = thr_o.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
        Tensor coord_s_rc = sm80::rowcol_view(
            thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
        float const alibi_slope =
            params.alibi_slopes == nullptr
                ? 0.f
                : params.alibi_slopes[blk.batch * params.alibi_batch_stride + blk.head] / params.logit_scale;

        Barrier::wait(&shared.bar_q, 0);
        for (int i = 0; i < n_blocks; ++i) {
            int const n_block = n_block_max - 1 - i;
            int const stage = i % kStages;
            int const phase = (i / kStages) & 1;
            int const col0 = n_block * kBlockN;

            Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
            Barrier::wait(&shared.bar_k[stage], phase);
            wgmma(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);

            auto s_rc = sm80::rowcol_view(acc_s);
            if (params.has_softcap) { apply_softcap(acc_s, params.softcap_pre); }
            if (params.alibi_slopes != nullptr) {
                apply_alibi(s_rc, coord_s_rc, row0, col0, window.diag_offset(), alibi_slope);
            }
            if (Range::needs_mask(window, m_block, n_block)) { apply_mask(s_rc, coord_s_rc, window, row0, col0); }
            softmax.update(s_rc, acc_o_rc, params.scale_log2);
            Tensor rP = sm80::convert_fragment<Element>(acc_s);
            Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));

            Barrier::wait(&shared.bar_v[stage], phase);
            if (col0 + kBlockN > sk) {
                // Rows past this sequence's keys hold other data (or, past seqused, anything: NaN * 0 is NaN).
                int const rows_left = sk - col0;
                for (int idx = tid; idx < kBlockN * kHeadDim; idx += Traits::kNThreads) {
                    int const r = idx / kHeadDim, c = idx % kHeadDim;
                    if (r >= rows_left) { sV(r, c, stage) = Element(0); }
                }
                cutlass::arch::fence_view_async_shared();
                __syncthreads();
            }
            // O += P V, accumulating into acc_o.
            warpgroup_fence_operand(acc_o);
            warpgroup_arrive();
            CUTE_UNROLL
            for (int k = 0; k < size<2>(tOrP); ++k) {
                cute::gemm(mma_o, tOrP(_, _, k), tOrVt(_, _, k, stage), acc_o);
            }
            warpgroup_commit_batch();
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_o);

            // Every warpgroup is done with this stage: thread 0 refills it.
            __syncthreads();
            if (tid == 0 && i + kStages < n_blocks) { load_kv(i + kStages); }
        }
    }

    float lse[kRows];
    softmax.finalize(acc_o_rc, params.logit_scale, lse);
    sm80::store_output<Traits>(mma_o, acc_o, lse, smem_buf, params, seq, m_block, blk.head, tid);
}

}  // namespace flash::sm90
