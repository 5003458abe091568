"""Adapters that plug flash_attention into other libraries; each submodule imports its library only when used."""
