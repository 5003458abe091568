"""Backward correctness on the GPU against the gradients of the fp32 reference.

Tolerance: for each of dq, dk and dv, the kernel's max error against the fp32 reference's gradient may be at most
three times that of the same math done by PyTorch's autograd in the input dtype, plus fp32 rounding. Gradients are
computed into a NaN-poisoned allocator, and the elements that the masks make exactly zero (rows that see no key,
keys that no row sees) must be exactly zero. The grid is the forward's (every value of every axis, the risky ones
crossed)."""

import pytest
import torch

from flash_attention import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from helpers import (HEADS, SMEM_BUDGETS, Case, SelfAttention, assert_matches_reference, bf16, build_cases,
                     case_kwargs, fp16, grad_rounding, make_inputs, make_tensor, max_err, output_and_grads,
                     poison_allocator, require_kernel)
from reference import attention_mask, attention_ref

pytestmark = pytest.mark.cuda

# The forward's grid, with fewer length pairs crossed with every mask: a backward case costs more to check.
CASES = build_cases(mask_seqlens=((1, 239), (113, 203), (799, 3), (1024, 1023)))

# Score elements in one piece of the reference: bounds its memory (a handful of fp32 tensors of this size each).
REF_CHUNK = 2**26


def visibility(q, k, causal=False, window_size=(-1, -1), **_):
    """Bool (seqlen_q, seqlen_k) mask of the keys each query row sees."""
    return attention_mask(q.shape[1], k.shape[1], causal, window_size, device=q.device)


def cotangents(q, k, with_lse=False, **kwargs):
    """A random dout, and with_lse a random dlse that is 0 on the rows that see no key: their lse is -inf, which no
    finite loss can weight."""
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    if not with_lse:
        return dout, None
    b, sq, h, _ = q.shape
    sees_a_key = visibility(q, k, **kwargs).any(dim=1)
    return dout, torch.randn(b, h, sq, device=q.device).masked_fill(~sees_a_key, 0.0)


def grads_of(q, k, v, dout, dlse=None, deterministic=False, **kwargs):
    """Run flash_attn_func on fresh leaves of q, k, v and return (out, lse) and its (dq, dk, dv) for dout (and dlse
    when the loss uses lse), the backward computed into a NaN-poisoned allocator."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flash_attn_func(*leaves, deterministic=deterministic, return_attn_probs=True, **kwargs)
    poison_allocator(q, k)
    if dlse is None:
        grads = torch.autograd.grad(out, leaves, dout)
    else:
        grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    return (out.detach(), lse.detach()), grads


def reference_grads(q, k, v, dout, dlse, upcast, **kwargs):
    """attention_ref's gradients, in fp32 (upcast) or in the input dtype."""
    leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, upcast=upcast, **kwargs)
    if dlse is None:
        return torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return torch.autograd.grad((out, lse), leaves, (dout.to(out.dtype), dlse))


