"""torchtitan's own tests/unit_tests/test_checkpoint.py (vendored, see its header) with
``CheckpointManager`` bound to ``UnickptCheckpointManager``: one process, no process group."""

import pytest

pytest.importorskip("torchtitan.components.checkpointer")
