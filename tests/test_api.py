"""Checks that need no GPU: input validation, tier dispatch, the Python-side preparation of inputs, the autograd
wiring of the ops (with CPU stand-ins for the kernels), and the reference itself. They run on the CPU-only CI."""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import flash_attention
from flash_attention import _checks, _ops, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
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
    ("window-triple", lambda: call(window_size=(1, 2, 3)), ValueError, r"window_size must be a pair of integers >= -1"),
    ("window-int", lambda: call(window_size=4), ValueError, r"window_size must be a pair of integers >= -1"),
    ("window-minus-2", lambda: call(window_size=(-2, 0)), ValueError, r"window_size must be a pair of integers >= -1"),
    ("window-float", lambda: call(window_size=(1.5, 0)), ValueError, r"window_size must be a pair of integers >= -1"),
    ("window-bool", lambda: call(window_size=(True, 0)), ValueError, r"window_size must be a pair of integers >= -1"),
    ("window-float-tensor", lambda: call(window_size=(torch.tensor(2.0), 0)), ValueError,
     r"window_size must be a pair of integers >= -1"),
    ("window-1d-tensor", lambda: call(window_size=(torch.tensor([2]), 0)), ValueError,
     r"window_size must be a pair of integers >= -1"),
    ("window-tensor-minus-2", lambda: call(window_size=(torch.tensor(-2), 0)), ValueError,
     r"window_size must be a pair of integers >= -1"),
    ("softcap-negative", lambda: call(softcap=-1.0), ValueError, r"softcap must be a number >= 0"),
    ("softcap-nan", lambda: call(softcap=float("nan")), ValueError, r"softcap must be a number >= 0"),
    ("tier-unknown", lambda: call(tier="sm75"), ValueError, r"unknown tier 'sm75'.*sm80, sm90, sm100"),
    ("tier-int", lambda: call(tier=80), TypeError, r"tier must be a string"),
    ("dropout", lambda: call(dropout_p=0.1), NotImplementedError, r"dropout is not supported yet"),
    ("dropout-negative", lambda: call(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
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
# Tier dispatch and kernel lookup

def cc_id(cc):
    return f"cc{cc[0]}{cc[1]}"


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)], ids=cc_id)
def test_default_tier(cc):
    assert _ops.select_tier(cc) == "sm80"


@pytest.mark.parametrize("cc", [(7, 5), (7, 0), (6, 1)], ids=cc_id)
def test_old_gpu_rejected(cc):
    with pytest.raises(RuntimeError, match=rf"compute capability {cc[0]}\.{cc[1]} are not supported"):
        _ops.select_tier(cc)
    with pytest.raises(RuntimeError, match="not supported"):
        _ops.select_tier(cc, "sm80")


@pytest.mark.parametrize(
    "override, cc, expected",
    [("sm80", (8, 0), "sm80"), ("sm80", (9, 0), "sm80"), ("sm80", (12, 0), "sm80"), ("SM90", (9, 0), "sm90"),
     (" sm100 ", (10, 0), "sm100"), ("sm100", (10, 3), "sm100")],
    ids=lambda x: cc_id(x) if isinstance(x, tuple) else repr(x).strip("'").strip(),
)
def test_tier_override(override, cc, expected):
    assert _ops.select_tier(cc, override) == expected


@pytest.mark.parametrize("override, cc", [("sm90", (8, 0)), ("sm90", (10, 0)), ("sm100", (9, 0)), ("sm100", (12, 0))],
                         ids=lambda x: cc_id(x) if isinstance(x, tuple) else x)
def test_tier_override_wrong_gpu(override, cc):
    with pytest.raises(RuntimeError, match=rf"tier {override} .* cannot run on this GPU of compute capability"):
        _ops.select_tier(cc, override)


@pytest.mark.parametrize("override", ["sm75", "hopper", ""], ids=["sm75", "hopper", "empty"])
def test_tier_override_unknown(override):
    with pytest.raises(ValueError, match=r"unknown tier .*FLASH_ATTN_TIER.*expected one of: sm80, sm90, sm100"):
        _ops.select_tier((9, 0), override)


def test_tier_override_from_environment(monkeypatch):
    monkeypatch.delenv("FLASH_ATTN_TIER", raising=False)
    assert _ops.requested_tier(None) is None
    monkeypatch.setenv("FLASH_ATTN_TIER", "")
    assert _ops.requested_tier(None) is None
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm90")
    assert _ops.requested_tier(None) == "sm90"
    assert _ops.requested_tier("sm80") == "sm80"  # the argument wins


@pytest.mark.parametrize(
    "d, expected",
    [(8, 32), (32, 32), (40, 64), (64, 64), (72, 96), (96, 96), (104, 128), (128, 128), (136, 192), (160, 192),
     (192, 192), (200, 256), (224, 256), (256, 256)],
    ids=lambda x: str(x),
)
def test_kernel_head_dim(d, expected):
    assert _ops.kernel_head_dim(d) == expected


BUILT = frozenset({(80, "fwd", 64, "bf16"), (80, "fwd", 128, "bf16"), (80, "fwd", 128, "fp16")})


def test_kernel_available():
    _ops.check_kernel_available(BUILT, "sm80", 128, "bf16")
    _ops.check_kernel_available(BUILT, "sm80", 40, "bf16")  # runs on the 64 kernel
    _ops.check_kernel_available(BUILT, "sm80", 112, "fp16")  # runs on the 128 kernel


def test_kernel_missing_head_dim():
    with pytest.raises(RuntimeError, match=r"no sm80 forward kernel for head dim 96 \(bf16\).*FLASH_ATTN_HEAD_DIMS"):
        _ops.check_kernel_available(BUILT, "sm80", 72, "bf16")
    with pytest.raises(RuntimeError, match=r"head dim 64 \(fp16\)"):
        _ops.check_kernel_available(BUILT, "sm80", 64, "fp16")


