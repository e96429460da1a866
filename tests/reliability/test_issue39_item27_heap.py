"""Issue 39 item 27: a heap corruption seen once in the crash matrix of ``test_rel_crash.py``.

In one ``make test`` run the victim of ``save.commit.begin-rank1-new`` died by SIGABRT after glibc
printed ``malloc(): unaligned tcache chunk detected`` instead of by the injected SIGKILL. This
test keeps that matrix running in a loop: every case of ``test_rel_crash.CASES``, ``ROUNDS``
times (``UNICKPT_ITEM27_ROUNDS`` raises it for a soak), each rank with its stderr in a file of
its own and glibc's malloc perturbation on (freed and new chunks filled with a byte, so that a
use of freed memory shows sooner). Every victim must die by SIGKILL (-9, at the injected point)
and no rank may print a glibc heap message. A rank that dies by a fatal signal also leaves every
thread's Python stack in its file (``unickpt.testing.launch`` enables ``faulthandler``): the
failure message carries it.

The one raw-pointer write after free found in the save path (``StagedFiles.release`` returned
a slot while the snapshot thread still copied into its images, which the next ``stage`` may
unmap) has its own test: ``tests/integration/engine/test_staging_processes.py``.
"""

from __future__ import annotations

import glob
import os

from tests.reliability.test_rel_crash import CASES
from tests.workers.harness import launch_ranks
from tests.workers.rel_workers import logged_crash_worker

ROUNDS = int(os.environ.get("UNICKPT_ITEM27_ROUNDS", "3"))
PERTURB = 0xA5  # glibc M_PERTURB byte
HEAP_MESSAGES = ("malloc()", "malloc_consolidate", "free()", "corrupted", "double free", "tcache", "munmap_chunk")


def test_issue39_item27_crash_matrix_loop_victims_die_by_sigkill_with_a_clean_heap(tmp_path):
    failures: list[str] = []
    runs = 0
    for round_no in range(ROUNDS):
        for fault, victim, same_path in CASES:
            case = f"{fault}-rank{victim}-{'same' if same_path else 'new'}"
            work = tmp_path / f"r{round_no}-{case}"
            work.mkdir()
            log = str(work / "rank")
            outcomes = launch_ranks(
                logged_crash_worker,
                2,
                log,
                PERTURB,
                str(work / "run"),
                str(work / "same"),
                fault,
                victim,
                same_path,
                str(work / "snap.pt"),
                victim=victim,
                grace=3.0,
            )
            runs += 1
            code = outcomes[victim].exitcode
            if code != -9:
                failures.append(f"round {round_no} {case}: victim exit code {code} ({outcomes[victim].status})")
            for path in sorted(glob.glob(log + ".*.err")):
                with open(path, errors="replace") as f:
                    text = f.read()
                found = [m for m in HEAP_MESSAGES if m in text]
                if found:
                    lines = [ln for ln in text.splitlines() if any(m in ln for m in found)]
                    failures.append(f"round {round_no} {case}: {os.path.basename(path)}: {lines[:3]}")
                if "Fatal Python error" in text:  # the launcher's faulthandler: every thread's stack
                    stacks = text[text.index("Fatal Python error") :][:4000]
                    failures.append(f"round {round_no} {case}: {os.path.basename(path)}:\n{stacks}")
    assert runs == ROUNDS * len(CASES)
    assert not failures, "\n".join(failures)
