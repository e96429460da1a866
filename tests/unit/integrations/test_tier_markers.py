"""The step marker that maps a Lightning / HF Trainer checkpoint path to a RAM-tier step
(``unickpt.integrations._tier``, issue 40 item 8): written and read back, never written over a
file it did not write, never read through a link."""

from __future__ import annotations

import json
import os

import pytest

from unickpt.errors import ConfigurationError, StorageError
from unickpt.integrations._tier import TierKnobs, read_step_marker, write_step_marker


def test_issue40_item8_a_step_marker_maps_a_path_to_its_step_and_replaces_only_its_own(tmp_path) -> None:
    path = str(tmp_path / "epoch=0-step=3.ckpt")
    write_step_marker(path, 3)
    assert json.loads(open(path).read()) == {"format": "unickpt-tier-step/1", "step": 3}
    assert read_step_marker(path) == 3
    write_step_marker(path, 6)  # last.ckpt saved again: its own marker is replaced
    assert read_step_marker(path) == 6


def test_issue40_item8_a_step_marker_never_overwrites_a_file_it_did_not_write(tmp_path) -> None:
    foreign = tmp_path / "last.ckpt"
    foreign.write_bytes(b"a Lightning .ckpt of the time before unickpt")
    with pytest.raises(StorageError, match="is not a unickpt tier-step marker"):
        write_step_marker(str(foreign), 3)
    assert foreign.read_bytes() == b"a Lightning .ckpt of the time before unickpt"
    assert read_step_marker(str(foreign)) is None


def test_issue40_item8_a_link_to_a_step_marker_is_not_read_through(tmp_path) -> None:
    real = str(tmp_path / "real.ckpt")
    write_step_marker(real, 3)
    os.symlink(real, tmp_path / "link.ckpt")
    assert read_step_marker(str(tmp_path / "link.ckpt")) is None
    assert read_step_marker(str(tmp_path / "missing.ckpt")) is None


def test_issue40_item8_tier_knobs_refuse_a_fast_root_that_is_not_ram() -> None:
    assert not TierKnobs().on  # off by default
    with pytest.raises(ConfigurationError, match="must be shm://<name>"):
        TierKnobs(fast_root="/nfs/run1")
    with pytest.raises(ConfigurationError, match="replicas >= 1"):
        TierKnobs(fast_root="shm://run1", replicas=0)
