"""``python -m unickpt ...``: the same command line as the ``unickpt`` console script (``cli.main``).

The guard matters: ``unickpt demo`` spawns worker processes, which re-import this module as
``__mp_main__``; they must not run the command line again.
"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
