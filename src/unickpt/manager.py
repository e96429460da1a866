"""``CheckpointManager``: numbered checkpoints for a training loop, a ``latest`` pointer, retention.

    manager = unickpt.CheckpointManager("ckpts", keep_last=3)
    done = manager.load_latest(state, framework="fsdp2") or 0  # steps already trained; 0 on a fresh start
    for step in range(done, steps):
        train_step(step)
        if (step + 1) % 100 == 0:  # numbered by the steps done: training resumes there
            manager.save(step + 1, state, framework="fsdp2", async_save=True)
    manager.wait()

The step a checkpoint is saved as is what ``load_latest`` returns: number checkpoints by the
steps completed when they were taken (as above), and the value is where training resumes. A
checkpoint numbered by the index of the step it was taken after (``save(step)``) must resume at
``load_latest(...) + 1``, or that step is trained twice.

Layout under ``root`` (any storage URL): ``step_<step:08d>/`` holds one checkpoint (with ``role``:
``step_<step:08d>/<role>/``, so managers of several models can share a root); the pointer file
``latest`` (``latest.<role>``) holds ``{"step": N, "path": "step_000000NN"}``, ``path`` relative to
``root`` so the tree can be moved.

Order of use (every rank calls ``save`` / ``load_latest`` with the same arguments):
  ``save``     -> ``Checkpointer._submit_after`` of its checkpointer (snapshot now; write + commit on
               its worker) -> a post-commit job queued on the same worker, so it runs after
               exactly that save:
               rank 0 checks the committed metadata names this save, publishes the pointer
               (``folder.publish.publisher_for``: temporary file + atomic rename, or one atomic
               put), then applies retention (which also deletes the publisher's own leftovers).
               The returned handle completes after the post-commit job. A failed save never
               reaches the pointer: ``latest`` only ever names a committed checkpoint.
  retention    (rank 0) sorts the step folders of its role (``step_states``) into complete
               (metadata decoded and every data file it names complete, ``folder.files``),
               incomplete (no metadata; unickpt's lock or marker), and kept-unproven (damaged:
               metadata without its data, e.g. a copied metadata file; unreadable: metadata this
               version cannot decode, e.g. a newer format; foreign: nothing unickpt writes). It
               deletes complete checkpoints beyond the ``keep_last`` newest *complete* ones,
               oldest first, never the one ``latest`` names, and the incomplete folders of
               saves older than ``latest`` whose lock is not live; in both only the files
               unickpt's metadata and markers prove it wrote (the metadata first, so a crash
               half-way leaves an incomplete folder, never a complete-looking one with missing
               data; then the data files of unickpt's form under ``data/<save_id>/`` of the
               metadata's and the marked saves, the markers, stale lock generations, publication
               temporaries, and the files of its ``huggingface/`` export that the export's record
               names, the record last; ``folder.cleanup.checkpoint_files``). A user's file anywhere stays;
               kept-unproven folders are never deleted and are named in a warning at each
               retention (and by ``unickpt ls``).
  ``load_latest`` rank 0 reads the pointer (falling back to the newest complete checkpoint when
               it is missing or names an unusable one), broadcasts the step, all ranks load it.
``list_checkpoints`` reports only complete checkpoints; ``latest_step`` falls back only to one.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .coordination.outcomes import Outcome, pack, retitled, unpack
from .errors import CheckpointError, IncompleteCheckpointError, RemoteRankError
from .folder.cleanup import checkpoint_files, delete_checkpoint, delete_files, lock_blocks_deletion
from .folder.lock_owner import LockContext
from .folder.probe import committed_metadata
from .folder.publish import publisher_for
from .folder.state import COMPLETE, DAMAGED, FOREIGN, INCOMPLETE, STATUSES, UNREADABLE, folder_state
from .folder.target import check_role
from .format.hf_manifest import HF_FOLDER
from .format.records import DATA_DIR, METADATA_FILE, Metadata
from .storage import Storage, open_storage
from .storage.base import SMALL_FILE_LIMIT
from .storage.registry import split_url

if TYPE_CHECKING:  # the checkpointer (torch) is imported on the first save or load, not for ls / prune
    from .checkpointer import Checkpointer
    from .engine.runtime.worker import SaveHandle
    from .options import LoadOptions, SaveOptions

__all__ = ["CheckpointManager", "CheckpointInfo", "LatestPointer", "RetentionPlan", "StepState", "STEP_STATUSES"]

_STEP_RE = re.compile(r"step_(\d{8,})")

STEP_STATUSES = STATUSES  # complete, incomplete, damaged, unreadable, foreign (``folder.state``)


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One complete checkpoint under a manager's root."""

    step: int
    path: str  # the URL/path to pass to unickpt.load (with the manager's role)
    save_id: str
    created_unix: float


