"""Metadata sections: the one place a feature adds its own part of the metadata (format version 2).

A section is a frozen record type (the feature's index, e.g. the dataloader's
LoaderShardToByteMap) plus a :class:`SectionCodec` that turns it into JSON and back. Features
register the codec once in a :class:`SectionRegistry` (``DEFAULT_SECTIONS`` for unickpt's own, from a
module that ``unickpt/__init__`` imports, so every decode knows them), put their record into
``Metadata.sections[name]`` on save, and read it from there on load. Nothing else changes: the
codec writes any metadata that has a section as format version 2 (an unickpt that reads only
version 1 refuses such a checkpoint with an upgrade hint rather than silently dropping it);
metadata without sections stays version 1, byte for byte.

In a version-2 document, sections sit under one top-level key, in name order::

    "sections": {"<name>": {"version": <the section's schema version, int >= 1>,
                            "required": <bool>,
                            "data": <the codec's JSON>}}

Reading (``decode``, called by ``format.v2``): a section whose name or schema version this
unickpt does not know is refused (``UnsupportedFormatVersionError``, with an upgrade hint) when
its writer marked it ``required``, else skipped with one :class:`SectionWarning` per decode.
Known sections are size-checked against ``max_bytes`` and decoded by their codec; anything the
codec raises becomes a ``CorruptMetadataError`` naming the section. Writing (``encode``): every
section must be registered, hold its codec's record type, encode to strict JSON within
``max_bytes`` and decode back to an equal record (a codec that loses data fails the save, not
the resume).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..errors import CorruptMetadataError, SizeLimitError, UnsupportedFormatVersionError, UnsupportedValueError
from .records import JSONValue
from .validation import Problems

__all__ = [
    "SECTIONS_FROM_VERSION",
    "MAX_SECTIONS",
    "SectionCodec",
    "SectionRegistry",
    "SectionWarning",
    "DEFAULT_SECTIONS",
]

R = TypeVar("R")

SECTIONS_FROM_VERSION = 2  # the first format version whose documents carry sections
MAX_SECTIONS = 256
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}(\.[a-z][a-z0-9_]{0,31}){0,3}")
_ENVELOPE = {"version", "required", "data"}


class SectionWarning(UserWarning):
    """A checkpoint carries optional metadata sections this unickpt does not know; they were skipped."""


@dataclass(frozen=True, slots=True)
class SectionCodec(Generic[R]):
    """How one metadata section is written and read.

    ``name``: the stable key in the document (lower case, dots for a plugin's namespace:
    ``"dataloader"``, ``"myorg.sampler"``). ``record_type``: the frozen record that
    ``Metadata.sections[name]`` holds. ``encode(record)`` returns plain JSON (dicts with str keys,
    lists, str, int, finite float, bool, None). ``decode(data, version)`` rebuilds the record from
    the JSON of schema ``version`` (1..``version`` of this codec), validating it: raise
    ``CorruptMetadataError`` (or ValueError / TypeError / KeyError) on anything ``encode`` would
    not write, and bound every allocation the data controls. ``version``: the schema version it
    writes; raise it when the JSON changes, keep decoding the older ones. ``required``: whether an
    unickpt that does not know this section (or this schema version) must refuse the checkpoint
    (True: loading without it would silently lose state) or may skip it. ``min_format_version``:
    the first format version able to carry it (2). ``max_bytes``: the most JSON bytes it writes
    or accepts."""

    name: str
    record_type: type[R]
    encode: Callable[[R], JSONValue]
    decode: Callable[[JSONValue, int], R]
    version: int = 1
    required: bool = True
    min_format_version: int = SECTIONS_FROM_VERSION
    max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"section name {self.name!r} must match {_NAME.pattern}")
        if type(self.version) is not int or self.version < 1:
            raise ValueError(f"section {self.name!r}: version must be an int >= 1")
        if type(self.min_format_version) is not int or self.min_format_version < SECTIONS_FROM_VERSION:
            raise ValueError(f"section {self.name!r}: min_format_version must be >= {SECTIONS_FROM_VERSION}")
        if type(self.max_bytes) is not int or self.max_bytes < 1:
            raise ValueError(f"section {self.name!r}: max_bytes must be a positive int")


class SectionRegistry:
    """Section codecs by name. ``DEFAULT_SECTIONS`` serves ``unickpt.format.encode_metadata`` /
    ``decode_metadata``; tests and tools build their own (``copy()``, or a fresh one) and give it
    to a ``format.codec.MetadataCodec``. Registering a name twice is an error."""

    def __init__(self, codecs: Iterable[SectionCodec[Any]] = ()) -> None:
        self._codecs: dict[str, SectionCodec[Any]] = {}
        for c in codecs:
            self.register(c)

    def register(self, codec: SectionCodec[Any]) -> None:
        if not isinstance(codec, SectionCodec):
            raise TypeError(f"expected a SectionCodec, got {type(codec).__name__}")
        if codec.name in self._codecs:
            raise ValueError(f"metadata section {codec.name!r} is already registered")
        self._codecs[codec.name] = codec

    def get(self, name: str) -> SectionCodec[Any] | None:
        return self._codecs.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._codecs

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._codecs))

    def copy(self) -> SectionRegistry:
        return SectionRegistry(self._codecs.values())

    # ----------------------------------------------------------------------- writing

    def min_format_version(self, sections: Mapping[str, object]) -> int:
        """The lowest format version able to carry ``sections`` (1 when there are none)."""
        return max((self._codec_for(name).min_format_version for name in sections), default=1)

    def encode(self, sections: Mapping[str, object]) -> dict[str, JSONValue]:
        """The ``"sections"`` object of a version-2 document (see the module docstring)."""
        if len(sections) > MAX_SECTIONS:
            raise UnsupportedValueError(f"{len(sections)} metadata sections are more than the {MAX_SECTIONS} allowed")
        out: dict[str, JSONValue] = {}
        for name in sorted(sections):
            codec = self._codec_for(name)
            record = sections[name]
            if not isinstance(record, codec.record_type):
                raise UnsupportedValueError(
                    f"metadata section {name!r} holds a {type(record).__name__}, expected {codec.record_type.__name__}"
                )
            out[name] = {"version": codec.version, "required": codec.required, "data": _encoded(codec, record)}
        return out

    def _codec_for(self, name: str) -> SectionCodec[Any]:
        codec = self._codecs.get(name)
        if codec is None:
            raise UnsupportedValueError(
                f"metadata section {name!r} is not registered; register its SectionCodec before saving"
            )
        return codec

    # ----------------------------------------------------------------------- reading

    def decode(self, raw: Any, format_version: int, source: str, problems: Problems) -> dict[str, object]:
        """The records of a document's ``"sections"`` object; structural problems go to
        ``problems``. Raises ``UnsupportedFormatVersionError`` first if a required section is
        unknown here; warns once (``SectionWarning``) about the optional ones it skips."""
        if not isinstance(raw, dict):
            problems.add(f"sections must be an object, got {_short(raw)}")
            return {}
        if len(raw) > MAX_SECTIONS:
            problems.add(f"{len(raw)} sections are more than the {MAX_SECTIONS} allowed")
            return {}
        envelopes: dict[str, tuple[int, bool, Any]] = {}
        for name in sorted(raw):
            env = _envelope(name, raw[name], problems)
            if env is not None:
                envelopes[name] = env
        self._refuse_unknown_required(envelopes, source)
        out: dict[str, object] = {}
        skipped = []
        for name, (version, _required, data) in envelopes.items():
            codec = self._codecs.get(name)
            if codec is None or version > codec.version:
                skipped.append(name if codec is None else f"{name} (schema version {version})")
                continue
            record = _decoded(codec, data, version, format_version, problems)
            if record is not None:
                out[name] = record
        if skipped:
            warnings.warn(
                SectionWarning(
                    f"checkpoint {source} has optional metadata section(s) {', '.join(skipped)} that this unickpt "
                    "does not know (written by a newer unickpt or a plugin not registered here); skipped"
                ),
                stacklevel=2,
            )
        return out

    def _refuse_unknown_required(self, envelopes: Mapping[str, tuple[int, bool, Any]], source: str) -> None:
        unknown = []
        for name, (version, required, _data) in envelopes.items():
            codec = self._codecs.get(name)
            if required and codec is None:
                unknown.append(f"{name!r}")
            elif required and codec is not None and version > codec.version:
                unknown.append(f"{name!r} schema version {version} (this unickpt reads 1..{codec.version})")
        if unknown:
            raise UnsupportedFormatVersionError(
                f"checkpoint {source} has required metadata section(s) {', '.join(unknown)} that this unickpt "
                "cannot read: it was written by a newer unickpt (or with a plugin that registers the section). "
                "Upgrade unickpt (or import the plugin) to load it."
            )


def _envelope(name: Any, entry: Any, problems: Problems) -> tuple[int, bool, Any] | None:
    head = f"section {_short(name)}"
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        problems.add(f"{head}: not a valid section name")
        return None
    if not isinstance(entry, dict) or set(entry) != _ENVELOPE:
        problems.add(f"{head}: must be an object with exactly the keys {sorted(_ENVELOPE)}")
        return None
    version, required = entry["version"], entry["required"]
    if type(version) is not int or not 1 <= version < 1 << 31:
        problems.add(f"{head}: version must be an integer >= 1, got {_short(version)}")
        return None
    if type(required) is not bool:
        problems.add(f"{head}: required must be true or false, got {_short(required)}")
        return None
    return version, required, entry["data"]


def _decoded(
    codec: SectionCodec[Any], data: Any, version: int, format_version: int, problems: Problems
) -> object | None:
    head = f"section {codec.name!r}"
    if format_version < codec.min_format_version:
        problems.add(f"{head} needs format version {codec.min_format_version}, the document is {format_version}")
        return None
    try:
        size = _json_size(data)
    except (ValueError, TypeError, RecursionError):
        problems.add(f"{head}: data is not JSON")
        return None
    if size > codec.max_bytes:
        problems.add(f"{head}: {size} bytes of data exceed its cap of {codec.max_bytes}")
        return None
    try:
        record = codec.decode(data, version)
    except CorruptMetadataError as e:
        problems.add(f"{head}: {e}")
        return None
    except Exception as e:  # a codec's own bug or a missed case: still only a CheckpointError leaves decode
        problems.add(f"{head}: {type(e).__name__}: {_clip(str(e), 200)}")
        return None
    if not isinstance(record, codec.record_type):
        problems.add(f"{head}: decoded to a {type(record).__name__}, expected {codec.record_type.__name__}")
        return None
    return record


def _encoded(codec: SectionCodec[Any], record: object) -> JSONValue:
    """The JSON of ``record`` exactly as a reader will see it, checked to decode back to it."""
    try:
        text = json.dumps(codec.encode(record), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise UnsupportedValueError(f"metadata section {codec.name!r} does not encode to strict JSON: {e}") from None
    if len(text) > codec.max_bytes:
        raise SizeLimitError(
            f"metadata section {codec.name!r} encodes to {len(text)} bytes, above its cap of {codec.max_bytes} "
            "(SectionCodec.max_bytes)"
        )
    data: JSONValue = json.loads(text)
    try:
        back = codec.decode(data, codec.version)
    except Exception as e:
        raise UnsupportedValueError(
            f"metadata section {codec.name!r} encodes a record its own decoder refuses ({type(e).__name__}: {e})"
        ) from e
    if back != record:
        raise UnsupportedValueError(
            f"metadata section {codec.name!r} does not survive its own encode/decode round trip "
            f"({_clip(repr(record), 200)} came back as {_clip(repr(back), 200)})"
        )
    return data


def _json_size(data: Any) -> int:
    return len(json.dumps(data, separators=(",", ":"), allow_nan=False))


def _short(v: Any) -> str:
    return _clip(repr(v), 60)


def _clip(text: str, cap: int) -> str:
    return text if len(text) <= cap else text[: cap - 3] + "..."


DEFAULT_SECTIONS = SectionRegistry()
