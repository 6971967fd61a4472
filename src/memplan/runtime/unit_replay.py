"""A unit's replay (``replay``): a recorded module call run again by calling the module, with
the parameters, grad mode and autocast it ran with, taking what autograd saves; and the value
of an outside tensor as a scope read it (ops and units alike)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from memplan.errors import ReplayError
from memplan.runtime.tape import (
    READ,
    Ext,
    Pos,
    Ref,
    Tape,
    UnitEntry,
    storage_key,
    tensor_leaves,
    unflatten_tree,
)


def ext_value(leaf: Ext, tape: Tape, what: object) -> torch.Tensor:
    """An outside tensor as the scope read it: never a value changed since. ``what`` read
    it (an op, or a text), formatted only for the error (an op's name costs microseconds)."""
    t = leaf.tensor
    if leaf.mode != READ:
        return t.clone()  # the op writes it: write a copy
    if t._version == leaf.version:
        return t
    snap = tape.snaps.get((storage_key(t), leaf.version))
    if snap is not None:
        return snap.clone()  # the replay may write it through a view, as the forward did
    raise ReplayError(
        f"memplan: {tape.namer(t)}, read by {what} in a recomputed part of the forward, was "
        f"changed in place afterwards (version {leaf.version} then, {t._version} now), so "
        "backward cannot recompute with the value it had. Clone it before changing it "
        "(x = x.clone(); x.mul_(...)), change it out of place, or keep that part (plan with "
        "a larger budget)."
    )


class Stop(Exception):
    """A unit's replay has taken every tensor its forward saved, and none of its outputs is
    needed: the rest of the call is not run (torch's checkpoint stops the same way)."""


def run_unit(entry: UnitEntry, env: dict[Pos, torch.Tensor], tape: Tape, collect: bool,
              grad: bool, stop: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Re-run a unit's module call. ``collect``: with grad enabled, taking the tensors
    autograd saves, in order (the handles' values); otherwise under no_grad, for its outputs.
    Inputs are detached unless ``grad`` (create_graph: the replay's graph must reach them).
    ``stop``: the call ends at its last save and gives no outputs."""
    what = f"the call of module '{entry.path}'"
    args, kwargs = _arguments(entry, env, tape, collect and not grad, what)
    saved: list[torch.Tensor] = []

    def take(t: torch.Tensor) -> Any:
        if grad:
            saved.append(t)
            return t.detach()
        saved.append(t.detach())
        if stop and len(saved) == entry.n_saved:
            raise Stop
        return None

    enable = entry.grad_enabled and (collect or grad)
    # The call's state set by hand, not by context managers: a region replays tens of units,
    # and an ExitStack of four contexts cost more than a small call's Python.
    restore = _bind(entry, what)
    was_enabled = torch.is_grad_enabled()
    try:
        torch._C._set_grad_enabled(enable)
        if collect:
            torch._C._autograd._push_saved_tensors_default_hooks(take, _identity)
        try:
            out = _call(entry, args, kwargs)
        finally:
            if collect:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            torch._C._set_grad_enabled(was_enabled)
    except Stop:
        _check_saved(entry, saved)
        return [], saved
    finally:
        for holder, key, value in reversed(restore):
            holder[key] = value
    outs = tensor_leaves(out)
    if len(outs) != entry.n_outputs or (collect and len(saved) != entry.n_saved):
        raise _differs(entry, f"gave {len(outs)} tensors and saved {len(saved)} for "
                       f"backward, where its forward gave {entry.n_outputs} and saved "
                       f"{entry.n_saved}")
    if collect:
        _check_saved(entry, saved)
    if not grad:
        outs = [o.detach() for o in outs]
    return outs, saved


def _arguments(entry: UnitEntry, env: dict[Pos, torch.Tensor], tape: Tape, detach: bool,
               what: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments from the replay's values; ``detach``: tensors cut from the
    replay's graph (leaves requiring grad where the forward's did)."""
    vals: list[Any] = []
    i = 0
    for leaf in entry.leaves:
        if isinstance(leaf, Ref):
            v = env[leaf.pos]
        elif isinstance(leaf, Ext):
            v = ext_value(leaf, tape, what)
        else:
            vals.append(leaf)
            continue
        if detach:
            v = v.detach().requires_grad_(entry.grads[i]) if entry.grads[i] else v.detach()
        vals.append(v)
        i += 1
    return unflatten_tree(vals, entry.spec)


def _check_saved(entry: UnitEntry, saved: list[torch.Tensor]) -> None:
    """A unit's re-run saved what its forward saved: the same shapes and dtypes, in order
    (compared whole; the first that differs is named)."""
    shapes, dtypes = entry.saved
    if tuple([t.shape for t in saved]) == shapes and tuple([t.dtype for t in saved]) == dtypes:
        return
    for t, shape, dtype in zip(saved, shapes, dtypes):
        if t.shape != shape or t.dtype != dtype:
            raise _differs(entry, f"saved a {_meta(t.shape, t.dtype)} tensor for backward "
                           f"where its forward saved a {_meta(shape, dtype)} one")


def _differs(entry: UnitEntry, got: str) -> ReplayError:
    return ReplayError(
        f"memplan: recomputing the call of module '{entry.path}' {got}: the module's forward "
        "depends on state other than its arguments, parameters and buffers (Python state, "
        "random numbers not from torch). Make its forward deterministic given its inputs, or "
        "keep that part (plan with a larger budget)."
    )


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def _call(entry: UnitEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The module call, under the autocast its forward ran in."""
    if not entry.autocast:
        return entry.module(*args, **kwargs)
    with contextlib.ExitStack() as stack:
        for device, dtype in entry.autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        return entry.module(*args, **kwargs)


def _bind(entry: UnitEntry, what: str) -> list[tuple[dict[str, Any], str, Any]]:
    """Bind the parameters and buffers the unit ran with (a functional_call or a
    re-registration since then leaves other tensors there); what to put back after."""
    restore: list[tuple[dict[str, Any], str, Any]] = []
    for slot, rec, version in zip(entry.info.slots, entry.bound, entry.versions):
        if rec is None:
            continue
        if rec._version != version:
            for holder, key, value in reversed(restore):
                holder[key] = value
            raise ReplayError(
                f"memplan: '{slot.name}', read by {what} in a recomputed part of the forward, "
                f"was changed in place afterwards (version {version} then, {rec._version} "
                "now), so backward cannot recompute with the value it had. Change it after "
                "backward (as optimizers do), or keep that part (plan with a larger budget)."
            )
        if slot.holder[slot.key] is not rec:
            restore.append((slot.holder, slot.key, slot.holder[slot.key]))
            slot.holder[slot.key] = rec
    return restore


def _identity(x: Any) -> Any:
    return x
