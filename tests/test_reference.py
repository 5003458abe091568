"""The reference itself (reference.py), the yardstick of every other test: its masks, its agreement with PyTorch's
scaled_dot_product_attention and with hand-computed values, ALiBi slopes of either shape, rows that see no key
(output 0, lse -inf, finite gradients), and its low-precision mode against fp32."""

import math

import pytest
import torch
import torch.nn.functional as F

from cpu_helpers import leaves, make_qkv
from helpers import bf16
from reference import attention_mask, attention_ref


def test_attention_mask_patterns():
    def mask(rows):
        return torch.tensor(rows, dtype=torch.bool)

    assert torch.equal(attention_mask(2, 4, causal=True), mask([[1, 1, 1, 0], [1, 1, 1, 1]]))
    assert torch.equal(attention_mask(4, 2, causal=True), mask([[0, 0], [0, 0], [1, 0], [1, 1]]))
    assert torch.equal(attention_mask(3, 3, window_size=(0, 0)), torch.eye(3, dtype=torch.bool))
    assert torch.equal(attention_mask(4, 4, window_size=(1, 0)),
                       mask([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]))
    assert torch.equal(attention_mask(3, 5, window_size=(-1, 1)),
                       mask([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    assert torch.equal(attention_mask(2, 5, window_size=(1, -1)), mask([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]))
    # causal overrides the right bound only
    assert torch.equal(attention_mask(3, 3, causal=True, window_size=(1, 5)), attention_mask(3, 3, window_size=(1, 0)))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(7, 7), (5, 9), (9, 5)], ids=lambda x: str(x))
@pytest.mark.parametrize("h, hk", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_reference_matches_sdpa(causal, sq, sk, h, hk):
    q, k, v = (torch.randn(2, s, n, 24) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    # SDPA's is_causal is aligned top-left; build the bottom-right mask independently with tril.
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=hk != h
    ).transpose(1, 2)
    out, _ = attention_ref(q, k, v, causal=causal)
    if causal and sq > sk:  # rows that see no key: SDPA gives NaN, the package gives 0
        visible = mask.any(dim=1)
        assert not out[:, ~visible].any()
        out, expected = out[:, visible], expected[:, visible]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_hand_computed():
    # One query, two keys: scores 1 and 0 at scale 1.
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 2, 1, 2)
    e = math.e
    out, lse = attention_ref(q, k, v, softmax_scale=1.0)
    p0, p1 = e / (e + 1), 1 / (e + 1)
    torch.testing.assert_close(out.flatten(), torch.tensor([p0 * 1 + p1 * 3, p0 * 2 + p1 * 4]))
    torch.testing.assert_close(lse.flatten(), torch.tensor([math.log(e + 1)]))

    # softcap 0.5: scores become 0.5 * tanh(2) and 0.
    s0 = 0.5 * math.tanh(2.0)
    out, lse = attention_ref(q, k, v, softmax_scale=1.0, softcap=0.5)
    torch.testing.assert_close(lse.flatten(), torch.tensor([math.log(math.exp(s0) + 1)]))

    # ALiBi slope 0.5, sq=1, sk=2: the query sits at key 1, so key 0 is 1 away: scores 1 - 0.5 and 0.
    out, lse = attention_ref(q, k, v, softmax_scale=1.0, alibi_slopes=torch.tensor([0.5]))
    torch.testing.assert_close(lse.flatten(), torch.tensor([math.log(math.exp(0.5) + 1)]))

    # causal with sq=1 sees every key; window (0, 0) sees only key 1.
    out, lse = attention_ref(q, k, v, softmax_scale=1.0, window_size=(0, 0))
    torch.testing.assert_close(out.flatten(), torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(lse.flatten(), torch.tensor([0.0]))


def test_reference_alibi_shapes_agree():
    q, k, v = (torch.randn(2, 6, 4, 8) for _ in range(3))
    slopes = torch.rand(4)
    out_h, lse_h = attention_ref(q, k, v, alibi_slopes=slopes)
    out_bh, lse_bh = attention_ref(q, k, v, alibi_slopes=slopes.expand(2, 4))
    assert torch.equal(out_h, out_bh) and torch.equal(lse_h, lse_bh)


@pytest.mark.parametrize("upcast", [True, False], ids=["fp32", "bf16"])
def test_reference_fully_masked_rows(upcast):
    q, k, v = make_qkv(b=1, sq=4, sk=2, h=2, hk=2, d=8, dtype=bf16)
    out, lse = attention_ref(q, k, v, causal=True, upcast=upcast)
    assert out.dtype == (torch.float32 if upcast else bf16) and lse.dtype == torch.float32
    assert not out[:, :2].any() and (lse[:, :, :2] == float("-inf")).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 2:]).all()


@pytest.mark.parametrize("upcast", [True, False], ids=["fp32", "bf16"])
def test_reference_grads_of_fully_masked_rows(upcast):
    """The GPU tests measure gradients against the reference's: a row that sees no key must give finite gradients,
    and dq 0, in either precision, though softmax of its all -inf scores is NaN before it is masked."""
    q, k, v = leaves(*(t.float() if upcast else t for t in make_qkv(b=1, sq=4, sk=2, h=2, hk=1, d=8, dtype=bf16)))
    out, lse = attention_ref(q, k, v, causal=True, softcap=2.0, alibi_slopes=torch.rand(2), upcast=upcast)
    dlse = torch.randn_like(lse).masked_fill(lse == float("-inf"), 0.0)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), dlse))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert not dq[:, :2].any() and dk.any() and dv.any()


def test_reference_low_precision_is_close():
    q, k, v = make_qkv(sq=33, sk=47, d=32, dtype=bf16)
    slopes = torch.rand(4)
    out16, lse16 = attention_ref(q, k, v, causal=True, softcap=5.0, alibi_slopes=slopes, upcast=False)
    out32, lse32 = attention_ref(q, k, v, causal=True, softcap=5.0, alibi_slopes=slopes)
    assert out16.dtype == bf16
    torch.testing.assert_close(out16.float(), out32, atol=3e-2, rtol=0)
    torch.testing.assert_close(lse16, lse32, atol=3e-2, rtol=0)
