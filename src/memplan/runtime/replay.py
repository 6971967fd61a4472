"""Runs a model's own forward under a Plan: the paper's mirror nodes (Alg. 2) in eager PyTorch.

The user's forward code runs unchanged. A ``TorchDispatchMode`` numbers its ops exactly as
capture did, so the plan's stage boundaries (forward op indices) are found inside arbitrary
code: residual blocks, LSTM steps, skip connections. Ops inside a recomputed scope are also
written to a tape: the aten op, its non-tensor arguments, and for each tensor argument either
the tape position that made it or, for a tensor from outside the scope, the tensor itself
(the scope's kept input, Alg. 1). Saved-tensor hooks hand autograd a ``Handle`` instead of
such a scope's tensors, so they are freed after the forward; when backward first unpacks one,
the scope's ops are replayed from its kept inputs, with the RNG state it started with, and
every handle of the scope gets its value back.

* ``region``: nothing of the scope is kept; its replay runs all its ops, including those of
  nested regions, whose inputs it hands over for their own replay later (Sec. 4.4).
* ``drop-cheap``: outputs of expensive ops (conv, matmul) are kept; replay runs only the
  cheap ops (Sec. 4.2).

Replay never touches state outside the tape: an op that writes an outside tensor (BatchNorm's
running statistics, ``num_batches_tracked``) writes a copy, so recomputation does not update
them a second time (``torch.utils.checkpoint`` does).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from memplan.core.ops import is_expensive
from memplan.errors import ReplayError
from memplan.runtime.layout import Layout, Template
from memplan.tracing.tracer import is_counted

Pos = tuple[int, int]  # (tape entry, output index)


# --- one forward's tape ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ref:
    pos: Pos


@dataclass(frozen=True)
class _Ext:
    tensor: torch.Tensor
    writable: bool  # the op writes it: replay writes a copy


@dataclass
class _Entry:
    func: Any
    spec: Any
    leaves: list[Any]
    refs: tuple[Pos, ...]
    expensive: bool


class Handle:
    """What autograd keeps for a tensor of a recomputed scope (``pos`` on the tape)."""

    __slots__ = ("__weakref__", "owner", "pos", "value")

    def __init__(self, owner: Scope, pos: Pos) -> None:
        self.owner = owner
        self.pos = pos
        self.value: torch.Tensor | None = None


@dataclass(eq=False)
class Scope:
    """A template's instance in one forward: a slice of its top-level scope's tape."""

    template: Template
    parent: Scope | None
    tape: Tape
    first_entry: int
    rng_state: tuple[torch.Tensor, torch.Tensor | None]
    last_entry: int = -1
    inputs: dict[Pos, None] = field(default_factory=dict)  # tape values from before it
    stash: dict[Pos, torch.Tensor] | None = None  # their values, given by the parent's replay
    handles: list[weakref.ref[Handle]] = field(default_factory=list)
    # Weak: a nested scope lives while autograd holds one of its handles (or a nested scope
    # of its own does); a strong link back would make a cycle that outlives the step.
    children: list[weakref.ref[Scope]] = field(default_factory=list)
    done: bool = False


@dataclass(eq=False)
class Tape:
    entries: list[_Entry] = field(default_factory=list)
    held: dict[Pos, torch.Tensor] = field(default_factory=dict)  # drop-cheap's kept outputs
    registry: dict[tuple[Any, ...], tuple[Pos, Any]] = field(default_factory=dict)

    def lookup(self, t: torch.Tensor) -> Pos | None:
        hit = self.registry.get(_key(t))
        if hit is None or hit[1]() is None:  # that storage died: another tensor reuses the key
            return None
        return hit[0]

    def register(self, t: torch.Tensor, pos: Pos) -> None:
        storage = t.untyped_storage()
        self.registry[_key(t)] = (pos, weakref.ref(storage))


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _rng(state: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
    """Run with the RNG as the scope's first forward found it; restore it afterwards."""
    saved = _rng_state()
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        if saved[1] is not None:
            torch.cuda.set_rng_state(saved[1])


