"""Runs a model's own forward under a Plan: the paper's mirror nodes (Alg. 2) in eager PyTorch.

The user's forward code runs unchanged. Forward hooks on the modules whose calls end the plan's
stages follow the stages. Kept stages run plainly: no hook, no mode, autograd saves natively.
While a recompute scope is current, saved-tensor hooks hand autograd a ``Handle`` instead of
the scope's tensors, so they are freed after the forward; when backward first unpacks one, the
scope is replayed from its kept inputs (Alg. 1), with the RNG state it started with, and every
handle of the scope gets its value back. A scope's forward is written to a tape of two kinds
of entries:

* a *unit*: a whole module call inside the scope (a residual unit, a transformer block, an LSTM
  step), found from the fake forward at apply time. It runs with no dispatch mode; its entry
  keeps the call's arguments (tape positions, or outside tensors and their versions); its
  saved tensors get handles by the order autograd saves them. Replay re-runs the call, as
  ``torch.utils.checkpoint`` does, with the parameters and buffers it ran with, BatchNorm
  statistics written to copies, and checks that it saves as many tensors as it did.
* an *op*: an aten op outside units (glue code, and every op of a drop-cheap stage), recorded
  by a ``TorchDispatchMode`` with its non-tensor arguments and, per tensor argument, the tape
  position that made it or the outside tensor itself.

* ``region``: nothing of the scope is kept; its replay runs all its entries, including those of
  nested regions, whose inputs it hands over for their own replay later (Sec. 4.4).
* ``drop-cheap``: outputs of expensive ops (conv, matmul) are kept; replay runs only the
  cheap ops (Sec. 4.2).

Replay never computes with a changed tensor: an outside tensor is read at the version it had
when the scope read it (a copy taken when an op of a scope writes it, or an error naming it),
and writes of outside tensors go to copies, so recomputation does not update BatchNorm's
running statistics a second time (``torch.utils.checkpoint`` does). Nothing of a forward
outlives its graph: handles are the only link from autograd to a scope, and nothing a scope
holds leads back to the graph's nodes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

from memplan import chain as C
from memplan import units as U
from memplan.errors import MemplanError
from memplan.plan import Plan

Pos = tuple[int, int]  # (tape entry, output index); for a unit's saved tensors (entry, k-th save)


# --- what the plan prescribes, per forward op --------------------------------------------------


@dataclass(eq=False)
class Template:
    """A recompute scope of the plan (a region, nested in ``parent``, or a drop-cheap stage)."""

    kind: str  # "region" | "drop-cheap"
    parent: Template | None
    index: int = 0


@dataclass
class Layout:
    """The plan as the runtime needs it, per stage of the model's forward."""

    template_of_stage: list[Template | None]  # the innermost recompute scope of each stage
    # Stage s ends when the end_calls[s][1]-th call of module end_calls[s][0] returns (None:
    # the end of the forward). Module calls, not op counts, mark boundaries at run time, so
    # kept stages run with no dispatch mode at all.
    end_calls: list[tuple[str, int] | None]
    templates: list[Template]
    units: dict[str, frozenset[int]] = field(default_factory=dict)  # path -> call numbers

    @property
    def boundary_modules(self) -> tuple[str, ...]:
        return tuple(sorted({e[0] for e in self.end_calls if e is not None}))


