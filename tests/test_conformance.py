"""Calls that flash-attn 2 and FlashAttention-4 accept, and the errors for bad input, on CPU with the kernels replaced
by the reference (conftest.py's stub_kernel)."""

import numpy as np
import pytest
import torch

from cpu_helpers import CU_K, CU_Q, call, call_varlen, int32, make_qkv, make_varlen, rand
from flash_attention import (cute, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                             flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)

pytest_plugins = ["pytester"]

# ---------------------------------------------------------------------------------------------------------------
# window_size as flash-attn 2's tests pass it: torch.randint(0, seqlen_k, (2,))

WINDOW_CALLS = {
    "func": lambda w: call(window_size=w),
    "kvpacked": lambda w: flash_attn_kvpacked_func(rand(2, 5, 4, 16), rand(2, 7, 2, 2, 16), window_size=w),
    "qkvpacked": lambda w: flash_attn_qkvpacked_func(rand(2, 7, 3, 4, 16), window_size=w),
    "varlen": lambda w: call_varlen(window_size=w),
    "varlen-kvpacked": lambda w: flash_attn_varlen_kvpacked_func(rand(5, 4, 16), rand(7, 2, 2, 16), int32(*CU_Q),
                                                                 int32(*CU_K), 3, 3, window_size=w),
    "varlen-qkvpacked": lambda w: flash_attn_varlen_qkvpacked_func(rand(7, 3, 4, 16), int32(*CU_K), 3, window_size=w),
}


@pytest.mark.parametrize("name", list(WINDOW_CALLS))
@pytest.mark.parametrize("window", [torch.tensor([3, 1]), torch.tensor([3, 1], dtype=torch.int32), np.array([3, 1])],
                         ids=["int64-tensor", "int32-tensor", "numpy"])
def test_window_size_tensor(stub_kernel, name, window):
    WINDOW_CALLS[name](window)
    (call_args,) = stub_kernel
    assert call_args["window"] == (3, 1) and all(type(w) is int for w in call_args["window"])


def test_window_size_tensor_matches_tuple(stub_kernel):
    q, k, v = make_qkv(sq=6, sk=9)
    assert torch.equal(flash_attn_func(q, k, v, window_size=torch.tensor([2, 1])),
                       flash_attn_func(q, k, v, window_size=(2, 1)))
    out, _ = cute.flash_attn_func(q, k, v, window_size=torch.tensor([2, 1]))
    assert torch.equal(out, flash_attn_func(q, k, v, window_size=(2, 1)))


@pytest.mark.parametrize("window", [torch.tensor([3.0, 1.0]), torch.tensor([3, 1, 0]), torch.tensor([[3, 1]]),
                                    torch.tensor([True, False]), "31", {3: 1}],
                         ids=["float", "three", "2d", "bool", "str", "dict"])
def test_window_size_not_a_pair(window):
    with pytest.raises(ValueError, match=r"window_size must be a pair of integers .* integer tensor of shape \(2,\)"):
        call(window_size=window)
    with pytest.raises(ValueError, match=r"window_size must be a pair of integers or None .* shape \(2,\)"):
        cute.flash_attn_func(*make_qkv(), window_size=window)


@pytest.mark.parametrize("window, causal, expected", [
    ((-2, 0), False, (-1, 0)),
    ((-5, -7), False, (-1, -1)),
    ((2, -3), False, (2, -1)),
    (torch.tensor([-4, 1]), False, (-1, 1)),
    ((-9, 3), True, (-1, 0)),
], ids=lambda x: str(x).replace(" ", ""))
def test_negative_window_bound_is_unbounded(stub_kernel, window, causal, expected):
    """flash-attn 2 takes any negative bound as unbounded (FlashAttention-4's rules stay: test_cute_api)."""
    q, k, v = make_qkv(sq=6, sk=9)
    flash_attn_func(q, k, v, causal=causal, window_size=window)
    call_varlen(causal=causal, window_size=window)
    assert [c["window"] for c in stub_kernel] == [expected, expected]


# ---------------------------------------------------------------------------------------------------------------
# softcap <= 0 is off in flash-attn 2; FlashAttention-4 wants >= 0