def test_kernel_missing_tier():
    with pytest.raises(RuntimeError, match=r"tier sm90 is not built .*built tiers: sm80.*FLASH_ATTN_CUDA_ARCHS"):
        _ops.check_kernel_available(BUILT, "sm90", 128, "bf16")
    with pytest.raises(RuntimeError, match=r"built tiers: none"):
        _ops.check_kernel_available(frozenset(), "sm80", 128, "bf16")


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


def test_kernel_operand_keeps_good_views():
    x = rand(2, 5, 4, 16)
    assert _ops.kernel_operand(x) is x
    transposed = rand(2, 4, 5, 16).transpose(1, 2)  # strides (320, 16, 80, 1): all multiples of 8
    assert _ops.kernel_operand(transposed) is transposed
    packed_k = rand(2, 5, 3, 4, 16).unbind(2)[1]
    assert _ops.kernel_operand(packed_k) is packed_k


def misaligned(*shape):
    """A contiguous tensor whose data starts 2 bytes past a 16-byte boundary."""
    return torch.randn(math.prod(shape) + 1, dtype=fp16)[1:].view(*shape)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: misaligned(2, 5, 4, 16), id="misaligned-base"),
        pytest.param(lambda: rand(2, 5, 4, 12)[..., :8], id="row-stride-12"),
        pytest.param(lambda: rand(2, 5, 4, 16).as_strided((1, 5, 4, 16), (3, 64, 16, 1)), id="size1-dim-stride-3"),
        pytest.param(lambda: torch.ones((), dtype=fp16).expand(2, 5, 4, 16), id="broadcast-grad-of-sum"),
        pytest.param(lambda: rand(2, 5, 4, 32)[..., ::2], id="last-dim-stride-2"),
    ],
)
def test_kernel_operand_copies_bad_views(make):
    x = make()
    y = _ops.kernel_operand(x)
    assert y.stride(-1) == 1 and y.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in y.stride()[:-1])
    assert torch.equal(x, y)


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
    """Let CPU tensors through and run the reference in place of the op; returns the list of calls it received."""
    calls = []

    def fake_fwd(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
        calls.append(dict(q=q, k=k, v=v, softmax_scale=softmax_scale, window=(window_left, window_right),
                          deterministic=deterministic, tier=tier))
        out, lse = attention_ref(q, k, v, False, (window_left, window_right), softcap, alibi_slopes, softmax_scale)
        return out.to(q.dtype), lse

    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    monkeypatch.setattr(_ops, "fwd", fake_fwd)
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
    """A last dimension that is not contiguous is copied before the kernel, as flash-attn does, not rejected."""
    q, k, v = make_qkv(sq=6, sk=9)
    strided = {"q": q, "k": k, "v": v}
    strided[name] = torch.cat([strided[name], strided[name]], dim=-1)[..., ::2]
    assert strided[name].stride(-1) == 2
    out = flash_attn_func(strided["q"], strided["k"], strided["v"], causal=True)
    for call_args in stub_kernel:
        assert all(call_args[n].stride(-1) == 1 for n in "qkv")
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
    monkeypatch.setattr(_ops, "_extension", None)
    monkeypatch.setattr(_ops, "_EXTENSION_NAME", "flash_attention._no_such_extension")


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

@pytest.fixture
def standin_ops(monkeypatch):
    """Let CPU tensors through and register CPU stand-ins under both custom ops, so that their own autograd formulas
    and fakes run: the forward is the reference, the backward returns 2 * dout, 3 * k and 4 * v, distinct for each
    input. Returns the calls they received, by op."""
    calls = {"fwd": [], "bwd": []}

    def fwd(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
        out, lse = attention_ref(q, k, v, False, (window_left, window_right), softcap, alibi_slopes, softmax_scale)
        out = out.to(q.dtype, memory_format=torch.contiguous_format)  # laid out as the ops' fakes say
        calls["fwd"].append(dict(q=q, k=k, v=v, out=out, lse=lse))
        return out, lse

    def bwd(dout, q, k, v, out, lse, dlse, softmax_scale, window_left, window_right, softcap, alibi_slopes,
            deterministic, tier):
        calls["bwd"].append(dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, softmax_scale=softmax_scale,
                                 window=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, tier=tier))
        return tuple(g.contiguous() for g in (2 * dout, 3 * k, 4 * v))

    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    with torch.library._scoped_library("flash_attention", "IMPL") as lib:
        lib.impl("fwd", fwd, "CPU")
        lib.impl("bwd", bwd, "CPU")
        yield calls


def test_backward_runs_bwd_on_saved_state(standin_ops):
    q, k, v = leaves(*make_qkv())
    slopes = torch.rand(4)
    out, lse = _ops.fwd(q, k, v, 0.3, 2, 0, 1.5, slopes, True, "sm80")
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
    out, lse = _ops.fwd(q, k, v, 0.25, -1, -1, 0.0, None, False, None)
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
# Missing extension

def test_package_imports():
    assert flash_attention.__version__ == "0.1.0"
    assert callable(flash_attention.flash_attn_func)


def test_missing_extension(no_extension, monkeypatch):
    missing = r"CUDA extension flash_attention\._C is missing.*FLASH_ATTN_SKIP_CUDA_BUILD"
    with pytest.raises(RuntimeError, match=missing):
        _ops.load_extension()
    assert not _ops.extension_available()
    q, k, v = make_qkv()
    with pytest.raises(RuntimeError, match=r"CUDA extension .* is missing"):
        _ops.fwd(q, k, v, 0.25, -1, -1, 0.0, None, False, None)
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
