// SM90-tier backward main kernel: one CTA per tile (key block, kv head, sequence), or per key block of a cluster of
// two (BwdTraits::kKeyPair), or (BwdTraits::kKVStages 2, short tiles) one persistent CTA per SM walking tiles; of one
// producer warpgroup (warp 0 loads, warp 1 adds the staged dQ into the workspace and, in a persistent CTA, stores dK
// and dV; setmaxnreg gives the warpgroup's registers to the consumers) and two consumer warpgroups (wgmma, the
// gradients' elementwise math, dQ staging, the dK / dV epilogue). A tile walks every query head of its GQA group, so
// dK and dV are reduced over the group in registers: no expanded copies, no atomics. The roles' per-tile code is in
// bwd_mainloop.h.
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

// The consumers' side of a tile's end in a persistent CTA, or of a split tile's part: the tile's K/V stage goes to
// the store warp (store_key_gradients, split_tile_last). Every consumer thread arrives once its GEMMs are done, and a
// persistent CTA's consumers go on to the next tile.
template <class Traits>
__device__ __forceinline__ void hand_over_key_gradients(int kv_stage) {
    cutlass::arch::NamedBarrier::arrive(Traits::kConsumerThreads + 32,
                                        uint32_t(BwdBarrierId::kKeyGradients0) + kv_stage);
}

// Stages dK (times the softmax scale) and dV of a batched call in K's and V's shared buffers of the tile's stage,
// with stmatrix in the accumulators' layout, for TMA stores (store_key_gradient_tiles, which clip the rows past sk
// and the columns past d). A varlen or seqused call, whose rows past the sequence belong to another or must stay
// zero, stores from registers instead (store_key_gradient).
template <class Traits, class AccKV>
__device__ __forceinline__ void stage_key_gradients(typename Traits::SharedStorage& shared, int kv_stage,
                                                    float softmax_scale, AccKV& acc_dk, AccKV const& acc_dv,
                                                    int ctid) {
    using Element = typename Traits::Element;
    sync_consumers<Traits::kConsumerThreads>();  // every warpgroup's last GEMMs have read K and V
    Tensor sK = make_tensor(make_smem_ptr(Traits::k_buffer(shared, kv_stage)), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(Traits::v_buffer(shared, kv_stage)), typename Traits::SmemLayoutV{});
    typename Traits::SmemCopydKV smem_copy;
    auto thr_copy = smem_copy.get_thread_slice(ctid);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) { acc_dk(i) *= softmax_scale; }
    copy(smem_copy, thr_copy.retile_S(convert_fragment<Element>(acc_dk)), thr_copy.partition_D(sK));
    copy(smem_copy, thr_copy.retile_S(convert_fragment<Element>(acc_dv)), thr_copy.partition_D(sV));
    cutlass::arch::fence_view_async_shared();  // the stores, visible to TMA
}