@pytest.mark.parametrize("softcap", [-2.0, -1, -0.5])
def test_negative_softcap_is_off(stub_kernel, softcap):
    q, k, v = make_qkv(sq=6, sk=9)
    assert torch.equal(flash_attn_func(q, k, v, softcap=softcap), flash_attn_func(q, k, v))
    call_varlen(softcap=softcap)
    assert stub_kernel[-1]["softcap"] == 0.0


def test_cute_negative_softcap_is_an_error(stub_kernel):
    with pytest.raises(ValueError, match=r"softcap must be a number >= 0 \(0 turns it off\), got -2\.0"):
        cute.flash_attn_func(*make_qkv(), softcap=-2.0)
    with pytest.raises(ValueError, match=r"softcap must be a number >= 0"):
        cute.flash_attn_varlen_func(*make_varlen(), cu_seqlens_q=int32(*CU_Q), cu_seqlens_k=int32(*CU_K), softcap=-1)
    assert not stub_kernel


# ---------------------------------------------------------------------------------------------------------------
# max_seqlen_q/k as tensors (Hugging Face and Transformer Engine pass them to FlashAttention-4)

@pytest.mark.parametrize("make", [lambda n: torch.tensor(n), lambda n: torch.tensor([n], dtype=torch.int32)],
                         ids=["0d-int64", "1-element-int32"])
def test_max_seqlen_cpu_tensor_is_read(stub_kernel, make):
    call_varlen(max_seqlen_q=make(2), max_seqlen_k=make(3))
    cute.flash_attn_varlen_func(*make_varlen(), cu_seqlens_q=int32(*CU_Q), cu_seqlens_k=int32(*CU_K),
                                max_seqlen_q=make(2), max_seqlen_k=make(3))
    assert [c["max_seqlen"] for c in stub_kernel] == [(2, 3), (2, 3)]
    assert all(type(n) is int for c in stub_kernel for n in c["max_seqlen"])


def test_max_seqlen_device_tensor_is_not_read(stub_kernel):
    """A tensor off the CPU would have to be read from its device (a sync): the totals, upper bounds of every
    sequence's length, stand in. The meta device plays the GPU here: it has no values at all."""
    hint = torch.tensor(3, device="meta")
    call_varlen(max_seqlen_q=hint, max_seqlen_k=hint)
    cute.flash_attn_varlen_func(*make_varlen(), cu_seqlens_q=int32(*CU_Q), cu_seqlens_k=int32(*CU_K),
                                max_seqlen_q=hint, max_seqlen_k=hint)
    assert [c["max_seqlen"] for c in stub_kernel] == [(5, 7), (5, 7)]


@pytest.mark.parametrize("hint", [torch.tensor(3.0), torch.tensor([2, 3]), torch.tensor(True)],
                         ids=["float", "two", "bool"])
def test_max_seqlen_tensor_refused(hint):
    with pytest.raises(ValueError, match=r"max_seqlen_k must be an int >= 0 or an integer tensor of one element"):
        call_varlen(max_seqlen_k=hint)


# ---------------------------------------------------------------------------------------------------------------
# flash_attn.cute callers: dropout_p, and FA4's argument order from before qv

def test_cute_func_with_dropout_p_keyword(stub_kernel):
    """A video-diffusion trainer's call, verbatim."""
    q, k, v = make_qkv(sq=6, sk=9)
    softmax_scale, causal, window_size, deterministic = 0.3, True, (-1, -1), False
    out, _ = cute.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, deterministic=deterministic)
    assert torch.equal(out, flash_attn_func(q, k, v, softmax_scale=0.3, causal=True))
    with pytest.raises(NotImplementedError, match=r"dropout is not supported yet: dropout_p must be 0\.0"):
        cute.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match=r"dropout is not supported yet"):
        cute.flash_attn_varlen_func(q, k, v, dropout_p=0.2)


