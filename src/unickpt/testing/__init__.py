"""Test support shipped with unickpt (not part of the checkpointing API): the tests, the
benchmarks (``bench/``) and the demo (``examples/demo.py``) use it.

- ``launch``: ``run_ranks`` / ``launch_ranks`` / ``run_jobs`` start real gloo ranks as processes
  (the one launcher of the project) and carry their results in the safe value encoding;
- ``threads``: ``ThreadCoordinator`` / ``run_threads``, N ranks as threads of one process (a
  ``Coordinator`` test double for planning and stage-protocol tests without processes);
- ``toy``: the small transformer the demo, the benchmarks and the multi-rank tests train.

Nothing in the library imports this package.
"""
