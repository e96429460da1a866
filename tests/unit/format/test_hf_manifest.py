"""The in-save export's record (``format.hf_manifest``): what it encodes decodes to itself, and
anything else (another format or version, a name that leaves the folder, a bad size, truncated
bytes) decodes to None, so nothing is then taken for unickpt's."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from unickpt.format.hf_manifest import HFManifest

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,30}", fullmatch=True).filter(
    lambda n: n != "unickpt.hf_export.json" and not n.endswith(".unickpt-partial")
)


@st.composite
def manifests(draw: st.DrawFn) -> HFManifest:
    complete = draw(st.booleans())
    files = draw(st.lists(names, max_size=8, unique=True))
    sizes = [draw(st.integers(0, 1 << 50)) if complete else None for _ in files]
    return HFManifest(draw(st.text(max_size=20)), complete, tuple(zip(files, sizes)))


@given(manifests())
def test_round_trip(m: HFManifest) -> None:
    assert HFManifest.decode(m.encode()) == m


@given(manifests(), st.integers(0, 200))
def test_truncated_bytes_are_no_manifest(m: HFManifest, cut: int) -> None:
    data = m.encode()
    if cut < len(data):
        assert HFManifest.decode(data[:cut]) is None


def _doc(**change: object) -> bytes:
    doc: dict[str, object] = {
        "format": "unickpt.hf_export",
        "version": 1,
        "save_id": "s",
        "complete": True,
        "files": [["model.safetensors", 10]],
    }
    doc.update(change)
    return json.dumps(doc).encode()


def test_what_is_not_a_manifest_of_this_version() -> None:
    assert HFManifest.decode(_doc()) == HFManifest("s", True, (("model.safetensors", 10),))
    for bad in (
        _doc(version=2),
        _doc(format="other"),
        _doc(files=[["../data/x", 1]]),
        _doc(files=[["sub/model.safetensors", 1]]),
        _doc(files=[["unickpt.hf_export.json", 1]]),
        _doc(files=[["model.safetensors", -1]]),
        _doc(files=[["model.safetensors", None]]),  # sizes are recorded once complete
        _doc(files=[["model.safetensors", True]]),
        _doc(complete="yes"),
        b"[1, 2]",
        b"\xff",
    ):
        assert HFManifest.decode(bad) is None, bad
