"""Variable-length (varlen) batches on the GPU: flash_attn_varlen_func against a per-sequence fp32 reference.

Each sequence is checked on its own: its used rows of q/k/v are sliced out and run through the batched reference
with batch 1 (masks aligned bottom-right to the sequence's used lengths, its own ALiBi slopes), and the kernel must be
within twice (forward: out, lse) / three times (gradients: dq, dk, dv) PyTorch's own same-dtype error on that same
sequence, plus fp32 rounding. Rows past seqused_q/seqused_k (and rows after the last sequence, with seqused) must be
out 0, lse -inf and zero gradients. Results are computed into a NaN-poisoned allocator, so a row the kernel must write
but does not stays NaN, and NaN never passes a check.

The grid crosses length mixes (0 and 1 in q only, k only and both; lengths around the 64/128 tiles; one long
sequence among short ones; sq > sk and sq < sk per sequence) with every mask, head dims, dtypes, GQA/MQA, softcap,
ALiBi and seqused, plus a seeded random grid; focused tests cover the lse gradient, determinism, bitwise equality
with the batched path on equal lengths, empty batches, max_seqlen as a mere hint, packed variants, torch.compile and
malformed cu_seqlens (last: a kernel fault there would poison the CUDA context for the tests after it)."""

import itertools
import random

import pytest
import torch

import flash_attention
import flash_attention.cute
from flash_attention import flash_attn_func
from helpers import (DTYPES, HEAD_DIMS, HEADS, SMEM_BUDGETS, VarlenCase, assert_varlen_grads_correct,
                     assert_varlen_matches_reference, bf16, cumulative, fp16, int32_cuda, make_varlen_inputs,
                     poison_allocator_varlen, require_kernel, varlen_cotangents, varlen_kwargs)

pytestmark = pytest.mark.cuda


def varlen_func(*args, **kwargs):
    """flash_attention.flash_attn_varlen_func, looked up at call time so that this file collects (on CPU too) before
    the API lands."""
    return flash_attention.flash_attn_varlen_func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------------------------------
# The grid

def _random_lengths(seed, n, low, high):
    rng = random.Random(seed)
    return tuple(rng.randint(low, high) for _ in range(n))


# name: (seqlens_q, seqlens_k)
MIXES = {
    "zeros_q": ((0, 37, 0, 200, 1), (50, 37, 10, 200, 1)),  # sequences with no query (but keys)
    "zeros_k": ((37, 5, 200, 1, 64), (0, 5, 0, 1, 64)),  # sequences whose rows see no key
    "zeros_both": ((0, 3, 0, 1, 65, 0), (0, 0, 7, 1, 65, 0)),  # empty sequences, first and last too
    "ones": ((1, 1, 1, 64, 1), (1, 5, 1, 64, 300)),
    "tiles": ((63, 64, 65, 127, 128, 129), (63, 64, 65, 127, 128, 129)),
    "tiles_cross": ((63, 128, 129, 64, 65, 127), (129, 65, 127, 128, 63, 64)),
    "q_longer": ((300, 129, 65, 1000), (17, 64, 1, 999)),  # sq > sk in every sequence
    "k_longer": ((17, 64, 1, 999), (300, 129, 65, 1000)),  # sq < sk in every sequence
    "single": ((777,), (555,)),
    "many": (_random_lengths(1, 48, 0, 200), _random_lengths(2, 48, 0, 200)),
}
LONG_MIX = ((3, 4097, 100, 1), (5, 4097, 64, 1))  # one very long sequence among short ones

# (name, causal, window_size)
VARLEN_MASKS = (
    ("causal", True, (-1, -1)),
    ("causal-left64", True, (64, -1)),
    ("local16", False, (16, 16)),
    ("diag", False, (0, 0)),
    ("left100", False, (100, -1)),
    ("right37", False, (-1, 37)),
    ("asym3_50", False, (3, 50)),
    ("asym50_0", False, (50, 0)),
    ("causal-as-window", False, (-1, 0)),
)


