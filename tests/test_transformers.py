"""The Hugging Face transformers integration (flash_attention.integrations.transformers).

Without a GPU: the unpad/pad helpers, the position_ids and window mappings, registration, and whole tiny models run
with CPU stand-ins for flash_attn_func / flash_attn_varlen_func (plain PyTorch with the kernels' semantics), compared
with the same weights under transformers' own sdpa (or eager) implementation. With a GPU (`cuda` marker): the same
models on the real kernels, forward and backward.

Accuracy rule: the reference is the model in fp32 with transformers' sdpa attention (eager where sdpa lacks a
feature); the same in bf16 is the baseline. Ours must be within 2x the baseline's error plus a floor of 1% of the
reference's largest magnitude: a bf16 model's error is dominated by the rounding of its weights and activations,
which both bf16 runs share, and ours measured within 1.3x of the baseline's on the CPU stand-ins. A wrong mask,
window or padding shifts the output by far more (a window off by one: 0.38 against a bound of 0.02)."""

import copy

import pytest
import torch

import flash_attention
import flash_attention.integrations.transformers as fa_hf
from flash_attention import _checks, _ops
from helpers import require_kernel
from reference import attention_ref

bf16 = torch.bfloat16
HEAD_DIM = 32  # every model below: hidden size 128 over 4 query heads


# ---------------------------------------------------------------------------------------------------------------------
# Helpers that need neither transformers nor a GPU


def test_unpad_indices_left_and_right_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    indices, cu_seqlens, max_seqlen = fa_hf.unpad_indices(mask)
    assert indices.tolist() == [2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 6, 11, 11]
    assert max_seqlen == 5
    # A bool mask and an int mask are the same mask.
    assert [t.tolist() if torch.is_tensor(t) else t for t in fa_hf.unpad_indices(mask.bool())] == \
        [indices.tolist(), cu_seqlens.tolist(), max_seqlen]


def test_unpad_pad_round_trip():
    torch.manual_seed(0)
    mask = torch.rand(3, 7) > 0.4
    x = torch.randn(3, 7, 4, 8, requires_grad=True)
    indices, cu_seqlens, _ = fa_hf.unpad_indices(mask)
    rows = fa_hf.unpad(x, indices)
    assert rows.shape == (int(mask.sum()), 4, 8)
    assert torch.equal(rows, x[mask])
    back = fa_hf.pad(rows, indices, 3, 7)
    assert torch.equal(back, x * mask[:, :, None, None])
    # The gradient flows to the kept rows only.
    back.sum().backward()
    assert torch.equal(x.grad, mask[:, :, None, None].expand_as(x).float())
    # Sequence i's rows are rows[cu_seqlens[i]:cu_seqlens[i + 1]], in order.
    for i in range(3):
        assert torch.equal(rows[cu_seqlens[i]:cu_seqlens[i + 1]], x[i][mask[i]])


@pytest.mark.parametrize("position_ids, expected", [
    ([[0, 1, 2, 0, 1, 0, 1, 2, 3]], ([0, 3, 5, 9], 4)),
    ([[2, 3, 4, 2, 3]], ([0, 3, 5], 3)),  # RoBERTa-like ids start at padding_idx + 1
    ([[0, 0, 0]], ([0, 1, 2, 3], 1)),
    ([[1, 2, 0, 1]], ([0, 2, 4], 2)),  # the row starts a sequence even if it does not start at the smallest id
    ([[0, 1, 2, 3]], None),
    ([[5, 6, 7, 8]], None),  # one sequence continuing a cache
    ([[0]], None),
    ([[0, 1, 0, 1], [0, 1, 0, 1]], None),  # packing is one row (batch 1)
])
def test_packed_cu_seqlens(position_ids, expected):
    position_ids = torch.tensor(position_ids)
    got = fa_hf.packed_cu_seqlens(position_ids, position_ids.shape[1])
    if expected is None:
        assert got is None
    else:
        cu_seqlens, max_seqlen = got
        assert cu_seqlens.dtype == torch.int32
        assert (cu_seqlens.tolist(), max_seqlen) == expected


def test_packed_cu_seqlens_length_mismatch():
    assert fa_hf.packed_cu_seqlens(torch.tensor([[0, 1, 0, 1]]), 3) is None


