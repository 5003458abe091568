"""FlashAttention-4's Python API (flash_attn.cute, as of its release fa4-v4.0.0.beta27) on this package's kernels, so
that code written against it switches by changing the import:

    from flash_attention.cute import flash_attn_func, flash_attn_varlen_func, flash_attn_combine

The parameters have FA4's names, order and defaults, and the functions return FA4's (out, lse). Where they differ:
- Features that change the result and that the kernels lack raise NotImplementedError when set: qv (MLA),
  gather_kv_indices, learnable_sink, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars,
  block_sparse_tensors, block_sparse_tensors_bwd; so does a negative window bound, which FA4 keeps as a window that
  leaves out the diagonal.
- Performance hints, which do not change the result, are accepted and ignored: num_splits, pack_gqa, min_seqlen_k,
  scheduler_metadata, seqlen_k_per_split, disable_scheduler_metadata.
- A keyword-only tier= picks the kernel tier, as in flash_attention.flash_attn_func; a keyword-only dropout_p (0
  only, as callers written for flash-attn 2 pass it) is accepted too.
- window_size may also be an integer tensor of shape (2,), read with one .tolist() (a device synchronisation when
  it is on a GPU); max_seqlen_q/k may be tensors (see flash_attn_varlen_func).
- flash_attn_varlen_func also serves FA4's argument order from before qv became its 4th parameter (see there).
- page_table (paged keys and values, any page size) gathers the pages into a contiguous copy before the kernel
  (each sequence's used rows, by a gather kernel, unless a gradient flows: then the whole table, differentiably).
Both run on the same custom ops as flash_attention's functions. flash_attn_combine (split-KV partials into one
output) is computed with PyTorch ops.
"""

from typing import Optional

import torch

from . import _catalog, _checks, _dispatch, _ops, _paged
from .interface import _forward, _varlen_forward

_NO_ALIBI = None


def _reject_unsupported(**features) -> None:
    for name, value in features.items():
        if value is not None and not (isinstance(value, (list, tuple)) and not value):
            raise NotImplementedError(
                f"flash_attention.cute: {name} is not supported by this package's kernels; it must be None"
            )


def _window(window_size, causal):
    """FA4's window_size as this package's: resolved as FA4 resolves it (causal sets the right bound to 0; a pair
    summing below 0, such as flash-attn 2's (-1, -1), means no window), then None becomes -1 (unbounded)."""
    pair = _checks.window_elements(window_size) or ()
    bounds = [None if w is None else _checks.as_int(w) for w in pair]
    if len(bounds) != 2 or any(b is None and w is not None for b, w in zip(bounds, pair)):
        raise ValueError(
            "window_size must be a pair of integers or None (None = unbounded), or an integer tensor of shape (2,), "
            f"got {window_size!r}"
        )
    left, right = bounds
    if _checks.as_flag(causal, "causal"):
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    for i, bound in enumerate((left, right)):
        if bound is not None and bound < 0:
            raise NotImplementedError(
                f"flash_attention.cute: window_size[{i}] = {bound} is not supported: a negative bound makes a window "
                "that leaves out the diagonal; use None for an unbounded side"
            )
    return (-1 if left is None else left, -1 if right is None else right)


def _softcap(softcap) -> float:
    """FA4's softcap: a number >= 0, 0 turning it off (flash_attention's flash-attn 2 functions also take a negative
    one as off)."""
    value = _checks.as_float(softcap)
    if value is None or value < 0:
        raise ValueError(f"softcap must be a number >= 0 (0 turns it off), got {softcap!r}")
    return value


