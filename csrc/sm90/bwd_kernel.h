// SM90-tier backward main kernel: one CTA per (key block, kv head, sequence), or per key block of a cluster of two
// (BwdTraits::kKeyPair), of one producer warpgroup (warp 0 loads, warp 1 adds the staged dQ into the workspace;
// setmaxnreg gives the warpgroup's registers to the consumers) and two consumer warpgroups (wgmma, the gradients'
// elementwise math, dQ staging, the dK / dV epilogue). The CTA walks every query head of its GQA group, so dK and
// dV are reduced over the group in registers: no expanded copies, no atomics. The roles' code is in bwd_mainloop.h.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/block_range.h"
#include "../common/block_scheduler.h"
#include "../common/fragment.h"
#include "../common/params.h"
#include "../common/seqlen.h"
#include "bwd_mainloop.h"
#include "epilogue.h"
#include "pipeline.h"
#include "tile_traits.h"

namespace flash::sm90 {

using namespace cute;

// Stores a (kBlockN, kHeadDim) accumulator of dK or dV from registers, times `scale`: rows below rows_left, columns
// below params.d.
template <class Traits, class Acc>
__device__ __forceinline__ void store_key_gradient(Acc const& acc, float scale, BwdParams const& params,
                                                   SeqlenInfo const& seq, TileCoord const& blk, void* base,
                                                   int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                                                   int ctid) {
    using Element = typename Traits::Element;
    constexpr int kBlockN = Traits::kBlockN;
    typename Traits::TiledMmadKV mma_dkv;
    Tensor coord_rc = rowcol_view(mma_dkv.get_thread_slice(ctid).partition_C(
        make_identity_tensor(Shape<Int<kBlockN>, Int<Traits::kHeadDim>>{})));
    Element* tile = static_cast<Element*>(base) + seq.k_offset(batch_stride, row_stride, head_stride, blk.head) +
                    int64_t(blk.block) * kBlockN * row_stride;
    store_row_pairs(coord_rc, rowcol_view(acc), tile, row_stride, seq.k.len - blk.block * kBlockN, params.d,
                    [scale](float x) { return Element(x * scale); });
}

// Stores dK (times the softmax scale) and dV of a batched call through K's and V's shared buffers: stmatrix in the
// accumulators' layout, then one TMA store each, which clips the rows past sk and the columns past d. A varlen or
// seqused call, whose rows past the sequence belong to another or must stay zero, stores from registers instead.
template <class Traits, class AccKV>
__device__ __forceinline__ void store_key_gradients_tma(BwdKernelParams<Traits> const& args,
                                                        typename Traits::SharedStorage& shared, AccKV& acc_dk,
                                                        AccKV const& acc_dv, SeqlenInfo const& seq,
                                                        TileCoord const& blk, int ctid) {
    using Element = typename Traits::Element;
    constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    BwdParams const& params = args.p;
    sync_consumers<Traits::kConsumerThreads>();  // every warpgroup's last GEMMs have read K and V
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});
    typename Traits::SmemCopydKV smem_copy;
    auto thr_copy = smem_copy.get_thread_slice(ctid);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) { acc_dk(i) *= params.softmax_scale; }
    copy(smem_copy, thr_copy.retile_S(convert_fragment<Element>(acc_dk)), thr_copy.partition_D(sK));
    copy(smem_copy, thr_copy.retile_S(convert_fragment<Element>(acc_dv)), thr_copy.partition_D(sV));
    cutlass::arch::fence_view_async_shared();  // the stores, visible to TMA
    sync_consumers<Traits::kConsumerThreads>();
    if (ctid == 0) {
        auto store = [&](auto const& tma, auto const& s) {
            Tensor m = tma.get_tma_tensor(make_shape(params.sk, params.d, params.hk, params.b));
            Tensor g = local_tile(m(_, _, blk.head, seq.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                  make_coord(blk.block, _0{}));
            auto slice = tma.get_slice(_0{});
            copy(tma, slice.partition_S(s), slice.partition_D(g));
        };
        store(args.tma_dk, sK);
        store(args.tma_dv, sV);
        tma_store_arrive();
        tma_store_wait<0>();  // shared memory stays until the stores have read it
    }
}

// Whether pred holds in any of the kConsumerThreads consumer threads: their barrier (sync_consumers'), reducing.
template <int kConsumerThreads>
__device__ __forceinline__ bool consumers_any(bool pred) {
    constexpr uint32_t kId =
        cutlass::arch::NamedBarrier::ReservedNamedBarrierCount + uint32_t(BwdBarrierId::kConsumers);
    uint32_t any;
    asm volatile(
        "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}"
        : "=r"(any)
        : "r"(uint32_t(pred)), "n"(kId), "n"(kConsumerThreads)
        : "memory");
    return any != 0;
}

