"""``unickpt convert --from torch|lightning FILE OUT``: one ``torch.save`` file (a plain training
script's checkpoint, a Lightning ``.ckpt``) in unickpt's terms, read without running its pickle
(``ops.torch_save_read.read_torch_save``: tensors and plain values only; any other class is refused
before it is built). ``convert.from_torch`` / ``convert.from_lightning`` call :func:`read_torch_checkpoint`
and save what it returns with ``framework="tensors"``.

What lands where (:class:`TorchImport`):

* the model: a ``{name: tensor}`` state dict. ``lightning``: the file's ``state_dict``. ``torch``:
  the file itself when it is one (``torch.save(model.state_dict())``), else the one entry that is
  a ``{name: tensor}`` dict, or, among several, the first of ``model``, ``state_dict``,
  ``model_state_dict``, ``module``, ``net``, ``network``; the other ``{name: tensor}`` entries
  (an EMA copy) become modules under their own key (``<key>.<name>``: ``unickpt.load(out,
  {"model": model, "ema": ema_model})``). Names are cleaned as unickpt names a live module
  (``module_state.clean_fqn``: DDP's ``module.``, ``_orig_mod.`` ... dropped), so the result loads
  into the bare, DDP-, FSDP- or compile-wrapped module alike.
* the optimizer: every optimizer state dict (``{"state", "param_groups"}``) of the file or a list
  of them (``lightning``: ``optimizer_states``), merged into unickpt's one ``optimizer`` object,
  state by parameter name (:func:`optimizer_names` says how ids become names).
* ``torch``: every other dict entry (an LR scheduler's, a ``GradScaler``'s ``state_dict()``) under
  its own key, as a ``Stateful`` saves it, restored by the live object's ``load_state_dict``;
  ``dataloader`` as the dataloader state of rank 0; every other value (``epoch``, ``step``,
  ``best_loss``, lists) in ``extra_state`` under its name.
* ``lightning``: everything but ``state_dict`` and ``optimizer_states`` (``epoch``,
  ``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``, ``hyper_parameters``, precision
  plugin and datamodule state ...) under the key ``lightning`` exactly as
  ``integrations.lightning``'s strategies save Lightning's dict, so ``trainer.fit(model,
  ckpt_path=OUT)`` with a unickpt strategy resumes from it, at any world size.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, ConfigurationError, CorruptMetadataError, NotACheckpointError
from ..frameworks.module_state import clean_fqn
from .torch_save_read import read_torch_save

__all__ = [
    "TorchImport",
    "StateDictOf",
    "read_torch_checkpoint",
    "optimizer_names",
    "param_names_of",
    "LIGHTNING_KEY",
    "MODEL_NAMES",
    "BATCHNORM_BUFFERS",
]

LIGHTNING_KEY = "lightning"  # integrations.lightning.LIGHTNING_KEY (that module needs Lightning installed)
MODEL_NAMES = ("model", "state_dict", "model_state_dict", "module", "net", "network")
BATCHNORM_BUFFERS = frozenset({"running_mean", "running_var", "num_batches_tracked"})
_RESERVED = frozenset({"model", "optimizer", "extra_state", "dataloader", LIGHTNING_KEY})
_LIGHTNING_TENSORS = ("state_dict", "optimizer_states")


@dataclass(frozen=True, slots=True)
class TorchImport:
    """One file in unickpt's terms (module docstring): ``tensors`` (``model.<name>``,
    ``<key>.<name>``, ``optimizer.state.<name>.<state>``), ``objects`` (the ``optimizer`` object, not
    encoded), ``statefuls`` (key -> the ``state_dict()`` to save under it), ``extra_state`` and
    ``dataloader`` (None when the file has none), and the summary line's ``layout``."""

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    statefuls: dict[str, Any]
    extra_state: dict[str, Any] | None
    dataloader: Any
    layout: str


