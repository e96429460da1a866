"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/cli/test_cli_corpus.py``, which holds its single-process tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.unit.cli.test_cli_corpus import (
    Corpus,
    _names,
    corpus,  # noqa: F401 (a fixture)
)


@pytest.mark.parametrize("case", ["md_garbage", "non_utf8"])
def test_end_to_end_subprocess_one_line(corpus: Corpus, case: str) -> None:  # noqa: F811 (a fixture)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, "-m", "unickpt", "inspect", os.fsencode(corpus[case])],
        capture_output=True,
        timeout=120,
        env=env,
    )
    err = r.stderr.decode("utf-8")  # strict: the line must be valid UTF-8 (the odd name escaped)
    lines = [x for x in err.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].isprintable() and _names(lines[0], corpus[case]), err
