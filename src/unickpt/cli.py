"""The ``unickpt`` command line (console script ``unickpt = unickpt.cli:main``; ``python -m unickpt``).

Who calls what: ``main(argv)`` parses the arguments (argparse, one subcommand each) and dispatches
to the subcommand's ``_cmd_*`` function, which calls the logic in ``unickpt.tools`` (``inspect``,
``verify`` via inspect, ``merge``, ``demo``) and renders the result; every name read from a
checkpoint is printed through ``tools.printable.printable`` (control characters and bidi marks
escaped).

Errors: ``main`` is the one place that turns a failure into a message. Any exception a command
raises is printed as ONE line on stderr, ``unickpt <command>: error: [<path>: ]<ErrorType>:
<message>`` (the path the command was given is put first when the message does not name the file
itself; the message's own line breaks are joined), never a traceback. A unickpt
``CheckpointError`` or an ``OSError`` naming its file is an expected failure; anything else
(a library's error on a file it could not parse) is printed the same way with a hint to rerun with
``--debug`` (or ``UNICKPT_DEBUG=1``), which re-raises it with its traceback.

Exit codes: 0 success; 1 failure: the check the command ran failed (``inspect`` found data files
missing or shorter than the metadata says, ``inspect --verify`` / ``verify`` found corrupt or missing
data, ``diff`` found differences, ``demo`` found a mismatch; the report is printed either way), or
the input is bad (not a checkpoint, incomplete or corrupt checkpoint, unsupported format version,
unreadable file); 2 usage errors (argparse's, a bad regular expression or size); 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence

from .errors import CheckpointError
from .tools.printable import printable

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAILED", "EXIT_ERROR", "EXIT_USAGE"]

EXIT_OK = 0
EXIT_FAILED = 1  # the check failed
EXIT_ERROR = 1  # bad input: no (complete, readable) checkpoint, a file that cannot be read
EXIT_USAGE = 2  # bad arguments
DEBUG_ENV = "UNICKPT_DEBUG"


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .tools import inspect as ins
    from .tools import inspect_more as more

    storage, md, md_bytes = ins.load_metadata(args.path, args.role)
    sizes = ins.file_sizes(storage, md)
    summary = ins.summarize(md, storage.url, sizes, md_bytes)
    wanted = more.key_filter(args.key)
    summary.tensors = [t for t in summary.tensors if wanted(t.fqn)]
    if args.verify:
        summary.verify = ins.verify(md, storage, sizes=sizes, threads=args.threads, max_failures=args.max_failures)
    if args.json:
        print(ins.to_json(summary))
    else:
        print(ins.format_text(summary, tensors=not args.summary))
        lines = more.state_lines(md)
        if not args.summary:
            lines += more.rank_bytes_lines(md)
        for key in args.shards:
            lines += more.shard_lines(md, key)
        for key in args.values:
            lines += more.value_lines(md, storage, key)
        if lines:
            print("\n".join(lines))
    if summary.verify is not None:
        return EXIT_OK if summary.verify.ok else EXIT_FAILED
    return EXIT_FAILED if ins.short_files(summary) else EXIT_OK  # missing / truncated data files


def _cmd_verify(args: argparse.Namespace) -> int:
    from .tools import inspect as ins

    storage, md, _ = ins.load_metadata(args.path, args.role)
    sizes = ins.file_sizes(storage, md)
    report = ins.verify(md, storage, sizes=sizes, threads=args.threads, max_failures=args.max_failures)
    if report.ok:
        print(
            f"{printable(storage.url)}: OK: {len(md.tensors)} tensors fully covered, "
            f"{len(md.files)} data files present, "
            f"{report.shards_checked} shards and {report.blobs_checked} blobs checksummed "
            f"({report.bytes_checked} bytes in {report.seconds:.2f} s)"
        )
        return EXIT_OK
    print(f"{printable(storage.url)}: FAILED: {report.failures_total} problem(s)")
    for line in report.failures:
        print(f"  {printable(line)}")
    if report.failures_total > len(report.failures):
        print(f"  ... and {report.failures_total - len(report.failures)} more")
    return EXIT_FAILED


def _cmd_merge(args: argparse.Namespace) -> int:
    from .tools import merge as mg

    terminal = sys.stderr.isatty()
    result = mg.merge(
        args.path,
        args.out,
        fmt=args.format,
        model_only=args.model_only,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        hf_config=args.hf_config,
        role=args.role,
        threads=args.threads,
        piece_bytes=args.piece_size,
        progress=terminal,  # a tqdm bar on a terminal, a line per output file otherwise
        report=None if terminal else (lambda line: print(f"unickpt merge: {printable(line)}", file=sys.stderr)),
    )
    print(
        f"merged {result.tensors} tensors into {printable(result.out)}: {', '.join(result.files)} "
        f"({result.bytes_written} bytes in {result.seconds:.1f} s)"
    )
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from .tools import convert as cv

    if (args.from_format is None) == (args.to_format is None):
        print("unickpt convert: error: give exactly one of --from {hf,dcp,verl-fsdp} or --to dcp", file=sys.stderr)
        return EXIT_USAGE
    if args.layout is not None and args.to_format is None:
        print("unickpt convert: error: --layout applies to --to dcp (imports detect theirs)", file=sys.stderr)
        return EXIT_USAGE
    if args.to_format == "dcp":
        result = cv.to_dcp(args.src, args.out, layout=args.layout or "state_dict")
    elif args.from_format == "hf":
        result = cv.from_hf(args.src, args.out)
    elif args.from_format == "verl-fsdp":
        result = cv.from_verl_fsdp(args.src, args.out)
    else:
        result = cv.from_dcp(args.src, args.out)
    layout = f" ({result.layout})" if result.layout else ""
    print(f"converted {result.tensors} tensors into {printable(result.out)}{layout}")
    if result.skipped:
        print(f"not converted: {len(result.skipped)} entries (e.g. {printable(list(result.skipped[:5]))})")
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    import json

    from .monitoring import report as rp

    try:
        title, records = rp.source_records(args.folder, args.role)
    except rp.NoPhaseRecords as e:
        print(str(e))
        return EXIT_FAILED
    rep = rp.Report.build(records, k=args.k)
    print(title)
    print(rp.format_text(rep, k=args.k))
    print("\n".join(rp.storage_lines(records)))
    if args.png:
        rp.heatmap_png(rep, args.png)
        print(f"heat map: {args.png}")
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(rp.chrome_trace(records), f)
        print(f"trace (open in https://ui.perfetto.dev): {args.trace}")
    if args.sqlite:
        print(f"{rp.to_sqlite(records, args.sqlite)} records in {args.sqlite}")
    return EXIT_OK


def _cmd_modify(args: argparse.Namespace) -> int:
    from .tools import modify as md

    r = md.modify(args.src, args.out, renames=args.rename, drops=args.drop, dtype=args.dtype)
    print(f"wrote {printable(r.out)}: {r.kept} tensors ({r.renamed} renamed), {r.dropped} dropped")
    return EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    from .tools.diff import diff

    report = diff(args.a, args.b, keys=args.key, threads=args.threads)
    for k in report.only_a:
        print(f"only in A: {printable(k)}")
    for k in report.only_b:
        print(f"only in B: {printable(k)}")
    for d in report.differ:
        print(f"differs ({d.what}): {printable(d.key)}: {d.detail}")
    for name in report.objects_differ:
        print(f"differs (object): {printable(name)}")
    verdict = "identical" if report.identical else "different"
    print(
        f"{verdict}: {report.same} tensors equal bit for bit, {len(report.differ)} differ, "
        f"{len(report.only_a)} only in A, {len(report.only_b)} only in B"
    )
    return EXIT_OK if report.identical else EXIT_FAILED


def _manager(args: argparse.Namespace, keep_last: int | None = None):  # -> CheckpointManager
    """The manager of ``args.root``; ``NotACheckpointError`` when the root does not exist."""
    from .errors import NotACheckpointError
    from .manager import CheckpointManager

    manager = CheckpointManager(args.root, keep_last=keep_last, role=args.role)
    if not manager.root_exists():
        raise NotACheckpointError(f"no checkpoint at {args.root} (it does not exist)")
    return manager


def _cmd_ls(args: argparse.Namespace) -> int:
    import time

    from .tools.inspect import human_bytes

    manager = _manager(args)
    pointer = manager.read_pointer()
    states = manager.step_states()
    for st in states:
        mark = " <- latest" if pointer is not None and pointer.step == st.step else ""
        md = st.metadata if st.status == "complete" else None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(md.created_unix)) if md else "-" * 19
        shown = f"{human_bytes(md.total_tensor_bytes):>10}" if md else f"{st.status:>10}"
        why = f"  ({st.reason[:200]})" if st.status not in ("complete", "incomplete") else ""
        print(f"step {st.step:>10}  {when}  {shown}  {manager.path_for(st.step)}{mark}{why}")
    if not states:
        print(f"no checkpoint under {args.root}")
    return EXIT_OK


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


def _cmd_demo(args: argparse.Namespace) -> int:
    from .tools import demo

    cfg = demo.DemoConfig(
        out=args.out,
        steps=args.steps,
        save_every=args.save_every,
        extra_steps=args.extra_steps,
        world_size=args.world_size,
        resume_world_size=args.resume_world_size,
        dim=args.dim,
        layers=args.layers,
        timeout_s=args.timeout,
    )
    return EXIT_OK if demo.run_demo(cfg) else EXIT_FAILED


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"bad regular expression {text!r}: {e}") from None


def _rename(text: str) -> tuple[re.Pattern[str], str]:
    from .tools.modify import parse_rename

    try:
        return parse_rename(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> int:
    from .tools.merge import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _role(text: str) -> str:
    if not text or "/" in text or text.startswith("."):
        raise argparse.ArgumentTypeError(f"invalid role {text!r} (a plain folder name)")
    return text


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="unickpt", description="Unified checkpointing for PyTorch training: tools.")
    parser.add_argument("--version", action="version", version=f"unickpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "inspect",
        help="describe a checkpoint (tensors, topology, files, totals)",
        description="Describe a checkpoint from its metadata (no data reads unless --verify).",
    )
    p.add_argument("path", help="checkpoint folder or URL (local path, memory://, s3://, ...)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument(
        "--verify", action="store_true", help="read every shard and blob and check its CRC32C (exit 1 on any failure)"
    )
    p.add_argument("--role", type=_role, default=None, help="inspect the sub-checkpoint of this role")
    p.add_argument("--summary", action="store_true", help="text output without per-tensor/file tables")
    p.add_argument(
        "--key", type=_regex, default=None, metavar="PATTERN", help="only tensors whose key matches (regex, re.search)"
    )
    p.add_argument("--shards", action="append", default=[], metavar="KEY", help="the shard layout of KEY")
    p.add_argument("--values", action="append", default=[], metavar="KEY", help="statistics and first elements of KEY")
    p.add_argument("--threads", type=_positive, default=4, help="reader threads for --verify (4)")
    p.add_argument(
        "--max-failures",
        type=_positive,
        default=10,
        help="how many --verify failures to describe (10; all are counted)",
    )
    p.set_defaults(func=_cmd_inspect)

    v = sub.add_parser(
        "verify",
        help="check a checkpoint: every tensor covered, every file present and complete, every checksum",
        description="Exit 0 when the checkpoint is complete and every shard's and blob's CRC32C matches, "
        "1 (naming each problem) otherwise; 1 with one error line when it is no (complete) checkpoint.",
    )
    v.add_argument("path", help="checkpoint folder or URL (local path, memory://, s3://, ...)")
    v.add_argument("--role", type=_role, default=None, help="verify the sub-checkpoint of this role")
    v.add_argument("--threads", type=_positive, default=4, help="reader threads (4)")
    v.add_argument("--max-failures", type=_positive, default=20, help="problems to describe (20; all are counted)")
    v.set_defaults(func=_cmd_verify)

    m = sub.add_parser(
        "merge",
        help="consolidate into one full state dict (safetensors / Hugging Face folder, or torch)",
        description="Read every tensor (any saved parallelism) and write it to a new folder: sharded "
        "safetensors with model.safetensors.index.json, streamed in pieces of at most --piece-size, or one "
        "torch.save file (held in memory). Progress: a bar on a terminal, a line per output file otherwise.",
    )
    m.add_argument("path", help="checkpoint folder or URL")
    m.add_argument("out", help="new (or empty) output folder")
    m.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    m.add_argument("--model-only", action="store_true", help="only model tensors, named as state_dict() names them")
    m.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None, help="cast floating-point tensors")
    m.add_argument("--max-shard-size", type=_size, default="5GB", help="largest safetensors file (5GB; e.g. 500MiB)")
    m.add_argument(
        "--piece-size",
        type=_size,
        default="64MiB",
        help="largest piece of a tensor read and held at once (64MiB): memory stays near a few pieces",
    )
    m.add_argument("--hf-config", default=None, help="a Hugging Face config.json to place next to the weights")
    m.add_argument("--role", type=_role, default=None, help="merge the sub-checkpoint of this role")
    m.add_argument("--threads", type=_positive, default=4, help="reader threads (4)")
    m.set_defaults(func=_cmd_merge)

    cv = sub.add_parser(
        "convert",
        help="import a Hugging Face / PyTorch DCP / ByteCheckpoint / verl FSDP checkpoint, or export to DCP",
        description="--from hf|dcp|verl-fsdp SRC OUT writes a unickpt checkpoint (DCP metadata and verl's "
        "torch.save files are read with allow-list unpicklers); --to dcp SRC OUT writes a unickpt checkpoint's "
        "tensors as DCP.",
    )
    cv.add_argument("src", help="source folder")
    cv.add_argument("out", help="new output folder")
    cv.add_argument("--from", dest="from_format", choices=("hf", "dcp", "verl-fsdp"), default=None)
    cv.add_argument("--to", dest="to_format", choices=("dcp",), default=None)
    cv.add_argument(
        "--layout",
        choices=("state_dict", "torchtitan"),
        default=None,
        help="with --to dcp: state_dict (default) writes {model, optimizer} as get_state_dict lays them out; "
        "torchtitan writes model FQNs at the top level and the flattened optimizer, as torchtitan resumes from",
    )
    cv.set_defaults(func=_cmd_convert)

    rp = sub.add_parser(
        "report",
        help="per-rank, per-phase view of a checkpoint's save, or of recorded metrics (heat map, trace, stragglers)",
        description="Read the phase records a checkpoint keeps of its save (every save keeps them unless "
        "SaveOptions(record_phases=False)), or the rank<r>.jsonl files a unickpt.monitoring.JsonlSink wrote "
        "into a folder. Exit 1 when the checkpoint keeps none.",
    )
    rp.add_argument("folder", metavar="PATH", help="a checkpoint, or a folder of rank<r>.jsonl metric files")
    rp.add_argument("--role", default=None, help="the checkpoint's role sub-checkpoint")
    rp.add_argument("--png", default=None, help="write a rank x phase heat map PNG here")
    rp.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    rp.add_argument("--sqlite", default=None, help="also write every record into this SQLite file")
    rp.add_argument("--k", type=float, default=1.5, help="straggler: slower than k x the median of a phase (1.5)")
    rp.set_defaults(func=_cmd_report)

    mo = sub.add_parser(
        "modify",
        help="write a new checkpoint with keys renamed (regex), dropped, or floating-point tensors cast",
        description="Never edits SRC. --drop and --rename may repeat; drops apply first, renames in order.",
    )
    mo.add_argument("src", help="source checkpoint")
    mo.add_argument("out", help="new (or empty) output folder")
    mo.add_argument(
        "--rename", type=_rename, action="append", default=[], metavar="PATTERN=REPL", help="re.sub on every key"
    )
    mo.add_argument(
        "--drop", type=_regex, action="append", default=[], metavar="PATTERN", help="drop keys matching (re.search)"
    )
    mo.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None, help="cast floating-point tensors")
    mo.set_defaults(func=_cmd_modify)

    df = sub.add_parser(
        "diff",
        help="compare two checkpoints tensor by tensor (exit 0 identical, 1 different)",
        description="Keys only in one, dtype/shape differences, and values compared bit for bit "
        "(with the largest absolute difference of floating-point tensors); any saved parallelism.",
    )
    df.add_argument("a", help="first checkpoint")
    df.add_argument("b", help="second checkpoint")
    df.add_argument(
        "--key", type=_regex, default=None, metavar="PATTERN", help="only keys that match (regex, re.search)"
    )
    df.add_argument("--threads", type=_positive, default=4, help="reader threads (4)")
    df.set_defaults(func=_cmd_diff)

    for name, func, text, more in (
        ("ls", _cmd_ls, "list the step folders of a CheckpointManager root", "; a folder that is not a complete "
         "checkpoint is shown as incomplete (a save in progress or interrupted), damaged (data missing), "
         "unreadable (metadata this version cannot decode) or foreign (not unickpt's)"),
        ("latest", _cmd_latest, "print the path of the latest complete checkpoint of a root", " (the one the "
         "latest pointer names, else the newest complete one)"),
        ("prune", _cmd_prune, "apply retention to a root: keep the newest --keep-last and the latest", "; only "
         "complete checkpoints and the files unickpt wrote are deleted, folders it cannot prove are its own stay"),
    ):  # fmt: skip
        sp = sub.add_parser(name, help=text, description=text + more + ".")
        sp.add_argument("root", help="the CheckpointManager root (local path or URL)")
        sp.add_argument("--role", type=_role, default=None, help="the manager's role")
        if name == "prune":
            sp.add_argument("--keep-last", type=_positive, required=True, help="complete checkpoints to keep")
            sp.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
        sp.set_defaults(func=func)

    d = sub.add_parser(
        "demo",
        help="train with FSDP2, save, resume with resharding, prove bit-exactness",
        description="Train the toy transformer with FSDP2 on CPU/gloo, checkpoint it, "
        "resume on a different world size and prove the resumed run is "
        "bit-identical to the uninterrupted one.",
    )
    d.add_argument("--out", default="./demo_out", help="folder for the checkpoints (./demo_out)")
    d.add_argument("--steps", type=_positive, default=6, help="steps before the last checkpoint (6)")
    d.add_argument("--save-every", type=_positive, default=2, help="save every N steps (2)")
    d.add_argument(
        "--extra-steps",
        type=_positive,
        default=4,
        help="steps trained after the last checkpoint, and after resuming (4)",
    )
    d.add_argument("--world-size", type=_positive, default=4, help="processes of the first run (4)")
    d.add_argument("--resume-world-size", type=_positive, default=2, help="processes after resuming (2)")
    d.add_argument("--dim", type=_positive, default=130, help="model width (130)")
    d.add_argument("--layers", type=_positive, default=4, help="transformer blocks (4)")
    d.add_argument("--timeout", type=float, default=300.0, help="seconds each phase may take (300)")
    d.set_defaults(func=_cmd_demo)
    debug_help = f"on an unexpected error, show the Python traceback (also: {DEBUG_ENV}=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    for command in sub.choices.values():  # `unickpt inspect X --debug` works as well as `unickpt --debug inspect X`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    return parser


_INPUTS = ("path", "src", "a", "b", "root", "folder")  # the arguments naming what a command reads
_OUTPUTS = ("out", "png", "trace", "sqlite", "hf_config")


_MAX_LINE = 2000  # characters of one error line (a library's message may hold a whole report)


def _unwrap(e: BaseException) -> BaseException:
    """The error a library's wrapper stands for: DCP's ``CheckpointException`` (a BaseException
    whose text embeds each rank's traceback) -> the first rank's own exception."""
    failures = getattr(e, "failures", None)
    if type(e).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]
    return e


def _error_line(command: str, args: argparse.Namespace, e: BaseException, expected: bool) -> str:
    """The one stderr line for ``e`` (module docstring): the file it is about first unless the
    message names it, the message's lines joined, every character printable."""
    e = _unwrap(e)
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip()) or repr(e)
    if len(text) > _MAX_LINE:
        text = text[:_MAX_LINE] + " ..."
    named = [getattr(args, a) for a in _INPUTS + _OUTPUTS if isinstance(getattr(args, a, None), str)]
    if isinstance(e, OSError) and e.filename is not None:
        subject: str | None = os.fsdecode(e.filename)
        if e.strerror:  # "[Errno 2] No such file or directory: 'x'" -> "No such file or directory"
            text = e.strerror + (f" (and {os.fsdecode(e.filename2)})" if e.filename2 is not None else "")
    else:
        inputs = [getattr(args, a) for a in _INPUTS if isinstance(getattr(args, a, None), str)]
        subject = inputs[0] if inputs else None
        forms = {f for p in named for f in (p, os.path.abspath(p), p.rstrip("/"))}
        if any(f and f in text for f in forms):
            subject = None  # the message names the file itself
    where = f"{subject}: " if subject is not None else ""
    hint = "" if expected else f" (unexpected: rerun with --debug or {DEBUG_ENV}=1 for the traceback)"
    return printable(f"unickpt {command}: error: {where}{type(e).__name__}: {text}{hint}")