class StateDictOf:
    """Saves a ``state_dict()`` read from a file under its key as a ``Stateful`` does (an LR
    scheduler's, Lightning's dict): what ``convert`` puts in the state it saves."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def read_torch_checkpoint(path: str, *, lightning: bool, param_names: Sequence[str] | None = None) -> TorchImport:
    """The ``torch.save`` file at ``path`` in unickpt's terms (module docstring). ``param_names``:
    the parameters every optimizer updates, in the order it lists them (:func:`param_names_of`),
    for files whose optimizer state is keyed by index and cannot be mapped from the file alone."""
    top = _read(path, lightning)
    where = path
    if lightning:
        if not isinstance(top, dict) or not _tensor_dict(top.get("state_dict")):
            raise NotACheckpointError(
                f"{path} is not a Lightning checkpoint (no 'state_dict' of tensors): a plain torch.save file "
                "converts with `unickpt convert --from torch`"
            )
        model_key, modules = "state_dict", {"state_dict": top["state_dict"]}
    elif _tensor_dict(top):
        model_key, modules, top = "", {"": top}, {}
    elif isinstance(top, dict):
        modules = {k: v for k, v in top.items() if _tensor_dict(v)}
        model_key = _model_key(modules, path)
    else:
        raise NotACheckpointError(
            f"{path} holds a {type(top).__name__}, not a dict: convert reads a state dict or a dict of them"
        )
    tensors: dict[str, torch.Tensor] = {}
    model_names: list[str] = []  # the model's entries, cleaned, in the file's order
    model_values: list[torch.Tensor] = []
    for key, sd in modules.items():
        prefix = "model." if key == model_key else f"{_state_key(key, path)}."
        for raw, t in sd.items():
            name = clean_fqn(raw, True)
            if prefix + name in tensors:
                raise ConfigurationError(f"{path}: {key or 'the state dict'} names {name!r} twice (as {raw!r})")
            tensors[prefix + name] = t
            if key == model_key:
                model_names.append(name)
                model_values.append(t)
    optim_keys = [k for k, v in (top.items() if isinstance(top, dict) else ()) if _optimizer_list(v) is not None]
    if lightning:
        optim_keys = [k for k in optim_keys if k == "optimizer_states"]
    optims = [(k, i, sd) for k in optim_keys for i, sd in enumerate(_optimizer_list(top[k]) or [])]
    objects: dict[str, Any] = {}
    how = ""
    if optims:
        names, how = optimizer_names(optims, model_names, model_values, param_names, where)
        optim_tensors, objects["optimizer"] = _optimizer(optims, names, dict(zip(model_names, model_values)), where)
        tensors.update(optim_tensors)
    statefuls: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    loader = None
    taken = set(modules) | set(optim_keys)
    if lightning:
        from ..format.values import dumps_value

        rest = {k: v for k, v in top.items() if k not in _LIGHTNING_TENSORS}
        try:
            data = dumps_value(rest, "the Lightning checkpoint dict")
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            raise ConfigurationError(f"{path}: cannot convert the Lightning checkpoint dict: {e}") from None
        statefuls[LIGHTNING_KEY] = {"checkpoint": data}
    else:
        for key, value in top.items():
            if key in taken:
                continue
            if key == "dataloader":
                loader = value
            elif type(value) in (dict, OrderedDict) and _valid_key(key) and key not in _RESERVED:
                statefuls[key] = value
            else:
                extra[key if isinstance(key, str) else str(key)] = value
    layout = _describe(path, lightning, model_key, modules, optims, how, statefuls, extra)
    return TorchImport(tensors, objects, statefuls, extra or None, loader, layout)


# ----------------------------------------------------------------------------- reading


def _read(path: str, lightning: bool) -> Any:
    """The unpickled object of the file the user named (a link the user named is followed, as
    the source folder of the other imports may be one; the file itself is opened without
    following anything, ``ops.source_files``)."""
    real = os.path.realpath(path)
    if os.path.isdir(real):
        hint = (
            "a Lightning sharded checkpoint (a DCP folder) converts with `unickpt convert --from dcp`"
            if lightning
            else "a DCP folder converts with `unickpt convert --from dcp`, a verl one with --from verl-fsdp"
        )
        raise NotACheckpointError(f"{path} is a folder, not a torch.save file: {hint}")
    if not os.path.lexists(real):
        raise NotACheckpointError(f"no file at {path}")
    folder, name = os.path.split(real)
    try:
        return read_torch_save(folder or ".", name, f"the file {path}")
    except CorruptMetadataError as e:
        if "asks to build" not in str(e):
            raise
        raise CorruptMetadataError(
            f"{e} (convert reads tensors and plain values only and runs no code from the file: save that "
            "object as plain values, e.g. vars(args) instead of args, and convert again)"
        ) from None


def _tensor_dict(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(type(k) is str for k in value)
        and all(type(v) is torch.Tensor for v in value.values())
    )


def _model_key(modules: dict[Any, Any], path: str) -> str:
    if not modules:
        raise NotACheckpointError(
            f"{path} holds no {{name: tensor}} state dict (looked for a dict of tensors at the top level and "
            f"under any key): nothing to import"
        )
    if len(modules) == 1:
        return str(next(iter(modules)))
    for name in MODEL_NAMES:
        if name in modules:
            return name
    raise ConfigurationError(
        f"{path} holds several state dicts ({', '.join(map(repr, list(modules)[:5]))}) and none is named "
        f"{', '.join(MODEL_NAMES)}: cannot tell which is the model (re-save it under 'model')"
    )


def _valid_key(key: Any) -> bool:
    from ..state.layout import check_key

    try:
        check_key(key)
    except CheckpointError:
        return False
    return True


def _state_key(key: Any, path: str) -> str:
    if not _valid_key(key) or key in _RESERVED:
        raise ConfigurationError(
            f"{path}: the state dict under {key!r} cannot become a unickpt state key (1-128 letters, digits, "
            f"'_', '-', '.', none of {sorted(_RESERVED)}): re-save it under another name"
        )
    return str(key)


def _is_optimizer(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("state"), dict)
        and isinstance(value.get("param_groups"), list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in value["param_groups"])
    )


def _optimizer_list(value: Any) -> list[dict[str, Any]] | None:
    """The optimizer state dicts ``value`` is (one, or a non-empty list of them), else None."""
    if _is_optimizer(value):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(_is_optimizer(v) for v in value):
        return list(value)
    return None


# ----------------------------------------------------------------------------- optimizer


def param_names_of(model: torch.nn.Module, *optimizers: Any) -> list[str]:
    """The names of the parameters ``optimizers`` update, in the order their state dicts number
    them (the ``param_names`` of :func:`read_torch_checkpoint`): built as the training script
    builds them (their values do not matter), e.g. ``param_names_of(model, AdamW(groups))``.
    Without optimizers: every parameter of ``model`` in ``model.parameters()`` order."""
    name_of: dict[int, str] = {}
    for name, p in model.named_parameters():
        name_of.setdefault(id(p), clean_fqn(name, True))
    if not optimizers:
        return list(dict.fromkeys(name_of.values()))
    out = []
    for i, opt in enumerate(optimizers):
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in name_of:
                    raise ConfigurationError(
                        f"optimizer {i} updates a parameter (shape {tuple(p.shape)}) the model lacks"
                    )
                out.append(name_of[id(p)])
    return out


def optimizer_names(
    optims: list[tuple[Any, int, dict[str, Any]]],
    model_names: list[str],
    model_values: list[torch.Tensor],
    param_names: Sequence[str] | None,
    where: str,
) -> tuple[list[list[str]], str]:
    """Per optimizer, the parameter name of each entry of its param groups (in their order), and
    how they were found. In order of preference:

    1. the groups list names already (``FSDP.optim_state_dict``, ``get_optimizer_state_dict``
       with full state dicts, a Lightning FSDP/ModelParallel full checkpoint): used as they are;
    2. the groups carry ``param_names`` (an optimizer built over ``model.named_parameters()``);
    3. ``param_names`` given by the user: the parameters of every optimizer in its order;
    4. inferred, only for one optimizer with one param group: torch numbers a state dict's
       parameters in the order the optimizer holds them, and an optimizer built over
       ``model.parameters()`` holds the model's parameters in state-dict order. A state dict does
       not say which entries are parameters: every floating-point entry counts except
       BatchNorm's buffers (``running_mean``, ``running_var``) and a tied parameter's second name;
       the count must equal the optimizer's, and every state tensor that is not a scalar must
       have its parameter's shape. Anything else (several groups, several optimizers, other
       buffers, an optimizer over a subset) is refused: pass ``param_names``.
    """
    per: list[list[str]] = []
    hows = set()
    offset = 0
    known = set(model_names)
    for key, index, sd in optims:
        label = f"{where}: optimizer {key!r}" + (f"[{index}]" if len(optims) > 1 else "")
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        if ids and all(type(i) is str for i in ids):
            names, how = [clean_fqn(i, True) for i in ids], "named in the file"
        elif all(
            isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(g["params"])
            for g in sd["param_groups"]
        ):
            names, how = [clean_fqn(str(n), True) for g in sd["param_groups"] for n in g["param_names"]], "param_names"
        elif not all(type(i) is int for i in ids) or ids != list(range(len(ids))):
            raise CorruptMetadataError(
                f"{label}: its param groups number their parameters {ids[:8]}, not 0..{len(ids) - 1}"
            )
        elif param_names is not None:
            names, how = list(param_names[offset : offset + len(ids)]), "param_names given"
            if len(names) != len(ids):
                raise ConfigurationError(
                    f"{label}: the optimizers update {offset + len(ids)} or more parameters, param_names lists "
                    f"{len(param_names)}"
                )
        else:
            names, how = _inferred(label, sd, model_names, model_values, len(optims)), "inferred from the model's order"
        missing = [n for n in names if n not in known]
        if missing:
            raise ConfigurationError(
                f"{label} updates {missing[:3]}, which the model state dict lacks"
                + (" (check param_names)" if how == "param_names given" else "")
            )
        if len(set(names)) != len(names):
            raise ConfigurationError(f"{label} lists a parameter twice ({_first_twice(names)!r})")
        offset += len(ids)
        per.append(names)
        hows.add(how)
    if param_names is not None and offset != len(param_names) and "param_names given" in hows:
        raise ConfigurationError(
            f"{where}: the optimizers update {offset} parameters, param_names lists {len(param_names)}"
        )
    flat = [n for names in per for n in names]
    if len(set(flat)) != len(flat):
        raise ConfigurationError(
            f"{where}: two optimizers update {_first_twice(flat)!r}; unickpt holds one state per parameter"
        )
    return per, ", ".join(sorted(hows))


def _first_twice(names: list[str]) -> str:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            return n
        seen.add(n)
    return ""


def _inferred(
    label: str, sd: dict[str, Any], names: list[str], values: list[torch.Tensor], optimizers: int
) -> list[str]:
    hint = (
        "pass the parameter names in the optimizer's order: `unickpt convert ... --param-names FILE` (one name "
        "a line) or convert.from_torch(..., param_names=convert.param_names_of(model, optimizer)) with the model "
        "and optimizer built as the training script builds them"
    )
    groups = sd["param_groups"]
    if optimizers > 1 or len(groups) > 1:
        what = f"{optimizers} optimizers" if optimizers > 1 else f"{len(groups)} param groups"
        raise ConfigurationError(
            f"{label} numbers its parameters (torch's optimizer.state_dict()) over {what}: which parameter each "
            f"number is cannot be told from the file; {hint}"
        )
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    params = []
    for name, t in zip(names, values):
        if not (t.is_floating_point() or t.is_complex()) or name.rpartition(".")[2] in BATCHNORM_BUFFERS:
            continue
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and ident in seen:  # a tied parameter: once in model.parameters()
            continue
        seen.add(ident)
        params.append((name, t))
    count = len(groups[0]["params"])
    if count != len(params):
        raise ConfigurationError(
            f"{label} updates {count} parameters, the model state dict has {len(params)} floating-point entries "
            f"that may be parameters (buffers cannot be told from parameters in a state dict, nor an optimizer "
            f"over a subset of them); {hint}"
        )
    state = sd["state"]
    for i, (name, t) in enumerate(params):
        for k, v in (state.get(i) or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(t.shape):
                raise ConfigurationError(
                    f"{label}: state {k!r} of parameter {i} has the shape {tuple(v.shape)}, the {i}-th parameter "
                    f"of the model ({name}) {tuple(t.shape)}: the parameters are not in the model's order; {hint}"
                )
    return [n for n, _ in params]


def _optimizer(
    optims: list[tuple[Any, int, dict[str, Any]]], per: list[list[str]], model: Mapping[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer tensors ``optimizer.state.<name>.<state>`` and unickpt's ``optimizer`` object
    (``{"param_groups": [{<hyper>..., "params": [name...]}], "state_values": {name: {state: value}}}``)."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for (key, _, sd), names in zip(optims, per):
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        name_of = dict(zip(ids, names))
        for pid, st in sd["state"].items():
            name = name_of.get(pid) if type(pid) in (int, str) else None
            if name is None:
                raise CorruptMetadataError(
                    f"{where}: optimizer {key!r} has state for {pid!r:.60}, a parameter no param group lists"
                )
            if not isinstance(st, dict) or not all(type(k) is str and k and "." not in k for k in st):
                raise CorruptMetadataError(
                    f"{where}: optimizer {key!r}: the state of {name!r} is not a dict of named values"
                )
            for k, v in st.items():
                if type(v) is torch.Tensor:
                    tensors[f"optimizer.state.{name}.{k}"] = v
                else:
                    values.setdefault(name, {})[k] = v
        for g in sd["param_groups"]:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [name_of[i] for i in g["params"]]
            groups.append(entry)
    return tensors, {"param_groups": groups, "state_values": values}


def _describe(
    path: str,
    lightning: bool,
    model_key: str,
    modules: dict[Any, Any],
    optims: list[tuple[Any, int, dict[str, Any]]],
    how: str,
    statefuls: dict[str, Any],
    extra: dict[str, Any],
) -> str:
    parts = [f"the model from {model_key!r}" if model_key else "the model (the whole file)"]
    others = [k for k in modules if k != model_key]
    if others:
        parts.append(f"modules under their own keys: {', '.join(map(str, others))}")
    if optims:
        keys = list(dict.fromkeys(str(k) for k, _, _ in optims))
        parts.append(f"the optimizer from {', '.join(keys)} (parameter names {how})")
    else:
        parts.append("no optimizer")
    if lightning:
        parts.append(f"Lightning's trainer state under {LIGHTNING_KEY!r}")
    else:
        if statefuls:
            parts.append(f"state_dict()s under their own keys: {', '.join(statefuls)}")
        if extra:
            parts.append(f"extra_state: {', '.join(map(str, extra))}")
    if not lightning and "pytorch-lightning_version" in extra:
        parts.append("a Lightning checkpoint: --from lightning keeps its trainer state for a unickpt strategy")
    return ("Lightning checkpoint: " if lightning else "torch.save: ") + "; ".join(parts)