def build_varlen_cases():
    uses = {}

    def pick(values):
        """Cycle through the values of an axis that a group of cases does not sweep."""
        n = uses[values] = uses.get(values, -1) + 1
        return values[n % len(values)]

    heads = tuple(HEADS)
    cases = []
    # Every head dim in both dtypes, with and without the causal mask, on tile-straddling lengths with sq != sk.
    for dtype, d, causal in itertools.product(DTYPES, HEAD_DIMS, (False, True)):
        cases.append(VarlenCase(dtype, d, *MIXES["tiles_cross"], heads="gqa" if causal else "mha", causal=causal,
                                mix="tiles_cross"))
    # Every length mix, with and without the causal mask.
    for (mix, (sq, sk)), causal in itertools.product(MIXES.items(), (False, True)):
        cases.append(VarlenCase(pick(DTYPES), pick(HEAD_DIMS), sq, sk, heads=pick(heads), causal=causal, mix=mix))
    # Every mask on the risky mixes.
    for (_, causal, window), mix in itertools.product(VARLEN_MASKS, ("zeros_k", "tiles_cross", "q_longer",
                                                                      "k_longer", "ones")):
        cases.append(VarlenCase(pick(DTYPES), pick(HEAD_DIMS), *MIXES[mix], heads=pick(heads), causal=causal,
                                window=window, mix=mix))
    # Softcap.
    for softcap, causal, mix in itertools.product((5.0, 30.0), (False, True), ("tiles_cross", "k_longer")):
        cases.append(VarlenCase(pick(DTYPES), pick(HEAD_DIMS), *MIXES[mix], heads=pick(heads), causal=causal,
                                softcap=softcap, mix=mix))
    # ALiBi, (nheads,) and (num sequences, nheads), with masks.
    for alibi, (_, causal, window), mix in itertools.product(("h", "bh"), VARLEN_MASKS[:3], ("zeros_q", "q_longer")):
        cases.append(VarlenCase(pick(DTYPES), pick(HEAD_DIMS), *MIXES[mix], heads=pick(heads), causal=causal,
                                window=window, alibi=alibi, mix=mix))
    # seqused: the masks align to the used lengths; rows past them (and a tail in no sequence) get 0 / -inf.
    sq, sk = MIXES["tiles_cross"]
    used_q = (0, 100, 129, 1, 64, 65)
    used_k = (129, 0, 64, 128, 1, 63)
    for i, (uq, uk, tail) in enumerate(((used_q, None, 0), (None, used_k, 0), (used_q, used_k, 0),
                                        (used_q, used_k, 37), (sq, sk, 5))):
        for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (20, 3))):
            cases.append(VarlenCase(pick(DTYPES), pick(HEAD_DIMS), sq, sk, heads=pick(heads), causal=causal,
                                    window=window, alibi="bh" if i == 3 else None, seqused_q=uq, seqused_k=uk,
                                    tail_q=tail if uq is not None else 0, tail_k=tail if uk is not None else 0,
                                    mix="tiles_cross"))
    # Strided views (the last dimension contiguous, the others not), including a head dim that gets padded.
    for d, causal in itertools.product((59, 128), (False, True)):
        cases.append(VarlenCase(pick(DTYPES), d, *MIXES["zeros_q"], heads="gqa", causal=causal, layout="sliced",
                                mix="zeros_q"))
    # One long sequence among short ones.
    for d, causal in itertools.product((64, 96, 128, 192, 256), (False, True)):
        cases.append(VarlenCase(pick(DTYPES), d, *LONG_MIX, heads="mqa", causal=causal, mix="long"))
    # Everything at once.
    for dtype, d in zip(DTYPES, (40, 224)):
        cases.append(VarlenCase(dtype, d, *MIXES["tiles_cross"], heads="gqa", causal=True, window=(100, -1),
                                softcap=20.0, alibi="bh", seqused_q=used_q, seqused_k=used_k, tail_q=3, tail_k=9,
                                layout="sliced", mix="tiles_cross"))
    cases += random_cases(32, seed=2024)
    return list(dict.fromkeys(cases))


