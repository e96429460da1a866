"""Who copies each file of a RAM step to the durable tier (``recovery.durable._copiers``): the
host that wrote it while it holds a copy, else the first host (sorted) holding one; a file no
host holds fails before anything is written. Expected values are written out by hand."""

from __future__ import annotations

import pytest

from unickpt.errors import IntegrityError
from unickpt.recovery.durable import _copiers

META = "unickpt.metadata.json"
REQUIRED = ["data/r0.bin", "data/r1.bin", "data/r2.bin", META]


def _entry(name: str, origin: str, where: str) -> dict:
    return {"name": name, "origin": origin, "where": where, "size": 1, "crcs": [0]}


def test_each_file_is_copied_by_the_host_that_wrote_it_when_every_host_is_there():
    gathered = [
        ["a", [REQUIRED, {"data/r0.bin": _entry("data/r0.bin", "a", "primary"),
                          "data/r2.bin": _entry("data/r2.bin", "c", "replica")}]],
        ["b", [REQUIRED, {"data/r1.bin": _entry("data/r1.bin", "b", "primary"),
                          "data/r0.bin": _entry("data/r0.bin", "a", "replica")}]],
        ["c", [REQUIRED, {"data/r2.bin": _entry("data/r2.bin", "c", "primary"),
                          "data/r1.bin": _entry("data/r1.bin", "b", "replica")}]],
        ["a", None],  # a second rank of host a: not its agent
    ]  # fmt: skip
    assert _copiers(gathered, 7) == {"data/r0.bin": "a", "data/r1.bin": "b", "data/r2.bin": "c"}


def test_a_file_of_a_host_gone_is_copied_by_the_first_host_holding_it():
    gathered = [
        ["b", [REQUIRED, {"data/r1.bin": _entry("data/r1.bin", "b", "primary"),
                          "data/r0.bin": _entry("data/r0.bin", "a", "replica"),
                          "data/r2.bin": _entry("data/r2.bin", "c", "primary")}]],
        ["d", [REQUIRED, {"data/r2.bin": _entry("data/r2.bin", "c", "replica"),
                          "data/r0.bin": _entry("data/r0.bin", "a", "primary")}]],
    ]  # fmt: skip
    assert _copiers(gathered, 7) == {"data/r0.bin": "b", "data/r1.bin": "b", "data/r2.bin": "b"}


def test_a_file_no_host_holds_is_an_integrity_error_before_anything_is_copied():
    gathered = [["a", [REQUIRED, {"data/r0.bin": _entry("data/r0.bin", "a", "primary")}]]]
    with pytest.raises(IntegrityError, match=r"step 7 cannot be copied to the durable tier: no host's RAM holds "
                                             r"data/r1.bin, data/r2.bin"):  # fmt: skip
        _copiers(gathered, 7)
