"""Input validation, done in Python before any kernel runs so that errors name the argument at fault."""

import math
import numbers
import operator
import os
from collections.abc import Sequence
from typing import Optional, Tuple

import torch

from ._catalog import MAX_HEAD_DIM
from ._dispatch import DTYPE_NAMES, parse_tier_name

INPUT_DTYPES = tuple(DTYPE_NAMES)
CHECK_VARLEN_ENV_VAR = "FLASH_ATTN_CHECK_VARLEN"


def check_packed(t, name: str, count: int, layout: str, rank: int = 5) -> None:
    """A packed qkv/kv tensor of the given rank whose axis rank - 3 (the one before heads) has `count` entries."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank or t.shape[rank - 3] != count:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")


def _qkv_valid(q, k, v, rank: int) -> bool:
    """The common case of _check_qkv in one expression (it runs on every call): plain tensors of one supported dtype
    and of the given rank, k and v of one shape, a head dim q shares and the kernels take, hk dividing h, and for
    batched tensors (rank 4) one batch size."""
    if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
        qs, ks = q.shape, k.shape
        return (q.dtype in INPUT_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype and len(qs) == rank
                and len(ks) == rank and v.shape == ks and ks[-1] == qs[-1] and 1 <= qs[-1] <= MAX_HEAD_DIM
                and ks[-2] >= 1 and qs[-2] % ks[-2] == 0 and qs[-2] >= 1 and (rank != 4 or ks[0] == qs[0]))
    return False


def _check_qkv(q, k, v, layouts) -> None:
    """Types, dtypes, ranks and head counts of q, k, v; layouts names each one's dims, as (q's, k/v's). Anything
    _qkv_valid does not pass takes the checks that name the fault."""
    if _qkv_valid(q, k, v, len(layouts[0])):
        return
    tensors = (("q", q), ("k", k), ("v", v))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(f"{name} must be {' or '.join(map(str, INPUT_DTYPES))}, got {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    rank = len(layouts[0])
    for (name, t), layout in zip(tensors, (layouts[0], layouts[1], layouts[1])):
        if t.dim() != rank:
            raise ValueError(f"{name} must have rank {rank}, ({', '.join(layout)}), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape ({', '.join(layouts[1])}), got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )

    h, d = q.shape[-2:]
    hk, dk = k.shape[-2:]
    if dk != d:
        raise ValueError(f"q, k and v must have the same head dim, got {d} for q and {dk} for k/v")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if h < 1 or hk < 1:
        raise ValueError(f"the number of heads must be at least 1, got {h} for q and {hk} for k/v")
    if h % hk != 0:
        raise ValueError(
            f"the number of query heads ({h}) must be a multiple of the number of key/value heads ({hk}) "
            "(GQA/MQA: each group of query heads shares one key/value head)"
        )


def _check_alibi(alibi_slopes, b: int, h: int) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be torch.float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((h,), (b, h)):
        raise ValueError(
            f"alibi_slopes must have shape (nheads,) = ({h},) or (batch, nheads) = ({b}, {h}), "
            f"got {tuple(alibi_slopes.shape)}"
        )


def check_inputs(q, k, v, alibi_slopes, tier) -> None:
    """Validate the tensors of flash_attn_func and the tier. The device is checked last so that every other check can
    be exercised with CPU tensors."""
    if (alibi_slopes is None and tier is None and _qkv_valid(q, k, v, 4) and q.is_cuda
            and k.get_device() == q.get_device() and v.get_device() == q.get_device()):
        return  # the common case in one expression: every call runs this
    _check_qkv(q, k, v, (("batch", "seqlen_q", "nheads", "head_dim"), ("batch", "seqlen_k", "nheads_k", "head_dim")))
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k/v must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    _check_alibi(alibi_slopes, q.shape[0], q.shape[2])
    _check_tier(tier)
    _check_devices(q, k, v, alibi_slopes)


def _check_devices(q, k, v, alibi_slopes) -> None:
    if alibi_slopes is None and q.is_cuda and k.get_device() == q.get_device() and v.get_device() == q.get_device():
        return  # the common case, without building check_device's names (or device objects)
    check_device(_named_tensors(q, k, v, alibi_slopes))


def _check_tier(tier) -> None:
    if tier is not None:
        parse_tier_name(tier)


def _named_tensors(q, k, v, alibi_slopes):
    """The tensors check_device compares, by name; alibi_slopes only when given, so that a message about q, k and v
    never names an argument that the called function lacks (FlashAttention-4's have no alibi_slopes)."""
    return {"q": q, "k": k, "v": v, **({} if alibi_slopes is None else {"alibi_slopes": alibi_slopes})}


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                        alibi_slopes, tier) -> Tuple[int, int]:
    """Validate the arguments of flash_attn_varlen_func; returns max_seqlen_q and max_seqlen_k as Python ints.

    Only metadata is checked (types, dtypes, shapes, devices), never a tensor's values: reading them would wait for
    the GPU. So these are not checked by default: that cu_seqlens_q/k start at 0, do not decrease and end at
    total_q/total_k (or before, with seqused: the rows after it belong to no sequence); that max_seqlen_q/k are at
    least every sequence's (used) length; that seqused_q/k are between 0 and their sequence's length. The kernels
    clamp such malformed values to the tensors' rows, so they cannot read or write outside q, k, v or the outputs,
    but the numbers are then unspecified. FLASH_ATTN_CHECK_VARLEN=1 checks the values too (check_varlen_values)."""
    _check_qkv(q, k, v, (("total_q", "nheads", "head_dim"), ("total_k", "nheads_k", "head_dim")))
    _check_index_tensor(cu_seqlens_q, "cu_seqlens_q", q.device)
    _check_index_tensor(cu_seqlens_k, "cu_seqlens_k", q.device)
    if len(cu_seqlens_q) < 1:
        raise ValueError("cu_seqlens_q must have length batch + 1 >= 1, got length 0")
    if len(cu_seqlens_k) != len(cu_seqlens_q):
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
            f"got {len(cu_seqlens_q)} and {len(cu_seqlens_k)}"
        )
    b = len(cu_seqlens_q) - 1
    for name, seqused in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        check_seqused(seqused, name, b, "len(cu_seqlens_q) - 1", q.device)
    max_seqlens = (_max_seqlen(max_seqlen_q, "max_seqlen_q", q.shape[0]),
                   _max_seqlen(max_seqlen_k, "max_seqlen_k", k.shape[0]))
    _check_alibi(alibi_slopes, b, q.shape[1])
    _check_tier(tier)
    _check_devices(q, k, v, alibi_slopes)
    return max_seqlens


