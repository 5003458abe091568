"""Checks that need no GPU: input validation, tier dispatch, the Python-side preparation of inputs, the autograd
wiring of the ops (with CPU stand-ins for the kernels), and the reference itself. They run on the CPU-only CI."""

import inspect
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import flash_attention
from flash_attention import (_checks, _dispatch, _ops, cute, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                             flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from flash_attention.interface import _BATCHED as BATCHED
from flash_attention.interface import normalize_window, pad_head_dim
from helpers import SelfAttention, output_and_grads
from reference import attention_mask, attention_ref

fp16, bf16 = torch.float16, torch.bfloat16


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


# ---------------------------------------------------------------------------------------------------------------
# Rejected inputs

REJECTED = [
    ("q-not-tensor", lambda: call(q=[[1.0]]), TypeError, r"q must be a torch\.Tensor, got list"),
    ("q-fp32", lambda: call(q=rand(2, 5, 4, 16, dtype=torch.float32)), TypeError,
     r"q must be torch\.float16 or torch\.bfloat16, got torch\.float32"),
    ("k-int32", lambda: call(k=torch.zeros(2, 7, 2, 16, dtype=torch.int32)), TypeError,
     r"k must be torch\.float16 or torch\.bfloat16, got torch\.int32"),
    ("v-bf16-with-fp16", lambda: call(v=rand(2, 7, 2, 16, dtype=bf16)), TypeError,
     r"q, k and v must have the same dtype"),
    ("q-rank3", lambda: call(q=rand(2, 5, 64)), ValueError, r"q must have rank 4"),
    ("v-rank5", lambda: call(v=rand(2, 7, 2, 16, 1)), ValueError, r"v must have rank 4"),
    ("k-v-seqlen-mismatch", lambda: call(v=rand(2, 8, 2, 16)), ValueError, r"k and v must have the same shape"),
    ("k-v-heads-mismatch", lambda: call(v=rand(2, 7, 4, 16)), ValueError, r"k and v must have the same shape"),
    ("batch-mismatch", lambda: call(q=rand(3, 5, 4, 16)), ValueError, r"same batch size, got 3 and 2"),
    ("head-dim-mismatch", lambda: call(q=rand(2, 5, 4, 32)), ValueError,
     r"same head dim, got 32 for q and 16 for k/v"),
    ("head-dim-264", lambda: flash_attn_func(*make_qkv(d=264)), ValueError,
     r"head dim must be between 1 and 256, got 264"),
    ("head-dim-0", lambda: flash_attn_func(*make_qkv(d=0)), ValueError, r"head dim must be between 1 and 256, got 0"),
    ("kv-heads-0", lambda: flash_attn_func(*make_qkv(hk=0)), ValueError, r"number of heads must be at least 1"),
    ("heads-not-multiple", lambda: flash_attn_func(*make_qkv(h=6, hk=4)), ValueError,
     r"query heads \(6\) must be a multiple of the number of key/value heads \(4\) \(GQA"),
    ("alibi-not-tensor", lambda: call(alibi_slopes=[0.5] * 4), TypeError, r"alibi_slopes must be a torch\.Tensor"),
    ("alibi-fp16", lambda: call(alibi_slopes=torch.ones(4, dtype=fp16)), TypeError,
     r"alibi_slopes must be torch\.float32, got torch\.float16"),
    ("alibi-shape-h+1", lambda: call(alibi_slopes=torch.ones(5)), ValueError,
     r"alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\) = \(2, 4\), got \(5,\)"),
    ("alibi-shape-h-b", lambda: call(alibi_slopes=torch.ones(4, 2)), ValueError, r"alibi_slopes must have shape"),
    ("alibi-shape-b-h-1", lambda: call(alibi_slopes=torch.ones(2, 4, 1)), ValueError,
     r"alibi_slopes must have shape"),
    ("window-triple", lambda: call(window_size=(1, 2, 3)), ValueError, r"window_size must be a pair of integers"),
    ("window-int", lambda: call(window_size=4), ValueError, r"window_size must be a pair of integers"),
    ("window-float", lambda: call(window_size=(1.5, 0)), ValueError, r"window_size must be a pair of integers"),
    ("window-bool", lambda: call(window_size=(True, 0)), ValueError, r"window_size must be a pair of integers"),
    ("window-float-tensor", lambda: call(window_size=(torch.tensor(2.0), 0)), ValueError,
     r"window_size must be a pair of integers"),
    ("window-1d-tensor", lambda: call(window_size=(torch.tensor([2]), 0)), ValueError,
     r"window_size must be a pair of integers"),
    ("softcap-nan", lambda: call(softcap=float("nan")), ValueError, r"softcap must be a finite number"),
    ("tier-unknown", lambda: call(tier="sm75"), ValueError, r"unknown tier 'sm75'.*sm80, sm90$"),
    ("tier-int", lambda: call(tier=80), TypeError, r"tier must be a string"),
    ("dropout", lambda: call(dropout_p=0.1), NotImplementedError, r"dropout is not supported yet"),
    ("dropout-negative", lambda: call(dropout_p=-0.1), ValueError, r"dropout_p must be a number in \[0, 1\)"),
    ("device-cpu", lambda: call(), ValueError, r"must be CUDA tensors, got device cpu"),
    ("device-mixed", lambda: call(k=rand(2, 7, 2, 16, device="meta")), ValueError, r"must be on the same device"),
    ("device-alibi", lambda: call(alibi_slopes=torch.ones(4, device="meta")), ValueError,
     r"must be on the same device"),
    ("qkvpacked-rank4", lambda: flash_attn_qkvpacked_func(rand(2, 5, 3, 64)), ValueError,
     r"qkv must have shape \(batch, seqlen, 3, nheads, head_dim\), got \(2, 5, 3, 64\)"),
    ("qkvpacked-2", lambda: flash_attn_qkvpacked_func(rand(2, 5, 2, 4, 16)), ValueError, r"qkv must have shape"),
    ("qkvpacked-not-tensor", lambda: flash_attn_qkvpacked_func(None), TypeError, r"qkv must be a torch\.Tensor"),
    ("kvpacked-3", lambda: flash_attn_kvpacked_func(rand(2, 5, 4, 16), rand(2, 7, 3, 2, 16)), ValueError,
     r"kv must have shape \(batch, seqlen_k, 2, nheads_k, head_dim\)"),
    ("qkvpacked-fp32", lambda: flash_attn_qkvpacked_func(rand(2, 5, 3, 4, 16, dtype=torch.float32)), TypeError,
     r"q must be torch\.float16 or torch\.bfloat16"),
]


@pytest.mark.parametrize("fn, exc, match", [pytest.param(*c[1:], id=c[0]) for c in REJECTED])
def test_rejected_input(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


# ---------------------------------------------------------------------------------------------------------------
# Rejected varlen inputs

def seqused(*values):
    return dict(seqused_q=int32(*values))


VARLEN_REJECTED = [
    ("q-rank4", lambda: call_varlen(q=rand(1, 5, 4, 16)), ValueError,
     r"q must have rank 3, \(total_q, nheads, head_dim\), got shape \(1, 5, 4, 16\)"),
    ("k-rank4", lambda: call_varlen(k=rand(1, 7, 2, 16)), ValueError, r"k must have rank 3, \(total_k, nheads_k"),
    ("v-rank2", lambda: call_varlen(v=rand(7, 32)), ValueError, r"v must have rank 3"),
    ("q-fp32", lambda: call_varlen(q=rand(5, 4, 16, dtype=torch.float32)), TypeError,
     r"q must be torch\.float16 or torch\.bfloat16, got torch\.float32"),
    ("v-bf16-with-fp16", lambda: call_varlen(v=rand(7, 2, 16, dtype=bf16)), TypeError,
     r"q, k and v must have the same dtype"),
    ("k-not-tensor", lambda: call_varlen(k="k"), TypeError, r"k must be a torch\.Tensor, got str"),
    ("k-v-shape", lambda: call_varlen(v=rand(6, 2, 16)), ValueError,
     r"k and v must have the same shape \(total_k, nheads_k, head_dim\)"),
    ("head-dim-mismatch", lambda: call_varlen(q=rand(5, 4, 24)), ValueError,
     r"same head dim, got 24 for q and 16 for k/v"),
    ("head-dim-264", lambda: flash_attn_varlen_func(*make_varlen(d=264), int32(*CU_Q), int32(*CU_K), 3, 3),
     ValueError, r"head dim must be between 1 and 256, got 264"),
    ("heads-not-multiple", lambda: flash_attn_varlen_func(*make_varlen(h=6, hk=4), int32(*CU_Q), int32(*CU_K), 3, 3),
     ValueError, r"query heads \(6\) must be a multiple of the number of key/value heads \(4\)"),
    ("cu_q-list", lambda: call_varlen(cu_seqlens_q=list(CU_Q)), TypeError,
     r"cu_seqlens_q must be a torch\.Tensor, got list"),
    ("cu_q-int64", lambda: call_varlen(cu_seqlens_q=torch.tensor(CU_Q)), TypeError,
     r"cu_seqlens_q must be torch\.int32, got torch\.int64"),
    ("cu_k-float", lambda: call_varlen(cu_seqlens_k=torch.tensor(CU_K, dtype=torch.float32)), TypeError,
     r"cu_seqlens_k must be torch\.int32, got torch\.float32"),
    ("cu_k-2d", lambda: call_varlen(cu_seqlens_k=int32(*CU_K)[None]), ValueError,
     r"cu_seqlens_k must be 1-D, got shape \(1, 4\)"),
    ("cu_q-0d", lambda: call_varlen(cu_seqlens_q=int32(*CU_Q)[0]), ValueError, r"cu_seqlens_q must be 1-D"),
    ("cu_q-strided", lambda: call_varlen(cu_seqlens_q=int32(0, 9, 2, 9, 2, 9, 5, 9)[::2]), ValueError,
     r"cu_seqlens_q must be contiguous, got stride \(2,\)"),
    ("cu_q-empty", lambda: call_varlen(cu_seqlens_q=int32(), cu_seqlens_k=int32()), ValueError,
     r"cu_seqlens_q must have length batch \+ 1 >= 1, got length 0"),
    ("cu-lengths-differ", lambda: call_varlen(cu_seqlens_k=int32(0, 7)), ValueError,
     r"cu_seqlens_q and cu_seqlens_k must have the same length \(batch \+ 1\), got 4 and 2"),
    ("cu_q-device", lambda: call_varlen(cu_seqlens_q=int32(*CU_Q).to("meta")), ValueError,
     r"cu_seqlens_q must be on q's device \(cpu\), got meta"),
    ("cu_k-device", lambda: call_varlen(cu_seqlens_k=int32(*CU_K).to("meta")), ValueError,
     r"cu_seqlens_k must be on q's device"),
    ("seqused_q-int64", lambda: call_varlen(seqused_q=torch.tensor([1, 0, 2])), TypeError,
     r"seqused_q must be torch\.int32, got torch\.int64"),
    ("seqused_k-list", lambda: call_varlen(seqused_k=[1, 1, 1]), TypeError, r"seqused_k must be a torch\.Tensor"),
    ("seqused_q-2d", lambda: call_varlen(seqused_q=int32(1, 0, 2)[None]), ValueError, r"seqused_q must be 1-D"),
    ("seqused_k-strided", lambda: call_varlen(seqused_k=int32(1, 9, 1, 9, 1, 9)[::2]), ValueError,
     r"seqused_k must be contiguous"),
    ("seqused_q-length", lambda: call_varlen(**seqused(1, 0)), ValueError,
     r"seqused_q must have length batch = len\(cu_seqlens_q\) - 1 = 3, got 2"),
    ("seqused_k-length", lambda: call_varlen(seqused_k=int32(1, 1, 1, 1)), ValueError,
     r"seqused_k must have length batch = len\(cu_seqlens_q\) - 1 = 3, got 4"),
    ("seqused_k-device", lambda: call_varlen(seqused_k=int32(1, 1, 1).to("meta")), ValueError,
     r"seqused_k must be on q's device"),
    ("max_seqlen_q-float", lambda: call_varlen(max_seqlen_q=3.0), ValueError,
     r"max_seqlen_q must be an int >= 0 or an integer tensor of one element, got 3\.0"),
    ("max_seqlen_k-negative", lambda: call_varlen(max_seqlen_k=-1), ValueError, r"max_seqlen_k must be an int >= 0"),
    ("max_seqlen_k-bool", lambda: call_varlen(max_seqlen_k=True), ValueError, r"max_seqlen_k must be an int >= 0"),
    ("max_seqlen_q-none", lambda: call_varlen(max_seqlen_q=None), ValueError, r"max_seqlen_q must be an int >= 0"),
    ("alibi-shape-b+1", lambda: call_varlen(alibi_slopes=torch.ones(4, 4)), ValueError,
     r"alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\) = \(3, 4\), got \(4, 4\)"),
    ("alibi-fp16", lambda: call_varlen(alibi_slopes=torch.ones(4, dtype=fp16)), TypeError,
     r"alibi_slopes must be torch\.float32"),
    ("tier-unknown", lambda: call_varlen(tier="sm75"), ValueError, r"unknown tier 'sm75'"),
    ("dropout", lambda: call_varlen(dropout_p=0.1), NotImplementedError, r"dropout is not supported yet"),
    ("block_table", lambda: flash_attn_varlen_func(*make_varlen(), int32(*CU_Q), int32(*CU_K), 3, 3, 0.0, None, False,
                                                   (-1, -1), 0.0, None, False, False, int32(0, 1)), NotImplementedError,
     r"block_table \(a paged KV cache\) is not supported yet: it must be None"),
    ("device-cpu", lambda: call_varlen(), ValueError, r"must be CUDA tensors, got device cpu"),
    ("device-alibi", lambda: call_varlen(alibi_slopes=torch.ones(4, device="meta")), ValueError,
     r"must be on the same device"),
    ("qkvpacked-rank5", lambda: flash_attn_varlen_qkvpacked_func(rand(1, 5, 3, 4, 16), int32(0, 5), 5), ValueError,
     r"qkv must have shape \(total, 3, nheads, head_dim\), got \(1, 5, 3, 4, 16\)"),
    ("qkvpacked-2", lambda: flash_attn_varlen_qkvpacked_func(rand(5, 2, 4, 16), int32(0, 5), 5), ValueError,
     r"qkv must have shape \(total, 3"),
    ("kvpacked-3", lambda: flash_attn_varlen_kvpacked_func(rand(5, 4, 16), rand(7, 3, 2, 16), int32(*CU_Q),
                                                           int32(*CU_K), 3, 3), ValueError,
     r"kv must have shape \(total_k, 2, nheads_k, head_dim\)"),
    ("kvpacked-not-tensor", lambda: flash_attn_varlen_kvpacked_func(rand(5, 4, 16), None, int32(*CU_Q), int32(*CU_K),
                                                                    3, 3), TypeError, r"kv must be a torch\.Tensor"),
    ("qkvpacked-seqused-length", lambda: flash_attn_varlen_qkvpacked_func(rand(5, 3, 4, 16), int32(0, 5), 5,
                                                                          seqused=int32(1, 2)), ValueError,
     r"seqused_q must have length batch = len\(cu_seqlens_q\) - 1 = 1, got 2"),
]


@pytest.mark.parametrize("fn, exc, match", [pytest.param(*c[1:], id=c[0]) for c in VARLEN_REJECTED])
def test_rejected_varlen_input(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


# ---------------------------------------------------------------------------------------------------------------
# Preparation of the kernel's inputs

@pytest.mark.parametrize("d", [1, 13, 59, 111, 250])
def test_pad_head_dim(d):
    x = rand(2, 3, 4, d)
    padded = pad_head_dim(x)
    assert padded.shape == (2, 3, 4, -(-d // 8) * 8)
    assert torch.equal(padded[..., :d], x)
    assert not padded[..., d:].any()


@pytest.mark.parametrize("d", [8, 64, 256])
def test_pad_head_dim_noop(d):
    x = rand(2, 3, 4, d)
    assert pad_head_dim(x) is x


@pytest.mark.parametrize(
    "window, causal, sq, sk, expected",
    [
        ((-1, -1), False, 10, 10, (-1, -1)),
        ((-1, -1), True, 10, 10, (-1, 0)),
        ((-1, -1), True, 1, 100, (-1, -1)),  # a single query row sees every key even when causal
        ((5, 3), False, 10, 10, (5, 3)),
        ((9, 9), False, 10, 10, (-1, -1)),
        ((8, 8), False, 10, 10, (8, 8)),
        ((3, 50), False, 100, 20, (3, 50)),  # sq > sk: a right bound >= sk still excludes keys of early rows
        ((19, 7), True, 5, 20, (-1, 0)),
        ((4, 7), True, 5, 20, (4, 0)),
    ],
    ids=lambda x: str(x).replace(" ", ""),
)
def test_normalize_window(window, causal, sq, sk, expected):
    assert normalize_window(window, causal, sq, sk) == expected


def test_normalize_window_keeps_mask():
    sizes, bounds = (1, 2, 3, 5, 8), (-1, 0, 1, 2, 4, 7, 9)
    for sq, sk, left, right, causal in itertools.product(sizes, sizes, bounds, bounds, (False, True)):
        normalized = normalize_window((left, right), causal, sq, sk)
        assert torch.equal(
            attention_mask(sq, sk, causal, (left, right)), attention_mask(sq, sk, False, normalized)
        ), (sq, sk, left, right, causal)


# ---------------------------------------------------------------------------------------------------------------
# The whole Python path on CPU, with the kernel replaced by the reference

@pytest.fixture
def stub_kernel(monkeypatch):
    """Let CPU tensors through and run the reference in place of the kernels' forward (batched and varlen); returns
    the list of calls it received."""
    calls = []

    def fake_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
        calls.append(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                          seqused_k=seqused_k, max_seqlen=(max_seqlen_q, max_seqlen_k), softmax_scale=softmax_scale,
                          window=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                          deterministic=deterministic, tier=tier))
        if cu_seqlens_q is None:
            out, lse = attention_ref(q, k, v, False, (window_left, window_right), softcap, alibi_slopes, softmax_scale)
        else:
            out, lse = varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                                  window_size=(window_left, window_right), softcap=softcap,
                                  softmax_scale=softmax_scale)
        return out.to(q.dtype), lse

    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    monkeypatch.setattr(_ops, "forward_impl", fake_forward)
    return calls


@pytest.mark.parametrize("d", [13, 40, 59, 111])
def test_padded_head_dim_matches_reference(stub_kernel, d):
    q, k, v = make_qkv(sq=9, sk=11, d=d, dtype=bf16)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, softcap=3.0, return_attn_probs=True)
    (call_args,) = stub_kernel
    assert call_args["q"].shape[-1] == call_args["k"].shape[-1] == call_args["v"].shape[-1] == -(-d // 8) * 8
    assert call_args["softmax_scale"] == d ** -0.5  # from the original head dim
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, softcap=3.0)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref_out.to(bf16))
    torch.testing.assert_close(lse, ref_lse)


def test_arguments_reach_the_kernel(stub_kernel):
    q, k, v = make_qkv(sq=6, sk=9)
    flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(2, -1), deterministic=True, tier="sm80")
    flash_attn_func(q, k, v, window_size=(100, 1))
    first, second = stub_kernel
    assert first["softmax_scale"] == 0.3 and first["window"] == (2, 0) and first["tier"] == "sm80"
    assert first["deterministic"] is True and second["deterministic"] is False
    assert first["q"] is q  # head dim 16 needs no padding and no copy
    assert second["window"] == (-1, 1) and second["tier"] is None


