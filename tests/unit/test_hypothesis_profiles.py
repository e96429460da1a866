"""The suite's Hypothesis profiles (``tests/support/hypothesis_profiles.py``): ``make test`` runs
today's example counts, ``make test-fast`` a few dozen derandomized ones."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import settings

from tests.support import hypothesis_profiles

ROOT = Path(__file__).resolve().parents[2]


def test_profiles_ci_keeps_counts_fast_caps_and_derandomizes() -> None:
    ci = settings.get_profile("ci")
    fast = settings.get_profile("fast")
    assert ci.max_examples == 100 and ci.deadline is None
    assert fast.max_examples == hypothesis_profiles.FAST_MAX_EXAMPLES <= 36
    assert fast.derandomize and fast.database is None and fast.deadline is None


def test_profiles_examples_is_the_count_under_ci_and_capped_under_fast() -> None:
    loaded = settings.get_current_profile_name()
    try:
        settings.load_profile("ci")
        assert hypothesis_profiles.examples(300) == 300
        settings.load_profile("fast")
        assert hypothesis_profiles.examples(300) == hypothesis_profiles.FAST_MAX_EXAMPLES
        assert hypothesis_profiles.examples(5) == 5
    finally:
        settings.load_profile(loaded)


def test_profiles_make_targets_select_them() -> None:
    makefile = (ROOT / "Makefile").read_text()
    test_fast = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", makefile, re.M)
    test = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert test_fast is not None and test is not None
    assert "HYPOTHESIS_PROFILE=fast" in test_fast.group(1) and "pytest" in test_fast.group(1)
    assert "HYPOTHESIS_PROFILE=ci" in test.group(1) and "pytest" in test.group(1)
