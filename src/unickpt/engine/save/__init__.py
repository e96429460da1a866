"""The save engine: ``pipeline`` (describe, plan, stage, then lock + write + commit on the
worker), ``staging`` (snapshot images), ``step_guard`` (optimizer steps wait for their snapshot),
``write`` (data files + checksums) and ``commit`` (the barrier and the publication)."""
