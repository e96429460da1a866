"""TokenPackingLoader and the unickpt.data protocol in one process: deterministic batches, state
carried across batches, and resharding across DP sizes that neither loses nor repeats a token
(issue 13)."""

from __future__ import annotations

import pytest

from tests.workers.loader_data import PAD, all_tokens, drain, make_loader, write_dataset
from unickpt.data import LoaderStateError, TokenPackingLoader
from unickpt.state.loader import loader_blobs


def _transfer(loaders):
    """What unickpt.save/load move between jobs: the replicated state once, every part once."""
    blobs = {}
    for ld in loaders:
        for k, v in loader_blobs(ld).items():
            assert k not in blobs, k
            blobs[k] = v
    rep = next(v for k, v in blobs.items() if k.startswith("dataloader/replicated"))
    parts = {int(k.split("-")[1]): v for k, v in blobs.items() if k.startswith("dataloader/part-")}
    return rep, parts


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (4, 3), (2, 1), (3, 2), (1, 3), (4, 4)])
def test_issue13_reshard_loses_and_repeats_nothing(tmp_path, old, new):
    sources = write_dataset(str(tmp_path / "d"))
    want = all_tokens(sources)
    before = [make_loader(sources, r, old) for r in range(old)]
    seen: list[int] = []
    for r, ld in enumerate(before):
        seen += drain(ld, limit=2 + r)  # ranks at different positions, partly used blocks in buffers
    rep, parts = _transfer(before)
    after = [make_loader(sources, r, new) for r in range(new)]
    for ld in after:
        ld.load_unickpt_state(rep["state"], parts, rep["dp_size"])
        seen += drain(ld)
    assert sorted(seen) == want


def test_issue13_same_size_resume_continues_exactly(tmp_path):
    sources = write_dataset(str(tmp_path / "d"))
    ref = make_loader(sources, 1, 2)
    full = [b.clone() for b in ref]
    run = make_loader(sources, 1, 2, num_workers=2)
    first = [next(run) for _ in range(3)]
    assert run._ahead is not None  # batch 4 is being read ahead: the state must not include it
    rep, parts = _transfer([make_loader(sources, 0, 2), run])
    resumed = make_loader(sources, 1, 2)
    resumed.load_unickpt_state(rep["state"], parts, 2)
    rest = list(resumed)
    got = first + rest
    assert len(got) == len(full) and all((a == b).all() for a, b in zip(got, full))
    run.close()


def test_issue13_batches_are_packed_from_both_sources_in_ratio(tmp_path):
    sources = write_dataset(str(tmp_path / "d"))
    code_max = sum(n for n in (700, 1, 523))
    ld = make_loader(sources, 0, 1, epochs=None, batch_size=8)
    toks = [t for _ in range(20) for t in next(ld).reshape(-1).tolist()]
    code = sum(1 for t in toks if 0 <= t < code_max)
    assert PAD not in toks and 0.1 < code / len(toks) < 0.45  # weights 1:3 -> about 25% code


def test_issue13_refusals(tmp_path):
    sources = write_dataset(str(tmp_path / "d"))
    with pytest.raises(LoaderStateError, match="num_parts"):
        make_loader(sources, 0, 13)  # more DP ranks than parts
    rep, parts = _transfer([make_loader(sources, 0, 1)])
    other = make_loader(sources, 0, 1, seed=6)
    with pytest.raises(LoaderStateError, match="seed"):
        other.load_unickpt_state(rep["state"], parts, 1)
    with pytest.raises(ValueError):
        TokenPackingLoader(sources, {"code": 1.0}, seq_len=4, batch_size=1, dp_rank=0, dp_size=1)
