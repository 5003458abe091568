"""flash_attn_with_kvcache against a reference written from flash-attn 2's semantics (its own kvcache test's): the new
keys (rotated) and values land in the cache in place at rows cache_seqlens onwards; q is rotated at cache_seqlens
(+ its row when causal or local); the attention sees rows [cache_leftpad, cache_seqlens + seqlen_new), masks aligned
bottom-right with them. The CPU tests run the composition around the attention with the reference in place of the
kernels (conftest.py's stub_kernel); the cuda tests run it on the GPU against fp32."""

import math

import pytest
import torch

from flash_attention import flash_attn_with_kvcache
from helpers import poison_blocks, require_kernel
from reference import attention_ref

bf16, fp16 = torch.bfloat16, torch.float16


def rotate(x, cos, sin, positions, interleaved):
    """x rotated in its first 2 * cos.shape[1] dims at positions (b, s), as complex products (pairs, or the halves as
    real and imaginary parts)."""
    half = cos.shape[1]
    xr = x[..., : 2 * half].double()
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], half, 2).contiguous())
    else:
        z = torch.complex(xr[..., :half], xr[..., half:])
    z = z * torch.complex(cos[positions].double(), sin[positions].double())[:, :, None, :]
    rotated = torch.view_as_real(z).flatten(-2) if interleaved else torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def expected(q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, causal, window, interleaved,
             softcap=0.0, alibi=None, upcast=True):
    """(out, lse, k_rows, v_rows): the reference's output and lse, and each sequence's cache rows after the append
    ((b, cache_len, hk, d), contiguous caches only)."""
    b, sq = q.shape[:2]
    idx = batch_idx.long() if batch_idx is not None else torch.arange(b)
    k_rows, v_rows = k_cache[idx].clone(), v_cache[idx].clone()
    s_new = 0 if k is None else k.shape[1]
    for i in range(b):
        n = int(seqlens[i])
        if k is not None:
            positions = torch.arange(n, n + s_new)[None]
            k_i = k[i:i + 1] if cos is None else rotate(k[i:i + 1], cos, sin, positions, interleaved)
            k_rows[i, n:n + s_new] = k_i[0]
            v_rows[i, n:n + s_new] = v[i]
    if cos is not None:
        steps = torch.arange(sq) if causal or window != (-1, -1) else torch.zeros(sq, dtype=torch.long)
        q = rotate(q, cos, sin, seqlens.long()[:, None] + steps, interleaved)
    outs, lses = [], []
    for i in range(b):
        lo = 0 if leftpad is None else int(leftpad[i])
        hi = int(seqlens[i]) + s_new
        out, lse = attention_ref(q[i:i + 1], k_rows[i:i + 1, lo:hi], v_rows[i:i + 1, lo:hi], causal=causal,
                                 window_size=window, softcap=softcap, alibi_slopes=alibi, upcast=upcast)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_rows, v_rows


def rotary_tables(seqlen_ro, rotary_dim, device="cpu"):
    angle = torch.rand(seqlen_ro, rotary_dim // 2, device=device) * 2 * math.pi
    return torch.cos(angle).to(bf16), torch.sin(angle).to(bf16)


def paged(cache, page_size, b):
    """A paged copy of the contiguous cache (b, cache_len, ...): its pages shuffled into a pool with spare pages, and
    the block table that finds them."""
    cache_len = cache.shape[1]
    blocks = cache_len // page_size
    pool = torch.randn(b * blocks + 3, page_size, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
    order = torch.randperm(pool.shape[0], device=cache.device)[: b * blocks]
    table = order.view(b, blocks).to(torch.int32)
    pool[order] = cache.reshape(b * blocks, page_size, *cache.shape[2:])
    return pool, table


def unpaged(pool, table):
    return pool[table.long()].flatten(1, 2)


CASES = [
    # (sq, s_new, causal, window, rotary (dim, interleaved) or None, leftpad, batch_idx, page_size)
    (1, 1, True, (-1, -1), None, False, False, None),
    (1, 0, False, (-1, -1), None, False, False, None),
    (4, 3, True, (-1, -1), (32, True), False, False, None),
    (4, 3, False, (-1, -1), (64, False), False, False, None),
    (3, 2, True, (-1, -1), (16, False), True, False, None),
    (2, 2, False, (5, 0), (32, True), False, True, None),
    (5, 4, True, (-1, -1), (32, False), False, False, 1),
    (1, 1, True, (-1, -1), (64, True), True, False, 3),
    (7, 5, True, (-1, -1), None, False, False, 16),
    (2, 0, False, (-1, -1), (32, True), False, False, 16),
]


def run_case(sq, s_new, causal, window, rotary, leftpad, batch_idx, page_size, device, d=64, b=3, h=4, hk=2,
             cache_len=48, softcap=0.0, alibi=False, num_splits=0):
    torch.manual_seed(sq * 100 + s_new)
    slopes = torch.rand(h, device=device) * 0.3 if alibi else None
    q = torch.randn(b, sq, h, d, dtype=bf16, device=device)
    k_cache = torch.randn(b + 2, cache_len, hk, d, dtype=bf16, device=device)
    v_cache = torch.randn_like(k_cache)
    k = v = None
    if s_new:
        k = torch.randn(b, s_new, hk, d, dtype=bf16, device=device)
        v = torch.randn_like(k)
    seqlens = torch.randint(0, cache_len - s_new + 1, (b,), dtype=torch.int32, device=device)
    seqlens[0] = cache_len - s_new  # a full cache
    pads = torch.minimum(torch.randint(0, 6, (b,), device=device), seqlens).to(torch.int32) if leftpad else None
    idx = torch.tensor([4, 0, 2][:b], dtype=torch.int32, device=device) if batch_idx else None
    cos = sin = None
    if rotary:
        # Rows for every position a query or new key takes: causal queries sit at cache_seqlens + i, past the new
        # keys where sq > s_new.
        cos, sin = rotary_tables(cache_len + sq + 4, rotary[0], device)
    interleaved = rotary[1] if rotary else True
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (q, k_cache, v_cache, k, v, cos, sin, seqlens, idx,
                                                                   pads)]
    mods = dict(softcap=softcap, alibi=None if slopes is None else slopes.cpu())
    ref = expected(*cpu, causal, window, interleaved, **mods)
    low = expected(*cpu, causal, window, interleaved, **mods, upcast=False)
    kwargs = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, cache_leftpad=pads,
                  causal=causal, window_size=window, rotary_interleaved=interleaved, softcap=softcap,
                  alibi_slopes=slopes, num_splits=num_splits, return_softmax_lse=True)
    if page_size:
        pool_k, table = paged(k_cache[:b], page_size, b)
        pool_v = torch.randn_like(pool_k)
        pool_v[table.long().flatten()] = v_cache[:b].reshape(-1, page_size, hk, d)
        out, lse = flash_attn_with_kvcache(q, pool_k, pool_v, block_table=table, **kwargs)
        rows = (unpaged(pool_k, table), unpaged(pool_v, table))
    else:
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_batch_idx=idx, **kwargs)
        sel = idx.long() if idx is not None else torch.arange(b, device=device)
        rows = (k_cache[sel], v_cache[sel])
    return out, lse, rows, ref, low


@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_matches_reference_cpu(stub_kernel, case):
    check_case(case, "cpu")