@pytest.mark.parametrize("window", [(np.int64(3), np.int32(0)), (torch.tensor(3), torch.tensor(0, dtype=torch.int32)),
                                    [3, 0]], ids=["numpy", "tensor", "list"])
def test_window_size_integer_likes(stub_kernel, window):
    """window_size takes what flash-attn takes: any pair of integer-likes, passed on as Python ints."""
    q, k, v = make_qkv(sq=6, sk=9)
    out = flash_attn_func(q, k, v, window_size=window)
    (call_args,) = stub_kernel
    assert call_args["window"] == (3, 0) and all(type(w) is int for w in call_args["window"])
    assert torch.equal(out, flash_attn_func(q, k, v, window_size=(3, 0)))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_strided_last_dim_is_copied(stub_kernel, name):
    """A last dimension that is not contiguous is accepted, as flash-attn does (the binding copies it; the GPU tests
    check that), not rejected."""
    q, k, v = make_qkv(sq=6, sk=9)
    strided = {"q": q, "k": k, "v": v}
    strided[name] = torch.cat([strided[name], strided[name]], dim=-1)[..., ::2]
    assert strided[name].stride(-1) == 2
    out = flash_attn_func(strided["q"], strided["k"], strided["v"], causal=True)
    expected = {n: t.contiguous() for n, t in strided.items()}
    assert torch.equal(out, flash_attn_func(expected["q"], expected["k"], expected["v"], causal=True))


