"""flash_attention.bert_padding against a reference written with loops over the batch."""

import pytest
import torch

from flash_attention import bert_padding

# Row 0: padded on the right; row 1: on the left; row 2: no padding; row 3: empty.
MASK = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
# Tokens allocated to a sequence but not used (row 0's fourth, row 3's first two).
UNUSED = torch.tensor([[0, 0, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)


def unpad_ref(x, mask, unused=None):
    """The kept rows of each sequence in order, with the lengths and offsets, token by token."""
    kept = mask if unused is None else mask | unused
    rows, indices, lengths = [], [], []
    for b in range(x.shape[0]):
        positions = [s for s in range(x.shape[1]) if kept[b, s]]
        rows += [x[b, s] for s in positions]
        indices += [b * x.shape[1] + s for s in positions]
        lengths.append(len(positions))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    used = [int(mask[b].sum()) for b in range(x.shape[0])]
    return torch.stack(rows), torch.tensor(indices), torch.tensor(cu, dtype=torch.int32), max(lengths), used


@pytest.mark.parametrize("with_unused", [False, True], ids=["mask", "mask+unused"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("shape", [(4, 5, 3), (4, 5, 2, 8)], ids=["3d", "4d"])
def test_unpad_input_matches_reference(with_unused, mask_dtype, shape):
    x = torch.randn(*shape)
    unused = UNUSED.to(mask_dtype) if with_unused else None
    tokens, indices, cu_seqlens, max_seqlen, seqused = bert_padding.unpad_input(x, MASK.to(mask_dtype), unused)
    ref_tokens, ref_indices, ref_cu, ref_max, ref_used = unpad_ref(x, MASK, UNUSED if with_unused else None)
    assert torch.equal(tokens, ref_tokens) and torch.equal(indices, ref_indices)
    assert cu_seqlens.dtype == seqused.dtype == torch.int32 and torch.equal(cu_seqlens, ref_cu)
    assert type(max_seqlen) is int and max_seqlen == ref_max
    assert seqused.tolist() == ref_used


def test_pad_input_inverts_unpad_input():
    x = torch.randn(4, 5, 2, 8)
    tokens, indices, _, _, _ = bert_padding.unpad_input(x, MASK)
    padded = bert_padding.pad_input(tokens, indices, 4, 5)
    assert padded.shape == x.shape
    assert torch.equal(padded, torch.where(MASK[..., None, None], x, torch.zeros(())))


def test_index_first_axis_and_put_reference():
    x = torch.randn(7, 3, 2)
    indices = torch.tensor([5, 0, 3])
    picked = bert_padding.index_first_axis(x, indices)
    assert torch.equal(picked, torch.stack([x[5], x[0], x[3]]))
    put = bert_padding.index_put_first_axis(picked, indices, 7)
    assert torch.equal(put[[5, 0, 3]], picked) and not put[[1, 2, 4, 6]].any()


def test_gradients():
    """unpad then pad: the gradient reaches exactly the kept tokens, as with flash-attn's autograd functions."""
    x = torch.randn(4, 5, 3, requires_grad=True)
    tokens, indices, _, _, _ = bert_padding.unpad_input(x, MASK)
    grad_out = torch.randn(4, 5, 3)
    (bert_padding.pad_input(tokens * 2, indices, 4, 5) * grad_out).sum().backward()
    assert torch.equal(x.grad, torch.where(MASK[..., None], 2 * grad_out, torch.zeros(())))
