"""The tests that start processes (gloo ranks, subprocesses, an S3 server) of the subject of
``tests/unit/frameworks/test_base_optimizer_like.py``, which holds its single-process tests."""

from __future__ import annotations

from tests.unit.frameworks.test_base_optimizer_like import _check, _load, _save
from tests.workers.harness import run_ranks


def test_optimizer_like_wrapper_reshards_fsdp2_ws2_to_torch_ws1(tmp_path):
    ckpt = str(tmp_path / "c")
    res = run_ranks(_save, 2, "fsdp2", ckpt, timeout=240)
    ref = res[0]
    _check(_load("torch", ckpt, ref), ref)