// WaveTail: adds this part's dK and dV into split tile `tile`'s sums. The tile's last part to finish reads the sums
// back into acc_dk and acc_dv (true); the other parts are done (false).
template <class Traits, class AccKV>
__device__ __forceinline__ bool sum_tile_parts(BwdParams const& params, int tile, int parts, AccKV& acc_dk,
                                               AccKV& acc_dv, int ctid) {
    constexpr int kThreads = Traits::kConsumerThreads;
    constexpr int kTileFloats = decltype(size(acc_dk))::value * kThreads;
    float* const sums = params.dkv_sums + int64_t(tile) * 2 * kTileFloats;
    add_dq<kThreads>(sums, acc_dk, ctid);
    add_dq<kThreads>(sums + kTileFloats, acc_dv, ctid);
    __threadfence();  // the additions, before the count that tells the last part to read them
    sync_consumers<kThreads>();
    bool last = false;
    if (ctid == 0) { last = atomicAdd(params.dkv_parts_done + tile, 1) == parts - 1; }
    if (!consumers_any<kThreads>(last)) { return false; }
    __threadfence();
    auto read = [&](AccKV& acc, float const* run) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc); i += 4) {
            float4 const v = __ldcg(reinterpret_cast<float4 const*>(run + dq_workspace_index<kThreads>(i, ctid)));
            acc(i) = v.x;
            acc(i + 1) = v.y;
            acc(i + 2) = v.z;
            acc(i + 3) = v.w;
        }
    };
    read(acc_dk, sums);
    read(acc_dv, sums + kTileFloats);
    return true;
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(__grid_constant__ BwdKernelParams<Traits> const args) {
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    BwdParams const& params = args.p;
    extern __shared__ __align__(1024) char smem_buf[];
    auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
    int const tid = threadIdx.x;

    // Under a causal mask the first key blocks see the most query blocks, so ascending order starts the longest first
    // (across args.section pairs); the deterministic dQ order hands them out last-first instead (launch order =
    // accumulation order).
    // kKeyPair: a cluster's two CTAs (ranks 0 and 1) take key blocks 2j and 2j + 1 of a 2 * kBlockN tile, and both
    // walk the query blocks that see either block (blocks past the diagonal or the keys' end are masked whole).
    // Each role decodes its tile after the register split (from a re-read block index): kept live from one decoding
    // before it, the tile's coordinates were spilled and reloaded in the consumers' loop (d 128).
    constexpr int kTileKeys = Traits::kKeyPair ? 2 * kBlockN : kBlockN;
    bool const reverse = params.deterministic && params.window_right >= 0;
    // WaveTail: block indices from tail.first on are the parts of split tiles, a tile's parts adjacent.
    auto work_at = [&](int block_index) {
        int part = 0, parts = 1;
        if (block_index >= args.tail.first) {
            int const i = block_index - args.tail.first;
            parts = args.tail.parts;
            part = i % parts;
            block_index = args.tail.first + i / parts;
        }
        TileCoord blk = decode_tile<kTileKeys>(Traits::kKeyPair ? block_index / 2 : block_index, params.cu_seqlens_k,
                                               params.seqused_k, params.sk, params.b, params.hk, reverse,
                                               args.section);
        SeqlenInfo const seq(params, blk.batch);
        AttnWindow const window = seq.window(params);
        Interval const m_range = BlockRange<kBlockM, kTileKeys>::m_blocks(window, blk.block);
        if constexpr (Traits::kKeyPair) { blk.block = 2 * blk.block + int(cute::block_rank_in_cluster()); }
        return KeyBlockWork{blk, seq, window, m_range, part, parts};
    };
    if (!work_at(blockIdx.x).blk.valid) { return; }

    if (tid == 0) {
        cutlass::arch::ClusterTransactionBarrier::init(&shared.kv_full, 1);
        shared.q_ring.init(Traits::kConsumerThreads / 32);
        shared.do_ring.init(Traits::kConsumerThreads / 32);
        if constexpr (Traits::kKeyPair) { DsExchange<Traits>::init(shared); }
        cutlass::arch::fence_barrier_init();
    }
    if constexpr (Traits::kKeyPair) {
        // The other CTA's copies and arrivals find this one's barriers initialised.
        cute::cluster_arrive_relaxed();
        cute::cluster_wait();
    } else {
        __syncthreads();
    }

    if (tid < 128) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
        KeyBlockWork const work = work_at(block_index_reread());
        bool const has_work = work.iterations(params) > 0;
        int const warp = tid / 32;
        if (warp == 0 && has_work && cute::elect_one_sync()) { load_bwd<Traits>(args, shared, work); }
        if constexpr (!Traits::kKeyPair) {
            if (warp == 1 && has_work) { store_dq<Traits>(params, shared, work, reverse, tid % 32); }
        }
        return;
    }

    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    KeyBlockWork const work = work_at(block_index_reread());
    SeqlenInfo const& seq = work.seq;
    TileCoord const& blk = work.blk;
    int const ctid = tid - 128;
    typename Traits::TiledMmadKV mma_dkv;
    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    clear(acc_dk);
    clear(acc_dv);
    if (work.iterations(params) > 0) { consume_bwd<Traits>(params, shared, work, ctid, acc_dk, acc_dv); }
    if (int const index = block_index_reread(); index >= args.tail.first) {
        int const tile = (index - args.tail.first) / args.tail.parts;
        if (!sum_tile_parts<Traits>(params, tile, args.tail.parts, acc_dk, acc_dv, ctid)) { return; }
    }

    // A key block that no query sees stores zeros.
    if (params.cu_seqlens_k == nullptr && params.seqused_k == nullptr) {
        store_key_gradients_tma<Traits>(args, shared, acc_dk, acc_dv, seq, blk, ctid);
        return;
    }
    store_key_gradient<Traits>(acc_dk, params.softmax_scale, params, seq, blk, params.dk, params.dk_batch_stride,
                               params.dk_row_stride, params.dk_head_stride, ctid);
    store_key_gradient<Traits>(acc_dv, 1.f, params, seq, blk, params.dv, params.dv_batch_stride, params.dv_row_stride,
                               params.dv_head_stride, ctid);
}

}  // namespace flash::sm90