def test_packed_inputs_are_views(stub_kernel):
    qkv = rand(2, 5, 3, 4, 16)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    q, kv = rand(2, 5, 4, 16), rand(2, 7, 2, 2, 16)
    out_kv = flash_attn_kvpacked_func(q, kv)
    packed, kvpacked = stub_kernel
    for name in "qkv":
        assert packed[name].untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    for name in "kv":
        assert kvpacked[name].untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    assert torch.equal(out, flash_attn_func(*qkv.unbind(2), causal=True))
    assert torch.equal(out_kv, flash_attn_func(q, *kv.unbind(2)))


def test_return_convention(stub_kernel):
    q, k, v = make_qkv(b=2, sq=5, h=4)
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
    result = flash_attn_func(q, k, v, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3 and result[2] is None
    assert torch.equal(result[0], out)
    assert result[1].shape == (2, 4, 5) and result[1].dtype == torch.float32
    for packed in (flash_attn_qkvpacked_func(rand(2, 5, 3, 4, 16), return_attn_probs=True),
                   flash_attn_kvpacked_func(q, rand(2, 7, 2, 2, 16), return_attn_probs=True)):
        assert len(packed) == 3 and packed[2] is None and packed[1].shape == (2, 4, 5)


@pytest.fixture
def no_extension(monkeypatch):
    """The extension fails to import, as in a build without CUDA: any kernel launch raises."""
    monkeypatch.setattr(_dispatch, "_extension", None)
    monkeypatch.setattr(_dispatch, "_EXTENSION_NAME", "flash_attention._no_such_extension")


@pytest.mark.parametrize(
    "b, sq, sk", [(2, 0, 7), (2, 5, 0), (0, 5, 7), (2, 0, 0)], ids=["sq0", "sk0", "b0", "sq0-sk0"]
)
def test_empty_sequences(no_extension, monkeypatch, b, sq, sk):
    """No query, key or batch: out 0, lse -inf and zero gradients, all without a kernel."""
    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    q, k, v = leaves(*make_qkv(b=b, sq=sq, sk=sk, d=59))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert lse.shape == (b, 4, sq) and lse.dtype == torch.float32
    assert (lse == float("-inf")).all()
    out.backward(torch.randn_like(out))
    for x in (q, k, v):
        assert x.grad.shape == x.shape and x.grad.dtype == x.dtype and not x.grad.any()


def test_compile_traces_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) traces padding, the custom op (through its fake) and slicing in one graph."""
    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)

    class Traced(Exception):
        pass

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise Traced  # the real op needs a GPU; tracing is what is under test

        return run

    def fn(q, k, v, slopes):
        return flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)[:2]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    with pytest.raises(Traced):
        compiled(*make_qkv(d=59), torch.rand(4))
    (gm,) = graphs
    targets = [str(node.target) for node in gm.graph.nodes]
    assert targets.count("flash_attention.fwd.default") == 1


# ---------------------------------------------------------------------------------------------------------------
# The autograd wiring on CPU, with stand-ins registered under the custom ops

@pytest.fixture(params=["eager", "op"])
def standin_ops(request, monkeypatch):
    """Let CPU tensors through and put CPU stand-ins in place of the kernels, so that the autograd formula and the
    fakes run, on either path: eagerly, or through the custom ops as torch.compile would. The forwards are the
    reference, the backwards return 2 * dout, 3 * k and 4 * v, distinct for each input. Returns the calls they
    received, by kind: fwd and bwd for batched calls, varlen_fwd and varlen_bwd for varlen ones."""
    calls = {"fwd": [], "bwd": [], "varlen_fwd": [], "varlen_bwd": []}

    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                window_left, window_right, softcap, alibi_slopes, deterministic, tier):
        if cu_seqlens_q is None:
            out, lse = attention_ref(q, k, v, False, (window_left, window_right), softcap, alibi_slopes, softmax_scale)
        else:
            out, lse = varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                                  window_size=(window_left, window_right), softcap=softcap,
                                  softmax_scale=softmax_scale)
        out = out.to(q.dtype, memory_format=torch.contiguous_format)  # laid out as the ops' fakes say
        calls["fwd" if cu_seqlens_q is None else "varlen_fwd"].append(dict(q=q, k=k, v=v, out=out, lse=lse))
        return out, lse

    def backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
        calls["bwd" if cu_seqlens_q is None else "varlen_bwd"].append(
            dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, cu_seqlens_q=cu_seqlens_q,
                 cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                 max_seqlen=(max_seqlen_q, max_seqlen_k), softmax_scale=softmax_scale,
                 window=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                 deterministic=deterministic, tier=tier))
        return tuple(g.contiguous() for g in (2 * dout, 3 * k, 4 * v))

    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    monkeypatch.setattr(_ops, "forward_impl", forward)
    monkeypatch.setattr(_ops, "backward_impl", backward)
    if request.param == "op":
        monkeypatch.setattr(_ops, "_eager", lambda q, k, v: False)
    calls["path"] = request.param
    return calls


def test_backward_runs_bwd_on_saved_state(standin_ops):
    q, k, v = leaves(*make_qkv())
    slopes = torch.rand(4)
    out, lse = _ops.attention(q, k, v, *BATCHED, 0.3, 2, 0, 1.5, slopes, True, "sm80")
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    (fwd_call,), (bwd_call,) = standin_ops["fwd"], standin_ops["bwd"]
    for name in ("q", "k", "v", "out", "lse"):
        assert torch.equal(bwd_call[name], fwd_call[name]), name
    assert torch.equal(bwd_call["dout"], dout)
    assert bwd_call["dlse"] is None  # the loss does not use lse: the kernel skips that term
    assert bwd_call["softmax_scale"] == 0.3 and bwd_call["window"] == (2, 0) and bwd_call["softcap"] == 1.5
    assert torch.equal(bwd_call["alibi_slopes"], slopes) and bwd_call["tier"] == "sm80"
    assert bwd_call["deterministic"] is True
    assert torch.equal(dq, 2 * dout) and torch.equal(dk, 3 * k) and torch.equal(dv, 4 * v)


@pytest.mark.parametrize("loss", ["out+lse", "lse"])
def test_lse_gradient_reaches_bwd(standin_ops, loss):
    q, k, v = leaves(*make_qkv())
    out, lse = _ops.attention(q, k, v, *BATCHED, 0.25, -1, -1, 0.0, None, False, None)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    if loss == "lse":
        torch.autograd.grad(lse, (q, k, v), dlse)
        dout = torch.zeros_like(out)  # the kernel takes a dout tensor even when the loss ignores out
    else:
        torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    (call,) = standin_ops["bwd"]
    assert torch.equal(call["dlse"], dlse) and torch.equal(call["dout"], dout)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_bwd(standin_ops, deterministic):
    q, k, v = leaves(*make_qkv())
    qkv, kv = leaves(rand(2, 5, 3, 4, 16), rand(2, 7, 2, 2, 16))
    flash_attn_func(q, k, v, deterministic=deterministic).sum().backward()
    flash_attn_qkvpacked_func(qkv, deterministic=deterministic).sum().backward()
    flash_attn_kvpacked_func(q, kv, deterministic=deterministic).sum().backward()
    assert [call["deterministic"] for call in standin_ops["bwd"]] == [deterministic] * 3


@pytest.mark.parametrize("d", [16, 13])
def test_grads_reach_inputs(standin_ops, d):
    q, k, v = leaves(*make_qkv(d=d))
    out = flash_attn_func(q, k, v, causal=True, softmax_scale=0.5)
    dout = torch.randn_like(out)
    out.backward(dout)
    (call,) = standin_ops["bwd"]
    # The kernel works on the head dim padded to 8, and the padding is sliced off the gradients.
    assert call["q"].shape[-1] == call["k"].shape[-1] == call["dout"].shape[-1] == 16
    assert torch.equal(call["dout"][..., :d], dout)
    assert call["softmax_scale"] == 0.5 and call["window"] == (-1, 0)
    assert torch.equal(q.grad, 2 * dout) and torch.equal(k.grad, 3 * k) and torch.equal(v.grad, 4 * v)


def test_packed_grads_reach_inputs(standin_ops):
    qkv, kv, q = leaves(rand(2, 5, 3, 4, 16), rand(2, 7, 2, 2, 16), rand(2, 5, 4, 16))
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _, k, v = qkv.detach().unbind(2)
    assert torch.equal(qkv.grad, torch.stack((2 * dout, 3 * k, 4 * v), dim=2))

    out = flash_attn_kvpacked_func(q, kv)
    dout = torch.randn_like(out)
    out.backward(dout)
    k, v = kv.detach().unbind(2)
    assert torch.equal(q.grad, 2 * dout) and torch.equal(kv.grad, torch.stack((3 * k, 4 * v), dim=2))


@pytest.mark.parametrize("wanted", ["q", "k", "v", "kv"])
def test_some_inputs_require_grad(standin_ops, wanted):
    inputs = dict(zip("qkv", make_qkv()))
    leaves(*(inputs[name] for name in wanted))
    out = flash_attn_func(*inputs.values())
    dout = torch.randn_like(out)
    out.backward(dout)
    expected = dict(q=2 * dout, k=3 * inputs["k"], v=4 * inputs["v"])
    for name, x in inputs.items():
        if name in wanted:
            assert torch.equal(x.grad, expected[name]), name
        else:
            assert x.grad is None, name


def test_compile_traces_backward(standin_ops):
    """torch.compile(fullgraph=True) of a layer puts the fwd op in the forward graph and the bwd op in the backward
    graph (through their fakes), passes deterministic on, and gives eager's gradients."""
    graphs = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = [str(node.target) for node in gm.graph.nodes]
            return make_boxed_func(gm.forward)

        return compiler

    model = SelfAttention(32, 4, 2, 16, deterministic=True).to(bf16)
    x = rand(2, 5, 32, dtype=bf16).requires_grad_()
    dy = torch.randn_like(x)

    eager = output_and_grads(model, list(model.parameters()), x, dy)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    compiled = output_and_grads(torch.compile(model, fullgraph=True, backend=backend), list(model.parameters()), x, dy)
    assert graphs["forward"].count("flash_attention.fwd.default") == 1
    assert graphs["backward"].count("flash_attention.bwd.default") == 1
    assert [call["deterministic"] for call in standin_ops["bwd"]] == [True, True]
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e)