# GPU-only cases: other head dims (odd ones padded), MQA, long caches, large pages, softcap, ALiBi, long queries.
CUDA_CASES = [
    ((1, 1, True, (-1, -1), (32, False), False, False, 256), dict(d=32, h=8, hk=1, cache_len=1024)),
    ((37, 0, True, (-1, -1), None, True, False, None), dict(d=96, cache_len=300)),
    ((4, 2, True, (-1, -1), (64, True), False, False, 64), dict(d=256, cache_len=512, softcap=30.0)),
    ((200, 0, True, (64, 0), None, False, True, None), dict(d=72, cache_len=700, alibi=True)),
    ((1, 1, True, (-1, -1), (128, False), True, False, 16), dict(d=128, b=2, h=16, hk=2, cache_len=16384)),
    ((3, 3, False, (-1, -1), None, False, False, 3), dict(d=128, h=8, hk=8, cache_len=99)),
    # Native calls GQA-packed under a mask: a sliding window over pages of 64, MQA against a 128k cache (64 splits of
    # 2k keys), an odd head dim in a wider kernel with softcap over pages of 3, a rotary head dim of 40.
    ((5, 2, True, (16, 0), (64, False), False, False, 64), dict(d=128, b=2, h=16, hk=4, cache_len=4096)),
    ((3, 0, True, (-1, -1), None, False, False, None), dict(d=64, b=1, h=16, hk=1, cache_len=131072)),
    ((2, 1, True, (-1, -1), None, False, False, 3), dict(d=72, h=6, hk=2, cache_len=99, softcap=20.0)),
    ((1, 1, False, (-1, -1), (40, True), False, False, None), dict(d=40, h=8, hk=2, cache_len=777)),
    # The 16-row decode tile at head dims whose rows are 32-column copies (d 32, 96): its Q is half a copy's rows.
    ((1, 1, True, (-1, -1), (48, False), False, False, 16), dict(d=96, h=16, hk=2, cache_len=2048)),
    ((2, 0, False, (-1, -1), None, True, False, None), dict(d=32, h=8, hk=4, cache_len=5000)),
    # Prefill-shaped against pages of 16 and 3: on Hopper the SM90 forward copies the pages of 16 row by row, and
    # those of 3 are gathered into contiguous copies for it (the gather kernel, after the append of the new keys).
    # The last case's key rows each meet about 5000 query rows (32 query heads a kv head): its pages of 16 are
    # gathered too (kvcache._gather_pays), rotated new keys included.
    ((100, 4, True, (-1, -1), None, False, False, 16), dict(d=128, h=8, hk=2, cache_len=512)),
    ((80, 0, False, (-1, -1), None, False, False, 3), dict(d=64, cache_len=300, softcap=15.0)),
    ((90, 5, True, (-1, -1), (64, False), False, False, 3), dict(d=128, h=8, hk=2, cache_len=300)),
    ((300, 6, True, (-1, -1), (64, True), False, False, 16), dict(d=128, h=64, hk=2, cache_len=320)),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case, extra", [(c, {}) for c in CASES] + CUDA_CASES,
                         ids=[f"c{i}" for i in range(len(CASES))] + [f"gpu{i}" for i in range(len(CUDA_CASES))])
def test_matches_reference_cuda(case, extra):
    check_case(case, "cuda", **extra)


def check_case(case, device, **extra):
    """run_case on the device (on the CPU: with stub_kernel's reference in place of the kernels): the appended cache
    rows exact, out within twice PyTorch's own bf16 error of the fp32 reference (plus fp32 rounding), lse within
    1e-3."""
    if device == "cuda":
        require_kernel(extra.get("d", 64), bf16)
    out, lse, (k_rows, v_rows), (ref_out, ref_lse, ref_k, ref_v), (low_out, _, _, _) = run_case(
        *case, device=device, **extra)
    assert torch.equal(k_rows.cpu(), ref_k) and torch.equal(v_rows.cpu(), ref_v)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    err = (out.float().cpu() - ref_out.float()).abs().max()
    low_err = (low_out.float() - ref_out.float()).abs().max()
    assert torch.isfinite(out).all() and err <= 2 * low_err + 1e-4
    assert torch.allclose(lse.cpu(), ref_lse, atol=1e-3, rtol=0)


def test_cache_seqlens_int_and_none(stub_kernel):
    """An int cache_seqlens is every sequence's; None is the whole cache."""
    q = torch.randn(2, 1, 4, 64, dtype=bf16)
    k_cache, v_cache = torch.randn(2, 16, 2, 64, dtype=bf16), torch.randn(2, 16, 2, 64, dtype=bf16)
    whole = flash_attn_with_kvcache(q, k_cache, v_cache)
    assert torch.equal(whole, flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=16))
    part = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=9)
    tensor = torch.full((2,), 9, dtype=torch.int32)
    assert torch.equal(part, flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=tensor))


BAD = {
    "k_cache": dict(k_cache=torch.randn(2, 16, 2, 32, dtype=bf16)),
    "v_cache": dict(v_cache=torch.randn(2, 16, 3, 64, dtype=bf16)),
    "nheads_k": dict(k_cache=torch.randn(2, 16, 3, 64, dtype=bf16), v_cache=torch.randn(2, 16, 3, 64, dtype=bf16)),
    "k and v": dict(k=torch.randn(2, 1, 2, 64, dtype=bf16)),
    "cache_seqlens must be given": dict(k=torch.randn(2, 1, 2, 64, dtype=bf16),
                                        v=torch.randn(2, 1, 2, 64, dtype=bf16)),
    "too short": dict(k=torch.randn(2, 17, 2, 64, dtype=bf16), v=torch.randn(2, 17, 2, 64, dtype=bf16),
                      cache_seqlens=0),
    "cache_seqlens must be an int32": dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)),
    "block_table": dict(block_table=torch.zeros(2, 4, dtype=torch.int64)),
    "cache_batch_idx cannot": dict(block_table=torch.zeros(2, 4, dtype=torch.int32),
                                   cache_batch_idx=torch.zeros(2, dtype=torch.int32)),
    "rotary_cos and rotary_sin must be given": dict(rotary_cos=torch.randn(20, 16)),
    "rotary_dim <= head_dim": dict(rotary_cos=torch.randn(20, 40), rotary_sin=torch.randn(20, 40)),
    "num_splits": dict(num_splits=-1),
    "fewer than q's batch": dict(k_cache=torch.randn(1, 16, 2, 64, dtype=bf16),
                                 v_cache=torch.randn(1, 16, 2, 64, dtype=bf16)),
}


@pytest.mark.parametrize("what", BAD)
def test_bad_inputs(stub_kernel, what):
    args = dict(q=torch.randn(2, 1, 4, 64, dtype=bf16), k_cache=torch.randn(2, 16, 2, 64, dtype=bf16),
                v_cache=torch.randn(2, 16, 2, 64, dtype=bf16))
    args.update(BAD[what])
    with pytest.raises(ValueError, match=what.split()[0]):
        flash_attn_with_kvcache(**args)


