"""One small forward + backward call per head dim, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool racecheck --kernel-name kns=bwd_kernel python3 benchmark/small_case.py 64 128
    compute-sanitizer --tool memcheck python3 benchmark/small_case.py --varlen 64 128
    compute-sanitizer --tool memcheck python3 benchmark/small_case.py --varlen --malformed 64
    compute-sanitizer --tool racecheck --kernel-name kns=fwd_kernel python3 benchmark/small_case.py --fwd 64 128 256
    compute-sanitizer --tool racecheck --kernel-name kns=fwd_kernel python3 benchmark/small_case.py --decode 64 128

Sizes are small (the tools slow kernels down by orders of magnitude) but cover a partial query tile, a partial key
block, GQA, a causal mask, the deterministic dQ order, (unmasked) the SM90 backward's tiles split into parts and its
persistent CTAs (head dim 64) taking several tiles, and the SM90 forward's persistent CTAs taking several tiles, in a
fixed stride (unmasked) or from the tile counter (causal and windowed; racecheck reports its hand-over of the next
index, benign: benchmark/racecheck/handover.cu).

--varlen runs flash_attn_varlen_func instead, on packed sequences that cover empty ones (no query, no key, neither),
single rows, partial tiles, sq > sk and sq < sk, with and without seqused_q/seqused_k (and rows after the last
sequence), causal and windowed, the lse in the loss, default and deterministic backward. --malformed adds calls whose
cu_seqlens/seqused are out of range (past the end, decreasing, negative): the kernels must clamp them to the tensors'
rows, so memcheck must stay clean (the numbers are unspecified).

--decode runs flash_attn_with_kvcache's calls instead (the SM80-tier decode kernels and the combine; on Hopper the
SM90 forward's split partials for 130 rows of a contiguous cache or pages of 16, 64 and 128): one and three query rows
GQA-packed, and 130 rows, under a causal mask or a window, unsplit, in 2 and 3 chunks (on Hopper merged inside a
cluster; unsplit and in 2, the contiguous cache's 16-row tiles take the ring kernel) and in 17 (merged by the combine
kernel), a contiguous cache and caches paged in pages of 16, 3, 64 and 128 (shuffled), an empty, a partial and a
full sequence, new keys appended; and with more query tiles than SMs, pages of 16 and 64, causal or not, and pages of
16 gathered first (the gather kernel, which pages of 3 take at 130 rows on Hopper too)."""

import argparse

import torch

from flash_attention import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, kvcache

BF16 = torch.bfloat16


def batched_case(d, backward):
    for deterministic in (False, True):
        q = torch.randn(1, 77, 4, d, dtype=BF16, device="cuda", requires_grad=True)
        k, v = (torch.randn(1, 150, 2, d, dtype=BF16, device="cuda", requires_grad=True) for _ in range(2))
        out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        if backward:
            out.backward(torch.randn_like(out))
    if backward:
        # Unmasked, 4 key tiles of 6 steps each: the SM90 backward splits them into parts that sum dK and dV.
        q = torch.randn(1, 300, 4, d, dtype=BF16, device="cuda", requires_grad=True)
        k, v = (torch.randn(1, 150, 2, d, dtype=BF16, device="cuda", requires_grad=True) for _ in range(2))
        out = flash_attn_func(q, k, v)
        out.backward(torch.randn_like(out))
        # More key tiles (70 x 2) than an H100/H200 has SMs, one step each: the SM90 backward's persistent CTAs
        # (head dim 64) take more than one, in both K/V buffers.
        for causal in (False, True):
            q = torch.randn(1, 64, 4, d, dtype=BF16, device="cuda", requires_grad=True)
            k, v = (torch.randn(1, 128 * 70, 2, d, dtype=BF16, device="cuda", requires_grad=True) for _ in range(2))
            out = flash_attn_func(q, k, v, causal=causal)
            out.backward(torch.randn_like(out))
    # Unmasked, with more query tiles (35 x 4) than an H100/H200 has SMs: the SM90 tier's persistent CTAs each take
    # more than one tile.
    q = torch.randn(1, 128 * 34 + 5, 4, d, dtype=BF16, device="cuda")
    k, v = (torch.randn(1, 150, 2, d, dtype=BF16, device="cuda") for _ in range(2))
    flash_attn_func(q, k, v)
    # Causal and windowed, with more query tiles than SMs at every tile height (8 heads): the SM90 forward's
    # persistent CTAs take them from a tile counter (head dims 64-192), handing each next index to the consumers
    # through shared memory.
    q = torch.randn(1, 128 * 34 + 5, 8, d, dtype=BF16, device="cuda")
    k, v = (torch.randn(1, 128 * 34 + 5, 2, d, dtype=BF16, device="cuda") for _ in range(2))
    flash_attn_func(q, k, v, causal=True)
    flash_attn_func(q, k, v, window_size=(300, 40))


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def varlen_call(d, cu_q, cu_k, total_q, total_k, deterministic, backward=True, **kwargs):
    """One forward + backward (lse in the loss) of flash_attn_varlen_func on random packed q, k, v (GQA 4:2)."""
    q = torch.randn(total_q, 4, d, dtype=BF16, device="cuda", requires_grad=True)
    k, v = (torch.randn(total_k, 2, d, dtype=BF16, device="cuda", requires_grad=True) for _ in range(2))
    out, lse, _ = flash_attn_varlen_func(q, k, v, int32(cu_q), int32(cu_k), 130, 200, deterministic=deterministic,
                                         return_attn_probs=True, **kwargs)
    if backward:
        dlse = torch.randn_like(lse).masked_fill(torch.isinf(lse), 0.0)  # rows that see no key: lse -inf, unweighted
        torch.autograd.backward((out, lse), (torch.randn_like(out), dlse))