def reference_chunks(q, k):
    """(batch, kv heads) slices that split the reference into pieces of at most REF_CHUNK score elements (or one
    batch entry and kv head, if that is more): a kv head's gradients come from its own group of query heads only."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    per_kv_head = h // hk * sq * sk
    heads = max(1, min(hk, REF_CHUNK // per_kv_head))
    batch = max(1, min(b, REF_CHUNK // (per_kv_head * hk))) if heads == hk else 1
    for i in range(0, b, batch):
        for g in range(0, hk, heads):
            yield slice(i, i + batch), slice(g, g + heads)


def assert_grads_correct(q, k, v, dout, dlse, *grad_sets, alibi_slopes=None, **kwargs):
    """Check each (dq, dk, dv) in grad_sets: shapes and dtypes, finite, exact zeros where the masks put them, and
    within three times PyTorch's own same-dtype error of the fp32 reference's gradients (plus fp32 rounding)."""
    sees = visibility(q, k, **kwargs)
    blind_rows, unseen_keys = ~sees.any(dim=1), ~sees.any(dim=0)
    for grads in grad_sets:
        for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {g.shape} {g.dtype}"
            assert torch.isfinite(g).all(), f"NaN/inf in {name}"
        dq, dk, dv = grads
        assert not dq[:, blind_rows].any(), "dq of a row that sees no key must be exactly 0"
        assert not dk[:, unseen_keys].any() and not dv[:, unseen_keys].any(), "dk/dv of a key no row sees must be 0"

    # Errors per reference piece, reduced with torch so that a NaN is not lost to Python's max.
    errs = [[[] for _ in range(3)] for _ in grad_sets]
    low_errs = [[] for _ in range(3)]
    group = q.shape[2] // k.shape[2]
    for bs, kv_heads in reference_chunks(q, k):
        q_heads = slice(kv_heads.start * group, kv_heads.stop * group)
        slopes = alibi_slopes
        if slopes is not None:
            slopes = slopes[q_heads] if slopes.dim() == 1 else slopes[bs, q_heads]

        def piece(qkv):
            return qkv[0][bs, :, q_heads], qkv[1][bs, :, kv_heads], qkv[2][bs, :, kv_heads]

        inputs = piece((q, k, v)) + (dout[bs, :, q_heads], None if dlse is None else dlse[bs, q_heads])
        ref = reference_grads(*inputs, upcast=True, alibi_slopes=slopes, **kwargs)
        low = reference_grads(*inputs, upcast=False, alibi_slopes=slopes, **kwargs)
        for j in range(3):
            low_errs[j].append(max_err(low[j], ref[j]))
            for n, grads in enumerate(grad_sets):
                errs[n][j].append(max_err(piece(grads)[j], ref[j]))
        del ref, low

    terms = (k.shape[1],) + (q.shape[1] * group,) * 2
    for grad_errs in errs:
        for name, err, low_err, n in zip(("dq", "dk", "dv"), grad_errs, low_errs, terms):
            err, tol = torch.tensor(err).max().item(), 3 * torch.tensor(low_err).max().item() + grad_rounding(n)
            assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


def check_backward(q, k, v, with_lse=False, deterministic=False, **kwargs):
    """Forward and backward of flash_attn_func against the reference; returns dout, dlse and the gradients."""
    dout, dlse = cotangents(q, k, with_lse, **kwargs)
    (out, lse), grads = grads_of(q, k, v, dout, dlse, deterministic, **kwargs)
    assert_matches_reference(out, lse, q, k, v, **kwargs)
    assert_grads_correct(q, k, v, dout, dlse, grads, **kwargs)
    return dout, dlse, grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_backward(case):
    require_kernel(case.d, case.dtype, "bwd")
    q, k, v, alibi = make_inputs(case)
    check_backward(q, k, v, **case_kwargs(case, alibi))


LSE_CASES = [
    Case(bf16, 64, 113, 203),
    Case(fp16, 128, 799, 3, heads="gqa", causal=True),  # most rows see no key
    Case(bf16, 111, 1024, 1023, heads="mqa", window=(16, 16)),
    Case(fp16, 256, 128, 217, heads="gqa", softcap=30.0, alibi="bh"),
    Case(bf16, 40, 1023, 1024, causal=True, window=(64, -1), layout="transposed"),
    Case(fp16, 192, 1, 239, heads="mqa", causal=True),
]


@pytest.mark.parametrize("case", LSE_CASES, ids=lambda c: c.id)
def test_lse_gradient(case):
    """A loss that uses lse as well as out: d lse_i / d s_ij = P_ij adds to dq and dk."""
    require_kernel(case.d, case.dtype, "bwd")
    q, k, v, alibi = make_inputs(case)
    check_backward(q, k, v, with_lse=True, **case_kwargs(case, alibi))


@pytest.mark.parametrize(
    "dtype, sq, sk, causal, window",
    [(fp16, 200, 50, False, (0, 0)), (bf16, 700, 130, True, (-1, -1)), (fp16, 500, 200, False, (30, 5))],
    ids=["diag", "causal", "local"],
)
def test_rows_that_see_no_key(dtype, sq, sk, causal, window):
    """More query rows than keys, with a right bound: the first sq - sk - right rows see no key (whole query tiles
    of them), the others see one key or a few. Their dq must be exactly 0, with the lse gradient in the loss too."""
    require_kernel(64, dtype, "bwd")
    q, k, v, _ = make_inputs(Case(dtype, 64, sq, sk, heads="gqa"))
    kwargs = dict(causal=causal, window_size=window)
    assert not visibility(q, k, **kwargs)[:128].any()  # the case does what it says
    check_backward(q, k, v, with_lse=True, **kwargs)


@pytest.mark.parametrize("budget", SMEM_BUDGETS, ids=list(SMEM_BUDGETS))
@pytest.mark.parametrize("d", [64, 128, 192, 256], ids=lambda d: f"d{d}")
def test_small_smem_tiles(monkeypatch, d, budget):
    """The fallback tiles, forced on this GPU by capping the shared-memory budget."""
    dtype = bf16 if d in (64, 192) else fp16
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm80")  # the tier of the GPUs whose budgets these are
    require_kernel(d, dtype, "bwd")
    monkeypatch.setenv("FLASH_ATTN_SMEM_BUDGET", str(SMEM_BUDGETS[budget]))
    case = Case(dtype, d, 300, 517, heads="gqa", causal=True, window=(200, -1), alibi="h")
    q, k, v, alibi = make_inputs(case)
    check_backward(q, k, v, **case_kwargs(case, alibi))


@pytest.mark.parametrize("d", [64, 59], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked_matches_unpacked(causal, d):
    """Gradients through the packed tensor are those through separate views of it (deterministic, so bitwise)."""
    dtype = fp16 if causal else bf16
    require_kernel(d, dtype, "bwd")
    qkv = torch.randn(2, 300, 3, 4, d, dtype=dtype, device="cuda", requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=causal, deterministic=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = qkv.detach().unbind(2)
    _, grads = grads_of(q, k, v, dout, causal=causal, deterministic=True)
    assert torch.equal(dqkv, torch.stack(grads, dim=2))
    assert_grads_correct(q, k, v, dout, None, dqkv.unbind(2), causal=causal)


@pytest.mark.parametrize("d", [128, 111], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_kvpacked_matches_unpacked(heads, d):
    dtype = fp16 if heads == "gqa" else bf16
    require_kernel(d, dtype, "bwd")
    h, hk = HEADS[heads]
    kwargs = dict(causal=True, window_size=(50, -1))
    q = torch.randn(2, 257, h, d, dtype=dtype, device="cuda", requires_grad=True)
    kv = torch.randn(2, 300, 2, hk, d, dtype=dtype, device="cuda", requires_grad=True)
    out = flash_attn_kvpacked_func(q, kv, deterministic=True, **kwargs)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    k, v = kv.detach().unbind(2)
    _, grads = grads_of(q, k, v, dout, deterministic=True, **kwargs)
    assert torch.equal(dq, grads[0]) and torch.equal(dkv, torch.stack(grads[1:], dim=2))
    assert_grads_correct(q.detach(), k, v, dout, None, (dq, *dkv.unbind(2)), **kwargs)


@pytest.mark.parametrize("wanted", ["q", "k", "v", "qk", "kv", "qv"])
def test_some_inputs_require_grad(wanted):
    """The gradients asked for are those of a backward through all three (deterministic, so bitwise); the others
    stay None."""
    require_kernel(96, bf16, "bwd")
    q, k, v, _ = make_inputs(Case(bf16, 96, 333, 222, heads="gqa"))
    kwargs = dict(causal=True, window_size=(100, -1))
    dout, _ = cotangents(q, k)
    _, expected = grads_of(q, k, v, dout, deterministic=True, **kwargs)
    inputs = dict(q=q, k=k, v=v)
    for name in wanted:
        inputs[name].requires_grad_()
    out = flash_attn_func(*inputs.values(), deterministic=True, **kwargs)
    poison_allocator(q, k)
    out.backward(dout)
    for name, grad in zip("qkv", expected):
        if name in wanted:
            assert torch.equal(inputs[name].grad, grad), name
        else:
            assert inputs[name].grad is None, name


@pytest.mark.parametrize("b, sq, sk", [(2, 0, 50), (2, 50, 0), (0, 50, 50)], ids=["sq0", "sk0", "b0"])
def test_empty_sequences(b, sq, sk):
    """No key at all, or no query: every gradient is a zero tensor, as for any other input that gets no signal."""
    q = torch.randn(b, sq, 4, 64, dtype=fp16, device="cuda", requires_grad=True)
    k, v = (torch.randn(b, sk, 2, 64, dtype=fp16, device="cuda", requires_grad=True) for _ in range(2))
    out = flash_attn_func(q, k, v)
    out.backward(torch.randn_like(out))
    for x in (q, k, v):
        assert x.grad.shape == x.shape and x.grad.dtype == x.dtype and x.grad.device == x.device
        assert not x.grad.any()


def test_loss_sum_backward():
    """out.sum().backward(): autograd hands dout over as a broadcast view (stride 0 everywhere), which the op copies;
    the gradients equal those of an explicit all-ones dout, bit for bit in deterministic mode."""
    require_kernel(64, bf16, "bwd")
    q, k, v, _ = make_inputs(Case(bf16, 64, 113, 203, heads="gqa"))
    grads = []
    for explicit_dout in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=True, deterministic=True)
        if explicit_dout:
            out.backward(torch.ones_like(out))
        else:
            out.sum().backward()
        grads.append([t.grad for t in leaves])
    for name, g, g_ones in zip(("dq", "dk", "dv"), *grads):
        assert torch.isfinite(g).all() and torch.equal(g, g_ones), name


@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_dout_broadcast_over_batch(d):
    """A dout that is one (seqlen, heads, d) tensor broadcast over the batch (batch stride 0, unit last stride; the
    binding copies such views for the TMA descriptors) gives the gradients of its contiguous copy, bit for bit in
    deterministic mode."""
    require_kernel(d, bf16, "bwd")
    q, k, v, _ = make_inputs(Case(bf16, d, 300, 260, heads="gqa"))
    dout = torch.randn(q.shape[1:], dtype=bf16, device="cuda").expand(q.shape)
    assert dout.stride(0) == 0
    grads = []
    for g in (dout, dout.contiguous()):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, leaves, g))
    for name, g, g_copy in zip(("dq", "dk", "dv"), *grads):
        assert torch.isfinite(g).all() and torch.equal(g, g_copy), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_deterministic(d, causal):
    """deterministic=True: every rerun of the backward gives the same bits."""
    require_kernel(d, bf16, "bwd")
    q, k, v, _ = make_inputs(Case(bf16, d, 1000, 1000, heads="gqa"))
    dout, dlse, first = check_backward(q, k, v, deterministic=True, causal=causal)
    for _ in range(19):
        _, grads = grads_of(q, k, v, dout, dlse, deterministic=True, causal=causal)
        for name, g, g0 in zip(("dq", "dk", "dv"), grads, first):
            assert torch.equal(g, g0), f"{name} differs between runs"


@pytest.mark.parametrize(
    "dtype, d, b, s, h, hk, causal",
    [(fp16, 64, 32, 1024, 16, 4, False), (bf16, 128, 1, 8192, 4, 1, True)],
    ids=["b32-h16", "s8192"],
)
def test_large_problems(dtype, d, b, s, h, hk, causal):
    """Many CTAs (batch x heads) or many key blocks per CTA, where races and index overflows show: two runs of the
    non-deterministic backward, every element checked against the reference."""
    require_kernel(d, dtype, "bwd")
    q = make_tensor("contiguous", b, s, h, d, dtype)
    k, v = (make_tensor("contiguous", b, s, hk, d, dtype) for _ in range(2))
    dout, _ = cotangents(q, k)
    runs = [grads_of(q, k, v, dout, causal=causal)[1] for _ in range(2)]
    assert_grads_correct(q, k, v, dout, None, *runs, causal=causal)


@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize(
    "b, sq, sk, h, hk",
    [(1, 1000, 300, 8, 2), (1, 1024, 8960, 2, 2), (2, 515, 333, 6, 3)],
    ids=["gqa-few-tiles", "past-one-wave", "b2-odd"],
)
def test_split_last_wave(d, b, sq, sk, h, hk):
    """Shapes whose last wave of key tiles the SM90 backward splits into parts that sum dK and dV in the workspace
    (WaveTail: few tiles with many steps each, or 140 tiles on 132 SMs): two runs, each on a workspace that the
    allocator poisoned with NaN, checked against the reference, with the lse gradient."""
    require_kernel(d, bf16, "bwd")
    q = make_tensor("contiguous", b, sq, h, d, bf16)
    k, v = (make_tensor("contiguous", b, sk, hk, d, bf16) for _ in range(2))
    dout, dlse = cotangents(q, k, with_lse=True)
    runs = [grads_of(q, k, v, dout, dlse)[1] for _ in range(2)]
    assert_grads_correct(q, k, v, dout, dlse, *runs)


@pytest.mark.parametrize(
    "mask", [{}, {"causal": True}, {"window_size": (300, 40)}], ids=["full", "causal", "window"]
)
def test_tiles_per_persistent_cta(mask):
    """Head dim 64, whose SM90 backward is persistent: about four tiles of keys per CTA, taken from the tile counter
    (under a mask, of different lengths), each with K and V in alternating buffers and its dK and dV stored by the
    store warp while the next tile runs. Two runs into NaN-poisoned memory, checked against the reference."""
    require_kernel(64, bf16, "bwd")
    q, k, v = (make_tensor("contiguous", 4, 2047, 8, 64, bf16) for _ in range(3))
    dout, dlse = cotangents(q, k, with_lse=True, **mask)
    runs = [grads_of(q, k, v, dout, dlse, **mask)[1] for _ in range(2)]
    assert_grads_correct(q, k, v, dout, dlse, *runs, **mask)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    """A model layer compiled in one graph (fullgraph=True fails on a graph break) with the backward op in its
    backward graph; aot_eager runs the same kernels as eager, inductor may round the projections differently."""
    require_kernel(64, bf16, "bwd")
    model = SelfAttention(256, 6, 2, 64, deterministic=True).to("cuda", bf16)
    x = torch.randn(2, 300, 256, dtype=bf16, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)

    eager = output_and_grads(model, list(model.parameters()), x, dy)
    torch._dynamo.reset()
    compiled = output_and_grads(torch.compile(model, fullgraph=True, backend=backend), list(model.parameters()), x, dy)
    for c, e in zip(compiled, eager):
        if backend == "aot_eager":
            assert torch.equal(c, e)
        else:
            torch.testing.assert_close(c, e, rtol=1.6e-2, atol=1e-3)
