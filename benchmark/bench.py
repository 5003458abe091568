"""Attention throughput of flash_attention beside the peers importable on this machine: forward, backward, or
forward + backward (--mode fwd, bwd, fwdbwd).

TFLOPS from 4 * b * h * sq * sk * d FLOPs for the forward (halved when causal), 2.5x that for the backward and 3.5x
for forward + backward, timed with CUDA events: per shape, rounds of warm-up (5 calls, then 200 ms of back-to-back
calls, so that every provider is timed at the GPU's sustained clocks) and timed runs with the providers in random
order, then the median of all timed runs. The backward is torch.autograd.grad of a kept forward output with a fixed
random dout; forward + backward runs a fresh forward before each such call. Besides `ours`, the backward
modes time `ours_det` (deterministic=True). Peers: PyTorch SDPA under its FLASH_ATTENTION (FlashAttention-2),
CUDNN_ATTENTION and EFFICIENT_ATTENTION backends, flash-attn 2 (`flash_attn`) and FlashAttention-4
(`flash_attn.cute`) when installed. A peer that is missing or fails on a shape shows as n/a.

    python benchmark/bench.py                         # 16k tokens, model dim 2048, head dims 64/128/256
    python benchmark/bench.py --tier sm80 --json out.json --png out.png
    python benchmark/bench.py --shape 1,4096,4096,32,8,128 --causal yes
    python benchmark/bench.py --mode bwd              # backward of ours and ours_det beside the peers' backward
    python benchmark/bench.py --mode fwdbwd --hdims 128 --seqlens 4096,16384
    python benchmark/bench.py --mode bwd --kernels --peers fa4   # and each one's kernels: us per call, longest first

Variable-length batches (--varlen [MIXES], with any --mode): 16k tokens (--tokens) packed as one varlen batch of
self-attention sequences (seqlen_q = seqlen_k per sequence), head dims 64 and 128 by default, model dim 2048. Mixes:
`uniform` (lengths uniform in 128..4096, seeded, until the tokens are used up), `diffusion` (one 12k sequence, then
text-like sequences of 64..512 tokens), `equal` (4 x 4096: `ours_batched`, flash_attn_func on the same tokens viewed
as (b, s, h, d), gives the varlen/batched ratio). Providers: ours (flash_attn_varlen_func; ours_det in the backward
modes) and each peer's varlen path: SDPA on jagged nested tensors (torch.nested.nested_tensor_from_jagged, layout
(b, h, j, d)) under its FLASH_ATTENTION (FlashAttention-2's varlen kernel through aten._flash_attention_forward with
cu_seqlens), CUDNN_ATTENTION and EFFICIENT_ATTENTION backends, flash-attn 2's flash_attn_varlen_func (or, when
flash-attn is not installed, the same kernel through aten._flash_attention_forward directly: SDPA's FLASH backend
without the nested-tensor wrapper's overhead) and FlashAttention-4's flash_attn_varlen_func. FLOPs count the visible scores exactly: 4 * h * d * sum over sequences of the number of
(query, key) pairs the mask lets through (sq * sk, or sq * (sq + 1) / 2 causal), for every provider alike; the
backward modes 2.5x / 3.5x that. Accuracy is checked per sequence (the longest, the shortest and the last) against
fp32 on the query heads of kv head 0.

    python benchmark/bench.py --varlen                    # uniform, diffusion, equal; head dims 64, 128; both masks
    python benchmark/bench.py --varlen --mode bwd --json varlen_bwd.json
    python benchmark/bench.py --varlen equal,diffusion --hdims 128 --causal yes

Eager time per call (--eager, with --mode fwd or fwdbwd; also bwd): the host path of a call (argument handling,
dispatch, allocation, launch), which is what a tiny shape such as a decode step costs. Per provider and round:
--warmup calls and a synchronize, then --iters (default 500) back-to-back calls between two synchronizes, timed with
time.perf_counter; the per-call time is the elapsed time / --iters, and the table shows its median over --rounds
(default 10) rounds, providers in random order every round, in us; the JSON keeps every round's. Forward + backward
is a fresh forward and torch.autograd.grad of it, per call. Default shapes (b,sq,sk,h,hk,d): 1,1,128,8,8,128 and
1,128,128,8,8,64 (--shape replaces them). The peers by default include SDPA's MATH backend (sdpa_math). The SDPA
peers are timed as SDPA's callers run it: F.scaled_dot_product_attention alone, on (b, h, s, d) views made outside
the timing, with its backend chosen once around the timed calls rather than per call. Ratios ours/peer are peer
time / ours, as in the throughput table: > 1 means ours is faster.

    python benchmark/bench.py --eager --json eager_fwd.json
    python benchmark/bench.py --eager --mode fwdbwd --json eager_fwdbwd.json
    python benchmark/bench.py --eager --shape 4,1,4096,32,8,128 --causal no --iters 1000

Decode steps (--decode): one attention call of a few query rows against a full KV cache per shape (default: the
inference issue's eight shapes, b,sq,sk,h,hk,d; --shape replaces them), causal. Ours is flash_attn_with_kvcache
(cache_seqlens = sk; with --page-size P the cache is paged into shuffled pages of P rows and read through
block_table); the peers get the same q, k, v: SDPA's FLASH and CUDNN backends on (b, h, s, d) views, FA4's
flash_attn_func. Each provider's call is captured in a CUDA graph once and replayed for 200 ms (--warmup-ms: the
GPU's sustained clocks); a sample is then --iters replays between two CUDA events (kernel time per call, without
launch overhead), --rounds rounds with the providers in random order, median.
The table shows us per call and the K+V bytes read per second (2 * b * sk * hk * d * 2 bytes / time, TB/s);
ours/best is the best peer's time over ours (> 1: ours is faster). With --eager, eager time per call instead.

    python benchmark/bench.py --decode --json decode.json
    python benchmark/bench.py --decode --page-size 16 --json decode_paged16.json
    python benchmark/bench.py --decode --kernels --peers sdpa_cudnn   # and each one's kernels (eager calls)
"""

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from flash_attention import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_eff", "fa2", "fa4")
# SDPA's MATH backend materializes the scores: a default peer only of the eager mode, whose shapes are tiny.
EAGER_PEERS = PEERS + ("sdpa_math",)
EAGER_SHAPES = ((1, 1, 128, 8, 8, 128), (1, 128, 128, 8, 8, 64))  # a decode step; a short prefill
# Peers that get an ours/peer column and summary: (provider, column label).
RATIO_PEERS = (("sdpa_flash", "flash"), ("sdpa_cudnn", "cudnn"), ("fa4", "fa4"))
# What each mode times and its FLOPs over the forward's: the backward runs 5 matmuls of the forward's size
# (S = QK^T again, dP = dO V^T, dV, dQ, dK) to the forward's 2.
MODES = {"fwd": ("forward", 1.0), "bwd": ("backward", 2.5), "fwdbwd": ("forward + backward", 3.5)}
SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_eff": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
RELERR_LIMIT = 2e-2  # far above bf16 rounding (~2e-3 relative); a result beyond it is wrong, not imprecise

