"""Issue 40 item 8: the Lightning strategies with the RAM tier turned on by their arguments
(``fast_root``, ``replicas``, ``durable_every``, ``keep_fast``): the real ``lightning.Trainer``,
``ModelCheckpoint`` (a checkpoint per epoch, ``last.ckpt``) and DDP on 2 gloo ranks, each a
simulated host (``UNICKPT_HOST_ID`` and a private RAM folder). Expected values come from an
uninterrupted run."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.workers.harness import run_ranks
from tests.workers.lightning_workers import trainer_on_the_ram_tier


def test_issue40_item8_lightning_strategy_resumes_from_peers_ram_like_the_uninterrupted_run(tmp_path) -> None:
    res = run_ranks(trainer_on_the_ram_tier, 2, str(tmp_path), timeout=600)
    for r in res:
        assert len(r["uninterrupted"]) == 9 and r["first"] == r["uninterrupted"][:6], r
        # each checkpoint path holds only the tier's step marker (a few bytes), the state is in the tier
        assert sorted(r["files"]) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"], r["files"]
        assert all(size < 100 for size in r["files"].values()), r["files"]
        assert r["resumed"] == r["uninterrupted"][6:], (r["resumed"], r["uninterrupted"])
        assert r["recovery"]["step"] == 6 and r["recovery"]["tier"] == "ram", r["recovery"]
        assert r["recovery"]["bytes"].get("peer", 0) > 0, r["recovery"]  # host b's part came from host a