# ---------------------------------------------------------------------------------------------------------------
# The varlen path on CPU, with the op replaced by a per-sequence reference

@pytest.mark.parametrize(
    "window, causal, expected",
    [
        ((-1, -1), False, (-1, -1)),
        ((-1, -1), True, (-1, 0)),
        ((5, 3), False, (5, 3)),  # no sequence is longer than 3 queries or keys, but max_seqlen is not trusted
        ((6, 4), False, (-1, -1)),  # >= total_k - 1 = 6 and total_q - 1 = 4
        ((5, 4), True, (5, 0)),
        ((100, 2), True, (-1, 0)),
    ],
    ids=lambda x: str(x).replace(" ", ""),
)
def test_varlen_window_normalized_by_totals(stub_kernel, window, causal, expected):
    call_varlen(window_size=window, causal=causal)
    (call_args,) = stub_kernel
    assert call_args["window"] == expected


def test_varlen_normalize_window_keeps_every_sequence_mask():
    """A bound dropped against the totals is one that no sequence, of any lengths that fit, needs."""
    sizes, bounds = (0, 1, 2, 3, 5), (-1, 0, 1, 2, 4, 6)
    for total_q, total_k, left, right, causal in itertools.product(sizes, sizes, bounds, bounds, (False, True)):
        normalized = normalize_window((left, right), causal, total_q, total_k)
        for sq, sk in itertools.product(range(total_q + 1), range(total_k + 1)):
            assert torch.equal(
                attention_mask(sq, sk, causal, (left, right)), attention_mask(sq, sk, False, normalized)
            ), (total_q, total_k, sq, sk, left, right, causal)


@pytest.mark.parametrize("d", [13, 40, 59])
def test_varlen_padded_head_dim_matches_reference(stub_kernel, d):
    q, k, v = make_varlen(d=d, dtype=bf16)
    cu_q, cu_k, slopes = int32(*CU_Q), int32(*CU_K), torch.rand(3, 4)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, softcap=3.0, alibi_slopes=slopes,
                                         return_attn_probs=True)
    (call_args,) = stub_kernel
    assert call_args["q"].shape[-1] == call_args["k"].shape[-1] == call_args["v"].shape[-1] == -(-d // 8) * 8
    assert call_args["softmax_scale"] == d ** -0.5  # from the original head dim
    ref_out, ref_lse = varlen_ref(q, k, v, cu_q, cu_k, alibi_slopes=slopes, causal=True, softcap=3.0)
    assert out.shape == q.shape and lse.shape == (4, 5)
    torch.testing.assert_close(out, ref_out.to(bf16))
    torch.testing.assert_close(lse, ref_lse)


def test_varlen_arguments_reach_the_op(stub_kernel):
    q, k, v = make_varlen()
    cu_q, cu_k, used_q, used_k = int32(*CU_Q), int32(*CU_K), int32(1, 0, 3), int32(2, 1, 0)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, np.int64(3), 4, softmax_scale=0.3, window_size=(2, 1),
                           deterministic=True, seqused_q=used_q, seqused_k=used_k, tier="sm80")
    (call_args,) = stub_kernel
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k),
                    ("seqused_q", used_q), ("seqused_k", used_k)):
        assert call_args[name] is t, name  # no padding needed, nothing copied
    assert call_args["max_seqlen"] == (3, 4) and all(type(n) is int for n in call_args["max_seqlen"])
    assert call_args["softmax_scale"] == 0.3 and call_args["window"] == (2, 1)
    assert call_args["deterministic"] is True and call_args["tier"] == "sm80"


def test_varlen_seqused_matches_reference(stub_kernel):
    q, k, v = make_varlen()
    cu_q, cu_k, used_q, used_k = int32(*CU_Q), int32(*CU_K), int32(1, 0, 3), int32(2, 1, 0)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, seqused_q=used_q, seqused_k=used_k,
                                         return_attn_probs=True)
    ref_out, ref_lse = varlen_ref(q, k, v, cu_q, cu_k, used_q, used_k)
    torch.testing.assert_close(out, ref_out.to(fp16))
    torch.testing.assert_close(lse, ref_lse)
    assert not out[1].any() and (lse[:, 1] == float("-inf")).all()  # past seqused_q of the first sequence
    assert not out[2:].any()  # the third sequence uses no key


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_varlen_strided_last_dim_is_copied(stub_kernel, name):
    tensors = dict(zip("qkv", make_varlen()))
    tensors[name] = torch.cat([tensors[name], tensors[name]], dim=-1)[..., ::2]
    out = call_varlen(**tensors, causal=True)
    expected = {n: t.contiguous() for n, t in tensors.items()}
    assert torch.equal(out, call_varlen(**expected, causal=True))


def test_varlen_packed_inputs_are_views(stub_kernel):
    qkv, cu = rand(5, 3, 4, 16), int32(0, 2, 5)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 3, causal=True, seqused=int32(1, 3))
    q, kv = rand(5, 4, 16), rand(7, 2, 2, 16)
    out_kv = flash_attn_varlen_kvpacked_func(q, kv, int32(*CU_Q), int32(*CU_K), 3, 3, seqused_k=int32(1, 1, 1))
    packed, kvpacked = stub_kernel[:2]
    for name in "qkv":
        assert packed[name].untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    for name in "kv":
        assert kvpacked[name].untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    assert packed["cu_seqlens_q"] is packed["cu_seqlens_k"] is cu and packed["max_seqlen"] == (3, 3)
    assert torch.equal(packed["seqused_q"], int32(1, 3)) and packed["seqused_k"] is packed["seqused_q"]
    assert kvpacked["seqused_q"] is None and torch.equal(kvpacked["seqused_k"], int32(1, 1, 1))
    assert torch.equal(out, flash_attn_varlen_func(*qkv.unbind(1), cu, cu, 3, 3, causal=True, seqused_q=int32(1, 3),
                                                   seqused_k=int32(1, 3)))
    assert torch.equal(out_kv, flash_attn_varlen_func(q, *kv.unbind(1), int32(*CU_Q), int32(*CU_K), 3, 3,
                                                      seqused_k=int32(1, 1, 1)))


