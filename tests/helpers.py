"""Inputs, the case grid and the checks shared by the GPU tests of the forward and backward passes."""

import itertools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch

from flash_attention import _ops, flash_attn_func
from reference import attention_ref

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
# Shared memory of GPUs whose tiles differ from the H100/H200's: sm86/89/120 (99 KB) and the A100 (163 KB).
SMEM_BUDGETS = {"sm86": 101376, "a100": 166912}


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


def build_cases(mask_seqlens=ODD_SEQLENS):
    """Every value of every axis, crossing the risky ones (masks x odd lengths x GQA) instead of taking the full
    Cartesian product. mask_seqlens are the length pairs crossed with every mask, the largest group of cases."""
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
    for (_, causal, window), (sq, sk), heads in itertools.product(MASKS, mask_seqlens, HEADS):
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


def case_kwargs(case, alibi):
    """The keyword arguments of flash_attn_func (and of the reference) that the case sets."""
    return dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=alibi)


def require_kernel(d, dtype, direction="fwd"):
    """Skip when the build was restricted (FLASH_ATTN_HEAD_DIMS) and lacks the kernel for this head dim; direction is
    "fwd" or "bwd"."""
    tier = _ops.select_tier(torch.cuda.get_device_capability(), _ops.requested_tier(None))
    key = (_ops.TIER_IDS[tier], direction, _ops.kernel_head_dim(-(-d // 8) * 8), _ops.DTYPE_NAMES[dtype])
    if key not in _ops.available_kernels():
        pytest.skip(f"kernel {key} not built (FLASH_ATTN_HEAD_DIMS / FLASH_ATTN_CUDA_ARCHS)")


def poison_allocator(q, k):
    """Leave NaN-filled blocks in the caching allocator, of the sizes of the buffers that attention on q and k/v
    allocates (outputs and gradients, padded copies of the inputs, fp32 row statistics and accumulators, the
    GQA/MQA key/value gradients of every query head), where the op's results will be placed: an element the kernel
    does not write then stays NaN and fails the test. All-ones bytes are NaN in fp16, bf16 and fp32 alike."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    d_padded = -(-d // 8) * 8
    shapes = [(b, sq, h, d_padded)] * 4 + [(b, sk, hk, d_padded)] * 4 + [(b, sk, h, d_padded)] * 2 + [(b, h, sq)] * 2
    blocks = [torch.full((math.prod(shape) * itemsize,), 255, dtype=torch.uint8, device="cuda")
              for shape in shapes for itemsize in (q.element_size(), 4)]
    del blocks


def max_err(x, ref):
    return (x.float() - ref).abs().max().item() if x.numel() else 0.0


@torch.no_grad()
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


class SelfAttention(torch.nn.Module):
    """A causal GQA attention layer around flash_attn_func: q/k/v from one projection, as strided views of it."""

    def __init__(self, dim, h, hk, d, **flash_kwargs):
        super().__init__()
        self.h, self.hk, self.d, self.flash_kwargs = h, hk, d, flash_kwargs
        self.qkv = torch.nn.Linear(dim, (h + 2 * hk) * d)
        self.proj = torch.nn.Linear(h * d, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, self.h + 2 * self.hk, self.d).split([self.h, self.hk, self.hk], dim=2)
        out = flash_attn_func(q, k, v, causal=True, **self.flash_kwargs)
        return self.proj(out.reshape(b, s, self.h * self.d))


def output_and_grads(module, params, x, dy):
    """module(x) and the gradients of <module(x), dy> with respect to x and params (the module's parameters, also when
    `module` is a compiled wrapper around it)."""
    y = module(x)
    return (y, *torch.autograd.grad(y, [x, *params], dy))
