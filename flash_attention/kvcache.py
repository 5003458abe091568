"""flash-attn 2's flash_attn_with_kvcache: the append, the rotary embedding and the attention as native kernels.

The new keys and values (rotary embedding applied to the keys) are written into the cache in place, and q rotated, by
one kernel (_ops.append_kv; under torch.compile, PyTorch ops with the same arithmetic); the attention
then runs over each sequence's used rows (cache_seqlens plus the new tokens, from cache_leftpad on). Nothing reads a
tensor's values on the host, so a decode step can be captured in a CUDA graph and traced by torch.compile.

Without ALiBi, and unless prefill-shaped (more than 64 query rows) on a GPU
with a faster tier of its own (Hopper) with cache_leftpad, the call is native (_ops.decode_attention;
_ops.split_attention on the faster tier): CTAs read the cache in place (a paged one through its block table; from
cache_leftpad on), each sequence's keys cut into num_splits chunks (0: enough to fill the GPU; each chunk masked as the
whole call is) whose fp32 partials the combine kernel merges (on Hopper, up to 16 chunks merge inside a thread-block
cluster instead). Decode-shaped calls run the SM80 tier's decode kernels, the query heads of a kv head packed as rows
of one sequence (GQA packing, each packed row masked as its query row), so each K/V block is read once per kv head;
prefill-shaped ones on Hopper run the SM90 forward, unpacked (a paged cache by TMA or row by row from its pages, or,
for pages of a size it does not read, and pages it would copy row by row where a gather pass costs less, from
contiguous copies of the used rows, gathered first). Otherwise, and
under torch.compile, it is composed: pages or the entries that cache_batch_idx selects are gathered into a contiguous
copy, and where exact (one query row, or no mask, and no window or ALiBi) the query heads are packed and the chunks
attended to as sequences of their own in one varlen call, whose outputs flash_attn_combine merges by their lse (rounded
to the input dtype before the merge). Not yet native: ALiBi.
"""

import functools
from typing import Optional

import torch

from . import _checks, _ops, _paged, cute, interface


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, nheads, head_dim) with its first 2 * cos.shape[1] dims rotated at positions (batch, seqlen)
    (rows of cos and sin), in fp32; interleaved rotates pairs (0, 1), (2, 3), ..., else the two halves (GPT-NeoX)."""
    half = cos.shape[1]
    c = cos[positions].unsqueeze(2).float()  # (batch, seqlen, 1, half)
    s = sin[positions].unsqueeze(2).float()
    xr = x[..., : 2 * half].float()
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _check_kvcache_inputs(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                          cache_leftpad, block_table):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, got {type(t).__name__}"
                             f"{'' if not isinstance(t, torch.Tensor) else ' of shape ' + str(tuple(t.shape))}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, "
                             f"{t.device}")
    b, _, h, d = q.shape
    hk, dk = k_cache.shape[2], k_cache.shape[3]
    if dk != d:
        raise ValueError(f"k_cache's head dim must be q's ({d}), got {dk}")
    if h % hk != 0:
        raise ValueError(f"q's nheads ({h}) must be a multiple of k_cache's nheads_k ({hk})")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values), or neither")
    int32_vectors = [("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)]
    if isinstance(cache_seqlens, torch.Tensor):
        int32_vectors.append(("cache_seqlens", cache_seqlens))
    elif cache_seqlens is not None and (isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int)):
        raise ValueError(f"cache_seqlens must be None, an int or an int32 tensor of shape ({b},), got "
                         f"{type(cache_seqlens).__name__}")
    for name, t in int32_vectors:
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.shape != (b,)
                              or t.device != q.device):
            raise ValueError(f"{name} must be an int32 tensor of shape ({b},) on q's device, got "
                             f"{_paged.describe(t)}")
    if block_table is not None:
        _paged.check_block_table(block_table, b, k_cache, v_cache)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with block_table (a paged cache)")
    elif cache_batch_idx is None and k_cache.shape[0] < b:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, fewer than q's batch ({b}); pass "
                         f"cache_batch_idx to select them")
    cache_len = _cache_len(k_cache, block_table)
    if k is not None:
        if k.dim() != 4 or k.shape[0] != b or k.shape[2:] != (hk, d) or v.shape != k.shape:
            raise ValueError(f"k and v must be ({b}, seqlen_new, {hk}, {d}), got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
            raise ValueError("k and v must have q's dtype and device")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given with new keys and values (where they are written)")
        if k.shape[1] > cache_len:
            raise ValueError(f"the cache ({cache_len} rows) is too short for the {k.shape[1]} new tokens")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together, or neither")
    if rotary_cos is not None:
        if (rotary_cos.dim() != 2 or rotary_sin.shape != rotary_cos.shape or 2 * rotary_cos.shape[1] > d
                or rotary_cos.device != q.device or rotary_sin.device != q.device):
            raise ValueError(f"rotary_cos and rotary_sin must be (seqlen_ro, rotary_dim / 2) on q's device with "
                             f"rotary_dim <= head_dim ({d}), got {tuple(rotary_cos.shape)} and "
                             f"{tuple(rotary_sin.shape)}")


def _cache_len(k_cache, block_table) -> int:
    """Rows a sequence's cache can hold."""
    return k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)