def paged_varlen_case(page_size, device):
    """A varlen batch (GQA, sq != sk, an empty key sequence) and its keys and values as a paged cache."""
    torch.manual_seed(page_size)
    lens_q, lens_k = [3, 1, 5, 2], [7, 0, 20, 13]
    b, h, hk, d = len(lens_q), 4, 2, 64
    slot = -(-max(lens_k) // page_size) * page_size
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), h, d, dtype=bf16, device=device)
    k, v = (torch.randn(sum(lens_k), hk, d, dtype=bf16, device=device) for _ in range(2))
    padded = torch.zeros(2, b, slot, hk, d, dtype=bf16, device=device)
    for i in range(b):
        padded[0, i, : lens_k[i]] = k[cu_k[i]:cu_k[i + 1]]
        padded[1, i, : lens_k[i]] = v[cu_k[i]:cu_k[i + 1]]
    pool_k, table = paged(padded[0], page_size, b)
    pool_v = torch.randn_like(pool_k)
    pool_v[table.long().flatten()] = padded[1].reshape(-1, page_size, hk, d)
    return q, k, v, cu_q, cu_k, pool_k, pool_v, table, max(lens_q), max(lens_k)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_block_table_matches_packed(stub_kernel, page_size, causal):
    """flash_attn_varlen_func with block_table (flash-attn 2's paged varlen call, lengths from cu_seqlens_k) gives the
    packed call's output and lse exactly."""
    from flash_attention import flash_attn_varlen_func
    q, k, v, cu_q, cu_k, pool_k, pool_v, table, mq, mk = paged_varlen_case(page_size, "cpu")
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_attn_probs=True)
    out_p, lse_p, _ = flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, mq, mk, causal=causal,
                                             return_attn_probs=True, block_table=table)
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "grad"])
def test_varlen_block_table_matches_packed_cuda(monkeypatch, page_size, grad):
    """The paged varlen call on the GPU gives the packed call's bits. Without a gradient its pages go through the
    gather kernel, which copies each sequence's used rows only: NaN in every pool row past a sequence's length and in
    the allocator's blocks where the copies land (the rows past the lengths stay unwritten). With one (k's pool
    requires it), PyTorch's differentiable gather of the whole table."""
    from flash_attention import flash_attn_varlen_func
    require_kernel(64, bf16)
    require_kernel(64, bf16, "gather")
    q, k, v, cu_q, cu_k, pool_k, pool_v, table, mq, mk = paged_varlen_case(page_size, "cuda")
    slot = table.shape[1] * page_size
    poison_past_used((pool_k, pool_v), table, cu_k.diff())
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, return_attn_probs=True)
    calls = count_gathers(monkeypatch)
    poison_blocks([(table.shape[0], slot, k.shape[1], k.shape[2])] * 2, (k.element_size(),))
    out_p, lse_p, _ = flash_attn_varlen_func(q, pool_k.requires_grad_(grad), pool_v, cu_q, cu_k, mq, mk, causal=True,
                                             return_attn_probs=True, block_table=table)
    assert bool(calls) != grad
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)


@pytest.mark.parametrize("page_size", [None, 16])
def test_compile_traces_one_graph(monkeypatch, page_size):
    """torch.compile(fullgraph=True) traces a decode step (append in place, rotary, a paged gather, the varlen op
    through its fake) in one graph: nothing reads a tensor's value on the host."""
    import functools

    from flash_attention import _checks
    from test_python_path import Traced, trace_only

    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    graphs = []
    b, cache_len, hk, d = 2, 32, 2, 64
    q, k, v = torch.randn(b, 1, 4, d, dtype=bf16), torch.randn(b, 1, hk, d, dtype=bf16), torch.randn(b, 1, hk, d,
                                                                                                    dtype=bf16)
    k_cache, v_cache = (torch.randn(b, cache_len, hk, d, dtype=bf16) for _ in range(2))
    table = None
    if page_size:
        k_cache, table = paged(k_cache, page_size, b)
        v_cache = torch.randn_like(k_cache)
    cos, sin = rotary_tables(cache_len, 32)
    seqlens = torch.tensor([3, 17], dtype=torch.int32)

    def step(q, k, v, k_cache, v_cache, seqlens, table):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=seqlens,
                                       block_table=table, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=functools.partial(trace_only, graphs))
    with pytest.raises(Traced):
        compiled(q, k, v, k_cache, v_cache, seqlens, table)
    (gm,) = graphs
    targets = [str(node.target) for node in gm.graph.nodes]
    assert targets.count("flash_attention.fwd.default") == 1
    assert targets.count("<built-in function setitem>") == 2  # the in-place appends, into k_cache and v_cache


@pytest.mark.parametrize("sq, causal, window, alibi, packed", [
    (1, True, (-1, -1), False, True), (3, False, (-1, -1), False, True), (3, True, (-1, -1), False, False),
    (1, True, (4, 0), False, False), (1, True, (-1, -1), True, False)])
