// Backward postprocess: the fp32 dQ workspace, scaled by the softmax scale, to dQ in the input dtype. One CTA per
// (query tile, head, sequence) reads the tile in the main kernel's fragment order (dq_workspace_index), so it takes the
// same tile traits.
#pragma once

#include <cute/tensor.hpp>

#include "../common/params.h"
#include "bwd_kernel.h"
#include "epilogue.h"

namespace flash::sm80 {

using namespace cute;

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads) bwd_convert_dq_kernel(__grid_constant__ BwdParams const params) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kHeadDim = Traits::kHeadDim;
    extern __shared__ __align__(128) char smem[];
    int const tid = threadIdx.x;
    TileCoord const blk =
        decode_tile<kBlockM>(blockIdx.x, params.cu_seqlens_q, params.seqused_q, params.sq, params.b, params.h, false);
    if (!blk.valid) { return; }
    SeqlenInfo const seq(params, blk.batch);
    int const m_block = blk.block, head = blk.head;

    typename Traits::TiledMmadQ mma_dq;
    Tensor acc = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    float const* tile = params.dq_accum + (dq_accum_row(params, seq, head) + m_block * kBlockM) * kHeadDim;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 4) {
        float4 const v = *reinterpret_cast<float4 const*>(tile + dq_workspace_index<Traits::kNThreads>(i, tid));
        acc(i) = v.x * params.softmax_scale;
        acc(i + 1) = v.y * params.softmax_scale;
        acc(i + 2) = v.z * params.softmax_scale;
        acc(i + 3) = v.w * params.softmax_scale;
    }

    Tensor sdQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutdO{});
    Tensor mdQ = head_rows<kHeadDim>(static_cast<Element*>(params.dq) + seq.q_offset(params.dq_batch_stride,
                                                                                     params.dq_row_stride,
                                                                                     params.dq_head_stride, head),
                                     seq.q.len, params.dq_row_stride);
    Tensor gdQ = local_tile(mdQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
    store_tile<Traits>(mma_dq, acc, sdQ, gdQ, seq.q.len - m_block * kBlockM, params.d, tid);
}

}  // namespace flash::sm80
