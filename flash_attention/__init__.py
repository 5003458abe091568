"""Exact attention for PyTorch with CuTe C++ kernels; a drop-in for flash-attn 2.x's forward functions."""

from .interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "__version__"]
