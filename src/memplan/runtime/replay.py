"""Replay in backward: when autograd first unpacks a handle of a recompute scope, the scope's
tape is run again from its kept inputs (Alg. 2's mirror nodes), with the RNG state it started
with: aten ops as recorded, units by calling their module again, up to where it has all it
gives back (early stop, ``_entries_to_run``). Every live handle gets its
value, every nested scope its inputs. Never with a changed tensor: an outside tensor is used
at the version the scope read it, or its copy from before a recorded write, or the replay
raises a ReplayError naming it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memplan.errors import ReplayError
from memplan.runtime.handles import Handle
from memplan.runtime.tape import (
    DEVICES,
    Ext,
    OpEntry,
    Pos,
    Ref,
    Scope,
    Tape,
    UnitEntry,
    is_view,
    rng_state,
    tensors,
    unflatten_args,
)
from memplan.runtime.unit_replay import ext_value, run_unit


def unpack(obj: Any) -> torch.Tensor:
    if not isinstance(obj, Handle):
        return obj  # type: ignore[no-any-return]
    values = obj.owner.table.values
    value = values[obj.row]
    if value is None:
        materialise(obj.owner)
        value = values[obj.row]
        if value is None:
            raise ReplayError(
                "memplan: a recomputed tensor was requested after its scope was released "
                "(backward through the same graph twice without retain_graph=True?)."
            )
    return value


# --- replay ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _rng(state: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
    """Run with the RNG as the scope's first forward found it; restore it afterwards."""
    saved = rng_state()
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        if saved[1] is not None:
            torch.cuda.set_rng_state(saved[1])


_REPLAYING = [0]  # replays in progress: module hooks of the plan do nothing during them


def replaying() -> bool:
    return _REPLAYING[0] > 0


def materialise(scope: Scope) -> None:
    """Replay the scope's entries from its kept inputs; give every live handle its value and
    every nested scope its inputs (Alg. 2's mirror nodes, run on first use in backward).
    Under ``create_graph`` (grad enabled here) the replay records its own graph, and a
    drop-cheap scope replays its expensive ops too (its kept outputs have no history)."""
    if scope.done:
        return
    if scope.parent is not None:
        materialise(scope.parent)
        if scope.stash is None:
            raise ReplayError("memplan: internal error: nested scope has no inputs")
    wants = _Wants(scope)
    kept = _replay(scope, wants)
    table = scope.table
    for row in wants.value_rows:
        if table.alive[row]:
            table.values[row] = kept[table.positions[row]]
    for child in wants.children:
        child.stash = {p: kept[p] for p in child.inputs}
    scope.done = True
    scope.stash = None
    if scope.template.kind == "drop-cheap":
        scope.tape.held.clear()  # what autograd still needs, its handles hold


class _Wants:
    """What a scope's replay gives back: the live handles (values on the tape, and the saved
    tensors of unit entries: ``units``, entry -> first row, where one is alive) and the
    nested scopes' inputs."""

    def __init__(self, scope: Scope) -> None:
        table = scope.table
        self.value_rows = [row for row in table.positions if table.alive[row]]
        self.values: dict[Pos, None] = {table.positions[row]: None for row in self.value_rows}
        self.units: dict[int, int] = {}
        for e, first in table.units:
            entry = scope.tape.entries[e]
            assert isinstance(entry, UnitEntry)
            if table.any_alive(first, entry.n_saved):
                self.units[e] = first
        self.children = [c for c in (r() for r in scope.children) if c is not None]
        for child in self.children:
            self.values.update(child.inputs)


def _replay(scope: Scope, wants: _Wants) -> dict[Pos, torch.Tensor]:
    """Run the scope's entries up to its early stop; the wanted values. Units' saved tensors
    go to their handles as each unit runs; every value dies after its last use."""
    tape = scope.tape
    grad = torch.is_grad_enabled()
    drop = scope.template.kind == "drop-cheap" and not grad
    want, units, table = wants.values, wants.units, scope.table
    run, stop_unit = _entries_to_run(tape, scope.first_entry, scope.last_entry, want, units,
                                     drop)
    last_use: dict[Pos, int] = {}
    for e in run:
        for p in tape.entries[e].refs:
            last_use[p] = e
    env: dict[Pos, torch.Tensor] = dict(scope.stash or {})
    if drop:
        env.update(tape.held)
    kept: dict[Pos, torch.Tensor] = {p: env[p] for p in want if p in env}
    _REPLAYING[0] += 1
    try:
        with _rng(scope.rng_state), _no_autocast():
            for e in run:
                entry = tape.entries[e]
                if isinstance(entry, OpEntry):
                    args, kwargs = _rebuild(entry, env, tape)
                    outs = tensors(entry.func(*args, **kwargs))
                    del args, kwargs  # inputs at their last use die now, not in a next unit
                else:
                    first = units.get(e)
                    outs, saved = run_unit(entry, env, tape, first is not None, grad,
                                            e == stop_unit)
                    if first is not None:
                        table.give(first, saved)
                    del saved
                _keep(outs, e, want, kept, last_use, env)
                del outs  # dead outputs die now, not during the next entry
                for p in entry.refs:
                    if last_use.get(p) == e:
                        env.pop(p, None)
    finally:
        _REPLAYING[0] -= 1
    return kept


