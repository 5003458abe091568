"""The custom ops `flash_attention::fwd` and `flash_attention::bwd`, wired together for autograd, and `attention`, the
one entry the public functions call.

One op per direction serves batched and variable-length calls alike: the sequence tensors (cu_seqlens_q/k,
seqused_q/k) are optional, and with cu_seqlens the operands are packed (total, heads, d) and lse is (h, total_q).
The ops are what torch.compile traces and what `opcheck` checks. An eager call does not need the dispatcher's
machinery around a Python op (its overhead is several times the rest of the host path on a decode step), so
`attention` skips it when nothing traces or intercepts the call: a call that needs no gradient runs the kernel
directly, and one that does gets the binding's C++ autograd node (`_differentiable`), whose backward runs no Python.
The most common batched calls skip the layers above too (interface._common_forward, with the routes found here).
"""

import functools
from typing import NamedTuple, Optional, Tuple

import torch

from . import _catalog, _dispatch


def _lse_shape(q: torch.Tensor):
    """(b, h, sq) batched; (h, total_q) packed."""
    if q.dim() == 4:
        b, sq, h, _ = q.shape
        return (b, h, sq)
    total_q, h, _ = q.shape
    return (h, total_q)


def nothing_to_compute(q, k, cu_seqlens_q) -> bool:
    """No query, key or sequence: every row is fully masked, and no kernel runs."""
    return q.numel() == 0 or k.numel() == 0 or (cu_seqlens_q is not None and cu_seqlens_q.shape[0] <= 1)


def forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
    """(out, lse) of the forward kernel on validated operands whose head dim is a multiple of 8; the binding copies
    operands whose strides or alignment the kernels cannot load, and allocates the outputs. With nothing to compute,
    out is 0 and lse -inf, and no kernel runs."""
    if nothing_to_compute(q, k, cu_seqlens_q):
        return q.new_zeros(q.shape), q.new_full(_lse_shape(q), float("-inf"), dtype=torch.float32)
    ext = _dispatch.load_extension()
    tier_id, kernel_dim = _dispatch.resolve(q.device, "fwd", q.shape[-1], q.dtype, tier)
    return ext.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, window_left, window_right, softcap, alibi_slopes, kernel_dim, tier_id)


def backward_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                  max_seqlen_k, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
    """(dq, dk, dv) of the backward kernel; zero with nothing to compute."""
    if nothing_to_compute(q, k, cu_seqlens_q):
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    ext = _dispatch.load_extension()
    tier_id, kernel_dim = _dispatch.resolve(q.device, "bwd", q.shape[-1], q.dtype, tier)
    return ext.bwd(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                   max_seqlen_k, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic,
                   kernel_dim, tier_id)


def _outputs_like(*tensors):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


@torch.library.custom_op("flash_attention::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    tier: Optional[str],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward attention on validated inputs whose head dim is a multiple of 8: q (b, sq, h, d), k/v (b, sk, hk, d),
    or, with cu_seqlens_q/k, the sequences packed in q (total_q, h, d) and k/v (total_k, hk, d): sequence i has query
    rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]) and key rows likewise from cu_seqlens_k, of which it uses the first
    seqused_q[i] / seqused_k[i] when given. Returns (out, lse (b, h, sq) or (h, total_q)); rows past seqused_q are
    fully masked (out 0, lse -inf). max_seqlen_q/k only guide the kernel's tile choice (0 = the tensors' rows).
    `deterministic` is for the backward: autograd hands it on to `bwd`."""
    return forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier)


@fwd.register_fake
def _fwd_fake(q, *args):
    return _outputs_like(q)[0], q.new_empty(_lse_shape(q), dtype=torch.float32)


@torch.library.custom_op("flash_attention::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    tier: Optional[str],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of fwd's (out, lse) given dout and, when the caller used lse, dlse; rows past
    seqused_q / seqused_k get zero gradients."""
    return backward_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                         deterministic, tier)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, *args):
    return _outputs_like(q, k, v)


