"""Exact attention for PyTorch with CuTe C++ kernels; a drop-in for flash-attn 2.x's functions, batched and
variable-length. flash_attention.cute mirrors FlashAttention-4's flash_attn.cute."""

from .kvcache import flash_attn_with_kvcache
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "__version__",
]
