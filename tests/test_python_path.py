"""The whole Python path on CPU with the kernel replaced by the reference (stub_kernel), batched and varlen: the
preparation of the kernel's inputs (head dim padded to a multiple of 8, window normalized against the lengths), the
arguments that reach the kernel, packed inputs passed as views, the return convention, empty inputs that need no
kernel, and torch.compile tracing the forward path in one graph."""

import functools
import itertools

import numpy as np
import pytest
import torch

from cpu_helpers import CU_K, CU_Q, call_varlen, int32, leaves, make_qkv, make_varlen, rand, varlen_ref
from flash_attention import (_checks, _dispatch, _ops, flash_attn_func, flash_attn_kvpacked_func,
                             flash_attn_qkvpacked_func, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                             flash_attn_varlen_qkvpacked_func)
from flash_attention import interface
from flash_attention.interface import normalize_window, pad_head_dim
from helpers import bf16, fp16
from reference import attention_mask, attention_ref


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
# The batched functions

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


@pytest.mark.parametrize("b, sq, sk", [(2, 0, 7), (2, 5, 0), (0, 5, 7)], ids=["sq0", "sk0", "b0"])
def test_empty_sequences_without_grad(no_extension, monkeypatch, b, sq, sk):
    """Without gradient, where a decode-shaped call would take the split kernels: empty calls still run no kernel."""
    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    monkeypatch.setattr(_ops, "decode_route", lambda q, tier: _ops.DecodeRoute(80, 64, 80, 132, 232448))
    q, k, v = make_qkv(b=b, sq=sq, sk=sk, d=64)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and not out.any() and lse.shape == (b, 4, sq) and (lse == float("-inf")).all()


# ---------------------------------------------------------------------------------------------------------------
# The common calls' shortcut (interface._common_forward): the same binding call as the general path, or none

class RecordingBinding:
    """The extension's entries that _common_forward reaches, recording their arguments; each returns (out, lse)."""

    def __init__(self):
        self.calls = []

    def _record(self, entry, q, k, v, args):
        self.calls.append((entry, (q, k, v) + args))
        b, rows, h, _ = q.shape
        return [torch.zeros_like(q), torch.zeros(b, h, rows)]

    def attention_autograd(self, q, k, v, *args):
        return self._record("attention_autograd", q, k, v, args)

    def fwd(self, q, k, v, *args):
        return self._record("fwd", q, k, v, args)

    def fwd_split(self, q, k, v, *args):
        return self._record("fwd_split", q, k, v, args)


@pytest.fixture
def routed_cpu(monkeypatch):
    """CPU tensors routed as if a call had found their kernels (device index -1, the CPU's get_device()), with the
    binding replaced by a RecordingBinding; returns it."""
    binding = RecordingBinding()
    monkeypatch.setattr(_dispatch, "_extension", binding)
    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    for d, dtype in itertools.product((16, 64, 264), (fp16, bf16)):
        monkeypatch.setitem(_ops.autograd_routes, (-1, d, dtype, None), (d, 90, d, 90))
    monkeypatch.setattr(_dispatch, "resolve", lambda device, kind, head_dim, dtype, tier: (90, head_dim))
    monkeypatch.setattr(_ops, "decode_route", lambda q, tier: _ops.DecodeRoute(80, q.shape[-1], 80, 132, 232448)
                        if q.shape[-1] in (16, 64) else None)
    return binding