def check_seqused(seqused, name: str, batch: int, batch_name: str, device: torch.device) -> None:
    """seqused_q or seqused_k (None: absent): one int32 length per sequence, on q's device (batch_name: where the
    batch size comes from, for the message)."""
    if seqused is not None:
        _check_index_tensor(seqused, name, device)
        if len(seqused) != batch:
            raise ValueError(f"{name} must have length batch = {batch_name} = {batch}, got {len(seqused)}")


def _check_index_tensor(t, name: str, device: torch.device) -> None:
    """cu_seqlens and seqused: 1-D contiguous int32 tensors on q's device, as the kernels index them."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")


def _max_seqlen(value, name: str, total: int):
    """max_seqlen as a Python int >= 0; the kernels take it only as a hint for their tiles. An int, or a tensor of one
    integer (Hugging Face and Transformer Engine pass one to FlashAttention-4): read with .item() on the CPU, which
    waits for no GPU; on a GPU, or while torch.compile traces, reading it would wait for the GPU or break the graph,
    so the total rows stand in, an upper bound of every sequence's length. While torch.compile traces, an int may be
    symbolic (from .item(), say) and is not compared."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and _integer_dtype(value.dtype):
        if value.device.type != "cpu" or torch.compiler.is_compiling():
            return total
        value = value.item()
    n = None if isinstance(value, (bool, torch.Tensor)) else _index(value)
    if n is None or (not torch.compiler.is_compiling() and n < 0):
        raise ValueError(f"{name} must be an int >= 0 or an integer tensor of one element, got {value!r}")
    return n


def _index(x) -> Optional[int]:
    if isinstance(x, int):  # also a symbolic int under torch.compile, which operator.index would specialize
        return x
    try:
        return operator.index(x)
    except TypeError:
        return None


def _integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def as_int(w):
    """An integer-like window bound as a Python int (Python and numpy ints, 0-d integer tensors), else None."""
    if isinstance(w, bool):
        return None
    if isinstance(w, torch.Tensor):
        return int(w.item()) if w.dim() == 0 and _integer_dtype(w.dtype) else None
    return _index(w)


def as_float(x) -> Optional[float]:
    """A finite real number (not a bool), or a tensor of one such element, as a Python float; else None. A tensor is
    read with .item(), which on a GPU waits for it."""
    if type(x) is float:  # the common case, first: this runs on every call
        return x if -math.inf < x < math.inf else None
    if isinstance(x, torch.Tensor):
        x = x.item() if x.numel() == 1 and x.dtype != torch.bool and not x.is_complex() else None
    # A comparison, not math.isfinite, which torch.compile cannot trace on a symbolic float; NaN fails it too.
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not -math.inf < x < math.inf:
        return None
    return float(x)


def as_flag(x, name: str) -> bool:
    """causal, deterministic: True or False (also the ints 1 and 0)."""
    if x is True or x is False:
        return x
    if not isinstance(x, int) or x not in (0, 1):
        raise TypeError(f"{name} must be True or False, got {x!r}")
    return bool(x)