@dataclass(frozen=True, slots=True)
class StepState:
    """What one step folder of a manager's role holds (``CheckpointManager.step_states``).

    ``status``: one of ``STEP_STATUSES``; ``metadata``: the decoded metadata (complete and
    damaged folders); ``reason``: why it is not complete, for warnings and ``unickpt ls``;
    ``hf_export``: a few words on the Hugging Face export unickpt wrote into its ``huggingface/``
    folder, "" when there is none (``folder.hf_files.describe_hf_export``)."""

    step: int
    status: str
    metadata: Metadata | None = None
    reason: str = ""
    hf_export: str = ""


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """What retention deletes (``CheckpointManager.plan_retention``): per step, the names under
    the root in the groups and order they are deleted; the step folders it keeps without proof
    (named in its warning); the ``latest`` pointer's publication leftovers."""

    deletions: tuple[tuple[int, tuple[tuple[str, ...], ...]], ...]
    kept: tuple[StepState, ...]
    pointer_leftovers: tuple[str, ...] = ()

    @property
    def steps(self) -> list[int]:
        return sorted(step for step, _ in self.deletions)


@dataclass(frozen=True, slots=True)
class LatestPointer:
    """Content of the ``latest`` file: the step and its folder, relative to the root."""

    step: int
    path: str

    def encode(self) -> bytes:
        return json.dumps({"step": self.step, "path": self.path}).encode("utf-8")

    @staticmethod
    def decode(data: bytes) -> LatestPointer | None:
        try:
            doc = json.loads(data.decode("utf-8"))
            step, path = doc["step"], doc["path"]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None
        if type(step) is not int or step < 0 or path != _folder(step):
            return None
        return LatestPointer(step, path)


def _lock_held_in_process(token: str) -> bool:
    """Whether a live checkpointer of this process holds the save lock ``token``
    (``checkpointer._lock_held_here``; False while no checkpointer can exist)."""
    module = sys.modules.get(f"{__package__}.checkpointer")
    return module is not None and bool(module._lock_held_here(token))


