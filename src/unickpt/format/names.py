"""Names a checkpoint may hold, and how to print any name safely.

A tensor fqn, a blob key, a metadata object key or a top-level ``extra_state`` key is shown by
``unickpt inspect`` / ``ls`` / ``diff`` and in error messages, so a name with a control character,
a NUL, a line or paragraph separator, a lone surrogate or an invisible format character (bidi
overrides and isolates U+202A-U+202E, U+2066-U+2069, marks U+200E/U+200F, zero-width characters:
Unicode categories Cc, Cf, Cs, Zl, Zp) could rewrite a terminal or make two names look alike.
``check_save_names`` refuses them when a save describes its state (``SavePipeline.describe``,
every rank, before anything is written) with ``UnsafeNameError`` naming the name escaped.
``printable(name)`` is what the tools print for names read from a checkpoint written before (or
by another tool): the name itself when it is safe, else with every unsafe character (and every
backslash) escaped as Python escapes it (``\\x1b``, ``\\u202e``).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ..errors import UnsafeNameError

__all__ = ["UNSAFE_CATEGORIES", "unsafe_char", "printable", "check_names", "check_save_names"]

UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_ASCII_PRINTABLE = bytes(range(0x20, 0x7F))  # ASCII outside it: the control characters (Cc)


class _Item(Protocol):
    @property
    def spec(self) -> Any: ...


def unsafe_char(name: str) -> str | None:
    """The first character of ``name`` a checkpoint name may not hold, or None."""
    if name.isprintable():  # in C: every unsafe category is unprintable (a save checks every fqn)
        return None
    for c in name:
        if unicodedata.category(c) in UNSAFE_CATEGORIES:
            return c
    return None


def _escape(c: str) -> str:
    n = ord(c)
    if c == "\\":
        return "\\\\"
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def printable(name: str) -> str:
    """``name`` safe to print on a terminal: unchanged when it holds no unsafe character, else
    with each unsafe character and each backslash escaped (``"a\\x1b[31m"``, ``"x\\u202ey"``)."""
    if unsafe_char(name) is None:
        return name
    return "".join(_escape(c) if c == "\\" or unicodedata.category(c) in UNSAFE_CATEGORIES else c for c in name)


def check_names(what: str, names: Iterable[str]) -> None:
    """``UnsafeNameError`` for the first of ``names`` (``what``: "tensor", "extra_state key" ...)
    holding an unsafe character."""
    strs = [n for n in names if isinstance(n, str)]  # others (int keys ...) are no names judged here
    joined = "".join(strs)
    if joined.isascii() and not joined.encode("ascii").translate(None, _ASCII_PRINTABLE):
        return  # the usual case, in C over all names at once (a save checks every fqn)
    for name in strs:
        c = unsafe_char(name)
        if c is not None:
            raise UnsafeNameError(
                f"cannot save {what} '{printable(name)}': its name holds U+{ord(c):04X} "
                f"({unicodedata.name(c, unicodedata.category(c))}); names in a checkpoint may not hold control "
                "characters, NUL, line separators or invisible format characters (bidi marks, zero-width "
                "characters): rename it before saving"
            )


def check_save_names(
    items: Iterable[_Item], objects: Mapping[str, Any], blobs: Mapping[str, Any], extra_state: Any
) -> None:
    """Every name one rank's save would write: tensor fqns (``items``' specs), metadata object
    keys, blob keys and the top-level keys of ``extra_state`` (a dict's keys name its parts;
    keys deeper inside are data, saved as they are)."""
    check_names("tensor", {item.spec.fqn for item in items})
    check_names("object", objects)
    check_names("blob", blobs)
    if isinstance(extra_state, Mapping):
        check_names("extra_state key", extra_state)
