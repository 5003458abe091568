"""One small forward + backward call per head dim, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool racecheck --kernel-name kns=bwd_kernel python3 benchmark/small_case.py 64 128

Sizes are small (the tools slow kernels down by orders of magnitude) but cover a partial query tile, a partial key
block, GQA, a causal mask and the deterministic dQ order."""

import sys

import torch

from flash_attention import flash_attn_func


def main():
    head_dims = [int(x) for x in sys.argv[1:]] or [64]
    for d in head_dims:
        for deterministic in (False, True):
            q = torch.randn(1, 77, 4, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            k, v = (torch.randn(1, 150, 2, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                    for _ in range(2))
            out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
            out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print("done", head_dims)


if __name__ == "__main__":
    main()
