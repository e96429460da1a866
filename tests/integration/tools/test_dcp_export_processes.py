"""Issue 39 item 11 at 2 ranks: torchtitan's DCP manager writes every DP rank's dataloader state
(``dp_rank_<r>``) into one ``dataloader`` entry; unickpt saves it per rank. ``convert --to dcp
--layout torchtitan`` writes every rank's, so each DP rank of a resumed torchtitan job continues its
own data (today: rank 0's only, so rank 1 starts its data over)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.dataloader import ParallelAwareDataloader

from tests.workers.dcp_export_workers import save_titan_loaders
from tests.workers.harness import run_ranks
from unickpt.ops.convert import to_dcp


def test_issue39_item11_every_dp_ranks_dataloader_state_in_one_dcp_entry(tmp_path):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "step-1")
    following = run_ranks(save_titan_loaders, 2, ck)
    result = to_dcp(ck, out, layout="torchtitan")
    assert result.skipped == (), result.skipped
    for rank in range(2):  # each DP rank of the resumed job: torchtitan's loader, torchtitan's key
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fresh = ParallelAwareDataloader(list(range(64)), dp_rank=rank, dp_world_size=2, batch_size=4)
            dcp.load({"dataloader": fresh}, storage_reader=dcp.FileSystemReader(out), no_dist=True)
            batch = next(iter(fresh))
        assert torch.equal(batch, torch.tensor(following[rank])), (rank, batch, following[rank])
