"""``python -m unickpt.cli ...``: the same command line as the ``unickpt`` console script."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