# Where the faster tier would copy a paged cache's rows (pages of 16 or 48 on Hopper), gathering them first by
# _ops.gather_pages pays once each key row meets this many query rows. H200, bf16, pages of 16, causal against 4096 to
# 16384 keys (RESULTS.md, session 72): the row copies cost 1.08-1.15x the contiguous cache; gathered first (3.3-3.9
# TB/s), 1.02-1.05x where a key row meets 6000 or more query rows, 1.08-1.10x (as the rows) at 3600-3800, 1.11-1.12x
# (the rows 1.10-1.11x) at 1900-2000.
_GATHER_MIN_REUSE = 3072
# The copies are allocated per call: above this, the pages are read in place.
_GATHER_MAX_BYTES = 256 << 20


def _gather_pays(tier_name: str, k_cache, b: int, sq: int, h: int, cache_len: int, causal: bool, local: bool) -> bool:
    """Whether gathering a paged cache into contiguous copies (_ops.gather_pages, one pass over the used rows) costs
    less than tier_name's forward copying its pages row by row: where each key row meets enough query rows (the query
    heads of its kv head times the query rows that see it, the capacity counted as used; local windows not estimated)
    and the copies take at most _GATHER_MAX_BYTES."""
    if local or not _ops.forward_copies_page_rows(tier_name, k_cache.shape[1]):
        return False
    hk, d = k_cache.shape[2:]
    if 2 * b * cache_len * hk * d * k_cache.element_size() > _GATHER_MAX_BYTES:
        return False
    sk = cache_len
    pairs = (sq * sk - sq * (sq - 1) // 2 if sq <= sk else sk * (sk + 1) // 2) if causal else sq * sk
    return h // hk * pairs >= _GATHER_MIN_REUSE * sk


def _cache_rows(cache: torch.Tensor, block_table, cache_batch_idx, b: int) -> torch.Tensor:
    """(b, cache_len, nheads_k, head_dim): each sequence's cache, a view when it already is one."""
    if block_table is not None:
        return _paged.gather_pages(cache, block_table)
    if cache_batch_idx is not None:
        return cache[cache_batch_idx.long().clamp(0, cache.shape[0] - 1)]
    return cache[:b]


def _append(cache: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, block_table, cache_batch_idx) -> None:
    """Writes new (b, seqlen_new, ...) at cache rows `rows` (b, seqlen_new) of each sequence, in place."""
    if block_table is not None:
        page = cache.shape[1]
        blocks = block_table.long().gather(1, rows // page).clamp(0, cache.shape[0] - 1)
        cache[blocks, rows % page] = new
    else:
        b = new.shape[0]
        batch = (cache_batch_idx.long().clamp(0, cache.shape[0] - 1) if cache_batch_idx is not None
                 else torch.arange(b, device=new.device))
        cache[batch[:, None], rows] = new


def _append_kernel_usable(q, k_cache, v_cache, k, v, cos, sin) -> bool:
    """Whether the append kernel takes these tensors: eager, on a GPU, last dims contiguous, rotary tables in q's
    dtype with contiguous rows (it reads them element by element at fixed strides)."""
    if not q.is_cuda or torch.compiler.is_compiling():
        return False
    if any(t is not None and t.stride(-1) != 1 for t in (q, k_cache, v_cache, k, v, cos, sin)):
        return False
    if cos is not None and (cos.dtype != q.dtype or sin.dtype != q.dtype or sin.stride() != cos.stride()):
        return False
    return _ops.append_kernel_available(q)


def _append_and_rotate(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, block_table, interleaved,
                       q_steps, cache_len) -> torch.Tensor:
    """_ops.append_kv as PyTorch ops: k (rotated) and v written into the caches in place, q rotated (returned)."""
    filled = cache_seqlens.long().clamp(0, cache_len)
    if k is not None:
        steps = torch.arange(k.shape[1], device=q.device)
        ends = filled[:, None] + steps
        rows = ends.clamp(max=cache_len - 1)
        # Rows past the cache's end land on its last row, and all carry the last new token (the kernel writes only
        # that one), so that the order of the duplicate writes does not matter.
        src = torch.where(ends >= cache_len - 1, k.shape[1] - 1, steps)
        batch = torch.arange(k.shape[0], device=q.device)[:, None]
        k, v = k[batch, src], v[batch, src]
        if cos is not None:
            k = apply_rotary(k, cos, sin, rows.clamp(max=cos.shape[0] - 1), interleaved)
        _append(k_cache, k, rows, block_table, cache_batch_idx)
        _append(v_cache, v, rows, block_table, cache_batch_idx)
    if cos is None:
        return q
    sq = q.shape[1]
    steps = torch.arange(sq, device=q.device) if q_steps else torch.zeros(sq, dtype=torch.long, device=q.device)
    return apply_rotary(q, cos, sin, (filled[:, None] + steps).clamp(max=cos.shape[0] - 1), interleaved)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    tier: Optional[str] = None,
):
    """Attention of q against a KV cache, with flash-attn 2's semantics.

    q: (batch, seqlen_q, nheads, head_dim). k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, head_dim), or
    with block_table (int32 (batch, max_blocks): sequence i's rows j are at page block_table[i, j // page_size], row
    j % page_size) (num_blocks, page_size, nheads_k, head_dim), any page size. cache_seqlens: the cache's filled
    rows per sequence (int32 (batch,) or an int; None: all of them). k, v (batch, seqlen_new, nheads_k, head_dim):
    new keys and values, written into the cache in place at rows cache_seqlens[i] onwards, then attended to.
    cache_batch_idx (int32 (batch,)): the cache entry of each sequence (default 0..batch-1). cache_leftpad (int32
    (batch,)): the first used row of each sequence's cache. rotary_cos/rotary_sin ((seqlen_ro, rotary_dim / 2)):
    the new keys are rotated at their cache rows; q at rows cache_seqlens[i] + its row when causal or local, else
    all at cache_seqlens[i]; interleaved (pairs) or not (halves), as rotary_interleaved says. Masks align
    bottom-right with the used rows [cache_leftpad, cache_seqlens + seqlen_new). num_splits: key chunks per sequence
    (see the module's docstring), 0 for a count from the shape and the SM count, 1 for none.
    Values are not checked (that would wait for the GPU): out-of-range ones are clamped to the tensors, which keeps
    every access in bounds but makes the result unspecified.

    Returns out (batch, seqlen_q, nheads, head_dim), and softmax_lse (batch, nheads, seqlen_q) fp32 when
    return_softmax_lse.
    """
    _check_kvcache_inputs(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                          cache_leftpad, block_table)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 picks a count), got {num_splits!r}")
    b, sq, h, d = q.shape
    cache_len = _cache_len(k_cache, block_table)
    if cache_seqlens is None:
        cache_seqlens = cache_len
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    s_new = 0 if k is None else k.shape[1]
    causal = _checks.as_flag(causal, "causal")
    local = _checks.window_pair(window_size) != (-1, -1)

    if k is not None or rotary_cos is not None:
        # The new keys go at rows filled + t of each sequence; q's rows are rotated at filled (+ their row when causal
        # or local). One kernel where it can (eager, on a GPU), else PyTorch ops with the same arithmetic.
        args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table,
                bool(rotary_interleaved), causal or local)
        q = _ops.append_kv(*args) if _append_kernel_usable(*args[:7]) else _append_and_rotate(*args, cache_len)

    hk = k_cache.shape[2]
    group = h // hk
    # Where every query row sees the same keys (one query row, or no mask) and no per-head or per-position bias
    # applies, the keys can be regrouped freely (exact). Native calls (the SM80-tier kernel reads the cache in place
    # and splits the keys itself, each chunk masked as the whole call) GQA-pack under any mask too: the kernel masks
    # a packed row as its query row.
    # - GQA packing (interface.pack_gqa): the query heads that share a kv head become rows of one sequence of it, so
    #   each K/V block is read once per kv head;
    # - split-KV: each sequence's used keys are cut into `splits` chunks whose outputs are combined by their lse: a
    #   decode step with few (sequence, kv head) pairs then fills the GPU. Composed (not native), each chunk is a
    #   sequence of its own in a varlen call, which only an exact call allows.
    exact = alibi_slopes is None and not local and (sq == 1 or not causal)
    if exact:
        causal = False  # one query row sees every used key under a bottom-right causal mask
    # Prefill-shaped calls (more than 64 query rows per head) on a GPU with a faster tier than the split kernels'
    # (Hopper) go to that tier's forward: natively and unpacked where it writes the partials itself (a contiguous
    # cache or pages of a size it reads, without cache_leftpad: _ops.split_forward_tier; its query tiles fill without
    # packing, which would copy q and out), else composed.
    route = _ops.decode_route(q, tier) if alibi_slopes is None and d % 8 == 0 and not torch.compiler.is_compiling() \
        else None
    can_split = route is not None
    faster_tier = gather = kernel_gathers = False
    if can_split and sq > 64:
        forward_tier = _ops.split_forward_tier(q, k_cache, None, cache_leftpad, 1, tier)
        faster_tier = forward_tier != _ops.SPLIT_TIER
        # Pages the faster tier does not read (by the catalog: of a size no multiple of its page_multiple, or at a head
        # dim outside its paged_head_dims) are gathered into a contiguous copy for it: that costs less than the
        # composed call (H100, 2026-11-26, pages of 16, sq 512-4096 against 4096 keys: the gather 17-57 us, the
        # composed call 64-107 us over the contiguous one). So are pages it would copy row by row, where the gather
        # kernel (which copies the used rows only) takes them and that pays.
        if faster_tier and block_table is not None:
            kernel_gathers = _ops.gather_kernel_usable(k_cache, v_cache)
            gather = not _ops.forward_reads_pages(forward_tier, k_cache.shape[1], d) or (
                kernel_gathers and _gather_pays(forward_tier, k_cache, b, sq, h, cache_len, causal, local))
    native = can_split and (sq <= 64 or faster_tier or _ops.split_tier_is_default(q, tier))
    pack = group > 1 and (exact or native) and not faster_tier
    # A native call's rows are packed by the kernel, and come back unpacked.
    repack = pack and not native
    if pack:
        rows, heads = sq * group, hk
    else:
        rows, heads = sq, h
    if repack:
        q = interface.pack_gqa(q, hk)
    def used_rows():  # each sequence's rows, the new ones included
        return (cache_seqlens + s_new if s_new else cache_seqlens).contiguous()

    if native:
        # No query copies or split metadata; a paged cache is read in place unless gathered for the faster tier.
        scale, _, _, cap, _ = interface._scalar_options(0.0, softmax_scale, False, (-1, -1), softcap, False)
        scale = d ** -0.5 if scale is None else scale
        window = interface.normalize_window(window_size, causal, sq, cache_len)
        used = used_rows()
        if block_table is not None and not gather:
            keys, values, table = k_cache, v_cache, block_table.contiguous()
        elif gather and kernel_gathers:
            (keys, values), table = _ops.gather_pages(k_cache, v_cache, block_table, used), None
        else:
            keys, values, table = (_cache_rows(k_cache, block_table, cache_batch_idx, b),
                                   _cache_rows(v_cache, block_table, cache_batch_idx, b), None)
        splits = _ops.route_split_count(route, num_splits, b, heads, rows, cache_len, d, table is not None)
        leftpad = None if cache_leftpad is None else cache_leftpad.contiguous()
        # Other than on the faster tier, the forward is SPLIT_TIER's, whose kernels the route holds.
        attend = _ops.split_attention if faster_tier else functools.partial(_ops.decode_attention, route)
        out, lse = attend(q, keys, values, used, table, leftpad, scale, *window, cap,
                          -splits if num_splits == 0 else splits, group if pack else 1, tier)  # negative: automatic
        return (out, lse) if return_softmax_lse else out
    splits = _ops.split_count(num_splits, b, heads, rows, cache_len, d, _ops.sm_count(q.device)) if exact else 1
    if block_table is not None:
        # The varlen call below reads no row past a sequence's used ones (seqused_k): the gather kernel copies those
        # alone where no gradient flows.
        keys, values = _paged.gather_used(k_cache, v_cache, block_table, used_rows(),
                                          _ops.needs_grad(q, k_cache, v_cache))
    else:
        keys = _cache_rows(k_cache, None, cache_batch_idx, b)
        values = _cache_rows(v_cache, None, cache_batch_idx, b)
    chunk = -(-cache_len // splits)
    queries = q.reshape(b, 1, rows, heads, d).expand(b, splits, rows, heads, d)  # each chunk's copy of the rows
    cu_seqlens_q, cu_seqlens_k, seqused_k = _split_sequences(cache_seqlens, cache_leftpad, s_new, b, splits, chunk,
                                                             cache_len, rows)
    out, lse, _ = interface.flash_attn_varlen_func(
        queries.reshape(b * splits * rows, heads, d), keys.reshape(b * cache_len, hk, d),
        values.reshape(b * cache_len, hk, d), cu_seqlens_q, cu_seqlens_k, rows, min(chunk, cache_len),
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, return_attn_probs=True, seqused_k=seqused_k, tier=tier)
    out = out.view(b, splits, rows, heads, d)
    lse = lse.view(heads, b, splits, rows)
    if splits > 1:
        # One query row, packed: the combine writes (b, group, hk, d) straight into a (b, 1, h, d) result, which
        # unpack_gqa then returns as a view, without the regrouping copy.
        dest = q.new_empty(b, 1, h, d).view(b, hk, group, d).transpose(1, 2) if pack and sq == 1 else None
        out, lse = cute.flash_attn_combine(out.transpose(0, 1), lse.permute(2, 1, 3, 0), out=dest, out_dtype=q.dtype)
        lse = lse.transpose(1, 2)  # (b, heads, rows)
    else:
        out, lse = out[:, 0], lse[:, :, 0].transpose(0, 1)  # (b, rows, heads, d), (b, heads, rows)
    if repack:
        out, lse = interface.unpack_gqa(out, lse, sq)
    else:
        lse = lse.contiguous()
    return (out, lse) if return_softmax_lse else out


def _split_sequences(cache_seqlens, cache_leftpad, s_new: int, b: int, splits: int, chunk: int, cache_len: int,
                     rows: int):
    """(cu_seqlens_q, cu_seqlens_k, seqused_k) of the varlen call over the packed cache (b * cache_len rows):
    sequence (i, s) has `rows` query rows and, as keys, chunk s of sequence i's used keys [leftpad[i], cache_seqlens[i]
    + s_new), i.e. rows i * cache_len + leftpad[i] + s * chunk onwards (clamped to its slot, where the chunk is
    empty), at most `chunk` of them. cu_seqlens_q, and without leftpad cu_seqlens_k, depend on the shapes only and
    come from _SplitLayout's cache: a decode step then spends two small kernels here rather than twenty."""
    layout = _SplitLayout.of(cache_seqlens.device, b, splits, chunk, cache_len, rows)
    if cache_leftpad is None:
        used = cache_seqlens[:, None] - layout.offsets
        if s_new:
            used += s_new
        return layout.cu_seqlens_q, layout.cu_seqlens_k, torch.clamp(used, layout.zeros, layout.limits).flatten()
    device = cache_seqlens.device
    leftpad = cache_leftpad.long().clamp(0, cache_len)
    used = (cache_seqlens.long().clamp(0, cache_len) + s_new).clamp(max=cache_len)
    offsets = (leftpad[:, None] + torch.arange(splits, device=device) * chunk).clamp(max=cache_len)  # (b, splits)
    starts = (torch.arange(b, device=device)[:, None] * cache_len + offsets).flatten()
    cu_seqlens_k = torch.cat((starts, starts.new_full((1,), b * cache_len))).to(torch.int32)
    seqused_k = (used[:, None] - offsets).clamp(0, chunk).flatten().to(torch.int32)
    return layout.cu_seqlens_q, cu_seqlens_k, seqused_k


class _SplitLayout:
    """The shape-only int32 tensors of _split_sequences without leftpad: cu_seqlens_q and cu_seqlens_k, the chunks'
    first keys (offsets, (1, splits)) and their sizes within the cache (limits), and zeros. Kept per shape, except
    under CUDA graph capture, whose kernels only run at replay: tensors made then are the graph's, never cached."""
    _cache = {}
    _MAX_ENTRIES = 256

    def __init__(self, device, b, splits, chunk, cache_len, rows):
        starts = torch.arange(splits, device=device, dtype=torch.int64) * chunk
        self.offsets = starts.clamp(max=cache_len).to(torch.int32)[None]
        self.limits = (cache_len - starts).clamp(0, chunk).to(torch.int32)[None]
        self.zeros = torch.zeros_like(self.limits)
        firsts = torch.arange(b, device=device, dtype=torch.int64)[:, None] * cache_len + self.offsets
        self.cu_seqlens_k = torch.cat((firsts.flatten(), firsts.new_full((1,), b * cache_len))).to(torch.int32)
        self.cu_seqlens_q = (torch.arange(b * splits + 1, device=device, dtype=torch.int64) * rows).to(torch.int32)

    @classmethod
    def of(cls, device, b, splits, chunk, cache_len, rows):
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return cls(device, b, splits, chunk, cache_len, rows)
        key = (device, b, splits, chunk, cache_len, rows)
        layout = cls._cache.get(key)
        if layout is None:
            if len(cls._cache) >= cls._MAX_ENTRIES:
                cls._cache.clear()
            layout = cls._cache[key] = cls(device, b, splits, chunk, cache_len, rows)
        return layout
