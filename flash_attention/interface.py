"""Public functions, with flash-attn 2.x's names, parameters and return conventions."""

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import _catalog, _checks, _dispatch, _ops, _paged


def normalize_window(window_size: Sequence[int], causal: bool, seqlen_q: int, seqlen_k: int) -> Tuple[int, int]:
    """(window_left, window_right) for the kernel. Causal is a right bound of 0. A bound that every row's range
    already satisfies becomes -1, which lets the kernel skip masking on that side; this never changes the result:
    query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right, so left >= sk - 1 and right >= sq - 1
    exclude no key of any row."""
    left, right = window_size
    if causal:
        right = 0
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    return left, right


def pad_head_dim(t: torch.Tensor) -> torch.Tensor:
    """Zero-pad the head dim to a multiple of 8, the kernels' granularity; zero columns leave q.k unchanged and
    give output columns that are sliced off."""
    pad = -t.shape[-1] % 8
    return F.pad(t, (0, pad)) if pad else t


def _check_dropout(dropout_p) -> None:
    p = _checks.as_float(dropout_p)
    if p is None or not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if p > 0.0:
        raise NotImplementedError(f"dropout is not supported yet: dropout_p must be 0.0, got {dropout_p!r}")


_NO_WINDOW = (-1, -1)


def _default_options(dropout_p, causal, window_size, softcap, deterministic) -> bool:
    """Whether the scalars are as most calls pass them, with nothing to check or convert: no dropout, window or
    softcap (as Python floats and a tuple), causal and deterministic bools."""
    return (type(dropout_p) is float and dropout_p == 0.0 and type(window_size) is tuple and window_size == _NO_WINDOW
            and type(softcap) is float and softcap == 0.0 and type(causal) is bool and type(deterministic) is bool)


def _scalar_options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic):
    """flash-attn 2's scalar arguments, checked, with flash-attn 2's conventions resolved: a negative window bound
    is unbounded and softcap <= 0 is off. Returns (softmax_scale, causal, window_size, softcap, deterministic) with
    Python values: a float or None, a bool, two ints >= -1, a float >= 0, a bool."""
    if softmax_scale is None and _default_options(dropout_p, causal, window_size, softcap, deterministic):
        return None, causal, _NO_WINDOW, 0.0, deterministic
    _check_dropout(dropout_p)
    scale = None if softmax_scale is None else _checks.as_float(softmax_scale)
    if scale is None and softmax_scale is not None:
        raise ValueError(
            f"softmax_scale must be None (for 1/sqrt(head_dim)) or a finite number, got {softmax_scale!r}"
        )
    cap = _checks.as_float(softcap)
    if cap is None:
        raise ValueError(f"softcap must be a finite number (<= 0 turns it off), got {softcap!r}")
    return (scale, _checks.as_flag(causal, "causal"), _checks.window_pair(window_size), max(cap, 0.0),
            _checks.as_flag(deterministic, "deterministic"))