def _save(ctx, q, k, v, args, out, lse):
    """Save what the backward needs: q, k, v, (out, lse) and the forward's other arguments, which it takes in the same
    order after dlse."""
    ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ctx.save_for_backward(q, k, v, out, lse, *(args[i] for i in ctx.tensor_positions))
    ctx.args = [None if i in ctx.tensor_positions else a for i, a in enumerate(args)]
    # An output the loss does not use then has gradient None, not zeros: an unused lse costs nothing.
    ctx.set_materialize_grads(False)


def _gradients(ctx, grad_out, grad_lse, bwd_fn):
    """Gradients for q, k, v, and None for the other arguments (sequence tensors, ALiBi slopes, scalars). The lse
    gradient, when the caller used lse, flows into dq and dk: d lse_i / d s_ij is P_ij, which the kernel folds into
    D."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    args = list(ctx.args)
    for i, t in zip(ctx.tensor_positions, tensors):
        args[i] = t
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = bwd_fn(grad_out, q, k, v, out, lse, grad_lse, *args)
    return (dq, dk, dv) + (None,) * len(args)


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    _save(ctx, q, k, v, args, *output)


fwd.register_autograd(lambda ctx, grad_out, grad_lse: _gradients(ctx, grad_out, grad_lse, bwd),
                      setup_context=_setup_context)


# The tier whose forward writes split-KV partials (and whose combine kernel merges them).
SPLIT_TIER = "sm80"


# (device index, head dim, dtype, forward tier) -> (tier id, kernel head dim) of fwd_split's forward kernel, then of
# its combine kernel, or None where the build lacks one.
_split_routes = {}


def _split_route(device: torch.device, head_dim: int, dtype: torch.dtype, fwd_tier: str):
    key = (_dispatch.device_index(device), head_dim, dtype, fwd_tier)
    route = _split_routes.get(key, False)
    if route is False:
        try:
            tier_id, kernel_dim = _dispatch.resolve(device, "fwd", head_dim, dtype, fwd_tier)
            route = (tier_id, kernel_dim) + _dispatch.resolve(device, "combine", head_dim, dtype, SPLIT_TIER)
        except RuntimeError:
            route = None
        _split_routes[key] = route
    return route


class DecodeRoute(NamedTuple):
    """What a decode-shaped call needs to run fwd_split on SPLIT_TIER's kernels, found once per key."""
    fwd_tier: int  # tier id and kernel head dim of the forward, whose combine kernel is the same tier's and dim's
    head_dim: int
    combine_tier: int
    sm_count: int  # of q's device, for split_count
    smem_per_block: int  # of q's device (opt-in bytes; 0 if torch does not say), for ring_kernel_fits
    lone_cta: bool = True  # whether q's device takes one 16-row decode CTA an SM (lone_decode_cta), for split_count


# (device index or -1, head dim, dtype, tier override) -> its DecodeRoute, or None where fwd_split cannot serve it: a
# decode step finds everything with one lookup.
_decode_routes = {}


def decode_route(q: torch.Tensor, tier: Optional[str]) -> Optional[DecodeRoute]:
    """fwd_split's kernels for q on SPLIT_TIER: None unless q is a CUDA tensor, no tier override other than SPLIT_TIER
    is in force, and the build holds that tier's forward and combine kernels for q's head dim and dtype (at the same
    kernel head dim)."""
    key = (q.get_device(), q.shape[-1], q.dtype, _dispatch.requested_tier(tier))
    route = _decode_routes.get(key, False)
    if route is False:
        route = _decode_routes[key] = _find_decode_route(*key)
    return route


@torch.compiler.assume_constant_result
def _find_decode_route(index: int, head_dim: int, dtype: torch.dtype,
                       override: Optional[str]) -> Optional[DecodeRoute]:
    """decode_route's answer for its key (index -1: not a CUDA tensor). torch.compile takes it as a constant: it
    cannot trace the extension's kernel list, and a step compiled before any eager call would fail otherwise."""
    if index < 0 or override not in (None, SPLIT_TIER):
        return None
    found = _split_route(torch.device("cuda", index), head_dim, dtype, SPLIT_TIER)
    if found is None or found[:2] != found[2:]:
        return None
    return DecodeRoute(*found[:3], _sm_count_of(index), _smem_per_block_of(index), _lone_decode_cta_of(index))


