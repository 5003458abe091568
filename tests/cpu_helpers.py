"""Inputs, calls and the per-sequence reference shared by the CPU tests, which run the Python path with the kernels
replaced by stand-ins (the fixtures in conftest.py): small random q, k, v, batched and packed (varlen), and calls of
the API on valid inputs with some replaced."""

import torch

from flash_attention import flash_attn_func, flash_attn_varlen_func
from flash_attention.interface import _BATCHED
from helpers import fp16
from reference import attention_ref

# The sequence arguments of a batched call to the ops (no cu_seqlens, seqused or max_seqlen).
BATCHED = _BATCHED


def rand(*shape, dtype=fp16, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def make_qkv(b=2, sq=5, sk=7, h=4, hk=2, d=16, dtype=fp16):
    return rand(b, sq, h, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype)


def leaves(*tensors):
    return [t.requires_grad_() for t in tensors]


def call(q=None, k=None, v=None, **kwargs):
    """flash_attn_func on valid CPU inputs (b=2, sq=5, sk=7, h=4, hk=2, d=16), with some replaced."""
    dq, dk, dv = make_qkv()
    return flash_attn_func(dq if q is None else q, dk if k is None else k, dv if v is None else v, **kwargs)


def int32(*values):
    return torch.tensor(values, dtype=torch.int32)


# Three sequences of 2, 0 and 3 queries and 3, 1 and 3 keys.
CU_Q, CU_K = (0, 2, 2, 5), (0, 3, 4, 7)


def make_varlen(total_q=5, total_k=7, h=4, hk=2, d=16, dtype=fp16):
    return rand(total_q, h, d, dtype=dtype), rand(total_k, hk, d, dtype=dtype), rand(total_k, hk, d, dtype=dtype)


def call_varlen(q=None, k=None, v=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=3, max_seqlen_k=3,
                **kwargs):
    """flash_attn_varlen_func on valid CPU inputs (CU_Q, CU_K, h=4, hk=2, d=16), with some replaced."""
    dq, dk, dv = make_varlen()
    return flash_attn_varlen_func(dq if q is None else q, dk if k is None else k, dv if v is None else v,
                                  int32(*CU_Q) if cu_seqlens_q is None else cu_seqlens_q,
                                  int32(*CU_K) if cu_seqlens_k is None else cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  **kwargs)


def used_rows(cu_seqlens, seqused):
    """The rows of each sequence that it uses."""
    cu = cu_seqlens.int().tolist()
    lengths = [end - start for start, end in zip(cu, cu[1:])] if seqused is None else seqused.int().tolist()
    return [slice(start, start + n) for start, n in zip(cu, lengths)]


def varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None, alibi_slopes=None, **kwargs):
    """attention_ref on each sequence of packed q (total_q, h, d) and k/v (total_k, hk, d): out (total_q, h, d) and
    lse (h, total_q), fp32; the rows of no sequence are fully masked (out 0, lse -inf)."""
    out = torch.zeros(q.shape)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    for i, (rows_q, rows_k) in enumerate(zip(used_rows(cu_seqlens_q, seqused_q), used_rows(cu_seqlens_k, seqused_k))):
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[i]
        o, l = attention_ref(q[rows_q][None], k[rows_k][None], v[rows_k][None], alibi_slopes=slopes, **kwargs)
        out[rows_q], lse[:, rows_q] = o[0], l[0]
    return out, lse


def reference_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
    """The reference with the kernels' forward signature (_ops.forward_impl's): (out in q's dtype, contiguous as the
    ops' fakes say, lse fp32), batched or varlen."""
    if cu_seqlens_q is None:
        out, lse = attention_ref(q, k, v, False, (window_left, window_right), softcap, alibi_slopes, softmax_scale)
    else:
        out, lse = varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                              window_size=(window_left, window_right), softcap=softcap, softmax_scale=softmax_scale)
    return out.to(q.dtype, memory_format=torch.contiguous_format), lse
