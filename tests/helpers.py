"""Inputs, the case grid and the checks shared by the GPU tests of the forward and backward passes."""

import itertools
import math
import re
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch

from flash_attention import _catalog, _dispatch, flash_attn_func
from reference import attention_mask, attention_ref

fp16, bf16 = torch.float16, torch.bfloat16
DTYPES = (fp16, bf16)
HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
SEQLENS = ((1, 1), (1, 239), (113, 203), (128, 217), (256, 512), (512, 256), (1023, 1024), (1024, 1023), (3, 799),
           (799, 3), (4097, 4097))
ODD_SEQLENS = ((1, 239), (113, 203), (3, 799), (799, 3), (1023, 1024), (1024, 1023))
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


def head_counts(heads):
    """(nheads, nheads_k) of a case's `heads`: a name in HEADS, or "h{nheads}k{nheads_k}" (the random grids')."""
    if heads in HEADS:
        return HEADS[heads]
    h, hk = re.fullmatch(r"h(\d+)k(\d+)", heads).groups()
    return int(h), int(hk)


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
    for d, causal, dtype in itertools.product((64, 96, 128, 192, 256), (False, True), DTYPES):
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
    h, hk = head_counts(case.heads)
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


def require_kernel(d, dtype, kind="fwd"):
    """Skip when the build was restricted (FLASH_ATTN_HEAD_DIMS) and lacks the kernel for this head dim; kind is
    "fwd" or "bwd"."""
    try:  # the ops' own tier choice (override, routing), whose error says which kernel the build lacks
        _dispatch.resolve_tier(torch.device("cuda"), None, -(-d // 8) * 8, dtype, kind)
    except RuntimeError as e:
        pytest.skip(f"not built (FLASH_ATTN_HEAD_DIMS / FLASH_ATTN_CUDA_ARCHS): {e}")


def poison_blocks(shapes, itemsizes):
    """Allocate NaN-filled (all-ones bytes) blocks of these shapes and item sizes at once, then free them: the caching
    allocator keeps them and hands them out to the next allocations of those sizes (or a little smaller)."""
    blocks = [torch.full((math.prod(shape) * itemsize,), 255, dtype=torch.uint8, device="cuda")
              for shape in shapes for itemsize in itemsizes]
    del blocks


def poison_allocator(q, k):
    """Leave NaN-filled blocks in the caching allocator, of the sizes of the buffers that attention on q and k/v
    allocates (outputs and gradients, padded copies of the inputs, fp32 row statistics and accumulators, the
    GQA/MQA key/value gradients of every query head), where the op's results will be placed: an element the kernel
    does not write then stays NaN and fails the test. All-ones bytes are NaN in fp16, bf16 and fp32 alike."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    d_padded = -(-d // 8) * 8
    shapes = [(b, sq, h, d_padded)] * 4 + [(b, sk, hk, d_padded)] * 4 + [(b, sk, h, d_padded)] * 2 + [(b, h, sq)] * 2
    poison_blocks(shapes, (q.element_size(), 4))


def poison_allocator_varlen(q, k, batch):
    """poison_allocator for a varlen call on q (total_q, h, d) and k/v (total_k, hk, d) with `batch` sequences: the
    same buffers over all rows, and again with 128 more rows per sequence (a per-sequence padding of the fp32
    accumulators, in case the op rounds each sequence up to a tile) and at the kernel head dim."""
    total_q, h, d = q.shape
    total_k, hk = k.shape[0], k.shape[1]
    shapes = []
    for extra in (0, 128 * batch):
        for width in sorted({-(-d // 8) * 8, _catalog.kernel_head_dim(-(-d // 8) * 8)}):
            rows_q, rows_k = total_q + extra, total_k + extra
            shapes += [(rows_q, h, width)] * 3 + [(rows_k, hk, width)] * 3 + [(rows_k, h, width)] * 2
        shapes += [(h, total_q + extra)] * 2
    poison_blocks(shapes, (q.element_size(), 4))


def grad_rounding(terms):
    """The fp32-rounding allowance of a gradient element that sums `terms` products (dq: the keys a row sees; dk and
    dv: the query rows of every query head of the kv head): 1e-4 up to 4096 terms, then growing as their square
    root, as a sum's rounding does. Where the same-dtype reference is exact (a sequence of one key: every
    probability 1, so dS = P (dP - D) is 0 by cancellation), the kernel's fp32 dP - D still differs by the order of
    its sums, and that difference adds up over the terms (H100: 1.02e-4 on dk over 1413 rows x 8 heads)."""
    return 1e-4 * max(1.0, terms / 4096) ** 0.5


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


# ---------------------------------------------------------------------------------------------------------------------
# Variable-length (varlen) batches: sequences packed along one token dimension, delimited by cu_seqlens.


@dataclass(frozen=True)
class VarlenCase:
    """A varlen call: sequence i has seqlens_q[i] query rows and seqlens_k[i] key rows, of which it uses the first
    seqused_q[i] / seqused_k[i] when given. tail_q / tail_k rows follow the last sequence and belong to none; they are
    only allowed with seqused_q / seqused_k, where the op must leave zeros in them (without seqused their contents
    are unspecified). `mix` names the length mix in the test id (else the lengths are spelled out)."""
    dtype: torch.dtype
    d: int
    seqlens_q: Tuple[int, ...]
    seqlens_k: Tuple[int, ...]
    heads: str = "mha"
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # None, "h" for (nheads,) slopes, "bh" for (num sequences, nheads)
    seqused_q: Optional[Tuple[int, ...]] = None
    seqused_k: Optional[Tuple[int, ...]] = None
    tail_q: int = 0
    tail_k: int = 0
    layout: str = "contiguous"  # or "sliced": every stride differs from contiguous
    mix: str = ""

    def __post_init__(self):
        b = len(self.seqlens_q)
        assert b == len(self.seqlens_k), "one key length per query length"
        for used, lengths in ((self.seqused_q, self.seqlens_q), (self.seqused_k, self.seqlens_k)):
            assert used is None or (len(used) == b and all(0 <= u <= s for u, s in zip(used, lengths)))
        assert not self.tail_q or self.seqused_q is not None, "tail rows of q are only checkable with seqused_q"
        assert not self.tail_k or self.seqused_k is not None, "tail rows of k are only checkable with seqused_k"

    @property
    def b(self):
        return len(self.seqlens_q)

    @property
    def used_q(self):
        return self.seqlens_q if self.seqused_q is None else self.seqused_q

    @property
    def used_k(self):
        return self.seqlens_k if self.seqused_k is None else self.seqused_k

    @property
    def id(self):
        dtype = "bf16" if self.dtype == bf16 else "fp16"
        if self.mix:
            lengths = self.mix
        else:
            lengths = "q" + ",".join(map(str, self.seqlens_q)) + "_k" + ",".join(map(str, self.seqlens_k))
        parts = [dtype, f"d{self.d}", lengths, self.heads]
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi:
            parts.append(f"alibi_{self.alibi}")
        if self.seqused_q is not None:
            parts.append("usedq")
        if self.seqused_k is not None:
            parts.append("usedk")
        if self.tail_q or self.tail_k:
            parts.append(f"tail{self.tail_q}_{self.tail_k}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        return "-".join(parts)


@dataclass
class VarlenInputs:
    q: torch.Tensor  # (total_q, h, d)
    k: torch.Tensor  # (total_k, hk, d)
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 (b + 1,)
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_q: Optional[torch.Tensor]  # int32 (b,)
    seqused_k: Optional[torch.Tensor]
    alibi: Optional[torch.Tensor]


def cumulative(lengths):
    """[0, l0, l0 + l1, ...] as Python ints."""
    return [0, *itertools.accumulate(lengths)]


def int32_cuda(values):
    return torch.tensor(list(values), dtype=torch.int32, device="cuda")


def make_varlen_tensor(layout, total, h, d, dtype):
    """A (total, h, d) tensor of random values laid out as asked."""
    if layout == "contiguous":
        return torch.randn(total, h, d, dtype=dtype, device="cuda")
    if layout == "sliced":  # extra heads and columns around it, as in a packed qkv projection
        return torch.randn(total, h + 1, d + 8, dtype=dtype, device="cuda")[:, 1:, :d]
    raise ValueError(layout)


def make_varlen_inputs(case):
    h, hk = head_counts(case.heads)
    total_q = sum(case.seqlens_q) + case.tail_q
    total_k = sum(case.seqlens_k) + case.tail_k
    q = make_varlen_tensor(case.layout, total_q, h, case.d, case.dtype)
    k = make_varlen_tensor(case.layout, total_k, hk, case.d, case.dtype)
    v = make_varlen_tensor(case.layout, total_k, hk, case.d, case.dtype)
    alibi = None
    if case.alibi == "h":
        alibi = torch.rand(h, device="cuda") * 0.3
    elif case.alibi == "bh":
        alibi = torch.rand(case.b, h, device="cuda") * 0.3
    return VarlenInputs(
        q, k, v, int32_cuda(cumulative(case.seqlens_q)), int32_cuda(cumulative(case.seqlens_k)),
        max(case.seqlens_q, default=0), max(case.seqlens_k, default=0),
        None if case.seqused_q is None else int32_cuda(case.seqused_q),
        None if case.seqused_k is None else int32_cuda(case.seqused_k),
        alibi,
    )


def varlen_kwargs(case, inputs):
    """The keyword arguments of flash_attn_varlen_func that the case sets (besides the positional tensors)."""
    return dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=inputs.alibi,
                seqused_q=inputs.seqused_q, seqused_k=inputs.seqused_k)


@dataclass(frozen=True)
class Sequence:
    index: int
    rows_q: slice  # the used query rows of the sequence
    rows_k: slice  # the used key/value rows


def varlen_sequences(case):
    """Each sequence's used rows (lengths known on the host: no device sync)."""
    cu_q, cu_k = cumulative(case.seqlens_q), cumulative(case.seqlens_k)
    return [Sequence(i, slice(cu_q[i], cu_q[i] + case.used_q[i]), slice(cu_k[i], cu_k[i] + case.used_k[i]))
            for i in range(case.b)]


def unused_rows(case):
    """Bool masks over q's rows and k's rows that belong to no used sequence position (past seqused, or in the
    tail), on the host's knowledge of the case; None for a side without seqused (its unused rows are unspecified)."""
    masks = []
    for used, lengths, tail, given in ((case.used_q, case.seqlens_q, case.tail_q, case.seqused_q),
                                       (case.used_k, case.seqlens_k, case.tail_k, case.seqused_k)):
        if given is None:
            masks.append(None)
            continue
        mask = torch.ones(sum(lengths) + tail, dtype=torch.bool)
        for start, n in zip(cumulative(lengths), used):
            mask[start:start + n] = False
        masks.append(mask.cuda())
    return masks


def sequence_reference_kwargs(case, inputs, seq):
    """attention_ref's keyword arguments for one sequence: the case's masks, and its own ALiBi slopes."""
    slopes = inputs.alibi
    if slopes is not None and slopes.dim() == 2:
        slopes = slopes[seq.index]
    return dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=slopes)