def test_varlen_return_convention(stub_kernel):
    q, k, v = make_varlen()
    out = call_varlen(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
    result = call_varlen(q, k, v, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3 and result[2] is None
    assert torch.equal(result[0], out)
    assert result[1].shape == (4, 5) and result[1].dtype == torch.float32  # (nheads, total_q)
    for packed in (flash_attn_varlen_qkvpacked_func(rand(5, 3, 4, 16), int32(0, 5), 5, return_attn_probs=True),
                   flash_attn_varlen_kvpacked_func(q, rand(7, 2, 2, 16), int32(*CU_Q), int32(*CU_K), 3, 3,
                                                   return_attn_probs=True)):
        assert len(packed) == 3 and packed[2] is None and packed[1].shape == (4, 5)


@pytest.mark.parametrize(
    "cu_q, cu_k, total_q, total_k",
    [((0, 0, 0), (0, 3, 7), 0, 7), ((0, 2, 5), (0, 0, 0), 5, 0), ((0,), (0,), 5, 7), ((0,), (0,), 0, 0)],
    ids=["total_q0", "total_k0", "b0", "b0-empty"],
)
@pytest.mark.parametrize("with_seqused", [False, True], ids=["plain", "seqused"])
def test_varlen_empty(no_extension, monkeypatch, cu_q, cu_k, total_q, total_k, with_seqused):
    """No query, key or sequence: out 0, lse -inf and zero gradients through a connected graph, without a kernel."""
    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    q, k, v = leaves(*make_varlen(total_q, total_k, d=59))
    b = len(cu_q) - 1
    used = dict(seqused_q=torch.zeros(b, dtype=torch.int32), seqused_k=torch.zeros(b, dtype=torch.int32)) \
        if with_seqused else {}
    out, lse, _ = flash_attn_varlen_func(q, k, v, int32(*cu_q), int32(*cu_k), 3, 3, causal=True,
                                         return_attn_probs=True, **used)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert lse.shape == (4, total_q) and lse.dtype == torch.float32 and (lse == float("-inf")).all()
    assert out.grad_fn is not None
    (out.float().sum() + lse.clamp(min=-1).sum()).backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and x.grad.dtype == x.dtype and not x.grad.any()


def test_varlen_compile_traces_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) traces the varlen checks, padding, the op (through its fake) and slicing in one
    graph, also with FLASH_ATTN_CHECK_VARLEN=1, whose value check would need the tensors' values."""
    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    monkeypatch.setenv("FLASH_ATTN_CHECK_VARLEN", "1")

    class Traced(Exception):
        pass

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            raise Traced

        return run

    def fn(q, k, v, cu_q, cu_k, used_q, slopes):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, alibi_slopes=slopes,
                                      return_attn_probs=True, seqused_q=used_q)[:2]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    with pytest.raises(Traced):
        compiled(*make_varlen(d=59), int32(*CU_Q), int32(*CU_K), int32(1, 0, 3), torch.rand(4))
    (gm,) = graphs
    targets = [str(node.target) for node in gm.graph.nodes]
    assert targets.count("flash_attention.fwd.default") == 1


# ---------------------------------------------------------------------------------------------------------------
# The varlen ops' own bodies, with a CPU stand-in for the binding

class FakeBinding:
    """Records the binding's calls (positional: the operands, the sequences, then the rest) and returns outputs of
    the shapes the kernels' binding allocates: out 1 and lse 0; dq, dk, dv 1."""

    def __init__(self):
        self.calls = []

    def fwd(self, q, k, v, *args):
        self.calls.append(("fwd", (q, k, v) + args))
        return torch.ones_like(q), torch.zeros(_ops._lse_shape(q))

    def bwd(self, dout, q, k, v, out, lse, dlse, *args):
        self.calls.append(("bwd", (dout, q, k, v, out, lse, dlse) + args))
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)


@pytest.fixture(params=["eager", "op"])
def fake_binding(request, monkeypatch):
    binding = FakeBinding()
    monkeypatch.setattr(_dispatch, "_extension", binding)
    monkeypatch.setattr(_dispatch, "resolve", lambda device, kind, head_dim, dtype, tier: (80, 64))
    if request.param == "op":
        monkeypatch.setattr(_ops, "_eager", lambda q, k, v: False)
    binding.path = request.param
    return binding


def test_varlen_binding_call(fake_binding):
    """The binding gets the outputs, the sequences, then the scores and options, all positional; lse is
    (h, total_q)."""
    q, k, v = leaves(*make_varlen(d=40))
    cu_q, cu_k, used_k, slopes = int32(*CU_Q), int32(*CU_K), int32(2, 1, 3), torch.rand(3, 4)
    out, lse = _ops.attention(q, k, v, cu_q, cu_k, None, used_k, 3, 4, 0.3, 2, 0, 1.5, slopes, True, None)
    (out * torch.randn_like(out)).sum().backward()
    (_, fwd_args), (_, bwd_args) = fake_binding.calls
    assert lse.shape == (4, 5) and torch.equal(bwd_args[4], out) and torch.equal(bwd_args[5], lse)
    assert fwd_args[3:] == (cu_q, cu_k, None, used_k, 3, 4, 0.3, 2, 0, 1.5, slopes, 64, 80)  # ..., kernel dim, tier
    assert bwd_args[6] is None  # the loss does not use lse
    assert bwd_args[7:] == (cu_q, cu_k, None, used_k, 3, 4, 0.3, 2, 0, 1.5, slopes, True, 64, 80)


def test_batched_binding_call_has_no_sequences(fake_binding):
    q, k, v = leaves(*make_qkv())
    out, _ = _ops.attention(q, k, v, *BATCHED, 0.25, -1, -1, 0.0, None, False, None)
    out.sum().backward()
    (_, fwd_args), (_, bwd_args) = fake_binding.calls
    assert fwd_args[3:9] == BATCHED and bwd_args[7:13] == BATCHED


def test_eager_call_skips_the_op(fake_binding, monkeypatch):
    """An eager call runs the kernel through the autograd.Function, not the custom op, whose dispatch costs more than
    the rest of the host path; a call that the op must see (traced, under a dispatch mode) takes the op."""
    op_calls = []
    monkeypatch.setattr(_ops, "fwd", lambda *args: op_calls.append(args) or _ops.forward_impl(*args))
    q, k, v = leaves(*make_qkv())
    out, _ = _ops.attention(q, k, v, *BATCHED, 0.25, -1, -1, 0.0, None, False, None)
    eager = fake_binding.path == "eager"
    assert len(op_calls) == (0 if eager else 1)
    if eager:
        assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
        with torch.no_grad():
            assert _ops.attention(q, k, v, *BATCHED, 0.25, -1, -1, 0.0, None, False, None)[0].grad_fn is None


def test_dispatch_mode_takes_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v = make_qkv()
    assert _ops._eager(q, k, v)
    with Passthrough():
        assert not _ops._eager(q, k, v)


# ---------------------------------------------------------------------------------------------------------------
# The varlen autograd wiring, with stand-ins registered under the custom ops

def test_varlen_backward_runs_bwd_on_saved_state(standin_ops):
    q, k, v = leaves(*make_varlen())
    cu_q, cu_k, used_q, slopes = int32(*CU_Q), int32(*CU_K), int32(1, 0, 3), torch.rand(4)
    out, lse = _ops.attention(q, k, v, cu_q, cu_k, used_q, None, 3, 4, 0.3, 2, 0, 1.5, slopes, True, "sm80")
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    (fwd_call,), (bwd_call,) = standin_ops["varlen_fwd"], standin_ops["varlen_bwd"]
    for name in ("q", "k", "v", "out", "lse"):
        assert torch.equal(bwd_call[name], fwd_call[name]), name
    assert torch.equal(bwd_call["dout"], dout) and bwd_call["dlse"] is None
    assert torch.equal(bwd_call["cu_seqlens_q"], cu_q) and torch.equal(bwd_call["cu_seqlens_k"], cu_k)
    assert torch.equal(bwd_call["seqused_q"], used_q) and bwd_call["seqused_k"] is None
    assert bwd_call["max_seqlen"] == (3, 4) and bwd_call["softmax_scale"] == 0.3 and bwd_call["window"] == (2, 0)
    assert bwd_call["softcap"] == 1.5 and torch.equal(bwd_call["alibi_slopes"], slopes)
    assert bwd_call["deterministic"] is True and bwd_call["tier"] == "sm80"
    assert torch.equal(dq, 2 * dout) and torch.equal(dk, 3 * k) and torch.equal(dv, 4 * v)


def test_varlen_no_gradient_for_sequence_tensors(standin_ops):
    """The backward returns None for cu_seqlens and seqused (integer tensors in real use; float stand-ins here, which
    could receive a gradient)."""
    q, k, v = leaves(*make_varlen())
    cu_q, cu_k, used_q, used_k = leaves(*(torch.tensor(x, dtype=torch.float32) for x in (CU_Q, CU_K, (2, 0, 3),
                                                                                         (3, 1, 3))))
    out, _ = _ops.attention(q, k, v, cu_q.int(), cu_k.int(), used_q.int(), used_k.int(), 3, 3, 0.25, -1, -1, 0.0,
                             None, False, None)
    out2, _ = _ops.attention(q, k, v, cu_q, cu_k, used_q, used_k, 3, 3, 0.25, -1, -1, 0.0, None, False, None)
    grads = torch.autograd.grad(out2.sum(), (q, cu_q, cu_k, used_q, used_k), allow_unused=True)
    assert grads[0] is not None and grads[1:] == (None,) * 4
    assert torch.equal(out, out2)