def split_tier_is_default(q: torch.Tensor, tier: Optional[str]) -> bool:
    """Whether q's forward runs on SPLIT_TIER anyway (no faster tier for this GPU, head dim and dtype)."""
    try:
        return _dispatch.resolve_tier(q.device, tier, q.shape[-1], q.dtype, "fwd") == SPLIT_TIER
    except RuntimeError:
        return False


def append_kernel_available(q: torch.Tensor) -> bool:
    """Whether the append kernel (the SM80 tier's, portable) is built for q's dtype and head dim."""
    try:
        _dispatch.resolve(q.device, "append", q.shape[-1], q.dtype, SPLIT_TIER)
    except RuntimeError:
        return False
    return True


def append_kv(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, block_table, interleaved,
              q_steps) -> torch.Tensor:
    """flash_attn_with_kvcache's append and rotary embedding in one kernel: k, v (rotated k) written into the caches in
    place, q rotated (returned; q itself without cos). Eager calls only: traced ones take kvcache.py's PyTorch ops."""
    ext = _dispatch.load_extension()
    tier_id, kernel_dim = _dispatch.resolve(q.device, "append", q.shape[-1], q.dtype, SPLIT_TIER)
    contiguous = [None if t is None else t.contiguous() for t in (cache_seqlens, cache_batch_idx, block_table)]
    return ext.append_kv(q, k_cache, v_cache, k, v, cos, sin, *contiguous, interleaved, q_steps, kernel_dim, tier_id)


def decode_ctas_per_sm(head_dim: int, rows: int, paged: bool = False, lone_cta: bool = True) -> int:
    """CTAs of the SM80 decode kernel an SM that split_count fills one wave with. The 16-row tile (rows <= 16): at
    head dim 64 or less three, as many as its registers allow (163 a thread, 128 threads); up to 128 one from a
    contiguous cache where the device takes lone CTAs (lone_decode_cta), which then keep a key block's K and V loads
    in flight together (FwdParams::single_cta_per_sm; H100, RESULTS.md: 16 x 32k MQA 2% faster than at two, no other
    row slower than 0.5%; pages of 16 were 3-5% slower so); else two. The other tiles two (over 200 registers; ptxas,
    sm_90)."""
    if rows <= 16 and head_dim <= 64:
        return 3
    return 1 if rows <= 16 and head_dim <= 128 and not paged and lone_cta else 2


def lone_decode_cta(device_name: str) -> bool:
    """Whether a 16-row decode CTA alone on its SM reads K and V as fast as two (at d 65-128: one CTA an SM from a
    contiguous cache, and the unsplit ring kernel): on the H100, where it was measured faster. Not on the H200,
    whose HBM gives each SM 1.4x the bandwidth: there two CTAs an SM were 7-15% faster on the rows that one took
    (RESULTS.md, session 55); nor, unmeasured, elsewhere, which keeps the two-CTA counts."""
    return "H100" in device_name


def ring_kernel_fits(route: DecodeRoute, paged: bool) -> bool:
    """Whether the ring decode kernel (sm80/fwd_launch.h RingDecodeTraits, whose launch checks the same) fits the
    shared memory of route's device: 16 query rows and three stages of 128-key K and V blocks, 2-byte elements, and
    from a paged cache the 128 threads' 4-byte table entries for three blocks (sm80/fwd_kernel.h PagedTableSlots). At
    d 64 the dense one fits sm86/89/120, the paged one the A100 and H100/H200; at d 128 only the H100/H200."""
    operands = 2 * (16 + 3 * 2 * 128) * route.head_dim
    table_slots = 3 * 128 * 4 if paged else 0
    return operands + table_slots <= route.smem_per_block