# nvidia-smi fields that tell machines and their state apart, kept in the JSON before and after the run (session 69
# read a spread of one kernel's figure as machines; session 70 found it was the clocks' state within a run).
SMI_FIELDS = ("driver_version", "power.limit", "clocks.max.sm", "clocks.max.mem", "clocks.sm", "temperature.gpu",
              "power.draw")


def machine_state():
    """The current GPU's identity, and its nvidia-smi fields where nvidia-smi runs (else only the identity)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = str(getattr(props, "uuid", "")).removeprefix("GPU-")
    state = dict(uuid=uuid, sms=props.multi_processor_count, l2_bytes=getattr(props, "L2_cache_size", None))
    try:
        out = subprocess.run(["nvidia-smi", "-i", f"GPU-{uuid}", f"--query-gpu={','.join(SMI_FIELDS)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return state
    values = [v.strip() for v in out.stdout.strip().split(",")]
    if out.returncode == 0 and len(values) == len(SMI_FIELDS):
        state.update(zip(SMI_FIELDS, values))
    return state


def sdpa_attention(q, k, v, causal):
    """F.scaled_dot_product_attention on SDPA's (b, h, s, d) layout, with the package's causal mask."""
    sq, sk = q.shape[2], k.shape[2]
    # A single query row sees every key under the bottom-right mask: no mask, as a decode step calls SDPA.
    causal = causal and sq > 1
    # SDPA's is_causal is aligned top-left; the package (and flash-attn) align bottom-right. The lower-right bias
    # picks its kernel itself (flash when it can), whatever backend sdpa_kernel enables.
    mask = causal_lower_right(sq, sk) if causal and sq != sk else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


def sdpa_provider(backend):
    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return sdpa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal).transpose(1, 2)

    return run


def make_provider(name, tier):
    """A differentiable function (q, k, v, causal) -> out in (b, s, h, d); raises if the provider cannot be loaded."""
    if name in ("ours", "ours_det"):
        deterministic = name == "ours_det"
        return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal, deterministic=deterministic, tier=tier)
    if name in SDPA_BACKENDS:
        return sdpa_provider(SDPA_BACKENDS[name])
    if name == "fa2":
        from flash_attn import flash_attn_func as fa2_func

        return lambda q, k, v, causal: fa2_func(q, k, v, causal=causal)
    if name == "fa4":
        from flash_attn.cute import flash_attn_func as fa4_func

        return lambda q, k, v, causal: fa4_func(q, k, v, causal=causal)[0]  # FA4 returns (out, lse)
    raise ValueError(f"unknown provider {name!r}; known: ours, ours_det, {', '.join(EAGER_PEERS)}")


# ---------------------------------------------------------------------------------------------------------------------
# Variable-length batches

VARLEN_MIXES = ("uniform", "diffusion", "equal")
# The varlen providers: ours, and each peer's varlen path (the peers' names, for --peers).
VARLEN_EXTRA = ("ours_batched",)
VARLEN_RATIOS = (("sdpa_flash", "flash"), ("fa2", "fa2"), ("sdpa_cudnn", "cudnn"), ("fa4", "fa4"),
                 ("ours_batched", "batched"))


def varlen_lengths(mix, tokens, seed=0):
    """Sequence lengths of a named mix, summing to `tokens`."""
    rng = random.Random(seed)
    if mix == "equal":  # 4 sequences, as the batched mode's b = 4, s = 4096 at 16k tokens
        if tokens % 4:
            raise ValueError(f"the equal mix splits --tokens in 4, got {tokens}")
        return [tokens // 4] * 4
    if mix == "uniform":  # uniform in 128..4096; the last one takes the remainder (kept at 128 or more)
        lengths, left = [], tokens
        while left:
            n = min(rng.randint(128, 4096), left)
            if left - n < 128:
                n = left
            lengths.append(n)
            left -= n
        return lengths
    if mix == "diffusion":  # one long (image/video) sequence of 3/4 of the tokens, then short text-like ones
        long = tokens * 3 // 4
        lengths, left = [long], tokens - long
        while left:
            n = min(rng.randint(64, 512), left)
            if left - n < 64:
                n = left
            lengths.append(n)
            left -= n
        return lengths
    raise ValueError(f"unknown mix {mix!r}; known: {', '.join(VARLEN_MIXES)}")


def visible_pairs(sq, sk, causal):
    """(query, key) pairs the mask lets through in one sequence (bottom-right causal alignment, as the kernels)."""
    if not causal:
        return sq * sk
    # Query i sees keys 0 .. i + sk - sq (clipped to 0 .. sk - 1).
    return sum(min(sk, max(0, i + sk - sq + 1)) for i in range(sq))


def cumulative(lengths):
    return [0, *itertools.accumulate(lengths)]


def sdpa_jagged_binder(backend):
    def bind(lengths):
        offsets = torch.tensor(cumulative(lengths), dtype=torch.int64, device="cuda")  # NJT offsets are int64
        lo, hi = min(lengths), max(lengths)

        def jagged(x):  # (total, h, d) -> nested (b, j, h, d) over the same storage -> (b, h, j, d)
            return torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=lo, max_seqlen=hi).transpose(1, 2)

        def run(q, k, v, causal):
            # Per sequence sq == sk, so SDPA's top-left is_causal is the bottom-right mask too.
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v), is_causal=causal)
            return out.transpose(1, 2).values()

        return run

    return bind


def make_varlen_binder(name, tier):
    """A function lengths -> provider (q, k, v, causal) -> out on packed (total, h, d) tensors, sequences per
    `lengths` (cu_seqlens built once, outside the timing); raises if the provider cannot be loaded."""
    def with_cu(fn):
        def bind(lengths):
            cu = torch.tensor(cumulative(lengths), dtype=torch.int32, device="cuda")
            return functools.partial(fn, cu=cu, max_len=max(lengths))
        return bind

    if name in ("ours", "ours_det"):
        deterministic = name == "ours_det"
        return with_cu(lambda q, k, v, causal, cu, max_len: flash_attn_varlen_func(
            q, k, v, cu, cu, max_len, max_len, causal=causal, deterministic=deterministic, tier=tier))
    if name == "ours_batched":
        def bind(lengths):
            if len(set(lengths)) != 1:
                raise ValueError("ours_batched runs only on sequences of one length (the equal mix)")
            b, s = len(lengths), lengths[0]
            return lambda q, k, v, causal: flash_attn_func(
                *(t.view(b, s, *t.shape[1:]) for t in (q, k, v)), causal=causal, tier=tier).view(q.shape)
        return bind
    if name in SDPA_BACKENDS:
        return sdpa_jagged_binder(SDPA_BACKENDS[name])
    if name == "fa2":
        try:
            from flash_attn import flash_attn_varlen_func as fa2_varlen
        except ImportError:
            # FlashAttention-2's varlen kernel as PyTorch ships it (what SDPA's FLASH backend calls on jagged
            # tensors), without the nested-tensor wrapper; it has a registered derivative.
            def fa2_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
                return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                               False)[0]

        return with_cu(lambda q, k, v, causal, cu, max_len: fa2_varlen(q, k, v, cu, cu, max_len, max_len,
                                                                      causal=causal))
    if name == "fa4":
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

        def fa4(q, k, v, causal, cu, max_len):
            # Keywords: FA4's 4th positional parameter is qv (MLA) in recent releases. It returns (out, lse).
            result = fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                max_seqlen_k=max_len, causal=causal)
            return result[0] if isinstance(result, tuple) else result

        return with_cu(fa4)
    raise ValueError(f"unknown provider {name!r}; known: ours, ours_det, ours_batched, {', '.join(EAGER_PEERS)}")


def varlen_reference(q, k, v, causal, lengths, dout=None):
    """reference_subset of a few sequences (the longest, the shortest, the last): {sequence index: (rows, ref)}."""
    cu = cumulative(lengths)
    picks = sorted({max(range(len(lengths)), key=lengths.__getitem__),
                    min(range(len(lengths)), key=lengths.__getitem__), len(lengths) - 1})
    refs = {}
    for i in picks:
        rows = slice(cu[i], cu[i + 1])
        refs[i] = rows, reference_subset(q[rows][None], k[rows][None], v[rows][None], causal,
                                         None if dout is None else dout[rows][None])
    return refs


def varlen_relative_errors(results, refs):
    """The worst relative error over the checked sequences, per reference tensor."""
    errors = {}
    for rows, ref in refs.values():
        sliced = {key: t[rows][None] for key, t in results.items()}  # self-attention: q and k rows coincide
        for key, error in relative_errors(sliced, ref).items():
            errors[key] = max(errors.get(key, 0.0), error)
    return errors


def run_varlen(args, dtype, backward, flops_factor):
    """The --varlen sweep: returns (rows, provider names, ratio columns, failed-check marks per row)."""
    binders = {}
    names = ["ours"] + (["ours_det"] if backward else []) + list(VARLEN_EXTRA) + args.peers
    for name in names:
        try:
            binders[name] = make_varlen_binder(name, args.tier)
        except Exception as e:  # a peer that is not installed is simply absent
            if name.startswith("ours"):
                raise
            print(f"{name}: n/a ({type(e).__name__}: {e})")
    names = list(binders)
    ratios = [("ours", peer, f"ours/{label}") for peer, label in VARLEN_RATIOS if peer in binders]
    if "ours_det" in binders:
        ratios.append(("ours_det", "ours", "det/ours"))
    columns = ["mix", "seqs", "max", "h", "d", "causal"] + names + [key for _, _, key in ratios]
    widths = [9, 5, 6, 4, 4, 6] + [max(10, len(n)) for n in names] + [12] * len(ratios)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))

    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = []
    rng = random.Random(0)
    for mix, d, causal in itertools.product(args.varlen, args.hdims or [64, 128], causals):
        lengths = varlen_lengths(mix, args.tokens)
        h = args.model_dim // d
        total = sum(lengths)
        q, k, v = (torch.randn(total, h, d, dtype=dtype, device="cuda", requires_grad=backward) for _ in range(3))
        dout = torch.randn_like(q) if backward else None
        flops = flops_factor * 4 * h * d * sum(visible_pairs(n, n, causal) for n in lengths)
        refs = None if args.no_check else varlen_reference(q, k, v, causal, lengths, dout)
        row = dict(mix=mix, lengths=lengths, b=len(lengths), total=total, max_seqlen=max(lengths), h=h, hk=h, d=d,
                   causal=causal, dtype=args.dtype, mode=args.mode, flops=flops)
        # Only the equal mix has a batched layout without padding (n/a in the others).
        attns = {name: functools.partial(bind, lengths) for name, bind in binders.items()
                 if name != "ours_batched" or len(set(lengths)) == 1}
        check = None if refs is None else functools.partial(varlen_relative_errors, refs=refs)
        bad = measure_row(row, attns, names, args, q, k, v, causal, dout, check, flops, ratios, rng)
        rows.append(row)
        del q, k, v, dout, refs

        cells = [mix, str(len(lengths)), str(max(lengths)), str(h), str(d), "yes" if causal else "no"]
        cells += result_cells(row, names, bad, ratios, args.eager)
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)), flush=True)
        print_kernels(row, names)
    return rows, names, ratios


def parse_mixes(text):
    mixes = [m for m in text.split(",") if m] if text != "all" else list(VARLEN_MIXES)
    unknown = [m for m in mixes if m not in VARLEN_MIXES]
    if unknown or not mixes:
        raise argparse.ArgumentTypeError(f"unknown mixes {','.join(unknown)}; known: {','.join(VARLEN_MIXES)}")
    return mixes


# ---------------------------------------------------------------------------------------------------------------------


def prepare_call(mode, attn, q, k, v, causal, dout):
    """Runs provider `attn` once in `mode` (which also compiles the JIT peers, outside the timing) and returns its
    results to check, {'out'} and in the backward modes {'dq', 'dk', 'dv'} too, and the call to time."""
    out = attn(q, k, v, causal)
    if mode == "fwd":
        return {"out": out}, functools.partial(attn, q, k, v, causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    results = dict(out=out.detach(), dq=dq, dk=dk, dv=dv)
    if mode == "bwd":  # the kept graph of this one forward is replayed backward, so only the backward is timed
        return results, functools.partial(torch.autograd.grad, out, (q, k, v), dout, retain_graph=True)
    return results, lambda: torch.autograd.grad(attn(q, k, v, causal), (q, k, v), dout)


def sustain(fn, calls, warmup_ms):
    """`calls` back-to-back calls of fn, then as many more as fill `warmup_ms` at their time per call (at least one
    call sets it). The long warm-up times every provider at the GPU's sustained clocks: an H200's kernels run up to
    12% faster in the first 40-50 ms of back-to-back calls after an idle moment, so that a short warm-up timed
    whichever provider came first in a round partly at the faster clocks (RESULTS.md, session 70)."""
    calls = max(calls, 1 if warmup_ms > 0 else 0)
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    for _ in range(calls):
        fn()
    last.record()
    torch.cuda.synchronize()
    if warmup_ms > 0:
        for _ in range(math.ceil(warmup_ms / max(first.elapsed_time(last) / calls, 1e-3))):
            fn()


def time_samples_ms(fn, warmup, iters, warmup_ms):
    """sustain(fn, warmup, warmup_ms), then `iters` timed calls, one CUDA-event pair each."""
    sustain(fn, warmup, warmup_ms)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def eager_samples_ms(fn, warmup, iters):
    """One sample: the wall time per call of `iters` back-to-back calls, from an idle GPU to the synchronize after
    the last. Tiny kernels finish before the next launch, so this is the host path's time; where the GPU is the
    slower side it is the GPU's time per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return [(time.perf_counter() - start) * 1e3 / iters]