@pytest.mark.parametrize("loss", ["out+lse", "lse"])
def test_varlen_lse_gradient_reaches_bwd(standin_ops, loss):
    q, k, v = leaves(*make_varlen())
    out, lse, _ = call_varlen(q, k, v, return_attn_probs=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    if loss == "lse":
        torch.autograd.grad(lse, (q, k, v), dlse)
        dout = torch.zeros_like(out)
    else:
        torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    (call,) = standin_ops["varlen_bwd"]
    assert torch.equal(call["dlse"], dlse) and torch.equal(call["dout"], dout)


@pytest.mark.parametrize("d", [16, 13])
def test_varlen_grads_reach_inputs(standin_ops, d):
    q, k, v = leaves(*make_varlen(d=d))
    out = call_varlen(q, k, v, causal=True, softmax_scale=0.5, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    (call,) = standin_ops["varlen_bwd"]
    assert call["q"].shape[-1] == call["k"].shape[-1] == call["dout"].shape[-1] == 16
    assert torch.equal(call["dout"][..., :d], dout)
    assert call["softmax_scale"] == 0.5 and call["window"] == (-1, 0) and call["deterministic"] is True
    assert torch.equal(q.grad, 2 * dout) and torch.equal(k.grad, 3 * k) and torch.equal(v.grad, 4 * v)


def test_varlen_packed_grads_reach_inputs(standin_ops):
    qkv, kv, q = leaves(rand(5, 3, 4, 16), rand(7, 2, 2, 16), rand(5, 4, 16))
    out = flash_attn_varlen_qkvpacked_func(qkv, int32(0, 2, 5), 3, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _, k, v = qkv.detach().unbind(1)
    assert torch.equal(qkv.grad, torch.stack((2 * dout, 3 * k, 4 * v), dim=1))

    out = flash_attn_varlen_kvpacked_func(q, kv, int32(*CU_Q), int32(*CU_K), 3, 3)
    dout = torch.randn_like(out)
    out.backward(dout)
    k, v = kv.detach().unbind(1)
    assert torch.equal(q.grad, 2 * dout) and torch.equal(kv.grad, torch.stack((3 * k, 4 * v), dim=1))


@pytest.mark.parametrize("layout", ["varlen", "batched"])
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_opcheck(standin_ops, op, layout):
    """torch.library.opcheck: schema, fake (static and dynamic shapes) and autograd registration of the ops, with
    and without the sequence tensors."""
    if layout == "varlen":
        q, k, v = make_varlen(d=8)
        sequences = (int32(*CU_Q), int32(*CU_K), int32(1, 0, 3), None, 3, 3)
        slopes = torch.rand(3, 4)
    else:
        q, k, v = make_qkv(d=8)
        sequences, slopes = BATCHED, torch.rand(2, 4)
    options = (0.25, -1, 0, 0.0, slopes, False, None)
    if op == "fwd":
        args = (*leaves(q, k, v), *sequences, *options)
    else:
        out, lse = _ops.attention(q, k, v, *sequences, *options)
        args = (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), *sequences, *options)
    torch.library.opcheck(getattr(torch.ops.flash_attention, op).default, args)


def test_varlen_compile_traces_backward(standin_ops):
    """torch.compile(fullgraph=True) puts varlen_fwd in the forward graph and varlen_bwd in the backward graph, and
    gives eager's gradients."""
    graphs = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = [str(node.target) for node in gm.graph.nodes]
            return make_boxed_func(gm.forward)

        return compiler

    def fn(q, k, v, cu_q, cu_k, used_k):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, deterministic=True,
                                             return_attn_probs=True, seqused_k=used_k)
        return out.float().square().sum() + lse.clamp(min=-5).sum()

    inputs = (int32(*CU_Q), int32(*CU_K), int32(3, 0, 2))
    grads = {}
    for mode, f in (("eager", fn), ("compiled", None)):
        if f is None:
            torch._dynamo.reset()
            backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
            f = torch.compile(fn, fullgraph=True, backend=backend)
        torch.manual_seed(0)
        q, k, v = leaves(*make_varlen(d=13, dtype=bf16))
        grads[mode] = torch.autograd.grad(f(q, k, v, *inputs), (q, k, v))
    assert graphs["forward"].count("flash_attention.fwd.default") == 1
    assert graphs["backward"].count("flash_attention.bwd.default") == 1
    assert [call["deterministic"] for call in standin_ops["varlen_bwd"]] == [True, True]
    for c, e in zip(grads["compiled"], grads["eager"]):
        assert torch.equal(c, e)


def test_varlen_compile_max_seqlen_from_item(standin_ops, monkeypatch):
    """max_seqlen computed in the graph with .item() (as model code does) is a symbolic int that no check may
    specialize on: fullgraph with dynamic shapes runs, and two batches of different lengths reuse the graph."""
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)

    def fn(q, k, v, cu_q, cu_k):
        max_q, max_k = ((cu[1:] - cu[:-1]).max().item() for cu in (cu_q, cu_k))
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for total_q, cu_q in ((5, CU_Q), (6, (0, 3, 3, 6))):
        q, k, v = leaves(*make_varlen(total_q=total_q))
        out = compiled(q, k, v, int32(*cu_q), int32(*CU_K))
        out.backward(torch.ones_like(out))
        assert torch.equal(out, fn(q, k, v, int32(*cu_q), int32(*CU_K))) and torch.equal(q.grad, 2 * torch.ones_like(q))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# ---------------------------------------------------------------------------------------------------------------
# FLASH_ATTN_CHECK_VARLEN=1: the sequence tensors' values

CHECKED = "FLASH_ATTN_CHECK_VARLEN: "

MALFORMED = [
    ("cu_q-start", dict(cu_seqlens_q=int32(1, 2, 2, 5)), r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
    ("cu_k-decreasing", dict(cu_seqlens_k=int32(0, 4, 3, 7)),
     r"cu_seqlens_k must not decrease, got cu_seqlens_k\[2\] = 3 < cu_seqlens_k\[1\] = 4"),
    ("cu_q-past-total", dict(cu_seqlens_q=int32(0, 2, 2, 6)),
     r"cu_seqlens_q must end at total_q = 5 \(or before it when seqused_q is given\), got cu_seqlens_q\[-1\] = 6"),
    ("cu_k-short", dict(cu_seqlens_k=int32(0, 3, 4, 6)), r"cu_seqlens_k must end at total_k = 7"),
    ("cu_q-short-past-seqused", dict(cu_seqlens_q=int32(0, 2, 2, 4), seqused_q=int32(2, 0, 3)),
     r"seqused_q\[2\] = 3 must be between 0 and the length of sequence 2 in cu_seqlens_q, 2"),
    ("seqused_k-negative", dict(seqused_k=int32(1, -1, 0)), r"seqused_k\[1\] = -1 must be between 0 and"),
    ("seqused_q-too-long", dict(seqused_q=int32(3, 0, 3)),
     r"seqused_q\[0\] = 3 must be between 0 and the length of sequence 0 in cu_seqlens_q, 2"),
    ("max_seqlen_q-short", dict(max_seqlen_q=2),
     r"max_seqlen_q = 2 is less than the length of sequence 2, 3; it must be at least every sequence's length"),
    ("max_seqlen_k-short", dict(max_seqlen_k=0), r"max_seqlen_k = 0 is less than the length of sequence 0, 3"),
]


@pytest.mark.parametrize("kwargs, match", [pytest.param(*c[1:], id=c[0]) for c in MALFORMED])
def test_check_varlen_catches(stub_kernel, monkeypatch, kwargs, match):
    monkeypatch.setenv("FLASH_ATTN_CHECK_VARLEN", "1")
    with pytest.raises(ValueError, match=CHECKED + match):
        call_varlen(**kwargs)
    assert not stub_kernel
    monkeypatch.setenv("FLASH_ATTN_CHECK_VARLEN", "0")
    call_varlen(**kwargs)  # off: metadata checks only, the op runs
    assert len(stub_kernel) == 1


@pytest.mark.parametrize("kwargs", [
    pytest.param({}, id="plain"),
    pytest.param(dict(seqused_q=int32(2, 0, 0), seqused_k=int32(0, 1, 3), max_seqlen_q=2), id="seqused-bounds-max"),
    pytest.param(dict(cu_seqlens_q=int32(0, 2, 2, 4), seqused_q=int32(2, 0, 2)), id="tail-row-with-seqused"),
    pytest.param(dict(cu_seqlens_q=int32(0), cu_seqlens_k=int32(0), max_seqlen_q=0, max_seqlen_k=0,
                      q=rand(0, 4, 16), k=rand(0, 2, 16), v=rand(0, 2, 16)), id="empty"),
])
def test_check_varlen_accepts_wellformed(stub_kernel, monkeypatch, kwargs):
    monkeypatch.setenv("FLASH_ATTN_CHECK_VARLEN", "1")
    call_varlen(**kwargs)
    assert len(stub_kernel) == 1


# ---------------------------------------------------------------------------------------------------------------
# flash_attention.cute: FlashAttention-4's API

# FA4's signatures (flash_attn/cute/interface.py, fa4-v4.0.0.beta27): names in order, with their defaults.
FA4_FUNC = [("q", None), ("k", None), ("v", None), ("qv", None), ("gather_kv_indices", None),
            ("softmax_scale", None), ("causal", False), ("window_size", (None, None)), ("learnable_sink", None),
            ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None), ("deterministic", False), ("score_mod", None),
            ("score_mod_bwd", None), ("mask_mod", None), ("aux_tensors", None), ("aux_scalars", None),
            ("block_sparse_tensors", None), ("block_sparse_tensors_bwd", None), ("return_lse", False)]