def random_cases(n, seed):
    """A seeded random grid: 1-8 sequences with lengths from a mix of 0, 1, tile boundaries and anything up to 700,
    equal or independent per side, random masks, heads, dtypes, head dims, softcap, ALiBi and seqused."""
    rng = random.Random(seed)

    def length():
        r = rng.random()
        if r < 0.1:
            return 0
        if r < 0.2:
            return 1
        if r < 0.45:
            return rng.choice((63, 64, 65, 127, 128, 129, 255, 256, 257))
        return rng.randint(2, 700)

    def used(lengths):
        return tuple(rng.choice((s, 0, rng.randint(0, s))) for s in lengths)

    cases = []
    for i in range(n):
        b = rng.randint(1, 8)
        sq = tuple(length() for _ in range(b))
        sk = sq if rng.random() < 0.4 else tuple(length() for _ in range(b))
        r = rng.random()
        if r < 0.3:
            causal, window = False, (-1, -1)
        elif r < 0.7:
            _, causal, window = rng.choice(VARLEN_MASKS)
        else:
            causal, window = rng.random() < 0.3, (rng.choice((-1, 0, rng.randint(0, 300))),
                                                  rng.choice((-1, 0, rng.randint(0, 300))))
        seqused_q = used(sq) if rng.random() < 0.25 else None
        seqused_k = used(sk) if rng.random() < 0.25 else None
        cases.append(VarlenCase(
            rng.choice(DTYPES), rng.choice(HEAD_DIMS), sq, sk, heads=rng.choice(tuple(HEADS)), causal=causal,
            window=window, softcap=rng.choice((0.0, 0.0, 0.0, 10.0)), alibi=rng.choice((None, None, None, "h", "bh")),
            seqused_q=seqused_q, seqused_k=seqused_k,
            tail_q=rng.choice((0, 0, 17)) if seqused_q is not None else 0,
            tail_k=rng.choice((0, 0, 17)) if seqused_k is not None else 0,
            mix=f"rand{i}"))
    return cases


CASES = build_varlen_cases()


# ---------------------------------------------------------------------------------------------------------------------
# Running and checking

def run_forward(case, inputs, **extra):
    kwargs = varlen_kwargs(case, inputs)
    kwargs.update(extra)
    return varlen_func(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens_q, inputs.cu_seqlens_k, inputs.max_seqlen_q,
                       inputs.max_seqlen_k, return_attn_probs=True, **kwargs)


