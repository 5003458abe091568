"""Which compiled kernel serves a call: the extension that holds the kernels, the tier override, and the routing from
(device, kind, head dim, dtype) to a (tier, kernel head dim), resolved once per such key and cached."""

import functools
import importlib
import os
from typing import FrozenSet, Optional, Sequence, Tuple

import torch

from . import _catalog

# The input dtypes some kernel takes, by torch dtype.
DTYPE_NAMES = {getattr(torch, torch_name): name for name, (torch_name, _, _) in _catalog.DTYPES.items()
               if any(pair[0] == name for pair in _catalog.DTYPE_PAIRS)}
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


# (tier id, kind, kernel head dim, dtype in, dtype out) of a compiled kernel.
KernelKey = Tuple[int, str, int, str, str]


@functools.lru_cache(maxsize=None)
def available_kernels() -> FrozenSet[KernelKey]:
    return frozenset(tuple(kernel) for kernel in load_extension().available_kernels())


def parse_tier_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"tier must be a string such as 'sm80' or None, got {type(name).__name__}")
    tier = name.strip().lower()
    if tier not in _catalog.TIERS:
        raise ValueError(
            f"unknown tier {name!r} (from the tier= argument or {TIER_ENV_VAR}); "
            f"expected one of: {', '.join(_catalog.TIERS)}"
        )
    return tier


# os.environ.get costs about ten times a dict lookup (it encodes the key on every call); os.environ's own dict, which
# every change made through os.environ updates, is read with the key encoded once.
_TIER_ENV_KEY = os.environ.encodekey(TIER_ENV_VAR)


def requested_tier(tier: Optional[str]) -> Optional[str]:
    """The tier override: the tier= argument wins over the environment variable; an empty variable is unset."""
    if tier is not None:
        return tier
    value = os.environ._data.get(_TIER_ENV_KEY)
    return os.environ.decodevalue(value) if value else None


def select_tier(capability: Sequence[int], override: Optional[str] = None) -> str:
    """Tier name for a GPU of the given compute capability, honouring an override. Pure, so testable on CPU."""
    cc = tuple(capability)
    default = _catalog.default_tier(cc)  # raises for GPUs no tier runs on, also under an override
    if override is None:
        return default
    tier = parse_tier_name(override)
    if not _catalog.TIERS[tier].runs_on(cc):
        raise RuntimeError(
            f"flash_attention: tier {tier} (requested by the tier= argument or {TIER_ENV_VAR}) cannot run on "
            f"this GPU of compute capability {cc[0]}.{cc[1]}"
        )
    return tier


def kernel_key(tier: str, kind: str, head_dim: int, dtype_name: str) -> KernelKey:
    """The registry key of the kernel that serves head_dim; the output dtype is the input's (all pairs today)."""
    spec = _catalog.TIERS[tier]
    return (spec.id, kind, _catalog.kernel_head_dim(head_dim, spec.kinds.get(kind)), dtype_name, dtype_name)


def routed_tier(available, tier: str, head_dim: int, dtype_name: str, kind: str, requested: bool) -> str:
    """A tier that lacks a kernel (the SM90 tier: the backward, some head dims) hands the call to its
    fallback tier (the catalog's rule); so does one that was not built at all (e.g. FLASH_ATTN_CUDA_ARCHS=80) unless it
    was requested, which is left to check_kernel_available's error."""
    fallback = _catalog.TIERS[tier].fallback
    if fallback is None or kernel_key(tier, kind, head_dim, dtype_name) in available:
        return tier
    tier_built = any(key[0] == _catalog.TIERS[tier].id for key in available)
    if (tier_built or not requested) and kernel_key(fallback, kind, head_dim, dtype_name) in available:
        return fallback
    return tier


def check_kernel_available(available, tier: str, head_dim: int, dtype_name: str, kind: str = "fwd") -> None:
    """Raise a clear error when the build lacks the kernel for (tier, kind, head_dim, dtype)."""
    tier_id = _catalog.TIERS[tier].id
    built_tiers = sorted({key[0] for key in available})
    if tier_id not in built_tiers:
        built = ", ".join(_catalog.TIER_BY_ID[t].name for t in built_tiers) or "none"
        raise RuntimeError(
            f"flash_attention: tier {tier} is not built in this installation (built tiers: {built}); "
            "the tiers compiled are chosen at build time by FLASH_ATTN_CUDA_ARCHS"
        )
    key = kernel_key(tier, kind, head_dim, dtype_name)
    if key not in available:
        built = sorted((hd, dt) for (t, kd, hd, dt, _) in available if t == tier_id and kd == kind)
        raise RuntimeError(
            f"flash_attention: this build has no {tier} {kind} kernel for head dim {key[2]} ({dtype_name}), "
            f"which serves head dim {head_dim}; built (head dim, dtype): {built}. The head dims and architectures "
            "compiled are restricted at build time by FLASH_ATTN_HEAD_DIMS and FLASH_ATTN_CUDA_ARCHS; rebuild with "
            "them unset to get every kernel"
        )


def _route(index: int, kind: str, head_dim: int, dtype: torch.dtype, override: Optional[str]) -> Tuple[int, int]:
    available = available_kernels()
    dtype_name = DTYPE_NAMES[dtype]
    tier = routed_tier(available, select_tier(torch.cuda.get_device_capability(index), override), head_dim,
                       dtype_name, kind, override is not None)
    check_kernel_available(available, tier, head_dim, dtype_name, kind)
    key = kernel_key(tier, kind, head_dim, dtype_name)
    return key[0], key[2]


def device_index(device: torch.device) -> int:
    """A CUDA device's index; the current device's for a bare "cuda"."""
    return device.index if device.index is not None else torch.cuda.current_device()


# (device index, kind, head dim, dtype, override) -> (tier id, kernel head dim); a plain dict, the cheapest lookup.
_resolved = {}


def resolve(device: torch.device, kind: str, head_dim: int, dtype: torch.dtype, tier: Optional[str]) -> Tuple[int, int]:
    """(tier id, kernel head dim) of the kernel that runs this call. Resolved at run time rather than by the caller, so
    that FLASH_ATTN_TIER is read on every call, also under torch.compile; the rest is cached per key (an error is
    not: it is raised again on the next call)."""
    key = (device_index(device), kind, head_dim, dtype, requested_tier(tier))
    found = _resolved.get(key)
    if found is None:
        found = _resolved[key] = _route(*key)
    return found


def resolve_tier(device: torch.device, tier: Optional[str], head_dim: int, dtype: torch.dtype, kind: str) -> str:
    """The name of the tier that runs this call (for tests and tools)."""
    return _catalog.TIER_BY_ID[resolve(device, kind, head_dim, dtype, tier)[0]].name
