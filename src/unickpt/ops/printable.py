"""Names from a checkpoint (tensor keys, blob keys, file names, object names) made safe to print
on a terminal: every tool that prints a name read from a checkpoint passes it through
``printable`` (``inspect``, ``verify``, ``diff``, ``merge``'s messages, ``ls``; ``cli.main``
passes each error line through it too).

A checkpoint is data someone else may have written: a key holding ``ESC [ 31 m`` would recolour
the terminal, ``U+202E`` (right-to-left override) would display ``weight.gpj`` for
``weight.jpg``, a newline would forge a line of the report. ``printable`` replaces each control
character (C0, C1, DEL), Unicode format character (bidi marks and overrides, zero-width
characters), line/paragraph separator, and lone surrogate (a non-UTF-8 byte of a file name,
decoded with ``surrogateescape``) by its escape (``\\x1b``, ``\\u202e``, ``\\udcff``), as
Python's ``repr`` would write it, and every backslash too (``\\\\``). Other text, non-ASCII
letters included, is left as it is; a name with no unsafe character is printed unchanged. The
same rule as ``format.names.printable`` (the save-time check's), where that module exists.
"""

from __future__ import annotations

from ..format.names import printable as _printable_name

__all__ = ["printable", "quoted"]


def printable(text: object) -> str:
    """``str(text)`` with every unsafe character and every backslash escaped (unchanged when it
    holds none): ``format.names.printable`` for any value a tool prints."""
    return _printable_name(str(text))


def quoted(text: object) -> str:
    """``'text'`` with ``printable``'s escapes (for messages that quote a name, as ``!r`` would,
    without doubling the escapes' backslashes)."""
    return f"'{printable(text)}'"
