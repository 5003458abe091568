"""The custom ops' own bodies on CPU, with a stand-in for the extension's binding (fake_binding): the arguments the
binding gets, batched and varlen; an eager call skipping the custom op and a call under a dispatch mode taking it;
and a missing extension, which the package imports without and which any kernel launch reports."""

import pytest
import torch

import flash_attention
from cpu_helpers import BATCHED, CU_K, CU_Q, int32, leaves, make_qkv, make_varlen
from flash_attention import _checks, _dispatch, _ops, flash_attn_func


# ---------------------------------------------------------------------------------------------------------------
# The ops' own bodies, with a CPU stand-in for the binding

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

    def attention_autograd(self, q, k, v, *args):
        """The C++ autograd node's contract: fwd's arguments up to deterministic, then the forward's and the
        backward's kernel head dim and tier; here its Python twin runs them through fwd and bwd above."""
        self.calls.append(("attention_autograd", (q, k, v) + args))
        return _ops._EagerAttention.apply(q, k, v, args[:-4] + (None,))


@pytest.fixture(params=["eager", "op"])
def fake_binding(request, monkeypatch):
    binding = FakeBinding()
    monkeypatch.setattr(_dispatch, "_extension", binding)
    monkeypatch.setattr(_dispatch, "resolve", lambda device, kind, head_dim, dtype, tier: (80, 64))
    monkeypatch.setattr(_ops, "autograd_routes", {})  # routes found through the real resolve
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
    calls = fake_binding.calls
    if fake_binding.path == "eager":
        (_, node_args), *calls = calls
        assert node_args[3:] == (cu_q, cu_k, None, used_k, 3, 4, 0.3, 2, 0, 1.5, slopes, True, 64, 80, 64, 80)
    (_, fwd_args), (_, bwd_args) = calls
    assert lse.shape == (4, 5) and torch.equal(bwd_args[4], out) and torch.equal(bwd_args[5], lse)
    assert fwd_args[3:] == (cu_q, cu_k, None, used_k, 3, 4, 0.3, 2, 0, 1.5, slopes, 64, 80)  # ..., kernel dim, tier
    assert bwd_args[6] is None  # the loss does not use lse
    assert bwd_args[7:] == (cu_q, cu_k, None, used_k, 3, 4, 0.3, 2, 0, 1.5, slopes, True, 64, 80)


def test_batched_binding_call_has_no_sequences(fake_binding):
    q, k, v = leaves(*make_qkv())
    out, _ = _ops.attention(q, k, v, *BATCHED, 0.25, -1, -1, 0.0, None, False, None)
    out.sum().backward()
    (_, fwd_args), (_, bwd_args) = fake_binding.calls[-2:]
    assert fwd_args[3:9] == BATCHED and bwd_args[7:13] == BATCHED


def test_eager_call_skips_the_op(fake_binding, monkeypatch):
    """An eager call runs the kernel through the binding's autograd node, not the custom op, whose dispatch costs more
    than the rest of the host path; a call that the op must see (traced, under a dispatch mode) takes the op."""
    op_calls = []
    monkeypatch.setattr(_ops, "fwd", lambda *args: op_calls.append(args) or _ops.forward_impl(*args))
    q, k, v = leaves(*make_qkv())
    out, _ = _ops.attention(q, k, v, *BATCHED, 0.25, -1, -1, 0.0, None, False, None)
    eager = fake_binding.path == "eager"
    assert len(op_calls) == (0 if eager else 1)
    if eager:
        assert fake_binding.calls[0][0] == "attention_autograd"
        with torch.no_grad():
            assert _ops.attention(q, k, v, *BATCHED, 0.25, -1, -1, 0.0, None, False, None)[0].grad_fn is None


def test_forward_runs_without_a_backward_kernel(fake_binding, monkeypatch):
    """A build without backward kernels (FLASH_ATTN_KINDS=fwd) still runs a differentiable forward; the missing kernel
    is reported when the backward runs."""
    def resolve(device, kind, head_dim, dtype, tier):
        if kind == "bwd":
            raise RuntimeError("flash_attention: this build has no sm80 bwd kernel")
        return (80, 64)

    monkeypatch.setattr(_dispatch, "resolve", resolve)
    q, k, v = leaves(*make_qkv())
    out, _ = _ops.attention(q, k, v, *BATCHED, 0.25, -1, -1, 0.0, None, False, None)
    assert [call[0] for call in fake_binding.calls] == ["fwd"]
    with pytest.raises(RuntimeError, match="no sm80 bwd kernel"):
        out.sum().backward()


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
