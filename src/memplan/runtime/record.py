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
  ``torch.utils.checkpoint`` does, with the parameters and buffers it ran with (no unit holds
  a BatchNorm: ``probe``), and checks that it saves as many tensors as it did.
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
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.runtime.entries import expensive_op, record_op, record_unit, unit_arguments
from memplan.runtime.handles import Handle
from memplan.runtime.layout import Layout, Template
from memplan.runtime.replay import unpack
from memplan.runtime.tape import (
    Namer,
    SavedMeta,
    Scope,
    Tape,
    UnitEntry,
    UnitInfo,
    rng_state,
    tensor_leaves,
    write_spots,
    written_tensors,
)
from memplan.tracing.opinfo import is_counted
from memplan.tracing.view_replays import ViewReplays


class _Unit:
    """The unit call running now: no dispatch mode; the shapes and dtypes of the tensors it
    saves, in order."""

    __slots__ = ("depth", "dtypes", "entry", "path", "scope", "shapes")

    def __init__(self, scope: Scope, entry: int, path: str) -> None:
        self.scope = scope
        self.entry = entry
        self.path = path
        self.shapes: list[torch.Size] = []
        self.dtypes: list[torch.dtype] = []
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
        # This forward's tapes, and its copies of outside tensors taken before a write (each
        # held by the tapes that read the tensor: see Tape.keep_before_write).
        self.tapes: list[Tape] = []
        self.snaps: dict[tuple[Any, ...], torch.Tensor] = {}
        self.saved_metas: dict[SavedMeta, SavedMeta] = {}  # one per distinct unit signature
        self.recorded_ops = 0  # tape entries (ops and units) this forward
        self.units_run = 0
        self.mode: PlanMode | None = None
        self.hooked = False
        self.ops_left: int | None = None  # ops until the current stage's op boundary
        self.stage_expensive = 0  # expensive ops of the current stage so far (drop-cheap)
        self.resync = False  # an op boundary passed inside a dispatch: hooks to set next op

    @property
    def current(self) -> Template | None:
        return self.template

    @property
    def finished(self) -> bool:
        """Whether every stage boundary of the plan was seen."""
        return self.stage >= len(self.layout.end_calls) - 1

    def start(self) -> None:
        self._count_stage()
        self._sync()

    def stop(self) -> None:
        self.unit = None
        self.close_top()
        self._set(False, False)
        self.scopes.clear()  # from now on only autograd's handles keep scopes alive
        self.tapes = []
        self.snaps = {}

    def on_call_end(self, path: str) -> None:
        """A stage-ending module's call returned: maybe the next stage begins. Autograd saved
        the last op's outputs before this, and saves the next op's inputs after it."""
        n = self.calls.get(path, 0) + 1
        self.calls[path] = n
        ends = self.layout.end_calls
        if self.stage < len(ends) and ends[self.stage] == (path, n):
            self._next_stage()
            if self.unit is None:  # inside a unit, its scope goes on to the unit's end
                self._sync()

    def _next_stage(self) -> None:
        self.stage += 1
        self.stage_expensive = 0
        stages = self.layout.template_of_stage
        self.template = stages[self.stage] if self.stage < len(stages) else None
        self._count_stage()

    def _count_stage(self) -> None:
        ops = self.layout.end_ops
        self.ops_left = ops[self.stage] if self.stage < len(ops) else None

    def _sync(self) -> None:
        """Close the top scope when the stage leaves it; saved-tensor hooks while a scope is
        current; the dispatch mode while a scope records outside units or a stage counts its
        ops (only here, never inside a dispatch)."""
        t = self.template
        if t is None or (self.top is not None and self.top.template is not _root(t)):
            self.close_top()
        self.resync = False
        self._set(t is not None, (t is not None and self.unit is None)
                  or self.ops_left is not None)

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
        if parent is None:
            tape = Tape({}, self.namer)
            self.tapes.append(tape)
        else:
            tape = parent.tape
        s = Scope(t, parent, tape, len(tape.entries), rng_state())
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
        got = unit_arguments(args, kwargs)
        if got is None:
            return  # given an object the call may change (a KV cache): its ops go on the tape
        scope = self.scope_for(t)
        e = record_unit(scope, module, path, self.infos(path, module), *got)
        scope.table.start_unit(e)
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
        assert isinstance(entry, UnitEntry)
        outs = tensor_leaves(out)
        for j, o in enumerate(outs):
            u.scope.tape.register(o, (u.entry, j))
        entry.n_outputs = len(outs)
        entry.n_saved = len(u.shapes)
        meta = (tuple(u.shapes), tuple(u.dtypes))
        entry.saved = self.saved_metas.setdefault(meta, meta)
        self.unit = None
        self._sync()

    # the dispatch side

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.resync:  # the stage after an op boundary: its hooks from its first op on
            self.resync = False
            self._set(self.template is not None, True)
        t = self.template
        if t is None or self.unit is not None:  # a kept stage counting its ops
            out = func(*args, **kwargs)
        else:
            self.recorded_ops += 1
            overwritten = False
            if t.kind == "drop-cheap" and expensive_op(func):  # (its ops all come here)
                overwritten = (self.stage_expensive
                               in self.layout.overwritten.get(self.stage, ()))
                self.stage_expensive += 1
            out = record_op(self.scope_for(t), self.tapes, self.snaps, func, args, kwargs,
                            overwritten)
        if self.ops_left is not None and is_counted(func):
            self.ops_left -= 1
            if self.ops_left == 0:
                self._op_boundary()
        return out

    def _op_boundary(self) -> None:
        """The stage's last op ran (an op-level cut): the next stage begins with the next op.
        Inside this dispatch autograd has yet to save this op's outputs: when the next stage
        leaves the scope, they are saved natively (hooks off now; they are the stage's
        outputs, kept); the next op sets the next stage's hooks. The mode stays on until a
        module hook or the forward's end turns it off."""
        before = self.template
        self._next_stage()
        t = self.template
        if t is None or (self.top is not None and self.top.template is not _root(t)):
            self.close_top()
            self._set(False, True)
            self.resync = t is not None
        elif before is None and t is not None:
            self.resync = True

    # the autograd side

    def pack(self, t: torch.Tensor) -> Any:
        u = self.unit
        if u is not None:
            u.shapes.append(t.shape)
            u.dtypes.append(t.dtype)
            return Handle(u.scope, u.scope.table.add_saved())
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
        return Handle(scope, scope.table.add_value(pos))


def _root(t: Template) -> Template:
    while t.parent is not None:
        t = t.parent
    return t


class PlanMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the ops of a recompute scope outside units (see the module docstring)."""

    def __init__(self, state: StepState) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.state = state
        self.replays = ViewReplays()  # on fake tensors (a simulated step): autograd's replays

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The planned forward already runs outside Dynamo (apply's compiler.disable); the
        # per-op wrapper torch adds otherwise costs more than recording the op.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "prim":
            return func(*args, **kwargs)
        replays = self.replays
        if replays.watch is not None and replays.is_replay(func, args, sys._getframe(1)):
            out = func(*args, **kwargs)  # autograd remaking a view's node: no op of the step
            replays.replayed(out)
            return out
        out = self.state.run_op(func, args, kwargs)
        if type(out) is FakeTensor and write_spots(func)[0]:  # real tensors never replay
            replays.written([t for t, _ in written_tensors(func, args, kwargs)],
                            tensor_leaves((args, kwargs)), sys._getframe(1))
        return out


@contextlib.contextmanager
def planned(state: StepState) -> Iterator[None]:
    """Run a forward under the plan: stage tracking, tapes and saved-tensor handles."""
    state.start()
    try:
        yield
    finally:
        state.stop()
