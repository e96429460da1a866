"""``unickpt inspect``, ``verify`` and ``diff``: read checkpoints and report on them (``ops.inspect``,
``ops.verify``, ``ops.diff``); the exit code says whether the check passed."""

from __future__ import annotations

import argparse

from ..ops.printable import printable
from ._common import EXIT_FAILED, EXIT_OK, positive, regex, role

__all__ = ["add_inspect", "add_verify", "add_diff"]


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..ops import inspect as ins

    storage, md, md_bytes = ins.load_metadata(args.path, args.role)
    sizes = ins.file_sizes(storage, md)
    summary = ins.summarize(md, storage.url, sizes, md_bytes)
    wanted = ins.key_filter(args.key)
    summary.tensors = [t for t in summary.tensors if wanted(t.fqn)]
    if args.verify:
        summary.verify = ins.verify(md, storage, sizes=sizes, threads=args.threads, max_failures=args.max_failures)
    if args.json:
        print(ins.to_json(summary))
    else:
        print(ins.format_text(summary, tensors=not args.summary))
        lines = ins.state_lines(md)
        if not args.summary:
            lines += ins.rank_bytes_lines(md)
        for key in args.shards:
            lines += ins.shard_lines(md, key)
        for key in args.values:
            lines += ins.value_lines(md, storage, key)
        if lines:
            print("\n".join(lines))
    if summary.verify is not None:
        return EXIT_OK if summary.verify.ok else EXIT_FAILED
    return EXIT_FAILED if ins.short_files(summary) else EXIT_OK  # missing / truncated data files


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..ops import inspect as ins

    storage, md, _ = ins.load_metadata(args.path, args.role)
    report = ins.verify(md, storage, threads=args.threads, max_failures=args.max_failures)  # stats each file
    if report.ok:
        print(
            f"{printable(storage.url)}: OK: {len(md.tensors)} tensors fully covered, "
            f"{len(md.files)} data files present, "
            f"{report.shards_checked} shards and {report.blobs_checked} blobs checksummed "
            f"({report.bytes_checked} bytes in {report.seconds:.2f} s)"
        )
        for note in report.notes:
            print(f"  note: {printable(note)}")
        return EXIT_OK
    print(f"{printable(storage.url)}: FAILED: {report.failures_total} problem(s)")
    for line in report.failures:
        print(f"  {printable(line)}")
    if report.failures_total > len(report.failures):
        print(f"  ... and {report.failures_total - len(report.failures)} more")
    return EXIT_FAILED


def _cmd_diff(args: argparse.Namespace) -> int:
    from ..ops.diff import diff

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


def add_inspect(sub: argparse._SubParsersAction) -> None:
    """The ``inspect`` subcommand."""
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
    p.add_argument("--role", type=role, default=None, help="inspect the sub-checkpoint of this role")
    p.add_argument("--summary", action="store_true", help="text output without per-tensor/file tables")
    p.add_argument(
        "--key", type=regex, default=None, metavar="PATTERN", help="only tensors whose key matches (regex, re.search)"
    )
    p.add_argument("--shards", action="append", default=[], metavar="KEY", help="the shard layout of KEY")
    p.add_argument("--values", action="append", default=[], metavar="KEY", help="statistics and first elements of KEY")
    p.add_argument("--threads", type=positive, default=4, help="reader threads for --verify (4)")
    p.add_argument(
        "--max-failures",
        type=positive,
        default=10,
        help="how many --verify failures to describe (10; all are counted)",
    )
    p.set_defaults(func=_cmd_inspect)


def add_verify(sub: argparse._SubParsersAction) -> None:
    """The ``verify`` subcommand."""
    v = sub.add_parser(
        "verify",
        help="check a checkpoint: every tensor covered, every file present and complete, every checksum",
        description="Exit 0 when the checkpoint is complete and every shard's and blob's CRC32C matches, "
        "1 (naming each problem) otherwise; 1 with one error line when it is no (complete) checkpoint.",
    )
    v.add_argument("path", help="checkpoint folder or URL (local path, memory://, s3://, ...)")
    v.add_argument("--role", type=role, default=None, help="verify the sub-checkpoint of this role")
    v.add_argument("--threads", type=positive, default=4, help="reader threads (4)")
    v.add_argument("--max-failures", type=positive, default=20, help="problems to describe (20; all are counted)")
    v.set_defaults(func=_cmd_verify)


def add_diff(sub: argparse._SubParsersAction) -> None:
    """The ``diff`` subcommand."""
    df = sub.add_parser(
        "diff",
        help="compare two checkpoints tensor by tensor (exit 0 identical, 1 different)",
        description="Keys only in one, dtype/shape differences, and values compared bit for bit "
        "(with the largest absolute difference of floating-point tensors); any saved parallelism.",
    )
    df.add_argument("a", help="first checkpoint")
    df.add_argument("b", help="second checkpoint")
    df.add_argument(
        "--key", type=regex, default=None, metavar="PATTERN", help="only keys that match (regex, re.search)"
    )
    df.add_argument("--threads", type=positive, default=4, help="reader threads (4)")
    df.set_defaults(func=_cmd_diff)