@pytest.mark.parametrize("sliding_window, causal, expected", [
    (None, True, (-1, -1)), (None, False, (-1, -1)), (4, True, (3, 0)), (4, False, (3, 3)), (1, True, (0, 0)),
])
def test_window_size(sliding_window, causal, expected):
    assert fa_hf.window_size(sliding_window, causal) == expected


def test_window_size_matches_transformers_sdpa_masks():
    """The window must select exactly the keys transformers' own masks keep: query i sees key j iff
    i - sliding_window < j <= i (causal), |i - j| < sliding_window (bidirectional)."""
    from reference import attention_mask

    n = 9
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for w in (1, 2, 3, 8, 20):
        assert torch.equal(attention_mask(n, n, True, fa_hf.window_size(w, True)), (j <= i) & (j > i - w))
        assert torch.equal(attention_mask(n, n, False, fa_hf.window_size(w, False)), (i - j).abs() < w)


def test_window_size_rejects_zero():
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        fa_hf.window_size(0, True)


def _causal(b, h, q, k):
    return k <= q


def _bidirectional(b, h, q, k):
    return q.new_ones((), dtype=torch.bool)


def test_padding_mask():
    ones = torch.ones(2, 5, dtype=torch.bool)
    no_cache = dict(batch_size=2, q_length=5, q_offset=0, mask_function=_causal)
    assert fa_hf.padding_mask(kv_length=5, attention_mask=None, **no_cache) is None
    assert fa_hf.padding_mask(kv_length=5, attention_mask=ones, **no_cache) is None
    assert fa_hf.padding_mask(kv_length=3, attention_mask=ones, **no_cache) is None  # a sliding cache keeps 3 keys
    padded = ones.clone()
    padded[0, :2] = False
    assert torch.equal(fa_hf.padding_mask(kv_length=5, attention_mask=padded, **no_cache), padded)
    assert torch.equal(fa_hf.padding_mask(kv_length=4, attention_mask=padded, **no_cache), padded[:, 1:])
    assert fa_hf.padding_mask(kv_length=3, attention_mask=padded, **no_cache) is None
    # A static cache has more slots than tokens: the mask is kept (shorter than kv_length) to cut the keys.
    assert torch.equal(fa_hf.padding_mask(kv_length=8, attention_mask=ones, **no_cache), ones)


def test_padding_mask_refuses_chunked_attention():
    class Config:
        attention_chunk_size = 8

    kwargs = dict(batch_size=1, q_length=8, q_offset=0, mask_function=_causal, config=Config())
    assert fa_hf.padding_mask(kv_length=8, **kwargs) is None
    with pytest.raises(NotImplementedError, match="cannot do chunked attention"):
        fa_hf.padding_mask(kv_length=9, **kwargs)


@pytest.mark.parametrize("positions", ["offset", "cache_position"])
def test_padding_mask_without_attention_mask(positions):
    """No attention_mask: None, except for a causal mask over a static cache's unwritten slots."""
    def call(q_offset, q_length, kv_length, kv_offset=0, mask_function=_causal):
        if positions == "offset":
            where = dict(q_offset=torch.tensor(q_offset), q_length=q_length, device="cpu")
        else:
            where = dict(cache_position=torch.arange(q_offset, q_offset + q_length))
        return fa_hf.padding_mask(batch_size=2, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
                                  **where)

    assert call(0, 5, 5) is None  # no cache
    assert call(4, 1, 5) is None  # a dynamic cache holds exactly the tokens seen
    assert call(9, 1, 4, kv_offset=6) is None  # a sliding one keeps the last keys
    assert call(0, 5, 7, mask_function=_bidirectional) is None  # cross-attention: more keys than queries
    assert torch.equal(call(0, 5, 16), torch.ones(2, 5, dtype=torch.bool))  # static cache: prefill
    assert torch.equal(call(5, 1, 16), torch.ones(2, 6, dtype=torch.bool))  # and decode
    assert torch.equal(call(5, 1, 8, kv_offset=2), torch.ones(2, 4, dtype=torch.bool))


class _Module(torch.nn.Module):
    def __init__(self, dtype=bf16, causal=True):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, dtype=dtype)
        self.is_causal = causal


