"""The test tiers: which tests start processes (marker ``distributed``) and which are slow
(``slow``: faults, crashes, soak, fuzz, long timeouts), decided by folder and, for the files
that mix both kinds, by test name.

``tests/conftest.py`` marks every collected test with ``markers_for``, and fails a test that
starts a process (``subprocess``, ``multiprocessing``, the spawn harness) without the
``distributed`` marker; ``tests/unit/test_tiers.py`` checks the same statically for every test
file, so the fast tier (``make test-fast``) never waits on a process.

Layout:

* ``tests/unit/``: no processes (``make test-fast`` runs it without the ``distributed`` and
  ``slow`` tests). A subject whose tests need both kinds has its process tests in
  ``tests/integration/<area>/test_<name>_processes.py``.
* ``tests/integration/``: real processes (gloo ranks, subprocesses, an S3 server); every test
  is ``distributed``.
* ``tests/reliability/``: every test is ``slow``; the ones that start processes are named below
  and are ``distributed`` too.
* ``tests/workers/``: the modules spawned ranks import (``tests.workers.<name>``); ``tests/support/``:
  the test-only oracles.
"""

from __future__ import annotations

# a first folder under tests/ whose every test is marked so
DISTRIBUTED_FOLDERS = frozenset({"integration"})
SLOW_FOLDERS = frozenset({"reliability"})

ALL = None  # every test of the file

# Test files outside DISTRIBUTED_FOLDERS (by file name, which is unique in tests/) whose tests
# start processes: ALL, or the names of those test functions. Only tests/reliability/ has such
# files; tests/unit/ starts no process.
DISTRIBUTED_TESTS: dict[str, frozenset[str] | None] = {
    "test_rel_concurrency.py": frozenset(
        {
            "test_two_jobs_saving_at_once_exactly_one_commits",
            "test_every_rank_refuses_when_another_job_holds_the_lock",
            "test_stale_locks_are_broken_with_a_warning",
            "test_loads_during_repeated_saves_see_whole_versions",
        }
    ),
    "test_rel_corruption.py": frozenset(
        {
            "test_two_rank_load_of_a_corrupt_checkpoint",
        }
    ),
    "test_rel_crash.py": ALL,
    "test_issue39_item27_heap.py": ALL,
    "test_rel_hostile.py": ALL,
    "test_rel_hostile_folders.py": frozenset(
        {
            "test_item2_every_rank_refuses_a_foreign_folder",
            "test_item9_fifos_devices_and_huge_files_fail_fast",
            "test_item11_sizes_claimed_by_metadata_are_refused_before_allocation",
        }
    ),
    "test_rel_lock.py": frozenset(
        {
            "test_item4_lock_holder_in_other_pid_namespace",
            "test_item4_pids_are_judged_only_in_the_holders_own_namespace_and_boot",
            "test_item4_heartbeat_keeps_a_lock_alive_and_a_frozen_holder_loses_it_after_its_lease",
            "test_item4_two_breakers_of_one_stale_lock_exactly_one_wins",
            "test_item4_stalled_breaker_never_takes_a_newer_lock",
            "test_item4_commit_refused_when_the_lock_was_taken_over",
        }
    ),
    "test_rel_storage.py": frozenset(
        {
            "test_two_ranks_with_faults_on_rank1",
            "test_disk_full_commits_nothing_and_releases_space",
        }
    ),
}


def markers_for(parts: tuple[str, ...], test_name: str) -> set[str]:
    """The tier markers of test function ``test_name`` in the file at ``parts`` (the path
    relative to ``tests/``, split)."""
    marks: set[str] = set()
    if parts[0] in DISTRIBUTED_FOLDERS:
        marks.add("distributed")
    if parts[0] in SLOW_FOLDERS:
        marks.add("slow")
    named = DISTRIBUTED_TESTS.get(parts[-1], frozenset())
    if named is ALL or test_name in named:
        marks.add("distributed")
    return marks
