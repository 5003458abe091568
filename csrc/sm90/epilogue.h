// SM90-tier epilogues. Forward: the normalised output and its lse. Batched calls stage each consumer warpgroup's 64
// rows in shared memory (stmatrix) and store them with one TMA, which clips the rows past sq and the columns past d;
// a varlen or seqused call, whose rows past the sequence belong to another, stores from registers instead. Backward:
// the register stores of dK and dV (varlen and seqused calls; bwd_kernel.h stages the others for TMA) and of the
// converted dQ.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/epilogue.h"
#include "../common/params.h"
#include "../common/seqlen.h"
#include "../common/fragment.h"
#include "pipeline.h"

namespace flash::sm90 {

using namespace cute;

// A consumer warpgroup's part of the TMA store (its leader, ctid % 128 == 0, issues it). The slab is free once the
// previous tile's store has read it; with Traits::kOAliasesV (the buffer is the V ring) the leader waits for that
// read here and then tells the producer through o_free.
template <class Traits, class FragO>
__device__ __forceinline__ void store_output_tma(typename Traits::TmaO const& tma_o,
                                                 typename Traits::SharedStorage& shared, FragO const& r_o,
                                                 FwdParams const& params, SeqlenInfo const& seq, int m_block, int head,
                                                 int ctid) {
    constexpr int kHeadDim = Traits::kHeadDim;
    int const wg = __shfl_sync(0xffffffff, ctid / 128, 0);
    bool const leader = ctid % 128 == 0;
    if constexpr (Traits::kOAliasesV) {
        sync_consumers<Traits::kConsumerThreads>();  // every warpgroup's last O GEMM has read the V ring
    } else {
        if (leader) { tma_store_wait<0>(); }
        sync_warpgroup(wg);
    }
    Tensor sO = make_tensor(make_smem_ptr(shared.o_buffer()), typename Traits::SmemLayoutO{});
    typename Traits::SmemCopyO smem_copy;
    auto thr_copy = smem_copy.get_thread_slice(ctid);
    copy(smem_copy, thr_copy.retile_S(r_o), thr_copy.partition_D(sO));
    cutlass::arch::fence_view_async_shared();  // the stores, visible to TMA
    sync_warpgroup(wg);
    if (leader) {
        Tensor mO = tma_o.get_tma_tensor(make_shape(params.sq, params.d, params.h, params.b));
        Tensor gO = local_tile(mO(_, _, head, seq.batch), Shape<_64, Int<kHeadDim>>{},
                               make_coord(m_block * Traits::kConsumerWarpGroups + wg, _0{}));
        Tensor sO_slab = make_tensor(make_smem_ptr(shared.o_buffer() + wg * 64 * kHeadDim),
                                     typename Traits::SmemLayoutOSlab{});
        auto tma = tma_o.get_slice(_0{});
        copy(tma_o, tma.partition_S(sO_slab), tma.partition_D(gO));
        tma_store_arrive();
        if constexpr (Traits::kOAliasesV) {
            tma_store_wait<0>();
            cutlass::arch::ClusterBarrier::arrive(&shared.o_free);
        }
    }
}

// Each thread stores its own rows from registers: pairs of adjacent columns (c, c + 1), c even, 4 bytes each.
template <class Traits, class CoordRC, class FragO>
__device__ __forceinline__ void store_output_registers(CoordRC const& coord_rc, FragO const& r_o,
                                                       FwdParams const& params, SeqlenInfo const& seq, int row0,
                                                       int head) {
    using Element = typename Traits::Element;
    Element* o = static_cast<Element*>(params.o) +
                 seq.q_offset(params.o_batch_stride, params.o_row_stride, params.o_head_stride, head) +
                 int64_t(row0) * params.o_row_stride;
    store_row_pairs(coord_rc, rowcol_view(r_o), o, params.o_row_stride, seq.q.len - row0, params.d,
                    [](Element x) { return x; });
}

// The tile's lse and output, through TMA when `via_tma` (a batched call without seqused_q).
template <class Traits, class AccO, int kRows>
__device__ __forceinline__ void store_output(typename Traits::TmaO const& tma_o, typename Traits::SharedStorage& shared,
                                             AccO const& acc_o, float const (&lse)[kRows], FwdParams const& params,
                                             SeqlenInfo const& seq, int m_block, int head, int ctid, bool via_tma) {
    constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
    int const row0 = m_block * kBlockM;
    typename Traits::TiledMmaO mma_o;
    Tensor coord_rc = rowcol_view(
        mma_o.get_thread_slice(ctid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    store_lse(params.lse, coord_rc, lse, params, seq, head, row0);
    Tensor r_o = convert_fragment<typename Traits::Element>(acc_o);
    if (via_tma) {
        store_output_tma<Traits>(tma_o, shared, r_o, params, seq, m_block, head, ctid);
    } else {
        store_output_registers<Traits>(coord_rc, r_o, params, seq, row0, head);
    }
}

}  // namespace flash::sm90
