"""Where CUTLASS is, which archs, kinds, head dims and dtypes to build, and the nvcc command for one kernel source.

Shared by setup.py (the real build) and csrc/compile_check.py (CI's compile-only check); what exists comes from the
catalog (flash_attention/_catalog.py), the environment only narrows it.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from generate_kernels import catalog

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

CUTLASS_HELP = (
    "flash-attention-cute needs the CUTLASS 4.2 headers: `pip install nvidia-cutlass==4.2.0.0 --no-deps` (only its "
    "headers are used), or point CUTLASS_DIR at a CUTLASS v4.2.0 checkout (or put one at 3rd/cutlass)."
)


def cutlass_include_dirs() -> list[Path]:
    """CUTLASS headers, in order: $CUTLASS_DIR, a checkout at 3rd/cutlass, the nvidia-cutlass pip package."""
    candidates = []
    if os.environ.get("CUTLASS_DIR"):
        candidates.append(Path(os.environ["CUTLASS_DIR"]))
    candidates.append(ROOT / "3rd" / "cutlass")
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "source")
    for base in candidates:
        if (base / "include" / "cute" / "tensor.hpp").exists():
            return [base / "include", base / "tools" / "util" / "include"]
    raise RuntimeError(CUTLASS_HELP)


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name)
    return [x.strip() for x in raw.replace(";", ",").split(",") if x.strip()] if raw else None


def requested_archs() -> list[int]:
    """FLASH_ATTN_CUDA_ARCHS, e.g. "80;90;120" (also accepts commas and a trailing 'a'); default: the catalog's."""
    raw = _env_list("FLASH_ATTN_CUDA_ARCHS")
    return [int(a.rstrip("a")) for a in raw] if raw else list(catalog.DEFAULT_ARCHS)


def requested_head_dims() -> list[int] | None:
    """FLASH_ATTN_HEAD_DIMS, e.g. "128" or "64,128": build only these kernel head dims (for fast iteration)."""
    raw = _env_list("FLASH_ATTN_HEAD_DIMS")
    return [int(x) for x in raw] if raw else None


def requested_kinds() -> list[str] | None:
    """FLASH_ATTN_KINDS (or its older name FLASH_ATTN_DIRECTIONS), e.g. "fwd": build only these kernel kinds."""
    return _env_list("FLASH_ATTN_KINDS") or _env_list("FLASH_ATTN_DIRECTIONS")


def requested_dtypes() -> list[str] | None:
    """FLASH_ATTN_DTYPES, e.g. "bf16": build only the kernels taking these input dtypes."""
    return _env_list("FLASH_ATTN_DTYPES")


def nvcc_path() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if not found:
        raise RuntimeError("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
    return found


def gencode_flags(archs: list[int], ptx_arch: int | None, suffix: str = "") -> list[str]:
    """SASS for each arch (sm_90a with suffix "a"), plus PTX for ptx_arch."""
    flags = [f"-gencode=arch=compute_{a}{suffix},code=sm_{a}{suffix}" for a in sorted(set(archs))]
    if ptx_arch is not None:
        flags.append(f"-gencode=arch=compute_{ptx_arch},code=compute_{ptx_arch}")
    return flags


def nvcc_command(source: Path, obj: Path, archs: list[int], ptx_arch: int | None, suffix: str = "",
                 defines: tuple[str, ...] = ()) -> list[str]:
    includes = [f"-I{p}" for p in [CSRC, *cutlass_include_dirs()]]
    flags = ["-std=c++20", "-O3", "--use_fast_math", "--expt-relaxed-constexpr", "-DNDEBUG", *(f"-D{d}" for d in defines),
             "-Xcompiler", "-fPIC", "-Xptxas=-v", *gencode_flags(archs, ptx_arch, suffix)]
    return [nvcc_path(), "-c", str(source), "-o", str(obj), *includes, *flags]
