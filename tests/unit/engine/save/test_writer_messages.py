"""The writer process's message frames (engine.save.writer_messages): versioned JSON, bounded,
never pickle. Expected frames are built here with ``struct`` and ``json``, not by the codec."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unickpt.engine.save.writer_messages import (
    MAX_BODY_BYTES,
    PROTOCOL_VERSION,
    MessageError,
    decode_body,
    decode_header,
    encode_message,
    read_message,
)


def _frame(body: bytes, magic: bytes = b"UCKW", version: int = PROTOCOL_VERSION, flags: int = 0, n=None) -> bytes:
    return struct.pack("!4sHHI", magic, version, flags, len(body) if n is None else n) + body


def _reader(data: bytes):
    pos = [0]

    def read_exact(n: int):
        if pos[0] == len(data):
            return None
        chunk = data[pos[0] : pos[0] + n]
        pos[0] += len(chunk)
        return chunk if len(chunk) == n else None

    return read_exact


def test_a_frame_is_the_header_and_the_compact_json():
    msg = {"op": "written", "id": 3, "sums": {"0": [5, [1, 2]]}}
    body = json.dumps(msg, separators=(",", ":")).encode()
    assert encode_message(msg) == _frame(body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.text(min_size=1, max_size=10), st.dictionaries(st.text(max_size=8), json_values, max_size=5))
def test_round_trip(op, fields):
    msg = {**fields, "op": op}
    stream = encode_message(msg) + encode_message({"op": "exit"})
    read = _reader(stream)
    assert read_message(read) == msg
    assert read_message(read) == {"op": "exit"}
    assert read_message(read) is None  # a clean end between frames


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        (_frame(b'{"op":"x"}', magic=b"PKL\x80"), "magic"),
        (_frame(b'{"op":"x"}', version=PROTOCOL_VERSION + 1), "version"),
        (_frame(b'{"op":"x"}', flags=1), "flags"),
        (_frame(b"", n=MAX_BODY_BYTES + 1), "limit"),
    ],
)
def test_foreign_headers_are_refused_before_reading_the_body(frame, says):
    with pytest.raises(MessageError, match=says):
        decode_header(frame[:12])


@pytest.mark.parametrize(
    "body",
    [b"\x80\x04\x95", b"[1, 2]", b'{"id": 1}', b'{"op": 3}', b'{"op":"x","v":NaN}', b"\xff\xfe"],
)
def test_bodies_that_are_not_a_message_object_are_refused(body):
    with pytest.raises(MessageError):
        decode_body(body)


def test_a_stream_ending_inside_a_frame_is_an_error():
    frame = encode_message({"op": "ready", "pid": 1})
    with pytest.raises(MessageError, match="ended inside"):
        read_message(_reader(frame[:-3]))


def test_nan_and_oversized_messages_are_not_encoded():
    with pytest.raises(ValueError):
        encode_message({"op": "x", "v": float("nan")})
    with pytest.raises(MessageError):
        encode_message(["op"])  # type: ignore[arg-type]
