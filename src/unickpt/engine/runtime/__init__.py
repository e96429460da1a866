"""What a ``Checkpointer`` keeps across calls and lends its pipelines: ``resources`` (the
record), ``worker`` (the background thread and async failure reports) and ``exit_hook`` (the
drain at interpreter exit)."""
