import pytest
import torch

from cpu_helpers import reference_forward
from flash_attention import _checks, _dispatch, _ops

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


# ---------------------------------------------------------------------------------------------------------------
# Stand-ins for the kernels and the extension, for the CPU tests

@pytest.fixture
def stub_kernel(monkeypatch):
    """Let CPU tensors through and run the reference in place of the kernels' forward (batched and varlen); returns
    the list of calls it received."""
    calls = []

    def fake_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
        calls.append(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                          seqused_k=seqused_k, max_seqlen=(max_seqlen_q, max_seqlen_k), softmax_scale=softmax_scale,
                          window=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                          deterministic=deterministic, tier=tier))
        return reference_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                 max_seqlen_k, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                                 deterministic, tier)

    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    monkeypatch.setattr(_ops, "forward_impl", fake_forward)
    python_autograd(monkeypatch)
    return calls


def python_autograd(monkeypatch):
    """Eager differentiable calls through the Python twin of the binding's C++ autograd node (the same formula), so
    that they reach the stand-ins."""
    monkeypatch.setattr(_ops, "_differentiable", lambda q, k, v, args: _ops._EagerAttention.apply(q, k, v, args))


@pytest.fixture
def no_extension(monkeypatch):
    """The extension fails to import, as in a build without CUDA: any kernel launch raises."""
    monkeypatch.setattr(_dispatch, "_extension", None)
    monkeypatch.setattr(_dispatch, "_EXTENSION_NAME", "flash_attention._no_such_extension")


@pytest.fixture(params=["eager", "op"])
def standin_ops(request, monkeypatch):
    """Let CPU tensors through and put CPU stand-ins in place of the kernels, so that the autograd formula and the
    fakes run, on either path: eagerly (the Python twin of the binding's autograd node), or through the custom ops as
    torch.compile would. The forwards are the
    reference, the backwards return 2 * dout, 3 * k and 4 * v, distinct for each input. Returns the calls they
    received, by kind: fwd and bwd for batched calls, varlen_fwd and varlen_bwd for varlen ones."""
    calls = {"fwd": [], "bwd": [], "varlen_fwd": [], "varlen_bwd": []}

    def forward(q, k, v, cu_seqlens_q, *args):
        out, lse = reference_forward(q, k, v, cu_seqlens_q, *args)
        calls["fwd" if cu_seqlens_q is None else "varlen_fwd"].append(dict(q=q, k=k, v=v, out=out, lse=lse))
        return out, lse

    def backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
        calls["bwd" if cu_seqlens_q is None else "varlen_bwd"].append(
            dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, cu_seqlens_q=cu_seqlens_q,
                 cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                 max_seqlen=(max_seqlen_q, max_seqlen_k), softmax_scale=softmax_scale,
                 window=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                 deterministic=deterministic, tier=tier))
        return tuple(g.contiguous() for g in (2 * dout, 3 * k, 4 * v))

    monkeypatch.setattr(_checks, "check_device", lambda tensors: None)
    monkeypatch.setattr(_ops, "forward_impl", forward)
    monkeypatch.setattr(_ops, "backward_impl", backward)
    if request.param == "op":
        monkeypatch.setattr(_ops, "_eager", lambda q, k, v: False)
    else:
        python_autograd(monkeypatch)
    calls["path"] = request.param
    return calls
