"""``unickpt merge``, ``convert`` and ``modify``: write what a checkpoint holds somewhere new
(``ops.merge``, ``ops.convert``, ``ops.modify``); the source is never changed."""

from __future__ import annotations

import argparse
import sys

from ..ops.printable import printable
from ._common import EXIT_OK, EXIT_USAGE, positive, regex, rename, role, size

__all__ = ["add_merge", "add_convert", "add_modify"]


def _cmd_merge(args: argparse.Namespace) -> int:
    from ..ops import merge as mg

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
        report=None if terminal else _report_line,
    )
    print(
        f"merged {result.tensors} tensors into {printable(result.out)}: {', '.join(result.files)} "
        f"({result.bytes_written} bytes in {result.seconds:.1f} s)"
    )
    return EXIT_OK


def _report_line(line: str) -> None:
    """A progress line of ``merge`` on stderr, in one write: ``print`` writes the text and its
    newline apart, and a Ctrl-C between the two would start "interrupted" on the progress line."""
    sys.stderr.write(f"unickpt merge: {printable(line)}\n")


def _cmd_convert(args: argparse.Namespace) -> int:
    from ..folder.target import refuse_nested_output
    from ..ops import convert as cv

    if (args.from_format is None) == (args.to_format is None):
        print(
            "unickpt convert: error: give exactly one of --from {hf,dcp,verl-fsdp,torch,lightning} or --to dcp",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.param_names is not None and args.from_format not in ("torch", "lightning"):
        print("unickpt convert: error: --param-names applies to --from torch|lightning", file=sys.stderr)
        return EXIT_USAGE
    if args.layout is not None and args.to_format is None:
        print("unickpt convert: error: --layout applies to --to dcp (imports detect theirs)", file=sys.stderr)
        return EXIT_USAGE
    refuse_nested_output(args.src, args.out, "convert")  # every direction, before anything is read
    if args.to_format == "dcp":
        result = cv.to_dcp(args.src, args.out, layout=args.layout or "state_dict")
    elif args.from_format == "hf":
        result = cv.from_hf(args.src, args.out)
    elif args.from_format == "verl-fsdp":
        result = cv.from_verl_fsdp(args.src, args.out)
    elif args.from_format == "torch":
        result = cv.from_torch(args.src, args.out, param_names=args.param_names)
    elif args.from_format == "lightning":
        result = cv.from_lightning(args.src, args.out, param_names=args.param_names)
    else:
        result = cv.from_dcp(args.src, args.out)
    layout = f" ({result.layout})" if result.layout else ""
    print(f"converted {result.tensors} tensors into {printable(result.out)}{layout}")
    if result.skipped:
        print(f"not converted: {len(result.skipped)} entries (e.g. {printable(list(result.skipped[:5]))})")
    return EXIT_OK


def _names_file(path: str) -> list[str]:
    """The parameter names of ``--param-names FILE`` (one a line; blank lines skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(16 << 20)
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e}") from None
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{path} names no parameter")
    return names


def _cmd_modify(args: argparse.Namespace) -> int:
    from ..ops import modify as md

    r = md.modify(args.src, args.out, renames=args.rename, drops=args.drop, dtype=args.dtype)
    print(f"wrote {printable(r.out)}: {r.kept} tensors ({r.renamed} renamed), {r.dropped} dropped")
    return EXIT_OK


def add_merge(sub: argparse._SubParsersAction) -> None:
    """The ``merge`` subcommand."""
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
    m.add_argument("--max-shard-size", type=size, default="5GB", help="largest safetensors file (5GB; e.g. 500MiB)")
    m.add_argument(
        "--piece-size",
        type=size,
        default="64MiB",
        help="largest piece of a tensor read and held at once (64MiB): memory stays near a few pieces",
    )
    m.add_argument("--hf-config", default=None, help="a Hugging Face config.json to place next to the weights")
    m.add_argument("--role", type=role, default=None, help="merge the sub-checkpoint of this role")
    m.add_argument("--threads", type=positive, default=4, help="reader threads (4)")
    m.set_defaults(func=_cmd_merge)


def add_convert(sub: argparse._SubParsersAction) -> None:
    """The ``convert`` subcommand."""
    cv = sub.add_parser(
        "convert",
        help="import a Hugging Face / PyTorch DCP / ByteCheckpoint / verl FSDP / torch.save / Lightning checkpoint, "
        "or export to DCP",
        description="--from hf|dcp|verl-fsdp|torch|lightning SRC OUT writes a unickpt checkpoint (DCP metadata, "
        "verl's rank files, torch.save files and Lightning .ckpt files are read with allow-list unpicklers: no "
        "code from the source runs); --to dcp SRC OUT writes a unickpt checkpoint's tensors as DCP.",
    )
    cv.add_argument("src", help="source folder (--from torch|lightning: the file)")
    cv.add_argument("out", help="new output folder")
    cv.add_argument(
        "--from", dest="from_format", choices=("hf", "dcp", "verl-fsdp", "torch", "lightning"), default=None
    )
    cv.add_argument(
        "--param-names",
        type=_names_file,
        default=None,
        metavar="FILE",
        help="with --from torch|lightning: a text file naming the parameters the optimizer updates, one a line, "
        "in the optimizer's order (needed when the file numbers them and has several param groups or buffers "
        "that are no BatchNorm's; docs/migrating.md)",
    )
    cv.add_argument("--to", dest="to_format", choices=("dcp",), default=None)
    cv.add_argument(
        "--layout",
        choices=("state_dict", "torchtitan"),
        default=None,
        help="with --to dcp: state_dict (default) writes {model, optimizer} as get_state_dict lays them out and "
        "other state keys (lr_scheduler ...) under their names; torchtitan writes model FQNs at the top level, the "
        "flattened optimizer, lr_scheduler, train_state and dataloader, as torchtitan resumes from",
    )
    cv.set_defaults(func=_cmd_convert)


def add_modify(sub: argparse._SubParsersAction) -> None:
    """The ``modify`` subcommand."""
    mo = sub.add_parser(
        "modify",
        help="write a new checkpoint with keys renamed (regex), dropped, or floating-point tensors cast",
        description="Never edits SRC. --drop and --rename may repeat; drops apply first, renames in order.",
    )
    mo.add_argument("src", help="source checkpoint")
    mo.add_argument("out", help="new (or empty) output folder")
    mo.add_argument(
        "--rename", type=rename, action="append", default=[], metavar="PATTERN=REPL", help="re.sub on every key"
    )
    mo.add_argument(
        "--drop", type=regex, action="append", default=[], metavar="PATTERN", help="drop keys matching (re.search)"
    )
    mo.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None, help="cast floating-point tensors")
    mo.set_defaults(func=_cmd_modify)
