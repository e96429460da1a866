"""Rank functions of the dataloader tests (spawned by ``harness.run_ranks``)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import unickpt
from tests.workers.loader_data import drain, make_loader
from unickpt.options import RestoreOptions


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def save_after_some_batches(rank: int, ws: int, sources, path: str) -> list[int]:
    """Each DP rank consumes 1 + rank batches, then the job saves model + loader."""
    loader = make_loader(sources, rank, ws, num_workers=1)
    seen = drain(loader, limit=1 + rank)
    unickpt.save(path, {"model": _model(), "dataloader": loader})
    loader.close()
    return seen


def load_and_drain(rank: int, ws: int, sources, path: str) -> list[int]:
    loader = make_loader(sources, rank, ws)
    unickpt.load(path, {"model": _model(), "dataloader": loader})
    return drain(loader)


class PlainLoader:
    """A loader with only state_dict/load_state_dict (no unickpt.data protocol)."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def save_plain(rank: int, ws: int, path: str) -> None:
    unickpt.save(path, {"model": _model(), "dataloader": PlainLoader(10 + rank)})


def load_plain(rank: int, ws: int, path: str, on_resize: str) -> dict:
    loader = PlainLoader(-1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            unickpt.load(
                path,
                {"model": _model(), "dataloader": loader},
                options=unickpt.LoadOptions(restore=RestoreOptions(loader_on_resize=on_resize)),
            )
    except unickpt.LoaderStateError as e:
        return {"error": str(e), "pos": loader.pos}
    return {"pos": loader.pos, "warned": any("not restored" in str(w.message) for w in caught)}


def save_extra(rank: int, ws: int, path: str) -> None:
    unickpt.save(path, {"model": _model(), "extra_state": {"rank": rank}})


def load_extra(rank: int, ws: int, path: str, choice: str) -> dict:
    state = {"model": _model(), "extra_state": {"rank": "untouched"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            unickpt.load(path, state, options=unickpt.LoadOptions(restore=RestoreOptions(extra_state_on_resize=choice)))
        except unickpt.ExtraStateResizeError as e:
            return {"error": str(e)}
    return {"rank": state["extra_state"]["rank"], "warned": bool(caught) and rank == 0}


def save_without_loader(rank: int, ws: int, path: str) -> None:
    unickpt.save(path, {"model": _model()})


def load_into_protocol_loader(rank: int, ws: int, sources, path: str, strict: bool) -> str:
    loader = make_loader(sources, rank, ws)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            unickpt.load(path, {"model": _model(), "dataloader": loader}, strict=strict)
        except unickpt.MissingKeysError as e:
            return f"MissingKeysError: {e}"
    return "warned: " + " | ".join(str(w.message) for w in caught)


def stateful_dataloader_round_trip(rank: int, ws: int, path: str) -> list[list[int]]:
    """torchdata's StatefulDataLoader at the same DP size: the resumed loader yields exactly the
    batches the uninterrupted one would have (expected values from torchdata itself)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(rank * 100, rank * 100 + 40))

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(rank))

    ref = [b.tolist() for b in make()]
    run = make()
    it = iter(run)
    for _ in range(3):
        next(it)
    unickpt.save(path, {"model": _model(), "dataloader": run})
    resumed = make()
    unickpt.load(path, {"model": _model(), "dataloader": resumed})
    rest = [b.tolist() for b in resumed]
    assert rest == ref[3:], (rest, ref[3:])
    return rest


def tp_job(rank: int, ws: int, sources, path: str, mode: str) -> list[int]:
    """4 ranks = DP 2 x TP 2 (Megatron style): only TP rank 0 of each DP group (ranks 0 and 2)
    owns a loader, with dp_rank = rank // 2; the others pass none. ``mode``: "save" consumes
    1 + dp_rank batches then saves; "load" restores on the same layout and drains."""
    dp_rank, tp_rank = divmod(rank, 2)
    loader = make_loader(sources, dp_rank, 2) if tp_rank == 0 else None
    state = {"model": _model()}
    if loader is not None:
        state["dataloader"] = loader
    if mode == "save":
        seen = drain(loader, limit=1 + dp_rank) if loader is not None else []
        unickpt.save(path, state)
        return seen
    unickpt.load(path, state)
    return drain(loader) if loader is not None else []


def dropout_run(rank: int, ws: int, path: str, steps: int, resume_at: int | None) -> list[float]:
    """Train a dropout model with a TokenPackingLoader-free random input stream: save at
    ``resume_at`` (with RNG state), then either go on or stop and resume in a new process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    start = 0
    if resume_at is not None and steps < 0:  # the resumed run
        state = {"model": model, "optimizer": optim, "extra_state": {}}
        unickpt.load(path, state)
        unickpt.set_rng_state(state["extra_state"]["rng"])
        start, steps = resume_at, -steps
    for step in range(start, steps):
        if resume_at is not None and step == resume_at and start == 0:
            unickpt.save(path, {"model": model, "optimizer": optim, "extra_state": {"rng": unickpt.rng_state()}})
        x = torch.randn(4, 8)
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def load_without_loader(rank: int, ws: int, path: str, strict: bool) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            unickpt.load(path, {"model": _model()}, strict=strict)
        except unickpt.UnexpectedKeysError as e:
            return f"UnexpectedKeysError: {e}"
    return "warned: " + " | ".join(str(w.message) for w in caught)


def run_steps(rank: int, ws: int, steps: list[list]) -> dict[str, object]:
    """Several of the rank functions above, one after the other in one spawned job: ``steps`` is
    a list of ``[label, function name, arguments]``; returns each step's result by label."""
    functions = {
        f.__name__: f
        for f in (
            save_after_some_batches,
            load_and_drain,
            save_plain,
            load_plain,
            save_extra,
            load_extra,
            save_without_loader,
            load_into_protocol_loader,
            stateful_dataloader_round_trip,
            tp_job,
            dropout_run,
            load_without_loader,
        )
    }
    return {label: functions[name](rank, ws, *args) for label, name, args in steps}
