"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/storage/test_storage_registry.py``, which holds its single-process tests."""

from __future__ import annotations

import os
import sys
import textwrap


def test_a4_no_environment_variable_is_read_at_import(tmp_path):
    """Importing every storage module reads no environment variable (checked in a fresh
    interpreter whose ``os.environ`` records every lookup)."""
    code = textwrap.dedent("""
        import os
        seen = []
        class Env(dict):
            def get(self, k, d=None):
                seen.append(k); return super().get(k, d)
            def __getitem__(self, k):
                seen.append(k); return super().__getitem__(k)
            def __contains__(self, k):
                seen.append(k); return super().__contains__(k)
        os.environ = Env(os.environ)
        import unickpt.storage, unickpt.storage.local, unickpt.storage.memory, unickpt.storage.retry
        import unickpt.folder.publish, unickpt.storage.registry
        print(sorted({k for k in seen if k.startswith("UNICKPT")}))
    """)
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
