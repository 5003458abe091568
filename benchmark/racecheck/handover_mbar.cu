// handover_bar.cu's hand-over behind two mbarriers (the SM90 pipelines' primitive, and the forward's tile index):
// MODE_SEL 3, the protocol (the producer's thread waits on empty, writes, arrives on full; each consumer warp waits on
// full, reads, one lane arrives on empty); 4, the producer writes before it waits on empty (a real race).
//   for m in 3 4; do nvcc -arch=sm_90a -DMODE_SEL=$m -o /tmp/ho$m benchmark/racecheck/handover_mbar.cu &&
//     /tmp/ho$m && compute-sanitizer --tool racecheck /tmp/ho$m | tail -1; done
// H200, CUDA 13.0: both report races (3 sums right, 4 wrong); synccheck reports nothing on 3. racecheck cannot tell
// the correct hand-over from the racy one in the write-after-read direction.
#include <cstdio>
#include <cstdint>
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
__global__ void handover_kernel(int n, int* out) {
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
    handover_kernel<MODE_SEL><<<4, 288>>>(50, out);
    cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
    printf("mode %d sum %d (expect %d) err %s\n", MODE_SEL, h[0], 50 * 51 / 2, cudaGetErrorString(cudaGetLastError()));
}