def _returned_lse(lse, return_lse: bool, q, k, v) -> Optional[torch.Tensor]:
    """lse as FA4 returns it: when asked for, differentiable; else, when an input requires grad (FA4 then computes lse
    for the backward), without a gradient; else None."""
    if return_lse:
        return lse
    return lse.detach() if any(t.requires_grad for t in (q, k, v)) else None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size=(None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    block_sparse_tensors=None,
    block_sparse_tensors_bwd=None,
    return_lse: bool = False,
    *,
    dropout_p: float = 0.0,
    tier: Optional[str] = None,
):
    """FA4's flash_attn_func: q (batch, seqlen_q, nheads, head_dim), k/v (batch, seqlen_k, nheads_k, head_dim).
    window_size (left, right): None leaves a side unbounded. Returns (out, lse): out like q; lse fp32
    (batch, nheads, seqlen_q), see _returned_lse. The rest as in flash_attention.flash_attn_func."""
    _reject_unsupported(qv=qv, gather_kv_indices=gather_kv_indices, learnable_sink=learnable_sink,
                        score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                        aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
                        block_sparse_tensors_bwd=block_sparse_tensors_bwd)
    out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, _window(window_size, causal), _softcap(softcap),
                        _NO_ALIBI, deterministic, tier)
    return out, _returned_lse(lse, return_lse, q, k, v)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    min_seqlen_k: Optional[int] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size=(None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_scalars=None,
    return_lse: bool = False,
    scheduler_metadata=None,
    seqlen_k_per_split: Optional[int] = None,
    disable_scheduler_metadata: bool = False,
    *,
    dropout_p: float = 0.0,
    tier: Optional[str] = None,
):
    """FA4's flash_attn_varlen_func. Each side is packed, q (total_q, nheads, head_dim) with cu_seqlens_q (batch + 1,)
    and k/v (total_k, nheads_k, head_dim) with cu_seqlens_k, or batched, (batch, seqlen, ...) with cu_seqlens None;
    seqused_q/seqused_k (batch,) limit each sequence to its first rows. max_seqlen_q/k, a hint, default to the
    longest a sequence can be; an int or an integer tensor of one element (read on the CPU; on a GPU, where reading
    it would wait for the GPU, the longest a sequence can be stands in). Returns (out, lse): out like q; lse fp32
    (nheads, total_q) for a packed q, (batch, nheads, seqlen_q) for a batched one (see _returned_lse). The rest as in
    flash_attention.flash_attn_varlen_func.

    FA4's older order, flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), is
    served too: a positional call in that order puts cu_seqlens_q in qv, where a packed (rank-3) q never has a 1-D
    int32 tensor otherwise, so such a qv is read as cu_seqlens_q and the next three arguments as cu_seqlens_k,
    max_seqlen_q and max_seqlen_k."""
    qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = _current_order(
        q, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _reject_unsupported(qv=qv, gather_kv_indices=gather_kv_indices, learnable_sink=learnable_sink,
                        score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod,
                        block_sparse_tensors=block_sparse_tensors, aux_tensors=aux_tensors, aux_scalars=aux_scalars)
    if page_table is not None:
        k, v, seqused_k, max_seqlen_k = _from_pages(k, v, page_table, cu_seqlens_q, q, cu_seqlens_k, seqused_k)
    window, softcap = _window(window_size, causal), _softcap(softcap)
    if cu_seqlens_q is None and cu_seqlens_k is None and seqused_q is None and seqused_k is None:
        out, lse = _forward(q, k, v, dropout_p, softmax_scale, causal, window, softcap, _NO_ALIBI, deterministic,
                            tier)
    else:
        out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                           (dropout_p, softmax_scale, causal, window, softcap, _NO_ALIBI, deterministic, tier))
    return out, _returned_lse(lse, return_lse, q, k, v)


def _from_pages(k, v, page_table, cu_seqlens_q, q, cu_seqlens_k, seqused_k):
    """FA4's page_table: k, v are pages (num_pages, page_size, nheads_k, head_dim), sequence i's key j at page
    page_table[i, j // page_size], row j % page_size, its length seqused_k[i] (else the table's capacity). Returns the
    batched key side (k, v, seqused_k, max_seqlen_k), the pages gathered into a contiguous copy (_paged.gather_used:
    the used rows only, unless a gradient flows)."""
    if cu_seqlens_k is not None:
        raise ValueError("page_table cannot be used with cu_seqlens_k: sequence lengths come from seqused_k")
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]
    _paged.check_block_table(page_table, batch, k, v)
    # Checked before the gather reads it.
    _checks.check_seqused(seqused_k, "seqused_k", batch, "len(cu_seqlens_q) - 1" if cu_seqlens_q is not None
                          else "q.shape[0]", q.device)
    capacity = page_table.shape[1] * k.shape[1]
    if seqused_k is None:
        seqused_k = torch.full((batch,), capacity, dtype=torch.int32, device=k.device)
    keys, values = _paged.gather_used(k, v, page_table, seqused_k, _ops.needs_grad(q, k, v))
    return keys, values, seqused_k, capacity


