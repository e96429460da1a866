"""The save engine: ``pipeline`` (describe, plan, stage, then lock + write + commit on the
worker), ``staging`` (snapshot images), ``step_guard`` (optimizer steps wait for their snapshot),
``write`` (data files + checksums, writer threads), ``writer_process`` / ``writer_main`` /
``writer_messages`` (the same by a writer process fed through shared memory,
``SaveOptions(writer="process")``) and ``commit`` (the barrier and the publication)."""
