"""Opt-in: make code written for flash-attn run on this package without changing its imports.

    import flash_attention.alias
    flash_attention.alias.install()  # once, before the code that imports flash_attn

Afterwards, in this process, `flash_attn` and `flash_attn.flash_attn_interface` are flash-attn 2's functions (this
package's flash_attention module), `flash_attn.bert_padding` is flash_attention.bert_padding and `flash_attn.cute`
(also as `flash_attn.cute.interface`) is flash_attention.cute. Nothing else of flash-attn is there (its layers,
modules, ops and `flash_attn_2_cuda`); `flash_attn_with_kvcache` is flash_attention's (flash_attention.kvcache). No
distribution named flash-attn is registered, so importlib.metadata, and libraries that check it (such as
transformers' is_flash_attn_2_available), still see none: use flash_attention.integrations.transformers there.

install() never shadows a flash-attn that is installed or already imported: it raises, unless
replace_installed=True says to shadow it in this process (the installed package is left as it is on disk).
"""

import importlib.util
import sys
import types

from . import bert_padding, cute, interface, kvcache

# The flash-attn 2 release whose signatures flash_attention's functions follow, so that callers' version checks
# (flash-attn 2.1 moved causal masks to the bottom-right alignment that this package uses) take its path.
FLASH_ATTN_VERSION = "2.8.4"

_FUNCTIONS = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
              "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func")


def _module(name: str, source: types.ModuleType, functions) -> types.ModuleType:
    """A package named name holding source's functions; a package, so that importing a submodule that is not
    aliased fails with ModuleNotFoundError."""
    module = types.ModuleType(name, f"flash_attention's stand-in for {name} (flash_attention.alias)")
    module.__path__ = []
    for function in functions:
        setattr(module, function, getattr(source, function))
    return module


def _flash_attn_2_module(name: str) -> types.ModuleType:
    module = _module(name, interface, _FUNCTIONS)
    module.flash_attn_with_kvcache = kvcache.flash_attn_with_kvcache
    return module


def _installed_flash_attn():
    """Where an importable flash-attn is, else None (found without importing it)."""
    spec = importlib.util.find_spec("flash_attn")
    return None if spec is None else (spec.origin or ", ".join(spec.submodule_search_locations or ()))


def install(*, replace_installed: bool = False) -> None:
    """Make flash_attn, flash_attn.flash_attn_interface, flash_attn.bert_padding and flash_attn.cute (and
    flash_attn.cute.interface) import this package's equivalents in this process. Calling it again does nothing.
    Raises RuntimeError when a flash-attn is installed or imported, unless replace_installed=True."""
    imported = sys.modules.get("flash_attn")
    if getattr(imported, "__flash_attention_alias__", False):
        return
    found = repr(imported) if imported is not None else _installed_flash_attn()
    if found is not None and not replace_installed:
        raise RuntimeError(
            f"flash_attention.alias.install(): a flash-attn package is installed or imported ({found}), and the "
            "alias would shadow it. Uninstall it (pip uninstall flash-attn flash-attn-4), or call "
            "install(replace_installed=True) to use flash-attention-cute in its place in this process"
        )
    package = _flash_attn_2_module("flash_attn")
    package.__version__ = FLASH_ATTN_VERSION
    package.__flash_attention_alias__ = True
    package.flash_attn_interface = _flash_attn_2_module("flash_attn.flash_attn_interface")
    package.bert_padding = bert_padding
    package.cute = _module("flash_attn.cute", cute, ("flash_attn_func", "flash_attn_varlen_func"))
    package.cute.interface = cute
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]  # the shadowed package's submodules, when replace_installed
    sys.modules.update({"flash_attn": package, "flash_attn.flash_attn_interface": package.flash_attn_interface,
                        "flash_attn.bert_padding": bert_padding, "flash_attn.cute": package.cute,
                        "flash_attn.cute.interface": cute})
