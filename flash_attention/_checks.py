"""Input validation, done in Python before any kernel runs so that errors name the argument at fault."""

import operator
from typing import Tuple

import torch

from ._kernel_dims import KERNEL_HEAD_DIMS
from ._ops import parse_tier_name

_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = KERNEL_HEAD_DIMS[-1]


def check_packed(t, name: str, count: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 5 or t.shape[2] != count:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")


def check_inputs(q, k, v, window_size, softcap, alibi_slopes, tier) -> None:
    """Validate the arguments of flash_attn_func. The device is checked last so that every other check can be
    exercised with CPU tensors."""
    tensors = (("q", q), ("k", k), ("v", v))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be torch.float16 or torch.bfloat16, got {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    for name, t in tensors:
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have rank 4, (batch, seqlen, nheads, head_dim), got shape {tuple(t.shape)}"
            )

    b, _, h, d = q.shape
    _, _, hk, _ = k.shape
    if k.shape != v.shape:
        raise ValueError(
            "k and v must have the same shape (batch, seqlen_k, nheads_k, head_dim), "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if k.shape[0] != b:
        raise ValueError(f"q and k/v must have the same batch size, got {b} and {k.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"q, k and v must have the same head dim, got {d} for q and {k.shape[3]} for k/v")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if h < 1 or hk < 1:
        raise ValueError(f"the number of heads must be at least 1, got {h} for q and {hk} for k/v")
    if h % hk != 0:
        raise ValueError(
            f"the number of query heads ({h}) must be a multiple of the number of key/value heads ({hk}) "
            "(GQA/MQA: each group of query heads shares one key/value head)"
        )

    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be torch.float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((h,), (b, h)):
            raise ValueError(
                f"alibi_slopes must have shape (nheads,) = ({h},) or (batch, nheads) = ({b}, {h}), "
                f"got {tuple(alibi_slopes.shape)}"
            )

    window_pair(window_size)
    if not isinstance(softcap, (int, float)) or not softcap >= 0:
        raise ValueError(f"softcap must be a number >= 0 (0 disables it), got {softcap!r}")
    if tier is not None:
        parse_tier_name(tier)

    check_device([q, k, v] + ([alibi_slopes] if alibi_slopes is not None else []))


def _as_int(w):
    """An integer-like window bound as a Python int (Python and numpy ints, 0-d integer tensors), else None."""
    if isinstance(w, bool):
        return None
    if isinstance(w, torch.Tensor):
        if w.dim() != 0 or w.dtype == torch.bool or w.is_floating_point() or w.is_complex():
            return None
        return int(w.item())
    try:
        return operator.index(w)
    except TypeError:
        return None


def window_pair(window_size) -> Tuple[int, int]:
    """window_size as two Python ints >= -1, accepting what flash-attn accepts: any pair of integer-likes."""
    bounds = [_as_int(w) for w in window_size] if isinstance(window_size, (tuple, list)) else []
    if len(bounds) != 2 or any(w is None or w < -1 for w in bounds):
        raise ValueError(
            f"window_size must be a pair of integers >= -1 (-1 = unbounded), got {window_size!r}"
        )
    return bounds[0], bounds[1]


def check_device(tensors) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(
            "q, k, v and alibi_slopes must be on the same device, got " + ", ".join(str(t.device) for t in tensors)
        )
    if device.type != "cuda":
        raise ValueError(f"q, k, v and alibi_slopes must be CUDA tensors, got device {device}")
