"""The ``unickpt`` command line (console script ``unickpt = _unickpt_cli:main``, which installs its
Ctrl-C handling before importing this package, then calls ``run``; ``python -m unickpt``,
``python -m unickpt.cli``; ``main(argv)`` in-process).

``main(argv)`` parses the arguments (``build_parser``: argparse, one subcommand
each, added by the module of its group: ``cli.checkpoint`` (inspect, verify, diff),
``cli.export`` (merge, convert, modify), ``cli.report``, ``cli.manage`` (ls, latest, prune)) and
dispatches to the subcommand's ``_cmd_*`` function, which calls the library operations in
``unickpt.ops`` and renders the result; every name read from a checkpoint is printed through
``ops.printable.printable`` (control characters and bidi marks escaped). The CLI holds no logic
of its own beyond arguments, rendering and exit codes.

Errors: ``main`` is the one place that turns a failure into a message. Any exception a command
raises is printed as ONE line on stderr, ``unickpt <command>: error: [<path>: ]<ErrorType>:
<message>`` (the path the command was given is put first when the message does not name the file
itself; the message's own line breaks are joined), never a traceback. A unickpt
``CheckpointError`` or an ``OSError`` naming its file is an expected failure; anything else
(a library's error on a file it could not parse) is printed the same way with a hint to rerun with
``--debug`` (or ``UNICKPT_DEBUG=1``), which re-raises it with its traceback.

Exit codes: 0 success; 1 failure: the check the command ran failed (``inspect`` found data files
missing or shorter than the metadata says, ``inspect --verify`` / ``verify`` found corrupt or missing
data, ``diff`` found differences; the report is printed either way), or
the input is bad (not a checkpoint, incomplete or corrupt checkpoint, unsupported format version,
unreadable file); 2 usage errors (argparse's, a bad regular expression or size); 130 interrupted
(Ctrl-C at any moment, from the import of this package on: one line, ``unickpt <command>:
interrupted``, no traceback; ``_unickpt_cli``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Sequence

from ..errors import CheckpointError
from ..ops.printable import printable
from . import checkpoint, export, manage, report
from ._common import EXIT_ERROR, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

__all__ = ["main", "run", "build_parser", "EXIT_OK", "EXIT_FAILED", "EXIT_ERROR", "EXIT_USAGE", "EXIT_INTERRUPTED"]

DEBUG_ENV = "UNICKPT_DEBUG"

# the subcommands in the order ``unickpt --help`` lists them
_COMMANDS = (
    checkpoint.add_inspect,
    checkpoint.add_verify,
    export.add_merge,
    export.add_convert,
    report.add_report,
    export.add_modify,
    checkpoint.add_diff,
    manage.add_manage,
)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="unickpt", description="Unified checkpointing for PyTorch training: tools.")
    parser.add_argument("--version", action="version", version=f"unickpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(sub)
    debug_help = f"on an unexpected error, show the Python traceback (also: {DEBUG_ENV}=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    for command in sub.choices.values():  # `unickpt inspect X --debug` works as well as `unickpt --debug inspect X`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    return parser


_INPUTS = ("path", "src", "a", "b", "root", "folder")  # the arguments naming what a command reads
_OUTPUTS = ("out", "png", "trace", "sqlite", "hf_config")


_MAX_LINE = 2000  # characters of one error line (a library's message may hold a whole report)


def _unwrap(e: BaseException) -> BaseException:
    """The error a library's wrapper stands for: DCP's ``CheckpointException`` (a BaseException
    whose text embeds each rank's traceback) -> the first rank's own exception."""
    failures = getattr(e, "failures", None)
    if type(e).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]
    return e


def _from_interrupt(e: BaseException) -> bool:
    """Whether ``e`` stands for a Ctrl-C: a ``KeyboardInterrupt`` wrapped (``_unwrap``) or among
    its causes (e.g. an ImportError of a C extension interrupted while it loaded)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, KeyboardInterrupt) or isinstance(_unwrap(x), KeyboardInterrupt):
            return True
        todo += [x.__cause__, x.__context__]
    return False


def _error_line(command: str, args: argparse.Namespace, e: BaseException, expected: bool) -> str:
    """The one stderr line for ``e`` (module docstring): the file it is about first unless the
    message names it, the message's lines joined, every character printable."""
    e = _unwrap(e)
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip()) or repr(e)
    if len(text) > _MAX_LINE:
        text = text[:_MAX_LINE] + " ..."
    named = [getattr(args, a) for a in _INPUTS + _OUTPUTS if isinstance(getattr(args, a, None), str)]
    if isinstance(e, OSError) and e.filename is not None:
        subject: str | None = os.fsdecode(e.filename)
        if e.strerror:  # "[Errno 2] No such file or directory: 'x'" -> "No such file or directory"
            text = e.strerror + (f" (and {os.fsdecode(e.filename2)})" if e.filename2 is not None else "")
    else:
        inputs = [getattr(args, a) for a in _INPUTS if isinstance(getattr(args, a, None), str)]
        subject = inputs[0] if inputs else None
        forms = {f for p in named for f in (p, os.path.abspath(p), p.rstrip("/"))}
        if any(f and f in text for f in forms):
            subject = None  # the message names the file itself
    where = f"{subject}: " if subject is not None else ""
    hint = "" if expected else f" (unexpected: rerun with --debug or {DEBUG_ENV}=1 for the traceback)"
    return printable(f"unickpt {command}: error: {where}{type(e).__name__}: {text}{hint}")


def _expected(e: BaseException) -> bool:
    """A failure the message alone explains: unickpt's own errors, and a file the system refused."""
    return isinstance(e, CheckpointError) or (isinstance(e, OSError) and e.filename is not None)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return the exit code; Ctrl-C
    anywhere in it (parsing included) prints ``unickpt <command>: interrupted`` and returns 130.
    The console script goes through ``_unickpt_cli.main`` instead, which also covers the import
    of this package."""
    try:
        return run(argv)
    except KeyboardInterrupt:
        words = list(sys.argv[1:] if argv is None else argv)
        command = next((a for a in words if not a.startswith("-")), "")
        print(f"unickpt {command}: interrupted" if command else "unickpt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run(argv: Sequence[str] | None = None) -> int:
    """``main`` without its ``KeyboardInterrupt`` handling: a Ctrl-C (also one a library wrapped
    in its own exception) is raised as ``KeyboardInterrupt`` for the caller, which says it
    (``main``, ``_unickpt_cli``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(args.debug) or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        with warnings.catch_warnings():  # restores the process's warning settings afterwards
            warnings.showwarning = _warning_printer(args.command)
            # DCP's note that it runs without a process group: convert runs it in one process on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return func(args)
    except BrokenPipeError:  # `unickpt inspect ... | head`: stop quietly, as other CLI tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit flush
        return EXIT_OK
    except (SystemExit, GeneratorExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # also libraries' BaseException subclasses (DCP's CheckpointException)
        if _from_interrupt(e):  # a Ctrl-C a library wrapped or turned into its own error
            raise KeyboardInterrupt from e
        if debug:
            raise
        print(_error_line(args.command, args, e, _expected(e)), file=sys.stderr)
        return EXIT_ERROR


def _warning_printer(command: str) -> Callable[..., None]:
    """``warnings.showwarning`` for the CLI: one line per warning, ``unickpt <command>: warning:
    <Category>: <message>`` (printable), instead of the message and its source line."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, *rest: object) -> None:
        text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
        print(printable(f"unickpt {command}: warning: {category.__name__}: {text}"), file=sys.stderr)

    return show