// One thread: the TMA stores of the dK and dV staged in K/V stage kv_stage, waiting until they have read it.
template <class Traits>
__device__ __forceinline__ void store_key_gradient_tiles(BwdKernelParams<Traits> const& args,
                                                         typename Traits::SharedStorage& shared,
                                                         KeyBlockWork const& work, int kv_stage) {
    constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    BwdParams const& params = args.p;
    auto store = [&](auto const& tma, auto* buffer, auto smem_layout) {
        Tensor m = tma.get_tma_tensor(make_shape(params.sk, params.d, params.hk, params.b));
        Tensor g = local_tile(m(_, _, work.blk.head, work.seq.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                              make_coord(work.blk.block, _0{}));
        auto slice = tma.get_slice(_0{});
        copy(tma, slice.partition_S(make_tensor(make_smem_ptr(buffer), smem_layout)), slice.partition_D(g));
    };
    store(args.tma_dk, Traits::k_buffer(shared, kv_stage), typename Traits::SmemLayoutK{});
    store(args.tma_dv, Traits::v_buffer(shared, kv_stage), typename Traits::SmemLayoutV{});
    tma_store_arrive();
    tma_store_wait<0>();
}

// Store warp of a persistent CTA, at a tile's end: once the consumers have handed the tile's K/V stage over, stores
// the dK and dV staged in it (a batched call's; a varlen or seqused one stores from the consumers' registers) and,
// once the stores have read it, frees the stage for the producer's next K and V. The consumers meanwhile start their
// next tile.
template <class Traits>
__device__ __forceinline__ void store_key_gradients(BwdKernelParams<Traits> const& args,
                                                    typename Traits::SharedStorage& shared, KeyBlockWork const& work,
                                                    int kv_stage, int lane) {
    cutlass::arch::NamedBarrier::arrive_and_wait(Traits::kConsumerThreads + 32,
                                                 uint32_t(BwdBarrierId::kKeyGradients0) + kv_stage);
    bool const batched = args.p.cu_seqlens_k == nullptr && args.p.seqused_k == nullptr;
    if (lane == 0 && batched) { store_key_gradient_tiles<Traits>(args, shared, work, kv_stage); }
}

// Whether pred holds in any of the kThreads threads that meet at named barrier kId (bar.red.or: the barrier, reducing).
template <BwdBarrierId kId, int kThreads>
__device__ __forceinline__ bool barrier_any(bool pred) {
    constexpr uint32_t kHardwareId = cutlass::arch::NamedBarrier::ReservedNamedBarrierCount + uint32_t(kId);
    uint32_t any;
    asm volatile(
        "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}"
        : "=r"(any)
        : "r"(uint32_t(pred)), "n"(kHardwareId), "n"(kThreads)
        : "memory");
    return any != 0;
}

// WaveTail, consumers: adds this part's dK and dV into split tile `tile`'s sums (fenced for the tile's other parts).
template <class Traits, class AccKV>
__device__ __forceinline__ void add_tile_part(BwdParams const& params, int tile, AccKV const& acc_dk,
                                              AccKV const& acc_dv, int ctid) {
    constexpr int kThreads = Traits::kConsumerThreads;
    constexpr int kTileFloats = decltype(size(acc_dk))::value * kThreads;
    float* const sums = params.dkv_sums + int64_t(tile) * 2 * kTileFloats;
    add_dq<kThreads>(sums, acc_dk, ctid);
    add_dq<kThreads>(sums + kTileFloats, acc_dv, ctid);
    __threadfence();
}

// WaveTail, consumers and store warp (its lane 0 knows the answer): whether this part is its tile's last, by the
// split barrier's reduction. The answer is passed on from lane 0 (__shfl_sync) so that ptxas sees it warp-uniform: a
// branch on it is then no divergence, which in the persistent CTA's loop over tiles would make every value carried
// around the loop (the rings' states) non-uniform and move the wgmma descriptors derived from them out of uniform
// registers.
template <class Traits>
__device__ __forceinline__ bool split_tile_last(bool pred) {
    bool const any = barrier_any<BwdBarrierId::kSplitTile, Traits::kConsumerThreads + 32>(pred);
    return __shfl_sync(0xffffffffu, int(any), 0) != 0;
}

// WaveTail, store warp: once the part's consumers have added into the sums and handed its K/V stage over, counts the
// part in; the tile's last part to be counted (true) is the one that stores the sums. The consumers learn it from
// split_tile_last.
template <class Traits>
__device__ __forceinline__ bool count_tile_part(BwdParams const& params, int tile, int parts, int kv_stage,
                                                int lane) {
    cutlass::arch::NamedBarrier::arrive_and_wait(Traits::kConsumerThreads + 32,
                                                 uint32_t(BwdBarrierId::kKeyGradients0) + kv_stage);
    bool last = false;
    if (lane == 0) {
        __threadfence();  // the consumers' additions (cumulative), before the count that tells the last part
        last = atomicAdd(params.dkv_parts_done + tile, 1) == parts - 1;
        __threadfence();  // the count, before the last part's consumers read the sums
    }
    return split_tile_last<Traits>(last);
}

// WaveTail, consumers of the tile's last part: the sums, into acc_dk and acc_dv.
template <class Traits, class AccKV>
__device__ __forceinline__ void read_tile_sums(BwdParams const& params, int tile, AccKV& acc_dk, AccKV& acc_dv,
                                               int ctid) {
    constexpr int kThreads = Traits::kConsumerThreads;
    constexpr int kTileFloats = decltype(size(acc_dk))::value * kThreads;
    float const* sums = params.dkv_sums + int64_t(tile) * 2 * kTileFloats;
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
}

// WaveTail, a CTA of one tile: the consumers add this part into the sums; the tile's last part to finish (true) reads
// them back into acc_dk and acc_dv, the other parts are done (false).
template <class Traits, class AccKV>
__device__ __forceinline__ bool sum_tile_parts(BwdParams const& params, int tile, int parts, AccKV& acc_dk,
                                               AccKV& acc_dv, int ctid) {
    constexpr int kThreads = Traits::kConsumerThreads;
    add_tile_part<Traits>(params, tile, acc_dk, acc_dv, ctid);
    sync_consumers<kThreads>();
    bool last = false;
    if (ctid == 0) { last = atomicAdd(params.dkv_parts_done + tile, 1) == parts - 1; }
    if (!barrier_any<BwdBarrierId::kConsumers, kThreads>(last)) { return false; }
    __threadfence();
    read_tile_sums<Traits>(params, tile, acc_dk, acc_dv, ctid);
    return true;
}

// Consumers: a tile's dK and dV (unscaled), accumulated over its steps (zero for a tile that no query sees).
template <class Traits>
__device__ __forceinline__ auto key_gradients(BwdParams const& params, typename Traits::SharedStorage& shared,
                                              KeyBlockWork const& work, int ctid,
                                              RingState<Traits::kKVStages> const& kv_state,
                                              RingState<Traits::kQStages>& q_state,
                                              RingState<Traits::kdOStages>& do_state) {
    typename Traits::TiledMmadKV mma_dkv;
    auto acc = cute::make_tuple(
        partition_fragment_C(mma_dkv, Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}),
        partition_fragment_C(mma_dkv, Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}));
    clear(get<0>(acc));
    clear(get<1>(acc));
    if (work.iterations(params) > 0) {
        consume_bwd<Traits>(params, shared, work, ctid, kv_state, q_state, do_state, get<0>(acc), get<1>(acc));
    }
    return acc;
}

