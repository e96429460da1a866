"""Checkpointed optimizer hyper-parameters against a live param group: validate, then apply.

``optim_state.OptimizerLoad.validate`` calls ``hyper_problems`` (and, under ``strict``,
``key_set_problem``) for every live group before anything is loaded; ``apply`` calls
``apply_hyper`` once every rank validated. A saved value must fit the type of the live one, so
that the next ``optimizer.step()`` cannot fail on it:

* bool <- bool only (``amsgrad=1`` is refused: bool and int are not interchangeable);
* a number <- a number (int or float, never a bool), or a one-element tensor (its value);
* a tensor (a tensor ``lr`` of a capturable / fused optimizer) <- a number (filled in) or a
  tensor of the same shape (copied in): the live tensor keeps its identity and device;
* a tuple or list (``betas``) <- a tuple or list of the same length whose items fit the live items;
* a str <- a str or None; None (unset: ``foreach``, ``fused``) <- any plain value.
Keys only the checkpoint has are set as saved; keys only the live group has are kept.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["hyper_problems", "key_set_problem", "apply_hyper"]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kind(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    if isinstance(v, (tuple, list)):
        return f"a {type(v).__name__} of {len(v)}"
    return f"{v!r} ({type(v).__name__})"


def _misfit(cur: Any, v: Any) -> bool:
    """True when saved value ``v`` cannot replace live value ``cur``."""
    if cur is None:
        return not isinstance(v, (type(None), bool, int, float, str, tuple, list, torch.Tensor))
    if isinstance(cur, torch.Tensor):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape) != tuple(cur.shape)
        return not (_number(v) and cur.numel() == 1)
    if isinstance(cur, bool):
        return not isinstance(v, bool)
    if _number(cur):
        return not (_number(v) or (isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype == torch.bool))
    if isinstance(cur, (tuple, list)):
        return not isinstance(v, (tuple, list)) or len(v) != len(cur) or any(_misfit(c, x) for c, x in zip(cur, v))
    if isinstance(cur, str):
        return not isinstance(v, (str, type(None)))
    return False  # a live value of another type: nothing to check it against


def hyper_problems(live: dict[str, Any], saved: dict[str, Any], gi: int, first: str) -> list[str]:
    """One line per saved hyper-parameter of group ``gi`` whose type does not fit the live one."""
    out = []
    for k, v in saved.items():
        if k in live and _misfit(live[k], v):
            out.append(
                f"param group {gi} (parameters from {first!r}): {k!r} is {_kind(v)} in the checkpoint, "
                f"the live optimizer has {_kind(live[k])}"
            )
    return out


# keys that schedulers and users add to groups: no sign of the optimizer class
_EXTRAS = frozenset({"params", "initial_lr"})


def key_set_problem(
    live: dict[str, Any], defaults: dict[str, Any], saved: dict[str, Any], gi: int, optimizer: str
) -> str | None:
    """A message when the checkpoint's group has keys the live one lacks *and* the live
    optimizer class has hyper-parameters (``defaults``) the checkpoint lacks: the signature of
    another optimizer class (one direction alone is a newer or older torch, or a scheduler)."""
    only_saved = sorted(set(saved) - set(live) - _EXTRAS)
    only_live = sorted(set(defaults) - set(saved) - _EXTRAS)
    if only_saved and only_live:
        return (
            f"optimizer param group {gi}: the checkpoint's hyper-parameters {only_saved} are unknown to the live "
            f"{optimizer}, which has {only_live} that the checkpoint lacks: was it saved from another optimizer "
            "class? (strict=False loads it anyway)"
        )
    return None


def _converted(cur: Any, v: Any) -> Any:
    if isinstance(cur, torch.Tensor):
        if isinstance(v, torch.Tensor):
            cur.copy_(v)
        else:
            cur.fill_(v)
        return cur
    if isinstance(cur, (tuple, list)) and isinstance(v, (tuple, list)):
        return type(cur)(_converted(c, x) for c, x in zip(cur, v))
    if _number(cur) and isinstance(v, torch.Tensor):
        return v.item()
    return v


def apply_hyper(live: dict[str, Any], saved: dict[str, Any]) -> None:
    """Set group ``live``'s hyper-parameters to ``saved`` (validated by ``hyper_problems``)."""
    with torch.no_grad():
        for k, v in saved.items():
            if k != "params":
                live[k] = _converted(live.get(k), v)
