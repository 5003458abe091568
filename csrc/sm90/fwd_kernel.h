// SM90-tier forward kernel: one CTA computes a kBlockM x d output tile with a producer warpgroup (one thread issues
// every TMA, the others leave) and kBlockM / 64 consumer warpgroups (wgmma, softmax, epilogue); setmaxnreg moves the
// producer's registers to the consumers. The roles' code is in mainloop.h.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/block_range.h"
#include "../common/block_scheduler.h"
#include "../common/params.h"
#include "../common/seqlen.h"
#include "../common/softmax.h"
#include "../sm80/epilogue.h"
#include "mainloop.h"
#include "tile_traits.h"

namespace flash::sm90 {

using namespace cute;

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_kernel(__grid_constant__ FwdKernelParams<Traits> const args) {
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    FwdParams const& params = args.p;

    extern __shared__ __align__(1024) char smem_buf[];
    auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
    int const tid = threadIdx.x;

    TileCoord const blk =
        decode_tile<kBlockM>(blockIdx.x, params.cu_seqlens_q, params.seqused_q, params.sq, params.b, params.h, true);
    if (!blk.valid) { return; }
    SeqlenInfo const seq(params, blk.batch);
    AttnWindow const window = seq.window(params);
    Interval const n_range = BlockRange<kBlockM, kBlockN>::n_blocks(window, blk.block);

    if (tid == 0) {
        cutlass::arch::ClusterTransactionBarrier::init(&shared.q_full, 1);
        shared.k_ring.init(Traits::kConsumerThreads / 32);
        shared.v_ring.init(Traits::kConsumerThreads / 32);
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();

    if (tid < 128) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
        if (tid < 32 && cute::elect_one_sync() && !n_range.empty()) { load<Traits>(args, shared, seq, blk, n_range); }
        return;
    }
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    int const ctid = tid - 128;
    typename Traits::TiledMmaO mma_o;
    Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_o);
    auto acc_o_rc = sm80::rowcol_view(acc_o);
    constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
    OnlineSoftmax<kRows> softmax;
    softmax.init();
    if (!n_range.empty()) {
        float const alibi_slope =
            params.alibi_slopes == nullptr
                ? 0.f
                : params.alibi_slopes[blk.batch * params.alibi_batch_stride + blk.head] / params.logit_scale;
        consume<Traits>(params, shared, window, blk.block, n_range, alibi_slope, ctid, acc_o, softmax);
    }
    float lse[kRows];
    softmax.finalize(acc_o_rc, params.logit_scale, lse);
    sm80::store_output<Traits>(mma_o, acc_o, lse, smem_buf, params, seq, blk.block, blk.head, ctid);
}

}  // namespace flash::sm90