def _current_order(q, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """(qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) in the current order. A 1-D int32 qv beside a
    packed q is cu_seqlens_q passed positionally in the old order (q, k, v, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k): each argument then sits one parameter to the right of its name. The old call has
    at most those seven arguments, so max_seqlen_k is then None and cu_seqlens_k holds a max_seqlen (an int or a
    one-element tensor); anything else mixes the two orders and is refused with the way to call."""
    old_order = (isinstance(qv, torch.Tensor) and qv.dim() == 1 and qv.dtype == torch.int32
                 and isinstance(q, torch.Tensor) and q.dim() == 3)
    if not old_order:
        return qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    holds_max_seqlen = not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.numel() == 1
    if max_seqlen_k is not None or not holds_max_seqlen:
        raise TypeError(
            "flash_attention.cute.flash_attn_varlen_func: qv is a 1-D int32 tensor, as cu_seqlens_q is in FA4's old "
            "argument order (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), but the other "
            "arguments fit neither order; pass the sequences by keyword: flash_attn_varlen_func(q, k, v, "
            "cu_seqlens_q=..., cu_seqlens_k=..., max_seqlen_q=..., max_seqlen_k=...)"
        )
    return None, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, options):
    """The varlen op, with a batched side flattened into batch sequences of seqlen rows, and q's results back in
    q's batched shape when it was batched. options: _varlen_forward's arguments after `sequences`."""
    batched_q, batched_k = cu_seqlens_q is None, cu_seqlens_k is None
    q_flat, cu_seqlens_q, max_seqlen_q = _packed(q, cu_seqlens_q, max_seqlen_q, "q", "cu_seqlens_q")
    # k first, so that a k/v layout at fault is reported for k; v's call takes the cu_seqlens_k it was given.
    k_flat, cu_flat_k, max_seqlen_k = _packed(k, cu_seqlens_k, max_seqlen_k, "k", "cu_seqlens_k")
    v_flat, _, _ = _packed(v, cu_seqlens_k, None, "v", "cu_seqlens_k")
    cu_seqlens_k = cu_flat_k
    _check_same_batch(batched_q, batched_k, cu_seqlens_q, cu_seqlens_k)
    sequences = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    out, lse = _varlen_forward(q_flat, k_flat, v_flat, sequences, *options)
    if not batched_q:
        return out, lse
    batch_seqlen = q.shape[:2]
    return out.unflatten(0, batch_seqlen), lse.unflatten(1, batch_seqlen).transpose(0, 1)


def _packed(x, cu_seqlens, max_seqlen, name: str, cu_name: str):
    """(x, cu_seqlens, max_seqlen) for the varlen op. A side without cu_seqlens must be batched, (batch, seqlen, ...):
    it is flattened (a view when the strides allow), with cu_seqlens 0, seqlen, 2 seqlen, ... (computed on the device,
    no sync). A missing max_seqlen becomes the longest a sequence can be."""
    if not isinstance(x, torch.Tensor):
        return x, cu_seqlens, max_seqlen  # check_varlen_inputs names the argument
    if cu_seqlens is not None:
        return x, cu_seqlens, x.shape[0] if max_seqlen is None else max_seqlen
    if x.dim() != 4:
        raise ValueError(
            f"{name} must have rank 4, (batch, seqlen, nheads, head_dim), when {cu_name} is None, "
            f"got shape {tuple(x.shape)}"
        )
    b, seqlen = x.shape[:2]
    cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=x.device) * seqlen
    return x.flatten(0, 1), cu_seqlens, seqlen if max_seqlen is None else max_seqlen


def _check_same_batch(batched_q: bool, batched_k: bool, cu_seqlens_q, cu_seqlens_k) -> None:
    """With a side batched, its cu_seqlens is made here; a batch mismatch is reported in the caller's terms."""
    if not (batched_q or batched_k) or not all(isinstance(cu, torch.Tensor) and cu.dim() == 1
                                                   for cu in (cu_seqlens_q, cu_seqlens_k)):
        return
    bq, bk = len(cu_seqlens_q) - 1, len(cu_seqlens_k) - 1
    if bq != bk:
        source_q = "q.shape[0]" if batched_q else "len(cu_seqlens_q) - 1"
        source_k = "k.shape[0]" if batched_k else "len(cu_seqlens_k) - 1"
        raise ValueError(f"q and k must hold the same number of sequences, got {source_q} = {bq} and "
                         f"{source_k} = {bk}")


