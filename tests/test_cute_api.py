"""flash_attention.cute, FlashAttention-4's API, on CPU with the kernel replaced by the reference (stub_kernel) or
stand-ins under the custom ops (standin_ops): signatures as FA4's, window_size in FA4's spelling, (out, lse) as FA4
returns it, unsupported features rejected unless given no-op values, and the varlen function's batched sides."""

import inspect
import math

import numpy as np
import pytest
import torch

from cpu_helpers import CU_K, CU_Q, int32, leaves, make_qkv, make_varlen, rand, varlen_ref
from flash_attention import cute, flash_attn_func, flash_attn_varlen_func
from helpers import fp16, require_kernel
from reference import attention_ref


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
               "block_sparse_tensors": object(), "block_sparse_tensors_bwd": object()}


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


FA4_COMBINE = [("out_partial", None), ("lse_partial", None), ("out", None), ("out_dtype", None), ("cu_seqlens", None),
               ("seqused", None), ("varlen_batch_idx", None), ("return_lse", True)]


def test_combine_signature():
    params = inspect.signature(cute.flash_attn_combine).parameters.values()
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params] == FA4_COMBINE


def split_partials(q, k, v, bounds):
    """The reference's (out, lse) over each key range in bounds, stacked as flash_attn_combine takes them:
    (splits, b, sq, h, d) and (splits, b, sq, h)."""
    outs, lses = [], []
    for lo, hi in bounds:
        out, lse = attention_ref(q, k[:, lo:hi], v[:, lo:hi])
        outs.append(out.float())
        lses.append(lse.transpose(1, 2))
    return torch.stack(outs), torch.stack(lses)


def test_combine_equals_attention_over_all_keys():
    """Splitting the keys, then combining the splits' outputs by their lse, gives the attention over all keys."""
    q = torch.randn(2, 5, 4, 32)
    k, v = torch.randn(2, 50, 4, 32), torch.randn(2, 50, 4, 32)
    out_partial, lse_partial = split_partials(q, k, v, [(0, 7), (7, 31), (31, 50)])
    out, lse = cute.flash_attn_combine(out_partial, lse_partial)
    ref_out, ref_lse = attention_ref(q, k, v)
    assert out.shape == ref_out.shape and out.dtype == torch.float32 and lse.shape == (2, 5, 4)
    assert lse.stride() == lse.transpose(1, 2).contiguous().transpose(1, 2).stride()  # (b, h, s) storage, as FA4's
    assert torch.allclose(out, ref_out.float(), atol=1e-5) and torch.allclose(lse, ref_lse.transpose(1, 2), atol=1e-5)
    # Packed rows (num_splits, total_q, nheads, head_dim), into a given out of another dtype.
    dest = torch.empty(10, 4, 32, dtype=torch.bfloat16)
    packed, packed_lse = cute.flash_attn_combine(out_partial.flatten(1, 2), lse_partial.flatten(1, 2), out=dest)
    assert packed is dest and torch.allclose(packed.float(), ref_out.float().flatten(0, 1), atol=2e-2)
    assert torch.allclose(packed_lse, ref_lse.transpose(1, 2).flatten(0, 1), atol=1e-5)


