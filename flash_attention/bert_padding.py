"""flash-attn 2's padding helpers (flash_attn.bert_padding), with its names, arguments and results: they move the
tokens of a padded batch (batch, seqlen, ...) to the packed layout of the varlen functions (total, ...) and back.
Hugging Face transformers and many trainers import them. All are differentiable."""

import torch
import torch.nn.functional as F


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input[indices] for a 1-D integer indices: the rows of input (first, ...) that indices name, in its order."""
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros (first_axis_dim, ...) with the rows named by indices set to values (len(indices), ...)."""
    zeros = values.new_zeros(first_axis_dim, *values.shape[1:])
    return zeros.index_copy(0, indices, values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """The tokens of hidden_states (batch, seqlen, ...) that attention_mask (batch, seqlen; bool or 0/1) keeps, or
    that unused_mask (the same, for tokens allocated to a sequence but not used) marks, packed in order.

    Returns (hidden_states (total, ...), indices (total,) of those tokens in the flattened batch * seqlen,
    cu_seqlens int32 (batch + 1,), max_seqlen_in_batch (a Python int: reading it waits for the GPU), seqused int32
    (batch,), each sequence's tokens in attention_mask alone), as flash-attn 2.6 and later return them."""
    kept = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    indices = kept.flatten().nonzero(as_tuple=True)[0]
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    tokens = index_first_axis(hidden_states.flatten(0, 1), indices)
    return tokens, indices, cu_seqlens, int(seqlens.max()), attention_mask.sum(dim=-1, dtype=torch.int32)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """unpad_input undone: hidden_states (total, ...) put back at indices of a zero (batch, seqlen, ...) tensor."""
    return index_put_first_axis(hidden_states, indices, batch * seqlen).unflatten(0, (batch, seqlen))
