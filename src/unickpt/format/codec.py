"""Metadata codec: ``Metadata`` <-> UTF-8 JSON bytes, dispatching on the format version.

Writers call ``encode_metadata`` once (the coordinator, at commit); readers call
``decode_metadata`` (every rank of a load, tools). Both go through a :class:`MetadataCodec`:
``DEFAULT_CODEC`` (the version tables below and ``format.sections.DEFAULT_SECTIONS``), or one a
test or tool builds with other readers or sections.

Versions (each in its own module, frozen once released):

==========  ==============================================================================
version     module: what it adds
==========  ==============================================================================
1           ``format.v1``: the document (tensors, shard rows / tables, blobs, objects)
2           ``format.v2``: version 1 + ``"sections"`` (``format.sections``)
3           ``format.v3``: checksums of file chunks (not shards) and exact file sizes
==========  ==============================================================================

**Decoding** parses strict JSON (no NaN / Infinity), checks the magic and reads
``format_version``, then hands the document to ``READERS[version]``; a version beyond the newest
one known is an ``UnsupportedFormatVersionError`` with an upgrade hint. The reader parses and
validates (``format.validation``: bounds, byte ranges, tiling, files) and raises one
``CorruptMetadataError`` listing every problem. Only ``CheckpointError`` subclasses leave
``decode`` whatever the input bytes (fuzz-tested in tests/reliability/test_rel_fuzz.py);
decoding is O(n log n) in the number of shards whatever their layout.

**Encoding** writes with the writer of the lowest version that can express the metadata and is
at least ``md.format_version`` (the floor a caller asks for; saves ask for 1): metadata with
per-shard checksums (``RangeChecksums``) is version 1 without sections and version 2 with them;
metadata with chunk checksums (``ChunkChecksums``, what saves write) is version 3.

**Adding version N** (e.g. compact descriptions of regular shardings): a module ``format/vN.py``
with a reader and a writer that reuse the previous versions' pieces (as ``v2`` reuses
``v1.read_body`` / ``v1.write_body``), one entry each in ``READERS`` and ``WRITERS``, and
``records.FORMAT_VERSION = N``; the writer's ``can_write`` says which metadata needs it, so
older-format checkpoints keep being written while they can be. Existing modules stay untouched;
the golden checkpoints (tests/fixtures/golden/) prove it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from ..errors import CheckpointError, UnsupportedFormatVersionError, UnsupportedValueError
from . import v1, v2, v3
from .records import Metadata
from .sections import DEFAULT_SECTIONS, SectionRegistry
from .v1 import MAGIC, TABLE_FROM
from .validation import MAX_BYTES, corrupt

__all__ = [
    "Reader",
    "Writer",
    "READERS",
    "WRITERS",
    "MetadataCodec",
    "DEFAULT_CODEC",
    "encode_metadata",
    "decode_metadata",
    "MAGIC",
    "MAX_BYTES",
    "TABLE_FROM",
]

_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError)


class Reader(Protocol):
    """Reads one format version. ``read`` gets the parsed document (a dict whose magic and
    ``format_version`` the codec checked) and the codec's sections; it returns the validated
    ``Metadata`` (``format_version`` = its version) or raises a ``CheckpointError``."""

    def read(self, doc: dict[str, Any], source: str, sections: SectionRegistry) -> Metadata: ...


class Writer(Protocol):
    """Writes one format version: ``can_write`` says whether this version can express ``md``;
    ``write`` returns the JSON document (a dict, serialised by the codec)."""

    def can_write(self, md: Metadata, sections: SectionRegistry) -> bool: ...

    def write(self, md: Metadata, sections: SectionRegistry) -> dict[str, Any]: ...


READERS: Mapping[int, Reader] = MappingProxyType({v1.VERSION: v1.READER, v2.VERSION: v2.READER, v3.VERSION: v3.READER})
WRITERS: Mapping[int, Writer] = MappingProxyType({v1.VERSION: v1.WRITER, v2.VERSION: v2.WRITER, v3.VERSION: v3.WRITER})


class MetadataCodec:
    """Encodes and decodes metadata with a table of readers and writers by format version and a
    registry of metadata sections. Immutable: ``with_version`` returns a new codec."""

    def __init__(
        self,
        readers: Mapping[int, Reader] = READERS,
        writers: Mapping[int, Writer] = WRITERS,
        sections: SectionRegistry = DEFAULT_SECTIONS,
    ) -> None:
        if not readers or any(type(v) is not int or v < 1 for v in (*readers, *writers)):
            raise ValueError("format versions are ints >= 1 and there is at least one reader")
        self.readers: Mapping[int, Reader] = MappingProxyType(dict(sorted(readers.items())))
        self.writers: Mapping[int, Writer] = MappingProxyType(dict(sorted(writers.items())))
        self.sections = sections

    @property
    def newest(self) -> int:
        """The newest format version this codec reads."""
        return max(self.readers)

    def with_version(self, version: int, reader: Reader, writer: Writer | None = None) -> MetadataCodec:
        """A codec that also reads (and, given a ``writer``, writes) ``version``. Versions already
        in the table cannot be replaced: what a released version means never changes."""
        if version in self.readers or version in self.writers:
            raise ValueError(f"format version {version} is already defined; a new format needs a new version")
        writers = dict(self.writers) if writer is None else {**self.writers, version: writer}
        return MetadataCodec({**self.readers, version: reader}, writers, self.sections)

    def with_sections(self, sections: SectionRegistry) -> MetadataCodec:
        return MetadataCodec(self.readers, self.writers, sections)

    def encode(self, md: Metadata) -> bytes:
        """UTF-8 strict JSON of ``md`` in the lowest version >= ``md.format_version`` whose writer
        can express it."""
        for version, writer in self.writers.items():
            if version >= md.format_version and writer.can_write(md, self.sections):
                doc = writer.write(md, self.sections)
                return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
        if md.format_version > max(self.writers, default=0):
            raise UnsupportedFormatVersionError(
                f"cannot write format version {md.format_version}: this unickpt writes versions {list(self.writers)}"
            )
        raise UnsupportedValueError(
            f"no format version this unickpt writes ({list(self.writers)}) can express this metadata "
            f"(sections {sorted(md.sections)}, checksums {type(md.checksums).__name__})"
        )

    def decode(self, data: bytes, source: str = "<metadata>") -> Metadata:
        """Parse and validate metadata bytes read from ``source`` (a path, for messages)."""
        try:
            doc = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, int too long
            raise corrupt(source, f"not valid JSON ({e.__class__.__name__}: {e})") from None
        if not isinstance(doc, dict) or doc.get("magic") != MAGIC:
            raise corrupt(source, "missing unickpt magic")
        version = doc.get("format_version")
        if type(version) is not int:
            raise corrupt(source, f"format_version must be an integer, got {_short(version)}")
        reader = self.readers.get(version)
        if reader is None:
            raise UnsupportedFormatVersionError(_unknown_version(source, version, self.newest))
        try:
            return reader.read(doc, source, self.sections)
        except _ERRORS as e:
            if isinstance(e, CheckpointError):
                raise
            raise corrupt(source, f"{e.__class__.__name__}: {_clip(str(e))}") from None


def _unknown_version(source: str, version: int, newest: int) -> str:
    if version > newest:
        return (
            f"checkpoint {source} has format version {version}; this unickpt reads versions "
            f"1..{newest}. Upgrade unickpt to load it."
        )
    return f"checkpoint {source} has format version {version}, which does not exist (versions start at 1)"


def _clip(text: str) -> str:
    return text if len(text) <= 200 else text[:197] + "..."


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")  # the encoder writes strict JSON (allow_nan=False)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


DEFAULT_CODEC = (
    MetadataCodec()
)  # records.FORMAT_VERSION == DEFAULT_CODEC.newest (tests/unit/format/test_codec_versions.py)


def encode_metadata(md: Metadata) -> bytes:
    """``DEFAULT_CODEC.encode``: the bytes the coordinator commits."""
    return DEFAULT_CODEC.encode(md)


def decode_metadata(data: bytes, source: str = "<metadata>") -> Metadata:
    """``DEFAULT_CODEC.decode``: parse and validate metadata bytes read from ``source``."""
    return DEFAULT_CODEC.decode(data, source)