def _qkv(b=2, h=4, hk=2, sq=6, sk=6, d=16, dtype=bf16):
    torch.manual_seed(0)
    return (torch.randn(b, h, sq, d, dtype=dtype), torch.randn(b, hk, sk, d, dtype=dtype),
            torch.randn(b, hk, sk, d, dtype=dtype))


def test_attention_forward_rejects():
    q, k, v = _qkv()
    module = _Module()
    module.train()
    with pytest.raises(NotImplementedError, match="no attention dropout"):
        fa_hf.attention_forward(module, q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match="takes a 2-D padding mask"):
        fa_hf.attention_forward(module, q, k, v, torch.zeros(2, 1, 6, 6))
    for name in ("s_aux", "position_bias"):
        with pytest.raises(NotImplementedError, match=f"does not support {name}"):
            fa_hf.attention_forward(module, q, k, v, None, **{name: torch.zeros(4)})
    with pytest.raises(TypeError, match="runs in fp16 or bf16"):
        fa_hf.attention_forward(_Module(torch.float32), *(t.float() for t in (q, k, v)), None)


# ---------------------------------------------------------------------------------------------------------------------
# CPU stand-ins for the kernels: tests/reference.py's attention, one sequence at a time


def _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, window_size=(-1, -1), softcap=0.0,
                      softmax_scale=None):
    """(out (total_q, h, d) in q's dtype, lse (h, total_q)) of the sequences that cu_seqlens_q/k delimit."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    for i in range(len(cu_seqlens_q) - 1):
        (q0, q1), (k0, k1) = cu_seqlens_q[i:i + 2].tolist(), cu_seqlens_k[i:i + 2].tolist()
        if q1 > q0:
            o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, window_size, softcap,
                                 softmax_scale=softmax_scale)
            out[q0:q1], lse[:, q0:q1] = o[0].to(q.dtype), l[0]
    return out, lse


def _reference_dense(calls):
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, deterministic=False):
        calls.append("dense")
        assert dropout_p == 0.0
        out, _ = attention_ref(q, k, v, causal, window_size, softcap, softmax_scale=softmax_scale)
        return out.to(q.dtype)
    return flash_attn_func


def _reference_varlen(calls):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               deterministic=False):
        calls.append("varlen")
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        assert max_seqlen_q == int(cu_seqlens_q.diff().max()) and max_seqlen_k == int(cu_seqlens_k.diff().max())
        return _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_size, softcap, softmax_scale)[0]
    return flash_attn_varlen_func


@pytest.fixture
def kernel_calls(monkeypatch):
    """Replace flash_attn_func and flash_attn_varlen_func by the CPU stand-ins, which are differentiable; the list
    records which one each attention call used."""
    calls = []
    monkeypatch.setattr(flash_attention, "flash_attn_func", _reference_dense(calls))
    monkeypatch.setattr(flash_attention, "flash_attn_varlen_func", _reference_varlen(calls))
    return calls


@pytest.fixture
def op_calls(monkeypatch):
    """Keep the package's Python path (argument checks, with FLASH_ATTN_CHECK_VARLEN=1 the sequence values too;
    window normalisation; head-dim padding) and replace only the kernels' forward by the stand-ins (no backward);
    the list records the calls, batched (fwd) or varlen (varlen_fwd)."""
    calls = []

    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
        if cu_seqlens_q is None:
            calls.append("fwd")
            out, lse = attention_ref(q, k, v, False, (window_left, window_right), softcap, alibi_slopes, softmax_scale)
            return out.to(q.dtype), lse
        calls.append("varlen_fwd")
        assert seqused_q is None and seqused_k is None and alibi_slopes is None
        return _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, False, (window_left, window_right), softcap,
                                 softmax_scale)

    monkeypatch.setenv("FLASH_ATTN_CHECK_VARLEN", "1")
    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    monkeypatch.setattr(_ops, "forward_impl", forward)
    return calls


def test_attention_forward_fp32_inputs_cast_to_projection_dtype(kernel_calls):
    """fp32 activations from fp32 layer norms in a bf16 model (as PEFT makes) run in bf16, as transformers' flash
    path does."""
    q, k, v = _qkv(dtype=torch.float32)
    out, weights = fa_hf.attention_forward(_Module(bf16), q, k, v, None)
    assert weights is None and out.dtype == bf16 and out.shape == (2, 6, 4, 16)
    ref, _ = attention_ref(*(t.to(bf16).transpose(1, 2) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


def test_attention_forward_fp32_inputs_under_autocast(kernel_calls):
    q, k, v = _qkv(dtype=torch.float32)
    with torch.autocast("cpu", dtype=bf16):
        out, _ = fa_hf.attention_forward(_Module(torch.float32), q, k, v, None)
    assert out.dtype == bf16


def test_attention_forward_dropout_ignored_in_eval(kernel_calls):
    q, k, v = _qkv()
    module = _Module().eval()
    out, _ = fa_hf.attention_forward(module, q, k, v, None, dropout=0.1)
    torch.testing.assert_close(out, fa_hf.attention_forward(module, q, k, v, None)[0], atol=0, rtol=0)


def test_attention_forward_narrow_v(kernel_calls):
    """v with a smaller head dim than q and k (MLA) is zero-padded for the kernel and the output cut back."""
    q, k, _ = _qkv(d=24)
    v = torch.randn(2, 2, 6, 16, dtype=bf16)
    out, _ = fa_hf.attention_forward(_Module(), q, k, v, None, scaling=0.3)
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), torch.nn.functional.pad(v, (0, 8)).transpose(1, 2),
                           causal=True, softmax_scale=0.3)
    assert out.shape == (2, 6, 4, 16)
    torch.testing.assert_close(out.float(), ref[..., :16], atol=2e-2, rtol=0)


def test_attention_forward_cu_seq_lens_kwargs(kernel_calls):
    """cu_seq_lens_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) delimit the sequences of a row."""
    q, k, v = _qkv(b=1, sq=9, sk=9)
    cu = torch.tensor([0, 4, 9], dtype=torch.int64)
    out, _ = fa_hf.attention_forward(_Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert kernel_calls == ["varlen"]
    for s0, s1 in ((0, 4), (4, 9)):
        ref, _ = attention_ref(*(t[:, :, s0:s1].transpose(1, 2) for t in (q, k, v)), causal=True)
        torch.testing.assert_close(out[:, s0:s1].float(), ref, atol=2e-2, rtol=0)


def test_attention_forward_cross_attention_with_padding(kernel_calls):
    """Bidirectional, more keys than queries, the mask the keys' (an encoder's): every query sees its row's keys."""
    q, k, v = _qkv(sq=3, sk=6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out, _ = fa_hf.attention_forward(_Module(causal=False), q, k, v, mask)
    for i, n in enumerate((4, 6)):
        ref, _ = attention_ref(q[i:i + 1].transpose(1, 2), *(t[i:i + 1, :, :n].transpose(1, 2) for t in (k, v)))
        torch.testing.assert_close(out[i:i + 1].float(), ref, atol=2e-2, rtol=0)


def test_attention_forward_chunk_after_cache_with_padding(kernel_calls):
    """With a KV cache the queries are the newest tokens, the mask's last columns: 3 queries after 3 cached keys."""
    q, k, v = _qkv(sq=3, sk=6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out, _ = fa_hf.attention_forward(_Module(), q, k, v, mask)
    for i, start in enumerate((2, 0)):
        ref, _ = attention_ref(q[i:i + 1].transpose(1, 2), *(t[i:i + 1, :, start:].transpose(1, 2) for t in (k, v)),
                               causal=True)
        torch.testing.assert_close(out[i:i + 1].float(), ref, atol=2e-2, rtol=0)


def test_attention_forward_decode_with_padding(kernel_calls):
    """One decoding step, left padding: the query sees its row's keys."""
    q, k, v = _qkv(sq=1, sk=6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out, _ = fa_hf.attention_forward(_Module(), q, k, v, mask)
    for i, start in enumerate((2, 0)):
        ref, _ = attention_ref(q[i:i + 1].transpose(1, 2), *(t[i:i + 1, :, start:].transpose(1, 2) for t in (k, v)),
                               causal=True)
        torch.testing.assert_close(out[i:i + 1].float(), ref, atol=2e-2, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Whole models, built from tiny configs (no downloads)

VOCAB = 128


def _transformers():
    transformers = pytest.importorskip("transformers")
    try:
        fa_hf.register()
    except ImportError as e:
        pytest.skip(str(e))
    return transformers


def _config(name, **overrides):
    """A tiny randomly initialised config: 2 layers, 4 query heads sharing 2 key/value heads (GQA)."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    kwargs.update(overrides)
    return getattr(_transformers(), name)(**{k: v for k, v in kwargs.items() if v is not None})


def _llama():
    return _config("LlamaConfig")


def _mistral_window4():
    """Mistral with a 4-token window (active over the 16-token batches)."""
    return _config("MistralConfig", sliding_window=4)


def _gemma2_softcap():
    """Gemma 2: attention logit softcapping, a query scale other than head_dim ** -0.5, alternating sliding layers."""
    return _config("Gemma2Config", head_dim=HEAD_DIM, attn_logit_softcapping=5.0, sliding_window=6,
                   query_pre_attn_scalar=24)


def _bert(**overrides):
    """A bidirectional encoder (BERT has no key/value head sharing: None drops the setting)."""
    return _config("BertConfig", num_key_value_heads=None, attention_probs_dropout_prob=0.0, **overrides)


def _models(auto_name, config, device, impl="sdpa"):
    """The reference (fp32) and the baseline (bf16) under transformers' implementation `impl`, and ours (bf16), all
    with the same weights."""
    auto = getattr(_transformers(), auto_name)
    torch.manual_seed(0)
    ref = auto.from_config(copy.deepcopy(config), attn_implementation=impl).to(device=device, dtype=torch.float32)
    ref.eval()
    if not type(ref)._supports_attention_backend:  # e.g. BERT before transformers 5
        pytest.skip(f"{type(ref).__name__} does not take registered attention functions in this transformers")
    models = {}
    for name in (impl, fa_hf.NAME):
        m = auto.from_config(copy.deepcopy(config), attn_implementation=name).to(device=device, dtype=bf16)
        m.load_state_dict(ref.state_dict())
        m.eval()
        models[name] = m
    return ref, models


def _outputs(model, **inputs):
    out = model(**inputs)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()


def _check(ours, base, ref, where=None, what="output"):
    """ours within 2x the bf16 baseline's error (vs the fp32 reference) plus 1% of the reference's magnitude."""
    if where is not None:
        ours, base, ref = ours[where], base[where], ref[where]
    err, base_err = (ours - ref).abs().max().item(), (base - ref).abs().max().item()
    bound = 2 * base_err + 1e-2 * ref.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.4g} > {bound:.4g} (the baseline's: {base_err:.4g})"


def _padded_batch(lengths, seqlen, side, device):
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (len(lengths), seqlen), device=device)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long, device=device)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, seqlen - n:] = 1
        else:
            mask[i, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def run_padded(device, side, config, auto="AutoModelForCausalLM", impl="sdpa"):
    ref, models = _models(auto, config, device, impl)
    ids, mask = _padded_batch([13, 7, 16, 1], 16, side, device)
    outs = {name: _outputs(m, input_ids=ids, attention_mask=mask) for name, m in models.items()}
    _check(outs[fa_hf.NAME], outs[impl], _outputs(ref, input_ids=ids, attention_mask=mask), mask.bool(),
           f"{side}-padded")
    return models


def run_cross_attention(device):
    """A BERT decoder with cross-attention to a right-padded encoder output of 16 tokens, from 9 decoder tokens: the
    cross-attention mask is the encoder's and must not be read as the decoder queries' padding."""
    ref, models = _models("AutoModelForCausalLM", _bert(is_decoder=True, add_cross_attention=True), device)
    _, encoder_mask = _padded_batch([13, 7, 16, 1], 16, "right", device)
    torch.manual_seed(3)
    encoder_states = torch.randn(4, 16, 128, device=device)
    ids = torch.randint(1, VOCAB, (4, 9), device=device)

    def logits(m):
        dtype = next(m.parameters()).dtype
        return _outputs(m, input_ids=ids, encoder_hidden_states=encoder_states.to(dtype),
                        encoder_attention_mask=encoder_mask)

    _check(logits(models[fa_hf.NAME]), logits(models["sdpa"]), logits(ref), what="decoder logits")


def run_unpadded(device, config):
    ref, models = _models("AutoModelForCausalLM", config, device)
    ids = torch.randint(1, VOCAB, (2, 24), device=device)
    outs = {name: _outputs(m, input_ids=ids) for name, m in models.items()}
    _check(outs[fa_hf.NAME], outs["sdpa"], _outputs(ref, input_ids=ids))


def run_packed(device, config, packing):
    """Three sequences packed into one row by DataCollatorWithFlattening give each sequence's own logits. packing:
    "position_ids" (restarting at each sequence) or "cu_seq_lens" (return_flash_attn_kwargs=True, no position_ids:
    the positions run on across the row, which rotary embeddings do not see)."""
    ref, models = _models("AutoModelForCausalLM", config, device)
    torch.manual_seed(2)
    lengths = [5, 11, 8]
    seqs = [torch.randint(1, VOCAB, (1, n), device=device) for n in lengths]
    collator = _transformers().DataCollatorWithFlattening(
        **(dict(return_flash_attn_kwargs=True, return_position_ids=False) if packing == "cu_seq_lens" else {}))
    batch = collator([{"input_ids": s[0].tolist()} for s in seqs], return_tensors="pt")
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items() if k != "labels"}
    assert ("position_ids" in inputs) == (packing == "position_ids")
    packed = _outputs(models[fa_hf.NAME], **inputs)
    start = 0
    for s, n in zip(seqs, lengths):
        _check(packed[:, start:start + n], _outputs(models["sdpa"], input_ids=s), _outputs(ref, input_ids=s),
               what=f"packed sequence of {n}")
        start += n


def run_backward(device, config, side):
    """Gradients of every parameter of a batch's loss (labels -100 at padding); side "none" has no padding."""
    ref, models = _models("AutoModelForCausalLM", config, device)
    ids, mask = _padded_batch([16] * 4 if side == "none" else [13, 7, 16, 3], 16, side, device)
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for name, m in (("ref", ref), *models.items()):
        m.zero_grad()
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads[name] = {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}
    assert grads[fa_hf.NAME].keys() == grads["ref"].keys()
    for n, g_ref in grads["ref"].items():
        _check(grads[fa_hf.NAME][n], grads["sdpa"][n], g_ref, what=f"grad of {n}")


def run_generate(device, config, cache, impl="sdpa", steps=5):
    """generate() with a KV cache ("dynamic" or "static") on a left-padded batch and on one without padding (where
    generate() drops the mask), the new tokens forced to the same ones for every model: each step's logits. Not
    compiled (generate() compiles the decoding step of a static cache on a GPU): this checks the numbers."""
    ref, models = _models("AutoModelForCausalLM", config, device, impl)
    for lengths in ([9, 4, 12], [12, 12, 12]):
        ids, mask = _padded_batch(lengths, 12, "left", device)
        forced = torch.randint(1, VOCAB, (len(lengths), steps)).tolist()
        logits = {}
        for name, m in (("ref", ref), *models.items()):
            out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, cache_implementation=cache, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, disable_compile=True,
                             prefix_allowed_tokens_fn=lambda i, prefix: [forced[i][len(prefix) - 12]])
            assert out.sequences[:, 12:].tolist() == forced
            logits[name] = torch.stack(out.logits).float()
        _check(logits[fa_hf.NAME], logits[impl], logits["ref"], what=f"{cache} cache, prompt lengths {lengths}")


# ---------------------------------------------------------------------------------------------------------------------
# CPU: whole models with the stand-ins (checks the unpadding, masks and options that reach the kernels)


def test_register():
    transformers = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    assert fa_hf.register() == fa_hf.NAME
    assert transformers.AttentionInterface()[fa_hf.NAME] is fa_hf.attention_forward
    assert AttentionMaskInterface()[fa_hf.NAME] is fa_hf.padding_mask
    with pytest.raises(ValueError, match="contains 'flash'"):
        fa_hf.register("flash_attention_cute")


def test_register_rejects_old_transformers(monkeypatch):
    transformers = _transformers()
    monkeypatch.setattr(transformers, "__version__", "4.52.4")
    with pytest.raises(ImportError, match=r"needs transformers >= 4\.53\.0, found 4\.52\.4"):
        fa_hf.register()


@pytest.mark.parametrize("side", ["left", "right"])
def test_cpu_padded(kernel_calls, side):
    run_padded("cpu", side, _llama())
    assert set(kernel_calls) == {"varlen"}


def test_cpu_unpadded(kernel_calls):
    run_unpadded("cpu", _llama())
    assert set(kernel_calls) == {"dense"}


@pytest.mark.parametrize("packing", ["position_ids", "cu_seq_lens"])
def test_cpu_packed(kernel_calls, packing):
    run_packed("cpu", _llama(), packing)
    assert "varlen" in kernel_calls


@pytest.mark.parametrize("side", ["left", "none"])
def test_cpu_backward(kernel_calls, side):
    run_backward("cpu", _llama(), side)
    assert set(kernel_calls) == {"dense" if side == "none" else "varlen"}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cpu_generate(kernel_calls, cache):
    run_generate("cpu", _llama(), cache)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cpu_generate_sliding_window(kernel_calls, cache):
    run_generate("cpu", _mistral_window4(), cache)


@pytest.mark.parametrize("side", ["left", "right"])
def test_cpu_sliding_window(kernel_calls, side):
    run_padded("cpu", side, _mistral_window4())


def test_cpu_softcap(kernel_calls):
    run_padded("cpu", "left", _gemma2_softcap(), impl="eager")  # sdpa has no softcap


def test_cpu_encoder(kernel_calls):
    run_padded("cpu", "right", _bert(), auto="AutoModel")


def test_cpu_cross_attention(kernel_calls):
    run_cross_attention("cpu")


@pytest.mark.parametrize("run", ["padded", "unpadded", "packed", "cross_attention", "generate_static"])
def test_cpu_through_the_package(op_calls, run):
    """The forward of whole models through flash_attn_func / flash_attn_varlen_func themselves, with only their
    ops replaced: what the integration hands over passes the package's checks and gives the same numbers."""
    with torch.no_grad():
        {"padded": lambda: run_padded("cpu", "left", _mistral_window4()),
         "unpadded": lambda: run_unpadded("cpu", _llama()),
         "packed": lambda: run_packed("cpu", _llama(), "position_ids"),
         "cross_attention": lambda: run_cross_attention("cpu"),
         "generate_static": lambda: run_generate("cpu", _llama(), "static")}[run]()
    assert "varlen_fwd" in op_calls or run == "unpadded"


def test_cpu_fp32_model_refused(kernel_calls):
    model = _transformers().AutoModelForCausalLM.from_config(_llama(), attn_implementation=fa_hf.NAME)
    with pytest.raises(TypeError, match="runs in fp16 or bf16"):
        model(input_ids=torch.randint(1, VOCAB, (1, 8)))


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the same models on the kernels


@pytest.fixture
def gpu():
    """Skip where the build lacks the bf16 kernels for the models' head dim (FLASH_ATTN_HEAD_DIMS)."""
    require_kernel(HEAD_DIM, bf16, "fwd")
    require_kernel(HEAD_DIM, bf16, "bwd")


@pytest.mark.cuda
@pytest.mark.parametrize("side", ["left", "right"])
def test_gpu_padded(gpu, side):
    run_padded("cuda", side, _llama())


@pytest.mark.cuda
def test_gpu_unpadded(gpu):
    run_unpadded("cuda", _llama())


@pytest.mark.cuda
@pytest.mark.parametrize("packing", ["position_ids", "cu_seq_lens"])
def test_gpu_packed(gpu, packing):
    run_packed("cuda", _llama(), packing)


@pytest.mark.cuda
@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_gpu_backward(gpu, side):
    run_backward("cuda", _llama(), side)


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpu_generate(gpu, cache):
    run_generate("cuda", _llama(), cache)


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpu_generate_sliding_window(gpu, cache):
    run_generate("cuda", _mistral_window4(), cache)


@pytest.mark.cuda
@pytest.mark.parametrize("side", ["left", "right"])
def test_gpu_sliding_window(gpu, side):
    run_padded("cuda", side, _mistral_window4())


@pytest.mark.cuda
def test_gpu_softcap(gpu):
    run_padded("cuda", "left", _gemma2_softcap(), impl="eager")


@pytest.mark.cuda
def test_gpu_cross_attention(gpu):
    run_cross_attention("cuda")


@pytest.mark.cuda
def test_gpu_encoder(gpu):
    run_padded("cuda", "right", _bert(), auto="AutoModel")