def test_gqa_packing(stub_kernel, sq, causal, window, alibi, packed):
    """Where it is exact (one query row or no mask, no window, no ALiBi), the query heads of each kv head reach the
    kernel as rows of one sequence; the result is the reference's either way."""
    b, h, hk, d, cache_len = 2, 6, 2, 32, 40
    q = torch.randn(b, sq, h, d, dtype=bf16)
    k_cache, v_cache = torch.randn(b, cache_len, hk, d, dtype=bf16), torch.randn(b, cache_len, hk, d, dtype=bf16)
    seqlens = torch.tensor([40, 23], dtype=torch.int32)
    slopes = torch.rand(h) * 0.3 if alibi else None
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal, window_size=window,
                                       alibi_slopes=slopes, return_softmax_lse=True)
    (call,) = stub_kernel
    assert call["q"].shape == ((b * sq * h // hk, hk, d) if packed else (b * sq, h, d))
    ref_out, ref_lse, _, _ = expected(q, k_cache, v_cache, None, None, None, None, seqlens, None, None, causal, window,
                                      True, alibi=slopes)
    assert (out.float() - ref_out.float()).abs().max() <= 2e-2
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=0)


SPLIT_CASES = [
    # (case, num_splits): split-KV where it is exact (one query row or no mask), with GQA packing, paging, leftpad,
    # new tokens, rotary; and cases where it is not: composed (the CPU stub, leftpad) they run unsplit, native each
    # chunk is masked as the whole call is.
    ((1, 1, True, (-1, -1), (32, True), True, False, 16), 3),
    ((4, 2, False, (-1, -1), None, False, True, None), 7),
    ((1, 0, True, (-1, -1), None, False, False, 3), 48),
    ((3, 2, True, (-1, -1), None, False, False, None), 4),
    ((1, 1, True, (4, 0), None, False, False, None), 4),
]


@pytest.mark.parametrize("case, num_splits", SPLIT_CASES, ids=[f"s{i}" for i in range(len(SPLIT_CASES))])
def test_split_kv_cpu(stub_kernel, case, num_splits):
    """num_splits cuts each sequence's keys into chunks attended to separately and combined by their lse, where that
    is exact; elsewhere the call runs unsplit. The result is the reference's either way."""
    out, lse, (k_rows, v_rows), (ref_out, ref_lse, ref_k, ref_v), _ = run_case(*case, device="cpu",
                                                                                num_splits=num_splits)
    sq, causal, window = case[0], case[2], case[3]
    exact = window == (-1, -1) and (sq == 1 or not causal)
    (call,) = stub_kernel
    assert call["cu_seqlens_k"].shape[0] - 1 == 3 * (num_splits if exact else 1)
    assert torch.equal(k_rows, ref_k) and torch.equal(v_rows, ref_v)
    assert (out.float() - ref_out.float()).abs().max() <= 2e-2
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("case, num_splits", SPLIT_CASES, ids=[f"s{i}" for i in range(len(SPLIT_CASES))])
def test_split_kv_cuda(case, num_splits):
    require_kernel(64, bf16)
    out, lse, _, (ref_out, ref_lse, _, _), (low_out, _, _, _) = run_case(*case, device="cuda",
                                                                         num_splits=num_splits)
    err = (out.float().cpu() - ref_out.float()).abs().max()
    low_err = (low_out.float() - ref_out.float()).abs().max()
    assert torch.isfinite(out).all() and err <= 2 * low_err + 1e-4
    assert torch.allclose(lse.cpu(), ref_lse, atol=1e-3, rtol=0)


def pages_of(k, v, page_size):
    """k, v (b, sk, hk, d) as pools of pages in one shuffled order, with a spare page of noise, and the int32 block
    table that finds each sequence's rows in them (its last page partly filled)."""
    b, sk, hk, d = k.shape
    per_seq = -(-sk // page_size)
    order = torch.randperm(b * per_seq + 1, device=k.device)[:b * per_seq]
    pools = []
    for cache in (k, v):
        padded = cache.new_zeros(b, per_seq * page_size, hk, d)
        padded[:, :sk] = cache
        pool = torch.randn(b * per_seq + 1, page_size, hk, d, dtype=cache.dtype, device=cache.device)
        pool[order] = padded.view(b * per_seq, page_size, hk, d)
        pools.append(pool)
    return pools[0], pools[1], order.view(b, per_seq).to(torch.int32)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("splits", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [None, 1, 3, 16, 48, 64, 128, 192, 256])
@pytest.mark.parametrize("sq", [3, 9, 130])
def test_native_split_cuda(d, splits, causal, page_size, sq):
    """The native split-KV forward (fp32 partials, merged by the combine kernel; on Hopper the SM90 forward writes
    them for the prefill-shaped (130 rows), unpacked calls of a contiguous cache or pages of a multiple of 16 rows, else
    the SM80 tier's decode kernels: 16-row tiles whose warps split the keys (3 rows, 9, 3 packed), 64-row tiles (9
    packed: 36 rows; 130 packed), which on Hopper merge up to 16 chunks inside a cluster instead) per
    sequence against the fp32 reference over its used keys: GQA, an empty sequence (out 0, lse -inf), one key,
    partial key blocks, more splits than key blocks, and a causal mask over several query rows (each chunk is masked
    as the whole call is; rows before the first key see none), with the query heads GQA-packed (each packed row
    masked as its query row) or not. Read from pages (any size, shuffled) 3 rows are the same bits as from the
    contiguous cache (the SM80 decode tile either way), 130 rows are checked against the reference (on Hopper, in
    pages of 16 to 256: the SM90 forward's TMA blocks, its 64-row boxes for other multiples of 64 (in 64-key blocks
    at d 256), and rows copied by its producer warpgroup for pages of 16 and 48 (48: a page size that is no power of
    two), the last key block's rows past the table zero-filled)."""
    from flash_attention import _ops
    require_kernel(d, bf16)
    require_kernel(d, bf16, "combine")
    # 1087 keys: 17 pages of 64, so the last 128-key block's second 64-row box lies past the table's rows.
    b, h, hk, sk = 4, 8, 2, 1087
    q = torch.randn(b, sq, h, d, dtype=bf16, device="cuda")
    k, v = (torch.randn(b, sk, hk, d, dtype=bf16, device="cuda") for _ in range(2))
    if _ops.decode_route(q, None) is None:
        pytest.skip("no SM80-tier forward and combine kernels for this head dim")
    used = torch.tensor([0, 1, 517, sk], dtype=torch.int32, device="cuda")
    args = (d ** -0.5, -1, 0 if causal else -1, 0.0, splits)
    if page_size is not None:
        k_pool, v_pool, table = pages_of(k, v, page_size)
        paged = _ops.split_attention(q, k_pool, v_pool, used, table, None, *args, 1, None)
        if sq <= 64:  # the SM80 decode tile, paged or not
            out, lse = _ops.split_attention(q, k, v, used, None, None, *args, 1, _ops.SPLIT_TIER)
            assert torch.equal(paged[0], out) and torch.equal(paged[1], lse)
            return
        results = [paged]  # 130 rows: tiles that may differ from the contiguous call's (SM90: 64-key blocks)
    else:
        out, lse = _ops.split_attention(q, k, v, used, None, None, *args, 1, None)
        results = [(out, lse), _ops.split_attention(q, k, v, used, None, None, *args, h // hk, None)]
    for out, lse in results:
        assert_matches_reference(q, k, v, used, out, lse, causal)


def poison_past_used(pools, table, used):
    """NaN in every row of the pools past sequence i's first used[i] rows of its pages."""
    page_size = pools[0].shape[1]
    for i in range(table.shape[0]):
        rows = torch.arange(int(used[i]), table.shape[1] * page_size, device=table.device)
        pages = table[i].long()[rows // page_size]
        for pool in pools:
            pool[pages, rows % page_size] = float("nan")


def count_gathers(monkeypatch):
    """A list that gets an entry for each call of the gather kernel (_ops.gather_pages)."""
    from flash_attention import _ops
    calls = []
    gather = _ops.gather_pages
    monkeypatch.setattr(_ops, "gather_pages", lambda *args: calls.append(1) or gather(*args))
    return calls


def assert_matches_reference(q, k, v, used, out, lse, causal):
    """Sequence i of out and lse against the fp32 reference over its first used[i] keys: out 0 and lse -inf where it
    has none."""
    b, sq, h = q.shape[:3]
    assert out.shape == q.shape and lse.shape == (b, h, sq) and not out.isnan().any()
    for i in range(b):
        n = int(used[i])
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])) and lse[i].isneginf().all()
            continue
        ref_out, ref_lse = attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal)
        low_out, _ = attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal, upcast=False)
        err = (out[i:i + 1].float() - ref_out.float()).abs().max()
        low_err = (low_out.float() - ref_out.float()).abs().max()
        assert err <= 2 * low_err + 1e-4, (i, err, low_err)
        seen = ref_lse.isfinite()
        assert torch.equal(lse[i:i + 1].isfinite(), seen)
        assert torch.allclose(lse[i:i + 1][seen], ref_lse[seen].float(), atol=1e-3, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("page_size", [16, 48, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_prefill_many_tiles_cuda(d, page_size, causal):
    """More query tiles than SMs: without a mask the SM90 forward's persistent CTAs take several each (one tile's
    output stores beside the next tile's loads); causal ones take them from the tile counter at d 64 and 128 where
    TMA reads the pages (64), else one CTA per tile (rows copied; d 192 and 256). Read from shuffled pages (rows
    copied for pages of 16 and 48, 64-row boxes for 64; at d 96 gathered into a contiguous copy), the output is the
    contiguous cache's, bit for bit where the key blocks are the same (d 64, 96, 128; d 192's and 256's paged kernels
    read blocks of 64 keys, their contiguous ones 112 and 80), and within flash-attn's rule of the reference for every
    sequence."""
    require_kernel(d, bf16)
    b, sq, h, hk, sk = 2, 400, 48, 8, 1000
    q = torch.randn(b, sq, h, d, dtype=bf16, device="cuda")
    k, v = (torch.randn(b, sk, hk, d, dtype=bf16, device="cuda") for _ in range(2))
    used = torch.tensor([sk, 611], dtype=torch.int32, device="cuda")
    k_pool, v_pool, table = pages_of(k, v, page_size)
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=used, block_table=table, causal=causal,
                                       num_splits=1, return_softmax_lse=True)
    dense, dense_lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=used, causal=causal, num_splits=1,
                                               return_softmax_lse=True)
    if d <= 128:
        assert torch.equal(out, dense) and torch.equal(lse, dense_lse)
    for i in range(b):
        n = int(used[i])
        ref_out, ref_lse = attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal)
        low_out, _ = attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal, upcast=False)
        err = (out[i:i + 1].float() - ref_out.float()).abs().max()
        low_err = (low_out.float() - ref_out.float()).abs().max()
        assert torch.isfinite(out[i]).all() and err <= 2 * low_err + 1e-4, (i, err, low_err)
        assert torch.allclose(lse[i:i + 1], ref_lse.float(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("page_size, sq, cache_len, h, causal, local, expected", [
    (16, 2048, 4096, 32, True, False, True),  # each key row meets 4 x 1536 query rows
    (48, 4096, 4096, 32, True, False, True),
    (16, 512, 4096, 32, True, False, False),  # 4 x 481: the row copies cost less
    (16, 1024, 4096, 16, True, False, False),  # 2 x 896
    (16, 1024, 4096, 32, False, False, True),
    (16, 2048, 4096, 32, True, True, False),  # local windows: not estimated
    (64, 2048, 4096, 32, True, False, False),  # TMA reads the pages
    (16, 2048, 65536, 32, True, False, False),  # 256 MiB of copies at most
])
def test_gather_pays(page_size, sq, cache_len, h, causal, local, expected):
    """Pages that the SM90 forward copies row by row are gathered first where each key row meets enough query rows
    (the query heads of its kv head times the query rows that see it), within the copies' memory bound."""
    from flash_attention import kvcache
    pool = torch.empty(1, page_size, 8, 128, dtype=bf16)
    assert kvcache._gather_pays("sm90", pool, 2, sq, h, cache_len, causal, local) is expected
    assert kvcache._gather_pays("sm80", pool, 2, sq, h, cache_len, causal, local) is False


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [bf16, fp16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size, hk, d", [(1, 3, 64), (3, 2, 128), (16, 8, 128), (48, 1, 256), (16, 4, 8)])
def test_gather_pages_kernel_cuda(dtype, page_size, hk, d):
    """_ops.gather_pages copies each sequence's first used rows (none for 0 or less, all for more than the table
    holds) from its pages, ids out of the pool clamped as PyTorch's gather does, from a pool whose rows are not
    contiguous (a slice of a wider one); it leaves the rows past them alone."""
    from flash_attention import _ops, _paged
    require_kernel(d, dtype, "gather")
    b, blocks = 5, 7
    wide = torch.randn(b * blocks + 2, page_size, hk, d + 8, dtype=dtype, device="cuda")
    k_pool, v_pool = wide[..., :d], wide[..., 8:]
    assert not k_pool.is_contiguous() and _ops.gather_kernel_usable(k_pool, v_pool)
    table = torch.randperm(b * blocks + 2, device="cuda")[:b * blocks].view(b, blocks).to(torch.int32)
    table[1, 0], table[2, 1] = -5, 10 ** 6
    cache_len = blocks * page_size
    used = torch.tensor([0, cache_len + 9, 1, cache_len - 1, -3], dtype=torch.int32, device="cuda")
    k, v = _ops.gather_pages(k_pool, v_pool, table, used)
    assert k.shape == v.shape == (b, cache_len, hk, d) and k.is_contiguous()
    for got, pool in ((k, k_pool), (v, v_pool)):
        want = _paged.gather_pages(pool, table)
        for i in range(b):
            n = max(0, min(int(used[i]), cache_len))
            assert torch.equal(got[i, :n], want[i, :n]), i


@pytest.mark.cuda
@pytest.mark.parametrize("d, page_size, dtype", [(64, 16, bf16), (128, 16, bf16), (128, 48, fp16), (256, 16, bf16)],
                         ids=["d64-p16", "d128-p16", "d128-p48-fp16", "d256-p16"])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_prefill_gathered_cuda(monkeypatch, d, page_size, dtype, causal):
    """Where gathering pays (forced here), a paged prefill on Hopper gathers the used rows into contiguous copies and
    runs the contiguous cache's kernel: the same bits as the contiguous call, with NaN in every pool row past a
    sequence's used count (those rows are not copied, and the forward masks the keys there and zeroes the values)."""
    from flash_attention import _ops, kvcache
    require_kernel(d, dtype)
    require_kernel(d, dtype, "gather")
    b, sq, h, hk, sk = 3, 300, 16, 4, 1000
    q = torch.randn(b, sq, h, d, dtype=dtype, device="cuda")
    k, v = (torch.randn(b, sk, hk, d, dtype=dtype, device="cuda") for _ in range(2))
    if _ops.split_forward_tier(q, k, None, None, 1, None) == _ops.SPLIT_TIER:
        pytest.skip("no faster tier than the split kernels' on this GPU and build")
    used = torch.tensor([sk, 611, 77], dtype=torch.int32, device="cuda")
    k_pool, v_pool, table = pages_of(k, v, page_size)
    poison_past_used((k_pool, v_pool), table, used)
    calls = count_gathers(monkeypatch)
    monkeypatch.setattr(kvcache, "_GATHER_MIN_REUSE", 0)
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=used, block_table=table, causal=causal,
                                       num_splits=1, return_softmax_lse=True)
    assert calls, "the call did not gather"
    dense, dense_lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=used, causal=causal, num_splits=1,
                                               return_softmax_lse=True)
    assert torch.equal(out, dense) and torch.equal(lse, dense_lse)
    assert_matches_reference(q, k, v, used, out, lse, causal)


@pytest.mark.cuda
@pytest.mark.parametrize("sq, page_size", [(1, 16), (113, 3)])
def test_composed_paged_call_gathers_used_rows_cuda(monkeypatch, sq, page_size):
    """A paged call that takes the composed path (ALiBi here) gathers each sequence's used rows with the gather
    kernel where no gradient flows, new keys included: the contiguous cache's bits, with NaN in every pool row past a
    sequence's used count and in the allocator's blocks where the copies land."""
    d = 64
    require_kernel(d, bf16)
    require_kernel(d, bf16, "gather")
    b, h, hk, sk, s_new = 3, 8, 2, 300, 2
    q = torch.randn(b, sq, h, d, dtype=bf16, device="cuda")
    k, v = (torch.randn(b, sk, hk, d, dtype=bf16, device="cuda") for _ in range(2))
    k_new, v_new = (torch.randn(b, s_new, hk, d, dtype=bf16, device="cuda") for _ in range(2))
    slopes = torch.rand(b, h, device="cuda")
    seqlens = torch.tensor([sk - s_new, 150, 0], dtype=torch.int32, device="cuda")
    k_pool, v_pool, table = pages_of(k, v, page_size)
    poison_past_used((k_pool, v_pool), table, seqlens + s_new)
    calls = count_gathers(monkeypatch)
    poison_blocks([(b, table.shape[1] * page_size, hk, d)] * 2, (2,))
    out = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                  causal=True, alibi_slopes=slopes, num_splits=1)
    assert calls, "the call did not gather with the kernel"
    dense = flash_attn_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=seqlens, causal=True, alibi_slopes=slopes,
                                    num_splits=1)
    assert torch.equal(out, dense)


