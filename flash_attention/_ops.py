"""The custom ops `flash_attention::fwd`/`bwd` (batched) and `flash_attention::varlen_fwd`/`varlen_bwd` (packed
variable-length sequences), each pair wired together for autograd, the compiled extension behind them, and tier
selection."""

import functools
import importlib
import os
from typing import FrozenSet, Optional, Sequence, Tuple

import torch

from ._kernel_dims import kernel_head_dim

TIER_IDS = {"sm80": 80, "sm90": 90, "sm100": 100}

# Where each tier's code can run: the SM80 tier uses only mma.sync/cp.async and ships as SASS for several
# architectures plus PTX; the SM90 tier needs wgmma (9.0 only), the SM100 tier tcgen05 (10.x only).
_TIER_RUNS_ON = {
    "sm80": lambda cc: cc >= (8, 0),
    "sm90": lambda cc: cc == (9, 0),
    "sm100": lambda cc: cc[0] == 10,
}

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
TIER_ENV_VAR = "FLASH_ATTN_TIER"

MISSING_BUILD_MESSAGE = (
    "flash_attention: the CUDA extension flash_attention._C is missing, so no kernel can run: the package was "
    "installed with FLASH_ATTN_SKIP_CUDA_BUILD=1 or the CUDA build failed. Reinstall on a machine with nvcc and a "
    "CUDA build of torch: `pip install -e . --no-build-isolation`."
)

_EXTENSION_NAME = "flash_attention._C"
_extension = None


def load_extension():
    """Import the compiled extension on first use, so the package imports fine without it."""
    global _extension
    if _extension is None:
        try:
            _extension = importlib.import_module(_EXTENSION_NAME)
        except ImportError as e:
            raise RuntimeError(f"{MISSING_BUILD_MESSAGE} (import error: {e})") from e
    return _extension


def extension_available() -> bool:
    try:
        load_extension()
    except RuntimeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def available_kernels() -> FrozenSet[Tuple[int, str, int, str]]:
    return frozenset(tuple(kernel) for kernel in load_extension().available_kernels())


def parse_tier_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"tier must be a string such as 'sm80' or None, got {type(name).__name__}")
    tier = name.strip().lower()
    if tier not in TIER_IDS:
        raise ValueError(
            f"unknown tier {name!r} (from the tier= argument or {TIER_ENV_VAR}); "
            f"expected one of: {', '.join(TIER_IDS)}"
        )
    return tier


def requested_tier(tier: Optional[str]) -> Optional[str]:
    """The tier override: the tier= argument wins over the environment variable; an empty variable is unset."""
    if tier is not None:
        return tier
    return os.environ.get(TIER_ENV_VAR) or None


def select_tier(capability: Sequence[int], override: Optional[str] = None) -> str:
    """Tier name for a GPU of the given compute capability, honouring an override. Pure, so testable on CPU."""
    cc = tuple(capability)
    if cc < (8, 0):
        raise RuntimeError(
            f"flash_attention: GPUs of compute capability {cc[0]}.{cc[1]} are not supported; "
            "it needs compute capability 8.0 or newer (Ampere, Ada, Hopper, Blackwell)"
        )
    if override is not None:
        tier = parse_tier_name(override)
        if not _TIER_RUNS_ON[tier](cc):
            raise RuntimeError(
                f"flash_attention: tier {tier} (requested by the tier= argument or {TIER_ENV_VAR}) cannot run on "
                f"this GPU of compute capability {cc[0]}.{cc[1]}"
            )
        return tier
    # The SM100 tier for (10, x) will take over here once it exists.
    return "sm90" if cc == (9, 0) else "sm80"


def check_kernel_available(available, tier: str, head_dim: int, dtype_name: str, direction: str = "fwd") -> None:
    """Raise a clear error when the build lacks the kernel for (tier, direction, head_dim, dtype)."""
    built_tiers = sorted({t for (t, _, _, _) in available})
    if TIER_IDS[tier] not in built_tiers:
        built = ", ".join(f"sm{t}" for t in built_tiers) or "none"
        raise RuntimeError(
            f"flash_attention: tier {tier} is not built in this installation (built tiers: {built}); "
            "the tiers compiled are chosen at build time by FLASH_ATTN_CUDA_ARCHS"
        )
    kernel_dim = kernel_head_dim(head_dim)
    if (TIER_IDS[tier], direction, kernel_dim, dtype_name) not in available:
        built = sorted((hd, dt) for (t, dr, hd, dt) in available if t == TIER_IDS[tier] and dr == direction)
        name = {"fwd": "forward", "bwd": "backward"}[direction]
        raise RuntimeError(
            f"flash_attention: this build has no {tier} {name} kernel for head dim {kernel_dim} ({dtype_name}), "
            f"which serves head dim {head_dim}; built (head dim, dtype): {built}. The head dims and architectures "
            "compiled are restricted at build time by FLASH_ATTN_HEAD_DIMS and FLASH_ATTN_CUDA_ARCHS; rebuild with "
            "them unset to get every kernel"
        )


