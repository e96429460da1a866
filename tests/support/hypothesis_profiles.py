"""The suite's two Hypothesis profiles and the cap on a property test's own example count.

``tests/conftest.py`` calls :func:`register` at import, before any test module is collected:

- ``ci`` (the default; ``make test``, the CI gate): today's example counts (Hypothesis' default of
  100 for a test that names none, each test's own ``max_examples`` otherwise), no deadline.
- ``fast`` (``make test-fast``): at most :data:`FAST_MAX_EXAMPLES` examples, derandomized (the
  same examples on every run, no example database), no deadline.

Select one with ``HYPOTHESIS_PROFILE=fast`` or ``--hypothesis-profile=fast``. A test that sets its
own count writes ``settings(max_examples=examples(300), ...)``: 300 under ``ci``, the cap under
``fast`` (an explicit ``max_examples`` would otherwise override the profile).
"""

from __future__ import annotations

import os

from hypothesis import settings

FAST_MAX_EXAMPLES = 20
PROFILES = ("ci", "fast")


def register() -> None:
    """Register both profiles and load the one ``HYPOTHESIS_PROFILE`` names (``ci`` when unset);
    Hypothesis' own ``--hypothesis-profile`` option, applied later, overrides it."""
    settings.register_profile("ci", deadline=None)
    settings.register_profile("fast", max_examples=FAST_MAX_EXAMPLES, derandomize=True, database=None, deadline=None)
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r}: the suite's profiles are {', '.join(PROFILES)}")
    settings.load_profile(name)


def examples(n: int) -> int:
    """A property test's example count: ``n`` under ``ci``, at most :data:`FAST_MAX_EXAMPLES`
    under ``fast``. Read when the test module is imported, after the profile is loaded."""
    if settings.get_current_profile_name() == "fast":
        return min(n, FAST_MAX_EXAMPLES)
    return n