@pytest.mark.parametrize("sq, packed", [(1, 1), (1, 4), (3, 4)])
def test_split_fake_lays_out_as_the_binding(sq, packed):
    """fwd_split's fake gives out and lse in q's layout (b, sq, h, d), whose rows the kernel may pack: contiguous, as
    the binding allocates them, so torch.compile can trust it."""
    from flash_attention import _ops
    b, hk, d = 2, 3, 16
    k = torch.randn(b, 5, hk, d, dtype=bf16)
    q = torch.randn(b, sq, hk * packed, d, dtype=bf16)
    out, lse = _ops._split_fake(q, k, k, None, None, None, 0.25, -1, -1, 0.0, 2, packed, None)
    assert out.shape == q.shape and out.is_contiguous()
    assert lse.shape == (b, q.shape[2], q.shape[1]) and lse.is_contiguous() and lse.dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.parametrize("sq, packed", [(1, 1), (1, 4), (3, 4)])
def test_split_opcheck_cuda(sq, packed):
    """torch.library.opcheck of fwd_split (schema, fake against the binding's outputs, dynamic shapes), its rows packed
    by the kernel or not; q already packed (b, sq * group, hk, d) is refused."""
    from flash_attention import _ops
    require_kernel(64, bf16)
    require_kernel(64, bf16, "combine")
    b, hk, d, sk = 2, 2, 64, 300
    q = torch.randn(b, sq, hk * packed, d, dtype=bf16, device="cuda")
    k, v = (torch.randn(b, sk, hk, d, dtype=bf16, device="cuda") for _ in range(2))
    if _ops.decode_route(q, None) is None:
        pytest.skip("no split kernels for this head dim")
    used = torch.tensor([7, sk], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.flash_attention.fwd_split.default,
                          (q, k, v, used, None, None, d ** -0.5, -1, 0, 0.0, 3, packed, None))
    if packed > 1:
        with pytest.raises(RuntimeError, match="packed_heads"):
            _ops.split_attention(q.reshape(b, sq * packed, hk, d), k, v, used, None, None, d ** -0.5, -1, 0, 0.0, 3,
                                 packed, None)


def decode_inputs(b, h, hk, d, sk, sq=1):
    """q (sq query rows per head, one by default), k and v (bf16) for fwd_split, or a skip where the build lacks its
    kernels."""
    from flash_attention import _ops
    require_kernel(d, bf16)
    require_kernel(d, bf16, "combine")
    q = torch.randn(b, sq, h, d, dtype=bf16, device="cuda")
    k, v = (torch.randn(b, sk, hk, d, dtype=bf16, device="cuda") for _ in range(2))
    if _ops.decode_route(q, None) is None:
        pytest.skip("no split kernels for this head dim")
    return q, k, v