def same_arguments(mine, theirs):
    """Tensors the same objects, or equal with the same layout (a packed q is a new tensor each call); other values
    equal and of one type."""
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        if isinstance(b, torch.Tensor):
            assert a is b or (torch.equal(a, b) and a.stride() == b.stride())
        else:
            assert a == b and type(a) is type(b)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize(
    "shape, kwargs",
    [
        ((2, 70, 80, 4, 2, 64), {}),
        ((2, 70, 80, 4, 2, 64), dict(causal=True)),
        ((1, 1, 9, 4, 4, 16), dict(causal=True)),  # one causal row sees every key: no mask
        ((2, 3, 9, 4, 2, 16), dict(causal=True)),  # no gradient: a decode step, GQA-packed
        ((2, 1, 9, 8, 2, 64), {}),  # no gradient: a GQA decode row, packed by the kernel
        ((2, 65, 65, 4, 4, 16), dict(softmax_scale=0.3, deterministic=True)),
        ((3, 100, 7, 2, 1, 64), dict(causal=True, window_size=(-1, -1), softcap=0.0, dropout_p=0.0)),
    ],
    ids=["mha", "causal", "one-row", "decode-rows", "decode-row", "scale-det", "explicit-defaults"],
)
def test_common_forward_matches_general_path(routed_cpu, monkeypatch, shape, kwargs, grad):
    """Where the shortcut takes a call, the binding gets what the general path gives it, and the result returns as
    flash_attn_func's."""
    b, sq, sk, h, hk, d = shape
    if grad and sq == 1 and h > hk:
        pytest.skip("a differentiable GQA decode row: packed by the general path alone (test_common_forward_declines)")
    q, k, v = make_qkv(b=b, sq=sq, sk=sk, h=h, hk=hk, d=d)
    q.requires_grad_(grad)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    (fast,) = routed_cpu.calls
    routed_cpu.calls.clear()
    with monkeypatch.context() as m:
        m.setattr(interface, "_common_forward", lambda *args: None)
        flash_attn_func(q, k, v, **kwargs)
    (general,) = routed_cpu.calls
    entry = "attention_autograd" if grad else "fwd_split" if sq <= 64 else "fwd"
    assert fast[0] == general[0] == entry
    same_arguments(fast[1], general[1])
    assert out.shape == q.shape and lse.shape == (b, h, sq)


@pytest.mark.parametrize(
    "change",
    [
        dict(kwargs=dict(window_size=(3, -1))), dict(kwargs=dict(window_size=[-1, -1])),
        dict(kwargs=dict(softcap=1.0)), dict(kwargs=dict(dropout_p=0)), dict(kwargs=dict(tier="sm80")),
        dict(kwargs=dict(alibi_slopes=torch.rand(4))), dict(kwargs=dict(causal=1)),
        dict(kwargs=dict(deterministic=0)), dict(kwargs=dict(softmax_scale=float("nan"))),
        dict(kwargs=dict(softmax_scale=torch.tensor(0.3))),
        dict(d=24),  # not routed
        dict(d=13),  # padded
        dict(d=264),  # above the largest head dim
        dict(dtype=torch.float32), dict(sq=1, h=4, hk=2), dict(h=4, hk=3), dict(sq=0), dict(sk=0), dict(b=0),
    ],
    ids=["window", "window-list", "softcap", "dropout-int", "tier", "alibi", "causal-int", "deterministic-int",
         "scale-nan", "scale-tensor", "unrouted", "padded", "head-dim-264", "fp32", "gqa-decode-row", "gqa-ratio",
         "sq0", "sk0", "b0"],
)
def test_common_forward_declines(routed_cpu, change):
    """Every differentiable call outside the shortcut's reach goes to the general path: _common_forward returns None
    and calls nothing."""
    sizes = dict(b=2, sq=6, sk=9, h=4, hk=4, d=16, dtype=bf16)
    sizes.update({key: value for key, value in change.items() if key in sizes})
    q, k, v = leaves(*make_qkv(**sizes))
    kwargs = dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, deterministic=False, tier=None)
    kwargs.update(change.get("kwargs", {}))
    assert interface._common_forward(q, k, v, *kwargs.values()) is None
    assert not routed_cpu.calls


