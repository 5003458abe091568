"""Forward correctness on the GPU against the fp32 reference.

Tolerance: the kernel's max error against the fp32 reference may be at most twice that of the same math done by
PyTorch in the input dtype, plus fp32 rounding. The grid covers every value of every axis and crosses the risky
ones (masks x odd lengths x GQA) instead of taking the full Cartesian product."""

import itertools
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch

from flash_attention import _ops, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from reference import attention_ref

pytestmark = pytest.mark.cuda

fp16, bf16 = torch.float16, torch.bfloat16
DTYPES = (fp16, bf16)
HEAD_DIMS = (32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256)
SEQLENS = ((1, 1), (1, 239), (113, 203), (128, 217), (256, 512), (512, 256), (1023, 1024), (1024, 1023), (3, 799),
           (799, 3), (4097, 4097))
ODD_SEQLENS = ((1, 239), (113, 203), (3, 799), (799, 3), (1023, 1024), (1024, 1023))
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
# (name, causal, window_size)
MASKS = (
    ("causal", True, (-1, -1)),
    ("local16", False, (16, 16)),
    ("diag", False, (0, 0)),
    ("left100", False, (100, -1)),
    ("right37", False, (-1, 37)),
    ("causal-left64", True, (64, -1)),
)
LAYOUTS = ("contiguous", "transposed", "sliced", "misaligned")


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    d: int
    sq: int
    sk: int
    heads: str = "mha"
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # None, "h" for (nheads,) slopes, "bh" for (batch, nheads)
    layout: str = "contiguous"
    b: int = 2

    @property
    def id(self):
        dtype = "bf16" if self.dtype == bf16 else "fp16"
        parts = [dtype, f"d{self.d}", f"{self.sq}x{self.sk}", self.heads, f"b{self.b}"]
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi:
            parts.append(f"alibi_{self.alibi}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        return "-".join(parts)


def build_cases():
    uses = {}

    def pick(values):
        """Cycle through the values of an axis that a group of cases does not sweep."""
        n = uses[values] = uses.get(values, -1) + 1
        return values[n % len(values)]

    cases = []
    # Every head dim in both dtypes, with and without the causal mask, at odd lengths.
    for dtype, d, causal in itertools.product(DTYPES, HEAD_DIMS, (False, True)):
        cases.append(Case(dtype, d, 113, 203, heads="gqa" if causal else "mha", causal=causal))
    # Every length pair, with and without the causal mask; small batch x heads for the big ones.
    for (sq, sk), causal in itertools.product(SEQLENS, (False, True)):
        big = sq * sk > 2**20
        cases.append(Case(pick(DTYPES), pick(HEAD_DIMS), sq, sk, heads=pick(("mha", "gqa", "mqa")), causal=causal,
                          b=1 if big else 2))
    for d, causal, dtype in itertools.product((64, 128, 256), (False, True), DTYPES):
        if (d, causal, dtype) != (64, False, fp16):  # thinned: the big case is the slowest to check
            cases.append(Case(dtype, d, 4097, 4097, heads="mqa", causal=causal, b=1))
    # Risky combinations: every mask x odd lengths x MHA/GQA/MQA.
    for (_, causal, window), (sq, sk), heads in itertools.product(MASKS, ODD_SEQLENS, HEADS):
        cases.append(Case(pick(DTYPES), pick(HEAD_DIMS), sq, sk, heads=heads, causal=causal, window=window))
    # Softcap.
    for softcap, causal, (sq, sk), dtype in itertools.product((5.0, 30.0), (False, True), ((113, 203), (1024, 1023)),
                                                            DTYPES):
        cases.append(Case(dtype, pick(HEAD_DIMS), sq, sk, heads=pick(tuple(HEADS)), causal=causal, softcap=softcap))
    # ALiBi, with masks.
    for alibi, (_, causal, window), (sq, sk) in itertools.product(("h", "bh"), MASKS[:3], ((128, 217), (799, 3))):
        cases.append(Case(pick(DTYPES), pick(HEAD_DIMS), sq, sk, heads=pick(tuple(HEADS)), causal=causal,
                          window=window, alibi=alibi))
    # Strided and misaligned views, including head dims that get padded.
    for layout, d, causal in itertools.product(LAYOUTS[1:], (59, 64, 128, 256), (False, True)):
        cases.append(Case(pick(DTYPES), d, 128, 217, heads="gqa", causal=causal, layout=layout))
    # Everything at once.
    for dtype, d in itertools.product(DTYPES, (40, 128, 224)):
        cases.append(Case(dtype, d, 799, 1023, heads="gqa", causal=True, window=(256, -1), softcap=20.0, alibi="bh",
                          layout="transposed"))
    return list(dict.fromkeys(cases))  # the rotating picks can repeat a case


CASES = build_cases()


def make_tensor(layout, b, s, h, d, dtype):
    """A (b, s, h, d) tensor of random values laid out as the case asks."""
    if layout == "contiguous":
        return torch.randn(b, s, h, d, dtype=dtype, device="cuda")
    if layout == "transposed":  # as produced from a (b, h, s, d) model layout
        return torch.randn(b, h, s, d, dtype=dtype, device="cuda").transpose(1, 2)
    if layout == "sliced":  # extra heads and extra columns around it: every stride differs from contiguous
        return torch.randn(b, s, h + 1, d + 8, dtype=dtype, device="cuda")[:, :, 1:, :d]
    if layout == "misaligned":  # contiguous, but starting 2 bytes past a 16-byte boundary
        return torch.randn(b * s * h * d + 1, dtype=dtype, device="cuda")[1:].view(b, s, h, d)
    raise ValueError(layout)


def make_inputs(case):
    h, hk = HEADS[case.heads]
    q = make_tensor(case.layout, case.b, case.sq, h, case.d, case.dtype)
    k = make_tensor(case.layout, case.b, case.sk, hk, case.d, case.dtype)
    v = make_tensor(case.layout, case.b, case.sk, hk, case.d, case.dtype)
    alibi = None
    if case.alibi == "h":
        alibi = torch.rand(h, device="cuda") * 0.3
    elif case.alibi == "bh":
        alibi = torch.rand(case.b, h, device="cuda") * 0.3
    return q, k, v, alibi


def require_kernel(d, dtype):
    """Skip when the build was restricted (FLASH_ATTN_HEAD_DIMS) and lacks the kernel for this head dim."""
    tier = _ops.select_tier(torch.cuda.get_device_capability(), _ops.requested_tier(None))
    key = (_ops.TIER_IDS[tier], "fwd", _ops.kernel_head_dim(-(-d // 8) * 8), _ops.DTYPE_NAMES[dtype])
    if key not in _ops.available_kernels():
        pytest.skip(f"kernel {key} not built (FLASH_ATTN_HEAD_DIMS / FLASH_ATTN_CUDA_ARCHS)")


def poison_allocator(b, sq, h, d, dtype):
    """Leave NaN-filled blocks of the output sizes in the caching allocator, where the op's outputs (and the padded
    inputs) will be placed: an element the kernel does not write then stays NaN and fails the test."""
    d_padded = -(-d // 8) * 8
    blocks = [torch.full((b, sq, h, d_padded), float("nan"), dtype=dtype, device="cuda") for _ in range(4)]
    blocks += [torch.full((b, h, sq), float("nan"), device="cuda") for _ in range(2)]
    del blocks


def max_err(x, ref):
    return (x.float() - ref).abs().max().item() if x.numel() else 0.0


def assert_matches_reference(out, lse, q, k, v, **kwargs):
    """out and lse within twice PyTorch's own same-dtype error of the fp32 reference (plus fp32 rounding)."""
    assert torch.isfinite(out).all(), "NaN/inf in out"
    ref_out, ref_lse = attention_ref(q, k, v, **kwargs)
    low_out, low_lse = attention_ref(q, k, v, upcast=False, **kwargs)

    err, tol = max_err(out, ref_out), 2 * max_err(low_out, ref_out) + 1e-5
    assert err <= tol, f"out: max error {err:.3g} > tolerance {tol:.3g}"

    visible = torch.isfinite(ref_lse)  # rows that see at least one key
    assert torch.equal(torch.isfinite(lse), visible), "lse finite where the reference is -inf, or the other way"
    assert (lse[~visible] == float("-inf")).all(), "a row that sees no key must have lse -inf"
    err = max_err(lse[visible], ref_lse[visible])
    tol = 2 * max_err(low_lse[visible], ref_lse[visible]) + 1e-3
    assert err <= tol, f"lse: max error {err:.3g} > tolerance {tol:.3g}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward(case):
    require_kernel(case.d, case.dtype)
    q, k, v, alibi = make_inputs(case)
    kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=alibi)
    poison_allocator(case.b, case.sq, q.shape[2], case.d, case.dtype)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (case.b, q.shape[2], case.sq) and lse.dtype == torch.float32
    assert_matches_reference(out, lse, q, k, v, **kwargs)
    # A second run must agree bit for bit: the forward pass is deterministic, and a race would show here.
    out2, lse2, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


# Shared memory of GPUs whose tiles differ from the H100/H200's: sm86/89/120 (99 KB) and the A100 (163 KB).
SMEM_BUDGETS = {"sm86": 101376, "a100": 166912}


@pytest.mark.parametrize("budget", SMEM_BUDGETS, ids=list(SMEM_BUDGETS))
@pytest.mark.parametrize("d", [160, 192, 224, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_small_smem_tiles(monkeypatch, dtype, d, budget):
    """The fallback tiles of large head dims, forced on this GPU by capping the shared-memory budget."""
    require_kernel(d, dtype)
    monkeypatch.setenv("FLASH_ATTN_SMEM_BUDGET", str(SMEM_BUDGETS[budget]))
    case = Case(dtype, d, 300, 517, heads="gqa", causal=True, window=(200, -1), alibi="h")
    q, k, v, alibi = make_inputs(case)
    kwargs = dict(causal=case.causal, window_size=case.window, alibi_slopes=alibi)
    poison_allocator(case.b, case.sq, q.shape[2], case.d, case.dtype)
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
    poison_allocator(case.b, case.sq, q.shape[2], case.d, case.dtype)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert_matches_reference(out, lse, q, k, v)


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
    default = flash_attn_func(q, k, v)
    assert torch.equal(flash_attn_func(q, k, v, tier="sm80"), default)
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm80")
    assert torch.equal(flash_attn_func(q, k, v), default)
    built = {f"sm{tier}" for (tier, _, _, _) in _ops.available_kernels()}
    for tier in _ops.TIER_IDS:
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


def test_backward_not_implemented():
    require_kernel(64, bf16)
    q, k, v = (torch.randn(1, 64, 2, 64, dtype=bf16, device="cuda", requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v)
    with pytest.raises(NotImplementedError, match="backward pass is not implemented yet"):
        out.sum().backward()


def test_long_rows_are_accurate():
    """Large scores (q scaled up) stress the online softmax rescaling across many key blocks."""
    require_kernel(128, bf16)
    q = torch.randn(1, 2048, 2, 128, dtype=bf16, device="cuda") * 4
    k, v = (torch.randn(1, 8192, 1, 128, dtype=bf16, device="cuda") for _ in range(2))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert_matches_reference(out, lse, q, k, v, causal=True)