@pytest.mark.cuda
def test_automatic_split_count_cuda():
    """An automatic split count (negative) may be lowered by the binding, to a third at most, where fewer chunks merge
    inside clusters (on an H100: 16 query tiles of 16 chunks exceed the 15 clusters it holds at once): the result is
    one of the allowed counts' bit for bit, and matches the reference."""
    from flash_attention import _ops
    b, h, hk, d, sk = 16, 4, 1, 128, 8192
    q, k, v = decode_inputs(b, h, hk, d, sk)
    used = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    run = lambda splits: _ops.split_attention(q, k, v, used, None, None, d ** -0.5, -1, -1, 0.0, splits, h, None)
    out, lse = run(-16)
    assert any(torch.equal(out, run(n)[0]) for n in range(6, 17))
    ref_out, ref_lse = attention_ref(q, k, v)
    low_out, _ = attention_ref(q, k, v, upcast=False)
    err, low_err = ((o.float() - ref_out.float()).abs().max() for o in (out, low_out))
    assert err <= 2 * low_err + 1e-4 and torch.allclose(lse, ref_lse.float(), atol=1e-3, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [-1, 1, -2])
def test_unmerged_kernels_cuda(splits):
    """A decode step whose chunks need no merging kernel launches one kernel: one chunk, automatic (-1) or not, or
    chunks merged inside a cluster (checked on sm_90). The combine kernel is named by the profiler."""
    from flash_attention import _ops
    b, h, hk, d, sk = 1, 8, 8, 128, 1024
    q, k, v = decode_inputs(b, h, hk, d, sk)
    run = lambda: _ops.split_attention(q, k, v, None, None, None, d ** -0.5, -1, -1, 0.0, splits, 1, None)
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels, "the profiler saw no kernel"
    merged_in_clusters = torch.cuda.get_device_capability() == (9, 0)  # the one GPU where this has run
    if splits != -2 or merged_in_clusters:
        assert len(kernels) == 1 and "combine" not in kernels[0], kernels


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 3, 17])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("sq, d", [(1, 128), (3, 128), (5, 64), (20, 64)])
def test_split_packs_rows_cuda(splits, page_size, sq, d):
    """The query rows of every head, handed to fwd_split unpacked, are GQA-packed by the kernel and come back unpacked,
    causal, unsplit, merged inside a cluster (3 splits, on Hopper) or by the combine kernel (17); 16-row tiles (up to
    16 packed rows) and 64-row ones (20 x 4 rows), from a contiguous cache or pages: against the fp32 reference."""
    from flash_attention import _ops
    b, h, hk, sk = 3, 8, 2, 700
    q, k, v = decode_inputs(b, h, hk, d, sk, sq)
    used = torch.tensor([0, 300, sk], dtype=torch.int32, device="cuda")
    keys, values, table = (k, v, None) if page_size is None else pages_of(k, v, page_size)
    out, lse = _ops.split_attention(q, keys, values, used, table, None, d ** -0.5, -1, 0, 0.0, splits, h // hk, None)
    assert_matches_reference(q, k, v, used, out, lse, causal=True)


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("h, hk, d", [(40, 2, 128), (160, 1, 64)])
def test_split_one_query_many_heads_cuda(splits, h, hk, d):
    """One query row of 20 and of 160 heads per kv head: the packed rows, its group's heads one stride apart, load and
    store as a plain tile (uniform_row_stride), in one 64-row tile and in three (rows from 64 on at a tile's offset),
    unsplit or merged (3 chunks): against the fp32 reference, lse included."""
    from flash_attention import _ops
    b, sk = 2, 700
    q, k, v = decode_inputs(b, h, hk, d, sk)
    out, lse = _ops.split_attention(q, k, v, None, None, None, d ** -0.5, -1, -1, 0.0, splits, h // hk, None)
    ref_out, ref_lse = attention_ref(q, k, v)
    low_out, _ = attention_ref(q, k, v, upcast=False)
    err, low_err = ((o.float() - ref_out.float()).abs().max() for o in (out, low_out))
    assert out.shape == q.shape and lse.shape == (b, h, 1)
    assert err <= 2 * low_err + 1e-4 and torch.allclose(lse, ref_lse.float(), atol=1e-3, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_load_schedules_agree_cuda(d, page_size):
    """The 16-row decode tile's three load schedules give the same bits, over a partial last key block: unsplit, one
    sequence (2 CTAs) takes the ring of K/V stages (a dense cache up to d 128) or loads a key block's K and V together
    (its CTA has the SM to itself); the same sequence sm_count / 2 times (sm_count CTAs) the ring at d 64, K and V
    together above; sm_count times (more CTAs than SMs) K and V one after the other."""
    from flash_attention import _ops
    n, h, hk, sk = _ops.sm_count(torch.device("cuda")), 8, 2, 700
    q, k, v = decode_inputs(1, h, hk, d, sk)
    used = torch.tensor([sk - 3], dtype=torch.int32, device="cuda")
    outs = []
    for b in (1, n // 2, n):
        kb, vb, table = k.repeat(b, 1, 1, 1), v.repeat(b, 1, 1, 1), None
        if page_size is not None:
            kb, vb, table = pages_of(kb, vb, page_size)
        args = (used.repeat(b), table, None, d ** -0.5, -1, 0, 0.0, 1, h // hk, None)
        out, lse = _ops.split_attention(q.repeat(b, 1, 1, 1), kb, vb, *args)
        outs.append((out[:1], lse[:1]))
    (out, lse), *others = outs
    assert out.abs().amax() > 0
    for out_b, lse_b in others:
        assert torch.equal(out, out_b) and torch.equal(lse, lse_b)


@pytest.mark.cuda
def test_decode_compiled_matches_eager_cuda():
    """A GQA decode step of flash_attn_func under torch.compile(fullgraph=True) (the traced fwd_split op, whose
    kernel packs the rows, its output laid out as the fake says) gives eager's bits. Compiled before any eager call
    finds the route: the tracer must not reach into the extension's kernel list."""
    from flash_attention import _dispatch, _ops, flash_attn_func
    require_kernel(64, bf16)
    for cache in (_ops._decode_routes, _ops._split_routes, _dispatch._resolved):
        cache.clear()
    q = torch.randn(2, 1, 8, 64, dtype=bf16, device="cuda")
    k, v = (torch.randn(2, 500, 2, 64, dtype=bf16, device="cuda") for _ in range(2))

    def step(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return out * 2, lse

    torch._dynamo.reset()
    with torch.no_grad():
        out, lse = torch.compile(step, fullgraph=True)(q, k, v)
        eager_out, eager_lse = step(q, k, v)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)



@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_step_in_cuda_graph(page_size):
    """A decode step (append of the new token with rotary, then split-KV attention and its combine, which starts
    beside the forward) captured once in a CUDA graph, then replayed on new inputs written into the captured tensors:
    each replay gives the eager call's bits and leaves the caches as it does, the step's position moving with
    cache_seqlens."""
    require_kernel(128, bf16)
    require_kernel(128, bf16, "combine")
    b, h, hk, d, cache_len = 2, 8, 2, 128, 4096
    cos, sin = rotary_tables(cache_len, 64, "cuda")
    q = torch.randn(b, 1, h, d, dtype=bf16, device="cuda")
    k_new, v_new = (torch.randn(b, 1, hk, d, dtype=bf16, device="cuda") for _ in range(2))
    k_cache, v_cache = (torch.randn(b, cache_len, hk, d, dtype=bf16, device="cuda") for _ in range(2))
    table = None
    if page_size:
        k_cache, v_cache, table = pages_of(k_cache, v_cache, page_size)
    seqlens = torch.tensor([3000, 4000], dtype=torch.int32, device="cuda")

    def step(k_cache, v_cache):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, block_table=table, causal=True, num_splits=0,
                                       return_softmax_lse=True)

    graph_k, graph_v = k_cache.clone(), v_cache.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels loaded, attributes set, outside the capture
        step(k_cache.clone(), v_cache.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_lse = step(graph_k, graph_v)
    graph_k.copy_(k_cache), graph_v.copy_(v_cache)  # undo the capture's own append, if it ran
    for n in range(3):
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))
        seqlens.copy_(torch.tensor([3000 + n, 4000 + n], dtype=torch.int32))
        graph.replay()
        out, lse = step(k_cache, v_cache)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.equal(graph_out, out) and torch.equal(graph_lse, lse), n
        assert torch.equal(graph_k, k_cache) and torch.equal(graph_v, v_cache), n


@pytest.mark.parametrize("b, heads, rows, keys, d, paged, expected", [
    (8, 16, 1, 4096, 64, False, 1),    # d 64, the tiles fill the SMs: the ring kernel, one CTA an SM, unsplit
    (8, 8, 4, 4096, 64, False, 2),     # half of them: two chunks
    (4, 8, 4, 16384, 64, False, 12),   # a quarter: three one-buffer CTAs an SM
    (8, 16, 1, 4096, 64, True, 1),     # from pages too
    (8, 8, 4, 4096, 128, False, 1),    # d 128, half of the SMs: the ring kernel, unsplit
    (8, 8, 4, 16384, 128, False, 2),   # up to 8k keys only: then two one-buffer CTAs
    (4, 32, 1, 4096, 128, False, 1),   # all of them: the one-buffer tile
    (16, 1, 8, 32768, 128, False, 8),  # d 128: one per SM, its K and V loads together
    (16, 1, 8, 32768, 128, True, 16),  # from pages: two per SM
    (8, 8, 4, 4096, 256, False, 4),    # d 256: two per SM
    (8, 16, 32, 4096, 64, False, 2),   # 32 rows: the 64-row tile, two per SM
    (1, 8, 4, 8192, 128, False, 16),   # few tiles: chunks of at least 512 keys
    (64, 8, 8, 2048, 128, False, 1),   # the tiles fill the GPU already
    (1, 1, 8, 1 << 17, 128, False, 64),  # at most 64 chunks
])
def test_split_count_fills_one_wave(b, heads, rows, keys, d, paged, expected):
    """num_splits=0 picks as many key chunks as fill one wave of the decode kernel's CTAs (132 SMs here), by the
    tile's occupancy and whether its cache is paged."""
    from flash_attention import _ops
    assert _ops.split_count(0, b, heads, rows, keys, d, 132, paged) == expected
    assert _ops.split_count(5, b, heads, rows, keys, d, 132, paged) == 5


def test_split_count_without_the_ring():
    """Where the ring kernel does not fit the device's shared memory, the one-buffer tile's count: d 64 from pages
    on an sm86/89/120 (99 KB a block) fills three CTAs an SM, not one unsplit ring CTA."""
    from flash_attention import _ops
    sm86 = dict(head_dim=64, sm_count=84, smem_per_block=101376)
    assert _ops.ring_kernel_fits(_ops.DecodeRoute(80, combine_tier=80, **sm86), paged=False)
    assert not _ops.ring_kernel_fits(_ops.DecodeRoute(80, combine_tier=80, **sm86), paged=True)
    assert not _ops.ring_kernel_fits(_ops.DecodeRoute(80, 128, 80, 132, 166912), paged=False)  # A100, d 128
    assert _ops.ring_kernel_fits(_ops.DecodeRoute(80, 128, 80, 132, 232448), paged=True)  # H100, d 128
    assert _ops.split_count(0, 8, 8, 1, 4096, 64, 84, True, ring_fits=False) == 3  # 64 tiles: 252 CTAs
    assert _ops.split_count(0, 8, 8, 1, 4096, 64, 84, True, ring_fits=True) == 1


@pytest.mark.parametrize("b, heads, rows, keys, d, h100, h200", [
    (8, 8, 16, 16384, 128, 2, 4),   # b 8, sq 4, GQA 4: one CTA an SM on the H100, two on the H200
    (16, 1, 8, 32768, 128, 8, 16),  # MQA
    (8, 8, 4, 4096, 128, 1, 4),     # the unsplit ring kernel on the H100 only
    (8, 16, 1, 4096, 64, 1, 1),     # d 64: the ring on both
    (1, 8, 4, 8192, 128, 16, 16),   # chunks of at least 512 keys on both
])
def test_split_count_by_device(b, heads, rows, keys, d, h100, h200):
    """Lone 16-row decode CTAs at d 65-128 (one an SM, and the unsplit ring) only on the H100, where they were measured
    faster; the H200 takes two CTAs an SM (session 55's sweeps, RESULTS.md)."""
    from flash_attention import _ops
    assert _ops.lone_decode_cta("NVIDIA H100 80GB HBM3") and not _ops.lone_decode_cta("NVIDIA H200")
    assert _ops.split_count(0, b, heads, rows, keys, d, 132, lone_cta=True) == h100
    assert _ops.split_count(0, b, heads, rows, keys, d, 132, lone_cta=False) == h200


@pytest.mark.parametrize("sq, table, leftpad, packed, tier, expected", [
    (65, None, None, 1, None, "sm90"),          # prefill-shaped, contiguous: the SM90 forward writes the partials
    (65, None, None, 1, "sm80", "sm80"),        # a tier override is kept
    (64, None, None, 1, None, "sm80"),          # decode-shaped: the SM80 decode kernels were faster there
    (512, None, None, 4, None, "sm80"),         # GQA-packed rows, masked as their queries only by the SM80 tier
    (512, 256, None, 1, None, "sm90"),          # pages of a multiple of 128 rows: by TMA, 128-key blocks
    (512, 128, None, 1, None, "sm90"),
    (512, 64, None, 1, None, "sm90"),           # of 64 rows: 64-row boxes
    (512, 192, None, 1, None, "sm90"),
    (512, 16, None, 1, None, "sm90"),           # other multiples of 16: row by row
    (512, 96, None, 1, None, "sm90"),
    (512, 8, None, 1, None, "sm80"),            # smaller pages
    (512, 3, None, 1, None, "sm80"),
    (512, None, "leftpad", 1, None, "sm80"),    # left-padded
    (512, None, None, 1, "unbuilt", "sm80"),    # no forward kernel for the call: the split tier's error path
])
def test_split_forward_tier(monkeypatch, sq, table, leftpad, packed, tier, expected):
    """Which tier's forward writes the split partials (the combine is always the portable SM80 tier's)."""
    from flash_attention import _dispatch, _ops

    def resolve_tier(device, requested, head_dim, dtype, kind):
        if requested == "unbuilt":
            raise RuntimeError("not built")
        return requested or "sm90"

    monkeypatch.setattr(_dispatch, "resolve_tier", resolve_tier)
    q = torch.randn(2, sq, 8, 64, dtype=bf16)
    k = torch.empty(4, table or 300, 2, 64, dtype=bf16)  # a page pool, or a contiguous cache
    assert _ops.split_forward_tier(q, k, "table" if table else None, leftpad, packed, tier) == expected


@pytest.mark.parametrize("sq, split_tier_default, fwd_tier, native", [
    (1, False, "sm80", True), (64, False, "sm80", True), (65, False, "sm80", False), (512, False, "sm80", False),
    (512, True, "sm80", True), (512, False, "sm90", True),
])
def test_native_or_composed(stub_kernel, monkeypatch, sq, split_tier_default, fwd_tier, native):
    """Decode-shaped calls (at most 64 query rows) take the native split kernels, GQA-packed by the kernel (q handed
    over unpacked, with the group as packed_heads); prefill-shaped ones do too where the split kernels' tier is the
    GPU's own, or unpacked where the GPU's faster tier writes the split partials itself (Hopper, the SM90 forward),
    and are otherwise composed (one varlen call, on the faster tier)."""
    from flash_attention import _ops
    split_calls = []

    def fake_split(q, k, v, *args):
        split_calls.append((q.shape, args[-2]))  # args[-2]: packed_heads
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(_ops, "decode_route", lambda q, tier: _ops.DecodeRoute(80, 64, 80, 132, 232448))
    monkeypatch.setattr(_ops, "decode_attention", lambda route, *args: fake_split(*args))
    monkeypatch.setattr(_ops, "split_tier_is_default", lambda q, tier: split_tier_default)
    monkeypatch.setattr(_ops, "split_forward_tier", lambda q, k, table, leftpad, packed, tier: fwd_tier)
    monkeypatch.setattr(_ops, "split_attention", fake_split)
    q = torch.randn(2, sq, 8, 64, dtype=bf16)
    k_cache, v_cache = (torch.randn(2, 600, 2, 64, dtype=bf16) for _ in range(2))
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=600, causal=True)
    assert (len(split_calls), len(stub_kernel)) == ((1, 0) if native else (0, 1))
    if native and (sq <= 64 or fwd_tier == "sm80"):
        assert split_calls[0] == ((2, sq, 8, 64), 4)  # GQA-packed by the kernel, under the causal mask
    elif native:
        assert split_calls[0] == ((2, sq, 8, 64), 1)  # a prefill on the SM90 forward: not packed


@pytest.mark.parametrize("page_size, leftpad, gathered", [(3, False, True), (1, False, True), (16, False, False),
                                                        (64, False, False), (16, True, False)])
def test_small_pages_gathered_for_the_faster_tier(stub_kernel, monkeypatch, page_size, leftpad, gathered):
    """A prefill-shaped call against pages that the faster tier (Hopper's SM90 forward) does not read (by the
    catalog: sizes no multiple of 16), without cache_leftpad, runs that tier natively on a contiguous copy of the
    sequences' pages (no table); pages it reads go to it with the table, and a left-padded call stays composed."""
    from flash_attention import _ops
    calls = []

    def fake_split(q, k, v, used, table, *args):
        calls.append((k, v, table))
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(_ops, "decode_route", lambda q, tier: _ops.DecodeRoute(80, 64, 80, 132, 232448))
    monkeypatch.setattr(_ops, "split_tier_is_default", lambda q, tier: False)
    monkeypatch.setattr(_ops, "split_forward_tier", lambda q, k, table, leftpad, packed, tier:
                        "sm80" if leftpad is not None or (table is not None and not _ops.forward_reads_pages(
                            "sm90", k.shape[1], q.shape[-1])) else "sm90")
    monkeypatch.setattr(_ops, "split_attention", fake_split)
    b, sq, hk, d, cache_len = 2, 128, 2, 64, 192
    q = torch.randn(b, sq, 8, d, dtype=bf16)
    pool_k, table = paged(torch.randn(b, cache_len, hk, d, dtype=bf16), page_size, b)
    pool_v = torch.randn_like(pool_k)
    pads = torch.tensor([0, 5], dtype=torch.int32) if leftpad else None
    flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=cache_len, cache_leftpad=pads, block_table=table,
                            causal=True)
    if leftpad:
        assert not calls and len(stub_kernel) == 1  # composed: one varlen call
        return
    (k, v, passed_table), = calls
    if gathered:
        assert passed_table is None and k.shape == (b, cache_len, hk, d)
        assert torch.equal(k, unpaged(pool_k, table)) and torch.equal(v, unpaged(pool_v, table))
    else:
        assert k is pool_k and v is pool_v and torch.equal(passed_table, table)


@pytest.mark.cuda
@pytest.mark.parametrize("d, rotary", [(64, None), (64, (64, True)), (64, (32, False)), (64, (40, False)),
                                       (128, (128, False)), (72, (24, True)), (256, (256, True))])
@pytest.mark.parametrize("layout", ["plain", "batch_idx", "page3", "page16"])
@pytest.mark.parametrize("sq, s_new, q_steps", [(1, 1, True), (3, 5, True), (2, 0, False), (4, 2, False)])
def test_append_kernel_matches_ops_cuda(d, rotary, layout, sq, s_new, q_steps):
    """The append kernel writes the same cache bits and returns the same rotated q as the PyTorch ops it replaces, for
    any head dim, rotary dim (interleaved or not, partial, a half not a multiple of 8), cache layout, new tokens past
    the cache's end (the last of them written to its last row) and rotary positions past the table (clamped to its last row)."""
    from flash_attention import _ops, kvcache
    require_kernel(d, bf16, "append")
    if rotary is None and s_new == 0:
        pytest.skip("nothing to append or rotate")
    b, h, hk, cache_len = 3, 8, 2, 48
    torch.manual_seed(d + s_new)
    q = torch.randn(b, sq, h, d, dtype=bf16, device="cuda")
    k, v = ((torch.randn(b, s_new, hk, d, dtype=bf16, device="cuda") for _ in range(2)) if s_new else (None, None))
    seqlens = torch.tensor([0, 17, cache_len - 1], dtype=torch.int32, device="cuda")
    cos = sin = None
    if rotary:
        cos, sin = rotary_tables(cache_len - 4, rotary[0], "cuda")  # positions past its end are clamped
    page = {"page3": 3, "page16": 16}.get(layout)
    if page:
        pool = torch.randn(b * cache_len // page + 2, page, hk, d, dtype=bf16, device="cuda")
        table = torch.randperm(pool.shape[0], device="cuda")[: b * cache_len // page].view(b, -1).int()
        caches, batch_idx = (pool, pool.clone() + 1), None
    else:
        caches = tuple(torch.randn(b + 2, cache_len, hk, d, dtype=bf16, device="cuda") for _ in range(2))
        table, batch_idx = None, (torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
                                  if layout == "batch_idx" else None)
    interleaved = bool(rotary and rotary[1])
    results = []
    for use_kernel in (True, False):
        k_cache, v_cache = (c.clone() for c in caches)
        args = (q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, table, interleaved, q_steps)
        q_rot = _ops.append_kv(*args) if use_kernel else kvcache._append_and_rotate(*args, cache_len)
        results.append((q_rot, k_cache, v_cache))
    for kernel_t, ops_t in zip(*results):
        assert torch.equal(kernel_t, ops_t)
    assert not torch.equal(results[0][1], caches[0]) or s_new == 0


@pytest.mark.parametrize("layout", ["plain", "page4"])
def test_append_past_the_cache_end_keeps_the_last_token(layout):
    """New rows that would run past the cache's end all land on its last row: the last new token is the one written
    there (the kernel writes only it; the ops write it from every duplicate), rows before it as usual."""
    from flash_attention import kvcache
    b, hk, d, cache_len, s_new = 2, 2, 8, 12, 5
    k, v = (torch.randn(b, s_new, hk, d, dtype=bf16) for _ in range(2))
    seqlens = torch.tensor([9, 12], dtype=torch.int32)  # 3 rows left, and none
    q = torch.randn(b, 1, 4, d, dtype=bf16)
    if layout == "page4":
        table = torch.arange(b * cache_len // 4, dtype=torch.int32).view(b, -1).flip(1).contiguous()
        caches = [torch.zeros(b * cache_len // 4, 4, hk, d, dtype=bf16) for _ in range(2)]
    else:
        table = None
        caches = [torch.zeros(b, cache_len, hk, d, dtype=bf16) for _ in range(2)]
    kvcache._append_and_rotate(q, *caches, k, v, None, None, seqlens, None, table, False, True, cache_len)

    def row(cache, i, r):
        if table is None:
            return cache[i, r]
        return cache[table[i, r // 4], r % 4]

    for i, filled in enumerate((9, 12)):
        for r in range(filled, cache_len - 1):
            assert torch.equal(row(caches[0], i, r), k[i, r - filled])
        assert torch.equal(row(caches[0], i, cache_len - 1), k[i, s_new - 1])
        assert torch.equal(row(caches[1], i, cache_len - 1), v[i, s_new - 1])
