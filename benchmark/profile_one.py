"""Runs one attention forward of ours and of SDPA's FlashAttention-2 backend, for `ncu` to profile side by side.
   usage: ncu --kernel-name regex:'fwd_kernel|flash' python benchmark/profile_one.py B S H D [causal]"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attention import flash_attn_func

b, s, h, d = (int(x) for x in sys.argv[1:5])
causal = len(sys.argv) > 5 and sys.argv[5] == "causal"
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    flash_attn_func(q, k, v, causal=causal, tier="sm80")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
torch.cuda.synchronize()
