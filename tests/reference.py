"""Plain PyTorch attention with the package's semantics, the yardstick for the kernels."""

import torch


def attention_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), device=None):
    """Bool (seqlen_q, seqlen_k): query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right, where a
    bound of -1 is absent and causal sets right = 0."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diagonal = i + seqlen_k - seqlen_q
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= diagonal - left
    if right >= 0:
        mask &= j <= diagonal + right
    return mask


def attention_ref(
    q,
    k,
    v,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    softmax_scale=None,
    upcast=True,
):
    """q (b, sq, h, d), k/v (b, sk, hk, d). Returns out (b, sq, h, d) and lse (b, h, sq) fp32.

    upcast=True computes in fp32 and returns out in fp32 (not rounded to the input dtype, so it serves as the exact
    answer); upcast=False does the same math in the input dtype, to measure how far plain PyTorch drifts.
    A row that sees no key gets out 0 and lse -inf."""
    b, seqlen_q, h, d = q.shape
    seqlen_k, hk = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype).reshape(-1, h, 1, 1)  # (h,) or (b, h)
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        distance = (i + seqlen_k - seqlen_q - j).abs().to(scores.dtype)
        scores = scores - slopes * distance
    mask = attention_mask(seqlen_q, seqlen_k, causal, window_size, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)
    # softmax of an all -inf row is NaN; such rows see no key and get probability 0 everywhere.
    probs = torch.softmax(scores, dim=-1).masked_fill(~mask.any(dim=-1)[:, None], 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse.float()
