"""Forward correctness on the GPU against the fp32 reference.

Tolerance: the kernel's max error against the fp32 reference may be at most twice that of the same math done by
PyTorch in the input dtype, plus fp32 rounding. The grid covers every value of every axis and crosses the risky
ones (masks x odd lengths x GQA) instead of taking the full Cartesian product."""

import pytest
import torch

from flash_attention import (_catalog, _dispatch, cute, flash_attn_func, flash_attn_kvpacked_func,
                             flash_attn_qkvpacked_func)
from helpers import (DTYPES, HEADS, LAYOUTS, SMEM_BUDGETS, Case, assert_matches_reference, bf16, build_cases,
                     case_kwargs, fp16, make_inputs, poison_allocator, require_kernel)

pytestmark = pytest.mark.cuda

CASES = build_cases()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward(case):
    require_kernel(case.d, case.dtype)
    q, k, v, alibi = make_inputs(case)
    kwargs = case_kwargs(case, alibi)
    poison_allocator(q, k)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (case.b, q.shape[2], case.sq) and lse.dtype == torch.float32
    assert_matches_reference(out, lse, q, k, v, **kwargs)
    # A second run must agree bit for bit: the forward pass is deterministic, and a race would show here.
    out2, lse2, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("budget", SMEM_BUDGETS, ids=list(SMEM_BUDGETS))
@pytest.mark.parametrize("d", [160, 192, 224, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_small_smem_tiles(monkeypatch, dtype, d, budget):
    """The fallback tiles of large head dims, forced on this GPU by capping the shared-memory budget."""
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm80")  # the tier of the GPUs whose budgets these are
    require_kernel(d, dtype)
    monkeypatch.setenv("FLASH_ATTN_SMEM_BUDGET", str(SMEM_BUDGETS[budget]))
    case = Case(dtype, d, 300, 517, heads="gqa", causal=True, window=(200, -1), alibi="h")
    q, k, v, alibi = make_inputs(case)
    kwargs = case_kwargs(case, alibi)
    poison_allocator(q, k)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert_matches_reference(out, lse, q, k, v, **kwargs)


@pytest.mark.parametrize("sk", [2048, 2112], ids=["short", "long"])
@pytest.mark.parametrize("d", [192, 256], ids=lambda d: f"d{d}")
def test_tile_choice_by_length(d, sk):
    """Large head dims pick a 64-row tile (two CTAs per SM on the H100/H200) when the query tiles see up to 2048 keys,
    and a 128-row tile above: both sides of the switch, with partial key blocks and GQA."""
    require_kernel(d, bf16)
    case = Case(bf16, d, 200, sk, heads="gqa", b=1)
    q, k, v, _ = make_inputs(case)
    poison_allocator(q, k)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert_matches_reference(out, lse, q, k, v)


@pytest.mark.parametrize("mask", [{"causal": True}, {"window": (300, 0)}, {"causal": True, "alibi": "h"}],
                         ids=["causal", "window", "causal-alibi"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256], ids=lambda d: f"d{d}")
def test_masked_tiles_from_counter(d, mask):
    """More causal or local query tiles than SMs (288-432 of them here): the SM90 forward's persistent CTAs take
    them from a tile counter (d 256: one CTA per tile), tiles of different lengths in no fixed order. Checked against
    the reference, and bit for bit across two runs, whose CTAs take different tiles."""
    require_kernel(d, bf16)
    case = Case(bf16, d, 1031, 1537, heads="h16k4", b=3, **mask)
    q, k, v, alibi = make_inputs(case)
    kwargs = case_kwargs(case, alibi)
    poison_allocator(q, k)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert_matches_reference(out, lse, q, k, v, **kwargs)
    out2, lse2, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("d", [64, 59], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_qkvpacked_matches_unpacked(dtype, causal, d):
    require_kernel(d, dtype)
    qkv = torch.randn(2, 300, 3, 4, d, dtype=dtype, device="cuda")
    out, lse, _ = flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True)
    q, k, v = (t.contiguous() for t in qkv.unbind(2))
    ref_out, ref_lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("d", [128, 111], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_kvpacked_matches_unpacked(dtype, heads, d):
    require_kernel(d, dtype)
    h, hk = HEADS[heads]
    q = torch.randn(2, 257, h, d, dtype=dtype, device="cuda")
    kv = torch.randn(2, 300, 2, hk, d, dtype=dtype, device="cuda")
    out = flash_attn_kvpacked_func(q, kv, causal=True, window_size=(50, -1))
    k, v = (t.contiguous() for t in kv.unbind(2))
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True, window_size=(50, -1)))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tensor_window(causal, device):
    """window_size as flash-attn 2's tests draw it, torch.randint(0, seqlen_k, (2,)), on the CPU (read without a
    sync) or the GPU (one sync): the same results as the tuple, for the packed functions and flash_attention.cute
    too."""
    require_kernel(64, bf16)
    torch.manual_seed(0)
    window = torch.randint(0, 300, (2,), device=device)
    pair = tuple(window.tolist())
    qkv = torch.randn(2, 300, 3, 4, 64, dtype=bf16, device="cuda")
    q, k, v = (t.contiguous() for t in qkv.unbind(2))
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    assert torch.equal(out, flash_attn_func(q, k, v, causal=causal, window_size=pair))
    assert_matches_reference(out, lse, q, k, v, causal=causal, window_size=pair)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, causal=causal, window_size=window),
                       flash_attn_qkvpacked_func(qkv, causal=causal, window_size=pair))
    kv = qkv[:, :, 1:]
    assert torch.equal(flash_attn_kvpacked_func(q, kv, causal=causal, window_size=window),
                       flash_attn_kvpacked_func(q, kv, causal=causal, window_size=pair))
    assert torch.equal(cute.flash_attn_func(q, k, v, causal=causal, window_size=window)[0],
                       cute.flash_attn_func(q, k, v, causal=causal, window_size=pair)[0])


