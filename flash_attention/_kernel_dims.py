"""The head dims the kernels are compiled for: the one list that the build (csrc/generate_kernels.py), the binding's
caller (_ops) and the tests read. No torch import, so the build can load this file on its own."""

KERNEL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def kernel_head_dim(head_dim: int) -> int:
    """The compiled head dim that serves `head_dim`: the smallest one that is at least as large."""
    for kernel_dim in KERNEL_HEAD_DIMS:
        if head_dim <= kernel_dim:
            return kernel_dim
    raise ValueError(f"head dim must be at most {KERNEL_HEAD_DIMS[-1]}, got {head_dim}")