def pack_gqa(q: torch.Tensor, hk: int) -> torch.Tensor:
    """q (b, sq, hk * group, d) as (b, sq * group, hk, d): the query heads that share a kv head become rows of that
    kv head, row (query, head in group), so a kernel reads each K/V block once per kv head rather than once per query
    head, its query tile filled with group * sq rows. A view when sq is 1. Exact where every row sees the same keys
    in the same order (one query row, or no mask) and no per-head or per-position bias applies."""
    b, sq, h, d = q.shape
    return q.reshape(b, sq, hk, h // hk, d).transpose(2, 3).reshape(b, sq * (h // hk), hk, d)


def unpack_gqa(out: torch.Tensor, lse: torch.Tensor, sq: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """pack_gqa's inverse on the attention of the packed rows: out (b, sq * group, hk, d) -> (b, sq, h, d), lse
    (b, hk, sq * group) -> (b, h, sq)."""
    b, rows, hk, d = out.shape
    group = rows // sq
    return (out.reshape(b, sq, group, hk, d).transpose(2, 3).reshape(b, sq, hk * group, d),
            lse.reshape(b, hk, sq, group).transpose(2, 3).reshape(b, hk * group, sq))


# The sequence arguments of a batched call: no cu_seqlens or seqused, max_seqlen 0 (the tensors' rows).
_BATCHED = (None, None, None, None, 0, 0)


def _attention(q, k, v, sequences, softmax_scale, window, softcap, alibi_slopes, deterministic, tier):
    """The attention op on validated q, k, v, with the head dim zero-padded to a multiple of 8 and the padding sliced
    off the output; `sequences`: (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k), or
    _BATCHED. The scalars are Python values (_scalar_options). Returns (out, lse). Views the kernels cannot load (a
    strided last dimension, say) are copied by the binding."""
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = d ** -0.5  # the original head dim, not the padded one
    if d % 8:
        q, k, v = pad_head_dim(q), pad_head_dim(k), pad_head_dim(v)
    out, lse = _ops.attention(q, k, v, *sequences, softmax_scale, *window, softcap, alibi_slopes, deterministic, tier)
    return (out[..., :d] if d % 8 else out), lse


def _common_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                    tier):
    """_forward's (out, lse) of the most common eager calls by the shortest path, or None for the general path below.
    On a slow host each Python layer of that path costs microseconds a call (issue 18), so this one function does
    what the layers would do for the calls it takes: plain CUDA tensors of a (device, head dim, dtype) whose kernels
    are found (_ops.autograd_route), valid as check_inputs' first line would pass them, head dim a multiple of 8,
    the default options (_default_options) with softmax_scale None or a finite float, no alibi or tier argument, and
    something to compute. It leaves to the general path the GQA decode row (packed there) of a differentiable call.
    The tensor checks are _checks._qkv_valid's, written out here: calling it and reading the shapes again cost 0.6 us
    a call on the development CPU (the GPU host runs Python about 2.7x slower), most of the eager forward's margin
    over SDPA FLASH on issue 18's one-row shape (2.8 us, RESULTS.md session 46)."""
    if not (alibi_slopes is None and tier is None
            and _default_options(dropout_p, causal, window_size, softcap, deterministic)
            and (softmax_scale is None or type(softmax_scale) is float and -math.inf < softmax_scale < math.inf)
            and type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0):
        return None
    qs, ks = q.shape, k.shape
    if not (len(qs) == 4 and len(ks) == 4 and v.shape == ks and q.dtype in _checks.INPUT_DTYPES and k.dtype == q.dtype
            and v.dtype == q.dtype):
        return None
    b, sq, h, d = qs
    _, sk, hk, _ = ks
    if not (b and sq and sk and h and hk and d and ks[0] == b and ks[3] == d and d % 8 == 0
            and d <= _catalog.MAX_HEAD_DIM and h % hk == 0):
        return None
    device = q.get_device()
    if k.get_device() != device or v.get_device() != device:
        return None
    window = (-1, 0 if causal and sq > 1 else -1)  # normalize_window's: one row sees every key
    grad = _ops.needs_grad(q, k, v)
    if not grad and sq <= 64:
        route = _ops.decode_route(q, None)
        return None if route is None else _decode_forward(q, k, v, softmax_scale, window, 0.0, None, route)
    if grad and sq == 1 and h > hk:
        return None
    route = _ops.autograd_routes.get((device, d, q.dtype, _dispatch.requested_tier(None)))
    if route is None:  # the first call of this (device, head dim, dtype), or not a CUDA one
        if not q.is_cuda:
            return None
        try:
            route = _ops.autograd_route(q, None)
        except RuntimeError:  # no kernel: the general path raises why
            return None
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    ext = _dispatch.load_extension()
    if not grad:
        return ext.fwd(q, k, v, None, None, None, None, 0, 0, scale, *window, 0.0, None, route[0], route[1])
    if route[2] is None:
        return None
    return ext.attention_autograd(q, k, v, None, None, None, None, 0, 0, scale, *window, 0.0, None, deterministic,
                                  *route)


def _forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, tier):
    common = _common_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                             deterministic, tier)
    if common is not None:
        return common
    softmax_scale, causal, window_size, softcap, deterministic = _scalar_options(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic)
    _checks.check_inputs(q, k, v, alibi_slopes, tier)
    b, sq, h, d = q.shape
    _, sk, hk, _ = k.shape
    window = normalize_window(window_size, causal, sq, sk)
    # Empty calls skip the decode route: the general path returns them without a kernel.
    if sq <= 64 and not _ops.nothing_to_compute(q, k, None) and alibi_slopes is None and d % 8 == 0 \
            and not _ops.needs_grad(q, k, v):
        route = _ops.decode_route(q, tier)
        if route is not None:
            return _decode_forward(q, k, v, softmax_scale, window, softcap, tier, route)
    if sq == 1 and h > hk and window == (-1, -1) and alibi_slopes is None:
        # A decode step with GQA: its one query row sees every key in every head, so pack_gqa applies (a view here).
        out, lse = _attention(pack_gqa(q, hk), k, v, _BATCHED, softmax_scale, window, softcap, None, deterministic,
                              tier)
        return unpack_gqa(out, lse, sq)
    return _attention(q, k, v, _BATCHED, softmax_scale, window, softcap, alibi_slopes, deterministic, tier)