def sequence_visibility(case, seq):
    """Bool (used_q, used_k) of the keys each query row of the sequence sees (masks bottom-right per sequence)."""
    nq, nk = seq.rows_q.stop - seq.rows_q.start, seq.rows_k.stop - seq.rows_k.start
    return attention_mask(nq, nk, case.causal, case.window, device="cuda")


def rows_seeing_a_key(case):
    """Bool (total_q,): the rows that are used and see at least one key of their sequence."""
    sees = torch.zeros(sum(case.seqlens_q) + case.tail_q, dtype=torch.bool, device="cuda")
    for seq in varlen_sequences(case):
        sees[seq.rows_q] = sequence_visibility(case, seq).any(dim=1)
    return sees


def assert_varlen_matches_reference(out, lse, case, inputs):
    """out (total_q, h, d) and lse (h, total_q): every sequence within the 2x rule of its own fp32 reference (b = 1,
    the sequence's used rows, its masks aligned to its own used lengths, its ALiBi slopes); rows outside every used
    sequence position exactly 0 / -inf when seqused is given."""
    q, k, v = inputs.q, inputs.k, inputs.v
    h = q.shape[1]
    assert out.shape == q.shape and out.dtype == q.dtype, f"out: {tuple(out.shape)} {out.dtype}"
    assert lse.shape == (h, q.shape[0]) and lse.dtype == torch.float32, f"lse: {tuple(lse.shape)} {lse.dtype}"
    for seq in varlen_sequences(case):
        if seq.rows_q.stop == seq.rows_q.start:
            continue
        try:
            assert_matches_reference(out[seq.rows_q][None], lse[:, seq.rows_q][None], q[seq.rows_q][None],
                                     k[seq.rows_k][None], v[seq.rows_k][None],
                                     **sequence_reference_kwargs(case, inputs, seq))
        except AssertionError as e:
            raise AssertionError(f"sequence {seq.index} (q rows {seq.rows_q.start}:{seq.rows_q.stop}, k rows "
                                 f"{seq.rows_k.start}:{seq.rows_k.stop}): {e}") from None
    unused_q, _ = unused_rows(case)
    if unused_q is not None:
        assert (out[unused_q] == 0).all(), "out of a row past seqused_q (or in no sequence) must be 0"
        assert (lse[:, unused_q] == float("-inf")).all(), "lse of a row past seqused_q (or in no sequence) must be -inf"