def test_return_attn_probs():
    require_kernel(64, bf16)
    q, k, v = (torch.randn(2, 100, 4, 64, dtype=bf16, device="cuda") for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    result = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(out, torch.Tensor) and len(result) == 3 and result[2] is None
    assert torch.equal(result[0], out)
    assert result[1].shape == (2, 4, 100) and result[1].dtype == torch.float32 and result[1].is_contiguous()


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_strided_views_match_contiguous(layout):
    require_kernel(128, fp16)
    case = Case(fp16, 128, 333, 444, heads="gqa", causal=True, layout=layout)
    q, k, v, _ = make_inputs(case)
    out = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))


def _misaligned(*shape):
    """A contiguous tensor whose data starts 2 bytes past a 16-byte boundary."""
    return torch.randn(shape[0] * shape[1] * shape[2] * shape[3] + 1, dtype=bf16, device="cuda")[1:].view(*shape)


# Views the kernels cannot load as they are (the binding copies them): their results must match a contiguous copy's.
BAD_VIEWS = {
    "misaligned-base": lambda: _misaligned(2, 65, 4, 64),
    "row-stride-72": lambda: torch.randn(2, 65, 4, 72, dtype=bf16, device="cuda")[..., :64],
    "size1-dim-stride-3": lambda: torch.randn(1, 65, 4, 64, dtype=bf16, device="cuda").as_strided(
        (1, 65, 4, 64), (3, 256, 64, 1)),
    "broadcast": lambda: torch.randn((), dtype=bf16, device="cuda").expand(2, 65, 4, 64),
    "batch-broadcast": lambda: torch.randn(65, 4, 64, dtype=bf16, device="cuda").expand(2, 65, 4, 64),
    "last-dim-stride-2": lambda: torch.randn(2, 65, 4, 128, dtype=bf16, device="cuda")[..., ::2],
}


@pytest.mark.parametrize("view", BAD_VIEWS)
def test_unloadable_views_are_copied(view):
    require_kernel(64, bf16)
    q = BAD_VIEWS[view]()
    k, v = (torch.randn(q.shape[0], 80, 4, 64, dtype=bf16, device="cuda") for _ in range(2))
    copy = q.clone(memory_format=torch.contiguous_format)
    for causal in (False, True):
        assert torch.equal(flash_attn_func(q, k, v, causal=causal), flash_attn_func(copy, k, v, causal=causal))


@pytest.mark.parametrize("d", [64, 59], ids=lambda d: f"d{d}")
def test_torch_compile_fullgraph(d):
    require_kernel(d, bf16)
    q = torch.randn(2, 200, 6, d, dtype=bf16, device="cuda")
    k, v = (torch.randn(2, 300, 2, d, dtype=bf16, device="cuda") for _ in range(2))
    slopes = torch.rand(6, device="cuda")

    def fn(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
        return out * 2, lse

    torch._dynamo.reset()
    out, lse = torch.compile(fn, fullgraph=True)(q, k, v)
    eager_out, eager_lse = fn(q, k, v)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


def test_tier_override(monkeypatch):
    require_kernel(64, bf16)
    q, k, v = (torch.randn(1, 128, 2, 64, dtype=bf16, device="cuda") for _ in range(3))
    default_tier = _dispatch.resolve_tier(q.device, None, 64, bf16, "fwd")
    default = flash_attn_func(q, k, v)
    assert torch.equal(flash_attn_func(q, k, v, tier=default_tier), default)
    sm80 = flash_attn_func(q, k, v, tier="sm80")
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm80")
    assert torch.equal(flash_attn_func(q, k, v), sm80)
    built = {_catalog.TIER_BY_ID[key[0]].name for key in _dispatch.available_kernels()}
    for tier in _catalog.TIERS:
        if tier not in built:  # not built, or cannot run on this GPU: either way a clear RuntimeError
            monkeypatch.setenv("FLASH_ATTN_TIER", tier)
            with pytest.raises(RuntimeError, match=rf"tier {tier}"):
                flash_attn_func(q, k, v)
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm75")
    with pytest.raises(ValueError, match="unknown tier 'sm75'"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("b, sq, sk", [(2, 0, 50), (2, 50, 0), (0, 50, 50)], ids=["sq0", "sk0", "b0"])
def test_empty_sequences(b, sq, sk):
    q = torch.randn(b, sq, 4, 64, dtype=fp16, device="cuda")
    k, v = (torch.randn(b, sk, 2, 64, dtype=fp16, device="cuda") for _ in range(2))
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and out.device == q.device and not out.any()
    assert lse.shape == (b, 4, sq) and (lse == float("-inf")).all()


def test_long_rows_are_accurate():
    """Large scores (q scaled up) stress the online softmax rescaling across many key blocks."""
    require_kernel(128, bf16)
    q = torch.randn(1, 2048, 2, 128, dtype=bf16, device="cuda") * 4
    k, v = (torch.randn(1, 8192, 1, 128, dtype=bf16, device="cuda") for _ in range(2))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert_matches_reference(out, lse, q, k, v, causal=True)
