"""What the subcommand modules share: the exit codes, and the argument types (``type=`` of
``argparse``), each of which turns a bad value into an ``ArgumentTypeError``, so it is a usage
error (exit 2) with argparse's message."""

from __future__ import annotations

import argparse
import re

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_ERROR",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "positive",
    "regex",
    "rename",
    "size",
    "role",
]

EXIT_OK = 0
EXIT_FAILED = 1  # the check failed
EXIT_ERROR = 1  # bad input: no (complete, readable) checkpoint, a file that cannot be read
EXIT_USAGE = 2  # bad arguments
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it; also _unickpt_cli.EXIT_INTERRUPTED)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"bad regular expression {text!r}: {e}") from None


def rename(text: str) -> tuple[re.Pattern[str], str]:
    from ..ops.modify import parse_rename

    try:
        return parse_rename(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size(text: str) -> int:
    from ..ops.merge import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def role(text: str) -> str:
    if not text or "/" in text or text.startswith("."):
        raise argparse.ArgumentTypeError(f"invalid role {text!r} (a plain folder name)")
    return text