def split_count(num_splits: int, b: int, heads: int, rows: int, keys: int, head_dim: int, sm_count: int,
                paged: bool = False, ring_fits: bool = True, lone_cta: bool = True) -> int:
    """Key chunks per sequence for fwd_split of b sequences of `rows` query rows (GQA-packed or not) over `heads`
    heads (`paged`: from a paged cache; `ring_fits`: whether the ring kernel fits the device, ring_kernel_fits();
    `lone_cta`: whether the device takes lone 16-row CTAs at d 65-128, lone_decode_cta()):
    num_splits when given (at most one per key); with 0, for 16-row tiles that fill a third of the sm_count SMs or
    more, one or two at head dim 64 or less, one at d 65-128 on at most half the SMs and up to 8k keys (the ring
    kernel; only where lone_cta); else as many as keep the query tiles (one per 64 rows) x chunks within one wave of
    decode_ctas_per_sm CTAs an SM (a second, partial wave costs more than fewer chunks), chunks of at least 512 keys,
    at most 64 (H100 and H200, RESULTS.md)."""
    if num_splits > 0:
        return max(1, min(num_splits, keys, 256))
    tiles = b * heads * -(-rows // 64)
    # The ring kernel, alone on its SM (sm80/fwd_launch.h takes_ring_kernel): 16-row tiles that fill a third of the
    # SMs or more, at d <= 64 in sm_count // tiles chunks, at d 65-128 unsplit on at most half the SMs and up to 8k
    # keys where lone_cta (H100, RESULTS.md: with 16k it was 1% slower than two chunks of the one-buffer tile; on the
    # H200 b 8 x 4k at d 128 ran 10% faster in four chunks, two CTAs an SM).
    ring = ring_fits and rows <= 16 and sm_count < 3 * tiles <= 3 * sm_count
    if ring and head_dim <= 64:
        return max(1, min(sm_count // tiles, keys // 512))
    if ring and lone_cta and head_dim <= 128 and 2 * tiles <= sm_count and keys <= 8192:
        return 1
    waves = decode_ctas_per_sm(head_dim, rows, paged, lone_cta) * sm_count
    return max(1, min(waves // max(tiles, 1), keys // 512, 64))


def route_split_count(route: DecodeRoute, num_splits: int, b: int, heads: int, rows: int, keys: int, head_dim: int,
                      paged: bool = False) -> int:
    """split_count on route's device: its SMs, whether the ring kernel fits it, whether it takes lone CTAs."""
    return split_count(num_splits, b, heads, rows, keys, head_dim, route.sm_count, paged,
                       ring_kernel_fits(route, paged), route.lone_cta)


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    return _sm_count_of(_dispatch.device_index(device)) if device.type == "cuda" else 1


@functools.lru_cache(maxsize=None)
def _smem_per_block_of(index: int) -> int:
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)


@functools.lru_cache(maxsize=None)
def _lone_decode_cta_of(index: int) -> bool:
    return lone_decode_cta(torch.cuda.get_device_properties(index).name)


@torch.library.custom_op("flash_attention::fwd_split", mutates_args=())
def fwd_split(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqused_k: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    leftpad_k: Optional[torch.Tensor],
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    packed_heads: int,
    tier: Optional[str],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split-KV forward for decoding, not differentiable: q (b, sq, h, d), k/v (b, sk, hk, d) validated, head dim a
    multiple of 8, of which sequence i uses the first seqused_k[i] keys; each query tile's keys are cut into
    num_splits chunks attended to by CTAs of their own (fp32 partials; split_forward_tier says whose), merged by the
    combine kernel (on Hopper, the SM80 tier's decode kernels merge up to 16 chunks inside a cluster; a negative
    num_splits is -num_splits chosen by split_count, which the binding may lower, to a third at most, where fewer
    chunks merge inside clusters and more do not). tier: the caller's tier override (None: the default). With
    block_table (int32 (b, max_blocks)), k/v are page pools (num_pages, page_size, hk, d) read in place: key j of
    sequence i is row j % page_size of page block_table[i, j // page_size]. packed_heads > 1: the kernel GQA-packs
    the query heads of each kv head as rows (row r: query r // packed_heads, masked as that query) of q (b, sq,
    hk * packed_heads, d); out and lse come back in q's layout. leftpad_k (int32 (b,)): sequence i's keys are its
    rows [leftpad_k[i], seqused_k[i]). Returns (out, lse (b, h, sq)), h and sq q's."""
    return split_forward_impl(q, k, v, seqused_k, block_table, leftpad_k, softmax_scale, window_left, window_right,
                              softcap, num_splits, packed_heads, tier)


def split_forward_tier(q: torch.Tensor, k: torch.Tensor, block_table, leftpad_k, packed_heads: int,
                       tier: Optional[str]) -> str:
    """The tier whose forward writes fwd_split's partials: q's forward tier (the SM90 forward on Hopper, whose TMA
    loads stream K and V) for prefill-shaped calls (more than 64 query rows) without left padding or GQA packing, of
    a contiguous cache or pages (k's rows, with block_table) of a size it reads; else SPLIT_TIER's decode kernels,
    which take any. Decode-shaped calls stay there: on an H200 (2026-11-26) the SM90 forward was 0.96x their speed
    over the decode shapes (0.77x at head dim 64)."""
    if q.shape[1] > 64 and leftpad_k is None and packed_heads == 1:
        try:
            name = _dispatch.resolve_tier(q.device, tier, q.shape[-1], q.dtype, "fwd")
        except RuntimeError:
            return SPLIT_TIER
        if block_table is None or forward_reads_pages(name, k.shape[1], q.shape[-1]):
            return name
    return SPLIT_TIER


def forward_reads_pages(tier_name: str, page_size: int, head_dim: int) -> bool:
    """Whether tier_name's forward reads a paged cache of pages of page_size rows in place at this head dim."""
    kind = _catalog.TIERS[tier_name].kinds["fwd"]
    paged_dims = kind.head_dims if kind.paged_head_dims is None else kind.paged_head_dims
    return (bool(kind.page_multiple) and page_size % kind.page_multiple == 0
            and _catalog.kernel_head_dim(head_dim, kind) in paged_dims)


def forward_copies_page_rows(tier_name: str, page_size: int) -> bool:
    """Whether tier_name's forward, where it reads pages of page_size rows, copies them row by row (not by TMA)."""
    kind = _catalog.TIERS[tier_name].kinds["fwd"]
    return bool(kind.page_box_rows) and page_size % kind.page_box_rows != 0


def gather_kernel_usable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether gather_pages takes these page pools: eager, built for their dtype, in 16-byte vectors (rows of a
    multiple of 16 bytes, 16-byte aligned)."""
    if not k_cache.is_cuda or torch.compiler.is_compiling():
        return False
    size = k_cache.element_size()
    for t in (k_cache, v_cache):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
            return False
    if k_cache.shape[-1] * size % 16:
        return False
    try:
        _dispatch.resolve(k_cache.device, "gather", k_cache.shape[-1], k_cache.dtype, SPLIT_TIER)
    except RuntimeError:
        return False
    return True


def gather_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, used: torch.Tensor):
    """(k, v) (b, max_blocks * page_size, hk, d): each sequence's first used[i] rows gathered from its pages in one
    kernel (the SM80 tier's, portable); the rows past them are uninitialized. Check gather_kernel_usable first."""
    ext = _dispatch.load_extension()
    tier_id, kernel_dim = _dispatch.resolve(k_cache.device, "gather", k_cache.shape[-1], k_cache.dtype, SPLIT_TIER)
    return tuple(ext.gather_pages(k_cache, v_cache, block_table.contiguous(), used.contiguous(), kernel_dim, tier_id))


def split_forward_impl(q, k, v, seqused_k, block_table, leftpad_k, softmax_scale, window_left, window_right, softcap,
                       num_splits, packed_heads, tier):
    ext = _dispatch.load_extension()
    fwd_tier = split_forward_tier(q, k, block_table, leftpad_k, packed_heads, tier)
    route = _split_route(q.device, q.shape[-1], q.dtype, fwd_tier)
    if route is None:  # raises the build's error
        _dispatch.resolve(q.device, "fwd", q.shape[-1], q.dtype, fwd_tier)
        _dispatch.resolve(q.device, "combine", q.shape[-1], q.dtype, SPLIT_TIER)
    tier_id, kernel_dim, combine_id, _ = route
    return ext.fwd_split(q, k, v, seqused_k, block_table, leftpad_k, softmax_scale, window_left, window_right,
                         softcap, num_splits, packed_heads, kernel_dim, tier_id, combine_id)


def split_attention(q, k, v, *args) -> Tuple[torch.Tensor, torch.Tensor]:
    """fwd_split(q, k, v, *args): through the op when traced, else straight to the binding (a decode step cannot
    afford the dispatcher's overhead around a Python op)."""
    return split_forward_impl(q, k, v, *args) if _eager(q, k, v) else fwd_split(q, k, v, *args)


def decode_attention(route: DecodeRoute, q, k, v, seqused_k, block_table, leftpad_k, softmax_scale, window_left,
                     window_right, softcap, num_splits, packed_heads, tier) -> Tuple[torch.Tensor, torch.Tensor]:
    """split_attention(q, k, v, ...) of a call whose forward runs on SPLIT_TIER (split_forward_tier), eagerly on the
    kernels of route (decode_route(q, tier)), found with one lookup."""
    if _eager(q, k, v):
        return _dispatch.load_extension().fwd_split(q, k, v, seqused_k, block_table, leftpad_k, softmax_scale,
                                                    window_left, window_right, softcap, num_splits, packed_heads,
                                                    route.head_dim, route.fwd_tier, route.combine_tier)
    return fwd_split(q, k, v, seqused_k, block_table, leftpad_k, softmax_scale, window_left, window_right, softcap,
                     num_splits, packed_heads, tier)


@fwd_split.register_fake
def _split_fake(q, k, v, seqused_k, block_table, leftpad_k, softmax_scale, window_left, window_right, softcap,
                num_splits, packed_heads, tier):
    """The forward's outputs in q's layout (its rows packed by the kernel or not): contiguous."""
    return _outputs_like(q)[0], q.new_empty(_lse_shape(q), dtype=torch.float32)


class _EagerAttention(torch.autograd.Function):
    """The ops' autograd formula without the op, for eager calls with nothing to compute (no kernel runs, so no
    binding is needed) or without a backward kernel (see _differentiable). The arguments after q, k, v travel as one
    tuple: none of them takes a gradient."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        out, lse = forward_impl(q, k, v, *args)
        _save(ctx, q, k, v, args, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _gradients(ctx, grad_out, grad_lse, backward_impl)[:3] + (None,)


def _eager(q, k, v) -> bool:
    """Whether the call may skip the op: nothing traces it (torch.compile, make_fx) or intercepts it (a dispatch mode
    such as FakeTensorMode, a tensor subclass)."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor)


# (device index, head dim, dtype, tier override) -> (forward's kernel head dim and tier id, then the backward's, or
# None where the build lacks a backward kernel): a differentiable eager call finds both with one lookup, and
# interface._common_forward reads this without a call.
autograd_routes = {}


def autograd_route(q: torch.Tensor, tier: Optional[str]):
    override = _dispatch.requested_tier(tier)
    key = (q.get_device(), q.shape[-1], q.dtype, override)
    route = autograd_routes.get(key)
    if route is None:
        fwd_tier, fwd_dim = _dispatch.resolve(q.device, "fwd", q.shape[-1], q.dtype, override)  # raises uncached
        try:
            bwd_tier, bwd_dim = _dispatch.resolve(q.device, "bwd", q.shape[-1], q.dtype, override)
            route = (fwd_dim, fwd_tier, bwd_dim, bwd_tier)
        except RuntimeError:
            route = (fwd_dim, fwd_tier, None, None)
        autograd_routes[key] = route
    return route


def _differentiable(q, k, v, args) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) with the backward as the binding's C++ autograd node; both kernels are resolved now (a tier override
    read at the forward holds for its backward). Without a backward kernel (a build with FLASH_ATTN_KINDS=fwd) the
    forward still runs: the Python twin defers the backward's lookup, and its error, to the backward."""
    if nothing_to_compute(q, k, args[0]):
        return _EagerAttention.apply(q, k, v, args)
    route = autograd_route(q, args[-1])
    if route[2] is None:
        return _EagerAttention.apply(q, k, v, args)
    out, lse = _dispatch.load_extension().attention_autograd(q, k, v, *args[:-1], *route)
    return out, lse


def needs_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def attention(q, k, v, *args) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of fwd(q, k, v, *args), differentiable: through the op when traced, else eagerly."""
    if not _eager(q, k, v):
        return fwd(q, k, v, *args)
    if needs_grad(q, k, v):
        return _differentiable(q, k, v, args)
    return forward_impl(q, k, v, *args)
