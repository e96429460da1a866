"""A checkpointer's loads read on threads it keeps between them (``engine.load.schedule.ReaderThreads``,
``Resources.readers``): the second and later loads start no reader or verifier thread; ``close``
stops them; a pool too small for a load is replaced by a larger one, the old one still serving
a load that holds it until ``close``. (A process forked from one
that has them: tests/integration/distributed/test_load_round_trips.py.)"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import unickpt
from unickpt.engine.load.schedule import ReaderThreads
from unickpt.errors import ConfigurationError


def _ours() -> dict[int, str]:
    """The live reader and verifier threads of this process: {ident: name}."""
    return {
        t.ident: t.name
        for t in threading.enumerate()
        if t.ident is not None and t.name.startswith(("unickpt-read", "unickpt-verify"))
    }


def _model(seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def _saved(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    path = str(tmp_path / "ck")
    m = _model(1)
    unickpt.save(path, {"model": m}, options=unickpt.SaveOptions(files_per_rank=2))
    return path, {k: v.clone() for k, v in m.state_dict().items()}


def _exact(m: nn.Module, want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, want[k]) for k, v in m.state_dict().items())


def test_later_loads_start_no_threads_and_close_stops_them(tmp_path) -> None:
    path, want = _saved(tmp_path)
    before = _ours()
    ck = unickpt.Checkpointer()
    try:
        m = _model(2)
        ck.load(path, {"model": m})
        assert _exact(m, want)
        first = {i: n for i, n in _ours().items() if i not in before}
        assert any(n.startswith("unickpt-read") for n in first.values())  # two files: reader threads
        for seed in (3, 4, 5):
            m = _model(seed)
            ck.load(path, {"model": m})
            assert _exact(m, want)
            assert {i: n for i, n in _ours().items() if i not in before} == first  # the same threads, no new one
    finally:
        ck.close()
    assert not set(_ours()) & set(first)  # joined by close
    with pytest.raises(ConfigurationError, match="closed"):
        ck.resources.readers.pool("read", 1)


def test_a_pool_too_small_is_replaced_by_a_larger_one() -> None:
    kept = ReaderThreads()
    try:
        small = kept.pool("read", 2)
        assert kept.pool("read", 1) is small and kept.pool("read", 2) is small
        larger = kept.pool("read", 4)
        assert larger is not small
        assert small.submit(lambda: 7).result(timeout=60) == 7  # a load still using it keeps working
        done = threading.Barrier(4)  # four tasks that can only finish together: four threads at once
        tasks = [larger.submit(done.wait, 30) for _ in range(4)]
        assert all(isinstance(t.result(timeout=60), int) for t in tasks)
        assert kept.pool("verify", 1) is not larger  # one pool per kind
    finally:
        kept.close()
    with pytest.raises(RuntimeError):  # close stopped the replaced pool too
        small.submit(lambda: 7)