def test_common_forward_follows_the_tier_variable(routed_cpu, monkeypatch):
    """FLASH_ATTN_TIER, read on every call, picks the route the shortcut takes, as it does the general path's."""
    q, k, v = leaves(*make_qkv(d=16, hk=4, dtype=bf16))
    monkeypatch.setitem(_ops.autograd_routes, (-1, 16, bf16, "sm80"), (16, 80, 16, 80))
    flash_attn_func(q, k, v)
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm80")
    flash_attn_func(q, k, v)
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm100")  # not routed: the general path
    with monkeypatch.context() as m:
        m.setattr(_ops, "autograd_route", lambda q, tier: (16, 100, 16, 100))
        flash_attn_func(q, k, v)
    default, sm80, sm100 = (args[-4:] for _, args in routed_cpu.calls)
    assert default == (16, 90, 16, 90) and sm80 == (16, 80, 16, 80) and sm100 == (16, 100, 16, 100)


def test_common_forward_takes_only_plain_eager_tensors(routed_cpu, monkeypatch):
    """A tensor subclass, a dispatch mode or tracing goes to the general path."""
    q, k, v = leaves(*make_qkv(d=16, hk=4))
    args = (0.0, None, False, (-1, -1), 0.0, None, False, None)
    assert interface._common_forward(q, k, v, *args) is not None
    assert interface._common_forward(q.as_subclass(torch.nn.Parameter), k, v, *args) is None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert interface._common_forward(q, k, v, *args) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert interface._common_forward(q, k, v, *args) is None


class Traced(Exception):
    """Raised instead of running a traced graph: the real op needs a GPU; tracing is what is under test."""


def trace_only(graphs, gm, example_inputs):
    """A torch.compile backend that keeps the graph and raises Traced when it would run."""
    graphs.append(gm)

    def run(*args):
        raise Traced

    return run


def test_compile_traces_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) traces padding, the custom op (through its fake) and slicing in one graph."""
    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)

    graphs = []
    backend = functools.partial(trace_only, graphs)

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
# The varlen functions, with the kernel replaced by a per-sequence reference

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

    graphs = []
    backend = functools.partial(trace_only, graphs)

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


@pytest.mark.parametrize("causal, window, alibi, packed", [
    (True, (-1, -1), False, True), (False, (-1, -1), False, True), (True, (3, 0), False, False),
    (False, (-1, -1), True, False)])
@pytest.mark.parametrize("d", [32, 59])
def test_decode_step_packs_gqa_heads(stub_kernel, causal, window, alibi, packed, d):
    """A one-row GQA call without window or ALiBi reaches the kernel with each kv head's query heads as rows (a
    batched (b, group, nheads_k, d) view); out and lse are the reference's either way (the backward through the
    view: test_bwd's one-row GQA cases on the GPU)."""
    b, h, hk, sk = 2, 6, 2, 37
    q, k, v = rand(b, 1, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    slopes = torch.rand(h) * 0.3 if alibi else None
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes,
                                  return_attn_probs=True)
    (call,) = stub_kernel
    assert call["q"].shape[:3] == ((b, h // hk, hk) if packed else (b, 1, h))
    ref_out, ref_lse = attention_ref(q.float(), k.float(), v.float(), causal=causal, window_size=window,
                                     alibi_slopes=slopes)
    assert out.shape == q.shape and lse.shape == (b, h, 1)
    assert torch.allclose(out.float(), ref_out, atol=2e-2) and torch.allclose(lse, ref_lse, atol=1e-4)


def test_decode_step_packing_backward(standin_ops):
    """The packed decode step's gradients reach q, k, v in their own shapes through the view, on the eager path and
    through the ops (the stand-in backward returns 2 dout, 3 k, 4 v in the shapes it was given)."""
    q, k, v = leaves(rand(2, 1, 6, 32), rand(2, 37, 2, 32), rand(2, 37, 2, 32))
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    (call,) = standin_ops["bwd"]
    assert call["q"].shape == (2, 3, 2, 32)
    assert torch.equal(q.grad, 2 * dout) and torch.equal(k.grad, 3 * k.detach()) and torch.equal(v.grad, 4 * v.detach())
