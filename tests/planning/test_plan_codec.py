"""``planning.plan_codec``: local and rank save plans round-trip through their compact bytes
(property test over random plans), the bytes are a fraction of a plain JSON dump's, and truncated,
foreign or index-corrupted buffers are refused with a PlanningError, never misread."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.errors import PlanningError
from unickpt.planning.plan_codec import decode_local_plan, decode_rank_plan, encode_local_plan, encode_rank_plan
from unickpt.planning.save_plan import LocalSavePlan, RankSavePlan, WriteEntry
from unickpt.planning.specs import BlobSpec, ShardSpec


@st.composite
def shard_specs(draw):
    nd = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 50), min_size=nd, max_size=nd)))
    offs = tuple(draw(st.integers(0, g - 1)) for g in shape)
    lens = tuple(draw(st.integers(0, g - o)) for g, o in zip(shape, offs))
    fqn = draw(st.sampled_from(["model.a", "model.b.weight", "optimizer.state.x.exp_avg", "é/ü"]))
    return ShardSpec(fqn, draw(st.sampled_from(["float32", "bfloat16", "int64"])), shape, offs, lens,
                     draw(st.none() | st.integers(0, 9)))  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    shards=st.lists(shard_specs(), max_size=20),
    blobs=st.lists(st.tuples(st.text(max_size=8), st.integers(0, 1 << 40)), max_size=3),
    rank=st.integers(0, 10_000),
)
def test_local_plans_round_trip(shards, blobs, rank):
    plan = LocalSavePlan(rank, tuple(shards), tuple(BlobSpec(k, n) for k, n in blobs))
    assert decode_local_plan(encode_local_plan(plan)) == plan


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(
        st.tuples(
            st.integers(-1, 1000),
            st.sampled_from(["data/s/r00001-00.bin", "data/s/r00001-01.bin"]),
            st.integers(0, 1 << 45),
            st.integers(0, 1 << 40),
            st.sampled_from(["", "extra_state/1", "loader/0"]),
        ),
        max_size=30,
    ),
)
def test_rank_plans_round_trip(entries):
    plan = RankSavePlan(1, "20250101T000000-abc", tuple(WriteEntry(*e) for e in entries))
    assert decode_rank_plan(encode_rank_plan(plan)) == plan


def test_bytes_are_a_fraction_of_a_plain_json_dump():
    shards = tuple(
        ShardSpec(f"model.layers.{i}.mlp.weight", "bfloat16", (8192, 8192), (64 * 7, 0), (64, 8192)) for i in range(500)
    )
    plan = LocalSavePlan(7, shards)
    plain = json.dumps(dataclasses.asdict(plan), separators=(",", ":")).encode()
    ours, theirs = len(encode_local_plan(plan)), len(plain)
    assert ours < theirs / 2, (ours, theirs)


def zlib_bomb() -> bytes:
    """A buffer whose body claims a small size but inflates to far more."""
    import struct
    import zlib

    return struct.pack("<4sHBI", b"UCLP", 2, 8, 100) + zlib.compress(b"\0" * (1 << 20))


def test_broken_buffers_are_refused():
    good = encode_local_plan(LocalSavePlan(0, (ShardSpec("model.a", "float32", (4,), (0,), (4,)),)))
    for bad in (b"", b"XXXX" + good[4:], good[:-8], good[:-3], good[:10], good + b"x", zlib_bomb()):
        with pytest.raises(PlanningError):
            decode_local_plan(bad)

    def forged(rows: list[int]) -> bytes:  # a well-formed buffer holding these rows
        from unickpt.planning import plan_codec

        header = {"rank": 0, "n": 1, "names": ["model.a"], "dtypes": ["float32"], "blobs": []}
        return plan_codec._pack(plan_codec._LOCAL, header, np.array(rows))

    assert decode_local_plan(forged([0, 0, 1, -1, 4, 0, 4])).shards[0].fqn == "model.a"
    with pytest.raises(PlanningError, match="outside its table"):  # -1 must not wrap to the last name
        decode_local_plan(forged([-1, 0, 1, -1, 4, 0, 4]))
    with pytest.raises(PlanningError, match="malformed"):  # a box outside the shape
        decode_local_plan(forged([0, 0, 1, -1, 4, 9, 4]))
    with pytest.raises(PlanningError, match="trailing"):
        decode_local_plan(forged([0, 0, 1, -1, 4, 0, 4, 7]))
    part = encode_rank_plan(RankSavePlan(0, "s", (WriteEntry(0, "f", 0, 8),)))
    with pytest.raises(PlanningError):
        decode_rank_plan(part[:-2])
    with pytest.raises(PlanningError):
        decode_local_plan(part)  # a rank plan is not a local plan