// A persistent CTA (launch_bwd's grid of one CTA per SM where BwdTraits::kKVStages is 2 and tiles are short): tiles
// from block index blockIdx.x on, then gridDim.x plus the count taken so far from params.tile_counter, so that the SMs
// that finish first take the next tiles (under a causal mask, the longest first). The producer takes them (skipping
// the indices that a varlen grid leaves spare and the tiles past seqused) and writes each into its K/V stage's
// tile_index before loading the stage; the other roles read it once the stage is full (from lane 0, so that ptxas
// sees the tile and the loop over its steps warp-uniform: see split_tile_last). args.blocks there ends the CTA. The
// consumers hand each tile's end to the store warp, which stores dK and dV from the K/V stage and frees it for the
// producer, while the consumers start the next tile.
template <class Traits, class WorkAt>
__device__ __forceinline__ void persistent_tiles(BwdKernelParams<Traits> const& args,
                                                 typename Traits::SharedStorage& shared, WorkAt const& work_at,
                                                 bool reverse, int tid) {
    BwdParams const& params = args.p;
    RingState<Traits::kKVStages> kv_state;
    auto tile_of = [&] {
        shared.kv_ring.wait(kv_state);
        return __shfl_sync(0xffffffffu, shared.tile_index[kv_state.index], 0);
    };
    if (tid < 128) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
        int const warp = tid / 32, lane = tid % 32;
        if (warp == 0) {
            RingState<Traits::kQStages> q_state;
            RingState<Traits::kdOStages> do_state;
            for (int index = block_index_reread();;) {
                bool const end = index >= args.blocks;
                KeyBlockWork const work = work_at(end ? 0 : index);
                if (end || work.blk.valid) {
                    if (cute::elect_one_sync()) {
                        shared.kv_ring.wait_free(kv_state);
                        // compute-sanitizer's racecheck reports this store against tile_of's loads, in both orders
                        // (d 64). Both are ordered: the stage's readers load after waiting on its full barrier,
                        // which this thread's announce below arrives on (a release) after the store; and this
                        // store follows wait_free, which the store warp's release completes only after it met the
                        // consumers' hand-over barrier, which every reader reaches after its load.
                        shared.tile_index[kv_state.index] = end ? args.blocks : index;
                        if (end) {
                            shared.kv_ring.announce(kv_state, 0);
                        } else {
                            load_bwd<Traits>(args, shared, work, kv_state, q_state, do_state);
                        }
                    }
                    __syncwarp();
                    if (end) { break; }
                    kv_state.advance();
                }
                int next = 0;
                if (lane == 0) { next = int(gridDim.x) + atomicAdd(params.tile_counter, 1); }
                index = __shfl_sync(0xffffffffu, next, 0);
            }
        } else if (warp == 1) {
            for (;; kv_state.advance()) {
                int const index = tile_of();
                if (index >= args.blocks) { break; }
                KeyBlockWork const work = work_at(index);
                if (work.iterations(params) > 0) { store_dq<Traits>(params, shared, work, reverse, lane); }
                if (index < args.tail.first) {
                    store_key_gradients<Traits>(args, shared, work, kv_state.index, lane);
                } else if (count_tile_part<Traits>(params, (index - args.tail.first) / args.tail.parts,
                                                   args.tail.parts, kv_state.index, lane)) {
                    split_tile_last<Traits>(false);  // the consumers have staged the sums
                    if (lane == 0) { store_key_gradient_tiles<Traits>(args, shared, work, kv_state.index); }
                }
                __syncwarp();
                shared.kv_ring.release(kv_state);
            }
        }
        return;
    }

    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    int const ctid = tid - 128;
    bool const batched = params.cu_seqlens_k == nullptr && params.seqused_k == nullptr;
    RingState<Traits::kQStages> q_state;
    RingState<Traits::kdOStages> do_state;
    for (;; kv_state.advance()) {
        int const index = tile_of();
        if (index >= args.blocks) { break; }
        KeyBlockWork const work = work_at(index);
        auto [acc_dk, acc_dv] = key_gradients<Traits>(params, shared, work, ctid, kv_state, q_state, do_state);
        if (index >= args.tail.first) {
            // A split tile (batched only): every part adds into the sums; the store warp counts the parts in, and
            // the last one's consumers stage the sums for it.
            int const tile = (index - args.tail.first) / args.tail.parts;
            add_tile_part<Traits>(params, tile, acc_dk, acc_dv, ctid);
            hand_over_key_gradients<Traits>(kv_state.index);
            if (split_tile_last<Traits>(false)) {
                read_tile_sums<Traits>(params, tile, acc_dk, acc_dv, ctid);
                stage_key_gradients<Traits>(shared, kv_state.index, params.softmax_scale, acc_dk, acc_dv, ctid);
                split_tile_last<Traits>(false);  // staged, for the store warp
            }
            continue;
        }
        // A key block that no query sees stores zeros.
        if (batched) {
            stage_key_gradients<Traits>(shared, kv_state.index, params.softmax_scale, acc_dk, acc_dv, ctid);
            hand_over_key_gradients<Traits>(kv_state.index);
            continue;
        }
        hand_over_key_gradients<Traits>(kv_state.index);
        store_key_gradient<Traits>(acc_dk, params.softmax_scale, params, work.seq, work.blk, params.dk,
                                   params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride, ctid);
        store_key_gradient<Traits>(acc_dv, 1.f, params, work.seq, work.blk, params.dv, params.dv_batch_stride,
                                   params.dv_row_stride, params.dv_head_stride, ctid);
    }
}