def test_cute_varlen_old_argument_order(stub_kernel):
    """`cute_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)`, the order
    FA4 had before qv became its 4th parameter, as a trainer calls it."""
    q, k, v = make_varlen()
    cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv = int32(*CU_Q), int32(*CU_K), 2, 3
    out, _ = cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
    expected, _ = cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_kv,
                                              max_seqlen_q=2, max_seqlen_k=3)
    old, new = stub_kernel
    assert torch.equal(out, expected) and old["max_seqlen"] == new["max_seqlen"] == (2, 3)
    assert torch.equal(old["cu_seqlens_q"], cu_seqlens_q) and torch.equal(old["cu_seqlens_k"], cu_seqlens_kv)
    cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_kv, torch.tensor(2), causal=True)
    assert stub_kernel[-1]["max_seqlen"] == (2, 7) and stub_kernel[-1]["window"] == (-1, 0)


def test_cute_varlen_mixed_argument_orders(stub_kernel):
    q, k, v = make_varlen()
    how = r"pass the sequences by keyword: flash_attn_varlen_func\(q, k, v, cu_seqlens_q=\.\.\., cu_seqlens_k="
    with pytest.raises(TypeError, match=how):  # cu_seqlens_q positional (old), cu_seqlens_k by keyword
        cute.flash_attn_varlen_func(q, k, v, int32(*CU_Q), cu_seqlens_k=int32(*CU_K))
    with pytest.raises(TypeError, match=how):  # an eighth positional argument: none in the old order
        cute.flash_attn_varlen_func(q, k, v, int32(*CU_Q), int32(*CU_K), 3, 3, 3)
    with pytest.raises(NotImplementedError, match=r"qv is not supported"):  # a real qv stays unsupported
        cute.flash_attn_varlen_func(q, k, v, rand(5, 4, 16), int32(*CU_Q), int32(*CU_K))
    assert not stub_kernel


# ---------------------------------------------------------------------------------------------------------------
# Bad scalar arguments: the message names the argument and what it may be

BAD_SCALARS = [
    ("dropout-none", dict(dropout_p=None), ValueError, r"dropout_p must be a number in \[0, 1\), got None"),
    ("dropout-str", dict(dropout_p="0"), ValueError, r"dropout_p must be a number in \[0, 1\), got '0'"),
    ("scale-str", dict(softmax_scale="x"), ValueError,
     r"softmax_scale must be None \(for 1/sqrt\(head_dim\)\) or a finite number, got 'x'"),
    ("scale-2-tensor", dict(softmax_scale=torch.tensor([0.5, 0.5])), ValueError,
     r"softmax_scale must be None .* or a finite number, got tensor\(\[0\.5000, 0\.5000\]\)"),
    ("scale-nan", dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be .* a finite number, got nan"),
    ("scale-inf", dict(softmax_scale=float("inf")), ValueError, r"softmax_scale must be .* a finite number"),
    ("scale-bool", dict(softmax_scale=True), ValueError, r"softmax_scale must be .* a finite number, got True"),
    ("causal-str", dict(causal="yes"), TypeError, r"causal must be True or False, got 'yes'"),
    ("causal-2", dict(causal=2), TypeError, r"causal must be True or False, got 2"),
    ("deterministic-none", dict(deterministic=None), TypeError, r"deterministic must be True or False, got None"),
]


@pytest.mark.parametrize("kwargs, exc, match", [pytest.param(*c[1:], id=c[0]) for c in BAD_SCALARS])
def test_bad_scalar(stub_kernel, kwargs, exc, match):
    calls = [lambda: call(**kwargs), lambda: call_varlen(**kwargs),
             lambda: flash_attn_qkvpacked_func(rand(2, 5, 3, 4, 16), **kwargs)]
    if "dropout_p" not in kwargs or kwargs["dropout_p"] is None:  # FA4 has dropout_p keyword-only
        calls += [lambda: cute.flash_attn_func(*make_qkv(), **kwargs),
                  lambda: cute.flash_attn_varlen_func(*make_varlen(), cu_seqlens_q=int32(*CU_Q),
                                                      cu_seqlens_k=int32(*CU_K), **kwargs)]
    for fn in calls:
        with pytest.raises(exc, match=match):
            fn()
    assert not stub_kernel


# ---------------------------------------------------------------------------------------------------------------
# Messages in the vocabulary of the function called

def test_cute_device_error_names_only_fa4_arguments():
    for fn in (lambda: cute.flash_attn_func(*make_qkv()),
               lambda: cute.flash_attn_varlen_func(*make_varlen(), cu_seqlens_q=int32(*CU_Q),
                                                   cu_seqlens_k=int32(*CU_K))):
        with pytest.raises(ValueError, match=r"^q, k and v must be CUDA tensors, got device cpu$"):
            fn()
    with pytest.raises(ValueError, match=r"^q, k and v must be on the same device, got cpu, meta, cpu$"):
        cute.flash_attn_func(*make_qkv()[:1], rand(2, 7, 2, 16, device="meta"), rand(2, 7, 2, 16))
    with pytest.raises(ValueError, match=r"^q, k, v and alibi_slopes must be CUDA tensors"):
        call(alibi_slopes=torch.ones(4))


def test_cute_varlen_packed_kv_without_cu_seqlens_k_names_k(stub_kernel):
    q, k, v = make_varlen()
    with pytest.raises(ValueError, match=r"^k must have rank 4, .* when cu_seqlens_k is None, got shape \(7, 2, 16\)"):
        cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=int32(*CU_Q))


