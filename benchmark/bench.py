"""Forward attention throughput of flash_attention beside the peers importable on this machine.

TFLOPS from 4 * b * h * sq * sk * d FLOPs (halved when causal), timed with CUDA events: per shape, rounds of warm-up
and timed runs with the providers in random order, then the median of all timed runs. Peers: PyTorch SDPA under its
FLASH_ATTENTION (FlashAttention-2), CUDNN_ATTENTION and EFFICIENT_ATTENTION backends, flash-attn 2 (`flash_attn`)
and FlashAttention-4 (`flash_attn.cute`) when installed.
A peer that is missing or fails on a shape shows as n/a.

    python benchmark/bench.py                         # 16k tokens, model dim 2048, head dims 64/128/256
    python benchmark/bench.py --tier sm80 --json out.json --png out.png
    python benchmark/bench.py --shape 1,4096,4096,32,8,128 --causal yes
"""

import argparse
import datetime
import functools
import itertools
import json
import math
import random
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from flash_attention import flash_attn_func

PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_eff", "fa2", "fa4")
# Peers that get an ours/peer column and summary: (provider, column label).
RATIO_PEERS = (("sdpa_flash", "flash"), ("sdpa_cudnn", "cudnn"), ("fa4", "fa4"))
SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_eff": SDPBackend.EFFICIENT_ATTENTION,
}
RELERR_LIMIT = 2e-2  # far above bf16 rounding (~2e-3 relative); a result beyond it is wrong, not imprecise


def sdpa_provider(backend):
    def run(q, k, v, causal):
        sq, sk = q.shape[1], k.shape[1]
        # SDPA's is_causal is aligned top-left; the package (and flash-attn) align bottom-right.
        mask = causal_lower_right(sq, sk) if causal and sq != sk else None
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                is_causal=causal and mask is None, enable_gqa=q.shape[2] != k.shape[2],
            )
        return out.transpose(1, 2)

    return run


def make_provider(name, tier):
    """A function (q, k, v, causal) -> out in (b, s, h, d); raises if the provider cannot be loaded."""
    if name == "ours":
        return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal, tier=tier)
    if name in SDPA_BACKENDS:
        return sdpa_provider(SDPA_BACKENDS[name])
    if name == "fa2":
        from flash_attn import flash_attn_func as fa2_func

        return lambda q, k, v, causal: fa2_func(q, k, v, causal=causal)
    if name == "fa4":
        from flash_attn.cute import flash_attn_func as fa4_func

        return lambda q, k, v, causal: fa4_func(q, k, v, causal=causal)[0]  # FA4 returns (out, lse)
    raise ValueError(f"unknown provider {name!r}; known: ours, {', '.join(PEERS)}")


def time_samples_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def time_providers_ms(fns, warmup, iters, rounds, rng):
    """Median time of each provider over `rounds` rounds of warm-up + iters calls, in a fresh random order every
    round. The clock and power state that one provider leaves behind (FA4 and cuDNN heat the GPU most) then falls on
    a different provider each time; in a fixed or rotated order it always falls on the same successor."""
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name in rng.sample(list(fns), len(fns)):
            samples[name] += time_samples_ms(fns[name], warmup, iters)
    return {name: statistics.median(s) for name, s in samples.items()}


def reference_subset(q, k, v, causal):
    """fp32 attention for batch 0 and the query heads that share key/value head 0 (at most 2), bottom-right causal.
    Checking a slice keeps the reference cheap at 16k tokens while still covering every query and key."""
    sq, h, d = q.shape[1], q.shape[2], q.shape[3]
    sk, hk = k.shape[1], k.shape[2]
    heads = min(2, h // hk)
    kk, vv = k[0, :, 0].float(), v[0, :, 0].float()
    outs = []
    for head in range(heads):
        scores = (q[0, :, head].float() @ kk.T) * d ** -0.5
        if causal:
            visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            scores.masked_fill_(~visible, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1).nan_to_num_(0.0) @ vv)
        del scores
    return torch.stack(outs, dim=1), heads  # (sq, heads, d)


def relative_error(out, ref, heads):
    got = out[0, :, :heads].float()
    return ((got - ref).norm() / ref.norm()).item()


def parse_shape(text):
    try:
        b, sq, sk, h, hk, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants b,sq,sk,h,hk,d (six ints), got {text!r}")
    return b, sq, sk, h, hk, d


def parse_ints(text):
    return [int(x) for x in text.split(",") if x]


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


