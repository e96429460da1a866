"""Test-only support code: oracles written with torch's own APIs (and numpy), never with unickpt.

A test's expected value must not be computed by the code under test, so nothing in this package
imports ``unickpt`` (``tests/unit/test_boundaries.py`` checks it). Imported as ``tests.support.<name>``
(the repository root is on ``sys.path``; ``spawn`` copies it into spawned ranks).
"""