FA4_VARLEN = [("q", None), ("k", None), ("v", None), ("qv", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
              ("max_seqlen_q", None), ("max_seqlen_k", None), ("min_seqlen_k", None), ("seqused_q", None),
              ("seqused_k", None), ("gather_kv_indices", None), ("page_table", None), ("softmax_scale", None),
              ("causal", False), ("window_size", (None, None)), ("learnable_sink", None), ("softcap", 0.0),
              ("num_splits", 1), ("pack_gqa", None), ("deterministic", False), ("score_mod", None),
              ("score_mod_bwd", None), ("mask_mod", None), ("block_sparse_tensors", None), ("aux_tensors", None),
              ("aux_scalars", None), ("return_lse", False), ("scheduler_metadata", None),
              ("seqlen_k_per_split", None), ("disable_scheduler_metadata", False)]


@pytest.mark.parametrize("fn, expected", [(cute.flash_attn_func, FA4_FUNC), (cute.flash_attn_varlen_func, FA4_VARLEN)],
                         ids=["func", "varlen"])
def test_cute_signature_is_fa4s(fn, expected):
    params = list(inspect.signature(fn).parameters.values())
    positional = [(p.name, None if p.default is p.empty else p.default) for p in params
                  if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == expected
    others = [(p.name, p.kind, p.default) for p in params if p.kind is not p.POSITIONAL_OR_KEYWORD]
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    assert others == [("dropout_p", keyword_only, 0.0), ("tier", keyword_only, None)]


@pytest.mark.parametrize(
    "window, causal, expected",
    [
        ((None, None), False, (-1, -1)),
        ((None, None), True, (-1, 0)),
        ((None, 0), False, (-1, 0)),  # FA4's other spelling of causal
        ((3, None), False, (3, -1)),
        ((3, 2), False, (3, 2)),
        ((3, 2), True, (3, 0)),
        ((None, 3), True, (-1, 0)),
        ((0, 0), False, (0, 0)),
        ((-1, -1), False, (-1, -1)),  # flash-attn 2's "no window": FA4 drops a pair that sums below 0
        ((-1, -1), True, (-1, 0)),
        ((-1, 0), False, (-1, -1)),  # sums below 0 too: no window in FA4 (flash-attn 2 would make it causal)
        ((-5, 3), True, (-1, 0)),  # causal makes it (-5, 0): dropped, causal stays
        ((np.int64(2), torch.tensor(1)), False, (2, 1)),
        ([4, None], False, (4, -1)),
    ],
    ids=lambda x: str(x).replace(" ", ""),
)
def test_cute_window(stub_kernel, window, causal, expected):
    q, k, v = make_qkv(sq=6, sk=9)  # normalization drops left >= 8 and right >= 5: none of these bounds
    out, lse = cute.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    (call_args,) = stub_kernel
    assert call_args["window"] == expected
    ref_out, ref_lse = attention_ref(q, k, v, window_size=expected)
    torch.testing.assert_close(out, ref_out.to(fp16))
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("window, causal, match", [
    ((-3, 5), False, r"window_size\[0\] = -3 is not supported: a negative bound"),
    ((None, -1), False, r"window_size\[1\] = -1 is not supported"),
    ((2, -1), False, r"window_size\[1\] = -1 is not supported"),
], ids=["left-3", "right-1", "2,-1"])
def test_cute_negative_window_bound(stub_kernel, window, causal, match):
    for call in (lambda: cute.flash_attn_func(*make_qkv(), causal=causal, window_size=window),
                 lambda: cute.flash_attn_varlen_func(*make_varlen(), cu_seqlens_q=int32(*CU_Q),
                                                     cu_seqlens_k=int32(*CU_K), window_size=window)):
        with pytest.raises(NotImplementedError, match=match):
            call()
    assert not stub_kernel


@pytest.mark.parametrize("window", [(1.5, None), 4, (None,), (None, None, None), (True, None)], ids=str)
def test_cute_window_not_a_pair(window):
    with pytest.raises(ValueError, match=r"window_size must be a pair of integers or None \(None = unbounded\)"):
        cute.flash_attn_func(*make_qkv(), window_size=window)


def test_cute_returns_out_and_lse(stub_kernel):
    """(out, lse) as FA4 returns it: lse (batch, nheads, seqlen_q) when asked for, None otherwise; and, when an
    input requires grad (FA4 computes lse for the backward then), lse without a gradient."""
    q, k, v = make_qkv()
    out, lse = cute.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True)) and lse is None
    out, lse = cute.flash_attn_func(q, k, v, causal=True, return_lse=True)
    expected_out, expected_lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse) and lse.shape == (2, 4, 5)
    k.requires_grad_()
    _, lse = cute.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(lse, expected_lse) and not lse.requires_grad
    _, lse = cute.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert lse.requires_grad


def test_cute_lse_gradient_only_when_returned(standin_ops):
    q, k, v = leaves(*make_qkv())
    out, lse = cute.flash_attn_func(q, k, v, return_lse=True)
    torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.ones_like(lse)))
    out, lse = cute.flash_attn_func(q, k, v)
    assert not lse.requires_grad
    out.sum().backward()
    with_lse, without_lse = standin_ops["bwd"]
    assert torch.equal(with_lse["dlse"], torch.ones(2, 4, 5)) and without_lse["dlse"] is None


UNSUPPORTED = {"qv": rand(2, 5, 4, 16), "gather_kv_indices": torch.zeros(2, 5, 3, dtype=torch.int32),
               "learnable_sink": torch.zeros(4), "score_mod": lambda *a: a[0], "score_mod_bwd": lambda *a: a[0],
               "mask_mod": lambda *a: True, "aux_tensors": [torch.zeros(1)], "aux_scalars": (1.0,),
               "block_sparse_tensors": object(), "block_sparse_tensors_bwd": object(),
               "page_table": torch.zeros(3, 1, dtype=torch.int32)}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_cute_unsupported_feature(stub_kernel, name):
    calls = {"func": lambda **kw: cute.flash_attn_func(*make_qkv(), **kw),
             "varlen": lambda **kw: cute.flash_attn_varlen_func(*make_varlen(), cu_seqlens_q=int32(*CU_Q),
                                                                cu_seqlens_k=int32(*CU_K), **kw)}
    takes = [fn for fn, params in (("func", FA4_FUNC), ("varlen", FA4_VARLEN)) if name in dict(params)]
    assert takes
    for fn in takes:
        with pytest.raises(NotImplementedError, match=rf"flash_attention\.cute: {name} is not supported .* None"):
            calls[fn](**{name: UNSUPPORTED[name]})
    assert not stub_kernel


def test_cute_accepts_no_op_values(stub_kernel):
    """FA4's default-like values of the unsupported features, and its performance hints, change nothing."""
    q, k, v = make_qkv()
    expected, _ = cute.flash_attn_func(q, k, v, causal=True)
    out, _ = cute.flash_attn_func(q, k, v, None, None, None, True, (None, None), None, 0.0, 4, True, False, None,
                                  None, None, [], (), None, None, False)
    assert torch.equal(out, expected)
    qp, kp, vp = make_varlen()
    cu = dict(cu_seqlens_q=int32(*CU_Q), cu_seqlens_k=int32(*CU_K))
    expected, _ = cute.flash_attn_varlen_func(qp, kp, vp, **cu)
    out, _ = cute.flash_attn_varlen_func(qp, kp, vp, min_seqlen_k=1, num_splits=3, pack_gqa=False,
                                         scheduler_metadata=object(), seqlen_k_per_split=64,
                                         disable_scheduler_metadata=True, aux_tensors=[], **cu)
    assert torch.equal(out, expected)


def test_cute_positional_arguments(stub_kernel):
    q, k, v = make_qkv()
    cute.flash_attn_func(q, k, v, None, None, 0.5, True, (None, None), None, 2.0, 1, None, True)
    (call_args,) = stub_kernel
    assert call_args["softmax_scale"] == 0.5 and call_args["window"] == (-1, 0) and call_args["deterministic"] is True
    qp, kp, vp = make_varlen()
    cute.flash_attn_varlen_func(qp, kp, vp, None, int32(*CU_Q), int32(*CU_K), 2, 3, None, int32(1, 0, 2), None,
                                None, None, 0.5, True)
    call_args = stub_kernel[1]
    assert call_args["max_seqlen"] == (2, 3) and torch.equal(call_args["seqused_q"], int32(1, 0, 2))
    assert call_args["softmax_scale"] == 0.5 and call_args["window"] == (-1, 0)


def test_cute_varlen_matches_flash_attn_varlen_func(stub_kernel):
    q, k, v = make_varlen()
    cu_q, cu_k, used_k = int32(*CU_Q), int32(*CU_K), int32(3, 0, 2)
    out, lse = cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k,
                                           causal=True, return_lse=True)
    expected_out, expected_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=True, seqused_k=used_k,
                                                           return_attn_probs=True)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse) and lse.shape == (4, 5)
    assert stub_kernel[0]["max_seqlen"] == (5, 7)  # no max_seqlen given: the totals, an upper bound


def test_cute_varlen_without_sequences_is_batched(stub_kernel):
    q, k, v = make_qkv()
    out, lse = cute.flash_attn_varlen_func(q, k, v, causal=True, return_lse=True)
    expected_out, expected_lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert all(call["cu_seqlens_q"] is None for call in stub_kernel)


@pytest.mark.parametrize("layout", ["q-batched", "k-batched", "both-batched"])
def test_cute_varlen_batched_side(stub_kernel, layout):
    """As FA4 allows, a side without cu_seqlens is batched, (batch, seqlen, ...): it runs as batch sequences of
    seqlen rows, and a batched q gets out (batch, seqlen_q, ...) and lse (batch, nheads, seqlen_q) back."""
    qb, kb, vb = make_qkv(b=3, sq=2, sk=3)
    qp, kp, vp = make_varlen()
    batched_q, batched_k = layout in ("q-batched", "both-batched"), layout in ("k-batched", "both-batched")
    q = qb if batched_q else qp
    k, v = (kb, vb) if batched_k else (kp, vp)
    cu_q = None if batched_q else int32(*CU_Q)
    cu_k = None if batched_k else int32(*CU_K)
    used_q, used_k = int32(1, 0, 2), int32(3, 1, 2)
    out, lse = cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q,
                                           seqused_k=used_k, causal=True, return_lse=True)
    (call_args,) = stub_kernel
    expected_cu_q = int32(0, 2, 4, 6) if batched_q else int32(*CU_Q)
    expected_cu_k = int32(0, 3, 6, 9) if batched_k else int32(*CU_K)
    assert torch.equal(call_args["cu_seqlens_q"], expected_cu_q)
    assert torch.equal(call_args["cu_seqlens_k"], expected_cu_k)
    assert call_args["max_seqlen"] == (2 if batched_q else 5, 3 if batched_k else 7)
    flat = [x.flatten(0, 1) if x.dim() == 4 else x for x in (q, k, v)]
    ref_out, ref_lse = varlen_ref(*flat, expected_cu_q, expected_cu_k, used_q, used_k, causal=True)
    if batched_q:
        ref_out, ref_lse = ref_out.view(3, 2, 4, 16), ref_lse.view(4, 3, 2).transpose(0, 1)
    assert out.shape == q.shape and lse.shape == ((3, 4, 2) if batched_q else (4, 5))
    torch.testing.assert_close(out, ref_out.to(fp16))
    torch.testing.assert_close(lse, ref_lse)


