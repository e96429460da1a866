"""``coordination.objects``: the slot every rank's object travels in (its processes' tests:
``tests/integration/coordination/test_coordination_objects_processes.py``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from unickpt.coordination.objects import HEADER, slot_bytes


def test_the_slot_is_4_kib_up_to_64_ranks_then_shrinks_to_512_bytes():
    assert [slot_bytes(n) for n in (1, 2, 64)] == [4096, 4096, 4096]
    assert [slot_bytes(n) for n in (65, 128, 256, 512, 4096)] == [4032, 2048, 1024, 512, 512]


@given(st.integers(1, 1 << 20))
def test_a_rank_receives_at_most_256_kib_of_slots_from_64_ranks_on(world_size):
    slot = slot_bytes(world_size)
    assert slot > HEADER + 256  # a stage's outcome (about 150 pickled bytes) always fits
    assert world_size * slot <= max(256 << 10, world_size * 512)
