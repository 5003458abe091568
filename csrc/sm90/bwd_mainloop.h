// SM90-tier backward main loop, by role. The CTA owns kBlockN keys of one kv head; K and V arrive once by TMA. The
// producer streams, for every query head of the GQA group and every query block that sees the keys, Q with its lse
// (log2 units) and dO with its D through two rings; the store warp adds each block's dQ into the workspace. Each
// consumer warpgroup owns 64 of the keys and runs, per query block:
//     S^T = K Q^T, dP^T = V dO^T issued                         (keys on wgmma's M, both from shared memory)
//     wait for S^T; P = exp2(S^T - lse), masked                  (overlaps the dP GEMM)
//     dV += P^T dO issued (P from registers); wait for dP^T; dS = P (dP - D)   (dV runs under dS's math)
//     dS^T to shared memory; barrier of both warpgroups
//     dQ = dS K (its half of the head dim; with 128-row query blocks, its 64 rows) and dK += dS^T Q (dS from
//     registers) issued
//     wait for dQ; release dO; dQ to shared memory (under the dK GEMM), for the store warp to add into the fp32
//     workspace; wait for dK; release Q
// With 128-row query blocks (BwdTraits::kdPAfterP), dP^T is issued only after P, behind which dV queues. Head dim 256
// (BwdTraits::kSplitHeadDim) shares 64 keys between the warpgroups and meets P^T and dS^T in shared memory; outside
// deterministic mode its CTAs come in key pairs (BwdTraits::kKeyPair, DsExchange), which add dQ from registers.
// The softmax scale is applied once, to dK in the epilogue and to dQ in the conversion kernel.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <climits>
#include <cmath>

#include "../common/block_range.h"
#include "../common/bwd_workspace.h"
#include "../common/fragment.h"
#include "../common/mask.h"
#include "../common/params.h"
#include "../common/score_mod.h"
#include "../common/seqlen.h"
#include "gemm.h"
#include "pipeline.h"
#include "tile_traits.h"

namespace flash::sm90 {

using namespace cute;

// Without a mask each tile of keys is the same work, and a CTA fills an SM: a grid of T tiles runs in waves of one
// CTA per SM, the last holding T mod SMs tiles while the other SMs idle (4096 tiles on 132 SMs: 31 full waves and 4
// tiles, 3% of the kernel). The tiles from `first` on are split into `parts` CTAs each (adjacent block indices), which
// take equal runs of the tile's (query head, query block) steps and add dK and dV into the workspace's fp32 sums
// (BwdParams::dkv_sums); the tile's last part to finish stores them. parts == 1: no tile is split.
struct WaveTail {
    int first = INT_MAX;
    int parts = 1;
    int tiles = 0;  // split, from `first` on (the workspace's sums and the grid's extra CTAs)
};

template <class Traits>
struct BwdKernelParams {
    BwdParams p;
    typename Traits::TmaQ tma_q;
    typename Traits::TmaQ tma_do;
    typename Traits::TmaK tma_k;
    typename Traits::TmaV tma_v;
    typename Traits::TmadK tma_dk;
    typename Traits::TmadV tma_dv;
    int section = 1;  // decode_tile's (batch, kv head) pairs taken together
    typename Traits::TmaKHalf tma_k_half{};  // Traits::kKeyPair: the other key block's K, this CTA's head-dim half
    WaveTail tail{};
    int blocks = 0;  // block indices: the grid's, or with a persistent grid more, taken through params.tile_counter
};

// The CTA's work: key block blk.block of kv head blk.head in sequence blk.batch, and the query blocks m_range that see
// it (in every query head of the group): all of its steps, or with WaveTail part `part` of `parts` of them.
struct KeyBlockWork {
    TileCoord blk;
    SeqlenInfo seq;
    AttnWindow window;
    Interval m_range;
    int part = 0, parts = 1;

    __device__ __forceinline__ int tile_steps(BwdParams const& params) const {
        return (m_range.hi - m_range.lo) * params.h_per_hk;
    }
    __device__ __forceinline__ int first_step(BwdParams const& params) const {
        return tile_steps(params) * part / parts;
    }
    __device__ __forceinline__ int iterations(BwdParams const& params) const {
        return parts == 1 ? tile_steps(params) : tile_steps(params) * (part + 1) / parts - first_step(params);
    }
};

// Steps through the (query head, query block) pairs of a KeyBlockWork, blocks fastest, without divisions (but at a
// WaveTail part's first step). With
// kRotate, each head's blocks run from `first` round to the one before it: without a mask and outside deterministic
// mode, key block n starts at query block lo + n mod (hi - lo), so that the CTAs of one head add into different dQ
// tiles at a time (measured at head dims 64 and 128, +0.5%; at 256 it only adds spills, so that tile keeps lo first).
template <bool kRotate>
struct QueryBlockCursor {
    int head, m_block, lo, hi, first;