def _vector_aligned(t: torch.Tensor) -> bool:
    """Whether the kernels' 16-byte accesses reach every row of t (the binding's vector_aligned)."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(stride * size % 16 == 0 for stride in t.stride()[:-1]))


def _combine_kernel(out_partial, lse_partial, out, out_dtype, return_lse):
    """flash_attn_combine's (out, lse) from the combine kernel, one launch, where it applies: CUDA, fp16/bf16 partials
    combined in their own dtype (into `out` when it is one the kernel's 16-byte stores reach), fp32 lse, a head dim
    that is a multiple of 8, an eager call. None elsewhere (and in a build without the kernel), for the PyTorch ops
    to serve."""
    d = out_partial.shape[-1]
    dtype = out_partial.dtype
    if not (out_partial.is_cuda and dtype in (torch.float16, torch.bfloat16) and out_dtype in (None, dtype)
            and lse_partial.dtype == torch.float32 and d % 8 == 0 and d <= _catalog.MAX_HEAD_DIM
            and (out is None or (type(out) is torch.Tensor and out.dtype == dtype and out.device == out_partial.device
                                 and out.shape == out_partial.shape[1:] and _vector_aligned(out)))
            and _ops._eager(out_partial, lse_partial, lse_partial)):
        return None
    try:
        tier, kernel_dim = _dispatch.resolve(out_partial.device, "combine", d, out_partial.dtype, None)
    except RuntimeError:
        return None
    packed = out_partial.dim() == 4  # (splits, total_q, nheads, head_dim): one batch entry
    partial = out_partial.unsqueeze(1) if packed else out_partial
    lse_in = lse_partial.unsqueeze(1) if packed else lse_partial
    _, b, rows, h, _ = partial.shape
    if out is None:
        combined = partial.new_empty((b, rows, h, d))
    else:
        combined = out.unsqueeze(0) if packed else out
    lse = torch.empty((b, h, rows), dtype=torch.float32, device=partial.device) if return_lse else None
    _dispatch.load_extension().combine(partial, lse_in, combined, lse, kernel_dim, tier)
    if packed:
        combined, lse = combined[0], (lse[0] if return_lse else None)
    return combined, (lse.transpose(-1, -2) if return_lse else None)


def flash_attn_combine(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqused: Optional[torch.Tensor] = None,
    varlen_batch_idx: Optional[torch.Tensor] = None,
    return_lse: bool = True,
):
    """FA4's flash_attn_combine: the attention over the union of key splits from each split's output and lse.
    out_partial (num_splits, batch, seqlen, nheads, head_dim) or, packed, (num_splits, total_q, nheads, head_dim);
    lse_partial its (num_splits, batch, seqlen, nheads) or (num_splits, total_q, nheads), natural log, -inf for a
    split that saw no key. Returns (out, lse): out (batch, seqlen, nheads, head_dim) or (total_q, nheads, head_dim)
    in out_dtype (default out_partial's), written into `out` when given; lse fp32 (batch, seqlen, nheads) or
    (total_q, nheads) (a transposed view of (batch, nheads, seqlen) or (nheads, total_q) storage, as FA4's), None
    without return_lse; rows whose splits all saw no key get out 0 and lse -inf. Computed in fp32: by one kernel
    launch for fp16/bf16 partials on a GPU combined in their own dtype, else with PyTorch ops; cu_seqlens,
    seqused and varlen_batch_idx, which steer FA4's kernel over the rows, change no value here and are accepted as
    they are."""
    if not isinstance(out_partial, torch.Tensor) or out_partial.dim() not in (4, 5):
        raise ValueError("out_partial must be (num_splits, batch, seqlen, nheads, head_dim) or (num_splits, total_q, "
                         f"nheads, head_dim), got {getattr(out_partial, 'shape', type(out_partial).__name__)}")
    if (not isinstance(lse_partial, torch.Tensor) or lse_partial.shape != out_partial.shape[:-1]
            or lse_partial.device != out_partial.device):
        raise ValueError(f"lse_partial must have shape {tuple(out_partial.shape[:-1])} (out_partial's without "
                         f"head_dim) on its device, got {getattr(lse_partial, 'shape', type(lse_partial).__name__)}")
    fused = _combine_kernel(out_partial, lse_partial, out, out_dtype, return_lse)
    if fused is not None:
        return fused
    # As few elementwise passes as the math allows: a decode step's combine is a dozen tiny kernels.
    lse = lse_partial.float()
    top = lse.amax(dim=0).nan_to_num_(nan=float("nan"), neginf=0.0)  # no split saw a key: weights 0, not NaN
    weights = (lse - top).exp_()
    total = weights.sum(dim=0)
    combined = (out_partial * weights.unsqueeze(-1)).sum(dim=0)  # fp32 by type promotion
    combined /= total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)  # 0 / tiny = 0 where no key
    dtype = out_dtype if out_dtype is not None else out_partial.dtype
    if out is not None:
        if out.shape != combined.shape:
            raise ValueError(f"out must have shape {tuple(combined.shape)}, got {tuple(out.shape)}")
        out.copy_(combined)
    else:
        out = combined.to(dtype)
    if not return_lse:
        return out, None
    lse_out = total.log_().add_(top)  # log(0) = -inf where no split saw a key
    return out, lse_out.transpose(-1, -2).contiguous().transpose(-1, -2)
