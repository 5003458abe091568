"""Seeded random configurations of the three entry points, checked against the fp32 reference as the curated grids
are: the configurations those grids do not reach. Any head dim from 1 to 256, any GQA ratio up to 16 (nheads up to
32), lengths anywhere up to a few thousand with a bias to tile edges, every mask, softcap, ALiBi and layout;
flash_attn_func and flash_attn_varlen_func forward and backward (the lse in the loss at random, deterministic at
random); flash_attn_with_kvcache over page sizes 1-256, split counts, rotary, appended tokens, left padding,
cache_batch_idx and the GQA-packed decode shapes, on the GPU and, with the reference in place of the kernels, through
its Python composition on the CPU.

Each case's id spells its configuration. FLASH_ATTN_RANDOM_SEED draws another grid and FLASH_ATTN_RANDOM_CASES sets
its size (per entry point, default 40), so that a deeper search runs the same checks, e.g.
`FLASH_ATTN_RANDOM_SEED=7 FLASH_ATTN_RANDOM_CASES=400 pytest -m cuda tests/test_random_grid.py -n 14`."""

import os
import random

import pytest
import torch

from helpers import (DTYPES, HEAD_DIMS, MASKS, Case, VarlenCase, case_kwargs, head_counts, make_inputs,
                     make_varlen_inputs, require_kernel)
from test_bwd import check_backward
from test_kvcache import check_case
from test_varlen import VARLEN_MASKS
from test_varlen import check_backward as check_varlen_backward

SEED = int(os.environ.get("FLASH_ATTN_RANDOM_SEED", "0"))
COUNT = int(os.environ.get("FLASH_ATTN_RANDOM_CASES", "40"))
# Reference score elements per case (b x h x sq x sk): bounds the time and memory of the fp32 and low-precision
# references.
SCORES = 2**24
TILE_EDGES = (15, 16, 17, 63, 64, 65, 79, 80, 81, 127, 128, 129, 175, 176, 177, 191, 192, 193, 255, 256, 257)


def _length(rng, high):
    r = rng.random()
    if r < 0.08:
        return 1
    if r < 0.35:
        return min(rng.choice(TILE_EDGES), high)
    return rng.randint(2, high)


def _head_dim(rng):
    return rng.choice(HEAD_DIMS) if rng.random() < 0.5 else rng.randint(1, 256)


def _heads(rng):
    """"h{h}k{hk}": hk in 1-8, h / hk in 1-16, h at most 32."""
    hk = rng.choice((1, 1, 2, 3, 4, 8))
    ratio = rng.choice([r for r in (1, 2, 3, 4, 5, 6, 7, 8, 16) if hk * r <= 32])
    return f"h{hk * ratio}k{hk}"


def _mask(rng, masks):
    r = rng.random()
    if r < 0.3:
        return False, (-1, -1)
    if r < 0.7:
        _, causal, window = rng.choice(masks)
        return causal, window
    side = lambda: rng.choice((-1, 0, rng.randint(0, 300)))  # noqa: E731
    return rng.random() < 0.3, (side(), side())


def _mods(rng):
    return dict(softcap=rng.choice((0.0, 0.0, 0.0, 5.0, 30.0)), alibi=rng.choice((None, None, None, "h", "bh")))