    __device__ __forceinline__ QueryBlockCursor(BwdParams const& params, KeyBlockWork const& work)
        : head(work.blk.head * params.h_per_hk), lo(work.m_range.lo), hi(work.m_range.hi), first(lo) {
        if constexpr (kRotate) {
            if (!params.deterministic && params.window_left < 0 && params.window_right < 0 && hi > lo) {
                first = lo + work.blk.block % (hi - lo);
            }
        }
        m_block = first;
        if (work.parts > 1) {
            int const n = hi - lo, step = work.first_step(params);
            head += step / n;
            m_block += step % n;
            if (m_block >= hi) { m_block -= n; }
        }
    }

    __device__ __forceinline__ void advance() {
        if constexpr (kRotate) {
            if (++m_block == hi) { m_block = lo; }
            if (m_block == first) { ++head; }
        } else if (++m_block == hi) {
            m_block = lo;
            ++head;
        }
    }
};

// A (rows, cols) register view read as (cols, rows).
template <class Tensor_>
__device__ __forceinline__ auto transposed(Tensor_&& t) {
    return make_tensor(t.data(), select<1, 0>(t.layout()));
}

__device__ __forceinline__ void bulk_reduce_add(float* gmem, float const* smem, int bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem),
                 "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
                 : "memory");
}

