"""The unickpt test suite (a package, so spawned ranks import ``tests.workers.<name>``)."""