def layout(plan: Plan, n_ops: int, call_ends: dict[str, list[int]],
           calls: list[U.Call] | None = None, values: U.Values | None = None) -> Layout:
    """Index the plan's schedule by stage. ``n_ops``: ops of the model's forward;
    ``call_ends``: for each stage-ending module, the op count at the end of each of its calls;
    ``calls`` and ``values``: the forward's module calls and value lifetimes, from which the
    units of flat top-level regions are chosen (all from a fake forward,
    ``apply.forward_targets``)."""
    stages = [st for st in plan.stages if st.first_op < n_ops]
    scope: list[Template | None] = [None] * len(stages)
    templates: list[Template] = []

    def walk(items: tuple[C.Item, ...], parent: Template | None) -> None:
        for it in items:
            if isinstance(it, C.Keep):
                continue
            lo, hi = (it.stage, it.stage) if isinstance(it, C.DropCheap) else (it.start, it.end)
            if hi >= len(stages) or plan.stages[hi].last_op >= n_ops:
                raise MemplanError(
                    f"the plan recomputes stages {lo}..{hi}, which reach past the model's "
                    f"forward ({n_ops} ops; the rest is the loss, which runs outside the "
                    "model): make the plan with memplan.plan(...) for this model and loss."
                )
            kind = "drop-cheap" if isinstance(it, C.DropCheap) else "region"
            t = Template(kind, parent, len(templates))
            templates.append(t)
            for k in range(lo, hi + 1):
                scope[k] = t
            if isinstance(it, C.Region):
                walk(it.body, t)

    walk(plan.schedule, None)
    end_calls: list[tuple[str, int] | None] = []
    for st in stages:
        if st.last_op >= n_ops - 1:
            end_calls.append(None)  # the forward's own end
            continue
        ends = call_ends.get(st.module, [])
        if st.last_op + 1 not in ends:
            raise MemplanError(
                f"stage {st.index} of the plan ends when a call of module '{st.module}' "
                f"returns after op {st.last_op}, but no call of it returned there in this "
                "model's forward (is it called through .forward() rather than as a module?). "
                "Make the plan for this model with memplan.plan(...)."
            )
        end_calls.append((st.module, ends.index(st.last_op + 1) + 1))
    units: dict[str, frozenset[int]] = {}
    if calls and values is not None:
        units = U.choose(_flat_regions(stages, scope, templates), calls, values)
    return Layout(scope, end_calls, templates, units)


def _flat_regions(stages: list[Any], scope: list[Template | None], templates: list[Template]
                  ) -> list[tuple[int, int]]:
    """(first op, last op) of each top-level region with no scope nested in it. A nested
    scope's entries are also replayed by its parent, for outputs only, with nothing saved:
    there a re-run call would keep what the plan's model frees."""
    nested = {t.parent.index for t in templates if t.parent is not None}
    spans: dict[int, tuple[int, int]] = {}
    for st, t in zip(stages, scope):
        if t is None or t.kind != "region" or t.parent is not None or t.index in nested:
            continue
        lo, _ = spans.get(t.index, (st.first_op, st.last_op))
        spans[t.index] = (lo, st.last_op)
    return [spans[i] for i in sorted(spans)]


# --- one forward's tape ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ref:
    pos: Pos


READ, WRITE_ONLY, SNAPSHOT = 0, 1, 2


class _Ext:
    """A tensor from outside the scope: read at ``version`` (READ); BatchNorm statistics the
    op only writes (WRITE_ONLY: replay writes a copy); or the copy of a tensor the op writes,
    taken before it did (SNAPSHOT: replay writes a copy of it)."""

    __slots__ = ("mode", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int, mode: int) -> None:
        self.tensor = tensor
        self.version = version
        self.mode = mode


class _Op:
    """An aten op recorded on the tape."""

    __slots__ = ("expensive", "func", "leaves", "refs", "spec")

    def __init__(self, func: Any, spec: Any, leaves: list[Any], refs: tuple[Pos, ...],
                 expensive: bool) -> None:
        self.func = func
        self.spec = spec
        self.leaves = leaves
        self.refs = refs
        self.expensive = expensive


@dataclass(eq=False)
class Slot:
    """A parameter or buffer of a unit's module tree: where it is bound, its name, and the
    index of its BatchNorm module when it is a running statistic."""

    holder: dict[str, Any]  # the module's _parameters or _buffers
    key: str
    name: str
    bn: int  # index into the unit's BatchNorm modules, or -1