# --- the forward -------------------------------------------------------------------------------


class StepState:
    """One planned forward: follows the stages by module calls, records tapes inside
    recompute scopes (only there is a dispatch mode on), makes handles."""

    def __init__(self, lay: Layout, protected: set[int]) -> None:
        self.layout = lay
        self.stage = 0
        self.calls: dict[str, int] = {}  # calls of stage-ending modules returned so far
        self.protected = protected  # ids of parameters and buffers: never copied at record
        self.top: Scope | None = None
        self.scopes: dict[int, Scope] = {}  # template index -> instance (this forward)
        self.recorded_ops = 0
        self.mode: PlanMode | None = None
        self.ops_left: int | None = None  # ops until the current stage's op boundary

    @property
    def current(self) -> Template | None:
        stages = self.layout.template_of_stage
        return stages[self.stage] if self.stage < len(stages) else None

    @property
    def finished(self) -> bool:
        """Whether every stage boundary of the plan was seen."""
        return self.stage >= len(self.layout.end_calls) - 1

    def start(self) -> None:
        self._count_stage()
        self._sync_mode()

    def stop(self) -> None:
        self.close_top()
        if self.mode is not None:
            self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self.mode = None
        self.scopes.clear()  # from now on only autograd's handles keep scopes alive

    def on_call_end(self, path: str) -> None:
        """A stage-ending module's call returned: maybe the next stage begins. Autograd saved
        the last op's outputs before this, and saves the next op's inputs after it."""
        n = self.calls.get(path, 0) + 1
        self.calls[path] = n
        ends = self.layout.end_calls
        if self.stage < len(ends) and ends[self.stage] == (path, n):
            self.stage += 1
            self._count_stage()
            self._sync_mode()

    def _count_stage(self) -> None:
        ops = self.layout.end_ops
        self.ops_left = ops[self.stage] if self.stage < len(ops) else None

    def _sync_mode(self) -> None:
        """Close the top scope when the stage leaves it; the dispatch mode on while a scope
        records or a stage counts its ops (only here, never inside a dispatch)."""
        t = self.current
        if t is None or (self.top is not None and self.top.template is not _root(t)):
            self.close_top()
        needed = t is not None or self.ops_left is not None
        if needed and self.mode is None:
            self.mode = PlanMode(self)
            self.mode.__enter__()  # type: ignore[no-untyped-call]
        elif not needed and self.mode is not None:
            self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self.mode = None

    def scope_for(self, t: Template) -> Scope:
        s = self.scopes.get(t.index)
        if s is not None:
            return s
        parent = self.scope_for(t.parent) if t.parent is not None else None
        if parent is None:
            tape = Tape()
        else:
            tape = parent.tape
        s = Scope(t, parent, tape, len(tape.entries), _rng_state())
        if parent is not None:
            parent.children.append(weakref.ref(s))
        else:
            self.top = s
        self.scopes[t.index] = s
        return s

    def close_top(self) -> None:
        if self.top is not None:
            self.top.tape.registry.clear()  # later scopes keep this one's outputs as inputs
            self.top = None

    # the dispatch side

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t = self.current
        if t is None:  # a kept stage counting its ops, or a hook left the mode on
            out = func(*args, **kwargs)
        else:
            self.recorded_ops += 1
            out = self._record(self.scope_for(t), func, args, kwargs)
        if self.ops_left is not None and is_counted(func):
            self.ops_left -= 1
            if self.ops_left == 0:  # an op boundary: the next stage begins with the next op
                self.stage += 1
                self._count_stage()
                t = self.current
                if t is None or (self.top is not None and self.top.template is not _root(t)):
                    self.close_top()  # (the mode stays on until a hook or stop turns it off)
        return out

    def _record(self, scope: Scope, func: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        tape = scope.tape
        e = len(tape.entries)
        written = _written_args(func, args, kwargs)
        flat, spec = _flatten(args, kwargs)
        leaves: list[Any] = []
        refs: list[Pos] = []
        for leaf in flat:
            if not isinstance(leaf, torch.Tensor):
                leaves.append(leaf)
                continue
            pos = tape.lookup(leaf)
            if pos is not None:
                leaves.append(_Ref(pos))
                refs.append(pos)
                _note_input(scope, pos)
                continue
            writes = id(leaf) in written
            if writes and id(leaf) not in self.protected:
                # An outside activation written in place: replay must read its old value.
                leaves.append(_Ext(leaf.detach().clone(), True))
            else:
                leaves.append(_Ext(leaf, writes))
        out = func(*args, **kwargs)
        expensive = _EXPENSIVE.get(func)
        if expensive is None:
            expensive = _EXPENSIVE[func] = is_expensive(str(func))
        for k, o in enumerate(_tensors(out)):
            tape.register(o, (e, k))
            if expensive and scope.template.kind == "drop-cheap":
                tape.held[(e, k)] = o
        tape.entries.append(_Entry(func, spec, leaves, tuple(refs), expensive))
        s: Scope | None = scope
        while s is not None:
            s.last_entry = e
            s = s.parent
        return out

    # the autograd side

    def pack(self, t: torch.Tensor) -> Any:
        tmpl = self.current
        top = self.top
        if tmpl is None or top is None or _root(tmpl) is not top.template:
            return t  # a kept stage, or the input of a scope that has not started yet
        pos = top.tape.lookup(t)
        if pos is None or pos in top.tape.held:
            return t  # from outside the scope, or kept by drop-cheap
        while tmpl.index not in self.scopes and tmpl.parent is not None:
            tmpl = tmpl.parent  # a nested scope whose first op is about to run
        scope = self.scopes[tmpl.index]
        while scope.parent is not None and pos[0] < scope.first_entry:
            scope = scope.parent  # made before this nested scope: its parent replays it
        h = Handle(scope, pos)
        scope.handles.append(weakref.ref(h))
        return h


def _root(t: Template) -> Template:
    while t.parent is not None:
        t = t.parent
    return t


def _note_input(scope: Scope, pos: Pos) -> None:
    """A nested scope reading a tape value made before it gets that value from its parent's
    replay (and so do its ancestors up to the one that made it)."""
    s: Scope | None = scope
    while s is not None and s.parent is not None and pos[0] < s.first_entry:
        s.inputs[pos] = None
        s = s.parent


def unpack(obj: Any) -> torch.Tensor:
    if not isinstance(obj, Handle):
        return obj  # type: ignore[no-any-return]
    if obj.value is None:
        materialise(obj.owner)
        if obj.value is None:
            raise ReplayError(
                "memplan: a recomputed tensor was requested after its scope was released "
                "(backward through the same graph twice without retain_graph=True?)."
            )
    return obj.value


def materialise(scope: Scope) -> None:
    """Replay the scope's ops from its kept inputs; give every live handle its value and every
    nested scope its inputs (Alg. 2's mirror nodes, run on first use in backward)."""
    if scope.done:
        return
    if scope.parent is not None:
        materialise(scope.parent)
        if scope.stash is None:
            raise ReplayError("memplan: internal error: nested scope has no inputs")
    tape = scope.tape
    drop = scope.template.kind == "drop-cheap"
    handles = [h for h in (r() for r in scope.handles) if h is not None]
    want: dict[Pos, None] = {h.pos: None for h in handles}
    children = [c for c in (r() for r in scope.children) if c is not None]
    for child in children:
        want.update(child.inputs)
    span = range(scope.first_entry, scope.last_entry + 1)
    last_use: dict[Pos, int] = {}
    for e in span:
        entry = tape.entries[e]
        if not (drop and entry.expensive):
            for p in entry.refs:
                last_use[p] = e
    env: dict[Pos, torch.Tensor] = dict(scope.stash or {})
    if drop:
        env.update(tape.held)
    kept: dict[Pos, torch.Tensor] = {p: env[p] for p in want if p in env}
    with _rng(scope.rng_state), _no_autocast():
        for e in span:
            entry = tape.entries[e]
            if drop and entry.expensive:
                continue
            args, kwargs = _rebuild(entry, env)
            out = entry.func(*args, **kwargs)
            for k, o in enumerate(_tensors(out)):
                p = (e, k)
                if p in want:
                    kept[p] = o
                if p in last_use:
                    env[p] = o
            for p in entry.refs:
                if last_use.get(p) == e:
                    env.pop(p, None)
    for h in handles:
        h.value = kept[h.pos]
    for child in children:
        child.stash = {p: kept[p] for p in child.inputs}
    scope.done = True
    scope.stash = None
    if drop:
        tape.held.clear()  # what autograd still needs, it keeps itself


def _rebuild(entry: _Entry, env: dict[Pos, torch.Tensor]) -> tuple[Any, dict[str, Any]]:
    vals: list[Any] = []
    for leaf in entry.leaves:
        if isinstance(leaf, _Ref):
            vals.append(env[leaf.pos])
        elif isinstance(leaf, _Ext):
            vals.append(leaf.tensor.clone() if leaf.writable else leaf.tensor)
        else:
            vals.append(leaf)
    return _unflatten(vals, entry.spec)


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    """The tape holds the ops autocast already chose (casts included): replay them as they are."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if device == "cpu" or torch.cuda.is_available():
                stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) or o is None
                                              for o in out):
        return [o for o in out if o is not None]
    flat, _ = tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor)]


# Aten op arguments nest at most one level (Tensor[], Tensor?[], int[]): flatten them by hand,
# pytree's general walk was most of the runtime's own cost.
_FLAT = "flat"


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    leaves: list[Any] = []
    shape: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            if any(isinstance(b, (list, tuple, dict)) for b in a):
                return _pytree_flatten(args, kwargs)
            shape.append((type(a), len(a)))
            leaves.extend(a)
        elif isinstance(a, dict):
            return _pytree_flatten(args, kwargs)
        else:
            shape.append(None)
            leaves.append(a)
    if kwargs:
        if any(isinstance(v, (list, tuple, dict)) for v in kwargs.values()):
            return _pytree_flatten(args, kwargs)
        leaves.extend(kwargs.values())
    return leaves, (_FLAT, tuple(shape), tuple(kwargs))


def _pytree_flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    return tree_flatten((args, kwargs))


def _unflatten(vals: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(spec, tuple) and spec and spec[0] == _FLAT:
        _, shape, keys = spec
        args: list[Any] = []
        i = 0
        for item in shape:
            if item is None:
                args.append(vals[i])
                i += 1
            else:
                kind, n = item
                args.append(kind(vals[i : i + n]))
                i += n
        return tuple(args), dict(zip(keys, vals[i:]))
    a, k = tree_unflatten(vals, spec)
    return tuple(a), dict(k)


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}
_EXPENSIVE: dict[Any, bool] = {}


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    spots = _WRITES.get(func)
    if spots is None:
        # native_batch_norm and the cudnn/miopen variants write the running statistics
        # without saying so in their schemas.
        bn = "batch_norm" in func._schema.name
        spots = _WRITES[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments)
            if (a.alias_info is not None and a.alias_info.is_write)
            or (bn and a.name in ("running_mean", "running_var"))
        )
    out: set[int] = set()
    for i, name in spots:
        val = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(val, torch.Tensor):
            out.add(id(val))
    return out


class PlanMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Numbers the forward's ops and records the plan's scopes (see the module docstring)."""

    def __init__(self, state: StepState) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func.namespace == "prim":
            return func(*args, **(kwargs or {}))
        return self.state.run_op(func, args, kwargs or {})


@contextlib.contextmanager
def planned(state: StepState) -> Iterator[None]:
    """Run a forward under the plan: stage tracking, tapes and saved-tensor handles."""
    with torch.autograd.graph.saved_tensors_hooks(state.pack, unpack):
        state.start()
        try:
            yield
        finally:
            state.stop()