def varlen_grads(case, inputs, dout, dlse=None, deterministic=False, **extra):
    """Run flash_attn_varlen_func on fresh leaves of q, k, v; return (out, lse) and its (dq, dk, dv) for dout (and
    dlse when the loss uses lse), the backward computed into a NaN-poisoned allocator."""
    leaves = [t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    kwargs = varlen_kwargs(case, inputs)
    kwargs.update(extra)
    out, lse, _ = varlen_func(*leaves, inputs.cu_seqlens_q, inputs.cu_seqlens_k, inputs.max_seqlen_q,
                              inputs.max_seqlen_k, deterministic=deterministic, return_attn_probs=True, **kwargs)
    poison_allocator_varlen(inputs.q, inputs.k, case.b)
    if dlse is None:
        grads = torch.autograd.grad(out, leaves, dout)
    else:
        grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    return (out.detach(), lse.detach()), grads


def check_backward(case, inputs, with_lse=False, deterministic=False):
    """Forward and backward against the per-sequence reference; returns dout, dlse and the gradients."""
    dout, dlse = varlen_cotangents(case, inputs, with_lse)
    (out, lse), grads = varlen_grads(case, inputs, dout, dlse, deterministic)
    assert_varlen_matches_reference(out, lse, case, inputs)
    assert_varlen_grads_correct(case, inputs, dout, dlse, grads)
    return dout, dlse, grads


# ---------------------------------------------------------------------------------------------------------------------
# Forward and backward grids

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward(case):
    require_kernel(case.d, case.dtype)
    inputs = make_varlen_inputs(case)
    poison_allocator_varlen(inputs.q, inputs.k, case.b)
    out, lse, none = run_forward(case, inputs)
    assert none is None
    assert lse.is_contiguous()
    assert_varlen_matches_reference(out, lse, case, inputs)
    # A second run must agree bit for bit: the forward pass is deterministic, and a race would show here.
    out2, lse2, _ = run_forward(case, inputs)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_backward(case):
    require_kernel(case.d, case.dtype, "bwd")
    check_backward(case, make_varlen_inputs(case))


LSE_CASES = [
    VarlenCase(bf16, 64, *MIXES["tiles_cross"], mix="tiles_cross"),
    VarlenCase(fp16, 128, *MIXES["q_longer"], heads="gqa", causal=True, mix="q_longer"),  # many rows see no key
    VarlenCase(bf16, 111, *MIXES["zeros_k"], heads="mqa", window=(16, 16), mix="zeros_k"),
    VarlenCase(fp16, 256, *MIXES["ones"], heads="gqa", softcap=30.0, alibi="bh", mix="ones"),
    VarlenCase(bf16, 59, *MIXES["tiles_cross"], causal=True, seqused_q=(0, 100, 129, 1, 64, 65),
               seqused_k=(129, 0, 64, 128, 1, 63), tail_q=5, tail_k=5, mix="tiles_cross"),
    VarlenCase(fp16, 192, *LONG_MIX, heads="mqa", causal=True, window=(300, -1), mix="long"),
]


@pytest.mark.parametrize("case", LSE_CASES, ids=lambda c: c.id)
def test_lse_gradient(case):
    """A loss that uses lse as well as out: d lse_i / d s_ij = P_ij adds to dq and dk."""
    require_kernel(case.d, case.dtype, "bwd")
    check_backward(case, make_varlen_inputs(case), with_lse=True)


@pytest.mark.parametrize("d, dtype", [(64, bf16), (128, fp16), (256, bf16)], ids=["d64", "d128", "d256"])
def test_many_short_sequences(d, dtype):
    """200 sequences of 0-40 rows (many CTAs with little work each, sequence lookups at every tile) and one of 700."""
    require_kernel(d, dtype, "bwd")
    sq = _random_lengths(3, 200, 0, 40) + (700,)
    sk = _random_lengths(4, 200, 0, 40) + (700,)
    case = VarlenCase(dtype, d, sq, sk, heads="gqa", causal=True, mix="many200")
    check_backward(case, make_varlen_inputs(case))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_deterministic(d, causal):
    """deterministic=True: every rerun of the backward gives the same bits (GQA: several query heads add into one
    dk/dv; a long sequence: many key blocks add into one dq tile)."""
    require_kernel(d, bf16, "bwd")
    case = VarlenCase(bf16, d, (1000, 65, 0, 1, 1500), (1000, 129, 3, 0, 1500), heads="gqa", causal=causal,
                      mix="det")
    inputs = make_varlen_inputs(case)
    dout, dlse, first = check_backward(case, inputs, deterministic=True)
    for _ in range(9):
        _, grads = varlen_grads(case, inputs, dout, dlse, deterministic=True)
        for name, g, g0 in zip(("dq", "dk", "dv"), grads, first):
            assert torch.equal(g, g0), f"{name} differs between runs"


@pytest.mark.parametrize("budget", SMEM_BUDGETS, ids=list(SMEM_BUDGETS))
@pytest.mark.parametrize("d", [64, 128, 192, 256], ids=lambda d: f"d{d}")
def test_small_smem_tiles(monkeypatch, d, budget):
    """The fallback tiles of smaller GPUs, forced on this GPU by capping the shared-memory budget."""
    dtype = bf16 if d in (64, 192) else fp16
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm80")  # the tier of the GPUs whose budgets these are
    require_kernel(d, dtype, "bwd")
    monkeypatch.setenv("FLASH_ATTN_SMEM_BUDGET", str(SMEM_BUDGETS[budget]))
    case = VarlenCase(dtype, d, *MIXES["tiles_cross"], heads="gqa", causal=True, window=(100, -1), alibi="h",
                      mix="tiles_cross")
    check_backward(case, make_varlen_inputs(case))


# ---------------------------------------------------------------------------------------------------------------------
# Equal lengths: the varlen path gives the batched path's bits

EQUIVALENCE = [
    # (dtype, d, b, s, heads, kwargs)
    (fp16, 64, 3, 300, "mha", {}),
    (bf16, 128, 2, 1000, "gqa", dict(causal=True)),
    (bf16, 59, 4, 129, "mqa", dict(window_size=(50, 10))),
    (fp16, 256, 2, 257, "gqa", dict(causal=True, softcap=20.0, alibi="bh")),
    (bf16, 192, 2, 2112, "mha", dict(alibi="h")),  # past 2048 keys: large head dims switch tiles there
    (bf16, 96, 5, 64, "gqa", dict(causal=True, window_size=(16, -1))),
]


@pytest.mark.parametrize("dtype, d, b, s, heads, kwargs", EQUIVALENCE,
                         ids=[f"d{d}-b{b}-s{s}-{heads}-" + ("_".join(kw) or "full")
                              for _, d, b, s, heads, kw in EQUIVALENCE])
def test_equal_lengths_match_batched(dtype, d, b, s, heads, kwargs):
    """Sequences of one length: out and lse equal flash_attn_func's on the (b, s, h, d) view bit for bit, and so do
    the gradients of the deterministic backward (also with the lse in the loss)."""
    require_kernel(d, dtype, "bwd")
    h, hk = HEADS[heads]
    kwargs = dict(kwargs)
    alibi = kwargs.pop("alibi", None)
    if alibi is not None:
        kwargs["alibi_slopes"] = torch.rand(*((b, h) if alibi == "bh" else (h,)), device="cuda") * 0.3
    q = torch.randn(b, s, h, d, dtype=dtype, device="cuda")
    k, v = (torch.randn(b, s, hk, d, dtype=dtype, device="cuda") for _ in range(2))
    dout = torch.randn_like(q)
    dlse = torch.randn(b, h, s, device="cuda")
    cu = int32_cuda(range(0, (b + 1) * s, s))

    def run(varlen):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if varlen:
            out, lse, _ = varlen_func(*(t.view(b * s, *t.shape[2:]) for t in leaves), cu, cu, s, s,
                                      deterministic=True, return_attn_probs=True, **kwargs)
            out, lse = out.view(b, s, h, d), lse.view(h, b, s).transpose(0, 1)
        else:
            out, lse, _ = flash_attn_func(*leaves, deterministic=True, return_attn_probs=True, **kwargs)
        grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
        return out.detach(), lse.detach(), grads

    out, lse, grads = run(varlen=True)
    ref_out, ref_lse, ref_grads = run(varlen=False)
    assert torch.equal(out, ref_out), "out differs from the batched path's"
    assert torch.equal(lse, ref_lse), "lse differs from the batched path's"
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.equal(g, g_ref), f"{name} differs from the batched path's"


# ---------------------------------------------------------------------------------------------------------------------
# API edges

@pytest.mark.parametrize("sq, sk", [((0, 0, 0), (5, 0, 300)), ((5, 1, 300), (0, 0, 0)), ((0, 0), (0, 0)), ((), ())],
                         ids=["no_query", "no_key", "none", "b0"])
def test_empty(sq, sk):
    """No query row at all, no key row at all, or no sequence: no kernel runs; out has q's shape and is 0, lse is
    -inf, and every gradient is a zero tensor."""
    h, hk, d = 4, 2, 64
    q = torch.randn(sum(sq), h, d, dtype=fp16, device="cuda", requires_grad=True)
    k, v = (torch.randn(sum(sk), hk, d, dtype=fp16, device="cuda", requires_grad=True) for _ in range(2))
    out, lse, _ = varlen_func(q, k, v, int32_cuda(cumulative(sq)), int32_cuda(cumulative(sk)), max(sq, default=0),
                              max(sk, default=0), causal=True, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and not out.any()
    assert lse.shape == (h, sum(sq)) and lse.dtype == torch.float32 and (lse == float("-inf")).all()
    out.backward(torch.randn_like(out))
    for x in (q, k, v):
        assert x.grad.shape == x.shape and x.grad.dtype == x.dtype and x.grad.device == x.device
        assert not x.grad.any()


@pytest.mark.parametrize("hint", ["one", "huge"])
def test_max_seqlen_is_only_a_hint(hint):
    """max_seqlen_q/k only pick tiles: far too small (which must not, for instance, let a window bound count as
    unbounded) or far too large, the results are right."""
    require_kernel(64, bf16, "bwd")
    case = VarlenCase(bf16, 64, (300, 5, 129), (200, 7, 700), heads="gqa", window=(5, 3), alibi="h", mix="hint")
    inputs = make_varlen_inputs(case)
    inputs.max_seqlen_q = inputs.max_seqlen_k = {"one": 1, "huge": 1 << 20}[hint]
    check_backward(case, inputs, with_lse=True)


def test_return_attn_probs():
    require_kernel(64, bf16)
    case = VarlenCase(bf16, 64, (100, 0, 37), (50, 3, 37), mix="rap")
    inputs = make_varlen_inputs(case)
    args = (inputs.q, inputs.k, inputs.v, inputs.cu_seqlens_q, inputs.cu_seqlens_k, 100, 50)
    out = varlen_func(*args, causal=True)
    result = varlen_func(*args, causal=True, return_attn_probs=True)
    assert isinstance(out, torch.Tensor) and len(result) == 3 and result[2] is None
    assert torch.equal(result[0], out)
    assert result[1].shape == (4, 137) and result[1].dtype == torch.float32 and result[1].is_contiguous()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qkvpacked_matches_unpacked(causal):
    """flash_attn_varlen_qkvpacked_func on qkv (total, 3, h, d) is flash_attn_varlen_func on its strided views
    (deterministic, so the gradients too bit for bit)."""
    require_kernel(59, bf16, "bwd")
    lengths = (129, 0, 1, 300)
    cu = int32_cuda(cumulative(lengths))
    qkv = torch.randn(sum(lengths), 3, 4, 59, dtype=bf16, device="cuda", requires_grad=True)
    out = flash_attention.flash_attn_varlen_qkvpacked_func(qkv, cu, 300, causal=causal, deterministic=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    leaves = [t.detach().clone().requires_grad_() for t in qkv.unbind(1)]
    ref = varlen_func(*leaves, cu, cu, 300, 300, causal=causal, deterministic=True)
    grads = torch.autograd.grad(ref, leaves, dout)
    assert torch.equal(out, ref) and torch.equal(dqkv, torch.stack(grads, dim=1))


@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_kvpacked_matches_unpacked(heads):
    require_kernel(128, fp16, "bwd")
    h, hk = HEADS[heads]
    sq, sk = (65, 300, 0, 7), (200, 64, 5, 0)
    cu_q, cu_k = int32_cuda(cumulative(sq)), int32_cuda(cumulative(sk))
    kwargs = dict(causal=True, window_size=(50, -1), deterministic=True)
    q = torch.randn(sum(sq), h, 128, dtype=fp16, device="cuda", requires_grad=True)
    kv = torch.randn(sum(sk), 2, hk, 128, dtype=fp16, device="cuda", requires_grad=True)
    out = flash_attention.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 300, 200, **kwargs)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    leaves = [q.detach().clone().requires_grad_()] + [t.detach().clone().requires_grad_() for t in kv.unbind(1)]
    ref = varlen_func(*leaves, cu_q, cu_k, 300, 200, **kwargs)
    grads = torch.autograd.grad(ref, leaves, dout)
    assert torch.equal(out, ref)
    assert torch.equal(dq, grads[0]) and torch.equal(dkv, torch.stack(grads[1:], dim=1))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tensor_window_and_max_seqlen(device):
    """window_size as flash-attn 2's tests draw it, torch.randint(0, seqlen_k, (2,)), and max_seqlen_q/k as tensors
    (as Hugging Face passes them to FlashAttention-4), on the CPU or the GPU: the same results as Python ints, for the
    packed functions and flash_attention.cute too."""
    require_kernel(64, bf16)
    torch.manual_seed(0)
    lengths = (65, 300, 0, 7)
    cu = int32_cuda(cumulative(lengths))
    window = torch.randint(0, 300, (2,), device=device)
    max_seqlen = torch.tensor(300, device=device)
    pair = tuple(window.tolist())
    hint = 300 if device == "cpu" else sum(lengths)  # a GPU tensor is not read: the total rows stand in
    qkv = torch.randn(sum(lengths), 3, 4, 64, dtype=bf16, device="cuda")
    q, k, v = (t.contiguous() for t in qkv.unbind(1))
    expected = varlen_func(q, k, v, cu, cu, hint, hint, causal=True, window_size=pair)
    assert torch.equal(varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, window_size=window), expected)
    assert torch.equal(flash_attention.flash_attn_varlen_qkvpacked_func(qkv, cu, max_seqlen, causal=True,
                                                                        window_size=window), expected)
    assert torch.equal(flash_attention.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, max_seqlen, max_seqlen,
                                                                       causal=True, window_size=window), expected)
    out, _ = flash_attention.cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                         max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                                         causal=True, window_size=window)
    assert torch.equal(out, expected)