def batched_case(i):
    rng = random.Random(f"batched-{SEED}-{i}")
    heads = _heads(rng)
    h, _ = head_counts(heads)
    b = rng.randint(1, 3)
    sq, sk = _length(rng, 3000), _length(rng, 3000)
    while b * h * sq * sk > SCORES:
        sq, sk = max(1, sq // 2), max(1, sk // 2)
    causal, window = _mask(rng, MASKS)
    case = Case(rng.choice(DTYPES), _head_dim(rng), sq, sk, heads=heads, causal=causal, window=window,
                layout=rng.choice(("contiguous", "contiguous", "transposed", "sliced", "misaligned")), b=b,
                **_mods(rng))
    return case, rng.random() < 0.3, rng.random() < 0.2  # with the lse in the loss, deterministic


def varlen_case(i):
    rng = random.Random(f"varlen-{SEED}-{i}")
    heads = _heads(rng)
    h, _ = head_counts(heads)
    b = rng.randint(1, 6)
    lengths = lambda: tuple(0 if rng.random() < 0.1 else _length(rng, 1500) for _ in range(b))  # noqa: E731
    seqlens_q = lengths()
    seqlens_k = seqlens_q if rng.random() < 0.4 else lengths()
    while h * sum(q * k for q, k in zip(seqlens_q, seqlens_k)) > SCORES:
        seqlens_q, seqlens_k = tuple(q // 2 for q in seqlens_q), tuple(k // 2 for k in seqlens_k)
    used = lambda lengths: tuple(rng.choice((s, 0, rng.randint(0, s))) for s in lengths)  # noqa: E731
    seqused_q = used(seqlens_q) if rng.random() < 0.25 else None
    seqused_k = used(seqlens_k) if rng.random() < 0.25 else None
    causal, window = _mask(rng, VARLEN_MASKS)
    case = VarlenCase(rng.choice(DTYPES), _head_dim(rng), seqlens_q, seqlens_k, heads=heads, causal=causal,
                      window=window, seqused_q=seqused_q, seqused_k=seqused_k,
                      tail_q=rng.choice((0, 0, 17)) if seqused_q is not None else 0,
                      tail_k=rng.choice((0, 0, 17)) if seqused_k is not None else 0,
                      layout=rng.choice(("contiguous", "contiguous", "sliced")), mix=f"rand{i}", **_mods(rng))
    return case, rng.random() < 0.3


def kvcache_case(i):
    """(run_case's positional case, its keyword arguments)."""
    rng = random.Random(f"kvcache-{SEED}-{i}")
    heads = _heads(rng)
    h, hk = head_counts(heads)
    d = rng.choice((32, 64, 96, 128, 256, rng.randint(8, 256)))
    page_size = rng.choice((None, None, 1, 3, 16, 48, 64, 128, 256))
    batch_idx = page_size is None and rng.random() < 0.3
    b = 3 if batch_idx else rng.randint(1, 4)  # run_case's cache_batch_idx is [4, 0, 2]
    sq = rng.choice((1, 1, 1, 2, 3, 4, 5, 8, 16, rng.randint(1, 300)))
    s_new = rng.choice((0, 0, 1, sq, rng.randint(0, 64)))
    cache_len = rng.choice((s_new + 1, rng.randint(s_new + 1, 600), rng.randint(s_new + 1, 9000)))
    if page_size:
        cache_len = -(-cache_len // page_size) * page_size
    while b * h * sq * cache_len > SCORES // 4 and sq > 1:  # the reference runs on the CPU
        sq = max(1, sq // 2)
    causal, window = _mask(rng, MASKS)
    rotary = None
    if d >= 2 and rng.random() < 0.4:
        rotary = (rng.choice((d // 2 * 2, max(2, d // 4 * 2))), rng.random() < 0.5)
        sq = min(sq, s_new + 4)  # q's rotary positions run to cache_seqlens + sq - 1 < the table's cache_len + 4
    mods = _mods(rng)
    case = (sq, s_new, causal, window, rotary, rng.random() < 0.2, batch_idx, page_size)
    extra = dict(d=d, b=b, h=h, hk=hk, cache_len=cache_len, softcap=mods["softcap"], alibi=mods["alibi"] is not None,
                 num_splits=rng.choice((0, 0, 1, rng.randint(2, 16))))
    return case, extra


def _kvcache_id(i):
    (sq, s_new, causal, window, rotary, leftpad, batch_idx, page_size), extra = kvcache_case(i)
    parts = [f"d{extra['d']}", f"b{extra['b']}", f"sq{sq}", f"new{s_new}", f"cache{extra['cache_len']}",
             f"h{extra['h']}k{extra['hk']}", f"splits{extra['num_splits']}"]
    parts += [f"page{page_size}"] if page_size else []
    parts += ["causal"] if causal else []
    parts += [f"win{window[0]}_{window[1]}"] if window != (-1, -1) else []
    parts += [f"rot{rotary[0]}{'i' if rotary[1] else ''}"] if rotary else []
    parts += ["leftpad"] * leftpad + ["batch_idx"] * batch_idx
    parts += [f"cap{extra['softcap']:g}"] if extra["softcap"] else []
    parts += ["alibi"] if extra["alibi"] else []
    return "-".join(parts)


@pytest.mark.cuda
@pytest.mark.parametrize("i", range(COUNT), ids=lambda i: f"{i}-{batched_case(i)[0].id}")
def test_batched(i):
    case, with_lse, deterministic = batched_case(i)
    require_kernel(case.d, case.dtype, "bwd")
    q, k, v, alibi = make_inputs(case)
    check_backward(q, k, v, with_lse, deterministic, **case_kwargs(case, alibi))


@pytest.mark.cuda
@pytest.mark.parametrize("i", range(COUNT), ids=lambda i: f"{i}-{varlen_case(i)[0].id}")
def test_varlen(i):
    case, with_lse = varlen_case(i)
    require_kernel(case.d, case.dtype, "bwd")
    check_varlen_backward(case, make_varlen_inputs(case), with_lse)


@pytest.mark.cuda
@pytest.mark.parametrize("i", range(COUNT), ids=lambda i: f"{i}-{_kvcache_id(i)}")
def test_kvcache(i):
    case, extra = kvcache_case(i)
    check_case(case, "cuda", **extra)


@pytest.mark.parametrize("i", range(COUNT), ids=lambda i: f"{i}-{_kvcache_id(i)}")
def test_kvcache_composition_cpu(stub_kernel, i):
    """The same configurations through the Python around the kernels (the append, rotary, pages, splits and GQA
    packing), with the reference in place of the kernels: the cache rows exact, out and lse as the reference's."""
    case, extra = kvcache_case(i)
    check_case(case, "cpu", **extra)
