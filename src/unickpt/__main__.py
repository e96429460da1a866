"""``python -m unickpt ...``: the same command line as the ``unickpt`` console script
(``_unickpt_cli.main``: Ctrl-C is one line and exit status 130 from here on; during the import of
``unickpt`` itself, before this module runs, it is Python's own ``KeyboardInterrupt``). Imported
as a module (not run), it imports nothing: ``_unickpt_cli`` takes over SIGINT when imported."""

import sys

if __name__ == "__main__":
    from _unickpt_cli import main

    sys.exit(main())
