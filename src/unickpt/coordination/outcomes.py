"""What every rank raises when a stage failed somewhere, or when the ranks disagree.

``run_stage`` (coordination.base) gathers one ``Outcome`` per rank and applies the same rules on
every rank, at every world size (one process included):
  * every failing rank raised the same ``CheckpointError`` type -> every rank raises that type,
    its message naming each failing rank and the stage (``stage_error``);
  * different types, or any exception that is not a ``CheckpointError`` -> every rank raises
    ``RankFailures`` holding each failing rank's exception object;
  * no failure, but the ranks claimed different values (path, framework, role) -> every rank
    raises ``RankDisagreementError`` listing each rank's value (``disagreement``).
The decisions use only what the failing ranks sent (type names, messages), so every rank makes
the same one.

Transport: a failing rank sends its exception pickled (at most ``MAX_PICKLED`` bytes) beside its
type, message and traceback text. The receivers rebuild it with ``unpack``, whose unpickler
resolves only exception classes of modules already imported (it imports nothing and builds no
other object); what cannot be rebuilt becomes a ``RemoteRankError`` with that type name, message
and traceback text. These are reports between live ranks of one job, never checkpoint data.
"""

from __future__ import annotations

import copy
import io
import pickle
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, RankDisagreementError, RankFailures, RemoteRankError

__all__ = ["Outcome", "pack", "unpack", "stage_error", "disagreement", "retitled", "MAX_PICKLED"]

MAX_PICKLED = 64 << 10
_SHOWN_VALUES = 8


@dataclass(frozen=True, slots=True)
class Outcome:
    """One rank's result of a stage: its failure (if any) and what it claims to agree on."""

    error_type: str | None = None  # "module.QualName" of the exception, None on success
    checkpoint_error: bool = False
    message: str = ""
    traceback_text: str = ""
    pickled: bytes | None = None
    claims: tuple[tuple[str, str], ...] = ()  # (what, value as text), on success
    count: int = 0  # run_stage's ``settle`` count
    shared: Any = None  # run_stage's ``share`` value, on success


def pack(e: BaseException, transport: bool = True, count: int = 0) -> Outcome:
    """The failure record of ``e`` (``transport``: also pickle it for the other ranks)."""
    cls = type(e)
    data = None
    if transport:
        try:
            data = pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            data = None
        if data is not None and len(data) > MAX_PICKLED:
            data = None
    return Outcome(
        f"{cls.__module__}.{cls.__qualname__}",
        isinstance(e, CheckpointError),
        str(e),
        "".join(traceback.format_exception(e)),
        data,
        count=count,
    )


class _ExceptionsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        obj: object = sys.modules.get(module)
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not an exception class loaded here")


def unpack(rank: int, outcome: Outcome) -> BaseException:
    """The exception another rank raised, rebuilt with its attributes, or a stand-in."""
    assert outcome.error_type is not None
    if outcome.pickled is not None:
        try:
            e = _ExceptionsOnly(io.BytesIO(outcome.pickled)).load()
            if isinstance(e, BaseException):
                e.add_note(f"(raised on rank {rank}; its traceback there:)\n{outcome.traceback_text}")
                return e
        except Exception:
            pass
    return RemoteRankError(outcome.error_type.rsplit(".", 1)[-1], outcome.message, outcome.traceback_text)


def stage_error(stage: str, outcomes: Mapping[int, Outcome], rank: int, local: BaseException | None) -> CheckpointError:
    """The error this rank raises for a stage that failed on the ranks in ``outcomes``
    (``local``: this rank's own exception, if it failed)."""
    failed = dict(sorted(outcomes.items()))

    def exception_of(r: int) -> BaseException:
        return local if r == rank and local is not None else unpack(r, failed[r])

    kinds = {(o.error_type, o.checkpoint_error) for o in failed.values()}
    (kind, is_ckpt), *more = kinds
    if not more and is_ckpt and kind != f"{RankFailures.__module__}.{RankFailures.__qualname__}":
        lines = [_line(r, stage, o.message) for r, o in failed.items()]
        first = rank if rank in failed else min(failed)
        base = exception_of(first)
        if isinstance(base, CheckpointError) and f"{type(base).__module__}.{type(base).__qualname__}" == kind:
            return retitled(base, "\n".join(lines))
        return RankFailures(stage, {r: exception_of(r) for r in failed})
    return RankFailures(stage, {r: exception_of(r) for r in failed})


def _line(rank: int, stage: str, message: str) -> str:
    """``rank r, stage: message`` without repeating the rank or an OSError's ``[Errno n]``."""
    if message.startswith("[Errno "):
        message = message.split("] ", 1)[-1]
    if message.startswith(f"rank {rank}, "):
        return message
    if message.startswith(f"rank {rank}: "):
        message = message[len(f"rank {rank}: ") :]
    return f"rank {rank}, {stage}: {message}"


def retitled(e: CheckpointError, message: str) -> CheckpointError:
    """A copy of ``e`` (same type and attributes, an OSError's errno included) whose message is
    ``message``; ``e`` itself when its type cannot be copied."""
    try:
        new = copy.copy(e)
    except Exception:
        return e
    if isinstance(new, OSError) and new.errno is not None:
        new.strerror = message  # str(): "[Errno n] <message>"
    else:
        new.args = (message,)
    new.__cause__ = e if e.__traceback__ is not None else e.__cause__
    return new


def disagreement(stage: str, claims: Mapping[int, tuple[tuple[str, str], ...]]) -> RankDisagreementError | None:
    """``RankDisagreementError`` when the ranks claimed different values, else None."""
    if not claims:
        return None
    by_what: dict[str, dict[int, str]] = {}
    for r, pairs in sorted(claims.items()):
        for what, value in pairs:
            by_what.setdefault(what, {})[r] = value
    differ = {what: values for what, values in by_what.items() if len(set(values.values())) > 1}
    if not differ:
        return None
    lines = [
        f"{stage}: the ranks disagree on the {' and '.join(differ)}; every rank must pass the same path, "
        "framework and role (a per-rank value, e.g. a timestamp in the path, makes each rank save "
        "somewhere else). Refused before any data was read or written. Values:"
    ]
    for what, values in differ.items():
        groups: dict[str, list[int]] = {}
        for r, v in values.items():
            groups.setdefault(v, []).append(r)
        shown = [f"{v} on {_ranks(rs)}" for v, rs in list(groups.items())[:_SHOWN_VALUES]]
        more = len(groups) - len(shown)
        lines.append(f"  {what}: " + "; ".join(shown) + (f"; ... and {more} more values" if more > 0 else ""))
    return RankDisagreementError("\n".join(lines), differ)


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0-2, 5``."""
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)
