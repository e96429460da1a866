"""``python -m unickpt ...``: the same command line as the ``unickpt`` console script (``cli.main``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
