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

While torch itself is being imported (``import torch``, wherever a command first does it) a
Ctrl-C is deferred: the line is printed at once, and the ``KeyboardInterrupt`` is raised when
that import returns. torch's import runs native initialisers (``torch._C._autograd_init``,
``_c10d_init``) that call back into Python; an exception raised inside one of them cannot
unwind through the C++ frames, and the process aborted (SIGABRT instead of status 130; seen in
CI with a Ctrl-C 1 s into ``unickpt convert``). ``_DeferDuringImport``, a meta path finder in
front of the others while a command runs, wraps the loader of ``torch`` to do this.

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
_DEFER = ("torch",)  # top-level modules whose import runs with Ctrl-C deferred (module docstring)
_DEFERRING: list[str] = []  # the deferred imports running now (the main thread's import)


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
    if _DEFERRING:  # inside torch's import: raised when it returns (_DeferringLoader.exec_module)
        return
    raise KeyboardInterrupt


class _DeferringLoader:
    """The loader of a ``_DEFER`` module: the real one's, with Ctrl-C deferred while the module
    runs and the ``KeyboardInterrupt`` raised once it returned. The module keeps its real loader."""

    def __init__(self, loader: object) -> None:
        self._loader = loader

    def create_module(self, spec: object) -> object:
        return self._loader.create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module: object) -> None:
        _DEFERRING.append(getattr(module, "__name__", ""))
        try:
            self._loader.exec_module(module)  # type: ignore[attr-defined]
        finally:
            _DEFERRING.pop()
            spec = getattr(module, "__spec__", None)
            if spec is not None:
                spec.loader = self._loader
            module.__loader__ = self._loader  # type: ignore[attr-defined]
        if _FIRED and not _DEFERRING:
            raise KeyboardInterrupt

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)


class _DeferDuringImport:
    """A meta path finder placed first while a command runs: the spec the other finders give a
    ``_DEFER`` module, with its loader wrapped (``_DeferringLoader``)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name not in _DEFER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)  # type: ignore[arg-type]
            if spec is not None:
                if getattr(spec, "loader", None) is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _DeferringLoader(spec.loader)  # type: ignore[assignment]
                return spec
        return None


def main() -> int:
    """Run ``unickpt`` with ``sys.argv[1:]``; return its exit status (130 once interrupted,
    whatever the command did after the ``KeyboardInterrupt``)."""
    finder = _DeferDuringImport()
    try:
        try:
            sys.meta_path.insert(0, finder)  # type: ignore[arg-type]
            _sig.signal(_sig.SIGINT, _raise_once)
            from unickpt.cli import run

            code = run(sys.argv[1:])
        finally:
            _sig.signal(_sig.SIGINT, _sig.SIG_IGN)  # the command is over: a late Ctrl-C changes nothing
            if finder in sys.meta_path:  # type: ignore[comparison-overlap]
                sys.meta_path.remove(finder)  # type: ignore[arg-type]
    except BaseException as e:  # KeyboardInterrupt, or what a library made of it while unwinding
        if isinstance(e, KeyboardInterrupt) or _FIRED:
            return EXIT_INTERRUPTED
        raise
    return EXIT_INTERRUPTED if _FIRED else code
