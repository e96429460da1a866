"""The test tiers: which tests start processes (marker ``distributed``) and which are slow
(``slow``: faults, crashes, soak, fuzz, long timeouts), decided by folder and, for the files
that mix both kinds, by test name.

``tests/conftest.py`` marks every collected test with ``markers_for``, and fails a test that
starts a process (``subprocess``, ``multiprocessing``, the spawn harness) without the
``distributed`` marker; ``tests/unit/test_tiers.py`` checks the same statically for every test
file, so the fast tier (``make test-fast``) never waits on a process.

Layout:

* ``tests/unit/``: no processes (``make test-fast`` runs it without the ``distributed`` and
  ``slow`` tests). A few files there still hold one or two process tests, named below.
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
# start processes: ALL, or the names of those test functions.
DISTRIBUTED_TESTS: dict[str, frozenset[str] | None] = {
    "test_boundaries.py": frozenset(
        {
            "test_issue11_boundaries_launcher_refuses_results_only_pickle_could_carry",
        }
    ),
    "test_careless_user.py": frozenset(
        {
            "test_item10_save_and_load_under_torchrun_without_a_process_group_are_refused",
        }
    ),
    "test_checkpointer.py": frozenset(
        {
            "test_two_checkpointers_at_world_size_2",
        }
    ),
    "test_cli.py": frozenset(
        {
            "test_python_m_inspect_json",
            "test_inspect_error_exits",
            "test_console_script",
            "test_demo_end_to_end",
        }
    ),
    "test_cli_corpus.py": frozenset(
        {
            "test_end_to_end_subprocess_one_line",
        }
    ),
    "test_convert_hostile.py": frozenset(
        {
            "test_cli_prints_a_dcp_refusal_as_one_line",
        }
    ),
    "test_describe.py": frozenset(
        {
            "test_save_and_load_views_are_one_description_every_framework",
            "test_box_memo_gives_the_boxes_torch_gives",
        }
    ),
    "test_doc_examples.py": frozenset(
        {
            "test_doc_examples_run",
        }
    ),
    "test_errors.py": frozenset(
        {
            "test_crash_before_commit_in_subprocess",
        }
    ),
    "test_framework_registry.py": frozenset(
        {
            "test_auto_detection_of_each_framework_incl_compiled_and_fsdp2_tp",
        }
    ),
    "test_fsdp_internals.py": frozenset(
        {
            "test_fsdp1_private_accessors_match_the_unwrapped_model",
            "test_dtensor_local_box_of_fsdp2_and_tp_shards",
        }
    ),
    "test_golden.py": frozenset(
        {
            "test_golden_v1_fsdp2_ws3_reshards_to_fsdp2_ws2",
        }
    ),
    "test_monitoring.py": frozenset(
        {
            "test_issue16_four_ranks_record_every_phase_within_the_wall_time",
        }
    ),
    "test_optimizer_like.py": frozenset(
        {
            "test_optimizer_like_wrapper_reshards_fsdp2_ws2_to_torch_ws1",
        }
    ),
    "test_phases.py": frozenset(
        {
            "test_issue26_item14_two_ranks_save_keeps_phases_and_report_shows_both",
        }
    ),
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
    "test_shm.py": frozenset(
        {
            "test_issue14_shm_checkpoint_shared_by_ranks_of_one_machine",
        }
    ),
    "test_storage_registry.py": frozenset(
        {
            "test_a4_no_environment_variable_is_read_at_import",
        }
    ),
    "test_tiering.py": frozenset(
        {
            "test_issue14_tiering_to_s3",
        }
    ),
    "test_tools_keymap.py": frozenset(
        {
            "test_issue15_modify_renames_drops_and_casts_into_a_new_checkpoint",
        }
    ),
    "test_tools_pieces.py": frozenset(
        {
            "test_merge_peak_memory_is_bounded_by_the_piece_not_the_tensor",
            "test_a_forged_8gib_claim_is_refused_before_allocating",
        }
    ),
    "test_waits.py": frozenset(
        {
            "test_issue26_item12_waiting_ranks_warn_and_every_collective_failure_is_a_collective_error",
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