@dataclass(eq=False)
class UnitInfo:
    """Per unit module: its parameters and buffers, and its BatchNorm modules."""

    slots: list[Slot]
    norms: list[torch.nn.Module]


def unit_info(module: torch.nn.Module, path: str) -> UnitInfo:
    norms: list[torch.nn.Module] = []
    slots: list[Slot] = []
    seen: set[tuple[int, str]] = set()
    for prefix, m in module.named_modules(prefix=path, remove_duplicate=False):
        bn = -1
        if isinstance(m, torch.nn.modules.batchnorm._NormBase):
            bn = len(norms)
            norms.append(m)
        for holder, is_buffer in ((m._parameters, False), (m._buffers, True)):
            for key in holder:
                if (id(holder), key) in seen:
                    continue
                seen.add((id(holder), key))
                stat = is_buffer and key in ("running_mean", "running_var", "num_batches_tracked")
                slots.append(Slot(holder, key, f"{prefix}.{key}" if prefix else key,
                                  bn if stat else -1))
    return UnitInfo(slots, norms)


class _Call:
    """A unit: a module call recorded whole, replayed by calling the module again."""

    __slots__ = ("autocast", "bn_training", "bound", "grad_enabled", "grads", "info", "leaves",
                 "module", "n_outputs", "n_saved", "path", "refs", "spec", "versions")

    def __init__(self, module: torch.nn.Module, path: str, info: UnitInfo) -> None:
        self.module = module
        self.path = path
        self.info = info
        self.spec: Any = None
        self.leaves: list[Any] = []
        self.refs: tuple[Pos, ...] = ()
        self.grads: list[bool] = []  # requires_grad of each tensor argument
        self.grad_enabled = True
        self.autocast: tuple[tuple[str, torch.dtype], ...] = ()
        self.bound: list[Any] = []  # the tensors bound to info.slots during the call
        self.versions: list[int] = []
        self.bn_training: tuple[bool, ...] = ()
        self.n_saved = 0
        self.n_outputs = 0

    @property
    def expensive(self) -> bool:
        return False


class Handle:
    """What autograd keeps for a tensor of a recomputed scope: ``pos`` on the tape, or for a
    unit's saved tensor (entry, k) with ``saved`` set."""

    __slots__ = ("__weakref__", "owner", "pos", "saved", "value")

    def __init__(self, owner: Scope, pos: Pos, saved: bool = False) -> None:
        self.owner = owner
        self.pos = pos
        self.saved = saved
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
    snaps: dict[tuple[Any, ...], torch.Tensor]  # (key, version) -> value before a write
    namer: Namer
    entries: list[_Op | _Call] = field(default_factory=list)
    held: dict[Pos, torch.Tensor] = field(default_factory=dict)  # drop-cheap's kept outputs
    # The tensors entries made, by identity (ops and autograd hand the same tensor objects
    # on: views and in-place results included); weak, so they die when the user drops them.
    ids: dict[int, tuple[Pos, Any]] = field(default_factory=dict)

    def lookup(self, t: torch.Tensor) -> Pos | None:
        hit = self.ids.get(id(t))
        if hit is not None and hit[1]() is t:
            return hit[0]
        return None

    def register(self, t: torch.Tensor, pos: Pos) -> None:
        self.ids[id(t)] = (pos, weakref.ref(t))

    def clear_index(self) -> None:
        self.ids.clear()


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class Namer:
    """Names a tensor for an error message: the model's input or its parameter/buffer name."""

    def __init__(self, model: torch.nn.Module | None, inputs: dict[int, str]) -> None:
        self.model = weakref.ref(model) if model is not None else None
        self.inputs = inputs

    def __call__(self, t: torch.Tensor) -> str:
        label = self.inputs.get(id(t))
        if label is not None:
            return label
        model = self.model() if self.model is not None else None
        if model is not None:
            for name, v in list(model.named_parameters()) + list(model.named_buffers()):
                if v is t:
                    return f"'{name}'"
        return f"a tensor of shape {list(t.shape)} ({str(t.dtype).removeprefix('torch.')})"


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


