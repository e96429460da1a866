"""The engines that execute plans: I/O and collectives happen here, decisions in ``planning``.

``save`` (``SavePipeline``: describe, plan, stage, then lock + write + commit on the worker),
``load`` (``LoadPipeline``: describe, metadata, validate, read, apply), ``export`` (the Hugging
Face export, a stage after a save's commit), ``runtime`` (what a
``Checkpointer`` keeps across calls: resources, the background worker, the drain at exit),
``plan_cache`` (the plan stage and its cache), ``read`` (the metadata and blob reads),
``bytes_view`` (zero-copy byte views of tensors) and ``gc_pause`` (the collector paused while
per-tensor records are built).
"""
