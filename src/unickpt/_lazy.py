"""Lazy public names of a package (PEP 562): ``__getattr__`` / ``__dir__`` built from one table.

A package's ``__init__`` calls ``lazy_exports(__name__, table)`` once at import and binds the
two functions it returns; a name of the table is imported from its module on first access and
cached in the package's namespace, so ``import unickpt`` (and the metadata commands) never pay
for torch until a call needs it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, table: Mapping[str, str | tuple[str, str | None]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a public name to its module
    (relative to ``package``; the attribute of the same name), or to ``(module, attribute)``
    (attribute None: the module itself)."""

    def __getattr__(name: str) -> Any:
        try:
            where = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module_name, attr = (where, name) if isinstance(where, str) else where
        module = importlib.import_module(module_name, package)
        value = module if attr is None else getattr(module, attr)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
