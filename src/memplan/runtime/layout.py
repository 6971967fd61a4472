"""The plan as the runtime needs it, per stage of the model's forward: the innermost
recompute scope of each stage, the module call that ends it, and the module calls replayed
whole (units). Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.core import schedule as S
from memplan.core.graph import OP
from memplan.core.ops import is_expensive
from memplan.core.plan import Plan, Stage
from memplan.errors import PlanMismatch
from memplan.runtime import units as U


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
    # the end of the forward, or an op boundary). Module calls mark boundaries at run time, so
    # kept stages run with no dispatch mode at all...
    end_calls: list[tuple[str, int] | None]
    templates: list[Template]
    units: dict[str, frozenset[int]] = field(default_factory=dict)  # path -> call numbers
    # ...except a stage that ends after an op of functional code (a plan through an op-level
    # cut point): it ends when end_ops[s] ops have run in it (counted as capture counts them).
    end_ops: list[int | None] = field(default_factory=list)
    # Per drop-cheap stage, expensive ops it recomputes all the same (a later op writes their
    # outputs in place, ``graph_arrays.held_expensive``), numbered among its expensive ops:
    # a real forward may run ops a fake one does not (HF's real-only checks), cheap ones.
    overwritten: dict[int, frozenset[int]] = field(default_factory=dict)

    @property
    def boundary_modules(self) -> tuple[str, ...]:
        return tuple(sorted({e[0] for e in self.end_calls if e is not None}))


def layout(plan: Plan, n_ops: int, call_ends: dict[str, list[int]],
           calls: list[U.Call] | None = None, values: U.Values | None = None,
           targets: list[str] | None = None, written: frozenset[int] = frozenset()) -> Layout:
    """Index the plan's schedule by stage. ``n_ops``: ops of the model's forward;
    ``call_ends``: for each stage-ending module, the op count at the end of each of its calls;
    ``calls`` and ``values``: the forward's module calls and value lifetimes, from which the
    units of flat top-level regions are chosen; ``targets``: its ops; ``written``: ops whose
    outputs a later op writes in place (all from a fake forward, ``probe.probe``)."""
    stages = [st for st in plan.stages if st.first_op < n_ops]
    scope: list[Template | None] = [None] * len(stages)
    templates: list[Template] = []

    def walk(items: tuple[S.Item, ...], parent: Template | None) -> None:
        for it in items:
            if isinstance(it, S.Keep):
                continue
            lo, hi = (it.stage, it.stage) if isinstance(it, S.DropCheap) else (it.start, it.end)
            if hi >= len(stages) or plan.stages[hi].last_op >= n_ops:
                raise PlanMismatch(
                    f"the plan recomputes stages {lo}..{hi}, which reach past the model's "
                    f"forward ({n_ops} ops; the rest is the loss, which runs outside the "
                    "model): make the plan with memplan.plan(...) for this model and loss."
                )
            kind = "drop-cheap" if isinstance(it, S.DropCheap) else "region"
            t = Template(kind, parent, len(templates))
            templates.append(t)
            for k in range(lo, hi + 1):
                scope[k] = t
            if isinstance(it, S.Region):
                walk(it.body, t)

    walk(plan.schedule, None)
    end_calls: list[tuple[str, int] | None] = []
    end_ops: list[int | None] = []
    for st in stages:
        end_ops.append(st.last_op - st.first_op + 1 if st.boundary == OP and
                       st.last_op < n_ops - 1 else None)
        if st.last_op >= n_ops - 1 or st.boundary == OP:
            end_calls.append(None)  # the forward's own end, or an op boundary
            continue
        ends = call_ends.get(st.module, [])
        if st.last_op + 1 not in ends:
            raise PlanMismatch(
                f"stage {st.index} of the plan ends when a call of module '{st.module}' "
                f"returns after op {st.last_op}, but no call of it returned there in this "
                "model's forward (is it called through .forward() rather than as a module?). "
                "Make the plan for this model with memplan.plan(...)."
            )
        end_calls.append((st.module, ends.index(st.last_op + 1) + 1))
    units: dict[str, frozenset[int]] = {}
    if calls and values is not None:
        room = [st.replay_headroom_bytes for st in stages  # per op: stages tile them
                for _ in range(st.first_op, st.last_op + 1)][:n_ops]
        units = U.choose(_flat_regions(stages, scope, templates), calls, values, room)
    overwritten: dict[int, frozenset[int]] = {}
    for k, (st, t) in enumerate(zip(stages, scope)):
        if t is not None and t.kind == "drop-cheap" and targets is not None:
            ops = [o for o in range(st.first_op, min(st.last_op + 1, len(targets)))
                   if is_expensive(targets[o])]
            overwritten[k] = frozenset(i for i, o in enumerate(ops) if o in written)
    return Layout(scope, end_calls, templates, units, end_ops, overwritten)


def _flat_regions(stages: list[Stage], scope: list[Template | None], templates: list[Template]
                  ) -> list[tuple[int, int]]:
    """(first op, last op) of each top-level region with no scope nested in it (nor an
    op-level boundary). A nested scope's entries are also replayed by its parent, for outputs
    only, with nothing saved: there a re-run call would keep what the plan's model frees."""
    nested = {t.parent.index for t in templates if t.parent is not None}
    # A region with an op-level boundary counts its ops through the dispatch mode, which a
    # unit turns off: no units there.
    counted = {t.index for st, t in zip(stages, scope) if t is not None and st.boundary == OP}
    spans: dict[int, tuple[int, int]] = {}
    for st, t in zip(stages, scope):
        if (t is None or t.kind != "region" or t.parent is not None or t.index in nested
                or t.index in counted):
            continue
        lo, _ = spans.get(t.index, (st.first_op, st.last_op))
        spans[t.index] = (lo, st.last_op)
    return [spans[i] for i in sorted(spans)]