def test_cute_varlen_batched_side_errors(stub_kernel):
    qb, kb, vb = make_qkv(b=2, sq=2, sk=3)
    with pytest.raises(ValueError, match=r"q and k must hold the same number of sequences, got q\.shape\[0\] = 2 and "
                                         r"len\(cu_seqlens_k\) - 1 = 3"):
        cute.flash_attn_varlen_func(qb, *make_varlen()[1:], cu_seqlens_k=int32(*CU_K))
    with pytest.raises(ValueError, match=r"q and k must hold the same number of sequences, got q\.shape\[0\] = 2 and "
                                         r"k\.shape\[0\] = 3"):
        cute.flash_attn_varlen_func(qb, *make_qkv(b=3)[1:], seqused_q=int32(1, 1))
    with pytest.raises(ValueError, match=r"q must have rank 4, \(batch, seqlen, nheads, head_dim\), when "
                                         r"cu_seqlens_q is None, got shape \(5, 4, 16\)"):
        cute.flash_attn_varlen_func(make_varlen()[0], kb, vb, seqused_k=int32(1, 1))
    with pytest.raises(ValueError, match=r"v must have rank 4, .* when cu_seqlens_k is None"):
        cute.flash_attn_varlen_func(qb, kb, vb[0], seqused_k=int32(1, 1))
    assert not stub_kernel


def test_cute_varlen_grads_of_batched_q(standin_ops):
    """The flattening of a batched side stays on the autograd graph."""
    q, k, v = leaves(*make_qkv(b=2, sq=3, sk=4))
    out, lse = cute.flash_attn_varlen_func(q, k, v, seqused_k=int32(4, 2), return_lse=True)
    dout = torch.randn_like(out)
    torch.autograd.grad((out, lse), (q, k, v), (dout, torch.ones_like(lse)))
    q.grad, k.grad, v.grad = None, None, None
    out, _ = cute.flash_attn_varlen_func(q, k, v, seqused_k=int32(4, 2))
    out.backward(dout)
    first, second = standin_ops["varlen_bwd"]
    assert torch.equal(first["dlse"], torch.ones(4, 6)) and second["dlse"] is None
    assert torch.equal(q.grad, 2 * dout) and torch.equal(k.grad, 3 * k) and torch.equal(v.grad, 4 * v)


# ---------------------------------------------------------------------------------------------------------------
# Missing extension

def test_package_imports():
    assert flash_attention.__version__ == "0.1.0"
    assert callable(flash_attention.flash_attn_func)


def test_missing_extension(no_extension, monkeypatch):
    missing = r"CUDA extension flash_attention\._C is missing.*FLASH_ATTN_SKIP_CUDA_BUILD"
    with pytest.raises(RuntimeError, match=missing):
        _dispatch.load_extension()
    assert not _dispatch.extension_available()
    q, k, v = make_qkv()
    with pytest.raises(RuntimeError, match=r"CUDA extension .* is missing"):
        _ops.attention(q, k, v, *BATCHED, 0.25, -1, -1, 0.0, None, False, None)
    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    with pytest.raises(RuntimeError, match=r"CUDA extension .* is missing"):
        flash_attn_func(q, k, v)


# ---------------------------------------------------------------------------------------------------------------
# The reference

def test_attention_mask_patterns():
    def mask(rows):
        return torch.tensor(rows, dtype=torch.bool)

    assert torch.equal(attention_mask(2, 4, causal=True), mask([[1, 1, 1, 0], [1, 1, 1, 1]]))
    assert torch.equal(attention_mask(4, 2, causal=True), mask([[0, 0], [0, 0], [1, 0], [1, 1]]))
    assert torch.equal(attention_mask(3, 3, window_size=(0, 0)), torch.eye(3, dtype=torch.bool))
    assert torch.equal(attention_mask(4, 4, window_size=(1, 0)),
                       mask([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]))
    assert torch.equal(attention_mask(3, 5, window_size=(-1, 1)),
                       mask([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    assert torch.equal(attention_mask(2, 5, window_size=(1, -1)), mask([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]))
    # causal overrides the right bound only
    assert torch.equal(attention_mask(3, 3, causal=True, window_size=(1, 5)), attention_mask(3, 3, window_size=(1, 0)))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(7, 7), (5, 9), (9, 5)], ids=lambda x: str(x))
@pytest.mark.parametrize("h, hk", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_reference_matches_sdpa(causal, sq, sk, h, hk):
    q, k, v = (torch.randn(2, s, n, 24) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    # SDPA's is_causal is aligned top-left; build the bottom-right mask independently with tril.
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=hk != h
    ).transpose(1, 2)
    out, _ = attention_ref(q, k, v, causal=causal)
    if causal and sq > sk:  # rows that see no key: SDPA gives NaN, the package gives 0
        visible = mask.any(dim=1)
        assert not out[:, ~visible].any()
        out, expected = out[:, visible], expected[:, visible]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_hand_computed():
    # One query, two keys: scores 1 and 0 at scale 1.
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 2, 1, 2)
    e = math.e
    out, lse = attention_ref(q, k, v, softmax_scale=1.0)
    p0, p1 = e / (e + 1), 1 / (e + 1)
    torch.testing.assert_close(out.flatten(), torch.tensor([p0 * 1 + p1 * 3, p0 * 2 + p1 * 4]))
    torch.testing.assert_close(lse.flatten(), torch.tensor([math.log(e + 1)]))

    # softcap 0.5: scores become 0.5 * tanh(2) and 0.
    s0 = 0.5 * math.tanh(2.0)
    out, lse = attention_ref(q, k, v, softmax_scale=1.0, softcap=0.5)
    torch.testing.assert_close(lse.flatten(), torch.tensor([math.log(math.exp(s0) + 1)]))

    # ALiBi slope 0.5, sq=1, sk=2: the query sits at key 1, so key 0 is 1 away: scores 1 - 0.5 and 0.
    out, lse = attention_ref(q, k, v, softmax_scale=1.0, alibi_slopes=torch.tensor([0.5]))
    torch.testing.assert_close(lse.flatten(), torch.tensor([math.log(math.exp(0.5) + 1)]))

    # causal with sq=1 sees every key; window (0, 0) sees only key 1.
    out, lse = attention_ref(q, k, v, softmax_scale=1.0, window_size=(0, 0))
    torch.testing.assert_close(out.flatten(), torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(lse.flatten(), torch.tensor([0.0]))


def test_reference_alibi_shapes_agree():
    q, k, v = (torch.randn(2, 6, 4, 8) for _ in range(3))
    slopes = torch.rand(4)
    out_h, lse_h = attention_ref(q, k, v, alibi_slopes=slopes)
    out_bh, lse_bh = attention_ref(q, k, v, alibi_slopes=slopes.expand(2, 4))
    assert torch.equal(out_h, out_bh) and torch.equal(lse_h, lse_bh)


@pytest.mark.parametrize("upcast", [True, False], ids=["fp32", "bf16"])
def test_reference_fully_masked_rows(upcast):
    q, k, v = make_qkv(b=1, sq=4, sk=2, h=2, hk=2, d=8, dtype=bf16)
    out, lse = attention_ref(q, k, v, causal=True, upcast=upcast)
    assert out.dtype == (torch.float32 if upcast else bf16) and lse.dtype == torch.float32
    assert not out[:, :2].any() and (lse[:, :, :2] == float("-inf")).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 2:]).all()


@pytest.mark.parametrize("upcast", [True, False], ids=["fp32", "bf16"])
def test_reference_grads_of_fully_masked_rows(upcast):
    """The GPU tests measure gradients against the reference's: a row that sees no key must give finite gradients,
    and dq 0, in either precision, though softmax of its all -inf scores is NaN before it is masked."""
    q, k, v = leaves(*(t.float() if upcast else t for t in make_qkv(b=1, sq=4, sk=2, h=2, hk=1, d=8, dtype=bf16)))
    out, lse = attention_ref(q, k, v, causal=True, softcap=2.0, alibi_slopes=torch.rand(2), upcast=upcast)
    dlse = torch.randn_like(lse).masked_fill(lse == float("-inf"), 0.0)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), dlse))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert not dq[:, :2].any() and dk.any() and dv.any()


def test_reference_low_precision_is_close():
    q, k, v = make_qkv(sq=33, sk=47, d=32, dtype=bf16)
    slopes = torch.rand(4)
    out16, lse16 = attention_ref(q, k, v, causal=True, softcap=5.0, alibi_slopes=slopes, upcast=False)
    out32, lse32 = attention_ref(q, k, v, causal=True, softcap=5.0, alibi_slopes=slopes)
    assert out16.dtype == bf16
    torch.testing.assert_close(out16.float(), out32, atol=3e-2, rtol=0)
    torch.testing.assert_close(lse16, lse32, atol=3e-2, rtol=0)
