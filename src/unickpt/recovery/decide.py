"""The one recovery decision (pure): which step to load and who holds each of its files.

``choose`` is called by rank 0 in ``restore.recover`` with every host's inventory (the commit
markers its agent found and the files they name that are present with their size) and the
durable tier's newest step. A RAM step (a step folder and save id) is *complete* when every file
its markers name as required has at least one holder; its copies' CRC32Cs are checked later, as
they are read. The newest complete RAM step not in ``excluded`` (steps whose copies failed to
verify in an earlier round) wins, unless the durable tier holds a newer step; a tie goes to
RAM. A step whose markers record non-finite tensors (``check_finite``) is never chosen.
The decision is broadcast and every host materialises or loads what it names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["choose"]


def choose(
    inventories: Mapping[str, Mapping[str, Mapping[str, Any]]],
    durable_step: int | None,
    excluded: Iterable[Iterable[str]] = (),
) -> dict[str, Any]:
    """``inventories``: host -> stepdir -> marker record (``inventory.RamLayout.local_inventory``).

    Returns ``{"source": "ram"|"durable"|"none", "step", "stepdir", "save_id", "chunk",
    "files": {name: [size, crcs]}, "holders": {name: [[host, where, origin], ...]},
    "incomplete": [[step, save_id, first missing file], ...]}``."""
    skip = {tuple(e) for e in excluded}
    saves: dict[tuple[str, str], list[tuple[str, Mapping[str, Any]]]] = {}
    for host in sorted(inventories):
        for stepdir, rec in inventories[host].items():
            saves.setdefault((stepdir, rec["save_id"]), []).append((host, rec))
    best: dict[str, Any] | None = None
    incomplete = []
    for key in sorted(saves, key=lambda k: (-int(saves[k][0][1]["step"]), k)):
        if key in skip:
            continue
        recs = saves[key]
        bad = sorted({n for _, rec in recs for n in rec.get("nonfinite", [])})
        if bad:  # check_finite found NaN/Inf when it was saved
            incomplete.append([int(recs[0][1]["step"]), key[1], f"non-finite values in {', '.join(bad[:5])}"])
            continue
        step, chunk = int(recs[0][1]["step"]), int(recs[0][1]["chunk"])
        required = list(recs[0][1]["required"])
        files: dict[str, list[Any]] = {}
        holders: dict[str, list[list[str]]] = {}
        # the origin's own entry fixes a file's size and CRCs; a copy that disagrees is no copy
        for prefer in ("primary", "replica"):
            for _, rec in recs:
                if int(rec["chunk"]) != chunk:
                    continue
                for e in rec["files"]:
                    if e["where"] == prefer:
                        files.setdefault(e["name"], [e["size"], e["crcs"]])
        for host, rec in recs:
            for e in rec["files"]:
                if files.get(e["name"]) == [e["size"], e["crcs"]] and int(rec["chunk"]) == chunk:
                    holders.setdefault(e["name"], []).append([host, e["where"], e["origin"]])
        lacking = [n for n in required if n not in holders]
        if lacking:
            incomplete.append([step, key[1], lacking[0]])
            continue
        best = {"source": "ram", "step": step, "stepdir": key[0], "save_id": key[1], "chunk": chunk}
        best["files"] = {n: files[n] for n in required}
        best["holders"] = {n: holders[n] for n in required}
        break
    if best is None or (durable_step is not None and durable_step > best["step"]):
        if durable_step is None:
            return {"source": "none", "step": None, "incomplete": incomplete}
        return {"source": "durable", "step": durable_step, "incomplete": incomplete}
    best["incomplete"] = incomplete
    return best
