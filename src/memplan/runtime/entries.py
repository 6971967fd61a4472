"""How one entry goes on a recompute scope's tape (``runtime.record`` decides when): a unit,
a whole module call, with its arguments; or an aten op, with its non-tensor arguments and,
per tensor argument, the tape position that made it or the outside tensor itself (a copy
taken first where the op writes it)."""

from __future__ import annotations

import enum
import weakref
from typing import Any

import torch

from memplan.core.ops import is_expensive
from memplan.runtime.tape import (
    READ,
    SNAPSHOT,
    Ext,
    OpEntry,
    Pos,
    Ref,
    Scope,
    Tape,
    UnitEntry,
    UnitInfo,
    autocast_state,
    flatten_args,
    flatten_tree,
    storage_key,
    tensors,
    written_tensors,
)

# By the op's id, as tape.write_spots, which ``written_tensors`` (called first for every
# op) keeps alive: an id stays its op's.
_EXPENSIVE: dict[int, bool] = {}
# Arguments a unit may take: a call re-run in replay must compute what it computed, so it gets
# only values it cannot change (tensors are checked by version). Any other object (HF's
# DynamicCache appends the keys on every call) keeps the call on the op tape, whose replay
# touches no Python state.
PLAIN = (torch.Tensor, int, float, complex, bool, str, bytes, type(None), torch.dtype,
         torch.device, torch.layout, torch.memory_format, torch.Size, slice, type(Ellipsis),
         enum.Enum)


def unit_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any] | None:
    """A unit call's flattened arguments and their structure; None when one is not PLAIN."""
    flat, spec = flatten_tree((args, kwargs))
    if not all(isinstance(leaf, PLAIN) for leaf in flat):
        return None
    return flat, spec


def record_unit(scope: Scope, module: torch.nn.Module, path: str, info: UnitInfo,
                flat: list[Any], spec: Any) -> int:
    """Put a unit call that is starting on the scope's tape; its tape index."""
    tape = scope.tape
    e = len(tape.entries)
    entry = UnitEntry(module, path, info)
    entry.spec = spec
    refs: list[Pos] = []
    for leaf in flat:
        if not isinstance(leaf, torch.Tensor):
            entry.leaves.append(leaf)
            continue
        entry.grads.append(leaf.requires_grad)
        pos = tape.lookup(leaf)
        if pos is not None:
            entry.leaves.append(Ref(pos))
            refs.append(pos)
            note_input(scope, pos)
        else:
            entry.leaves.append(Ext(leaf, leaf._version, READ))
            tape.note_outside(leaf)
    entry.refs = tuple(refs)
    entry.grad_enabled = torch.is_grad_enabled()
    entry.autocast = autocast_state()
    entry.bound = [s.holder[s.key] for s in info.slots]
    entry.versions = [-1 if b is None else b._version for b in entry.bound]
    tape.entries.append(entry)
    extend(scope, e)
    return e


def record_op(scope: Scope, tapes: list[Tape], snaps: dict[tuple[Any, ...], torch.Tensor],
              func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              overwritten: bool = False) -> Any:
    """Run an aten op of the scope and put it on its tape. ``tapes``: the forward's tapes
    (those that read what the op writes keep a copy first); ``snaps``: the forward's copies
    of outside tensors taken before a write, one per (tensor, version); ``overwritten``: a
    later op writes its outputs in place (a drop-cheap scope recomputes it then, expensive or
    not: ``graph_arrays.held_expensive``). Every op of a scope outside units comes here, so
    the common case (no write, tensors from the tape or read as they are) takes the shortest
    path."""
    tape = scope.tape
    e = len(tape.entries)
    writes = written_tensors(func, args, kwargs)
    written: dict[int, int] | None = None
    if writes:
        written = {id(t): mode for t, mode in writes}
        for other in tapes:  # this tape and earlier ones that read what it writes
            if other.outside:
                other.keep_before_write([t for t, _ in writes], snaps)
    flat, spec = flatten_args(args, kwargs)
    leaves: list[Any] = []
    refs: list[Pos] = []
    wrote: list[Pos] = []
    ids = tape.ids
    nested = scope.parent is not None
    for leaf in flat:
        if not isinstance(leaf, torch.Tensor):
            leaves.append(leaf)
            continue
        hit = ids.get(id(leaf))
        if hit is not None and hit[1]() is leaf:  # Tape.lookup, inlined
            pos = hit[0]
            leaves.append(Ref(pos))
            refs.append(pos)
            if written is not None and id(leaf) in written:
                wrote.append(pos)
            if nested:
                note_input(scope, pos)
            continue
        mode = READ if written is None else written.get(id(leaf), READ)
        if mode == SNAPSHOT:
            leaves.append(_snapshot(tape, snaps, leaf))
        else:
            leaves.append(Ext(leaf, leaf._version, mode))
            if mode == READ:
                tape.outside.append(leaf)  # Tape.note_outside
    out = func(*args, **kwargs)
    expensive = expensive_op(func) and not overwritten
    held = expensive and scope.template.kind == "drop-cheap"
    for k, o in enumerate(tensors(out)):
        ids[id(o)] = ((e, k), weakref.ref(o))  # Tape.register
        if held:
            tape.held[(e, k)] = o.detach()
    tape.entries.append(OpEntry(func, spec, leaves, tuple(refs), expensive, tuple(wrote)))
    extend(scope, e)
    return out


def expensive_op(func: Any) -> bool:
    """``core.ops.is_expensive`` of an aten op, cached (it runs per recorded op)."""
    expensive = _EXPENSIVE.get(id(func))
    if expensive is None:
        expensive = _EXPENSIVE[id(func)] = is_expensive(str(func))
    return expensive


def _snapshot(tape: Tape, snaps: dict[tuple[Any, ...], torch.Tensor], leaf: torch.Tensor) -> Ext:
    """An outside tensor the op writes in place: replay reads its value from before, and so
    does every earlier read of it at that version."""
    key = (storage_key(leaf), leaf._version)
    snap = snaps.get(key)
    if snap is None:
        snap = snaps[key] = leaf.detach().clone()
    tape.snaps[key] = snap
    return Ext(snap, -1, SNAPSHOT)


def extend(scope: Scope, e: int) -> None:
    """Entry ``e`` belongs to the scope and to every scope around it."""
    s: Scope | None = scope
    while s is not None:
        s.last_entry = e
        s = s.parent


def note_input(scope: Scope, pos: Pos) -> None:
    """A nested scope reading a tape value made before it gets that value from its parent's
    replay (and so do its ancestors up to the one that made it)."""
    s: Scope | None = scope
    while s is not None and s.parent is not None and pos[0] < s.first_entry:
        s.inputs[pos] = None
        s = s.parent