def varlen_case(d, malformed, backward):
    seqlens_q = [0, 1, 77, 130, 5, 0]
    seqlens_k = [3, 0, 150, 64, 200, 0]
    cu_q, cu_k = [0], [0]
    for n, m in zip(seqlens_q, seqlens_k):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + m)
    total_q, total_k = cu_q[-1], cu_k[-1]
    masks = (dict(), dict(causal=True), dict(window_size=(40, 7)))
    for deterministic in (False, True):
        for mask in masks:
            varlen_call(d, cu_q, cu_k, total_q, total_k, deterministic, backward, **mask)
            # seqused: part of each sequence's rows, and 9 rows after the last sequence that belong to none.
            varlen_call(d, cu_q, cu_k, total_q + 9, total_k + 9, deterministic, backward,
                        seqused_q=int32([0, 1, 50, 129, 5, 0]), seqused_k=int32([2, 0, 150, 1, 120, 0]), **mask)
    if malformed:
        bad = (
            ([0, 50, 1 << 20], [0, 60, 1 << 30], {}),  # past the end of q / k
            ([0, 150, 40], [0, 190, 10], {}),  # decreasing
            ([-30, 50, 200], [0, -60, 200], {}),  # negative
            ([0, 100, 200], [0, 100, 200], dict(seqused_q=int32([1 << 20, 7]), seqused_k=int32([1 << 30, -5]))),
        )
        for bad_q, bad_k, used in bad:
            for deterministic in (False, True):
                varlen_call(d, bad_q, bad_k, 200, 200, deterministic, backward, causal=True, **used)


def decode_case(d):
    b, cache_len, h, hk = 3, 384, 8, 2
    k_cache, v_cache = (torch.randn(b, cache_len, hk, d, dtype=BF16, device="cuda") for _ in range(2))
    seqlens = int32([0, 77, cache_len - 2])
    # 3 and 20 rows: GQA-packed by the kernel into one 16-row and two 64-row tiles; 130 rows: prefill-shaped (on Hopper
    # the SM90 forward's split partials).
    for sq in (1, 3, 20, 130):
        q = torch.randn(b, sq, h, d, dtype=BF16, device="cuda")
        for num_splits in (1, 2, 3, 17):
            for window in ((-1, -1), (20, 0)):
                flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, window_size=window,
                                        num_splits=num_splits)
            for page in (16, 3, 64, 128):  # on Hopper 130 rows take the SM90 forward's rows (16) or TMA (64, 128)
                pages = cache_len // page
                order = torch.randperm(b * pages, device="cuda")
                k_pool, v_pool = (torch.empty(b * pages, page, hk, d, dtype=BF16, device="cuda") for _ in range(2))
                k_pool[order], v_pool[order] = (c.reshape(b * pages, page, hk, d) for c in (k_cache, v_cache))
                table = order.view(b, pages).int()
                flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table, causal=True,
                                        num_splits=num_splits)
    # More query tiles than SMs: persistent CTAs take several, so one tile's output stores meet the next tile's loads;
    # causal ones from the tile counter (on Hopper at head dims 64 and 128, pages of 64).
    q = torch.randn(b, 130, 96, d, dtype=BF16, device="cuda")
    def table_of(page):
        return torch.arange(b * (cache_len // page), device="cuda", dtype=torch.int32).view(b, -1)
    for page in (16, 64):
        for causal in (False, True):
            flash_attn_with_kvcache(q, k_cache.view(-1, page, hk, d), v_cache.view(-1, page, hk, d),
                                    cache_seqlens=seqlens, block_table=table_of(page), causal=causal, num_splits=1)
    # Pages of 16 gathered first by the gather kernel, as where that pays (forced here; pages of 3 above always are).
    reuse, kvcache._GATHER_MIN_REUSE = kvcache._GATHER_MIN_REUSE, 0
    flash_attn_with_kvcache(q, k_cache.view(-1, 16, hk, d), v_cache.view(-1, 16, hk, d), cache_seqlens=seqlens,
                            block_table=table_of(16), causal=True, num_splits=1)
    kvcache._GATHER_MIN_REUSE = reuse
    k_new, v_new = (torch.randn(b, 2, hk, d, dtype=BF16, device="cuda") for _ in range(2))
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head_dims", type=int, nargs="*", default=[64])
    parser.add_argument("--varlen", action="store_true", help="run the varlen case instead of the batched one")
    parser.add_argument("--malformed", action="store_true", help="with --varlen: add out-of-range cu_seqlens calls")
    parser.add_argument("--fwd", action="store_true", help="forward only (a build of the forward kernels only)")
    parser.add_argument("--decode", action="store_true", help="run the kvcache (decode) case instead")
    args = parser.parse_args()
    if args.malformed and not args.varlen:
        parser.error("--malformed goes with --varlen")
    if args.decode and args.varlen:
        parser.error("--decode and --varlen are separate cases")
    for d in args.head_dims:
        if args.decode:
            decode_case(d)
        elif args.varlen:
            varlen_case(d, args.malformed, not args.fwd)
        else:
            batched_case(d, not args.fwd)
    torch.cuda.synchronize()
    if args.decode:
        print("done decode", args.head_dims)
    elif args.varlen:
        print("done varlen" + (" + malformed" if args.malformed else ""), args.head_dims)
    else:
        print("done", args.head_dims)


if __name__ == "__main__":
    main()
