"""Public functions, with flash-attn 2.x's names, parameters and return conventions."""

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import _checks, _ops


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


def _forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, tier):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0:
        raise NotImplementedError(f"dropout is not supported yet: dropout_p must be 0.0, got {dropout_p}")
    _checks.check_inputs(q, k, v, window_size, softcap, alibi_slopes, tier)
    # The kernels read rows of the head dim as 16-byte vectors: a strided last dimension is copied, as flash-attn does.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))

    seqlen_q, d = q.shape[1], q.shape[3]
    seqlen_k = k.shape[1]
    if softmax_scale is None:
        softmax_scale = d ** -0.5  # the original head dim, not the padded one
    window_left, window_right = normalize_window(_checks.window_pair(window_size), causal, seqlen_q, seqlen_k)
    out, lse = _ops.fwd(
        pad_head_dim(q),
        pad_head_dim(k),
        pad_head_dim(v),
        float(softmax_scale),
        window_left,
        window_right,
        float(softcap),
        alibi_slopes,
        bool(deterministic),
        tier,
    )
    if out.shape[-1] != d:
        out = out[..., :d]
    return out, lse


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
    (-1 = unbounded side); causal=True sets the right bound to 0 (bottom-right aligned).
    softcap > 0 applies softcap * tanh(score / softcap); alibi_slopes (fp32, (nheads,) or (batch, nheads)) adds
    -slope * |i + seqlen_k - seqlen_q - j| to the score. A row that sees no key gets output 0 and lse -inf.
    dropout_p must be 0 (dropout is not supported yet). deterministic=True makes the backward bitwise reproducible
    (dq is accumulated in a fixed order; the default adds it with atomics, faster); the forward always is.
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
