"""flash_attention.alias.install(): flash_attn's imports resolve to this package, never silently over a real one."""

import importlib
import sys

import pytest

import flash_attention
from flash_attention import alias, bert_padding, cute


def _flash_attn_modules():
    return {n: m for n, m in sys.modules.items() if n == "flash_attn" or n.startswith("flash_attn.")}


@pytest.fixture
def clean_modules(monkeypatch):
    """No flash_attn imported before the test, and the modules as they were after it."""
    before = _flash_attn_modules()
    for name in before:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in _flash_attn_modules():
        del sys.modules[name]
    sys.modules.update(before)


@pytest.fixture
def installed_flash_attn(tmp_path, monkeypatch):
    """A flash_attn package importable from sys.path, as pip would install it."""
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path / "flash_attn"


def test_imports_resolve_here(clean_modules):
    alias.install()
    import flash_attn
    import flash_attn.cute.interface
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
    from flash_attn.cute import flash_attn_func as fa4_func, flash_attn_varlen_func as fa4_varlen_func
    from flash_attn.flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache

    for name in flash_attention.__all__[:-1]:  # every function; the last is __version__
        assert getattr(flash_attn, name) is getattr(flash_attention, name)
    assert flash_attn_varlen_func is flash_attention.flash_attn_varlen_func
    assert (unpad_input, pad_input, index_first_axis) == (bert_padding.unpad_input, bert_padding.pad_input,
                                                          bert_padding.index_first_axis)
    assert (fa4_func, fa4_varlen_func) == (cute.flash_attn_func, cute.flash_attn_varlen_func)
    assert flash_attn.cute.interface is cute and flash_attn.__version__ == alias.FLASH_ATTN_VERSION
    assert flash_attn_with_kvcache is flash_attention.flash_attn_with_kvcache
    with pytest.raises(ModuleNotFoundError, match=r"flash_attn\.layers"):
        importlib.import_module("flash_attn.layers.rotary")


def test_install_twice_keeps_the_modules(clean_modules):
    alias.install()
    first = _flash_attn_modules()
    alias.install()
    assert _flash_attn_modules() == first


def test_refuses_to_shadow_an_installed_flash_attn(clean_modules, installed_flash_attn):
    with pytest.raises(RuntimeError, match=r"a flash-attn package is installed or imported \(.*flash_attn.*\), "
                                           r"and the alias would shadow it.*install\(replace_installed=True\)"):
        alias.install()
    assert not _flash_attn_modules()
    assert importlib.import_module("flash_attn").REAL


def test_refuses_to_replace_an_imported_flash_attn(clean_modules, installed_flash_attn):
    real = importlib.import_module("flash_attn")
    with pytest.raises(RuntimeError, match=r"installed or imported"):
        alias.install()
    assert sys.modules["flash_attn"] is real


def test_replace_installed_shadows_on_request(clean_modules, installed_flash_attn):
    importlib.import_module("flash_attn")
    alias.install(replace_installed=True)
    import flash_attn

    assert not hasattr(flash_attn, "REAL") and flash_attn.flash_attn_func is flash_attention.flash_attn_func
