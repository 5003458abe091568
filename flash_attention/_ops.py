"""The `flash_attention::fwd` and `flash_attention::bwd` custom ops (wired together for autograd), the compiled
extension behind them, and tier selection."""

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
    # The SM80 tier is the only one built so far; SM90 for (9, 0) and SM100 for (10, x) will take over here.
    return "sm80"


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
    tier_name = select_tier(torch.cuda.get_device_capability(device), requested_tier(tier))
    check_kernel_available(available_kernels(), tier_name, head_dim, DTYPE_NAMES[dtype], direction)
    return tier_name


def kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """The kernel loads 16-byte vectors: the last dimension must be contiguous, every other stride a multiple of 8
    elements and the base pointer 16-byte aligned. Otherwise copy (autograd hands the gradient of out.sum() over as a
    broadcast view with stride 0 everywhere); clone rather than .contiguous(), which keeps a misaligned view that
    torch already considers contiguous."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(stride % 8 for stride in t.stride()[:-1]):
        return t.clone(memory_format=torch.contiguous_format)
    return t


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
    """Forward attention on validated inputs whose head dim is a multiple of 8. Returns (out, lse). With no query, key
    or batch, every row is fully masked: out 0, lse -inf, and no kernel runs. `deterministic` is for the backward
    (the forward is always deterministic): autograd hands it on to `bwd`."""
    b, sq, h, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or k.shape[1] == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    ext = load_extension()
    tier_name = resolve_tier(q.device, tier, d, q.dtype, "fwd")
    q, k, v = kernel_operand(q), kernel_operand(k), kernel_operand(v)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    ext.fwd(q, k, v, out, lse, softmax_scale, window_left, window_right, softcap, alibi_slopes, kernel_head_dim(d),
            TIER_IDS[tier_name])
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
    b, sq, h, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((b, h, sq), dtype=torch.float32)


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
    """Gradients (dq, dk, dv) of the forward's (out, lse) given dout and, when the caller used lse, dlse. With no query,
    key or batch they are zero, and no kernel runs."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    ext = load_extension()
    d = q.shape[-1]
    tier_name = resolve_tier(q.device, tier, d, q.dtype, "bwd")
    dout, q, k, v, out = (kernel_operand(t) for t in (dout, q, k, v, out))
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    ext.bwd(dout, q, k, v, out, lse.contiguous(), dlse, dq, dk, dv, softmax_scale, window_left, window_right, softcap,
            alibi_slopes, deterministic, kernel_head_dim(d), TIER_IDS[tier_name])
    return dq, dk, dv


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, window_left, window_right, softcap, alibi_slopes,
              deterministic, tier):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    # An output the loss does not use then has gradient None, not zeros: an unused lse costs nothing.
    ctx.set_materialize_grads(False)
    ctx.args = (softmax_scale, window_left, window_right, softcap, deterministic, tier)


def _fwd_backward(ctx, grad_out, grad_lse):
    """Gradients for q, k, v. The lse gradient, when the caller used lse, flows into dq and dk: d lse_i / d s_ij is
    P_ij, which the kernel folds into D."""
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    softmax_scale, window_left, window_right, softcap, deterministic, tier = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = bwd(grad_out, q, k, v, out, lse, grad_lse, softmax_scale, window_left, window_right, softcap,
                     alibi_slopes, deterministic, tier)
    return dq, dk, dv, None, None, None, None, None, None, None


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