def reference_grads(q, k, v, dout, dlse, upcast, **kwargs):
    """attention_ref's gradients (dq, dk, dv) for dout (and dlse when not None), in fp32 (upcast) or in the input
    dtype; q (b, sq, h, d), k/v (b, sk, hk, d)."""
    leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, upcast=upcast, **kwargs)
    if dlse is None:
        return torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return torch.autograd.grad((out, lse), leaves, (dout.to(out.dtype), dlse))


def varlen_cotangents(case, inputs, with_lse=False):
    """A random dout (total_q, h, d), and with_lse a random dlse (h, total_q) that is 0 on the rows whose lse is -inf
    (unused rows, rows that see no key): no finite loss can weight those."""
    dout = torch.randn(inputs.q.shape, dtype=inputs.q.dtype, device="cuda")
    if not with_lse:
        return dout, None
    h, total_q = inputs.q.shape[1], inputs.q.shape[0]
    return dout, torch.randn(h, total_q, device="cuda").masked_fill(~rows_seeing_a_key(case), 0.0)


def assert_varlen_grads_correct(case, inputs, dout, dlse, *grad_sets):
    """Each (dq, dk, dv) in grad_sets: shapes and dtypes; per sequence finite, exact zeros where the masks put them
    (rows that see no key, keys that no row sees) and within three times PyTorch's own same-dtype error of that
    sequence's fp32 reference gradients (plus fp32 rounding); zeros in the rows past seqused (and in the tail)."""
    q, k, v = inputs.q, inputs.k, inputs.v
    group = q.shape[1] // k.shape[1]
    for grads in grad_sets:
        for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {tuple(g.shape)} {g.dtype}"
    for seq in varlen_sequences(case):
        rows = (seq.rows_q, seq.rows_k, seq.rows_k)
        if seq.rows_q.stop == seq.rows_q.start and seq.rows_k.stop == seq.rows_k.start:
            continue
        where = f"sequence {seq.index} (q rows {seq.rows_q.start}:{seq.rows_q.stop}, k rows " \
                f"{seq.rows_k.start}:{seq.rows_k.stop})"
        sees = sequence_visibility(case, seq)
        blind_rows, unseen_keys = ~sees.any(dim=1), ~sees.any(dim=0)
        pieces = [q[seq.rows_q][None], k[seq.rows_k][None], v[seq.rows_k][None], dout[seq.rows_q][None],
                  None if dlse is None else dlse[:, seq.rows_q][None]]
        kwargs = sequence_reference_kwargs(case, inputs, seq)
        ref = reference_grads(*pieces, upcast=True, **kwargs)
        low = reference_grads(*pieces, upcast=False, **kwargs)
        terms = (seq.rows_k.stop - seq.rows_k.start,) + ((seq.rows_q.stop - seq.rows_q.start) * group,) * 2
        for grads in grad_sets:
            got = [g[r] for g, r in zip(grads, rows)]
            for name, g in zip(("dq", "dk", "dv"), got):
                assert torch.isfinite(g).all(), f"{where}: NaN/inf in {name}"
            assert not got[0][blind_rows].any(), f"{where}: dq of a row that sees no key must be exactly 0"
            assert not got[1][unseen_keys].any() and not got[2][unseen_keys].any(), \
                f"{where}: dk/dv of a key no row sees must be exactly 0"
            for name, g, r, lo, n in zip(("dq", "dk", "dv"), got, ref, low, terms):
                err, tol = max_err(g[None], r), 3 * max_err(lo, r) + grad_rounding(n)
                assert err <= tol, f"{where}: {name}: max error {err:.3g} > tolerance {tol:.3g}"
        del ref, low
    unused_q, unused_k = unused_rows(case)
    for grads in grad_sets:
        dq, dk, dv = grads
        if unused_q is not None:
            assert (dq[unused_q] == 0).all(), "dq of a row past seqused_q (or in no sequence) must be 0"
        if unused_k is not None:
            assert (dk[unused_k] == 0).all() and (dv[unused_k] == 0).all(), \
                "dk/dv of a row past seqused_k (or in no sequence) must be 0"