// Waits until this thread's bulk operations have completed, writes included (wait_group.read only covers reads).
__device__ __forceinline__ void bulk_wait_complete() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Producer (one thread), per tile, once the tile's K/V stage is free: K and V once into that stage, then Q with its
// lse2 and dO with its D for every (head, query block), in the consumers' order, each on its stage's one transaction
// barrier. A tile without steps completes its K/V stage with no bytes.
template <class Traits>
__device__ __forceinline__ void load_bwd(BwdKernelParams<Traits> const& args, typename Traits::SharedStorage& shared,
                                         KeyBlockWork const& work, RingState<Traits::kKVStages> const& kv_state,
                                         RingState<Traits::kQStages>& q_state, RingState<Traits::kdOStages>& do_state) {
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    constexpr int kStatsBytes = kBlockM * int(sizeof(float));
    BwdParams const& params = args.p;
    SeqlenInfo const& seq = work.seq;
    int const entry = params.cu_seqlens_q == nullptr ? seq.batch : 0;
    int const batches = tensor_batches(params);
    Tensor mQ = args.tma_q.get_tma_tensor(make_shape(params.sq, params.d, params.h, batches));
    Tensor mdO = args.tma_do.get_tma_tensor(make_shape(params.sq, params.d, params.h, batches));
    Tensor mK = args.tma_k.get_tma_tensor(make_shape(params.sk, params.d, params.hk, batches));
    Tensor mV = args.tma_v.get_tma_tensor(make_shape(params.sk, params.d, params.hk, batches));
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(Traits::k_buffer(shared, kv_state.index)), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(Traits::v_buffer(shared, kv_state.index)), typename Traits::SmemLayoutV{});
    auto tma_q = args.tma_q.get_slice(_0{});
    auto tma_do = args.tma_do.get_slice(_0{});
    auto tma_k = args.tma_k.get_slice(_0{});
    auto tma_v = args.tma_v.get_slice(_0{});

    auto key_tile = [&](auto const& m) {
        return local_tile(domain_offset(make_coord(seq.k.start, _0{}), m(_, _, work.blk.head, entry)),
                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(work.blk.block, _0{}));
    };
    constexpr int kPeerKBytes = Traits::kKeyPair ? Traits::kKVBytes / 2 : 0;
    int const iters = work.iterations(params);
    uint64_t& kv_full = shared.kv_ring.announce(kv_state, iters > 0 ? 2 * Traits::kKVBytes + kPeerKBytes : 0);
    if (iters == 0) { return; }
    copy(args.tma_k.with(kv_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tma_k.partition_S(key_tile(mK)),
         tma_k.partition_D(sK));
    copy(args.tma_v.with(kv_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tma_v.partition_S(key_tile(mV)),
         tma_v.partition_D(sV));
    if constexpr (Traits::kKeyPair) {
        // The other block's K, columns of the head-dim half that this CTA (its rank) adds into dQ.
        Tensor mKh = args.tma_k_half.get_tma_tensor(make_shape(params.sk, params.d, params.hk, batches));
        Tensor sKp = make_tensor(make_smem_ptr(shared.k_peer.data()), typename Traits::SmemLayoutKHalf{});
        auto tma_kh = args.tma_k_half.get_slice(_0{});
        Tensor gKp = local_tile(domain_offset(make_coord(seq.k.start, _0{}), mKh(_, _, work.blk.head, entry)),
                                Shape<Int<kBlockN>, Int<Traits::kPeerKCols>>{},
                                make_coord(work.blk.block ^ 1, int(cute::block_rank_in_cluster())));
        copy(args.tma_k_half.with(kv_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tma_kh.partition_S(gKp),
             tma_kh.partition_D(sKp));
    }

    // Q and dO are read by every key block of their head: keep them in L2.
    constexpr auto kKeep = TMA::CacheHintSm90::EVICT_LAST;
    Tensor tQsQ = tma_q.partition_D(sQ);  // (TMA, 1, 1, stage)
    Tensor tdOsdO = tma_do.partition_D(sdO);
    QueryBlockCursor<!Traits::kSplitHeadDim> cur(params, work);
    for (int it = 0; it < iters; ++it, cur.advance()) {
        auto query_tile = [&](auto const& m) {
            return local_tile(domain_offset(make_coord(seq.q.start, _0{}), m(_, _, cur.head, entry)),
                              Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(cur.m_block, _0{}));
        };
        int64_t const stats_row = dq_accum_row(params, seq, cur.head) + cur.m_block * kBlockM;

        // The statistics are the only ring data that consumers read with plain loads. compute-sanitizer's racecheck
        // reports those loads against these bulk copies: it takes the copy's write to happen at its issue, after this
        // thread's arrival on the full barrier, while the bytes in fact complete that barrier's transaction count,
        // which the consumers wait for (and they release the stage only after a warp barrier behind their loads).
        uint64_t& q_full = shared.q_ring.acquire(q_state, Traits::kQBytes + kStatsBytes);
        copy(args.tma_q.with(q_full, 0, kKeep), tma_q.partition_S(query_tile(mQ)), tQsQ(_, _, _, q_state.index));
        SM90_BULK_COPY_G2S::copy(params.lse2 + stats_row, &q_full, shared.lse2[q_state.index], kStatsBytes);
        q_state.advance();

        uint64_t& do_full = shared.do_ring.acquire(do_state, Traits::kQBytes + kStatsBytes);
        copy(args.tma_do.with(do_full, 0, kKeep), tma_do.partition_S(query_tile(mdO)),
             tdOsdO(_, _, _, do_state.index));
        SM90_BULK_COPY_G2S::copy(params.dpsum + stats_row, &do_full, shared.dpsum[do_state.index], kStatsBytes);
        do_state.advance();
    }
}

// A consumer warpgroup's dQ staging buffer, between the warpgroup (128 threads) and the store warp (32): named
// barriers, so that neither side spins.
template <class Traits>
struct DqStaging {
    int wg;
    static constexpr uint32_t kThreads = 128 + 32;

    __device__ __forceinline__ uint32_t full_id() const { return uint32_t(BwdBarrierId::kDqFull0) + wg; }
    __device__ __forceinline__ uint32_t empty_id() const { return uint32_t(BwdBarrierId::kDqEmpty0) + wg; }
    // Consumers.
    __device__ __forceinline__ void wait_empty() const {
        cutlass::arch::NamedBarrier::arrive_and_wait(kThreads, empty_id());
    }
    __device__ __forceinline__ void mark_full() const { cutlass::arch::NamedBarrier::arrive(kThreads, full_id()); }
    // Store warp.
    __device__ __forceinline__ void wait_full() const {
        cutlass::arch::NamedBarrier::arrive_and_wait(kThreads, full_id());
    }
    __device__ __forceinline__ void mark_empty() const { cutlass::arch::NamedBarrier::arrive(kThreads, empty_id()); }
};

// Traits::kKeyPair: dS^T between the two CTAs of a cluster. Step it's dS^T (buffer it % 2) goes by one bulk copy from
// the sender's dS buffer into the receiver's ds_peer buffer, completing the receiver's peer_ds_full; the receiver's
// warpgroups, once their dQ GEMM has read it, arrive on the sender's peer_ds_empty. The sender waits for that before
// its consumers overwrite the buffer two steps later (it is the copy's source) and before it exits, so that nothing
// in flight reaches a CTA that has left.
template <class Traits>
struct DsExchange {
    typename Traits::SharedStorage& shared;
    uint32_t peer;  // the other CTA's rank in the cluster
    // The other CTA's peer_ds_empty[0], mapped once: mapped at every step into a scratch register, the remote arrive
    // held that register until the next step's first write to it, which stalled the arriving warp there (ncu: 11% of
    // the pair kernel's stall samples, RESULTS.md session 63).
    uint32_t peer_empty;

    __device__ __forceinline__ DsExchange(typename Traits::SharedStorage& shared, uint32_t peer)
        : shared(shared), peer(peer),
          peer_empty(cute::set_block_rank(cute::cast_smem_ptr_to_uint(&shared.peer_ds_empty[0]), peer)) {}

    static constexpr int kBufferElements = Traits::kBlockN * Traits::kBlockM;

    __device__ __forceinline__ static void init(typename Traits::SharedStorage& shared) {
        CUTE_UNROLL
        for (int b = 0; b < 2; ++b) {
            cutlass::arch::ClusterTransactionBarrier::init(&shared.peer_ds_full[b], 1);
            cutlass::arch::ClusterBarrier::init(&shared.peer_ds_empty[b], Traits::kConsumerWarpGroups);
        }
    }
    // One consumer thread, at the start of step it: the bytes that the other CTA sends for it.
    __device__ __forceinline__ void expect(int it) const {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&shared.peer_ds_full[it % 2], Traits::kdSBytes);
    }
    // Every consumer thread, before its dS^T stores of step it: the copy of step it - 2 has been read out of the
    // buffer.
    __device__ __forceinline__ void wait_sent(int it) const {
        if (it >= 2) { cutlass::arch::ClusterBarrier::wait(&shared.peer_ds_empty[it % 2], ((it - 2) / 2) & 1); }
    }
    // One consumer thread, once both warpgroups' dS^T of step it is in shared memory (fenced for the async proxy).
    __device__ __forceinline__ void send(int it) const {
        int const b = it % 2;
        uint32_t const src = cute::cast_smem_ptr_to_uint(shared.ds.data() + b * kBufferElements);
        uint32_t const dst =
            cute::set_block_rank(cute::cast_smem_ptr_to_uint(shared.ds_peer.data() + b * kBufferElements), peer);
        uint32_t const bar = cute::set_block_rank(cute::cast_smem_ptr_to_uint(&shared.peer_ds_full[b]), peer);
        asm volatile(
            "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
            "r"(src), "r"(Traits::kdSBytes), "r"(bar)
            : "memory");
    }
    // Every consumer thread: the other CTA's dS^T of step it has landed.
    __device__ __forceinline__ void wait_received(int it) const {
        cutlass::arch::ClusterTransactionBarrier::wait(&shared.peer_ds_full[it % 2], (it / 2) & 1);
    }
    // One thread per consumer warpgroup, once the warpgroup's wgmma reads of step it's received dS^T are complete.
    __device__ __forceinline__ void release_received(int it) const {
        static_assert(sizeof(shared.peer_ds_empty[0]) == 8);
        if (it % 2 == 0) {
            asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(peer_empty) : "memory");
        } else {
            asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0 + 8];" ::"r"(peer_empty) : "memory");
        }
    }
    // The sender, before its CTA exits: the other CTA has read the last copies (and its last arrivals have landed).
    __device__ __forceinline__ void drain(int iters) const {
        for (int it = max(iters - 2, 0); it < iters; ++it) {
            cutlass::arch::ClusterBarrier::wait(&shared.peer_ds_empty[it % 2], (it / 2) & 1);
        }
    }
};

