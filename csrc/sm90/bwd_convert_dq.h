// SM90-tier backward postprocess: the fp32 dQ workspace, scaled by the softmax scale, to dQ in the input dtype. One
// CTA per (query block, head, sequence) of the main kernel's consumer threads: each reads its fragment of the tile
// in the order the main kernel staged it (each consumer warpgroup's part one run, in dq_workspace_index order), and
// the tile goes out through shared memory as whole 16-byte pieces of rows (from the fragment, a warp's store would
// cover 16 bytes of each of 8 rows).
#pragma once

#include <cute/tensor.hpp>

#include "../common/block_scheduler.h"
#include "../common/bwd_workspace.h"
#include "../common/fragment.h"
#include "../common/params.h"
#include "../common/seqlen.h"
#include "epilogue.h"
#include "tile_traits.h"

namespace flash::sm90 {

using namespace cute;

template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads)
    bwd_convert_dq_kernel(__grid_constant__ BwdParams const params) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
    int const tid = threadIdx.x;
    TileCoord const blk =
        decode_tile<kBlockM>(blockIdx.x, params.cu_seqlens_q, params.seqused_q, params.sq, params.b, params.h, false);
    if (!blk.valid) { return; }
    SeqlenInfo const seq(params, blk.batch);
    int const row0 = blk.block * kBlockM;

    typename Traits::TiledMmadQ mma_dq;
    Tensor acc = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    float const* chunk = params.dq_accum + (dq_accum_row(params, seq, blk.head) + row0) * kHeadDim +
                         tid / 128 * Traits::kdQChunkFloats;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 4) {
        float4 const v = *reinterpret_cast<float4 const*>(chunk + dq_workspace_index<128>(i, tid % 128));
        acc(i) = v.x;
        acc(i + 1) = v.y;
        acc(i + 2) = v.z;
        acc(i + 3) = v.w;
    }
    Tensor coord_rc = rowcol_view(
        mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    // Rows padded by 16 bytes, so that the fragment's pairs of 8 rows fall in different banks.
    constexpr int kPitch = kHeadDim + 8;
    __shared__ alignas(16) Element tile[kBlockM * kPitch];
    float const scale = params.softmax_scale;
    store_row_pairs(coord_rc, rowcol_view(acc), tile, kPitch, kBlockM, kHeadDim,
                    [scale](float x) { return Element(x * scale); });
    __syncthreads();
    Element* dq = static_cast<Element*>(params.dq) +
                  seq.q_offset(params.dq_batch_stride, params.dq_row_stride, params.dq_head_stride, blk.head) +
                  int64_t(row0) * params.dq_row_stride;
    // The binding's head dims are multiples of 8 and dq is its own contiguous tensor: each piece is whole and aligned.
    constexpr int kPieces = kHeadDim / 8;
    int const rows_left = seq.q.len - row0;
    CUTE_UNROLL
    for (int idx = tid; idx < kBlockM * kPieces; idx += Traits::kConsumerThreads) {
        int const r = idx / kPieces, c = idx % kPieces * 8;
        if (r < rows_left && c < params.d) {
            *reinterpret_cast<uint4*>(dq + int64_t(r) * params.dq_row_stride + c) =
                *reinterpret_cast<uint4 const*>(tile + r * kPitch + c);
        }
    }
}

}  // namespace flash::sm90
