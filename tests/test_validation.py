"""Inputs that the API rejects before any kernel runs, with the exception and message each gets: the batched and
packed functions', the varlen functions' (q, k, v of rank 3, the sequence tensors, max_seqlen), and the values of the
sequence tensors that FLASH_ATTN_CHECK_VARLEN=1 checks (and lets through when off)."""

import pytest
import torch

from cpu_helpers import CU_K, CU_Q, call, call_varlen, int32, make_qkv, make_varlen, rand
from flash_attention import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                             flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from helpers import bf16, fp16


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
    ("block_table-1d", lambda: flash_attn_varlen_func(*make_varlen(), int32(*CU_Q), int32(*CU_K), 3, 3, 0.0, None,
                                                      False, (-1, -1), 0.0, None, False, False, int32(0, 1)),
     ValueError, r"block_table must be an int32 tensor of shape \(3, max_blocks\)"),
    ("block_table-unpaged-k", lambda: flash_attn_varlen_func(*make_varlen(), int32(*CU_Q), int32(*CU_K), 3, 3,
                                                             block_table=torch.zeros(3, 2, dtype=torch.int32)),
     ValueError, r"with block_table, k must be a paged cache \(num_blocks, page_size, nheads_k, head_dim\)"),
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