def sample_providers(fns, sample, rounds, rng, pins):
    """The samples (ms) of each provider over `rounds` rounds of `sample(fn)`, under its pin (a context manager
    factory), in a fresh random order every round. The clock and power state that one provider leaves behind (FA4 and
    cuDNN heat the GPU most) then falls on a different provider each time; in a fixed or rotated order it always falls
    on the same successor."""
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name in rng.sample(list(fns), len(fns)):
            with pins[name]():
                samples[name] += sample(fns[name])
    return samples


def reference_subset(q, k, v, causal, dout=None):
    """fp32 attention for batch 0 and the query heads that share key/value head 0 (at most 2), bottom-right causal:
    {'out': (sq, heads, d)}; given dout, by autograd also 'dq' (sq, heads, d) and, when those heads are the whole
    group of key/value head 0 and so give its whole gradient, 'dk' and 'dv' (sk, 1, d). Checking a slice keeps the
    reference cheap at 16k tokens (1 GiB per fp32 score matrix, a few alive per head) while still covering every
    query and key."""
    sq, h, d = q.shape[1], q.shape[2], q.shape[3]
    sk, hk = k.shape[1], k.shape[2]
    heads = min(2, h // hk)
    grad = dout is not None
    # Detached copies: in the backward modes q, k, v require grad, and their graph must not grow here.
    kk, vv = (t[0, :, 0].detach().float().requires_grad_(grad) for t in (k, v))
    hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq).logical_not_() if causal else None
    outs, dqs = [], []
    for head in range(heads):
        qq = q[0, :, head].detach().float().requires_grad_(grad)
        scores = (qq @ kk.T) * d ** -0.5
        if causal:
            scores = scores.masked_fill(hidden, float("-inf"))
        # A row that sees no key gives NaN here and 0 in the kernels; its masked_fill backward zeroes its gradient.
        out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vv
        del scores
        if grad:
            out.backward(dout[0, :, head].float())  # adds this head's share to kk.grad and vv.grad
            dqs.append(qq.grad)
        outs.append(out.detach())
        del out  # frees this head's graph before the next
    ref = {"out": torch.stack(outs, dim=1)}
    if grad:
        ref["dq"] = torch.stack(dqs, dim=1)
        if heads == h // hk:
            ref["dk"], ref["dv"] = kk.grad.unsqueeze(1), vv.grad.unsqueeze(1)
    return ref