def _expected(e: BaseException) -> bool:
    """A failure the message alone explains: unickpt's own errors, and a file the system refused."""
    return isinstance(e, CheckpointError) or (isinstance(e, OSError) and e.filename is not None)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo" and args.save_every > args.steps:
        parser.error(f"--save-every {args.save_every} is larger than --steps {args.steps}: nothing to resume")
    debug = bool(args.debug) or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        with warnings.catch_warnings():  # restores the process's warning settings afterwards
            warnings.showwarning = _warning_printer(args.command)
            # DCP's note that it runs without a process group: convert runs it in one process on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return func(args)
    except KeyboardInterrupt:
        print(f"unickpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `unickpt inspect ... | head`: stop quietly, as other CLI tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit flush
        return EXIT_OK
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # also libraries' BaseException subclasses (DCP's CheckpointException)
        if debug:
            raise
        print(_error_line(args.command, args, e, _expected(e)), file=sys.stderr)
        return EXIT_ERROR


def _warning_printer(command: str) -> Callable[..., None]:
    """``warnings.showwarning`` for the CLI: one line per warning, ``unickpt <command>: warning:
    <Category>: <message>`` (printable), instead of the message and its source line."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, *rest: object) -> None:
        text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
        print(printable(f"unickpt {command}: warning: {category.__name__}: {text}"), file=sys.stderr)

    return show


if __name__ == "__main__":
    sys.exit(main())
