import pytest
import torch

from flash_attention import _dispatch

_NO_GPU_SKIPS = pytest.StashKey[int]()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU and the built extension")


def pytest_collection_modifyitems(config, items):
    """Without a GPU, the cuda tests are skipped (and the summary says so in one line). With one, they run: a
    missing extension is reported by pytest_collection_finish instead of as skips that would pass the run."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Runs after -m and -k have deselected: only the cuda tests that will run count."""
    selected = sum(item.get_closest_marker("cuda") is not None for item in session.items)
    if not selected:
        return
    if not torch.cuda.is_available():
        session.config.stash[_NO_GPU_SKIPS] = selected
        return
    try:
        _dispatch.load_extension()
    except RuntimeError as e:
        pytest.exit(f"{selected} cuda tests selected on a machine with a GPU, but: {e}",
                    returncode=pytest.ExitCode.TESTS_FAILED)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = config.stash.get(_NO_GPU_SKIPS, 0)
    if skipped:
        terminalreporter.write_line(f"no CUDA GPU: the {skipped} tests marked cuda were skipped", yellow=True)