// Traits::kPersistent (kKVStages 2): a grid of one CTA per SM walking the tiles (persistent_tiles), else one CTA per
// tile.
template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(__grid_constant__ BwdKernelParams<Traits> const args) {
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
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
    if (!Traits::kPersistent && !work_at(blockIdx.x).blk.valid) { return; }

    if (tid == 0) {
        shared.kv_ring.init(1);  // (a persistent CTA's store warp frees a stage)
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
    if constexpr (Traits::kPersistent) {
        persistent_tiles<Traits>(args, shared, work_at, reverse, tid);
        return;
    }

    // One tile: the K/V ring's first stage, the rings from their start.
    RingState<Traits::kKVStages> const kv_state;
    RingState<Traits::kQStages> q_state;
    RingState<Traits::kdOStages> do_state;
    if (tid < 128) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
        KeyBlockWork const work = work_at(block_index_reread());
        bool const has_work = work.iterations(params) > 0;
        int const warp = tid / 32;
        if (warp == 0 && has_work && cute::elect_one_sync()) {
            load_bwd<Traits>(args, shared, work, kv_state, q_state, do_state);
        }
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
    auto [acc_dk, acc_dv] = key_gradients<Traits>(params, shared, work, ctid, kv_state, q_state, do_state);
    if (int const index = block_index_reread(); index >= args.tail.first) {
        int const tile = (index - args.tail.first) / args.tail.parts;
        if (!sum_tile_parts<Traits>(params, tile, args.tail.parts, acc_dk, acc_dv, ctid)) { return; }
    }

    // A key block that no query sees stores zeros.
    if (params.cu_seqlens_k == nullptr && params.seqused_k == nullptr) {
        stage_key_gradients<Traits>(shared, kv_state.index, params.softmax_scale, acc_dk, acc_dv, ctid);
        sync_consumers<Traits::kConsumerThreads>();
        if (ctid == 0) { store_key_gradient_tiles<Traits>(args, shared, work, kv_state.index); }
        return;
    }
    store_key_gradient<Traits>(acc_dk, params.softmax_scale, params, seq, blk, params.dk, params.dk_batch_stride,
                               params.dk_row_stride, params.dk_head_stride, ctid);
    store_key_gradient<Traits>(acc_dv, 1.f, params, seq, blk, params.dv, params.dv_batch_stride, params.dv_row_stride,
                               params.dv_head_stride, ctid);
}

}  // namespace flash::sm90
