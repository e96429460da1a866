"""Modules the spawned ranks and subprocesses of the tests import (``tests.workers.<name>``): the
spawn harness and the per-feature rank functions."""
