import pytest
import torch

from flash_attention import _dispatch


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and the built extension")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        reason = "no CUDA GPU"
    elif not _dispatch.extension_available():
        reason = "the CUDA extension flash_attention._C is not built or fails to import"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
