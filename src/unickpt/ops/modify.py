"""``unickpt modify SRC OUT``: a new checkpoint with keys renamed (regular expressions), keys
dropped, floating-point tensors cast; the source is never changed.

``modify`` decodes the source's metadata, builds the key map (drops, then
renames, in the order given; ``format.keymap.remap`` also renames the optimizer's parameter
names), reads every kept tensor whole (``merge.read_full_tensor``, CRC32C checked), casts, and
saves all of them with the ``optimizer`` object through ``framework="tensors"`` into ``OUT``
(new or empty). The tensors are held in memory once (one save): memory is the size of the kept
tensors, so the data files are checked first (``pieces.check_data_files``): a metadata claiming
more bytes than its files hold is refused before anything is allocated.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigurationError
from ..folder.target import refuse_nested_output
from ..format.keymap import remap
from ..frameworks.flat import FlatTensors
from .inspect import load_metadata
from .merge import CAST_DTYPES, read_full_tensor
from .pieces import check_data_files

__all__ = ["ModifyResult", "modify", "parse_rename"]


@dataclass(frozen=True, slots=True)
class ModifyResult:
    out: str
    kept: int
    dropped: int
    renamed: int


def parse_rename(text: str) -> tuple[re.Pattern[str], str]:
    """``"PATTERN=REPLACEMENT"`` (Python ``re.sub`` syntax) -> compiled pair."""
    pattern, sep, repl = text.partition("=")
    if not sep or not pattern:
        raise ValueError(f"--rename takes PATTERN=REPLACEMENT, got {text!r}")
    try:
        return re.compile(pattern), repl
    except re.error as e:
        raise ValueError(f"--rename {text!r}: bad regular expression: {e}") from None


def modify(
    src: str,
    out: str,
    *,
    renames: Sequence[tuple[re.Pattern[str], str]] = (),
    drops: Sequence[re.Pattern[str]] = (),
    dtype: str | None = None,
    threads: int = 4,
) -> ModifyResult:
    refuse_nested_output(src, out, "modify")
    if os.path.lexists(out):
        if os.path.islink(out) or not os.path.isdir(out):
            raise ConfigurationError(f"modify: {out} exists and is not a folder; modify writes a new checkpoint only")
        if os.listdir(out):
            raise ConfigurationError(f"modify: {out} is not empty; modify writes a new checkpoint only")
    cast = CAST_DTYPES[dtype] if dtype is not None else None
    storage, md, _ = load_metadata(src)

    def key_map(key: str) -> str | None:
        if any(p.search(key) for p in drops):
            return None
        for pattern, repl in renames:
            key = pattern.sub(repl, key)
        return key

    mapped = remap(md, key_map)
    origin = {key_map(k): k for k in md.tensors if key_map(k) is not None}
    check_data_files(storage, md, [origin[new] for new in mapped.tensors])  # before allocating any tensor
    tensors = {}
    for new in mapped.tensors:
        t = read_full_tensor(md, storage, origin[new], threads)
        tensors[new] = t.to(cast) if cast is not None and t.is_floating_point() else t
    if not tensors:
        raise ConfigurationError(f"modify: every tensor of {storage.url} was dropped")
    objects = {
        k: v for k, v in mapped.objects.items() if k != "optimizer" or any(n.startswith("optimizer.") for n in tensors)
    }
    import unickpt

    unickpt.save(out, {"model": FlatTensors(tensors, objects)}, framework="tensors")
    renamed = sum(1 for new, old in origin.items() if new != old)
    return ModifyResult(out, len(tensors), len(md.tensors) - len(tensors), renamed)
