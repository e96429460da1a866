"""Import paths shared by every test folder and the ranks it spawns (``spawn`` copies
``sys.path`` into the child): ``tests/`` for the test-only oracles (``support``), and
``tests/distributed`` for the launcher harness and the distributed workers, and the other
folders' worker modules (so the S3 tests can run the same workers on ``s3://``; ``tests/megatron``
holds the megatron-core test bed ``megatron_env``)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (
    os.path.join(_HERE, "distributed"),
    os.path.join(_HERE, "data"),
    os.path.join(_HERE, "monitoring"),
    os.path.join(_HERE, "reliability"),
    os.path.join(_HERE, "megatron"),
    _HERE,
):
    if _path not in sys.path:
        sys.path.insert(0, _path)
