// Does compute-sanitizer's racecheck follow a producer / consumer hand-over of one shared int, the pattern of the SM90
// forward's tile index (fwd_kernel.h: the producer writes shared.next_tile, the consumers read it)? One producer warp
// hands 0..50 to 256 consumer threads, each of which sums them (1275 when right). MODE_SEL:
//   0: a full and an empty hardware barrier, bar.arrive by the side that signals, bar.sync by the side that waits;
//   1: as 0, but the producer writes before it waits on empty (a real write-after-read race);
//   2: every side bar.sync on both barriers;
//   3: a full and an empty mbarrier (the forward's): the producer's thread waits on empty, writes, arrives on full;
//      each consumer warp waits on full, reads, one lane arrives on empty;
//   4: as 3, but the producer writes before it waits on empty (a real race).
//   for m in 0 1 2 3 4; do nvcc -arch=sm_90a -DMODE_SEL=$m -o /tmp/ho$m benchmark/racecheck/handover.cu &&
//     /tmp/ho$m && compute-sanitizer --tool racecheck /tmp/ho$m | tail -1; done
// H200, CUDA 13.0 (RESULTS.md session 67, these kernels as two programs): 0 and 3 sum right and report races, as do
// 1 and 4 (sums wrong); 2 reports none; synccheck reports nothing on 3. racecheck cannot tell the correct hand-over
// from the racy one in the write-after-read direction.
#include <cstdint>
#include <cstdio>

#ifndef MODE_SEL
#define MODE_SEL 0
#endif
template <int kId> __device__ void bsync() { asm volatile("bar.sync %0, 288;" ::"n"(kId) : "memory"); }
template <int kId> __device__ void barrive() { asm volatile("bar.arrive %0, 288;" ::"n"(kId) : "memory"); }
template <int MODE>
__global__ void bar_handover_kernel(int n, int* out) {
    __shared__ int slot;
    int tid = threadIdx.x;
    if (tid >= 256) {  // producer warp
        for (int i = 0; i <= n; ++i) {
            if (MODE == 1 && tid == 256) slot = i;  // before the empty barrier: races with the previous reads
            if (i > 0) bsync<2>();
            if (MODE != 1 && tid == 256) slot = i;
            __syncwarp();
            if (MODE == 2) bsync<1>(); else barrive<1>();
        }
    } else {
        int sum = 0;
        for (int i = 0; i <= n; ++i) {
            bsync<1>();
            int v = slot;
            sum += v;
            if (i < n) { if (MODE == 2) bsync<2>(); else barrive<2>(); }
        }
        out[tid] = sum;
    }
}
__device__ void mb_init(uint64_t* b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(uint32_t(__cvta_generic_to_shared(b))), "r"(count));
}
__device__ void mb_arrive(uint64_t* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(uint32_t(__cvta_generic_to_shared(b))) : "memory");
}
__device__ void mb_wait(uint64_t* b, uint32_t parity) {
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n"
                 ::"r"(uint32_t(__cvta_generic_to_shared(b))), "r"(parity) : "memory");
}
template <int MODE>
__global__ void mbar_handover_kernel(int n, int* out) {
    __shared__ uint64_t full, empty;
    __shared__ int slot;
    int tid = threadIdx.x;
    if (tid == 0) { mb_init(&full, 1); mb_init(&empty, 8); asm volatile("fence.mbarrier_init.release.cluster;"); }
    __syncthreads();
    if (tid >= 256) {
        if (tid == 256) {
            for (int i = 0; i <= n; ++i) {
                if (MODE == 4) slot = i;
                mb_wait(&empty, (i & 1) ^ 1);
                if (MODE == 3) slot = i;
                mb_arrive(&full);
            }
        }
    } else {
        int sum = 0;
        for (int i = 0; i <= n; ++i) {
            mb_wait(&full, i & 1);
            sum += slot;
            __syncwarp();
            if (tid % 32 == 0) mb_arrive(&empty);
        }
        out[tid] = sum;
    }
}
int main() {
    int* out; cudaMalloc(&out, 256 * sizeof(int));
    int h[256];
#if MODE_SEL < 3
    bar_handover_kernel<MODE_SEL><<<4, 288>>>(50, out);
#else
    mbar_handover_kernel<MODE_SEL><<<4, 288>>>(50, out);
#endif
    cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
    printf("mode %d sum %d (expect %d) err %s\n", MODE_SEL, h[0], 50 * 51 / 2, cudaGetErrorString(cudaGetLastError()));
}