def test_combine_splits_without_keys():
    """A split that saw no key (lse -inf, any output) weighs nothing; rows whose splits all saw none get out 0 and
    lse -inf, not NaN."""
    out_partial = torch.randn(3, 1, 2, 1, 8)
    lse_partial = torch.tensor([[-1.0, float("-inf")], [float("-inf"), float("-inf")], [0.5, float("-inf")]])
    lse_partial = lse_partial.view(3, 1, 2, 1)
    out, lse = cute.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float16)
    w = torch.softmax(torch.tensor([-1.0, 0.5]), 0)
    expected_row0 = w[0] * out_partial[0, 0, 0, 0] + w[1] * out_partial[2, 0, 0, 0]
    assert out.dtype == torch.float16 and torch.allclose(out[0, 0, 0].float(), expected_row0, atol=1e-2)
    assert torch.equal(out[0, 1, 0], torch.zeros(8, dtype=torch.float16))
    assert torch.isclose(lse[0, 0, 0], torch.logsumexp(torch.tensor([-1.0, 0.5]), 0)) and lse[0, 1, 0] == -math.inf
    _, none = cute.flash_attn_combine(out_partial, lse_partial, return_lse=False)
    assert none is None


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 72, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, fp16], ids=["bf16", "fp16"])
def test_combine_kernel_cuda(d, dtype):
    """The combine kernel (16-bit partials on a GPU) against the PyTorch ops (asked for fp32 output, which the kernel
    does not serve): strided partials as the decode path passes them, empty splits, a row with none, a NaN split, and
    the packed (splits, total_q, nheads, head_dim) form."""
    require_kernel(d, dtype, "combine")
    splits, b, sq, h = 5, 3, 7, 4
    out_partial = torch.randn(b, splits, sq, h, d, dtype=dtype, device="cuda").transpose(0, 1)
    lse_partial = torch.randn(splits, b, sq, h, device="cuda") * 3
    lse_partial[1, 0] = -math.inf
    lse_partial[:, 1, 2] = -math.inf  # a row whose splits all saw no key
    lse_partial[3, 2, 5, 1] = math.nan
    out, lse = cute.flash_attn_combine(out_partial, lse_partial)
    ref_out, ref_lse = cute.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float32)
    assert out.dtype == dtype and out.shape == (b, sq, h, d) and lse.shape == (b, sq, h)
    nan_row = torch.zeros(b, sq, h, dtype=torch.bool, device="cuda")
    nan_row[2, 5, 1] = True
    assert out[nan_row].isnan().all() and lse[nan_row].isnan().all() and not out[~nan_row].isnan().any()
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2])) and lse[1, 2].isneginf().all()
    rounding = torch.finfo(dtype).eps * ref_out[~nan_row].abs().max()
    assert (out[~nan_row].float() - ref_out[~nan_row]).abs().max() <= rounding
    finite = ~nan_row & lse.isfinite()
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
    # Into a given strided out (as the decode path passes its GQA-packed result).
    dest = torch.empty(b, h, sq, d, dtype=dtype, device="cuda").transpose(1, 2)
    written, _ = cute.flash_attn_combine(out_partial, lse_partial, out=dest)
    assert written is dest
    torch.testing.assert_close(dest, out, rtol=0, atol=0, equal_nan=True)
    packed, packed_lse = cute.flash_attn_combine(out_partial.flatten(1, 2), lse_partial.flatten(1, 2))
    torch.testing.assert_close(packed, out.flatten(0, 1), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(packed_lse, lse.flatten(0, 1), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bad", ["rank", "lse-shape"])
def test_combine_bad_inputs(bad):
    out_partial = torch.randn(2, 3, 4, 8) if bad != "rank" else torch.randn(3, 4, 8)
    lse_partial = torch.randn(2, 3, 4) if bad != "lse-shape" else torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="out_partial" if bad == "rank" else "lse_partial"):
        cute.flash_attn_combine(out_partial, lse_partial)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("packed_q", [False, True], ids=["batched-q", "packed-q"])
def test_page_table_matches_batched_keys(stub_kernel, page_size, packed_q):
    """page_table (FA4's paged keys and values, lengths from seqused_k) gives the call on the same keys batched."""
    torch.manual_seed(page_size)
    b, slot, hk, d = 3, 32, 2, 16
    k, v = rand(b, slot, hk, d), rand(b, slot, hk, d)
    used = int32(5, 0, 32)
    pool_k, pool_v = rand(b * slot // page_size + 2, page_size, hk, d), rand(b * slot // page_size + 2, page_size, hk, d)
    order = torch.randperm(pool_k.shape[0])[: b * slot // page_size]
    table = order.view(b, slot // page_size).to(torch.int32)
    pool_k[order] = k.reshape(-1, page_size, hk, d)
    pool_v[order] = v.reshape(-1, page_size, hk, d)
    if packed_q:
        q, seq_q = rand(6, 4, d), dict(cu_seqlens_q=int32(0, 2, 3, 6), max_seqlen_q=3)
    else:
        q, seq_q = rand(b, 2, 4, d), {}
    expected = cute.flash_attn_varlen_func(q, k, v, seqused_k=used, causal=True, return_lse=True, **seq_q)
    got = cute.flash_attn_varlen_func(q, pool_k, pool_v, page_table=table, seqused_k=used, causal=True,
                                      return_lse=True, **seq_q)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [3, 16])
def test_page_table_gathers_used_rows_cuda(monkeypatch, page_size):
    """On the GPU, page_table's pages go through the gather kernel (each sequence's first seqused_k rows only): NaN in
    every pool row past them and in the allocator's blocks where the copies land, and the call still gives the
    batched keys' bits."""
    from flash_attention import _ops
    from helpers import poison_blocks
    require_kernel(64, torch.bfloat16)
    require_kernel(64, torch.bfloat16, "gather")
    torch.manual_seed(page_size)
    b, slot, h, hk, d = 3, 96, 4, 2, 64
    k, v = (torch.randn(b, slot, hk, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    used = torch.tensor([50, 0, 96], dtype=torch.int32, device="cuda")
    pages = b * slot // page_size
    order = torch.randperm(pages + 2, device="cuda")[:pages]
    table = order.view(b, slot // page_size).to(torch.int32)
    pool_k, pool_v = (torch.full((pages + 2, page_size, hk, d), float("nan"), dtype=torch.bfloat16, device="cuda")
                      for _ in range(2))
    rows = torch.arange(slot, device="cuda")
    for i in range(b):
        keep = rows < used[i]
        pool_k[table[i].long()[rows[keep] // page_size], rows[keep] % page_size] = k[i, keep]
        pool_v[table[i].long()[rows[keep] // page_size], rows[keep] % page_size] = v[i, keep]
    q = torch.randn(b, 2, h, d, dtype=torch.bfloat16, device="cuda")
    expected = cute.flash_attn_varlen_func(q, k, v, seqused_k=used, causal=True, return_lse=True)
    calls = []
    gather = _ops.gather_pages
    monkeypatch.setattr(_ops, "gather_pages", lambda *args: calls.append(1) or gather(*args))
    poison_blocks([(b, slot, hk, d)] * 2, (2,))
    got = cute.flash_attn_varlen_func(q, pool_k, pool_v, page_table=table, seqused_k=used, causal=True,
                                      return_lse=True)
    assert calls
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("seqused_k, error, message", [
    (torch.tensor([5, 0, 32]), TypeError, r"seqused_k must be torch\.int32, got torch\.int64"),
    (int32(5, 0), ValueError, r"seqused_k must have length batch = q\.shape\[0\] = 3, got 2")])
def test_page_table_checks_seqused_k_before_the_gather(stub_kernel, seqused_k, error, message):
    """page_table's lengths are checked before the pages are gathered by them, with the varlen checks' messages."""
    pool = rand(8, 16, 2, 16)
    table = torch.arange(6, dtype=torch.int32).view(3, 2)
    with pytest.raises(error, match=message):
        cute.flash_attn_varlen_func(rand(3, 2, 4, 16), pool, pool, page_table=table, seqused_k=seqused_k)
    assert not stub_kernel


def test_page_table_rejects_cu_seqlens_k(stub_kernel):
    with pytest.raises(ValueError, match="page_table cannot be used with cu_seqlens_k"):
        cute.flash_attn_varlen_func(rand(5, 4, 16), rand(4, 8, 2, 16), rand(4, 8, 2, 16), cu_seqlens_q=int32(*CU_Q),
                                    cu_seqlens_k=int32(*CU_K), page_table=torch.zeros(3, 1, dtype=torch.int32))
