"""Paged key/value caches gathered, each sequence's pages in order, into a contiguous copy: for the calls whose kernels
do not read pages in place (flash_attn_varlen_func's block_table, FA4's page_table, flash_attn_with_kvcache's composed
path)."""

import torch


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(batch, max_blocks * page_size, nheads_k, head_dim): sequence i's rows j from page block_table[i, j //
    page_size], row j % page_size of cache (num_blocks, page_size, nheads_k, head_dim). Page ids out of range are
    clamped to the pool (the result is then unspecified, but no access leaves it)."""
    return cache[block_table.long().clamp(0, cache.shape[0] - 1)].flatten(1, 2)


def gather_used(k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor, used: torch.Tensor,
                differentiable: bool):
    """(k, v) as gather_pages gives them, where only sequence i's first used[i] rows (int32 (batch,); the kernel
    clamps them to [0, the table's rows]) are read: by the gather kernel, which copies those rows alone (3.3-3.9 TB/s
    against PyTorch's 2.0-2.9 for whole tables, H200, RESULTS.md session 72) and leaves the rest unspecified, where it
    takes the pools and the call is not `differentiable` (no gradient may flow through rows the kernels read past a
    length); else PyTorch's indexing of the whole table, through which gradients flow to the pools."""
    from . import _ops
    if not differentiable and _ops.gather_kernel_usable(k, v):
        return _ops.gather_pages(k, v, block_table, used)
    return gather_pages(k, block_table), gather_pages(v, block_table)


def describe(t) -> str:
    """A value as an error message shows it: a tensor's dtype, shape and device, else its type."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"


def check_block_table(block_table, batch: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2
            or block_table.shape[0] != batch or block_table.device != k.device):
        raise ValueError(f"block_table must be an int32 tensor of shape ({batch}, max_blocks) on the cache's device, "
                         f"got {describe(block_table)}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"with block_table, {name} must be a paged cache (num_blocks, page_size, nheads_k, "
                             f"head_dim), got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"with block_table, k and v must have the same pages, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")


def packed_from_pages(k, v, block_table, cu_seqlens_k, seqused_k, differentiable):
    """flash-attn 2's varlen block_table call as a packed one: (k, v, cu_seqlens_k, seqused_k, max_seqlen_k) with each
    sequence's pages gathered (gather_used) into a slot of max_blocks * page_size rows and its length, cu_seqlens_k's
    difference (and at most seqused_k), as seqused_k. Reads no tensor value on the host."""
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1:
        raise ValueError("cu_seqlens_k must be an int32 tensor of shape (batch + 1,) with block_table")
    batch = cu_seqlens_k.shape[0] - 1
    check_block_table(block_table, batch, k, v)
    slot = block_table.shape[1] * k.shape[1]
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).clamp(0, slot)
    if seqused_k is not None:
        lengths = torch.minimum(lengths, seqused_k)
    lengths = lengths.to(torch.int32)
    keys, values = gather_used(k, v, block_table, lengths, differentiable)
    starts = (torch.arange(batch + 1, device=cu_seqlens_k.device) * slot).to(torch.int32)
    return keys.flatten(0, 1), values.flatten(0, 1), starts, lengths, slot