_DEVICES = ("cpu", "cuda")


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    return tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICES if torch.is_autocast_enabled(d))


# --- the forward -------------------------------------------------------------------------------


class _Unit:
    """The unit call running now: no dispatch mode; its saved tensors are counted."""

    __slots__ = ("count", "depth", "entry", "path", "scope")

    def __init__(self, scope: Scope, entry: int, path: str) -> None:
        self.scope = scope
        self.entry = entry
        self.path = path
        self.count = 0
        self.depth = 0  # calls of the same module inside it (recursion)


class StepState:
    """One planned forward: follows the stages by module calls; while a recompute scope is
    current, sets the saved-tensor hooks and, outside units, the dispatch mode that records
    ops; records units; makes handles."""

    def __init__(self, lay: Layout, infos: Callable[[str, torch.nn.Module], UnitInfo],
                 namer: Namer) -> None:
        self.layout = lay
        self.infos = infos
        self.namer = namer
        self.stage = 0
        self.template: Template | None = lay.template_of_stage[0] if lay.template_of_stage else None
        self.calls: dict[str, int] = {}  # calls of stage-ending modules returned so far
        self.starts: dict[str, int] = {}  # calls of unit modules started so far
        self.top: Scope | None = None
        self.scopes: dict[int, Scope] = {}  # template index -> instance (this forward)
        self.unit: _Unit | None = None
        self.snaps: dict[tuple[Any, ...], torch.Tensor] = {}
        self.recorded_ops = 0  # tape entries (ops and units) this forward
        self.units_run = 0
        self.mode: PlanMode | None = None
        self.hooked = False

    @property
    def current(self) -> Template | None:
        return self.template

    @property
    def finished(self) -> bool:
        """Whether every stage boundary of the plan was seen."""
        return self.stage >= len(self.layout.end_calls) - 1

    def start(self) -> None:
        self._sync()

    def stop(self) -> None:
        self.unit = None
        self.close_top()
        self._set(False, False)
        self.scopes.clear()  # from now on only autograd's handles keep scopes alive
        self.snaps = {}

    def on_call_end(self, path: str) -> None:
        """A stage-ending module's call returned: maybe the next stage begins. Autograd saved
        the last op's outputs before this, and saves the next op's inputs after it."""
        n = self.calls.get(path, 0) + 1
        self.calls[path] = n
        ends = self.layout.end_calls
        if self.stage < len(ends) and ends[self.stage] == (path, n):
            self.stage += 1
            stages = self.layout.template_of_stage
            self.template = stages[self.stage] if self.stage < len(stages) else None
            if self.unit is None:  # inside a unit, its scope goes on to the unit's end
                self._sync()

    def _sync(self) -> None:
        t = self.template
        if t is None or (self.top is not None and self.top.template is not _root(t)):
            self.close_top()
        self._set(t is not None, t is not None and self.unit is None)

    def _set(self, hooked: bool, moded: bool) -> None:
        if not moded and self.mode is not None:
            self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self.mode = None
        if hooked and not self.hooked:
            torch._C._autograd._push_saved_tensors_default_hooks(self.pack, unpack)
        elif self.hooked and not hooked:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self.hooked = hooked
        if moded and self.mode is None:
            self.mode = PlanMode(self)
            self.mode.__enter__()  # type: ignore[no-untyped-call]

    def scope_for(self, t: Template) -> Scope:
        s = self.scopes.get(t.index)
        if s is not None:
            return s
        parent = self.scope_for(t.parent) if t.parent is not None else None
        tape = Tape(self.snaps, self.namer) if parent is None else parent.tape
        s = Scope(t, parent, tape, len(tape.entries), _rng_state())
        if parent is not None:
            parent.children.append(weakref.ref(s))
        else:
            self.top = s
        self.scopes[t.index] = s
        return s

    def close_top(self) -> None:
        if self.top is not None:
            self.top.tape.clear_index()  # later scopes keep this one's outputs as inputs
            self.top = None

    # units: whole module calls

    def on_call_start(self, path: str, module: torch.nn.Module, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
        n = self.starts.get(path, 0) + 1
        self.starts[path] = n
        u = self.unit
        if u is not None:
            if path == u.path:
                u.depth += 1
            return
        t = self.template
        if t is None or t.kind != "region" or n not in self.layout.units.get(path, ()):
            return
        scope = self.scope_for(t)
        tape = scope.tape
        e = len(tape.entries)
        entry = _Call(module, path, self.infos(path, module))
        flat, entry.spec = _flatten_tree((args, kwargs))
        refs: list[Pos] = []
        for leaf in flat:
            if not isinstance(leaf, torch.Tensor):
                entry.leaves.append(leaf)
                continue
            entry.grads.append(leaf.requires_grad)
            pos = tape.lookup(leaf)
            if pos is not None:
                entry.leaves.append(_Ref(pos))
                refs.append(pos)
                _note_input(scope, pos)
            else:
                entry.leaves.append(_Ext(leaf, leaf._version, READ))
        entry.refs = tuple(refs)
        entry.grad_enabled = torch.is_grad_enabled()
        entry.autocast = _autocast_state()
        entry.bound = [s.holder[s.key] for s in entry.info.slots]
        entry.versions = [-1 if b is None else b._version for b in entry.bound]
        entry.bn_training = tuple(m.training for m in entry.info.norms)
        tape.entries.append(entry)
        _extend(scope, e)
        self.recorded_ops += 1
        self.units_run += 1
        self.unit = _Unit(scope, e, path)
        self._set(True, False)

    def on_unit_end(self, path: str, out: Any) -> None:
        u = self.unit
        if u is None or path != u.path:
            return
        if u.depth:
            u.depth -= 1
            return
        entry = u.scope.tape.entries[u.entry]
        assert isinstance(entry, _Call)
        outs = _tensor_leaves(out)
        for j, o in enumerate(outs):
            u.scope.tape.register(o, (u.entry, j))
        entry.n_outputs = len(outs)
        entry.n_saved = u.count
        self.unit = None
        self._sync()

    # the dispatch side

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t = self.template
        if t is None:  # a hook left the mode on: nothing to record
            return func(*args, **kwargs)
        self.recorded_ops += 1
        return self._record(self.scope_for(t), func, args, kwargs)

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
            mode = written.get(id(leaf), READ)
            if mode == SNAPSHOT:
                # An outside tensor written in place: replay reads its value from before,
                # and so does every earlier read of it at that version.
                snap = leaf.detach().clone()
                tape.snaps[(_key(leaf), leaf._version)] = snap
                leaves.append(_Ext(snap, -1, SNAPSHOT))
            else:
                leaves.append(_Ext(leaf, leaf._version, mode))
        out = func(*args, **kwargs)
        expensive = _EXPENSIVE.get(func)
        if expensive is None:
            expensive = _EXPENSIVE[func] = C.is_expensive(str(func))
        held = expensive and scope.template.kind == "drop-cheap"
        for k, o in enumerate(_tensors(out)):
            tape.register(o, (e, k))
            if held:
                tape.held[(e, k)] = o.detach()
        tape.entries.append(_Op(func, spec, leaves, tuple(refs), expensive))
        _extend(scope, e)
        return out

    # the autograd side

    def pack(self, t: torch.Tensor) -> Any:
        u = self.unit
        if u is not None:
            h = Handle(u.scope, (u.entry, u.count), True)
            u.count += 1
            u.scope.handles.append(weakref.ref(h))
            return h
        tmpl = self.template
        top = self.top
        if tmpl is None or top is None or _root(tmpl) is not top.template:
            return t  # the input of a scope that has not started yet
        pos = top.tape.lookup(t)
        if pos is None:
            return t  # from outside the scope: older than every node of it
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


def _extend(scope: Scope, e: int) -> None:
    s: Scope | None = scope
    while s is not None:
        s.last_entry = e
        s = s.parent


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
            raise MemplanError(
                "memplan: a recomputed tensor was requested after its scope was released "
                "(backward through the same graph twice without retain_graph=True?)."
            )
    return obj.value


# --- replay ------------------------------------------------------------------------------------


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
            raise MemplanError("memplan: internal error: nested scope has no inputs")
    tape = scope.tape
    grad = torch.is_grad_enabled()
    drop = scope.template.kind == "drop-cheap" and not grad
    handles = [h for h in (r() for r in scope.handles) if h is not None]
    want: dict[Pos, None] = {}
    unit_handles: dict[int, list[Handle]] = {}
    for h in handles:
        if h.saved:
            unit_handles.setdefault(h.pos[0], []).append(h)
        else:
            want[h.pos] = None
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
    _REPLAYING[0] += 1
    try:
        with _rng(scope.rng_state), _no_autocast():
            for e in span:
                entry = tape.entries[e]
                if isinstance(entry, _Op):
                    if drop and entry.expensive:
                        continue
                    args, kwargs = _rebuild(entry, env, tape)
                    outs = _tensors(entry.func(*args, **kwargs))
                else:
                    hs = unit_handles.get(e)
                    outs, saved = _run_unit(entry, env, tape, hs is not None, grad)
                    for h in hs or ():
                        h.value = saved[h.pos[1]]
                    del saved
                _keep(outs, e, want, kept, last_use, env)
                del outs  # dead outputs die now, not during the next entry
                for p in entry.refs:
                    if last_use.get(p) == e:
                        env.pop(p, None)
    finally:
        _REPLAYING[0] -= 1
    for h in handles:
        if not h.saved:
            h.value = kept[h.pos]
    for child in children:
        child.stash = {p: kept[p] for p in child.inputs}
    scope.done = True
    scope.stash = None
    if scope.template.kind == "drop-cheap":
        tape.held.clear()  # what autograd still needs, its handles hold


def _keep(outs: list[torch.Tensor], e: int, want: dict[Pos, None],
          kept: dict[Pos, torch.Tensor], last_use: dict[Pos, int],
          env: dict[Pos, torch.Tensor]) -> None:
    for k, o in enumerate(outs):
        p = (e, k)
        if p in want:
            kept[p] = o
        if p in last_use:
            env[p] = o


def _ext_value(leaf: _Ext, tape: Tape, what: str) -> torch.Tensor:
    """An outside tensor as the scope read it: never a value changed since."""
    t = leaf.tensor
    if leaf.mode != READ:
        return t.clone()  # the op writes it: write a copy
    if t._version == leaf.version:
        return t
    snap = tape.snaps.get((_key(t), leaf.version))
    if snap is not None:
        return snap
    raise MemplanError(
        f"memplan: {tape.namer(t)}, read by {what} in a recomputed part of the forward, was "
        f"changed in place afterwards (version {leaf.version} then, {t._version} now), so "
        "backward cannot recompute with the value it had. Clone it before changing it "
        "(x = x.clone(); x.mul_(...)), change it out of place, or keep that part (plan with "
        "a larger budget)."
    )


def _rebuild(entry: _Op, env: dict[Pos, torch.Tensor], tape: Tape
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    vals: list[Any] = []
    for leaf in entry.leaves:
        if isinstance(leaf, _Ref):
            vals.append(env[leaf.pos])
        elif isinstance(leaf, _Ext):
            vals.append(_ext_value(leaf, tape, str(entry.func)))
        else:
            vals.append(leaf)
    return _unflatten(vals, entry.spec)


def _run_unit(entry: _Call, env: dict[Pos, torch.Tensor], tape: Tape, collect: bool,
              grad: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Re-run a unit's module call. ``collect``: with grad enabled, taking the tensors
    autograd saves, in order (the handles' values); otherwise under no_grad, for its outputs.
    Inputs are detached unless ``grad`` (create_graph: the replay's graph must reach them)."""
    what = f"the call of module '{entry.path}'"
    vals: list[Any] = []
    i = 0
    for leaf in entry.leaves:
        if isinstance(leaf, _Ref):
            v = env[leaf.pos]
        elif isinstance(leaf, _Ext):
            v = _ext_value(leaf, tape, what)
        else:
            vals.append(leaf)
            continue
        if collect and not grad:
            v = v.detach().requires_grad_(entry.grads[i]) if entry.grads[i] else v.detach()
        vals.append(v)
        i += 1
    args, kwargs = tree_unflatten_call(vals, entry.spec)
    saved: list[torch.Tensor] = []
    copies: dict[int, torch.Tensor] = {}  # BatchNorm statistics' copies -> the statistics

    def take(t: torch.Tensor) -> Any:
        t = copies.get(id(t), t)  # BatchNorm saves its statistics: keep no copy of them
        if grad:
            saved.append(t)
            return t.detach()
        saved.append(t.detach())
        return None

    enable = entry.grad_enabled and (collect or grad)
    with contextlib.ExitStack() as stack:
        _bind(entry, stack, what, copies)
        for device, dtype in entry.autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        stack.enter_context(torch.enable_grad() if enable else torch.no_grad())
        if collect:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(take, _identity))
        out = entry.module(*args, **kwargs)
    outs = _tensor_leaves(out)
    if len(outs) != entry.n_outputs or (collect and len(saved) != entry.n_saved):
        raise MemplanError(
            f"memplan: recomputing {what} gave {len(outs)} tensors and saved {len(saved)} "
            f"for backward, where its forward gave {entry.n_outputs} and saved "
            f"{entry.n_saved}: the module's forward depends on state other than its "
            "arguments, parameters and buffers (Python state, random numbers not from torch). "
            "Make its forward deterministic given its inputs, or keep that part (plan with a "
            "larger budget)."
        )
    if not grad:
        outs = [o.detach() for o in outs]
    return outs, saved


def _bind(entry: _Call, stack: contextlib.ExitStack, what: str,
          copies: dict[int, torch.Tensor]) -> None:
    """Bind the parameters and buffers the unit ran with (a functional_call or a
    re-registration since then leaves other tensors there); BatchNorm statistics of
    training-mode norms as copies, so the replay does not update them again."""
    restore: list[tuple[dict[str, Any], str, Any]] = []
    for slot, rec, version in zip(entry.info.slots, entry.bound, entry.versions):
        if rec is None:
            continue
        if slot.bn >= 0 and entry.bn_training[slot.bn]:
            restore.append((slot.holder, slot.key, slot.holder[slot.key]))
            copy = slot.holder[slot.key] = rec.clone()
            copies[id(copy)] = rec
            continue
        if rec._version != version:
            raise MemplanError(
                f"memplan: '{slot.name}', read by {what} in a recomputed part of the forward, "
                f"was changed in place afterwards (version {version} then, {rec._version} "
                "now), so backward cannot recompute with the value it had. Change it after "
                "backward (as optimizers do), or keep that part (plan with a larger budget)."
            )
        if slot.holder[slot.key] is not rec:
            restore.append((slot.holder, slot.key, slot.holder[slot.key]))
            slot.holder[slot.key] = rec

    def undo() -> None:
        for holder, key, value in reversed(restore):
            holder[key] = value

    stack.callback(undo)


def _identity(x: Any) -> Any:
    return x


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    """The tape holds the ops autocast already chose (casts included): replay them as they are."""
    with contextlib.ExitStack() as stack:
        for device in _DEVICES:
            if torch.is_autocast_enabled(device):  # backward runs without autocast, mostly
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


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    leaves: list[Any] = []
    _walk(out, leaves)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


# Module-call arguments and outputs: nested tuples, lists and dicts walked by hand (pytree's
# general walk costs more than a small op); other registered containers through pytree.


def _walk(obj: Any, leaves: list[Any]) -> Any:
    kind = type(obj)
    if kind is tuple or kind is list:
        return (kind, [_walk(o, leaves) for o in obj])
    if kind is dict:
        return (dict, [(k, _walk(v, leaves)) for k, v in obj.items()])
    if kind in SUPPORTED_NODES:
        flat, spec = tree_flatten(obj)
        leaves.extend(flat)
        return ("pytree", spec, len(flat))
    leaves.append(obj)
    return None


def _flatten_tree(obj: Any) -> tuple[list[Any], Any]:
    leaves: list[Any] = []
    return leaves, _walk(obj, leaves)


def _build(spec: Any, vals: Iterator[Any]) -> Any:
    if spec is None:
        return next(vals)
    if spec[0] == "pytree":
        return tree_unflatten([next(vals) for _ in range(spec[2])], spec[1])
    if spec[0] is dict:
        return {k: _build(s, vals) for k, s in spec[1]}
    return spec[0](_build(s, vals) for s in spec[1])


def tree_unflatten_call(vals: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = _build(spec, iter(vals))
    return tuple(args), dict(kwargs)


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


# Per op: (argument index, name, write-only BatchNorm statistic) of the arguments it writes,
# and the index of its ``training`` flag (BatchNorm ops).
_WRITES: dict[Any, tuple[tuple[tuple[int, str, bool], ...], int]] = {}
_EXPENSIVE: dict[Any, bool] = {}


def _write_spots(func: Any) -> tuple[tuple[tuple[int, str, bool], ...], int]:
    spots = _WRITES.get(func)
    if spots is None:
        # native_batch_norm and the cudnn/miopen variants write the running statistics
        # without saying so in their schemas, and only when training.
        schema = func._schema
        bn = "batch_norm" in schema.name
        names = [a.name for a in schema.arguments]
        training = names.index("training") if bn and "training" in names else -1
        spots = _WRITES[func] = (tuple(
            (i, a.name, bn and a.name in ("running_mean", "running_var"))
            for i, a in enumerate(schema.arguments)
            if (a.alias_info is not None and a.alias_info.is_write)
            or (bn and a.name in ("running_mean", "running_var"))), training)
    return spots


def written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> list[tuple[torch.Tensor, int]]:
    """The tensor arguments the op writes, with WRITE_ONLY for BatchNorm running statistics
    in training (their value reaches no output) and SNAPSHOT for the others."""
    spots, training = _write_spots(func)
    if not spots:
        return []
    trains = True
    if training >= 0:
        flag = args[training] if training < len(args) else kwargs.get("training")
        trains = bool(flag)
    out: list[tuple[torch.Tensor, int]] = []
    for i, name, stat in spots:
        val = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(val, torch.Tensor) and (trains or not stat):
            out.append((val, WRITE_ONLY if stat else SNAPSHOT))
    return out


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, int]:
    """id -> mode of the tensor arguments the op writes (``written_tensors``)."""
    return {id(t): mode for t, mode in written_tensors(func, args, kwargs)}


class PlanMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the ops of a recompute scope outside units (see the module docstring)."""

    def __init__(self, state: StepState) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.state = state

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The planned forward already runs outside Dynamo (apply's compiler.disable); the
        # per-op wrapper torch adds otherwise costs more than recording the op.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func.namespace == "prim":
            return func(*args, **(kwargs or {}))
        return self.state.run_op(func, args, kwargs or {})


@contextlib.contextmanager
def planned(state: StepState) -> Iterator[None]:
    """Run a forward under the plan: stage tracking, tapes and saved-tensor handles."""
    state.start()
    try:
        yield
    finally:
        state.stop()
