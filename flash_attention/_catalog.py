"""The kernel catalog: the one table of what this package can build and run. The build (csrc/generate_kernels.py,
csrc/build_config.py, csrc/compile_check.py), the Python routing (_dispatch.py) and the input checks read it; a head
dim, an arch or a tier rule is written here and nowhere else. No torch import, so the build loads this file on its
own, by path.

A tier is one architecture's family of kernels (one folder of csrc/); a kind is what a kernel computes (fwd, bwd,
combine of split-KV partials, append-KV, the gather of a paged cache), each kind with its own params type. A kernel is
keyed by (tier, kind, kernel head dim, dtype in, dtype out): the only properties that change its machine code's
shape.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

Capability = Tuple[int, int]

# Head dims the kernels are compiled for; a call runs on the smallest one at least as large as its head dim
# (zero-padded to a multiple of 8).
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = HEAD_DIMS[-1]

# dtype name -> (torch dtype attribute, C++ element type, flash::DType enumerator)
DTYPES = {"fp16": ("float16", "cutlass::half_t", "kFloat16"),
          "bf16": ("bfloat16", "cutlass::bfloat16_t", "kBFloat16")}
# (dtype in, dtype out) of the kernels built; FP8 inputs with 16-bit outputs would join here.
DTYPE_PAIRS = (("fp16", "fp16"), ("bf16", "bf16"))

# Archs a default build compiles for (FLASH_ATTN_CUDA_ARCHS overrides): Ampere, Hopper, consumer Blackwell.
DEFAULT_ARCHS = (80, 90, 120)


@dataclasses.dataclass(frozen=True)
class Kind:
    params: str  # C++ params type of its launch (csrc/common/params.h)
    header: str  # launch header of the tier that defines its run function, relative to csrc/
    head_dims: Tuple[int, ...] = HEAD_DIMS
    # One kernel, compiled at the largest of head_dims, serves every head dim up to it (it loops over the dims).
    any_head_dim: bool = False
    # Paged K / V: the page sizes it reads are multiples of this (sm90/tile_traits.h: kPageMultiple); 0: no pages.
    page_multiple: int = 0
    # The kernel head dims whose kernels read pages (None: all of head_dims).
    paged_head_dims: Optional[Tuple[int, ...]] = None
    # Pages of a multiple of this arrive by TMA (sm90/tile_traits.h: kPageBoxRows); the other multiples of
    # page_multiple are copied row by row, about 10% slower than a contiguous cache (0: no such split).
    page_box_rows: int = 0


@dataclasses.dataclass(frozen=True)
class Tier:
    name: str
    id: int  # the tier's number in the C++ registry key
    archs: Tuple[int, ...]  # archs its code is compiled for and runs on (SASS; PTX for the first one when portable)
    capabilities: Tuple[Capability, Capability]  # inclusive range of compute capabilities it runs on
    kinds: Dict[str, Kind]
    header_dirs: Tuple[str, ...]  # folders of csrc/ (beside common/) whose headers its kernels include
    arch_suffix: str = ""  # "a": arch-specific instructions (wgmma, setmaxnreg), so no portable PTX either
    defines: Tuple[str, ...] = ()  # preprocessor macros for its kernel files
    # The tier that runs what this one lacks (kinds, head dims): it must run wherever this one does and share its
    # lse convention, so that a forward on one tier and its backward on the other agree.
    fallback: Optional[str] = None

    @property
    def namespace(self) -> str:
        return f"flash::{self.name}"

    def runs_on(self, capability: Capability) -> bool:
        lo, hi = self.capabilities
        return lo <= tuple(capability) <= hi


TIERS = {
    "sm80": Tier("sm80", 80, (80, 86, 87, 89, 90, 120, 121), ((8, 0), (99, 99)),
                 {"fwd": Kind("FwdParams", "sm80/fwd_launch.h", page_multiple=1),
                  "bwd": Kind("BwdParams", "sm80/bwd_launch.h"),
                  "combine": Kind("CombineParams", "sm80/combine_launch.h"),
                  "append": Kind("AppendParams", "sm80/append_launch.h", (MAX_HEAD_DIM,), any_head_dim=True),
                  "gather": Kind("GatherParams", "sm80/gather_launch.h", (MAX_HEAD_DIM,), any_head_dim=True)},
                 ("sm80",)),
    # Its d 256 key blocks of 80 columns need CuTe's wgmma shapes with N not a power of two.
    "sm90": Tier("sm90", 90, (90,), ((9, 0), (9, 0)),
                 {"fwd": Kind("FwdParams", "sm90/fwd_launch.h", (64, 96, 128, 192, 256), page_multiple=16,
                              paged_head_dims=(64, 128, 192, 256), page_box_rows=64),
                  "bwd": Kind("BwdParams", "sm90/bwd_launch.h", (64, 96, 128, 192, 256))},
                 ("sm90",), "a", ("CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",), fallback="sm80"),
}
TIER_BY_ID = {tier.id: tier for tier in TIERS.values()}
KINDS = tuple(dict.fromkeys(kind for tier in TIERS.values() for kind in tier.kinds))
MIN_CAPABILITY = min(tier.capabilities[0] for tier in TIERS.values())


def kernel_head_dim(head_dim: int, kind: Optional[Kind] = None) -> int:
    """The compiled head dim that serves `head_dim`: the smallest one that is at least as large (the kind's one for a
    kind that takes any head dim)."""
    for kernel_dim in HEAD_DIMS:
        if head_dim <= kernel_dim:
            return kind.head_dims[-1] if kind is not None and kind.any_head_dim else kernel_dim
    raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


def default_tier(capability: Capability) -> str:
    """The tier for a GPU: the newest one that runs on it (its fallback takes what it lacks)."""
    tiers = [tier for tier in TIERS.values() if tier.runs_on(capability)]
    if not tiers:
        raise RuntimeError(
            f"flash_attention: GPUs of compute capability {capability[0]}.{capability[1]} are not supported; it needs "
            f"compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ampere, Ada, Hopper, Blackwell)"
        )
    return max(tiers, key=lambda tier: tier.id).name