def resolve_tier(device: torch.device, tier: Optional[str], head_dim: int, dtype: torch.dtype, direction: str) -> str:
    """The tier that runs on `device`, checked to be built for this head dim, dtype and direction. Resolved inside the
    ops rather than by the caller so that FLASH_ATTN_TIER is read at run time, also under torch.compile."""
    available = available_kernels()
    override = requested_tier(tier)
    tier_name = routed_tier(available, select_tier(torch.cuda.get_device_capability(device), override), head_dim,
                            DTYPE_NAMES[dtype], direction, override is not None)
    check_kernel_available(available, tier_name, head_dim, DTYPE_NAMES[dtype], direction)
    return tier_name


def routed_tier(available, tier: str, head_dim: int, dtype_name: str, direction: str, requested: bool) -> str:
    """A newer tier serves only some of the work (the SM90 tier: the forward for head dims 64, 128 and 256); the rest
    is routed to the SM80 tier, which runs on every supported GPU and shares the lse convention, so a forward on one
    tier and its backward on the other agree. So is all of it when the default tier was not built (e.g.
    FLASH_ATTN_CUDA_ARCHS=80); a requested tier that was not built is left to check_kernel_available's error."""
    def built(name):
        return (TIER_IDS[name], direction, kernel_head_dim(head_dim), dtype_name) in available

    tier_built = any(t == TIER_IDS[tier] for (t, _, _, _) in available)
    if tier != "sm80" and (tier_built or not requested) and not built(tier) and built("sm80"):
        return "sm80"
    return tier


def kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """The kernel loads 16-byte vectors: the last dimension must be contiguous, every other stride a multiple of 8
    elements and the base pointer 16-byte aligned. Otherwise copy (autograd hands the gradient of out.sum() over as a
    broadcast view with stride 0 everywhere); clone rather than .contiguous(), which keeps a misaligned view that
    torch already considers contiguous."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(stride % 8 for stride in t.stride()[:-1]):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _optional_contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _buffer(shape, dtype: torch.dtype, device: torch.device, fill: Optional[float]) -> torch.Tensor:
    """An output buffer: left uninitialized when the kernel writes all of it, else filled with `fill`."""
    if fill is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, fill, dtype=dtype, device=device)


def _varlen_kwargs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """The binding's keyword arguments that switch it to variable-length sequences."""
    return dict(cu_seqlens_q=cu_seqlens_q.contiguous(), cu_seqlens_k=cu_seqlens_k.contiguous(),
                seqused_q=_optional_contiguous(seqused_q), seqused_k=_optional_contiguous(seqused_k),
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _attention_fwd(q, k, v, lse_shape, empty, prefill, score_args, tier, varlen) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the kernel, shared by the batched and the varlen op. score_args: (softmax_scale, window_left,
    window_right, softcap, alibi_slopes); varlen: _varlen_kwargs, or {} for the batched binding. With nothing to
    compute (`empty`: no query, key or sequence) every row is fully masked, out 0 and lse -inf, and no kernel runs;
    `prefill` fills the outputs so too where the kernel leaves rows unwritten (past seqused_q)."""
    out = _buffer(q.shape, q.dtype, q.device, 0.0 if empty or prefill else None)
    lse = _buffer(lse_shape, torch.float32, q.device, float("-inf") if empty or prefill else None)
    if empty:
        return out, lse
    ext = load_extension()
    d = q.shape[-1]
    tier_name = resolve_tier(q.device, tier, d, q.dtype, "fwd")
    *scores, alibi_slopes = score_args
    ext.fwd(kernel_operand(q), kernel_operand(k), kernel_operand(v), out, lse, *scores,
            _optional_contiguous(alibi_slopes), kernel_head_dim(d), TIER_IDS[tier_name], **varlen)
    return out, lse


def _attention_bwd(dout, q, k, v, out, lse, dlse, empty, zero_dq, zero_dkv, score_args, deterministic, tier, varlen):
    """(dq, dk, dv) of the kernel, shared by the batched and the varlen op; arguments as for _attention_fwd. Gradients
    are zero with nothing to compute, and are zeroed first where the kernel leaves rows unwritten: dq past seqused_q
    (zero_dq), dk and dv past seqused_k (zero_dkv)."""
    dq = _buffer(q.shape, q.dtype, q.device, 0.0 if empty or zero_dq else None)
    dk = _buffer(k.shape, k.dtype, k.device, 0.0 if empty or zero_dkv else None)
    dv = _buffer(v.shape, v.dtype, v.device, 0.0 if empty or zero_dkv else None)
    if empty:
        return dq, dk, dv
    ext = load_extension()
    d = q.shape[-1]
    tier_name = resolve_tier(q.device, tier, d, q.dtype, "bwd")
    *scores, alibi_slopes = score_args
    dout, q, k, v, out = (kernel_operand(t) for t in (dout, q, k, v, out))
    ext.bwd(dout, q, k, v, out, lse.contiguous(), _optional_contiguous(dlse), dq, dk, dv, *scores,
            _optional_contiguous(alibi_slopes), deterministic, kernel_head_dim(d), TIER_IDS[tier_name], **varlen)
    return dq, dk, dv


def _outputs_like(*tensors):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


@torch.library.custom_op("flash_attention::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    tier: Optional[str],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward attention on validated inputs q (b, sq, h, d), k/v (b, sk, hk, d) whose head dim is a multiple of 8.
    Returns (out, lse (b, h, sq)). `deterministic` is for the backward (the forward is always deterministic):
    autograd hands it on to `bwd`."""
    b, sq, h, _ = q.shape
    return _attention_fwd(q, k, v, (b, h, sq), q.numel() == 0 or k.numel() == 0, False,
                          (softmax_scale, window_left, window_right, softcap, alibi_slopes), tier, {})


@fwd.register_fake
def _fwd_fake(q, *args):
    b, sq, h, _ = q.shape
    return _outputs_like(q)[0], q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("flash_attention::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    tier: Optional[str],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of fwd's (out, lse) given dout and, when the caller used lse, dlse."""
    return _attention_bwd(dout, q, k, v, out, lse, dlse, q.numel() == 0 or k.numel() == 0, False, False,
                          (softmax_scale, window_left, window_right, softcap, alibi_slopes), deterministic, tier, {})


def _varlen_empty(q, k, cu_seqlens_q) -> bool:
    return q.numel() == 0 or k.numel() == 0 or cu_seqlens_q.shape[0] <= 1


@torch.library.custom_op("flash_attention::varlen_fwd", mutates_args=())
def varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
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
    """fwd on the sequences packed in q (total_q, h, d) and k/v (total_k, hk, d): sequence i has query rows
    [cu_seqlens_q[i], cu_seqlens_q[i + 1]) and key rows likewise from cu_seqlens_k, of which it uses the first
    seqused_q[i] / seqused_k[i] when given. Returns (out, lse (h, total_q)); rows past seqused_q are fully masked
    (out 0, lse -inf). max_seqlen_q/k only guide the kernel's tile choice."""
    total_q, h, _ = q.shape
    varlen = _varlen_kwargs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return _attention_fwd(q, k, v, (h, total_q), _varlen_empty(q, k, cu_seqlens_q), seqused_q is not None,
                          (softmax_scale, window_left, window_right, softcap, alibi_slopes), tier, varlen)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, *args):
    total_q, h, _ = q.shape
    return _outputs_like(q)[0], q.new_empty((h, total_q), dtype=torch.float32)


@torch.library.custom_op("flash_attention::varlen_bwd", mutates_args=())
def varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
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
    """Gradients (dq, dk, dv) of varlen_fwd's (out, lse); rows past seqused_q / seqused_k get zero gradients."""
    varlen = _varlen_kwargs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return _attention_bwd(dout, q, k, v, out, lse, dlse, _varlen_empty(q, k, cu_seqlens_q), seqused_q is not None,
                          seqused_k is not None, (softmax_scale, window_left, window_right, softcap, alibi_slopes),
                          deterministic, tier, varlen)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, *args):
    return _outputs_like(q, k, v)


varlen_bwd.register_fake(_bwd_fake)


def _setup_context(ctx, inputs, output):
    """Save what the backward op needs: q, k, v, (out, lse) and the forward's other arguments, which it takes in the
    same order after dlse."""
    q, k, v, *args = inputs
    ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ctx.save_for_backward(q, k, v, *output, *(args[i] for i in ctx.tensor_positions))
    ctx.args = [None if i in ctx.tensor_positions else a for i, a in enumerate(args)]
    # An output the loss does not use then has gradient None, not zeros: an unused lse costs nothing.
    ctx.set_materialize_grads(False)


def _backward_by(bwd_op):
    def backward(ctx, grad_out, grad_lse):
        """Gradients for q, k, v, and None for the other arguments (index tensors, ALiBi slopes, scalars). The lse
        gradient, when the caller used lse, flows into dq and dk: d lse_i / d s_ij is P_ij, which the kernel folds
        into D."""
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        args = list(ctx.args)
        for i, t in zip(ctx.tensor_positions, tensors):
            args[i] = t
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = bwd_op(grad_out, q, k, v, out, lse, grad_lse, *args)
        return (dq, dk, dv) + (None,) * len(args)

    return backward


fwd.register_autograd(_backward_by(bwd), setup_context=_setup_context)
varlen_fwd.register_autograd(_backward_by(varlen_bwd), setup_context=_setup_context)
