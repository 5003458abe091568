"""The autograd wiring of the custom ops on CPU, with stand-ins registered under them (standin_ops, on the eager
path and through the ops): the backward gets the forward's saved state and options, lse's gradient and
deterministic reach it, the gradients reach q, k, v (padded, packed, some not requiring grad) and none goes to the
sequence tensors; torch.library.opcheck of the ops, and torch.compile putting fwd and bwd in their graphs."""

import functools

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from cpu_helpers import BATCHED, CU_K, CU_Q, call_varlen, int32, leaves, make_qkv, make_varlen, rand
from flash_attention import (_ops, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                             flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from helpers import SelfAttention, bf16, output_and_grads


# ---------------------------------------------------------------------------------------------------------------
# Batched calls

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


def graph_capture(graphs, name):
    """An aot_autograd compiler that records the node targets of its graph in graphs[name] and runs the graph."""
    def compiler(gm, example_inputs):
        graphs[name] = [str(node.target) for node in gm.graph.nodes]
        return make_boxed_func(gm.forward)

    return compiler


def test_compile_traces_backward(standin_ops):
    """torch.compile(fullgraph=True) of a layer puts the fwd op in the forward graph and the bwd op in the backward
    graph (through their fakes), passes deterministic on, and gives eager's gradients."""
    graphs = {}
    capture = functools.partial(graph_capture, graphs)

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
# Varlen calls

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
    capture = functools.partial(graph_capture, graphs)

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


def test_varlen_compile_max_seqlen_from_item(standin_ops):
    """max_seqlen computed in the graph with .item() (as model code does) is a symbolic int that no check may
    specialize on: fullgraph with dynamic shapes runs, and two batches of different lengths reuse the graph."""
    # torch's own patch context: with pytest 9.2, monkeypatch's undo left the setting missing for the next test
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
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
            assert torch.equal(out, fn(q, k, v, int32(*cu_q), int32(*CU_K)))
            assert torch.equal(q.grad, 2 * torch.ones_like(q))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