// Store warp: adds the consumer warpgroups' staged dQ of every (head, query block) into the fp32 workspace, one bulk
// reduction per warpgroup (lane 0 issues them). Deterministic, the key blocks of a query block add in launch order,
// counted by its semaphore (see the SM80 tier's DqOrder); only this warp waits for it, so the consumers stall only if
// their next dQ finds the buffer still unread.
template <class Traits>
__device__ __forceinline__ void store_dq(BwdParams const& params, typename Traits::SharedStorage& shared,
                                         KeyBlockWork const& work, bool reverse, int lane) {
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    constexpr int kWarpGroups = Traits::kConsumerWarpGroups;
    constexpr int kRounds = Traits::kdQRounds;
    constexpr int kBytes = Traits::kdQStagedFloats * int(sizeof(float));
    using Range = BlockRange<kBlockM, kBlockN>;
    QueryBlockCursor<!Traits::kSplitHeadDim> cur(params, work);
    int const iters = work.iterations(params);
    CUTE_UNROLL
    for (int wg = 0; wg < kWarpGroups; ++wg) { DqStaging<Traits>{wg}.mark_empty(); }
    for (int it = 0; it < iters; ++it, cur.advance()) {
        int64_t const dq_row = dq_accum_row(params, work.seq, cur.head) + cur.m_block * kBlockM;
        int* semaphore = nullptr;
        if (params.deterministic && lane == 0) {
            Interval const n_range = Range::n_blocks(work.window, cur.m_block);
            int const rank = reverse ? n_range.hi - 1 - work.blk.block : work.blk.block - n_range.lo;
            semaphore = params.dq_semaphore + dq_row / kBlockM;
            while (load_acquire(semaphore) < rank) {}
        }
        __syncwarp();  // the named barriers below count whole warps
        CUTE_UNROLL
        for (int round = 0; round < kRounds; ++round) {
            CUTE_UNROLL
            for (int wg = 0; wg < kWarpGroups; ++wg) { DqStaging<Traits>{wg}.wait_full(); }
            if (lane == 0) {
                CUTE_UNROLL
                for (int wg = 0; wg < kWarpGroups; ++wg) {
                    bulk_reduce_add(params.dq_accum + dq_row * kHeadDim + wg * Traits::kdQChunkFloats +
                                        round * Traits::kdQStagedFloats,
                                    shared.dq.data() + wg * Traits::kdQStagedFloats, kBytes);
                }
                tma_store_arrive();
                if (params.deterministic && round + 1 == kRounds) {
                    // The count moves on only once the additions have landed.
                    bulk_wait_complete();
                    __threadfence();
                    atomicAdd(semaphore, 1);
                } else {
                    tma_store_wait<0>();  // the buffers have been read
                }
            }
            __syncwarp();
            if (it + 1 < iters || round + 1 < kRounds) {
                CUTE_UNROLL
                for (int wg = 0; wg < kWarpGroups; ++wg) { DqStaging<Traits>{wg}.mark_empty(); }
            }
        }
    }
}

