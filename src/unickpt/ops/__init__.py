"""Operations on saved checkpoints, one process, no process group: the library side of the
``unickpt`` command line (``unickpt.cli`` parses arguments and renders what these return) and
of ``TieredCheckpointManager`` (``ops.verify``).

- ``inspect``: ``load_metadata``, ``summarize``, ``format_text`` / ``to_json`` and the deeper
  views (``shard_lines``, ``value_lines`` ...);
- ``verify``: ``verify`` (every checksum, every file), ``file_sizes``;
- ``merge``: ``read_full_tensor``, ``iter_full_tensors``, ``merge`` (safetensors / torch);
- ``pieces``: ``iter_pieces`` (one tensor in bounded pieces);
- ``convert`` (``from_hf``, ``from_dcp``, ``from_verl_fsdp``, ``to_dcp``; readers in ``hf_read``,
  ``dcp_read``, ``dcp_layouts``, ``verl_read``, ``torch_save_read``, ``source_files``),
  ``modify``, ``diff``, ``report`` (phase records);
- ``printable``: how names read from a checkpoint are printed.

Layering: ``ops`` uses the library (``engine``, ``planning``, ``format``, ``storage`` ...); nothing
in the library imports ``ops`` except ``tiering`` (``ops.verify``) and ``cli``.
"""
