"""Imports that stay light: names of a package that load from their modules on first use (PEP 562), and httpx
without its command line."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each of ``names`` (name -> relative module) is imported on
    first access and then kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__


def import_httpx() -> types.ModuleType:
    """``import httpx`` without httpx's own command line.

    httpx's ``__init__`` imports ``httpx._main`` for the ``httpx`` script whenever click and rich are installed:
    55-75 ms, half of the import, paid by every ``transformd resolve`` of an engine's start-up. A placeholder
    module without ``main`` stands in for it during the first import (httpx then defines its fallback ``main``,
    which no client calls) and is removed after, so a later ``import httpx._main`` loads the real module.
    """
    if "httpx" not in sys.modules:
        placeholder = sys.modules.setdefault("httpx._main", types.ModuleType("httpx._main"))
        try:
            import httpx  # noqa: F401
        finally:
            if sys.modules.get("httpx._main") is placeholder:
                del sys.modules["httpx._main"]
    return sys.modules["httpx"]