// Consumer warpgroups (ctid: thread index among them): accumulate the tile's dK and dV (unscaled) in registers, and
// add each query block's dQ into the workspace. K and V are in K/V stage kv_state, once full (a persistent CTA's
// consumers have waited for that already, to read the stage's tile: persistent_tiles).
template <class Traits, class AccKV>
__device__ __forceinline__ void consume_bwd(BwdParams const& params, typename Traits::SharedStorage& shared,
                                            KeyBlockWork const& work, int ctid,
                                            RingState<Traits::kKVStages> const& kv_state,
                                            RingState<Traits::kQStages>& q_state,
                                            RingState<Traits::kdOStages>& do_state, AccKV& acc_dk, AccKV& acc_dv) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    constexpr int kConsumerThreads = Traits::kConsumerThreads;
    using Range = BlockRange<kBlockM, kBlockN>;
    SeqlenInfo const& seq = work.seq;
    AttnWindow const& window = work.window;
    int const n_block = work.blk.block;

    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutdO{});
    int const kv_stage = Traits::uniform_stage(kv_state.index);
    Tensor sK = make_tensor(make_smem_ptr(Traits::k_buffer(shared, kv_stage)), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(Traits::v_buffer(shared, kv_stage)), typename Traits::SmemLayoutV{});
    Tensor sdS = make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutdS{});
    Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutdOt{});
    Tensor sKt = make_tensor(make_smem_ptr(Traits::k_buffer(shared, kv_stage)), typename Traits::SmemLayoutKt{});
    Tensor sdSt = make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutdSt{});

    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    // Shared-memory operands are sliced per warpgroup from a warp-uniform index, so that their descriptors live in
    // uniform registers.
    int const wg = __shfl_sync(0xffffffff, ctid / 128, 0);
    int const wg_tid = ctid % 128;
    constexpr bool kSplitHeadDim = Traits::kSplitHeadDim;
    auto wg_sdp = mma_sdp.get_slice(wg * 128);
    auto wg_dkv = mma_dkv.get_slice(wg * 128);
    auto wg_dq = mma_dq.get_slice(wg * 128);
    Tensor tSrK = wg_sdp.partition_fragment_A(sK);
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);      // (MMA, MMA_N, MMA_K, stage)
    Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);   // (MMA, MMA_N, MMA_K, stage)
    Tensor tdVrdOt = wg_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tdKrQt = wg_dkv.partition_fragment_B(sQt);    // (MMA, MMA_N, MMA_K, stage)
    // kSplitHeadDim: P^T and dS^T as dV's and dK's A operands, from shared memory.
    auto tdKVsPdS = [&] {
        if constexpr (kSplitHeadDim) {
            return wg_dkv.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_K, buffer)
        } else {
            return 0;
        }
    }();
    Tensor tdQrdS = wg_dq.partition_fragment_A(sdSt);    // (MMA, MMA_M, MMA_K, buffer)
    Tensor tdQrKt = wg_dq.partition_fragment_B(sKt);
    // kSplitHeadDim: dQ by slices of kdQSliceCols head-dim columns: slice r of warpgroup w is K^T's tile
    // w * kdQRounds + r. kKeyPair: this CTA's warpgroup wg takes slice wg of warpgroup `rank`'s columns (the CTA's
    // head-dim half), over its own keys and then the other block's (k_peer's tile wg).
    constexpr bool kPair = Traits::kKeyPair;
    int const rank = kPair ? int(cute::block_rank_in_cluster()) : 0;
    typename Traits::TiledMmadQSlice mma_dq_slice;
    auto slice_dq = mma_dq_slice.get_slice(0);
    Tensor tdQrdS_slice = slice_dq.partition_fragment_A(sdSt);  // (MMA, MMA_M, MMA_K, buffer)
    auto kt_slice = [&](int tile) {
        return slice_dq.partition_fragment_B(local_tile(sKt, Shape<Int<Traits::kdQSliceCols>, Int<kBlockN>>{},
                                                        make_coord(tile, _0{})));
    };
    auto tdQrdS_peer = [&] {
        if constexpr (kPair) {
            Tensor sdSpt = make_tensor(make_smem_ptr(shared.ds_peer.data()), typename Traits::SmemLayoutdSPeert{});
            return slice_dq.partition_fragment_A(sdSpt);  // (MMA, MMA_M, MMA_K, buffer)
        } else {
            return 0;
        }
    }();
    auto tdQrKt_peer = [&] {
        if constexpr (kPair) {
            Tensor sKpt = make_tensor(make_smem_ptr(shared.k_peer.data()), typename Traits::SmemLayoutKHalft{});
            return slice_dq.partition_fragment_B(
                local_tile(sKpt, Shape<Int<Traits::kdQSliceCols>, Int<kBlockN>>{}, make_coord(wg, _0{})));
        } else {
            return 0;
        }
    }();
    DsExchange<Traits> const exchange{shared, uint32_t(rank ^ 1)};

    typename Traits::SmemCopydS copy_ds;
    auto thr_copy_ds = copy_ds.get_thread_slice(ctid);
    Tensor tdSsdS = thr_copy_ds.partition_D(sdS);  // (CPY, CPY_M, CPY_N, buffer)

    // This thread's scores seen as (query, key), with (query, key) coordinates in the tile, for the mask and ALiBi.
    auto thr_sdp = mma_sdp.get_thread_slice(ctid);
    Tensor coord_qk = transposed(rowcol_view(thr_sdp.partition_C(make_tensor(
        make_inttuple_iter(make_tuple(_0{}, _0{})), make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, make_stride(E<1>{}, E<0>{}))))));
    using AccSLayout = decltype(partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{}).layout());
    constexpr int kCols = decltype(size<0>(coord_qk))::value;  // queries of this thread

    int const sq = seq.q.len;
    int const col0 = n_block * kBlockN;
    bool const has_mods = params.has_softcap || params.alibi_slopes != nullptr;
    // Rows of a partial block that belong to another sequence or lie past seqused, in the tensors.
    bool const foreign_q = params.cu_seqlens_q != nullptr || params.seqused_q != nullptr;
    bool const foreign_k = params.cu_seqlens_k != nullptr || params.seqused_k != nullptr;

    if constexpr (!Traits::kPersistent) { shared.kv_ring.wait(kv_state); }
    // The other block of a pair holds keys past its own end too (kKeyPair: when its block is the second).
    int const peer_col0 = kPair ? (n_block ^ 1) * kBlockN : col0;
    if (foreign_k && max(col0, peer_col0) + kBlockN > seq.k.len) {
        zero_tail_rows<kConsumerThreads>(sK, seq.k.len - col0, ctid);
        zero_tail_rows<kConsumerThreads>(sV, seq.k.len - col0, ctid);
        if constexpr (kPair) {
            zero_tail_rows<kConsumerThreads>(
                make_tensor(make_smem_ptr(shared.k_peer.data()), typename Traits::SmemLayoutKHalf{}),
                seq.k.len - peer_col0, ctid);
        }
        cutlass::arch::fence_view_async_shared();
        sync_consumers<kConsumerThreads>();
    }

    QueryBlockCursor<!Traits::kSplitHeadDim> cur(params, work);
    int const iters = work.iterations(params);

    // kKeyPair: this warpgroup's dQ slice (K^T's tile dq_slice) of a step, over this block's keys and then the other
    // block's, both in the next step (BwdTraits). dq_pending is where that step's dQ adds, in the workspace.
    int const dq_slice = rank * Traits::kdQRounds + wg;
    auto acc_dq_pair = [&] {
        if constexpr (kPair) {
            return partition_fragment_C(mma_dq_slice, Shape<_64, Int<Traits::kdQSliceCols>>{});
        } else {
            return 0;
        }
    }();
    int64_t dq_pending = 0;
    auto issue_dq_pair = [&](int it) {
        if constexpr (kPair) {
            Tensor tdQrdS_own = tdQrdS_slice(_, _, _, it % 2);
            Tensor tdQrKt_own = kt_slice(dq_slice);
            gemm<true>(mma_dq_slice, tdQrdS_own, tdQrKt_own, acc_dq_pair);
            exchange.wait_received(it);
            Tensor tdQrdS_peer_buf = tdQrdS_peer(_, _, _, it % 2);
            gemm<false>(mma_dq_slice, tdQrdS_peer_buf, tdQrKt_peer, acc_dq_pair);
        }
    };
    // Once step it's dQ over the other block's keys is done: the received dS^T is free, and the slice adds.
    auto finish_dq_pair = [&](int it) {
        if constexpr (kPair) {
            if (wg_tid == 0) { exchange.release_received(it); }
            add_dq<128>(params.dq_accum + dq_pending, acc_dq_pair, wg_tid);
        }
    };

    auto step = [&](int it, auto mods) __attribute__((always_inline)) {
        int const row0 = cur.m_block * kBlockM;
        int const buf = it % 2;
        if constexpr (kPair) {
            if (ctid == 0) { exchange.expect(it); }
        }
        if (foreign_q && row0 + kBlockM > sq) {
            shared.q_ring.wait(q_state);
            shared.do_ring.wait(do_state);
            zero_tail_rows<kConsumerThreads>(sQ(_, _, q_state.index), sq - row0, ctid);
            zero_tail_rows<kConsumerThreads>(sdO(_, _, do_state.index), sq - row0, ctid);
            cutlass::arch::fence_view_async_shared();
            sync_consumers<kConsumerThreads>();
        }
        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        auto issue_dp = [&] {
            shared.do_ring.wait(do_state);
            gemm<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, do_state.index), acc_dp);
        };
        constexpr bool kdPAfterP = Traits::kdPAfterP;
        // Softcap's derivative multiplies dP^T: D comes off first, and S^T and dP^T are needed together.
        constexpr bool kSoftcap = decltype(mods)::value && !kdPAfterP;
        shared.q_ring.wait(q_state);
        gemm<true>(mma_sdp, tSrK, tSrQ(_, _, _, q_state.index), acc_s);
        if constexpr (!kdPAfterP) { issue_dp(); }
        if constexpr (kPair) {
            if (it > 0) {
                issue_dq_pair(it - 1);
            } else {
                // Empty, so that the waits below count the same batches.
                warpgroup_commit_batch();
                warpgroup_commit_batch();
            }
        }
        // Batches behind S^T: dP^T, and (kPair) the previous step's dQ over this block's keys and the other's.
        static_assert(!kPair || !kdPAfterP);
        constexpr int kBehindS = (kdPAfterP ? 0 : 1) + (kPair ? 2 : 0);

        auto s_rc = rowcol_view(acc_s);    // (key, query)
        auto dp_rc = rowcol_view(acc_dp);
        auto s_qk = transposed(s_rc);      // (query, key)
        auto dp_qk = transposed(dp_rc);
        float const* dpsum = shared.dpsum[do_state.index];
        if constexpr (kSoftcap) {
            // dS = P (dP - D) (1 - tanh^2): D comes off before the score mods.
            warpgroup_wait<0>();
            CUTE_UNROLL
            for (int c = 0; c < kCols; ++c) {
                float const d = dpsum[get<0>(coord_qk(c, 0))];
                CUTE_UNROLL
                for (int k = 0; k < size<1>(dp_qk); ++k) { dp_qk(c, k) -= d; }
            }
            apply_score_mods_bwd(params, acc_s, acc_dp, s_qk, coord_qk, seq.batch, cur.head, row0, col0,
                                 window);
        } else {
            warpgroup_wait<kBehindS>();  // S^T is done (wgmma batches complete in order)
            if constexpr (decltype(mods)::value) {  // ALiBi only: run_bwd gives softcap to a 64-row tile
                apply_alibi(s_qk, coord_qk, row0, col0, window.diag_offset(),
                            alibi_slope(params, seq.batch, cur.head));
            }
        }
        // Keys past sk are masked too: their zero scores would give P = exp2(-lse) > 0.
        if (Range::needs_mask(window, cur.m_block, n_block)) { apply_mask(s_qk, coord_qk, window, row0, col0); }
        float const* lse2 = shared.lse2[q_state.index];
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
            float const l = lse2[get<0>(coord_qk(c, 0))];
            CUTE_UNROLL
            for (int k = 0; k < size<1>(s_qk); ++k) { s_qk(c, k) = exp2f(s_qk(c, k) * params.scale_log2 - l); }
        }
        Tensor tdVrP = make_tensor<Element>(acc_as_a_operand(AccSLayout{}));
        convert_fragment_into(acc_s, tdVrP);
        if constexpr (kdPAfterP) { issue_dp(); }
        if constexpr (kSplitHeadDim) {
            // P^T to shared memory, where dV of each warpgroup's head-dim half reads both warpgroups' queries: it meets
            // dS^T there, behind one consumer barrier a step.
            copy(copy_ds, thr_copy_ds.retile_S(make_tensor(tdVrP.data(), AccSLayout{})),
                 tdSsdS(_, _, _, Traits::kPBuffer + buf));
        } else {
            // dV needs only P: it runs behind dP^T, under dS's math.
            gemm<false>(mma_dkv, tdVrP, tdVrdOt(_, _, _, do_state.index), acc_dv);
        }
        // dP^T is done (kPair: the previous step's dQ is not).
        warpgroup_wait<kSplitHeadDim ? (kPair ? 2 : 0) : 1>();

        // With dP^T issued after P, S^T's fp32 registers are gone: dS takes P from its 16-bit copy, read by 32-bit
        // words (tdVrP is in the accumulators' storage order), so that the packed registers stay its only copy; read
        // element by element, ptxas kept each 16-bit value in a register of its own and repacked the dV GEMM's
        // operand from them (64 more live registers, and PRMTs).
        uint32_t const* p_words = reinterpret_cast<uint32_t const*>(tdVrP.data());
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
            float const d = kSoftcap ? 0.f : dpsum[get<0>(coord_qk(c, 0))];
            CUTE_UNROLL
            for (int k = 0; k < size<1>(dp_qk); ++k) {
                float const p = kdPAfterP ? packed_element<Element>(p_words, dp_qk.layout()(c, k)) : s_qk(c, k);
                dp_qk(c, k) = p * (dp_qk(c, k) - d);
            }
        }
        // dS in accumulator order: the registers of the dK GEMM's A operand, and stmatrix's source.
        Tensor r_ds = make_tensor<Element>(AccSLayout{});
        convert_fragment_into(acc_dp, r_ds);
        if constexpr (kPair) { exchange.wait_sent(it); }  // dS^T's buffer is the copy's source two steps back
        copy(copy_ds, thr_copy_ds.retile_S(r_ds), tdSsdS(_, _, _, buf));
        cutlass::arch::fence_view_async_shared();
        sync_consumers<kConsumerThreads>();  // both warpgroups' dS (kSplitHeadDim: and P^T) are in shared memory
        if constexpr (kPair) {
            if (ctid == 0) { exchange.send(it); }
        }
        if constexpr (kSplitHeadDim) {
            Tensor tdVsP = tdKVsPdS(_, _, _, Traits::kPBuffer + buf);
            gemm<false>(mma_dkv, tdVsP, tdVrdOt(_, _, _, do_state.index), acc_dv);
        }

        if constexpr (kPair) {
            Tensor tdKsdS = tdKVsPdS(_, _, _, buf);
            gemm<false>(mma_dkv, tdKsdS, tdKrQt(_, _, _, q_state.index), acc_dk);
            // The additions, under dK: their reductions then have until the next step's dQ, which overwrites their
            // source registers, to read them (ncu: the wgmma issued right behind them waited 14% of the pair kernel's
            // stall samples, RESULTS.md session 64).
            warpgroup_wait<2>();  // the previous step's dQ is done (dV and dK are not)
            if (it > 0) { finish_dq_pair(it - 1); }
            warpgroup_wait<0>();  // dV and dK are done: dO and Q are free
            shared.do_ring.release_after_loads(do_state);  // D
            do_state.advance();
            shared.q_ring.release_after_loads(q_state);  // lse2
            q_state.advance();
            dq_pending = (dq_accum_row(params, seq, cur.head) + row0) * kHeadDim + dq_slice * Traits::kdQStagedFloats;
        } else {
            // dQ (or its first slice) before dK: its staging below then runs under the dK GEMM.
            auto acc_dq = [&] {
                if constexpr (kSplitHeadDim) {
                    return partition_fragment_C(mma_dq_slice, Shape<_64, Int<Traits::kdQSliceCols>>{});
                } else {
                    return partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
                }
            }();
            auto issue_dq = [&](int r) {
                if constexpr (kSplitHeadDim) {
                    Tensor tdQrdS_buf = tdQrdS_slice(_, _, _, buf);
                    Tensor tdQrKt_r = kt_slice(wg * Traits::kdQRounds + r);
                    gemm<true>(mma_dq_slice, tdQrdS_buf, tdQrKt_r, acc_dq);
                } else {
                    Tensor tdQrdS_buf = tdQrdS(_, _, _, buf);
                    gemm<true>(mma_dq, tdQrdS_buf, tdQrKt, acc_dq);
                }
            };
            // dQ (slice) to this warpgroup's staging buffer, once the store warp has read the previous one out of it.
            DqStaging<Traits> const staging{wg};
            auto stage_dq = [&] {
                staging.wait_empty();
                float* chunk = shared.dq.data() + wg * Traits::kdQStagedFloats;
                static_assert(decltype(size(acc_dq))::value * 128 == Traits::kdQStagedFloats);
                CUTE_UNROLL
                for (int i = 0; i < size(acc_dq); i += 4) {
                    *reinterpret_cast<float4*>(chunk + dq_workspace_index<128>(i, wg_tid)) =
                        make_float4(acc_dq(i), acc_dq(i + 1), acc_dq(i + 2), acc_dq(i + 3));
                }
                cutlass::arch::fence_view_async_shared();  // the stores, visible to the bulk reduction
                staging.mark_full();
            };
            issue_dq(0);
            if constexpr (kSplitHeadDim) {
                Tensor tdKsdS = tdKVsPdS(_, _, _, buf);
                gemm<false>(mma_dkv, tdKsdS, tdKrQt(_, _, _, q_state.index), acc_dk);
            } else {
                Tensor tdKrdS = make_tensor(r_ds.data(), acc_as_a_operand(AccSLayout{}));
                gemm<false>(mma_dkv, tdKrdS, tdKrQt(_, _, _, q_state.index), acc_dk);
            }
            warpgroup_wait<1>();  // dV and dQ are done: dO is free
            shared.do_ring.release_after_loads(do_state);  // D
            do_state.advance();
            stage_dq();
            CUTE_UNROLL
            for (int r = 1; r < Traits::kdQRounds; ++r) {
                issue_dq(r);
                warpgroup_wait<0>();
                stage_dq();
            }
            warpgroup_wait<0>();  // dK is done: Q is free
            shared.q_ring.release_after_loads(q_state);  // lse2
            q_state.advance();
        }
    };

    auto query_loop = [&](auto mods) __attribute__((always_inline)) {
        for (int it = 0; it < iters; ++it, cur.advance()) { step(it, mods); }
    };
    if (has_mods) {
        query_loop(cute::true_type{});
    } else {
        query_loop(cute::false_type{});
    }
    if constexpr (kPair) {
        if (iters > 0) {
            issue_dq_pair(iters - 1);
            warpgroup_wait<0>();
            finish_dq_pair(iters - 1);
        }
        if (ctid == 0) { exchange.drain(iters); }
    }
}

}  // namespace flash::sm90