def test_some_inputs_require_grad():
    """Only k requires grad: its gradient is that of a backward through all three (deterministic, so bitwise)."""
    require_kernel(96, bf16, "bwd")
    case = VarlenCase(bf16, 96, (333, 0, 20), (222, 5, 0), heads="gqa", causal=True, mix="some")
    inputs = make_varlen_inputs(case)
    dout, _ = varlen_cotangents(case, inputs)
    _, expected = varlen_grads(case, inputs, dout, deterministic=True)
    k = inputs.k.detach().clone().requires_grad_()
    out = varlen_func(inputs.q, k, inputs.v, inputs.cu_seqlens_q, inputs.cu_seqlens_k, 333, 222, causal=True,
                      deterministic=True)
    out.backward(dout)
    assert torch.equal(k.grad, expected[1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    """A varlen forward + backward step compiled in one graph (fullgraph=True fails on a graph break), with seqused_k
    and the lse in the loss; the ops around the kernels are exact, so compiled equals eager bit for bit."""
    require_kernel(64, bf16, "bwd")
    case = VarlenCase(bf16, 64, (200, 0, 65), (300, 7, 64), heads="gqa", causal=True, seqused_k=(250, 7, 1),
                      mix="compile")
    inputs = make_varlen_inputs(case)
    dout, dlse = varlen_cotangents(case, inputs, with_lse=True)

    def step(q, k, v, cu_q, cu_k, seqused_k):
        out, lse, _ = varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True, deterministic=True,
                                  seqused_k=seqused_k, return_attn_probs=True)
        return out * 2, lse

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
        out, lse = fn(*leaves, inputs.cu_seqlens_q, inputs.cu_seqlens_k, inputs.seqused_k)
        return (out.detach(), lse.detach(), *torch.autograd.grad((out, lse), leaves, (dout / 2, dlse)))

    eager = run(step)
    torch._dynamo.reset()
    compiled = run(torch.compile(step, fullgraph=True, backend=backend))
    for name, c, e in zip(("out", "lse", "dq", "dk", "dv"), compiled, eager):
        assert torch.equal(c, e), name
    # And eager is right (out * 2 and dout / 2 are exact).
    assert_varlen_matches_reference(eager[0] / 2, eager[1], case, inputs)
    assert_varlen_grads_correct(case, inputs, dout, dlse, eager[2:])


# ---------------------------------------------------------------------------------------------------------------------
# Malformed cu_seqlens: last in the file, as a fault here would poison the CUDA context of every later test

@pytest.mark.parametrize("bad", ["past_end", "decreasing", "negative", "huge_seqused"])
def test_malformed_cu_seqlens(monkeypatch, bad):
    """cu_seqlens (or seqused) out of range are not checked (that would need a device sync); the kernels clamp them
    to the tensors' rows: no fault, no hang (the numbers are unspecified). A valid call afterwards is right."""
    require_kernel(64, bf16, "bwd")
    monkeypatch.delenv("FLASH_ATTN_CHECK_VARLEN", raising=False)  # the opt-in value check would reject them
    h, hk, d = 4, 2, 64
    total_q, total_k = 300, 400
    cu_q, cu_k = [0, 100, 300], [0, 150, 400]
    seqused_k = None
    if bad == "past_end":
        cu_q, cu_k = [0, 100, 1 << 20], [0, 150, 1 << 30]
    elif bad == "decreasing":
        cu_q, cu_k = [0, 250, 100], [0, 390, 20]
    elif bad == "negative":
        cu_q, cu_k = [-50, 100, 300], [0, -150, 400]
    else:
        seqused_k = int32_cuda([1 << 20, 1 << 30])
    q = torch.randn(total_q, h, d, dtype=bf16, device="cuda", requires_grad=True)
    k, v = (torch.randn(total_k, hk, d, dtype=bf16, device="cuda", requires_grad=True) for _ in range(2))
    for causal in (False, True):
        out = varlen_func(q, k, v, int32_cuda(cu_q), int32_cuda(cu_k), 200, 250, causal=causal, seqused_k=seqused_k)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    case = VarlenCase(bf16, 64, (100, 200), (150, 250), heads="gqa", causal=True, mix="valid")
    check_backward(case, make_varlen_inputs(case))
