"""The messages between a checkpointer and its writer process (``writer_process`` /
``writer_main``): versioned JSON in length-prefixed frames, never pickle.

A frame is a 12-byte header, ``struct`` ``"!4sHHI"``: the magic ``b"UCKW"``, the protocol version
(``PROTOCOL_VERSION``), reserved zero flags and the body's length; then the body, one JSON object
(UTF-8). A frame announces at most ``MAX_BODY_BYTES``: a reader allocates nothing larger, whatever
the header says. Requests and replies (every key is required):

  parent -> writer  {"op": "write", "id": n, "root": str, "direct": bool, "chunk": int,
                     "threads": int, "files": [{"file": str, "path": str, "size": int,
                     "image": int | null}], "new_images": [int], "forget": [int]}
                    (the frame carries one file descriptor per ``new_images`` entry, in order:
                    the shared-memory images the writer maps once and keeps until ``forget``)
                    {"op": "exit"}
  writer -> parent  {"op": "ready", "pid": int}
                    {"op": "written", "id": n, "sums": {file: [size, [crc32c, ...]]}}
                    {"op": "failed", "id": n, "error": {"type": str, "errno": int | null,
                     "message": str}}
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_BODY_BYTES",
    "HEADER",
    "MessageError",
    "encode_message",
    "decode_header",
    "decode_body",
    "read_message",
]

PROTOCOL_VERSION = 1
MAGIC = b"UCKW"
HEADER = struct.Struct("!4sHHI")
# a reply holds 4 bytes of CRC per checksum chunk (>= 64 KiB) of a rank's files, ~11 characters
# as JSON: 256 MiB covers a rank writing over 1.5 TiB at the smallest chunk
MAX_BODY_BYTES = 256 << 20


class MessageError(ValueError):
    """A frame that is not a message of this protocol (wrong magic, version, size or JSON)."""


def encode_message(message: dict[str, Any]) -> bytes:
    """One frame holding ``message`` (a JSON object; NaN and infinities refused)."""
    if not isinstance(message, dict):
        raise MessageError(f"a message is a JSON object, not {type(message).__name__}")
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_BODY_BYTES:
        raise MessageError(f"message of {len(body)} bytes exceeds the limit of {MAX_BODY_BYTES}")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(body)) + body


def decode_header(header: bytes) -> int:
    """The body length a frame's header announces (checked: magic, version, flags, bound)."""
    if len(header) != HEADER.size:
        raise MessageError(f"a frame header has {HEADER.size} bytes, got {len(header)}")
    magic, version, flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise MessageError(f"not a writer message (magic {magic!r}, expected {MAGIC!r})")
    if version != PROTOCOL_VERSION:
        raise MessageError(f"writer protocol version {version}, this unickpt speaks {PROTOCOL_VERSION}")
    if flags != 0:
        raise MessageError(f"unknown flags {flags:#x} in a writer message")
    if length > MAX_BODY_BYTES:
        raise MessageError(f"a writer message announces {length} bytes, over the limit of {MAX_BODY_BYTES}")
    return length


def decode_body(body: bytes) -> dict[str, Any]:
    """The JSON object of a frame's body (with an ``"op"`` string)."""
    try:
        message = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise MessageError(f"a writer message is not JSON: {e}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise MessageError("a writer message is a JSON object with an 'op' string")
    return message


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_message(read_exact: Callable[[int], bytes | None]) -> dict[str, Any] | None:
    """The next message from ``read_exact(n)`` (exactly ``n`` bytes, or None at a clean end of the
    stream before the frame); None at that end. A stream ending inside a frame: ``MessageError``."""
    header = read_exact(HEADER.size)
    if header is None:
        return None
    length = decode_header(header)
    body = read_exact(length) if length else b""
    if body is None:
        raise MessageError(f"the stream ended inside a writer message ({length} bytes announced)")
    return decode_body(body)
