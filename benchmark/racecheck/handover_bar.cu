// Does compute-sanitizer's racecheck follow a bar.arrive -> bar.sync hand-over? One producer warp hands an index to
// 256 consumer threads through one shared int, behind a full and an empty hardware barrier (the pattern of the SM90
// forward's tile index, fwd_kernel.h). MODE_SEL 0: the protocol; 1: the producer writes before it waits on the empty
// barrier (a real write-after-read race); 2: both barriers are bar.sync on every side (no arrive).
//   for m in 0 1 2; do nvcc -arch=sm_90a -DMODE_SEL=$m -o /tmp/ho$m benchmark/racecheck/handover_bar.cu &&
//     /tmp/ho$m && compute-sanitizer --tool racecheck /tmp/ho$m | tail -1; done
// H200, CUDA 13.0 (RESULTS.md session 67): 0 sums right and reports races, as does 1 (sums wrong); 2 reports none.
#include <cstdio>
template <int kId> __device__ void bsync() { asm volatile("bar.sync %0, 288;" ::"n"(kId) : "memory"); }
template <int kId> __device__ void barrive() { asm volatile("bar.arrive %0, 288;" ::"n"(kId) : "memory"); }
template <int MODE>
__global__ void handover_kernel(int n, int* out) {
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
int main() {
    int* out; cudaMalloc(&out, 256 * sizeof(int));
    int h[256];
    handover_kernel<MODE_SEL><<<4, 288>>>(50, out);
    cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
    printf("mode %d sum %d (expect %d) err %s\n", MODE_SEL, h[0], 50 * 51 / 2, cudaGetErrorString(cudaGetLastError()));
}