def window_elements(window_size) -> Optional[list]:
    """The two elements of window_size, else None: any sequence of length 2 (not a string), or an integer tensor or
    array of shape (2,) (flash-attn 2's tests draw windows as torch.randint(0, seqlen_k, (2,))), read with one
    .tolist(): on the CPU that waits for no GPU; on a GPU it is one device synchronisation."""
    if not isinstance(window_size, torch.Tensor) and hasattr(window_size, "__array__"):  # numpy arrays
        window_size = torch.as_tensor(window_size)
    if isinstance(window_size, torch.Tensor):
        fits = tuple(window_size.shape) == (2,) and _integer_dtype(window_size.dtype)
        return window_size.tolist() if fits else None
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence) or len(window_size) != 2:
        return None
    return list(window_size)


def window_pair(window_size) -> Tuple[int, int]:
    """flash-attn 2's window_size as two Python ints >= -1: a pair of integer-likes (window_elements), where any
    negative bound leaves its side unbounded, as in flash-attn 2."""
    if type(window_size) is tuple and len(window_size) == 2:  # the common case, first: this runs on every call
        left, right = window_size
        if type(left) is int and type(right) is int:
            return max(left, -1), max(right, -1)
    bounds = [as_int(w) for w in window_elements(window_size) or ()]
    if len(bounds) != 2 or None in bounds:
        raise ValueError(
            "window_size must be a pair of integers (a negative bound leaves its side unbounded): a tuple or list of "
            f"two ints, or an integer tensor of shape (2,), got {window_size!r}"
        )
    return max(bounds[0], -1), max(bounds[1], -1)


def check_device(tensors) -> None:
    """tensors: {name: tensor}, to be on one CUDA device."""
    devices = [t.device for t in tensors.values()]
    same = devices.count(devices[0]) == len(devices)
    if same and devices[0].type == "cuda":
        return
    names = list(tensors)
    names = ", ".join(names[:-1]) + f" and {names[-1]}"
    if not same:
        raise ValueError(f"{names} must be on the same device, got " + ", ".join(str(d) for d in devices))
    raise ValueError(f"{names} must be CUDA tensors, got device {devices[0]}")


def varlen_values_check_requested() -> bool:
    """FLASH_ATTN_CHECK_VARLEN=1 asks for check_varlen_values; never while torch.compile traces, where reading a
    tensor's values would break the graph."""
    return os.environ.get(CHECK_VARLEN_ENV_VAR) == "1" and not torch.compiler.is_compiling()


def check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k) -> None:
    """The checks of the sequence tensors' values that check_varlen_inputs leaves out; waits for the GPU."""
    for side, total, cu_seqlens, seqused, max_seqlen in (("q", q.shape[0], cu_seqlens_q, seqused_q, max_seqlen_q),
                                                        ("k", k.shape[0], cu_seqlens_k, seqused_k, max_seqlen_k)):
        lengths = _check_cu_seqlens(cu_seqlens.tolist(), f"cu_seqlens_{side}", total, f"total_{side}",
                                    seqused is not None)
        if seqused is not None:
            lengths = _check_seqused(seqused.tolist(), f"seqused_{side}", lengths, f"cu_seqlens_{side}")
        if lengths and max(lengths) > max_seqlen:
            i = lengths.index(max(lengths))
            raise ValueError(
                f"{CHECK_VARLEN_ENV_VAR}: max_seqlen_{side} = {max_seqlen} is less than the length of sequence {i}, "
                f"{lengths[i]}; it must be at least every sequence's length"
            )


def _check_cu_seqlens(cu, name: str, total: int, total_name: str, with_seqused: bool):
    """The sequence lengths that cu describes, once it is checked to run from 0 to total without decreasing. With
    seqused it may end before total: the rows after it then belong to no sequence and read as fully masked."""
    if cu[0] != 0:
        raise ValueError(f"{CHECK_VARLEN_ENV_VAR}: {name} must start at 0, got {name}[0] = {cu[0]}")
    lengths = [end - start for start, end in zip(cu, cu[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(
            f"{CHECK_VARLEN_ENV_VAR}: {name} must not decrease, got {name}[{i + 1}] = {cu[i + 1]} < "
            f"{name}[{i}] = {cu[i]}"
        )
    if cu[-1] > total or (cu[-1] < total and not with_seqused):
        seqused = name.replace("cu_seqlens", "seqused")
        raise ValueError(
            f"{CHECK_VARLEN_ENV_VAR}: {name} must end at {total_name} = {total} (or before it when {seqused} is "
            f"given), got {name}[-1] = {cu[-1]}"
        )
    return lengths


def _check_seqused(seqused, name: str, lengths, cu_name: str):
    """The used lengths, once each is checked to lie between 0 and its sequence's length."""
    for i, (used, n) in enumerate(zip(seqused, lengths)):
        if not 0 <= used <= n:
            raise ValueError(
                f"{CHECK_VARLEN_ENV_VAR}: {name}[{i}] = {used} must be between 0 and the length of sequence {i} in "
                f"{cu_name}, {n}"
            )
    return seqused
