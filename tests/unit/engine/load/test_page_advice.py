"""numpy's huge-page advice is off inside ``huge_pages_off`` (the coordinator's read assignment)
and back to what it was after it: nested, overlapping on two threads, and after an error.
Checked with numpy's own getter."""

from __future__ import annotations

import threading

import pytest

from unickpt.engine.load.page_advice import huge_pages_off

multiarray = pytest.importorskip("numpy._core.multiarray")
get = getattr(multiarray, "_get_madvise_hugepage", None)
put = getattr(multiarray, "_set_madvise_hugepage", None)
pytestmark = pytest.mark.skipif(get is None or put is None, reason="this numpy has no huge-page switch")


@pytest.mark.parametrize("before", [True, False])
def test_off_inside_and_restored_after(before):
    old = put(before)
    try:
        with huge_pages_off():
            assert get() is False
            with huge_pages_off():
                assert get() is False
            assert get() is False  # the inner block's end does not restore it
        assert get() is before
        with pytest.raises(ZeroDivisionError), huge_pages_off():
            1 / 0  # noqa: B018
        assert get() is before
    finally:
        put(old)


def test_overlapping_blocks_on_two_threads_restore_once_both_left():
    old = put(True)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with huge_pages_off():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with huge_pages_off():
            second_in.set()
            first_out.wait(10)
            seen.append(get())  # the first thread left, this block is still in force
        seen.append(get())

    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen == [False, True]
    finally:
        put(old)


def test_the_read_assignment_leaves_the_setting_as_it_was():
    from tests.fixtures.read_fixtures import split_metadata
    from unickpt.engine.load.exchange import read_parts
    from unickpt.planning.load.assign import report_needs
    from unickpt.planning.load.runs import vectorized

    md = split_metadata()
    needs = report_needs(md, {("a", 0): (0, 4), ("a", 1): (0, 4)}, ["a"])
    old = put(True)
    try:
        parts = read_parts(md, [("h0", needs), ("h1", needs)], True, False, vectorized(lambda f, lo, hi: (lo, hi)))
        assert len(parts) == 2
        assert get() is True
    finally:
        put(old)


def test_issue41_item3_a_small_read_assignment_never_touches_numpys_setting():
    """The read assignment of a small job (two ranks, a few needs: no array near numpy's 4 MiB
    advice line) runs with numpy's setting as the process had it, not switched for the process;
    a large one (reports of 1 MiB, 24 bytes a need) runs with the advice off. Seen from inside the
    assignment: the extents callback it calls reads numpy's setting."""
    from tests.fixtures.read_fixtures import split_metadata
    from unickpt.engine.load.exchange import read_parts
    from unickpt.planning.load.assign import report_needs
    from unickpt.planning.load.runs import vectorized

    md = split_metadata()
    needs = report_needs(md, {("a", 0): (0, 4), ("a", 1): (0, 4)}, ["a"])
    seen: list[bool] = []

    def extents(f, lo, hi):
        seen.append(get())
        return lo, hi

    old = put(True)
    try:
        read_parts(md, [("h0", needs), ("h1", needs)], True, False, vectorized(extents))
        assert seen and set(seen) == {True}
        seen.clear()
        many = [("h0", needs)] * ((1 << 20) // len(needs) + 1)  # 1 MiB of reports
        read_parts(md, many, True, False, vectorized(extents))
        assert seen and set(seen) == {False}
        assert get() is True
    finally:
        put(old)
