"""``planning.save.wire``: local and rank save plans round-trip through their compact bytes
(property test over random plans), the bytes are a fraction of a plain JSON dump's, and truncated,
foreign or index-corrupted buffers are refused with a PlanningError, never misread."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from unickpt.errors import PlanningError
from unickpt.planning.save import LocalSavePlan, RankSavePlan, WriteEntry
from unickpt.planning.save.wire import (
    decode_local_plan,
    decode_local_table,
    decode_rank_plan,
    encode_local_plan,
    encode_rank_plan,
)
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


@settings(max_examples=examples(200), deadline=None)
@given(
    shards=st.lists(shard_specs(), max_size=20),
    blobs=st.lists(st.tuples(st.text(max_size=8), st.integers(0, 1 << 40)), max_size=3),
    rank=st.integers(0, 10_000),
)
def test_local_plans_round_trip(shards, blobs, rank):
    plan = LocalSavePlan(rank, tuple(shards), tuple(BlobSpec(k, n) for k, n in blobs))
    assert decode_local_plan(encode_local_plan(plan)) == plan


def _encode_rows_plainly(plan: LocalSavePlan) -> bytes:
    """The encoder as it was (one Python row per spec): the bytes must not change."""
    from unickpt.planning.save import wire as save_wire

    names: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    rows: list[int] = []
    for s in plan.shards:
        rows += [names.setdefault(s.fqn, len(names)), dtypes.setdefault(s.dtype, len(dtypes)), len(s.global_shape)]
        rows += [-1 if s.replica_source is None else s.replica_source, *s.global_shape, *s.offsets, *s.lengths]
    header = {
        "rank": plan.rank,
        "n": len(plan.shards),
        "names": list(names),
        "dtypes": list(dtypes),
        "blobs": [[b.key, b.nbytes] for b in plan.blobs],
    }
    return save_wire._pack(save_wire._LOCAL, header, np.array(rows, dtype=np.int64))


@settings(max_examples=examples(200), deadline=None)
@given(
    shards=st.lists(shard_specs(), max_size=20),
    blobs=st.lists(st.tuples(st.text(max_size=8), st.integers(0, 1 << 40)), max_size=3),
    rank=st.integers(0, 10_000),
)
def test_tables_round_trip_and_the_bytes_are_the_row_encoders(shards, blobs, rank):
    """``encode_local_plan`` goes through a ``ShardTable`` (vectorised rows): same bytes as the
    plain row encoder; ``decode_local_table`` gives the table of the decoded records."""
    plan = LocalSavePlan(rank, tuple(shards), tuple(BlobSpec(k, n) for k, n in blobs))
    data = encode_local_plan(plan)
    assert data == _encode_rows_plainly(plan)
    table = decode_local_table(data)
    assert table.to_plan() == plan
    assert [table.spec(i) for i in range(len(table))] == list(plan.shards)
    assert encode_local_plan(table) == data


@settings(max_examples=examples(300), deadline=None)
@given(
    rows=st.lists(st.integers(-2, 12), max_size=24),
    n=st.integers(-1, 4),
    names=st.lists(st.sampled_from(["model.a", "model.b", 7, None]), max_size=3),
)
def test_a_forged_local_plan_decodes_to_the_same_table_or_the_same_error(rows, n, names):
    """Whatever a buffer holds, the fast decoder agrees with the record decoder: the same
    PlanningError, or the table of the same records."""
    from unickpt.planning.save import wire as save_wire

    header = {"rank": 3, "n": n, "names": names, "dtypes": ["float32", "int8"], "blobs": [["k", 4]]}
    data = save_wire._pack(save_wire._LOCAL, header, np.array(rows, dtype=np.int64))
    try:
        want = decode_local_plan(data)
    except PlanningError as e:
        with pytest.raises(PlanningError) as got:
            decode_local_table(data)
        assert str(got.value) == str(e)
        return
    assert decode_local_table(data).to_plan() == want


@settings(max_examples=examples(200), deadline=None)
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


@settings(max_examples=examples(300), deadline=None)
@given(
    rows=st.lists(st.integers(-3, 4), max_size=20),
    files=st.lists(st.sampled_from(["data/s/r00000-00.bin", "data/s/r00000-01.bin", 3]), max_size=3),
    blobs=st.lists(st.sampled_from(["extra_state/0", None]), max_size=2),
)
def test_a_forged_rank_plan_decodes_as_entry_by_entry(rows, files, blobs):
    """The vectorised rank-plan decoder agrees with the entry-by-entry one: same entries or
    the same PlanningError."""
    from unickpt.planning.save import wire as save_wire

    header = {"rank": 1, "save_id": "s", "files": files, "blobs": blobs}
    data = save_wire._pack(save_wire._RANK, header, np.array(rows, dtype=np.int64))

    def slow():
        h, table = save_wire._unpack(save_wire._RANK, data, "rank save plan")
        if table.size % 5:
            raise PlanningError("rank save plan: truncated rows")
        try:
            return save_wire._decode_rank_rows(h, table.reshape(-1, 5))
        except PlanningError:
            raise
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise PlanningError(f"rank save plan: malformed ({type(e).__name__}: {e})") from None

    try:
        want = slow()
    except PlanningError as e:
        with pytest.raises(PlanningError) as got:
            decode_rank_plan(data)
        assert str(got.value) == str(e)
        return
    assert decode_rank_plan(data) == want


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
        from unickpt.planning.save import wire as save_wire

        header = {"rank": 0, "n": 1, "names": ["model.a"], "dtypes": ["float32"], "blobs": []}
        return save_wire._pack(save_wire._LOCAL, header, np.array(rows))

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
