"""Dataloader state that survives a change of the data-parallel size: the ``unickpt.data`` protocol,
the blobs it is stored in, and the ``"dataloader"`` metadata section that indexes them.

A loader takes part by implementing ``ReshardableLoader``: its state is split into a
*replicated* part (the same on every DP rank: dataset list, weights, epoch rules, seed) and
``num_parts`` *parts* (read positions, token buffers, sampler counters), numbered globally and
fixed when the loader is built, independent of the DP size; DP rank ``r`` of ``n`` owns some of
them (``TokenPackingLoader``: ``p % n == r``). Resharding is then re-assignment: after a change
of DP size every part goes to exactly one new owner with its position, so no sample is lost or
repeated. A loader whose parts cannot be spread over the new size refuses with
``LoaderStateError``.

Order of use
  save  every rank holding ``state["dataloader"]`` (only ranks that own a loader: in Megatron
        jobs TP rank 0 of the first PP stage) -> ``loader_blobs(loader)``: the DP rank 0
        loader's replicated part (blob ``dataloader/replicated-of-<N>``) and each owned part
        (``dataloader/part-<p>-of-<N>``), each in the safe value encoding. Rank 0 at the commit
        -> ``loader_index(blob keys)``: the section (every part exactly once, or the save fails).
  load  any rank holding a loader -> ``LoaderIndex`` from ``Metadata.sections`` -> every blob of
        it read (``engine.load.pipeline``) -> ``loader.load_unickpt_state(replicated, parts,
        saved_dp_size)``, which keeps the parts it owns now.
Loaders with only ``state_dict`` / ``load_state_dict`` keep the per-rank blob of older
releases: loaded as they are at the same world size, refused after a change (or left alone with
``LoadOptions(restore=RestoreOptions(loader_on_resize="skip"))``): a silent ``r % old_size`` would replay or drop data.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import CorruptMetadataError, LoaderStateError, PlanningError
from ..format.sections import DEFAULT_SECTIONS, SectionCodec

__all__ = [
    "LoaderState",
    "ReshardableLoader",
    "LoaderIndex",
    "is_reshardable",
    "loader_blobs",
    "loader_index",
    "LOADER_SECTION",
    "LEGACY_PREFIX",
    "MAX_PARTS",
]

LOADER_SECTION = "dataloader"
LEGACY_PREFIX = "dataloader/rank"  # per-rank blobs of loaders without the protocol
MAX_PARTS = 1 << 20
_PART = re.compile(r"dataloader/part-(\d{1,7})-of-(\d{1,7})")
_REPLICATED = re.compile(r"dataloader/replicated-of-(\d{1,7})")


@dataclass(frozen=True, slots=True)
class LoaderState:
    """What one DP rank's loader saves: ``replicated`` (equal on every DP rank; saved by DP rank
    0), and ``parts`` (global part number -> that part's state) for the parts it owns now."""

    dp_rank: int
    dp_size: int
    num_parts: int
    replicated: Mapping[str, Any]
    parts: Mapping[int, Mapping[str, Any]]

    def __post_init__(self) -> None:
        if not (0 <= self.dp_rank < self.dp_size):
            raise LoaderStateError(f"loader state: dp_rank {self.dp_rank} is outside dp_size {self.dp_size}")
        if not (1 <= self.num_parts <= MAX_PARTS):
            raise LoaderStateError(f"loader state: num_parts {self.num_parts} is outside 1..{MAX_PARTS}")
        bad = [p for p in self.parts if not (isinstance(p, int) and 0 <= p < self.num_parts)]
        if bad:
            raise LoaderStateError(f"loader state: part numbers {bad[:5]} are outside 0..{self.num_parts - 1}")


@runtime_checkable
class ReshardableLoader(Protocol):
    """The ``unickpt.data`` protocol (module docstring)."""

    def unickpt_state(self) -> LoaderState:
        """This DP rank's replicated state and the parts it owns, as plain values."""

    def load_unickpt_state(
        self, replicated: Mapping[str, Any], parts: Mapping[int, Mapping[str, Any]], saved_dp_size: int
    ) -> None:
        """Restore from the saved replicated state and *every* saved part (keep those this rank
        owns now); raise ``LoaderStateError`` when this loader cannot take them (another dataset,
        part count, or more DP ranks than parts)."""


def is_reshardable(loader: object) -> bool:
    return callable(getattr(loader, "unickpt_state", None)) and callable(getattr(loader, "load_unickpt_state", None))


def part_key(part: int, num_parts: int) -> str:
    return f"dataloader/part-{part}-of-{num_parts}"


def replicated_key(num_parts: int) -> str:
    return f"dataloader/replicated-of-{num_parts}"


def loader_blobs(loader: ReshardableLoader) -> dict[str, dict[str, Any]]:
    """Blob key -> value to save for this rank's loader (module docstring)."""
    st = loader.unickpt_state()
    if not isinstance(st, LoaderState):
        raise LoaderStateError(f"{type(loader).__name__}.unickpt_state() must return a unickpt.data.LoaderState")
    out: dict[str, dict[str, Any]] = {}
    if st.dp_rank == 0:
        out[replicated_key(st.num_parts)] = {"dp_size": st.dp_size, "state": dict(st.replicated)}
    for p, value in st.parts.items():
        out[part_key(p, st.num_parts)] = dict(value)
    return out


@dataclass(frozen=True, slots=True)
class LoaderIndex:
    """The ``"dataloader"`` metadata section (the design note's LoaderShardToByteMap): where the
    replicated state and each part live (blob keys; the blobs carry file, offset and CRC32C)."""

    num_parts: int
    replicated: str
    parts: tuple[str, ...]  # parts[p] is the blob key of part p


def loader_index(blob_keys: Iterable[str]) -> LoaderIndex | None:
    """The section for a save whose blobs are ``blob_keys`` (None without protocol loaders).
    ``PlanningError`` unless the replicated state is there once and every part exactly once."""
    keys = list(blob_keys)
    replicated = [k for k in keys if _REPLICATED.fullmatch(k)]
    parts = [k for k in keys if _PART.fullmatch(k)]
    if not replicated and not parts:
        return None
    sizes = {int(_REPLICATED.fullmatch(k).group(1)) for k in replicated}  # type: ignore[union-attr]
    sizes |= {int(_PART.fullmatch(k).group(2)) for k in parts}  # type: ignore[union-attr]
    if len(sizes) != 1:
        raise PlanningError(f"dataloader state: the ranks' loaders disagree on the number of parts: {sorted(sizes)}")
    (n,) = sizes
    if len(replicated) != 1:
        raise PlanningError(
            "dataloader state: no rank saved the replicated part (the loader with dp_rank 0 must be in the state)"
            if not replicated
            else "dataloader state: the replicated part was saved twice"
        )
    seen = sorted(int(_PART.fullmatch(k).group(1)) for k in parts)  # type: ignore[union-attr]
    dup = sorted({p for p in seen if seen.count(p) > 1})
    missing = sorted(set(range(n)) - set(seen))
    if dup or missing:
        raise PlanningError(
            f"dataloader state: every one of the {n} parts must be saved by exactly one rank; "
            f"missing {missing[:10]}, saved twice {dup[:10]} (give the loader only on the ranks that own one)"
        )
    return LoaderIndex(n, replicated[0], tuple(part_key(p, n) for p in range(n)))


def _encode(idx: LoaderIndex) -> dict[str, Any]:
    return {"num_parts": idx.num_parts, "replicated": idx.replicated, "parts": list(idx.parts)}


def _decode(data: Any, version: int) -> LoaderIndex:
    del version
    if not isinstance(data, dict) or set(data) != {"num_parts", "replicated", "parts"}:
        raise CorruptMetadataError("dataloader section: expected num_parts, replicated, parts")
    n, rep, parts = data["num_parts"], data["replicated"], data["parts"]
    if type(n) is not int or not (1 <= n <= MAX_PARTS) or not isinstance(parts, list) or len(parts) != n:
        raise CorruptMetadataError(f"dataloader section: {n!r} parts with a list of {len(parts)} keys")
    if rep != replicated_key(n) or parts != [part_key(p, n) for p in range(n)]:
        raise CorruptMetadataError("dataloader section: blob keys do not follow the part numbering")
    return LoaderIndex(n, rep, tuple(parts))


LOADER_CODEC: SectionCodec[LoaderIndex] = SectionCodec(
    LOADER_SECTION, LoaderIndex, _encode, _decode, version=1, required=False, max_bytes=64 << 20
)
if LOADER_SECTION not in DEFAULT_SECTIONS:
    DEFAULT_SECTIONS.register(LOADER_CODEC)
