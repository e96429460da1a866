"""Format version 2: version 1 plus metadata sections (``format.sections``).

A version-2 document is a version-1 document (``format.v1``, every key and rule unchanged) with
``"format_version": 2`` and one more top-level key, last::

    "sections": {"<name>": {"version": int, "required": bool, "data": JSON}, ...}   (name order)

The codec writes version 2 only for metadata that has sections (or asks for it): an unickpt
that reads only version 1 then refuses the checkpoint with an upgrade hint instead of loading it
without, say, its dataloader state. This module is also the pattern for the next version: reuse
``v1.write_body`` / ``v1.read_body`` (and this module's pieces), add what is new, register the
reader and writer in ``format.codec.READERS`` / ``WRITERS``; older modules stay untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .checksums import RangeChecksums
from .records import Metadata
from .sections import SectionRegistry
from .v1 import read_body, write_body
from .validation import Problems, corrupt

__all__ = ["VERSION", "V2Reader", "V2Writer", "READER", "WRITER"]

VERSION = 2


class V2Writer:
    """Writes metadata whose sections all fit version 2 (and metadata without any, when asked)."""

    def can_write(self, md: Metadata, sections: SectionRegistry) -> bool:
        return sections.min_format_version(md.sections) <= VERSION and isinstance(md.checksums, RangeChecksums)

    def write(self, md: Metadata, sections: SectionRegistry) -> dict[str, Any]:
        doc = write_body(md, VERSION)
        doc["sections"] = sections.encode(md.sections)
        return doc


class V2Reader:
    """Reads a version-2 document: the sections first (a required section this unickpt does not
    know refuses the checkpoint before anything else is judged), then the version-1 body; every
    problem of both is reported in one ``CorruptMetadataError``."""

    def read(self, doc: dict[str, Any], source: str, sections: SectionRegistry) -> Metadata:
        return read_sectioned(doc, source, sections, VERSION, lambda problems: read_body(doc, VERSION, problems))


def read_sectioned(
    doc: dict[str, Any],
    source: str,
    sections: SectionRegistry,
    version: int,
    read: Callable[[Problems], Metadata | None],
) -> Metadata:
    """A document of a version with sections (2 and later): the sections first, then the body
    (``read``, which adds its problems); every problem of both in one ``CorruptMetadataError``."""
    problems = Problems()
    records: dict[str, object] = {}
    if "sections" not in doc:
        problems.add(f"missing field 'sections' (every version-{version} document has one)")
    else:
        records = sections.decode(doc["sections"], version, source, problems)
    md = read(problems)
    problems.raise_if_any(lambda text: corrupt(source, text))
    assert md is not None
    return replace(md, sections=records)


READER = V2Reader()
WRITER = V2Writer()
