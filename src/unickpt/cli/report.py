"""``unickpt report``: the per-rank, per-phase view of a save (``monitoring.report``, with the
records read by ``ops.report``)."""

from __future__ import annotations

import argparse

from ._common import EXIT_FAILED, EXIT_OK

__all__ = ["add_report"]


def _cmd_report(args: argparse.Namespace) -> int:
    import json

    from ..monitoring import report as rp
    from ..ops.report import source_records

    try:
        title, records = source_records(args.folder, args.role)
    except rp.NoPhaseRecords as e:
        print(str(e))
        return EXIT_FAILED
    rep = rp.Report.build(records, k=args.k)
    print(title)
    print(rp.format_text(rep, k=args.k))
    print("\n".join(rp.storage_lines(records)))
    if args.png:
        rp.heatmap_png(rep, args.png, rp.heatmap_title(rep, records, title))
        print(f"heat map: {args.png}")
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(rp.chrome_trace(records), f)
        print(f"trace (open in https://ui.perfetto.dev): {args.trace}")
    if args.sqlite:
        print(f"{rp.to_sqlite(records, args.sqlite)} records in {args.sqlite}")
    return EXIT_OK


def add_report(sub: argparse._SubParsersAction) -> None:
    """The ``report`` subcommand."""
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
    rp.add_argument(
        "--k",
        type=float,
        default=1.5,
        help="straggler: slower than k x the median of a phase (1.5) and by more than 0.1 s",
    )
    rp.set_defaults(func=_cmd_report)
