"""Make the reliability helpers importable here and in spawned child processes (spawn copies
``sys.path`` into the child)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