def relative_errors(results, ref):
    """Norm-wise relative error of each reference tensor against the same slice of a provider's results."""
    errors = {}
    for key, expected in ref.items():
        got = results[key][0, :, : expected.shape[1]].float()
        errors[key] = ((got - expected).norm() / expected.norm()).item()
    return errors


def parse_shape(text):
    try:
        b, sq, sk, h, hk, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants b,sq,sk,h,hk,d (six ints), got {text!r}")
    return b, sq, sk, h, hk, d


def parse_ints(text):
    return [int(x) for x in text.split(",") if x]


def parse_peers(text):
    peers = [p for p in text.split(",") if p]
    unknown = [p for p in peers if p not in EAGER_PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peers {','.join(unknown)}; known: {','.join(EAGER_PEERS)}")
    return peers


def build_configs(args):
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if args.shape:
        return [(*shape, causal) for shape in args.shape for causal in causals]
    configs = []
    for d in args.hdims:
        h = args.model_dim // d
        for causal in causals:
            for s in args.seqlens:
                configs.append((max(1, args.tokens // s), s, s, h, h, d, causal))
    return configs


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def geomean(values):
    return math.exp(sum(math.log(x) for x in values) / len(values)) if values else None


def plot(rows, providers, path, what):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no plot written to {path}")
        return
    head_dims = sorted({r["d"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plt.subplots(len(causals), len(head_dims), figsize=(4.5 * len(head_dims), 3.8 * len(causals)),
                             squeeze=False)
    for (i, causal), (j, d) in itertools.product(enumerate(causals), enumerate(head_dims)):
        ax = axes[i][j]
        group = [r for r in rows if r["d"] == d and r["causal"] == causal]
        for name in providers:
            points = [(r["sq"], r[f"{name}_tflops"]) for r in group if r[f"{name}_tflops"] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"head dim {d}, {'causal' if causal else 'full'}")
        ax.set_xlabel("seqlen_q")
        ax.set_ylabel(f"TFLOPS ({what})")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def heads_first(t):
    """(b, s, h, d) -> a (b, h, s, d) view of the same storage, a leaf requiring grad as `t` does (for the eager
    mode's SDPA, whose gradients are then taken with respect to these views)."""
    return None if t is None else t.detach().transpose(1, 2).requires_grad_(t.requires_grad)


def measure_row(row, attns, names, args, q, k, v, causal, dout, check, flops, ratios, rng):
    """One shape of either sweep: each provider (`attns`: name -> a function returning its attention callable) is
    run once and checked (`check(results)` -> relative error per output, or None to skip), the ones that ran are
    timed together, and `row` gets their TFLOPS, ms (and with --eager us per call, median and per round), errors
    and the ratio columns. Returns the providers whose check failed."""
    bad, runnable, pins = set(), {}, {}
    for name in names:
        row[f"{name}_tflops"] = row[f"{name}_ms"] = None
    for name, make_attn in attns.items():
        try:
            attn, inputs, pin = make_attn(), (q, k, v, dout), contextlib.nullcontext
            eager_sdpa = args.eager and name in SDPA_BACKENDS
            if eager_sdpa:
                # SDPA as its callers run it: on its own layout (views made here, outside the timing) and with the
                # backend chosen once around the timed calls; sdpa_kernel's enter and exit cost several us a call.
                attn, inputs = sdpa_attention, [heads_first(t) for t in inputs]
                pin = functools.partial(sdpa_kernel, [SDPA_BACKENDS[name]])
            with pin():
                results, call = prepare_call(args.mode, attn, *inputs[:3], causal, inputs[3])
            if eager_sdpa:
                results = {key: t.transpose(1, 2) for key, t in results.items()}
            if not all(torch.isfinite(t).all() for t in results.values()):
                raise RuntimeError("non-finite output")
            if check is not None:
                errors = check(results)
                # The forward's key stays {name}_relerr, as before the backward modes; gradients add a suffix.
                row.update({f"{name}_relerr" + ("" if key == "out" else f"_{key}"): error
                            for key, error in errors.items()})
                if not all(error <= RELERR_LIMIT for error in errors.values()):
                    bad.add(name)
            del results
            runnable[name], pins[name] = call, pin
        except Exception as e:  # one failing provider must not stop the others
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    sample = (functools.partial(eager_samples_ms, warmup=args.warmup, iters=args.iters) if args.eager else
              functools.partial(time_samples_ms, warmup=args.warmup, iters=args.iters, warmup_ms=args.warmup_ms))
    for name, samples in sample_providers(runnable, sample, args.rounds, rng, pins).items():
        ms = statistics.median(samples)
        row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
        row[f"{name}_ms"] = ms
        if args.eager:  # one sample a round: keep them all
            row[f"{name}_us"], row[f"{name}_us_rounds"] = ms * 1e3, [x * 1e3 for x in samples]
    if args.kernels:
        for name, call in runnable.items():
            with pins[name]():
                row[f"{name}_kernels_us"] = kernel_times_us(call)
    # Over the same FLOPs, the throughput ratio is the inverse time ratio: > 1 means ours is faster in both modes.
    for num, den, key in ratios:
        mine, theirs = row[f"{num}_ms"], row[f"{den}_ms"]
        row[key] = theirs / mine if mine and theirs else None
    return bad


def result_cells(row, names, bad, ratios, eager):
    """A row's table cells after its shape: each provider's TFLOPS (with --eager its us per call), '!' where its
    check failed, then the ratios."""
    unit = "us" if eager else "tflops"
    cells = [fmt(row.get(f"{n}_{unit}"), ".1f") + ("!" if n in bad else "") for n in names]
    return cells + [fmt(row[key], ".3f") for _, _, key in ratios]


def kernel_times_us(fn, calls=5):
    """Device time per call of each kernel (and memset or copy) that `fn` runs, in us, longest first: torch.profiler
    over `calls` calls after one warm-up."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total = getattr(event, "self_device_time_total", None)
        total = event.self_cuda_time_total if total is None else total
        if total > 0:
            times[event.key] = total / calls
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def print_kernels(row, names, top=4):
    """--kernels: one line per provider under its row, its kernels' us per call, names cut to their first 60
    characters (without template arguments' tails)."""
    for name in names:
        times = row.get(f"{name}_kernels_us")
        if times:
            parts = [f"{us:.1f} {key.removeprefix('void ').split('(')[0].strip()[:60]}" for key, us in
                     itertools.islice(times.items(), top)]
            print(f"    {name}: {sum(times.values()):.1f} us: " + "; ".join(parts), flush=True)


def run_batched(args, dtype, backward, flops_factor):
    """The batched sweep (the default): returns (rows, provider names, ratio columns)."""
    providers = {}
    for name in ["ours"] + (["ours_det"] if backward else []) + args.peers:
        try:
            providers[name] = make_provider(name, args.tier)
        except Exception as e:  # a peer that is not installed is simply absent
            if name.startswith("ours"):
                raise
            print(f"{name}: n/a ({type(e).__name__}: {e})")
    names = list(providers)

    # (numerator, denominator, column): ours over each strong peer; in the backward modes also the deterministic
    # backward over the default one, the price of determinism.
    ratios = [("ours", peer, f"ours/{label}") for peer, label in RATIO_PEERS if peer in providers]
    if "ours_det" in providers:
        ratios.append(("ours_det", "ours", "det/ours"))
    columns = ["b", "sq", "sk", "h", "hk", "d", "causal"] + names + [key for _, _, key in ratios]
    widths = [4, 6, 6, 4, 4, 4, 6] + [max(10, len(n)) for n in names] + [10] * len(ratios)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))

    rows = []
    rng = random.Random(0)
    for b, sq, sk, h, hk, d, causal in build_configs(args):
        q, k, v = (torch.randn(b, s, n, d, dtype=dtype, device="cuda", requires_grad=backward)
                   for s, n in ((sq, h), (sk, hk), (sk, hk)))
        dout = torch.randn_like(q) if backward else None
        flops = flops_factor * 4 * b * h * sq * sk * d / (2 if causal else 1)
        ref = None if args.no_check else reference_subset(q, k, v, causal, dout)
        row = dict(b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, causal=causal, dtype=args.dtype, mode=args.mode)
        attns = {name: (lambda attn=attn: attn) for name, attn in providers.items()}
        check = None if ref is None else functools.partial(relative_errors, ref=ref)
        bad = measure_row(row, attns, names, args, q, k, v, causal, dout, check, flops, ratios, rng)
        rows.append(row)

        cells = [str(b), str(sq), str(sk), str(h), str(hk), str(d), "yes" if causal else "no"]
        cells += result_cells(row, names, bad, ratios, args.eager)
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)), flush=True)
        print_kernels(row, names)
    return rows, names, ratios


# The inference issue's decode shapes (b, sq, sk, h, hk, d).
DECODE_SHAPES = ((1, 1, 8192, 32, 8, 128), (8, 1, 4096, 32, 8, 128), (32, 1, 8192, 32, 8, 128),
                 (64, 1, 2048, 64, 8, 128), (8, 4, 16384, 32, 8, 128), (16, 1, 32768, 8, 1, 128),
                 (8, 1, 4096, 16, 16, 64), (4, 1, 8192, 16, 2, 256))
DECODE_PEERS = ("sdpa_flash", "sdpa_cudnn", "fa4")


def graph_samples_ms(fn, warmup, iters, warmup_ms):
    """One sample: `fn` captured once in a CUDA graph, sustain(replay, 10, warmup_ms), then the time per replay of
    `iters` back-to-back replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    sustain(graph.replay, 10, warmup_ms)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / iters]


def decode_calls(name, q, k, v, page_size):
    """Provider `name`'s decode call on q (b, sq, h, d) against the full cache k, v (b, sk, hk, d), as a closure; ours
    through flash_attn_with_kvcache (paged when page_size), the peers on the same tensors."""
    b, sk = k.shape[:2]
    if name == "ours":
        seqlens = torch.full((b,), sk, dtype=torch.int32, device=q.device)
        if not page_size:
            return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)
        pages = sk // page_size
        order = torch.randperm(b * pages, device=q.device)
        table = order.view(b, pages).to(torch.int32)
        k_pool, v_pool = (torch.empty(b * pages, page_size, *t.shape[2:], dtype=t.dtype, device=t.device)
                          for t in (k, v))
        k_pool[order], v_pool[order] = k.reshape(-1, page_size, *k.shape[2:]), v.reshape(-1, page_size, *v.shape[2:])
        return lambda: flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table,
                                               causal=True)
    if name in SDPA_BACKENDS:
        qh, kh, vh = (heads_first(t) for t in (q, k, v))
        return lambda: sdpa_attention(qh, kh, vh, True).transpose(1, 2)
    if name == "fa4":
        from flash_attn.cute import flash_attn_func as fa4_func

        return lambda: fa4_func(q, k, v, causal=True)[0]
    raise ValueError(f"unknown decode provider {name!r}")


def run_decode(args, dtype):
    """The decode sweep: returns (rows, provider names, ratio columns)."""
    names = ["ours"] + [p for p in args.peers if p in DECODE_PEERS]
    ratios = [("ours", "best", "ours/best")]
    columns = ["b", "sq", "sk", "h", "hk", "d"] + [f"{n} us" for n in names] + ["ours TB/s", "best TB/s", "ours/best"]
    widths = [4, 4, 6, 4, 4, 4] + [max(10, len(n) + 3) for n in names] + [10, 10, 10]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    rows, rng = [], random.Random(0)
    sample = (functools.partial(eager_samples_ms, warmup=args.warmup, iters=args.iters) if args.eager else
              functools.partial(graph_samples_ms, warmup=args.warmup, iters=args.iters, warmup_ms=args.warmup_ms))
    for b, sq, sk, h, hk, d in args.shape:
        q = torch.randn(b, sq, h, d, dtype=dtype, device="cuda")
        k, v = (torch.randn(b, sk, hk, d, dtype=dtype, device="cuda") for _ in range(2))
        kv_bytes = 2 * b * sk * hk * d * k.element_size()
        row = dict(b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, dtype=args.dtype, page_size=args.page_size,
                   kv_bytes=kv_bytes)
        calls, pins, bad = {}, {}, set()
        expected = None
        for name in names:
            try:
                call = decode_calls(name, q, k, v, args.page_size)
                pin = (functools.partial(sdpa_kernel, [SDPA_BACKENDS[name]]) if name in SDPA_BACKENDS
                       else contextlib.nullcontext)
                with pin():
                    out = call().float()
                if not torch.isfinite(out).all():
                    raise RuntimeError("non-finite output")
                if expected is None:
                    expected = out  # ours, the first: the peers are checked against it
                else:
                    error = ((out - expected).norm() / expected.norm()).item()
                    row[f"{name}_relerr"] = error
                    if error > RELERR_LIMIT:
                        bad.add(name)
                calls[name], pins[name] = call, pin
            except Exception as e:  # one failing provider must not stop the others
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for name, samples in sample_providers(calls, sample, args.rounds, rng, pins).items():
            row[f"{name}_us"] = statistics.median(samples) * 1e3
            row[f"{name}_us_rounds"] = [x * 1e3 for x in samples]
        if args.kernels:  # eager calls: the graph time above adds about 1-1.5 us of node launch to each provider
            for name, call in calls.items():
                with pins[name]():
                    row[f"{name}_kernels_us"] = kernel_times_us(call)
        peers = [row[f"{n}_us"] for n in names[1:] if row.get(f"{n}_us") and n not in bad]
        row["best_us"] = min(peers) if peers else None
        ours = row.get("ours_us")
        row["ours/best"] = row["best_us"] / ours if ours and row["best_us"] else None
        for who in ("ours", "best"):
            t = row.get(f"{who}_us")
            row[f"{who}_tbps"] = kv_bytes / (t * 1e-6) / 1e12 if t else None
        rows.append(row)
        cells = [str(x) for x in (b, sq, sk, h, hk, d)]
        cells += [fmt(row.get(f"{n}_us"), ".1f") + ("!" if n in bad else "") for n in names]
        cells += [fmt(row["ours_tbps"], ".2f"), fmt(row["best_tbps"], ".2f"), fmt(row["ours/best"], ".3f")]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)), flush=True)
        if args.kernels:
            print_kernels(row, names)
    return rows, names, ratios


def summarize(rows, ratios):
    """Geomean and minimum of each ratio column over the rows."""
    summary = {}
    for num, den, key in ratios:
        values = [r[key] for r in rows if r.get(key) is not None]
        summary[f"geomean_{num}_over_{den}"] = geomean(values)
        summary[f"min_{num}_over_{den}"] = min(values) if values else None
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=tuple(MODES), default="fwd",
                        help="time the forward, the backward, or forward + backward")
    parser.add_argument("--eager", action="store_true", help="time the eager time per call (us) instead of "
                        f"throughput; default shapes {' '.join(','.join(map(str, s)) for s in EAGER_SHAPES)}")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--hdims", type=parse_ints, default=None,
                        help="head dims of the default sweep (64,128,256; with --varlen 64,128)")
    parser.add_argument("--seqlens", type=parse_ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="b * seqlen in the default sweep, the total "
                        "length of the packed sequences with --varlen")
    parser.add_argument("--model-dim", type=int, default=2048, help="nheads * head_dim in the default sweep")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--shape", type=parse_shape, action="append", help="b,sq,sk,h,hk,d; repeatable; "
                        "replaces the default sweep")
    parser.add_argument("--varlen", type=parse_mixes, nargs="?", const="all", metavar="MIXES",
                        help=f"time variable-length batches instead: comma-separated mixes of "
                        f"{','.join(VARLEN_MIXES)} (all when no value is given)")
    parser.add_argument("--decode", action="store_true", help="time decode steps against a KV cache (see above)")
    parser.add_argument("--page-size", type=int, default=0, help="with --decode: read ours' cache through "
                        "block_table in pages of this many rows (0: a contiguous cache)")
    parser.add_argument("--peers", type=parse_peers, default=None,
                        help=f"comma-separated subset of {','.join(EAGER_PEERS)} (default: all but sdpa_math; "
                        "with --eager all; \"\": none)")
    parser.add_argument("--tier", default=None, help="force a tier of ours, e.g. sm80")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--warmup-ms", type=float, default=200.0,
                        help="after --warmup calls (--decode: graph replays), back-to-back calls for this many ms more "
                        "before the timed ones, so that each provider is timed at the GPU's sustained clocks (0: "
                        "none; --eager has none)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed calls per provider and round (default 30; with --eager 500)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per shape, providers in random order (default 5; with --eager 10)")
    parser.add_argument("--no-check", action="store_true", help="skip the fp32 accuracy check")
    parser.add_argument("--kernels", action="store_true", help="also each provider's kernels' device time per call "
                        "(torch.profiler), printed under each row and kept in the JSON")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--png", metavar="PATH")
    args = parser.parse_args()
    if args.varlen and args.shape:
        parser.error("--shape is for the batched sweep; --varlen takes its lengths from the mixes")
    if args.varlen and args.eager:
        parser.error("--eager times batched shapes (--shape), not --varlen")
    if args.decode and args.varlen:
        parser.error("--decode and --varlen are separate sweeps")
    if args.kernels and args.eager:
        parser.error("--kernels breaks down the timed sweeps (batched, --varlen or --decode), not --eager")
    if args.decode:
        args.shape = args.shape or list(DECODE_SHAPES)
        bad = [s for s in args.shape if args.page_size and s[2] % args.page_size]
        if bad:
            parser.error(f"--page-size {args.page_size} must divide every shape's sk, not those of {bad}")
    if args.peers is None:
        args.peers = list(EAGER_PEERS if args.eager else PEERS)
    args.iters = args.iters or (500 if args.eager else 100 if args.decode else 30)
    args.rounds = args.rounds or (10 if args.eager else 5)
    if args.eager:
        args.shape = args.shape or list(EAGER_SHAPES)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    what, flops_factor = MODES[args.mode]
    backward = args.mode != "fwd"

    gpu = torch.cuda.get_device_name()
    machine_before = machine_state()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine_before.items()))
    print(f"{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, {args.dtype}, {what}"
          + (f", varlen {args.tokens} tokens" if args.varlen else "")
          + (f", decode (causal{f', pages of {args.page_size}' if args.page_size else ''})" if args.decode else "")
          + f", {args.rounds} rounds of warm-up {args.warmup}"
          + ("" if args.eager else f" + {args.warmup_ms:g} ms") + f" + {args.iters} timed calls, median")
    if args.eager:
        print("eager time per call in us (wall time of the timed calls between two synchronizes / calls); "
              "ours/peer = peer time / ours time, > 1: ours is faster")
    if args.decode:
        rows, names, ratios = run_decode(args, dtype)
    elif args.varlen:
        rows, names, ratios = run_varlen(args, dtype, backward, flops_factor)
    else:
        args.hdims = args.hdims or [64, 128, 256]
        rows, names, ratios = run_batched(args, dtype, backward, flops_factor)

    failures = sorted({k[: -len("_error")] for r in rows for k in r if k.endswith("_error")})
    for name in failures:
        first = next(r for r in rows if f"{name}_error" in r)
        print(f"{name} failed on some shapes, e.g. {first[f'{name}_error']}")
    if args.decode:
        print(f"'!' marks a peer whose output differs from ours by more than {RELERR_LIMIT} (relative norm)")
    elif not args.no_check:
        checked = "output, dq, and dk and dv where checkable" if backward else "output"
        if args.varlen:
            checked += ", of the longest, the shortest and the last sequence"
        print(f"'!' marks a result whose relative error against fp32 ({checked}) exceeds {RELERR_LIMIT}")

    summary = summarize(rows, ratios)
    print("   ".join(f"{stat} {num}/{den}: {fmt(summary[f'{stat}_{num}_over_{den}'], '.3f')}"
                     for num, den, _ in ratios for stat in ("geomean", "min")))
    if args.varlen:  # and per mix
        summary["per_mix"] = {}
        for mix in args.varlen:
            per_mix = summarize([r for r in rows if r["mix"] == mix], ratios)
            summary["per_mix"][mix] = per_mix
            print(f"  {mix}: " + "   ".join(
                f"geomean {num}/{den}: {fmt(per_mix[f'geomean_{num}_over_{den}'], '.3f')}" for num, den, _ in ratios
                if per_mix[f"geomean_{num}_over_{den}"] is not None))

    if args.json:
        meta = dict(gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda, dtype=args.dtype, mode=args.mode,
                    eager=args.eager, tier=args.tier, warmup=args.warmup, warmup_ms=args.warmup_ms, iters=args.iters,
                    rounds=args.rounds,
                    command=" ".join(sys.argv), machine_before=machine_before, machine_after=machine_state(),
                    date=datetime.datetime.now().isoformat(timespec="seconds"))
        if args.decode:
            meta.update(decode=True, page_size=args.page_size, timing="CUDA graph replays" if not args.eager
                        else "eager")
        if args.varlen:
            meta.update(varlen=args.varlen, tokens=args.tokens,
                        flops="4 * h * d * sum over sequences of the visible (query, key) pairs, x mode factor")
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, summary=summary, rows=rows), f, indent=1)
        print(f"results written to {args.json}")
    if args.png:
        if args.varlen or args.eager or args.decode:
            print("--png draws the batched throughput sweep only; no plot for --varlen, --eager or --decode")
        else:
            plot(rows, names, args.png, what)


if __name__ == "__main__":
    main()
