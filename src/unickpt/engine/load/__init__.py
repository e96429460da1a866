"""The load engine: executes what ``planning.load`` plans.

``pipeline`` (``LoadPipeline``: describe, metadata, validate, read, apply) -> ``stage``
(``read_stage``: one rank's reads and placements) over ``exchange`` (the collective of the read
assignment), ``reader`` (runs of ranged reads, verified unit by unit) and ``forwarding``
(batches sent to the ranks that need them).
"""
