"""``unickpt ls``, ``latest`` and ``prune``: the step folders of a ``CheckpointManager`` root."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ._common import EXIT_FAILED, EXIT_OK, positive, role

if TYPE_CHECKING:
    from ..folder.state import FolderState
    from ..manager import StepState

__all__ = ["add_manage"]


def _manager(args: argparse.Namespace, keep_last: int | None = None):  # -> CheckpointManager
    """The manager of ``args.root``; ``NotACheckpointError`` when the root does not exist."""
    from ..errors import NotACheckpointError
    from ..manager import CheckpointManager

    manager = CheckpointManager(args.root, keep_last=keep_last, role=args.role)
    if not manager.root_exists():
        raise NotACheckpointError(f"no checkpoint at {args.root} (it does not exist)")
    return manager


def _cmd_ls(args: argparse.Namespace) -> int:
    manager = _manager(args)
    pointer = manager.read_pointer()
    states = manager.step_states()
    for st in states:
        mark = " <- latest" if pointer is not None and pointer.step == st.step else ""
        print(f"step {st.step:>10}  {_state_line(st, manager.path_for(st.step))}{mark}")
    if states:
        return EXIT_OK
    # not a CheckpointManager root: every checkpoint below (``folder.state.find_checkpoints``)
    from ..folder.state import MAX_DEPTH, find_checkpoints
    from ..storage import open_storage

    root = args.root.rstrip("/") or args.root
    found = find_checkpoints(open_storage(root))
    if args.role is not None:  # the checkpoints of that role: folders named after it
        found = [(rel, st) for rel, st in found if rel.rpartition("/")[2] == args.role]
    for rel, st in found:
        print(_state_line(st, f"{root}/{rel}" if rel else root))
    if not found:
        print(f"no checkpoint under {args.root} (no step folders, none {MAX_DEPTH} levels deep; links not followed)")
    return EXIT_OK


def _state_line(st: FolderState | StepState, path: str) -> str:
    """One line of ``ls``: when, size or state, path, the HF export, why it is not complete."""
    import time

    from ..ops.inspect import human_bytes

    md = st.metadata if st.status == "complete" else None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(md.created_unix)) if md else "-" * 19
    shown = f"{human_bytes(md.total_tensor_bytes):>10}" if md else f"{st.status:>10}"
    why = f"  ({st.reason[:200]})" if st.status != "complete" else ""
    hf = f"  [{st.hf_export}]" if st.hf_export else ""
    return f"{when}  {shown}  {path}{hf}{why}"


def _cmd_latest(args: argparse.Namespace) -> int:
    manager = _manager(args)
    step = manager.latest_step()
    if step is None:
        print(f"unickpt latest: no complete checkpoint under {args.root}", file=sys.stderr)
        return EXIT_FAILED
    print(manager.path_for(step))
    return EXIT_OK


def _cmd_prune(args: argparse.Namespace) -> int:
    import warnings

    manager = _manager(args, keep_last=args.keep_last)
    if args.dry_run:
        plan = manager.plan_retention()
        for step, groups in plan.deletions:
            print(f"would delete step {step}: {sum(len(g) for g in groups)} file(s) unickpt wrote")
            for group in groups:
                for name in group:
                    print(f"  {manager.root}/{name}")
        for st in plan.kept:
            print(f"would keep step {st.step} ({st.status}: {st.reason[:200]})")
        print(
            f"would delete {len(plan.steps)} checkpoint(s): steps {plan.steps}" if plan.steps else "nothing to delete"
        )
        return EXIT_OK
    plan = manager.plan_retention()
    with warnings.catch_warnings():  # its warning names the kept folders: one line each below
        warnings.filterwarnings("ignore", message="retention under")
        deleted = manager.apply_retention(plan)
    for st in plan.kept:
        print(f"kept step {st.step} ({st.status}: {st.reason[:200]})")
    print(f"deleted {len(deleted)} checkpoint(s): steps {deleted}" if deleted else "nothing to delete")
    return EXIT_OK


def add_manage(sub: argparse._SubParsersAction) -> None:
    """The ``ls``, ``latest`` and ``prune`` subcommands."""
    for name, func, text, more in (
        ("ls", _cmd_ls, "list the step folders of a CheckpointManager root (elsewhere: every checkpoint below "
         "the folder, a few levels deep)", "; a folder that is not a complete "
         "checkpoint is shown as incomplete (a save in progress or interrupted), damaged (data missing), "
         "unreadable (metadata this version cannot decode) or foreign (not unickpt's)"),
        ("latest", _cmd_latest, "print the path of the latest complete checkpoint of a root", " (the one the "
         "latest pointer names, else the newest complete one)"),
        ("prune", _cmd_prune, "apply retention to a root: keep the newest --keep-last and the latest", "; only "
         "complete checkpoints and the files unickpt wrote are deleted, folders it cannot prove are its own stay"),
    ):  # fmt: skip
        sp = sub.add_parser(name, help=text, description=text + more + ".")
        sp.add_argument("root", help="the CheckpointManager root (local path or URL)")
        sp.add_argument("--role", type=role, default=None, help="the manager's role")
        if name == "prune":
            sp.add_argument("--keep-last", type=positive, required=True, help="complete checkpoints to keep")
            sp.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
        sp.set_defaults(func=func)
