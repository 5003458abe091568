"""Runs one attention forward of ours (the default tier, or FLASH_ATTN_TIER's), and optionally of SDPA's
FlashAttention-2 and cuDNN backends, for `ncu` to profile.
   usage: ncu --kernel-name regex:'fwd_kernel|flash|cudnn' python benchmark/profile_one.py B S H D [causal] [peers]"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attention import flash_attn_func

b, s, h, d = (int(x) for x in sys.argv[1:5])
causal = "causal" in sys.argv[5:]
peers = "peers" in sys.argv[5:]
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    flash_attn_func(q, k, v, causal=causal)
    if peers:
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
torch.cuda.synchronize()