def _entries_to_run(tape: Tape, first: int, last: int, want: dict[Pos, None],
                    unit_saves: dict[int, int], drop: bool) -> tuple[list[int], int]:
    """The entries a replay runs, and the unit (-1: none) that stops at its last save.

    Like torch's non-reentrant checkpoint, a replay stops once it has everything it gives
    back (``core.scopes`` models the same stop): it runs the entries up to the last one
    that makes or writes in place a storage it needs (a wanted tensor's, a unit's saved
    tensors; a scan's output written a slice at a time), then only the views after it that
    give wanted tensors (of storages made before, or outside tensors).
    That last entry, a unit none of whose outputs is needed, stops at its last save, before
    the rest of its call runs (autograd saves an op's inputs before running it)."""
    end = -1
    bases: set[int] = set()
    for p in want:
        b = _base(tape, p[0], first, drop)
        bases.add(b)
        end = max(end, b)
    for e in unit_saves:
        end = max(end, e)
    made = {b for b in bases if b >= 0}  # storages made in the scope (others: as they are)
    for e in range(max(first, end + 1), last + 1):
        entry = tape.entries[e]
        if (isinstance(entry, OpEntry) and entry.writes and not (drop and entry.expensive)
                and any(_base(tape, p[0], first, drop) in made for p in entry.writes)):
            end = e
    views: set[int] = set()
    for p in want:
        e = p[0]
        while e > end:  # a chain of views after the last storage made (see _base)
            entry = tape.entries[e]
            if drop and entry.expensive:
                break  # its output is held
            views.add(e)
            leaf = entry.leaves[0]
            if not isinstance(leaf, Ref):
                break
            e = leaf.pos[0]
    run = [e for e in range(first, end + 1)
           if not (drop and tape.entries[e].expensive) and not _scalar_read(tape.entries[e])]
    run += sorted(views)
    stop = end if end >= first and isinstance(tape.entries[end], UnitEntry) \
        and end in unit_saves and end not in bases else -1
    return run, stop


def _scalar_read(entry: OpEntry | UnitEntry) -> bool:
    """``t.item()``: a number the forward's Python used, baked into the ops after it as
    they were recorded; no tensor to remake. Not replayed (on fake tensors, as in a
    simulated step, it could not be: its value is the data's)."""
    if not isinstance(entry, OpEntry):
        return False
    hit = _SCALAR_READS.get(entry.func)
    if hit is None:
        hit = _SCALAR_READS[entry.func] = torch.Tag.data_dependent_output in entry.func.tags
    return hit


_SCALAR_READS: dict[Any, bool] = {}  # per aten op: read once


def _base(tape: Tape, e: int, first: int, drop: bool) -> int:
    """The entry that made the storage of entry ``e``'s output, following views (ops whose
    outputs all alias their first argument and that write nothing); -1: made before the
    scope, outside it, or by an expensive op a drop-cheap replay does not run."""
    while e >= first:
        entry = tape.entries[e]
        if not isinstance(entry, OpEntry):
            return e
        if drop and entry.expensive:
            return -1
        if not is_view(entry.func):
            return e
        leaf = entry.leaves[0]
        if not isinstance(leaf, Ref):
            return -1
        e = leaf.pos[0]
    return -1


def _keep(outs: list[torch.Tensor], e: int, want: dict[Pos, None],
          kept: dict[Pos, torch.Tensor], last_use: dict[Pos, int],
          env: dict[Pos, torch.Tensor]) -> None:
    for k, o in enumerate(outs):
        p = (e, k)
        if p in want:
            kept[p] = o
        if p in last_use:
            env[p] = o


def _rebuild(entry: OpEntry, env: dict[Pos, torch.Tensor], tape: Tape
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    vals: list[Any] = []
    for leaf in entry.leaves:
        if isinstance(leaf, Ref):
            vals.append(env[leaf.pos])
        elif isinstance(leaf, Ext):
            vals.append(ext_value(leaf, tape, entry.func))
        else:
            vals.append(leaf)
    return unflatten_args(vals, entry.spec)




@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    """The tape holds the ops autocast already chose (casts included): replay them as they are."""
    with contextlib.ExitStack() as stack:
        for device in DEVICES:
            if torch.is_autocast_enabled(device):  # backward runs without autocast, mostly
                stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield
