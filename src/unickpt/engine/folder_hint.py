"""What a folder that is not a unickpt checkpoint is instead, for ``NotACheckpointError``'s hint.

Called by ``engine.read.read_metadata_bytes`` only on the error path (no metadata, no data), so
its storage listings cost nothing on a real load. Recognises a PyTorch DCP checkpoint (a
``.metadata`` file beside ``__<rank>_<n>.distcp`` files) and a ``CheckpointManager`` root
(``step_<n>`` folders, a ``latest`` pointer); returns "" for anything else.
"""

from __future__ import annotations

import re

from ..errors import CheckpointError
from ..format.records import METADATA_FILE
from ..storage.base import Storage

__all__ = ["folder_hint"]

_DISTCP = re.compile(r"__\d+_\d+\.distcp")
_STEP = re.compile(r"step_(\d{8,})")


def folder_hint(storage: Storage) -> str:
    """A sentence saying what ``storage`` holds and how to load it, or "" (also when the folder
    cannot be listed: the hint never replaces the error it decorates)."""
    try:
        names = storage.list("")
    except (CheckpointError, OSError):
        return ""
    top = [n for n in names if "/" not in n]
    if ".metadata" in top and any(_DISTCP.fullmatch(n) for n in top):
        return (
            "; it is a PyTorch DCP (torch.distributed.checkpoint) checkpoint: load it with "
            "torch.distributed.checkpoint.load, or convert it once with `unickpt convert` and load the result"
        )
    steps: dict[int, str] = {}
    for name in names:
        folder = name.split("/", 1)[0]
        m = _STEP.fullmatch(folder)
        if m and name.endswith("/" + METADATA_FILE):
            steps.setdefault(int(m.group(1)), folder)
    if not steps:
        return ""
    shown = [steps[s] for s in sorted(steps)]
    listed = ", ".join(shown[-10:]) + (f" (and {len(shown) - 10} older)" if len(shown) > 10 else "")
    newest = f"{storage.url.rstrip('/')}/{shown[-1]}"
    return (
        f"; it is a CheckpointManager root holding {listed}: resume with "
        f"unickpt.CheckpointManager({storage.url!r}).load_latest(state), or load the newest step {newest}"
    )
