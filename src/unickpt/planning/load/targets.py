"""Load targets against the metadata: what a load asks (keys, shapes, dtypes) checked before any
byte is read. Pure functions; each collects every problem and raises one error.

Used on every rank in the load's validate stage: :func:`check_targets` (shapes, dtypes, then
missing / unexpected keys: a strict load raises them, a non-strict one returns them in a
:class:`KeyReport`); after every rank's keys are combined, :func:`keys_error` for a strict load.

Strictness is a ``bool``, as ``load(strict=...)`` takes it: an enum with Megatron's partial modes
(raise only missing / only unexpected keys) had no caller before the first release and went
(issue 41). Load targets are anything with ``fqn``, ``dtype`` and
``global_shape`` (:class:`TargetSpec`; ``planning.specs.ShardSpec`` is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ...errors import (
    DtypeMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    UnexpectedKeysError,
)
from ...format.records import Metadata

__all__ = ["KeyReport", "TargetSpec", "check_targets", "keys_error", "rename_guess"]


@dataclass(frozen=True, slots=True)
class KeyReport:
    """Keys a non-strict load skipped instead of raising (both empty after a strict one)."""

    missing: tuple[str, ...]  # wanted by the live state, absent from the checkpoint
    unexpected: tuple[str, ...]  # in the checkpoint, not wanted by the live state


class TargetSpec(Protocol):
    """What a load target must say about itself (``planning.specs.ShardSpec`` does)."""

    @property
    def fqn(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def global_shape(self) -> tuple[int, ...]: ...


def check_targets(
    md: Metadata,
    specs: Sequence[TargetSpec],
    *,
    strict: bool,
    source: str,
    checkpoint_keys: set[str] | None = None,
    cast_dtypes: bool = False,
) -> KeyReport:
    """Validate load targets against the metadata; raise one error listing every problem.

    ``checkpoint_keys``: the saved fqns this load is responsible for (default: all tensors), so a
    load of only the model does not call the optimizer's tensors unexpected. ``cast_dtypes``:
    differing dtypes are converted while loading instead of refused. Shape mismatches raise
    ``ShapeMismatchError``, else dtype mismatches ``DtypeMismatchError``, else keys the
    ``strict`` load has ``keys_error``'s class; the message lists every problem of every kind.
    Returns the keys a non-strict load lets through (none after a strict one)."""
    wanted = {s.fqn: s for s in specs}
    saved = set(md.tensors) if checkpoint_keys is None else checkpoint_keys
    missing = sorted(set(wanted) - set(md.tensors))
    unexpected = sorted(saved - set(wanted))
    shape_problems, dtype_problems = [], []
    for fqn, spec in wanted.items():
        rec = md.tensors.get(fqn)
        if rec is None:
            continue
        if tuple(rec.shape) != tuple(spec.global_shape):
            shape_problems.append(f"{fqn}: checkpoint shape {rec.shape}, live shape {spec.global_shape}")
        elif rec.dtype != spec.dtype and not cast_dtypes:
            dtype_problems.append(f"{fqn}: checkpoint dtype {rec.dtype}, live dtype {spec.dtype}")
    keys = keys_error(missing, unexpected, source) if strict and (missing or unexpected) else None
    texts = []
    if shape_problems:
        texts.append(f"shape mismatch loading {source}:" + _listing(shape_problems, 10))
    if dtype_problems:
        texts.append(
            f"dtype mismatch loading {source}:"
            + _listing(dtype_problems, 10)
            + "\nCast the live model to the checkpoint's dtypes before loading (model.to(dtype)), or pass "
            "options=unickpt.LoadOptions(restore=RestoreOptions(cast_dtypes=True)) to convert each tensor while "
            "loading (as Tensor.to)"
        )
    if texts and keys is not None:
        texts.append(str(keys))
    if shape_problems:
        raise ShapeMismatchError("\n".join(texts))
    if dtype_problems:
        raise DtypeMismatchError("\n".join(texts))
    if keys is not None:
        raise keys
    return KeyReport(tuple(missing), tuple(unexpected))


def _listing(lines: list[str], cap: int) -> str:
    out = "".join(f"\n  {x}" for x in lines[:cap])
    return out + (f"\n  ... and {len(lines) - cap} more" if len(lines) > cap else "")


def keys_error(missing: list[str], unexpected: list[str], source: str) -> MissingKeysError | UnexpectedKeysError:
    """The strict-load error for these keys: MissingKeysError when some are missing (listing the
    unexpected ones too), else UnexpectedKeysError."""
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} key(s) of the live state are not in checkpoint {source}: "
            + ", ".join(missing[:20])
            + (" ..." if len(missing) > 20 else "")
        )
    if unexpected:
        parts.append(
            f"{'the ' if missing else ''}checkpoint {source} has {len(unexpected)} key(s) the live state lacks: "
            + ", ".join(unexpected[:20])
            + (" ..." if len(unexpected) > 20 else "")
        )
    if missing:
        hint = _rename_hint(missing, unexpected) if unexpected else ""
        hint += "strict=False loads only the keys both have and leaves the others at the job's initial values"
    else:
        hint = "pass strict=False to ignore them"
    msg = "; ".join(parts) + f" ({hint})"
    return MissingKeysError(msg) if missing else UnexpectedKeysError(msg)


def _rename_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """The ``key_map`` advice of a load where both sides have keys the other lacks (a renamed layer)."""
    rename = rename_guess(missing, unexpected)
    fn = f"lambda k: k.replace({rename[0]!r}, {rename[1]!r})" if rename else "fn"
    return (
        "if the job renamed them, map the checkpoint's names onto the job's: "
        f"LoadOptions(restore=RestoreOptions(key_map={fn})) (unickpt.options); "
    )


def _renamed_part(live: str, saved: str) -> tuple[str, str] | None:
    """(saved part, live part) when the two dotted names differ in one run of components only
    (``model.attention.bias`` / ``model.attn.bias`` -> ``(".attention.", ".attn.")``), the parts
    with the dots that bound them; None otherwise."""
    a, b = saved.split("."), live.split(".")
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    old, new = a[head : len(a) - tail], b[head : len(b) - tail]
    if not old or not new or (head == 0 and tail == 0):
        return None
    lead, trail = ("." if head else ""), ("." if tail else "")
    return f"{lead}{'.'.join(old)}{trail}", f"{lead}{'.'.join(new)}{trail}"


def rename_guess(missing: Sequence[str], unexpected: Sequence[str], limit: int = 200) -> tuple[str, str] | None:
    """The substitution (saved part, live part) that turns the most unexpected checkpoint keys into
    missing live ones, for the ``key_map`` hint of ``keys_error``; None when none does. Looks at
    the first ``limit`` keys of each side (a message, not a search)."""
    live = set(missing[:limit])
    counts: dict[tuple[str, str], int] = {}
    for m in missing[:limit]:
        for u in unexpected[:limit]:
            part = _renamed_part(m, u)
            if part is not None and u.replace(part[0], part[1], 1) in live:
                counts[part] = counts.get(part, 0) + 1
    return max(counts, key=lambda p: counts[p]) if counts else None