def _decode_forward(q, k, v, softmax_scale, window, softcap, tier, route):
    """A decode-shaped call without gradient (at most 64 query rows) on the native split kernels: the query heads of a
    kv head packed into one tile's rows (each masked as its query row), the keys cut into chunks that fill the GPU
    (_ops.split_count), merged by the combine kernel or, on Hopper, inside a cluster. On Hopper it beat the SM90
    forward, whose one CTA per (batch, head) leaves most SMs idle, on two of three measured shapes (b 8 with 4k keys
    lost 12%; RESULTS.md). route: _ops.decode_route(q, tier)."""
    b, sq, h, d = q.shape
    hk = k.shape[2]
    group = h // hk
    # The kernel packs the rows, which come back unpacked.
    splits = _ops.route_split_count(route, 0, b, hk, sq * group, k.shape[1], d)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    return _ops.decode_attention(route, q, k, v, None, None, None, scale, *window, softcap, -splits, group,
                                 tier)  # negative: an automatic count


def _varlen_forward(q, k, v, sequences, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, tier):
    """_forward for packed sequences; `sequences`: (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k)."""
    softmax_scale, causal, window_size, softcap, deterministic = _scalar_options(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic)
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k = sequences
    max_seqlen_q, max_seqlen_k = _checks.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                             seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                                                             tier)
    if _checks.varlen_values_check_requested():
        _checks.check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                    max_seqlen_k)
    # A bound may be dropped only where no sequence needs it: the totals bound every sequence's length, while
    # max_seqlen is a hint that the kernels do not trust.
    window = normalize_window(window_size, causal, q.shape[0], k.shape[0])
    sequences = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return _attention(q, k, v, sequences, softmax_scale, window, softcap, alibi_slopes, deterministic, tier)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    tier: Optional[str] = None,
):
    """Exact attention, differentiable with respect to q, k and v.

    q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_k, head_dim), fp16 or bf16 on CUDA,
    nheads % nheads_k == 0 (GQA/MQA), head_dim <= 256; a last dimension that is not contiguous is copied.
    Query i sees key j iff i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1]
    (a negative bound leaves its side unbounded); causal=True sets the right bound to 0 (bottom-right aligned).
    window_size is a pair of integer-likes or an integer tensor of shape (2,), read with one .tolist(): no device
    synchronisation on the CPU, one on a GPU. softcap > 0 applies softcap * tanh(score / softcap) (<= 0: off);
    alibi_slopes (fp32, (nheads,) or (batch, nheads)) adds -slope * |i + seqlen_k - seqlen_q - j| to the score.
    A row that sees no key gets output 0 and lse -inf. dropout_p must be 0 (dropout is not supported yet).
    deterministic=True makes the backward bitwise reproducible (dq is accumulated in a fixed order; the default adds
    it with atomics, faster); the forward always is.
    tier ("sm80", ...) forces a kernel tier, as does the FLASH_ATTN_TIER environment variable.

    Returns out (batch, seqlen_q, nheads, head_dim), or (out, softmax_lse, None) when return_attn_probs, with
    softmax_lse fp32 (batch, nheads, seqlen_q) in natural log. A gradient reaching softmax_lse (when the loss uses it)
    flows into dq and dk.
    """
    out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                        tier)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    tier: Optional[str] = None,
):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, head_dim); q, k and v are strided views, not copies."""
    _checks.check_packed(qkv, "qkv", 3, "(batch, seqlen, 3, nheads, head_dim)")
    q, k, v = qkv.unbind(dim=2)
    out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                        tier)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    tier: Optional[str] = None,
):
    """flash_attn_func on q and kv (batch, seqlen_k, 2, nheads_k, head_dim); k and v are strided views of kv."""
    _checks.check_packed(kv, "kv", 2, "(batch, seqlen_k, 2, nheads_k, head_dim)")
    k, v = kv.unbind(dim=2)
    out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                        tier)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    seqused_q=None,
    seqused_k=None,
    tier: Optional[str] = None,
):
    """flash_attn_func on a batch of sequences of different lengths, packed along the first dim.

    q: (total_q, nheads, head_dim); k, v: (total_k, nheads_k, head_dim). Sequence i has the query rows
    [cu_seqlens_q[i], cu_seqlens_q[i + 1]) and the key/value rows [cu_seqlens_k[i], cu_seqlens_k[i + 1]);
    cu_seqlens_q/k: int32 (batch + 1,), from 0 to total_q/total_k, on q's device. max_seqlen_q/k (ints, or integer
    tensors of one element): at least the longest query/key sequence; only a hint for the kernel's tiles, so a
    tensor on a GPU is not read (a synchronisation): total_q/total_k stand in. seqused_q/seqused_k (int32 (batch,),
    as in FlashAttention-3): sequence i uses only the first seqused[i] rows of its slot; with seqused_q, every query
    row outside the used ones (also rows after cu_seqlens_q[-1]) gets out 0, lse -inf and zero gradients; with
    seqused_k, every key row outside them zero gradients. Masks, softcap and ALiBi apply within each sequence,
    aligned bottom-right with its (used) lengths; alibi_slopes: (nheads,) or (batch, nheads). The sequence tensors'
    values are not checked (it would wait for the GPU; see _checks.check_varlen_inputs); FLASH_ATTN_CHECK_VARLEN=1
    checks them. block_table (int32 (batch, max_blocks), flash-attn 2's paged KV cache): k and v are then pages
    (num_blocks, page_size, nheads_k, head_dim) of any page size, sequence i's key j at page block_table[i, j //
    page_size], row j % page_size, its length cu_seqlens_k[i + 1] - cu_seqlens_k[i]; the pages are gathered into
    a contiguous copy before the kernel runs (flash_attention._paged: each sequence's used rows by a gather kernel,
    or, where a gradient flows to q, k or v, the whole table by differentiable indexing).

    Returns out (total_q, nheads, head_dim), or (out, softmax_lse, None) when return_attn_probs, with softmax_lse
    fp32 (nheads, total_q).
    """
    if block_table is not None:
        k, v, cu_seqlens_k, seqused_k, max_seqlen_k = _paged.packed_from_pages(k, v, block_table, cu_seqlens_k,
                                                                               seqused_k, _ops.needs_grad(q, k, v))
    sequences = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    out, lse = _varlen_forward(q, k, v, sequences, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, tier)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    seqused=None,
    tier: Optional[str] = None,
):
    """flash_attn_varlen_func on qkv (total, 3, nheads, head_dim), whose queries and keys share cu_seqlens,
    max_seqlen and seqused; q, k and v are strided views, not copies."""
    _checks.check_packed(qkv, "qkv", 3, "(total, 3, nheads, head_dim)", rank=4)
    q, k, v = qkv.unbind(dim=1)
    out, lse = _varlen_forward(q, k, v, (cu_seqlens, cu_seqlens, seqused, seqused, max_seqlen, max_seqlen), dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, tier)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    seqused_q=None,
    seqused_k=None,
    tier: Optional[str] = None,
):
    """flash_attn_varlen_func on q and kv (total_k, 2, nheads_k, head_dim); k and v are strided views of kv."""
    _checks.check_packed(kv, "kv", 2, "(total_k, 2, nheads_k, head_dim)", rank=4)
    k, v = kv.unbind(dim=1)
    sequences = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    out, lse = _varlen_forward(q, k, v, sequences, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, tier)
    return (out, lse, None) if return_attn_probs else out
