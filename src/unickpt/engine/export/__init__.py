"""Exports written after a save: files derived from the state in another format.

``hf`` (the Hugging Face safetensors folder, every rank its own share: plan with
``format.hf_layout``, write through ``storage.local_files``) and ``stage`` (``HFExportStage``:
what a save with ``SaveOptions.hf_export`` runs before it starts and after its commit, and
``run_export``, the one call of ``hf.export_state`` inside a ``save.hf_export`` phase).
"""
