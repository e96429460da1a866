"""The trainer integrations with a ``gs://`` / ``az://`` checkpoint path, against the emulators
the fixtures start (issue 42, item 3), parametrised over both services.

Lightning: the strategy saves and loads any unickpt storage URL (``trainer.save_checkpoint``,
``fit(ckpt_path=...)``, ``remove_checkpoint``, Fabric's ``save``/``load``), so a run resumed
from the cloud is checked against the same run uninterrupted, bit for bit. Lightning's own
``ModelCheckpoint(dirpath="gs://...")`` lists and checks its folder through fsspec (gcsfs /
adlfs, not unickpt's storage; not installed here), as it does for ``s3://``: not tested."""

from __future__ import annotations

import pytest
import torch

from tests.integration.storage.test_cloud_checkpoint import cloud  # noqa: F401 (a fixture)
from tests.workers.harness import run_ranks
from unickpt.format.records import METADATA_FILE
from unickpt.storage import open_storage

pytest.importorskip("lightning")


def test_issue42_item3_lightning_trainer_and_fabric_resume_bit_exact(cloud):  # noqa: F811 (a fixture)
    from tests.workers.cloud_integration_workers import lightning_on_url

    url = cloud.url("lightning")
    outs = run_ranks(lightning_on_url, 2, url, timeout=600)
    for out in outs:
        steps = len(out["resumed"])
        assert steps > 0 and out["resumed"] == out["whole"][-steps:], (out["whole"], out["resumed"])
        for k, v in out["whole_params"].items():
            assert torch.equal(out["resumed_params"][k], v), k
        assert out["fabric_resumed"] == [*out["fabric_whole"][3:], 5.0]
    names = open_storage(url).list()
    assert f"epoch0/{METADATA_FILE}" in names and f"fabric/{METADATA_FILE}" in names
    assert not [n for n in names if n.startswith("gone/")], names  # remove_checkpoint on the URL


def test_issue42_item3_verl_manager_saves_retains_and_resumes_bit_exact(cloud):  # noqa: F811 (a fixture)
    pytest.importorskip("verl")
    from tests.support.compare import assert_same_tree
    from tests.workers.cloud_integration_workers import verl_on_url

    url = cloud.url("verl")
    for out in run_ranks(verl_on_url, 2, url, timeout=600):
        assert_same_tree(out["saved"], out["resumed"], "resumed from the cloud")
    names = open_storage(url).list()
    assert not [n for n in names if n.startswith("global_step_1/")], names  # max_ckpt_to_keep=1
    hf = {n.rsplit("/", 1)[1] for n in names if n.startswith("global_step_2/actor/huggingface/")}
    assert {"config.json", "model.safetensors"} <= hf, names  # hf_model: config and weights
    assert f"global_step_2/actor/{METADATA_FILE}" in names


def test_issue42_item3_torchtitan_manager_saves_retains_and_resumes_bit_exact(cloud):  # noqa: F811 (a fixture)
    pytest.importorskip("torchtitan")
    from tests.support.compare import assert_same_tree
    from tests.workers.cloud_integration_workers import torchtitan_on_url
    from tests.workers.torchtitan_workers import SAVE_STEPS

    url = cloud.url("titan")
    for out in run_ranks(torchtitan_on_url, 2, url, timeout=600):
        assert out["fresh_load"] is False and out["loaded"] is True
        assert_same_tree(out["saved"], out["resumed"], "resumed from the cloud")
    names = open_storage(url).list()
    kept = sorted({n.split("/")[1] for n in names if n.endswith(f"/{METADATA_FILE}")})
    assert kept == [f"step-{SAVE_STEPS - 2}", f"step-{SAVE_STEPS}"], names  # keep_latest_k=2
