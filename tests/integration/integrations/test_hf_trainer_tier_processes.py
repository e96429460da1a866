"""Issue 40 item 8: the HF Trainer mixin with the RAM tier turned on by its knobs
(``unickpt_fast_root``, ``unickpt_replicas``, ``unickpt_durable_every``, ``unickpt_keep_fast``):
the real ``transformers.Trainer`` and a tiny Llama on 2 gloo ranks, each a simulated host
(``UNICKPT_HOST_ID`` and a private RAM folder). Expected values come from an uninterrupted run."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.workers.accelerate_workers import trainer_on_the_ram_tier
from tests.workers.harness import run_ranks


def test_issue40_item8_hf_trainer_resumes_from_peers_ram_like_the_uninterrupted_run(tmp_path) -> None:
    res = run_ranks(trainer_on_the_ram_tier, 2, str(tmp_path), timeout=600)
    for r in res:
        assert len(r["uninterrupted"]) == 6 and r["first"] == r["uninterrupted"][:4], r
        # checkpoint-N holds the Trainer's own files and the tier's step marker, no unickpt/ folder
        for name in ("checkpoint-2", "checkpoint-4"):
            assert "unickpt-tier.json" in r["folders"][name] and "unickpt" not in r["folders"][name], r["folders"]
            assert "trainer_state.json" in r["folders"][name]
        assert r["resumed"] == r["uninterrupted"][4:], (r["resumed"], r["uninterrupted"])
        assert r["recovery"]["step"] == 4 and r["recovery"]["tier"] == "ram", r["recovery"]
        assert r["recovery"]["bytes"].get("peer", 0) > 0, r["recovery"]  # host b's part came from host a
