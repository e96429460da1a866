"""The checksum chunk of a save: by default the save's coordinator picks it from the size of
the checkpoint's tensors (1 MiB, doubled until the data is at most ``AUTO_MAX_CHUNKS`` chunks:
the metadata's checksums stay bounded at any size), and every rank writes with rank 0's choice;
a chunk the save names is used as it is. Real gloo ranks; the bound is lowered in each rank so
that a few MiB of tensors need a larger chunk."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workers.harness import run_ranks
from unickpt.format.checksums import DEFAULT_CHUNK, MAX_CHUNK, auto_chunk

MIB = 1 << 20


def _save_twice_then_load(rank: int, ws: int, ckpt: str, chunks: list[int | None], most: int) -> dict:
    import unickpt
    from unickpt.format import checksums

    checksums.AUTO_MAX_CHUNKS = most  # this rank's bound (only the coordinator's decides)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 256) for _ in range(3)))  # 3 MiB + 3 KiB, replicated
    options = unickpt.SaveOptions(checksum_chunk_bytes=chunks[rank])
    with unickpt.Checkpointer() as ck:
        ck.save(ckpt, {"model": model}, options=options).wait()
        first = _chunk_of(ckpt)
        ck.save(ckpt, {"model": model}, options=options).wait()  # the cached plan keeps the choice
        second = _chunk_of(ckpt)
        into = torch.nn.Sequential(*(torch.nn.Linear(1024, 256) for _ in range(3)))
        ck.load(ckpt, {"model": into})
    want = model.state_dict()
    return {"chunks": (first, second), "exact": all(torch.equal(v, want[k]) for k, v in into.state_dict().items())}


def _chunk_of(ckpt: str) -> int:
    from unickpt.format import decode_metadata

    with open(os.path.join(ckpt, "unickpt.metadata.json"), "rb") as f:
        return decode_metadata(f.read()).checksums.chunk_size


@pytest.mark.parametrize(
    "chunks, most, want",
    [
        ([None, None], 2, 2 * MIB),  # 3 MiB + 3 KiB of tensors in at most 2 chunks: 2 MiB (1 MiB gives 4)
        ([None, None], 1, 4 * MIB),  # in 1 chunk: 4 MiB
        ([None, None], 1 << 21, MIB),  # the real bound: 1 MiB
        ([None, 8192], 2, 2 * MIB),  # rank 1 asks for another chunk: rank 0's choice is everyone's
        ([65536, None], 2, 65536),  # a chunk the save names is used as it is
    ],
)
def test_every_rank_writes_with_the_coordinators_chunk(tmp_path, chunks, most, want):
    res = run_ranks(_save_twice_then_load, 2, str(tmp_path / "c"), chunks, most)
    assert [r["chunks"] for r in res] == [(want, want)] * 2
    assert all(r["exact"] for r in res)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.integers(0, 1 << 52), st.integers(1, 1 << 22))
def test_auto_chunk_is_the_least_power_of_two_that_fits(data, most):
    """1 MiB times the least power of two whose chunks hold ``data`` in ``most`` (1 GiB at most)."""
    got = auto_chunk(data, most)
    k = 0
    while (DEFAULT_CHUNK << k) < MAX_CHUNK and (data + (DEFAULT_CHUNK << k) - 1) // (DEFAULT_CHUNK << k) > most:
        k += 1
    assert got == DEFAULT_CHUNK << k


def test_auto_chunk_of_known_sizes():
    assert auto_chunk(0) == MIB
    assert auto_chunk(2 << 40) == MIB  # 2 TiB: 2 Mi chunks of 1 MiB
    assert auto_chunk((2 << 40) + 1) == 2 * MIB
    assert auto_chunk(4 * 10**12) == 2 * MIB  # the 405B job's 4 TB: 1.86 Mi chunks of 2 MiB
    assert auto_chunk(1 << 62) == MAX_CHUNK


def test_save_options_take_none_or_a_chunk_size():
    """A careless chunk (zero, under 4 KiB, over 1 GiB, a bool, a float, a string) is refused
    when the options are made, before any rank writes."""
    import unickpt

    assert unickpt.SaveOptions().checksum_chunk_bytes is None
    for ok in (4096, MIB, MAX_CHUNK):
        assert unickpt.SaveOptions(checksum_chunk_bytes=ok).checksum_chunk_bytes == ok
    for bad in (0, 4095, MAX_CHUNK + 1, True, 1.5, "1MiB", -MIB):
        with pytest.raises(ValueError, match="checksum_chunk_bytes must be None or an int"):
            unickpt.SaveOptions(checksum_chunk_bytes=bad)