def _folder(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Numbered checkpoints under ``root`` with a ``latest`` pointer and ``keep_last`` retention
    (``None`` keeps everything). See the module docstring for the protocol."""

    def __init__(
        self,
        root: str,
        keep_last: int | None = 3,
        role: str | None = None,
        *,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        """``checkpointer``: the one whose worker, groups and options this manager's saves and
        loads use (default: ``unickpt.default_checkpointer()``)."""
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        check_role(role)
        self.root = str(root).rstrip("/")
        self.keep_last = keep_last
        self.role = role
        self.pointer_name = "latest" if role is None else f"latest.{role}"
        self._storage: Storage = open_storage(self.root)
        self._publisher = publisher_for(self._storage)  # ``latest`` and the steps' metadata
        self._checkpointer = checkpointer  # None: ``default_checkpointer()``, taken at the first save or load

    @property
    def _ckpt(self) -> Checkpointer:
        """The checkpointer of this manager's saves and loads (``unickpt.default_checkpointer()``
        unless one was given), taken when first needed: listing and retention never need it."""
        if self._checkpointer is None:
            from .checkpointer import default_checkpointer

            self._checkpointer = default_checkpointer()
        return self._checkpointer

    @property
    def _locks(self) -> LockContext:
        """The lock context retention judges save locks with: the checkpointer's, or, while this
        manager has none yet, one asking every live checkpointer of this process (none exists
        before ``unickpt.checkpointer`` is imported), as the checkpointer's would."""
        if self._checkpointer is not None:
            return self._checkpointer.resources.locks
        return LockContext(held_here=_lock_held_in_process)

    # ------------------------------------------------------------------ paths

    def path_for(self, step: int) -> str:
        """The folder of ``step`` (pass it with ``role=self.role`` to unickpt.save/load)."""
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return f"{self.root}/{_folder(step)}"

    def _prefix(self, step: int) -> str:
        """Names of ``step``'s checkpoint inside the root storage start with this."""
        return f"{_folder(step)}/" + (f"{self.role}/" if self.role else "")

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        state: MutableMapping[str, Any],
        *,
        framework: str = "auto",
        async_save: bool = False,
        options: SaveOptions | None = None,
    ) -> SaveHandle:
        """Save ``state`` as ``step`` (every rank). The handle completes once the checkpoint is
        committed and (rank 0) ``latest`` points at it and retention ran."""
        path = self.path_for(step)
        rank = self._ckpt.rank()
        # the save raises this manager's unseen async failures first; right after it, on the same
        # worker, rank 0 moves ``latest`` and applies retention (the handle is that job's)
        return self._ckpt._submit_after(
            path,
            state,
            lambda inner: self._after_commit(step, inner, rank),
            framework=framework,
            async_save=async_save,
            role=self.role,
            options=options,
            owner=self,
            what=f" of {self.root}",
        )

    def _after_commit(self, step: int, inner: SaveHandle, rank: int) -> Metadata | None:
        md = inner.wait()  # runs after that save on the same worker; re-raises its failure
        if rank != 0:
            return md
        if md is None:
            raise IncompleteCheckpointError(f"save of step {step} returned no metadata on rank 0")
        self._publish_latest(step, md.save_id)
        try:
            self.apply_retention()
        except CheckpointError as e:
            warnings.warn(
                f"checkpoint retention under {self.root} failed (will retry after the next save): {e}", stacklevel=2
            )
        return md

    def _publish_latest(self, step: int, save_id: str) -> None:
        """Move ``latest`` to ``step`` after re-reading its committed metadata (rank 0)."""
        md = self._metadata(step)
        if md is None or md.save_id != save_id:
            raise IncompleteCheckpointError(
                f"refusing to point {self.root}/{self.pointer_name} at step {step}: its metadata "
                f"does not name the save {save_id} that just committed"
            )
        self._publisher.publish(self.pointer_name, LatestPointer(step, _folder(step)).encode())

    def _raise_unreported(self) -> None:
        """Raise one ``AsyncSaveFailures`` for every failed async save of this manager nobody
        has seen yet."""
        self._ckpt.resources.worker.raise_failures(self, f" of {self.root}")

    def wait(self) -> None:
        """Block until every save of this manager committed and its pointer/retention ran;
        raises ``AsyncSaveFailures`` for every failure nobody has seen yet."""
        self._ckpt.resources.worker.drain()
        self._raise_unreported()

    # ------------------------------------------------------------------ discovery

    def _scan(self) -> dict[int, list[str]]:
        """Every step folder under root -> the names of *this role's* checkpoint it holds.

        With a role: ``step_N/<role>/...``. Role-less: the files directly in ``step_N/``
        (metadata, lock, markers) and under ``step_N/data/`` and ``step_N/huggingface/`` (an
        in-save export), never ``step_N/<role>/...``, which belong to the managers of those roles."""
        out: dict[int, list[str]] = {}
        for name in self._storage.list(""):
            first, sep, rest = name.partition("/")
            m = _STEP_RE.fullmatch(first)
            if m is None or not sep:
                continue
            step = int(m.group(1))
            if self.role is not None:
                if not name.startswith(self._prefix(step)):
                    continue
            elif "/" in rest and not rest.startswith((f"{DATA_DIR}/", f"{HF_FOLDER}/")):
                continue
            out.setdefault(step, []).append(name)
        return out

    def _metadata(self, step: int) -> Metadata | None:
        """The decoded metadata of ``step``, or None if missing or undecodable."""
        try:
            return committed_metadata(self._storage, self._prefix(step), where=self._where(step))
        except CheckpointError:
            return None

    def _where(self, step: int) -> str:
        """The metadata file of ``step`` as errors name it (under ``root`` as the user gave it)."""
        return f"{self.root}/{self._prefix(step)}{METADATA_FILE}"

    def _inspect(self, step: int, names: list[str] | None = None) -> StepState:
        """What ``step``'s folder holds (``names``: its names from ``_scan``, listed when None and
        needed): ``folder.state.folder_state``, the states ``unickpt ls`` prints."""
        st = folder_state(self._storage, self._prefix(step), names, self._where(step), self._publisher)
        return StepState(step, st.status, st.metadata, st.reason, st.hf_export)

    def step_states(self) -> list[StepState]:
        """Every step folder of this manager's role and what it holds, by increasing step."""
        folders = self._scan()
        return [self._inspect(step, folders[step]) for step in sorted(folders)]

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Complete checkpoints (metadata decoded, every data file present with its recorded
        size), by increasing step."""
        out = []
        for st in self.step_states():
            if st.status == COMPLETE and st.metadata is not None:
                md = st.metadata
                out.append(CheckpointInfo(st.step, self.path_for(st.step), md.save_id, md.created_unix))
        return out

    def list_steps(self) -> list[tuple[int, bool, int]]:
        """Every step folder of this manager's role: ``(step, complete, tensor bytes)`` by
        increasing step (bytes 0 unless complete; ``step_states`` says why one is not)."""
        out = []
        for st in self.step_states():
            ok = st.status == COMPLETE and st.metadata is not None
            out.append((st.step, ok, st.metadata.total_tensor_bytes if ok and st.metadata is not None else 0))
        return out

    def root_exists(self) -> bool:
        """Whether the root exists: a local root's folder, anything stored under another URL's."""
        scheme, rest = split_url(self.root)
        if scheme == "file":
            return os.path.isdir(os.path.expanduser(rest))
        return bool(self._storage.list(""))

    def read_pointer(self) -> LatestPointer | None:
        """The ``latest`` pointer as written, or None when missing or malformed."""
        data = self._publisher.read(self.pointer_name, SMALL_FILE_LIMIT)
        return None if data is None else LatestPointer.decode(data)

    def latest_step(self) -> int | None:
        """The step ``latest`` names if it is complete; else the newest complete step (with a
        warning when a pointer exists); None when there is no complete checkpoint."""
        raw = self._publisher.read(self.pointer_name, SMALL_FILE_LIMIT)
        pointer = None if raw is None else LatestPointer.decode(raw)
        if pointer is not None and self._inspect(pointer.step).status == COMPLETE:
            return pointer.step
        complete = self.list_checkpoints()
        newest = complete[-1].step if complete else None
        if raw is not None:
            warnings.warn(
                f"{self.root}/{self.pointer_name} is malformed or names an incomplete "
                f"checkpoint; using the newest complete one (step {newest})",
                stacklevel=2,
            )
        return newest

    # ------------------------------------------------------------------ load

    def load_latest(
        self,
        state: MutableMapping[str, Any],
        *,
        framework: str = "auto",
        strict: bool = True,
        options: LoadOptions | None = None,
    ) -> int | None:
        """Load the latest complete checkpoint into ``state`` (every rank); return its step (the
        number it was saved as: save ``step + 1`` after training step ``step`` and this is the
        first step to train; see the module docstring), or None (state untouched) when there is
        none. Rank 0 picks the step for all ranks."""
        self.wait()
        timeout = options.timeout if options is not None else None
        coord = self._ckpt.resources.coordinator("foreground", timeout, f"load_latest of {self.root}")
        outcome: tuple[int | None, Outcome | None] = (None, None)
        local: CheckpointError | None = None
        if coord.rank == 0:
            try:
                outcome = (self.latest_step(), None)
            except CheckpointError as e:
                local, outcome = e, (None, pack(e))
        if coord.world_size > 1:
            outcome = coord.broadcast_object(outcome)
        step, failure = outcome
        if failure is not None:  # every rank raises rank 0's error type (its family), retitled
            found = local if local is not None else unpack(0, failure)
            if not isinstance(found, CheckpointError):  # rank 0 caught CheckpointErrors only
                found = RemoteRankError(str(failure.error_type), failure.message, failure.traceback_text)
            message = failure.message.split("] ", 1)[-1] if failure.message.startswith("[Errno ") else failure.message
            raise retitled(found, f"cannot find the latest checkpoint under {self.root}: {message}")
        if step is None:
            return None
        self._ckpt.load(self.path_for(step), state, framework=framework, strict=strict, role=self.role, options=options)
        return step

    # ------------------------------------------------------------------ retention

    def plan_retention(self) -> RetentionPlan:
        """What ``apply_retention`` would delete now, deleting nothing (rank 0; ``unickpt prune
        --dry-run``)."""
        pointer = self.read_pointer()
        latest = pointer.step if pointer is not None else None
        folders = self._scan()
        states = [self._inspect(step, folders[step]) for step in sorted(folders)]
        complete = [st.step for st in states if st.status == COMPLETE]
        keep = set(complete if self.keep_last is None else complete[-self.keep_last :])
        if latest is not None:
            keep.add(latest)
        targets = [step for step in complete if step not in keep]  # oldest first
        if latest is not None:  # abandoned saves: unickpt's own files only
            targets += [st.step for st in states if st.status == INCOMPLETE and st.step < latest]
        deletions = []
        for step in targets:
            groups = self._owned_files(step, folders[step])
            if any(groups):
                deletions.append((step, groups))
        kept = tuple(st for st in states if st.status in (DAMAGED, UNREADABLE, FOREIGN))
        return RetentionPlan(tuple(deletions), kept, tuple(self._publisher.leftovers(self.pointer_name)))

    def apply_retention(self, plan: RetentionPlan | None = None) -> list[int]:
        """Delete what retention allows (rank 0 only; see the module docstring): ``plan``, or
        ``plan_retention()`` now; warn naming every step folder kept because it is not provably
        a complete checkpoint of unickpt's (damaged, unreadable, foreign). Returns the steps
        whose files were deleted."""
        plan = plan if plan is not None else self.plan_retention()
        deleted = []
        for step, groups in plan.deletions:
            if self._lock_is_live(step):  # a save started there meanwhile
                continue
            delete_files(self._storage, groups)  # the metadata first
            deleted.append(step)
        self._warn_kept(list(plan.kept))
        if plan.pointer_leftovers:
            self._storage.delete(list(plan.pointer_leftovers))
        return sorted(deleted)

    def _warn_kept(self, kept: list[StepState]) -> None:
        if not kept:
            return
        # every folder by name; the reasons of the first few (each can be a long error message)
        shown = "; ".join(
            f"{_folder(st.step)} ({st.status}: {st.reason})" if i < 3 else f"{_folder(st.step)} ({st.status})"
            for i, st in enumerate(kept)
        )
        warnings.warn(
            f"retention under {self.root} kept {len(kept)} step folder(s) it cannot prove are complete "
            f"checkpoints of its own: {shown}. They are never deleted by unickpt "
            "(`unickpt ls` lists them): load, repair or delete them by hand",
            stacklevel=3,
        )

    def _lock_is_live(self, step: int) -> bool:
        return lock_blocks_deletion(self._storage, self._prefix(step), self._locks)

    def _delete_checkpoint(self, step: int, names: list[str]) -> bool:
        """Delete the files of ``step`` that unickpt provably wrote (``folder.cleanup``), the
        metadata first, unless a save holds its lock. True when something was deleted."""
        return delete_checkpoint(self._storage, self._prefix(step), names, self._locks)

    def _owned_files(self, step: int, names: list[str]) -> tuple[tuple[str, ...], ...]:
        """The files of ``step`` (``names``: its names from ``_scan``) that unickpt provably wrote,
        in the order to delete them (``folder.cleanup.checkpoint_files``; nothing while a save
        holds its lock)."""
        return checkpoint_files(self._storage, self._prefix(step), names, self._locks)
