"""The Hugging Face export of a save (``SaveOptions.hf_export``) as one stage around it, and the
one place an export runs inside its ``save.hf_export`` phase.

``Checkpointer._save`` (``save`` and ``_submit_after`` alike) builds an ``HFExportStage`` when
the options ask for an export, and calls, on every rank:
  ``check()``              before the save writes anything (collective): a path the export
                           cannot write (not local) is refused on every rank, and so is a
                           ``huggingface/`` folder holding anything unickpt did not write
                           (``folder.hf_files``: a user's file, a link, a sub-folder; rank 0
                           looks); the checkpoint there, if any, stays as it is;
  ``after_commit(md)``     once the save committed (``md``: what the wait returned, the
                           ``Metadata`` on the ranks that committed it): rank 0 reads the committed
                           metadata back for the tensor order ``unickpt merge`` writes, removes
                           what is left of an earlier export (the commit normally did) and
                           refuses files unickpt did not write that appeared since ``check``;
                           then every rank writes its share (``engine.export.hf.export_state``).
After the commit, not before: the save refuses a folder holding files it did not write, and a
failed export leaves the committed checkpoint whole.

``run_export`` is what ``after_commit`` and ``Checkpointer.export_hf`` (any folder) both call.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...coordination import Coordinator, run_stage
from ...errors import ForeignFolderError
from ...folder.hf_files import hf_export_files, remove_hf_export
from ...folder.probe import read_metadata_bytes
from ...folder.target import open_target
from ...format import decode_metadata
from ...format.hf_layout import HFExport
from ...format.records import Metadata
from ...options import SaveOptions
from ...storage.base import METADATA_LIMIT
from ..runtime.resources import Resources
from .hf import HFExportResult, export_state, hf_folder

__all__ = ["HFExportStage", "run_export"]


def run_export(
    resources: Resources,
    out: str,
    state: MutableMapping[str, Any],
    options: HFExport,
    framework: str,
    timeout: float | None,
    order: Sequence[str] = (),
    manifest_save_id: str | None = None,
) -> HFExportResult:
    """``export_state`` of ``state`` into ``out`` on the checkpointer's foreground collectives,
    inside a ``save.hf_export`` phase (its bytes: every file's size); collective."""
    coord = resources.coordinator("foreground", timeout, f"Hugging Face export into {out}")
    with resources.events.phase("save.hf_export", coord.rank, path=out) as p:
        result = export_state(out, state, options, coord, framework, order, manifest_save_id)
        p.nbytes = result.bytes_written
    return result


@dataclass(frozen=True, slots=True)
class HFExportStage:
    """The export of one save into ``path``'s (``path/role``'s) ``huggingface/`` folder (module
    docstring); ``options``: the save's, whose ``hf_export`` is ``export``."""

    resources: Resources
    path: str
    role: str | None
    state: MutableMapping[str, Any]
    export: HFExport
    framework: str
    options: SaveOptions

    def _coordinator(self, out: str) -> Coordinator:
        return self.resources.coordinator("foreground", self.options.timeout, f"Hugging Face export into {out}")

    def check(self) -> None:
        """Before the save writes anything (every rank, collective; module docstring)."""
        out = hf_folder(self.path, self.role)  # raises alike on every rank for a path that is not local
        coord = self._coordinator(out)

        def check() -> None:
            if coord.rank != 0:
                return
            storage = open_target(self.path, self.role, self.options.storage)
            found = hf_export_files(storage)
            if found.foreign:
                raise ForeignFolderError(
                    f"refusing to save into {storage.url} with hf_export: {out} holds {len(found.foreign)} "
                    f"file(s) unickpt did not write, e.g. {list(found.foreign[:3])}. Nothing was saved; the "
                    "checkpoint there is unchanged. unickpt never deletes or overwrites them: move them away, "
                    "or save without hf_export (the folder then stays as it is)"
                )

        run_stage(coord, "hf export (check)", check)

    def after_commit(self, md: Metadata | None) -> HFExportResult:
        """The committed checkpoint's ``huggingface/`` folder, its tensors in the order of the
        committed metadata as ``unickpt merge`` decodes it (rank 0 reads it back; ``md`` tells
        which ranks committed), so the files equal ``unickpt merge``'s (module docstring)."""
        out = hf_folder(self.path, self.role)
        coord = self._coordinator(out)

        def prepare() -> tuple[list[str], str]:
            if not isinstance(md, Metadata):  # ranks other than 0
                return [], ""
            storage = open_target(self.path, self.role, self.options.storage)
            order = list(decode_metadata(read_metadata_bytes(storage, METADATA_LIMIT), storage.url).tensors)
            left = remove_hf_export(storage).foreign
            if left:
                raise ForeignFolderError(
                    f"checkpoint {storage.url} (save {md.save_id}) is committed, but its Hugging Face export is "
                    f"refused: {out} holds {len(left)} file(s) unickpt did not write, e.g. {list(left[:3])}; "
                    "they stay. Move them away and export with `unickpt merge`"
                )
            return order, md.save_id

        order, save_id = run_stage(coord, "hf export (replace)", prepare)
        return run_export(
            self.resources, out, self.state, self.export, self.framework, self.options.timeout, order, save_id
        )
