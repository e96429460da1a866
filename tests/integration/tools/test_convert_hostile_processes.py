"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/ops/test_convert_hostile.py``, which holds its single-process tests."""

from __future__ import annotations

import subprocess
import sys

from tests.unit.ops.test_convert_hostile import (
    _edit,
    _info,
    case,  # noqa: F401 (a fixture)
    saved,  # noqa: F401 (a fixture: case's)
)


def test_cli_prints_a_dcp_refusal_as_one_line(case):  # noqa: F811 (a fixture)
    _edit(case / "src", lambda md: setattr(_info(md, "w", (0, 0)), "relative_path", "../other/__0_0.distcp"))
    r = subprocess.run(
        [sys.executable, "-m", "unickpt", "convert", "--from", "dcp", str(case / "src"), str(case / "ck")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "UnsafePathError" in lines[0] and "../other/__0_0.distcp" in lines[0], r.stderr
    assert not (case / "ck").exists()
