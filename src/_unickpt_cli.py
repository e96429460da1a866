"""The ``unickpt`` console script's entry (``[project.scripts]``; ``python -m unickpt`` too): Ctrl-C
at any moment of a command is one line on stderr, ``unickpt <command>: interrupted``, and exit
status 130, never a traceback (issue 39, item 14).

Why a module of its own, outside the ``unickpt`` package: importing ``unickpt.cli`` first imports
``unickpt/__init__`` (numpy, the metadata codec: a tenth of a second or more), and the
arguments' types import torch while argparse parses; a SIGINT there raised ``KeyboardInterrupt``
outside any handler (a traceback, and the interpreter's exit by SIGINT). This module imports only
``os``, ``sys`` and ``_signal`` (loaded with the interpreter) and installs its handler as it is
imported, before anything heavy:

  until ``main`` runs     ``_exit_now``: the line, then ``os._exit(130)`` (nothing started yet);
  import, parse, command  ``_raise_once``: the line, then ``KeyboardInterrupt``, so the command's
                          ``finally`` blocks clean up (partial outputs); stderr is closed after
                          the line (what unwinds adds nothing) and the exit status is 130
                          whatever the command does next; a second Ctrl-C during that clean-up
                          exits at once;
  after the command       ignored: its output is complete, its exit status stands.

``unickpt.cli.run`` parses and dispatches and lets ``KeyboardInterrupt`` through (also when a
library wrapped it, as DCP does); ``unickpt.cli.main(argv)``, the in-process form, turns it into
the same line and 130 itself. Import this module only to run the command line: importing it takes
over SIGINT. What stays uncovered: the interpreter's own start-up before this
module runs (Python's ``site``, the script's first line), a few milliseconds.
"""

import os
import sys

try:  # the C module under ``signal``: always loaded; ``signal`` itself imports enum (milliseconds)
    import _signal as _sig
except ImportError:  # an interpreter without it
    import signal as _sig  # type: ignore[no-redef]

__all__ = ["main", "EXIT_INTERRUPTED"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command Ctrl-C stopped
_FIRED: list[int] = []  # the SIGINTs received (the handlers' only state; this process runs one command)


def _say_interrupted() -> None:
    """The one line, once; then stderr goes to /dev/null: what unwinds after an interrupt (a
    library's warning with a traceback, an error wrapping the KeyboardInterrupt) adds nothing."""
    argv = sys.argv[1:]
    command = next((a for a in argv if not a.startswith("-")), "")  # no top-level option takes a value
    line = f"unickpt {command}: interrupted\n" if command else "unickpt: interrupted\n"
    try:  # from a signal handler: no buffered stream (the main thread may be inside a write to it)
        os.write(2, line.encode(errors="replace"))
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    except OSError:
        pass


def _exit_now(signum: int, frame: object) -> None:
    _say_interrupted()
    os._exit(EXIT_INTERRUPTED)


# at import, as early as the handler can run: the console script's first line imports this module
_sig.signal(_sig.SIGINT, _exit_now)


def _exit_silently(signum: int, frame: object) -> None:
    os._exit(EXIT_INTERRUPTED)


def _raise_once(signum: int, frame: object) -> None:
    _FIRED.append(signum)
    _say_interrupted()
    _sig.signal(_sig.SIGINT, _exit_silently)
    raise KeyboardInterrupt


def main() -> int:
    """Run ``unickpt`` with ``sys.argv[1:]``; return its exit status (130 once interrupted,
    whatever the command did after the ``KeyboardInterrupt``)."""
    try:
        try:
            _sig.signal(_sig.SIGINT, _raise_once)
            from unickpt.cli import run

            code = run(sys.argv[1:])
        finally:
            _sig.signal(_sig.SIGINT, _sig.SIG_IGN)  # the command is over: a late Ctrl-C changes nothing
    except BaseException as e:  # KeyboardInterrupt, or what a library made of it while unwinding
        if isinstance(e, KeyboardInterrupt) or _FIRED:
            return EXIT_INTERRUPTED
        raise
    return EXIT_INTERRUPTED if _FIRED else code
