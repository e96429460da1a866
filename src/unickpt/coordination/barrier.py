"""The commit barrier: every rank reports the end of its part through the job's key-value store,
without waiting for the others; rank 0 commits once all have reported; the outcome comes back
through the store (no collective, so no rank waits in a group for a slow or dead peer).

    commit_barrier(coord, key, report, commit, stage="save (write)", commit_stage="save (commit)")

``report()`` runs on every rank: its payload (opaque bytes, encoded by the caller) or the
exception it raised. ``commit(payloads)`` runs on rank 0 only, with every rank's payload in rank
order, once every rank reported success; its result is returned on rank 0 (None elsewhere).

Who does what (keys ``<scope.prefix>/<key>/...``, one set per ``key``, e.g. per save id):
  every rank  appends one frame (its rank, success or failure, its bytes) to ``reports`` and
              counts itself in ``count``; the rank that completes the count sets ``all``.
  rank 0      waits for ``all`` (at most ``timeout`` from its own report), then claims the
              ``decision`` (``compare_set``: only the first claim counts): ``commit`` when every
              rank reported success, else a failure record (the reported failures, or the ranks
              whose report is missing). On ``commit`` it calls ``commit`` and sets ``outcome``
              (success, or the commit's failure).
  other ranks wait for the ``decision`` (at most ``timeout`` from their own report); when none
              comes they claim it themselves (a failure naming the ranks whose report is missing)
              and set ``all`` so that rank 0 stops waiting. After ``commit`` they wait (at most
              ``timeout``) for the ``outcome``.
The decision is claimed once, so every rank learns the same one: rank 0 never commits after
another rank gave up, and no rank gives up once rank 0 decided to commit.

What every rank raises (the contract of ``run_stage``, same error type on every rank): reported
failures -> ``outcomes.stage_error(stage, ...)`` (the failing ranks' common ``CheckpointError``
type, else ``RankFailures``); missing reports -> ``CollectiveTimeoutError`` naming the ranks and
the stage; a failed commit -> ``stage_error(commit_stage, {0: ...})``; a store that cannot be
reached (its host died) -> ``CollectiveError``. Failures travel as ``outcomes.Outcome`` fields in
the safe value encoding (``format.values``); payloads are never decoded here.

Waiting ranks warn every ``scope.warn_every`` seconds (``coordination.waits``): while reports are
missing, naming the ranks whose report is missing; then (the others) naming rank 0, deciding or
committing.

Cleanup: each rank counts itself out in ``done`` once it knows the outcome; the last one deletes
the keys. A barrier that a rank never finishes (it died) leaves its keys behind. After a failed
barrier rank 0, the store's host, waits (a few seconds at most) for the ranks that reported to
count out before raising, so that its process ending cannot take the store away from a rank
still reading the decision.

Without a store (``coord.store_scope()`` None: one process) the same contract runs on
collectives: ``run_stage`` on the reports, a gather of the payloads, ``run_stage`` on the commit.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from ..errors import CheckpointError, CollectiveError, CollectiveTimeoutError
from ..format.values import dumps_value, loads_value
from .base import Coordinator, run_stage
from .outcomes import Outcome, pack, stage_error
from .store import StoreScope
from .waits import OTHERS_NAME_THEM, WAITS, names_missing

__all__ = ["commit_barrier"]

T = TypeVar("T")

_FRAME = struct.Struct("<IBQ")  # rank, 1 = success / 0 = failure, length of the bytes that follow
_COMMIT = b"C"
_SUCCESS = b"S"
_FAILED = b"F"
_LINGER = 5.0  # seconds rank 0 keeps the store up for the others after a failed barrier, at most


def commit_barrier(
    coord: Coordinator,
    key: str,
    report: Callable[[], bytes],
    commit: Callable[[list[bytes]], T],
    *,
    stage: str,
    commit_stage: str,
    on_decided: Callable[[], None] | None = None,
) -> T | None:
    """Report this rank's ``report()``; rank 0 runs ``commit`` once every rank succeeded (module
    docstring). ``key``: unique to this barrier (a save id); ``on_decided``: called on every rank
    once the commit is decided (rank 0: before ``commit``)."""
    scope = coord.store_scope() if coord.world_size > 1 else None
    if scope is None:
        return _on_collectives(coord, report, commit, stage, commit_stage, on_decided)
    return _StoreBarrier(scope, key, coord.rank, coord.world_size, stage).run(report, commit, commit_stage, on_decided)


def _on_collectives(
    coord: Coordinator,
    report: Callable[[], bytes],
    commit: Callable[[list[bytes]], T],
    stage: str,
    commit_stage: str,
    on_decided: Callable[[], None] | None,
) -> T | None:
    payload = run_stage(coord, stage, report)
    gathered = coord.gather_object(payload) if coord.world_size > 1 else [payload]
    if on_decided is not None:
        on_decided()
    return run_stage(coord, commit_stage, lambda: commit(gathered or []) if coord.rank == 0 else None)


class _StoreBarrier:
    def __init__(self, scope: StoreScope, key: str, rank: int, world_size: int, stage: str) -> None:
        self.scope, self.rank, self.world_size, self.stage = scope, rank, world_size, stage
        self.store = scope.store
        base = f"{scope.prefix}/{key}"
        self.k_reports, self.k_count, self.k_all = f"{base}/reports", f"{base}/count", f"{base}/all"
        self.k_decision, self.k_outcome, self.k_done = f"{base}/decision", f"{base}/outcome", f"{base}/done"
        self._decision = b""  # rank 0: the decision it read back after its claim

    # ------------------------------------------------------------------ the barrier

    def run(
        self,
        report: Callable[[], bytes],
        commit: Callable[[list[bytes]], T],
        commit_stage: str,
        on_decided: Callable[[], None] | None,
    ) -> T | None:
        local: BaseException | None = None
        try:
            payload = report()
            frame = _FRAME.pack(self.rank, 1, len(payload)) + payload
        except Exception as e:  # reported to every rank through the decision
            local = e
            body = _encode_outcome(pack(e))
            frame = _FRAME.pack(self.rank, 0, len(body)) + body
        t0 = time.monotonic()
        failed = True
        try:
            self._store("report", self._report, frame)
            if self.rank == 0:
                result = self._lead(t0, local, commit, commit_stage, on_decided)
            else:
                self._follow(t0, local, on_decided)
                result = None
            failed = False
            return result
        finally:
            self._count_out()
            if failed and self.rank == 0:
                self._linger()

    def _report(self, frame: bytes) -> None:
        self.store.append(self.k_reports, frame)
        if self.store.add(self.k_count, 1) == self.world_size:
            self.store.set(self.k_all, b"1")

    def _lead(
        self,
        t0: float,
        local: BaseException | None,
        commit: Callable[[list[bytes]], T],
        commit_stage: str,
        on_decided: Callable[[], None] | None,
    ) -> T:
        self._wait(self.k_all, t0)
        frames = self._store("read the reports", self._frames)
        claim = self._verdict(frames, leader_late=False)
        decision = self._store("claim the decision", self.store.compare_set, self.k_decision, "", claim)
        self._decision = decision
        if decision != _COMMIT:
            raise self._error(decision, local) from local
        if on_decided is not None:
            on_decided()
        try:
            result = commit([frames[r][1] for r in range(self.world_size)])
        except Exception as e:
            failed = {0: pack(e)}
            try:
                self.store.set(self.k_outcome, _FAILED + _encode_record(commit_stage, failed, None, "", None))
            except Exception:  # the others then time out waiting for the outcome, naming rank 0
                pass
            raise stage_error(commit_stage, {0: pack(e, transport=False)}, 0, e) from e
        self._store("publish the outcome", self.store.set, self.k_outcome, _SUCCESS)
        return result

    def _follow(self, t0: float, local: BaseException | None, on_decided: Callable[[], None] | None) -> None:
        if self._wait(self.k_decision, t0):
            decision = self._store("read the decision", self.store.get, self.k_decision)
        else:  # no decision in time: claim a failure naming the missing reports
            frames = self._store("read the reports", self._frames)
            claim = self._verdict(frames, leader_late=True)
            decision = self._store("claim the decision", self.store.compare_set, self.k_decision, "", claim)
            try:
                self.store.set(self.k_all, b"1")  # rank 0 stops waiting for the missing reports
            except Exception:
                pass
        if decision != _COMMIT:
            raise self._error(decision, local) from local
        if on_decided is not None:
            on_decided()
        if not self._wait(self.k_outcome, time.monotonic()):
            raise CollectiveTimeoutError(
                f"{self.scope.label}: rank 0 did not finish the commit within {self.scope.timeout:g}s after every "
                f"rank reported the end of {self.stage}; the checkpoint may or may not be committed",
                (0,),
                self.scope.timeout,
            )
        outcome = self._store("read the outcome", self.store.get, self.k_outcome)
        if outcome != _SUCCESS:
            raise self._error(outcome, None)

    # ------------------------------------------------------------------ records

    def _frames(self) -> dict[int, tuple[bool, bytes]]:
        return _frames_of(self.store.get(self.k_reports))

    def _verdict(self, frames: dict[int, tuple[bool, bytes]], leader_late: bool) -> bytes:
        """The decision these reports make: commit, or the failure record."""
        missing = [r for r in range(self.world_size) if r not in frames]
        failed = {r: _decode_outcome(body) for r, (ok, body) in sorted(frames.items()) if not ok}
        t = self.scope.timeout
        if missing:
            message = (
                f"{self.scope.label}: rank(s) {missing} did not report the end of {self.stage} within {t:g}s "
                "(each rank reports when its part is done; the commit waits for every rank): nothing was committed"
            )
        elif leader_late and not failed:
            missing = [0]
            message = (
                f"{self.scope.label}: rank 0 did not decide the commit within {t:g}s although every rank "
                f"reported the end of {self.stage}: nothing was committed"
            )
        elif failed:
            return _FAILED + _encode_record(self.stage, failed, None, "", None)
        else:
            return _COMMIT
        if failed:
            lines = "; ".join(f"rank {r}: {o.error_type}: {o.message}" for r, o in failed.items())
            message += f". Reported failures: {lines}"
        return _FAILED + _encode_record(self.stage, failed, missing, message, t)

    def _error(self, data: bytes, local: BaseException | None) -> CheckpointError:
        """The error a failure record (a decision or an outcome) makes this rank raise."""
        try:
            if not data.startswith(_FAILED):
                raise ValueError(f"unknown record {data[:16]!r}")
            doc = loads_value(data[1:], "commit barrier record")
            failed = {int(r): _outcome_of(o) for r, o in doc["failures"].items()}
            if doc["missing"] is not None:
                return CollectiveTimeoutError(doc["message"], tuple(doc["missing"]), doc["timeout"])
            return stage_error(doc["stage"], failed, self.rank, local)
        except CheckpointError:
            raise
        except Exception as e:
            return CollectiveError(f"{self.scope.label}: unreadable record in the commit barrier: {e}")

    # ------------------------------------------------------------------ store access

    def _wait(self, key: str, since: float) -> bool:
        """Whether ``key`` appeared within the timeout counted from ``since``; while it waits, a
        warning every ``scope.warn_every`` seconds says whom for (``coordination.waits``)."""
        remaining = max(0.001, self.scope.timeout - (time.monotonic() - since))
        what = f"{self.scope.label}: the commit barrier after {self.stage}"
        ticket = WAITS.watch(what, self.scope.warn_every, self.scope.timeout, lambda: self._waiting_for(key), self.rank)
        try:
            self.store.wait([key], timedelta(seconds=remaining))
            return True
        except Exception:
            return self._store("check the barrier", self.store.check, [key])
        finally:
            WAITS.done(ticket)

    def _waiting_for(self, key: str) -> str:
        """Whom a rank waiting for ``key`` waits for: the ranks whose report is missing (ranks
        below ``waits.NAMING_RANKS``; the others count them), else rank 0. Read over the scope's
        watch store: the barrier's own connection is waiting."""
        store = self.scope.watch_store or self.store
        if key != self.k_outcome and names_missing(self.rank):
            data = store.get(self.k_reports) if store.check([self.k_reports]) else b""
            missing = [r for r in range(self.world_size) if r not in _frames_of(data)]
            if missing:
                return f"rank(s) {missing} have not reported the end of {self.stage} yet"
        elif key != self.k_outcome:
            late = self.world_size - store.add(self.k_count, 0)
            if late > 0:
                return f"{late} rank(s) have not reported the end of {self.stage} yet ({OTHERS_NAME_THEM})"
        doing = "finish the commit" if key == self.k_outcome else "decide the commit"
        return f"every rank reported the end of {self.stage}; waiting for rank 0 to {doing}"

    def _store(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except CheckpointError:
            raise
        except Exception as e:
            raise CollectiveError(
                f"{self.scope.label}: the commit barrier could not {what} in the job's store (the process "
                f"hosting it, rank 0 of the job, may have died): {type(e).__name__}: {e}",
                (),
                self.scope.timeout,
            ) from e

    def _linger(self) -> None:
        """Rank 0 hosts the job's store, and its error may end its process (and the store with
        it): after a failed barrier it waits, at most ``_LINGER`` seconds, until every rank that
        reported has counted out (read the decision), so that none of them finds the store gone
        and raises a different error than the others."""
        expected = self.world_size
        try:
            if self._decision.startswith(_FAILED):
                expected -= len(loads_value(self._decision[1:], "commit barrier record")["missing"] or ())
        except Exception:  # an unreadable record: wait for every rank, still at most _LINGER
            pass
        deadline = time.monotonic() + min(_LINGER, self.scope.timeout)
        try:
            while time.monotonic() < deadline:
                # the counter gone: the last rank counted out and removed the keys
                if not self.store.check([self.k_done]):
                    break
                counted = self.store.add(self.k_done, 0)
                if counted == 0:  # removed after the check (this rank counted 1): add recreated it
                    self.store.delete_key(self.k_done)
                    break
                if counted >= expected:
                    break
                time.sleep(0.01)  # a bounded poll: the store has no wait for a counter's value
        except Exception:  # the store is gone: nobody to wait for
            pass

    def _count_out(self) -> None:
        """This rank knows the outcome; the last rank to know deletes the barrier's keys."""
        try:
            if self.store.add(self.k_done, 1) == self.world_size:
                for k in (self.k_reports, self.k_count, self.k_all, self.k_decision, self.k_outcome, self.k_done):
                    self.store.delete_key(k)
        except Exception:  # the keys stay behind; the outcome is known
            pass


def _frames_of(data: bytes) -> dict[int, tuple[bool, bytes]]:
    """The report frames appended to the ``reports`` key: rank -> (success, bytes); the first
    frame of a rank counts."""
    out: dict[int, tuple[bool, bytes]] = {}
    pos = 0
    while pos + _FRAME.size <= len(data):
        rank, ok, n = _FRAME.unpack_from(data, pos)
        pos += _FRAME.size
        out.setdefault(rank, (bool(ok), bytes(data[pos : pos + n])))
        pos += n
    return out


def _encode_record(
    stage: str, failed: dict[int, Outcome], missing: list[int] | None, message: str, timeout: float | None
) -> bytes:
    doc = {
        "stage": stage,
        "failures": {r: _outcome_doc(o) for r, o in failed.items()},
        "missing": missing,
        "message": message,
        "timeout": timeout,
    }
    return dumps_value(doc, "commit barrier record")


def _outcome_doc(o: Outcome) -> dict[str, Any]:
    return {
        "type": o.error_type,
        "checkpoint_error": o.checkpoint_error,
        "message": o.message,
        "traceback": o.traceback_text,
        "pickled": o.pickled,
    }


def _encode_outcome(o: Outcome) -> bytes:
    return dumps_value(_outcome_doc(o), "commit barrier report")


def _decode_outcome(data: bytes) -> Outcome:
    return _outcome_of(loads_value(data, "commit barrier report"))


def _outcome_of(doc: dict[str, Any]) -> Outcome:
    pickled = doc["pickled"]
    return Outcome(
        str(doc["type"]),
        bool(doc["checkpoint_error"]),
        str(doc["message"]),
        str(doc["traceback"]),
        pickled if isinstance(pickled, bytes) else None,
    )