def plot(rows, providers, path):
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
        ax.set_ylabel("TFLOPS (fwd)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--hdims", type=parse_ints, default=[64, 128, 256], help="head dims of the default sweep")
    parser.add_argument("--seqlens", type=parse_ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="b * seqlen in the default sweep")
    parser.add_argument("--model-dim", type=int, default=2048, help="nheads * head_dim in the default sweep")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--shape", type=parse_shape, action="append", help="b,sq,sk,h,hk,d; repeatable; "
                        "replaces the default sweep")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--tier", default=None, help="force a tier of ours, e.g. sm80")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30, help="timed calls per provider and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per shape, providers in random order")
    parser.add_argument("--no-check", action="store_true", help="skip the fp32 accuracy check")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--png", metavar="PATH")
    args = parser.parse_args()

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    providers = {}
    for name in ["ours"] + [p for p in args.peers.split(",") if p]:
        try:
            providers[name] = make_provider(name, args.tier)
        except Exception as e:  # a peer that is not installed is simply absent
            if name == "ours":
                raise
            print(f"{name}: n/a ({type(e).__name__}: {e})")
    names = list(providers)

    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, {args.dtype}, "
          f"{args.rounds} rounds of warm-up {args.warmup} + {args.iters} timed calls, median")
    ratios = [(peer, f"ours/{label}") for peer, label in RATIO_PEERS if peer in providers]
    columns = ["b", "sq", "sk", "h", "hk", "d", "causal"] + names + [key for _, key in ratios]
    widths = [4, 6, 6, 4, 4, 4, 6] + [max(10, len(n)) for n in names] + [10] * len(ratios)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))

    rows = []
    rng = random.Random(0)
    for b, sq, sk, h, hk, d, causal in build_configs(args):
        q = torch.randn(b, sq, h, d, dtype=dtype, device="cuda")
        k = torch.randn(b, sk, hk, d, dtype=dtype, device="cuda")
        v = torch.randn(b, sk, hk, d, dtype=dtype, device="cuda")
        flops = 4 * b * h * sq * sk * d / (2 if causal else 1)
        ref, ref_heads = (None, 0) if args.no_check else reference_subset(q, k, v, causal)
        row = dict(b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, causal=causal, dtype=args.dtype)
        bad = set()
        runnable = {}
        for name, fn in providers.items():
            row[f"{name}_tflops"] = None
            try:  # the first call also compiles the JIT peers, outside the timing
                out = fn(q, k, v, causal)
                if not torch.isfinite(out).all():
                    raise RuntimeError("non-finite output")
                if ref is not None:
                    row[f"{name}_relerr"] = relative_error(out, ref, ref_heads)
                    if not row[f"{name}_relerr"] <= RELERR_LIMIT:
                        bad.add(name)
                del out
                runnable[name] = functools.partial(fn, q, k, v, causal)
            except Exception as e:  # one failing provider must not stop the others
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for name, ms in time_providers_ms(runnable, args.warmup, args.iters, args.rounds, rng).items():
            row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
        for peer, key in ratios:
            ours, theirs = row["ours_tflops"], row.get(f"{peer}_tflops")
            row[key] = ours / theirs if ours and theirs else None
        rows.append(row)

        cells = [str(b), str(sq), str(sk), str(h), str(hk), str(d), "yes" if causal else "no"]
        cells += [fmt(row[f"{n}_tflops"], ".1f") + ("!" if n in bad else "") for n in names]
        cells += [fmt(row[key], ".3f") for _, key in ratios]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)), flush=True)

    failures = sorted({k[: -len("_error")] for r in rows for k in r if k.endswith("_error")})
    for name in failures:
        first = next(r for r in rows if f"{name}_error" in r)
        print(f"{name} failed on some shapes, e.g. {first[f'{name}_error']}")
    if not args.no_check:
        print(f"'!' marks a result whose relative error against fp32 exceeds {RELERR_LIMIT}")

    summary = {}
    for peer, key in ratios:
        values = [r[key] for r in rows if r[key] is not None]
        summary[f"geomean_ours_over_{peer}"] = geomean(values)
        summary[f"min_ours_over_{peer}"] = min(values) if values else None
    print("   ".join(f"{stat} ours/{peer}: {fmt(summary[f'{stat}_ours_over_{peer}'], '.3f')}"
                     for peer, _ in ratios for stat in ("geomean", "min")))

    if args.json:
        meta = dict(gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda, dtype=args.dtype, tier=args.tier,
                    warmup=args.warmup, iters=args.iters, command=" ".join(sys.argv),
                    date=datetime.datetime.now().isoformat(timespec="seconds"))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, summary=summary, rows=rows), f, indent=1)
        print(f"results written to {args.json}")
    if args.png:
        plot(rows, names, args.png)


if __name__ == "__main__":
    main()
