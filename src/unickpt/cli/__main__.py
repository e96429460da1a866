"""``python -m unickpt.cli ...``: the same command line as the ``unickpt`` console script
(``_unickpt_cli.main``; imported as a module, not run, it imports nothing)."""

import sys

if __name__ == "__main__":
    from _unickpt_cli import main

    sys.exit(main())