# ---------------------------------------------------------------------------------------------------------------
# pytest -m cuda: loud on a GPU machine without the extension, one line on a machine without a GPU

CUDA_TEST = """
import pytest

@pytest.mark.cuda
def test_on_gpu():
    pass

def test_on_cpu():
    pass
"""


@pytest.fixture
def suite(pytester, request):
    pytester.makeconftest((request.config.rootpath / "tests" / "conftest.py").read_text())
    pytester.makepyfile(CUDA_TEST)
    return pytester


def test_gpu_without_extension_fails_the_run(suite, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("flash_attention._dispatch._extension", None)
    monkeypatch.setattr("flash_attention._dispatch._EXTENSION_NAME", "flash_attention._no_such_extension")
    result = suite.runpytest_inprocess("-m", "cuda")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*1 cuda tests selected on a machine with a GPU, but: *extension*is missing*"])
    assert suite.runpytest_inprocess("-m", "not cuda").ret == pytest.ExitCode.OK


def test_no_gpu_says_so_in_one_line(suite, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = suite.runpytest_inprocess("-q")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["no CUDA GPU: the 1 tests marked cuda were skipped"])
    assert "no CUDA GPU" not in suite.runpytest_inprocess("-q", "-m", "not cuda").stdout.str()


@pytest.mark.parametrize("sq, grad, split", [(1, False, True), (64, False, True), (65, False, False),
                                             (1, True, False)])
def test_decode_shaped_calls_take_the_split_kernels(stub_kernel, monkeypatch, sq, grad, split):
    """flash_attn_func's calls of at most 64 query rows without gradient (inference: decode steps) run on the native
    split kernels, GQA-packed under their mask by the kernel (q handed over unpacked); longer or differentiable ones
    on the forward kernels."""
    from flash_attention import _ops
    split_calls = []

    def fake_split(route, q, k, v, seqused_k, block_table, leftpad_k, scale, left, right, cap, splits, packed_heads,
                   tier):
        split_calls.append(dict(shape=q.shape, window=(left, right), packed_heads=packed_heads, splits=splits))
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(_ops, "decode_route", lambda q, tier: _ops.DecodeRoute(80, 64, 80, 132, 232448))
    monkeypatch.setattr(_ops, "decode_attention", fake_split)
    q = torch.randn(2, sq, 8, 64, dtype=torch.bfloat16, requires_grad=grad)
    k, v = (torch.randn(2, 700, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == q.shape
    assert (len(split_calls), len(stub_kernel)) == ((1, 0) if split else (0, 1))
    if split:
        # q goes unpacked: the kernel packs its rows.
        assert split_calls[0]["shape"] == q.shape and split_calls[0]["packed_heads"] == 4
        # One query row sees every key under the bottom-right causal mask: no bound is left.
        assert split_calls[0]["window"] == ((-1, -1) if sq == 1 else (-1, 0))
        assert split_calls[0]["splits"] <= -1  # an automatic count (split_count's), which the binding may lower
