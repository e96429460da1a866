"""Test-only support code: oracles written with torch's own APIs (and numpy), never with unickpt.

A test's expected value must not be computed by the code under test, so nothing in this package
imports ``unickpt`` (``tests/coordination/test_threads.py`` checks it). ``tests/conftest.py``
puts ``tests/`` on ``sys.path``, so ``import support.reference`` works in every test folder and
in spawned ranks (``spawn`` copies ``sys.path`` into the child).
"""
