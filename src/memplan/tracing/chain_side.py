"""The backward of a chained module's calls (``stamp_chain``), from a side run of two chained
calls (fresh fake copies of the weights, fresh inputs that require grad, under a tracer of its
own): the first call's backward is a middle call's, the second's the last call's (only the
outputs the model reads after its last call get a gradient). Checked on the paper's LSTM
(``benchmarks/stamp_facts.py``): op for op, event for event, death for death.

Codes as in ``stamp_template``, with two more kinds of outer value after the call's tensor
arguments, parameters and buffers: the incoming gradient of each output, then the running sum
of each weight's gradient handed over by the call after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten

from memplan.core import graph as g
from memplan.tracing.stamp_template import (
    NEW,
    Forward,
    Ineligible,
    backward_window,
    empty_like_strided,
    read_forward,
    tensor_spec,
)
from memplan.tracing.tracer import StepTracer

Spec = tuple[Any, ...]  # (tensor_spec, is a view, its storage's bytes)


@dataclass
class Window:
    """One call's backward, events relative to the one before its first node ran."""

    ops: list[tuple[str, list[int], list[int], list[int], int, int]]  # target, inputs, outputs
    # (new values), mutated, flops, grad_of
    values: list[tuple[int, tuple[int, ...], str, int, int]]  # nbytes, shape, dtype, numel,
    # birth event
    deaths: dict[int, list[int]]
    events: list[tuple[int, int]]  # per forward op: (unpack, release), -1: none
    length: int
    last_grad_of: int
    incoming: list[Spec | None]  # per output: its gradient's spec (None: no gradient)
    dying: set[int]  # outputs whose incoming gradient dies in the window
    handed: list[tuple[Any, ...]]  # per input requiring grad: ("in", output) or ("new",
    # new value, shape, stride, offset, is a view)
    sums: list[int]  # per weight: the new value holding its gradient's running sum after
    releases: dict[int, int]  # saved input/output code -> the event its saver releases it
    takes_sums: bool  # a middle call: adds onto the running sums handed over


class SideCall(NamedTuple):
    """One call of the side run: its forward ops and values, outer values, outputs."""

    op0: int
    op1: int
    v0: int
    v1: int
    outer: list[int]
    outs: list[torch.Tensor]


@dataclass(frozen=True)
class ArgSpec:
    """A tensor argument of a chained call, as the side run remakes it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


@dataclass
class ChainTemplate:
    saved: list[list[int]]  # per forward op: codes of what it saved
    middle: Window
    last: Window


def _vids(side: StepTracer, ts: list[torch.Tensor]) -> list[int]:
    out = [side._lookup(t) for t in ts]
    if any(v is None for v in out):
        raise Ineligible("an untracked tensor")
    return out  # type: ignore[return-value]


def side_run(main: StepTracer, module: torch.nn.Module, fwd: Forward, flat: list[Any],
             spec: Any, params: list[torch.Tensor], buffers: list[torch.Tensor],
             used: list[int]) -> ChainTemplate:
    """Two chained calls of ``module`` alone, forward and backward, read as templates."""
    if not used:
        raise Ineligible("no output of the last call is read")
    side = StepTracer(record=True, fake=main.fake)
    side._run = main._run
    tensors = [a for a in flat if isinstance(a, ArgSpec)]
    with main.paused():
        leaves = [t.make().requires_grad_() for t in tensors if t.requires_grad]
        p2 = [empty_like_strided(p).requires_grad_(p.requires_grad) for p in params]
        b2 = [empty_like_strided(b) for b in buffers]
        others = [[t.make() for t in tensors if not t.requires_grad] for _ in range(2)]
    for t in (*leaves, *others[0], *others[1]):
        side.register(t, g.INPUT)
    for p in p2:
        side.register(p, g.PARAMETER)
    for b in b2:
        side.register(b, g.BUFFER)
    names = ([n for n, _ in module.named_parameters()], [n for n, _ in module.named_buffers()])
    state = dict(zip(names[0], p2)) | dict(zip(names[1], b2))
    hooks = torch.autograd.graph.saved_tensors_hooks(side.pack, side.unpack)
    calls: list[SideCall] = []
    with main.paused(), side, hooks:
        grad_in = [t.clone() for t in leaves]
        starts = list(grad_in)
        for n in range(2):
            it, other = iter(grad_in), iter(others[n])
            args = [(next(it) if a.requires_grad else next(other))
                    if isinstance(a, ArgSpec) else a for a in flat]
            arg_tensors = [a for a in args if isinstance(a, torch.Tensor)]
            outer = _vids(side, [*arg_tensors, *p2, *b2])
            op0, v0 = len(side.ops), len(side.values)
            out = functional_call(module, state, tuple(tree_unflatten(args, spec)))
            outs = tree_flatten(out)[0]
            if len(outs) != len(grad_in) or any(not isinstance(t, torch.Tensor) for t in outs):
                raise Ineligible("the outputs are not the next call's inputs")
            calls.append(SideCall(op0, len(side.ops), v0, len(side.values), outer, outs))
            grad_in = outs
        loss = sum((calls[1].outs[j] * 2.0).sum() for j in used)
    side.end_forward()
    for op0, op1, v0, v1, outer, outs in calls:
        try:
            again = read_forward(side, "", op0, v0, len(side.module_calls), outer, outs[0],
                                 (op1, v1), modules=False, more=tuple(outs[1:]))
        except Ineligible as err:
            raise Ineligible(f"side run: {err}") from None
        if [(t, *r) for t, _, *r in again.ops] != [(t, *r) for t, _, *r in fwd.ops] \
                or [v[:4] for v in again.values] != [v[:4] for v in fwd.values] \
                or (again.out, again.more) != (fwd.out, fwd.more):
            raise Ineligible("the side run's forward differs from the first call")
    # What each call hands its inputs, and what the loss hands the second call's outputs:
    # read off the nodes' edges (a tensor hook would see the sum over all its uses).
    given = [_edges(side, (c.op0, c.op1), ins)
             for c, ins in ((calls[0], starts), (calls[1], calls[0].outs))]
    to_last = _edges(side, (calls[1].op1, len(side.ops)), calls[1].outs)
    with main.paused(), side:
        loss.backward()  # type: ignore[union-attr]
    if any(p.grad is None for p in p2):
        raise Ineligible("a weight gets no gradient")
    grads = _vids(side, [p.grad for p in p2])  # type: ignore[misc]
    # Each weight's gradient: the last call's, plus the first call's, by one add.
    by_out = {o: b for b in side.backward_ops for o in b.outputs}
    firsts = []
    for f in grads:
        add = by_out.get(f)
        if add is None or add.target != "aten.add.Tensor" or len(add.inputs) != 2:
            raise Ineligible("a weight's gradient not one add of the two calls'")
        firsts.append(add.inputs[0])
    saved = [_saved(side, calls[n]) for n in range(2)]
    if saved[0] != saved[1]:
        raise Ineligible("the two calls save differently")
    calls_values = range(calls[0].v0, calls[1].v1)
    last = _read(side, calls[1], [_spec(side, t) for t in to_last],
                 [_spec(side, t) for t in given[1]], [], firsts, saved[1], calls_values)
    # Values of the side run's own loss may die anywhere (autograd frees a node's inputs
    # late); the calls' forward values and the last call's backward values may not.
    ws, we, _ = backward_window(side, range(calls[1].op0, calls[1].op1))
    born = [v.id for v in side.values if v.kind in (g.BACKWARD, g.GRADIENT)
            and ws < v.birth <= we]
    foreign = set(calls_values) | set(born)
    middle = _read(side, calls[0], [_spec(side, t) for t in given[1]],
                   [_spec(side, t) for t in given[0]], firsts, grads, saved[0], foreign)
    return ChainTemplate(saved[0], middle, last)


def _edges(side: StepTracer, ops: tuple[int, int], targets: list[torch.Tensor]
           ) -> list[list[torch.Tensor | None]]:
    """Per target tensor, a cell filled by backward with the gradient the nodes of forward
    ops ``ops`` hand it; more than one node handing it one: not foreseen."""
    where = {}
    for k, t in enumerate(targets):
        if t.grad_fn is not None:
            where[(id(t.grad_fn), t.output_nr)] = k
    cells: list[list[torch.Tensor | None]] = [[] for _ in targets]
    seen: set[int] = set()
    for node, index in side._node_refs:
        if not ops[0] <= index < ops[1] or id(node) in seen:
            continue
        seen.add(id(node))
        mine = [(i, where[(id(nxt), nr)]) for i, (nxt, nr) in enumerate(node.next_functions)
                if nxt is not None and (id(nxt), nr) in where]
        for _, k in mine:
            if cells[k]:
                raise Ineligible("an output read by two nodes of the next call")
            cells[k].append(None)
        if mine:
            node.register_hook(_catch(side, cells, mine))
    return cells


def _catch(side: StepTracer, cells: list[list[Any]], mine: list[tuple[int, int]]) -> Any:
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        for i, k in mine:  # the spec only: holding the tensor would keep it alive
            t = grad_inputs[i]
            cells[k][0] = None if t is None else (side._lookup(t), (
                tensor_spec(t), t._is_view(), int(t.untyped_storage().nbytes())))
    return hook


def _spec(side: StepTracer, cell: list[Any]) -> tuple[int, Spec] | None:
    """(value, spec) of a gradient caught by ``_edges`` (None: none handed)."""
    got = cell[0] if cell else None
    if got is None:
        return None
    if got[0] is None:
        raise Ineligible("a handed gradient is not tracked")
    return got  # type: ignore[no-any-return]


def _saved(side: StepTracer, call: SideCall) -> list[list[int]]:
    op0, op1, v0, v1, outer, _ = call
    code = {v: -1 - k for k, v in enumerate(outer)}
    out = []
    for op in side.ops[op0:op1]:
        codes = []
        for v in op.saved:
            if v0 <= v < v1:
                codes.append(v - v0)
            elif v in code:
                codes.append(code[v])
            else:
                raise Ineligible("a save from outside the call")
        out.append(codes)
    return out


def _read(side: StepTracer, call: SideCall, incoming: list[tuple[int, Spec] | None],
          handed: list[tuple[int, Spec] | None], sums_in: list[int], sums_out: list[int],
          saved: list[list[int]], foreign: range | set[int]) -> Window:
    """One call's backward window: ``sums_in``/``sums_out`` the values holding each weight's
    running sum before (none: the last call) and after it; ``foreign``: values of the calls
    that must not die in this window unless coded."""
    op0, op1, v0, v1, outer, _ = call
    unit = range(op0, op1)
    ws, we, window = backward_window(side, unit)
    n_outer, n_out = len(outer), len(incoming)
    outs = set(_vids(side, call.outs))
    code: dict[int, int] = {v: -1 - k for k, v in enumerate(outer)}
    for j, inc in enumerate(incoming):
        if inc is not None:
            if inc[0] in code:
                raise Ineligible("one gradient for two outputs")
            code[inc[0]] = -1 - (n_outer + j)
    born = [v for v in side.values if v.kind in (g.BACKWARD, g.GRADIENT) and ws < v.birth <= we]
    if not born:
        raise Ineligible("no backward values")
    new0, new1 = born[0].id, born[-1].id + 1
    if [v.id for v in born] != list(range(new0, new1)):
        raise Ineligible("backward values not contiguous")
    # The running sums of the weights' gradients: made by the last call; a middle call adds
    # onto the next call's.
    if any(not new0 <= s < new1 for s in sums_out) or any(s in code or new0 <= s < new1
                                                          for s in sums_in):
        raise Ineligible("a running sum not where the chain puts it")
    for p, s_in in enumerate(sums_in):
        code[s_in] = -1 - (n_outer + n_out + p)
    sums = [s - new0 for s in sums_out]

    def rel(x: int) -> int:
        if new0 <= x < new1:
            return NEW + x - new0
        if v0 <= x < v1:
            return int(x - v0)
        c = code.get(x)
        if c is None:
            raise Ineligible(f"backward reads value {x} from outside the call")
        return c

    ops = [(b.target, [rel(v) for v in b.inputs], [rel(v) - NEW for v in b.outputs],
            [rel(v) for v in b.mutated], b.fwd_flops, b.grad_of - op0) for b in window]
    values = [(v.nbytes, v.shape, v.dtype, v.numel, v.birth - ws) for v in born]
    hands: list[tuple[Any, ...]] = []
    for h in handed:
        if h is None:
            raise Ineligible("an input requiring grad gets none")
        hv, (tspec, view, nbytes) = h
        c = code.get(hv)
        if c is not None and c <= -1 - n_outer and -1 - c - n_outer < n_out:
            hands.append(("in", -1 - c - n_outer))
        elif new0 <= hv < new1 and nbytes == side.values[hv].nbytes:
            hands.append(("new", hv - new0, tspec[0], tspec[1], tspec[2], view))
        else:
            raise Ineligible("a handed gradient neither incoming nor made in the call")
    kept = {h[1] for h in hands if h[0] == "new"} | set(sums)
    for v in born:
        if (v.death is None or v.death > we) != (v.id - new0 in kept):
            raise Ineligible("a backward value outlives the call, or one handed on dies")
    deaths: dict[int, list[int]] = {}
    dying: set[int] = set()
    for v in side.values:
        if v.death is None or not ws < v.death <= we:
            continue
        c = code.get(v.id) if not (new0 <= v.id < new1 or v0 <= v.id < v1) else rel(v.id)
        if c is None:
            if v.id in foreign:
                raise Ineligible(f"a value of the calls dies in a window unforeseen: {v}")
            continue
        if 0 <= c < NEW and v.id in outs:
            continue  # the call's outputs: real tensors, tracked as any
        if -1 - n_outer < c < 0:
            continue  # its arguments, weights and buffers: tracked as any
        if -1 - n_outer >= c > -1 - n_outer - n_out:
            dying.add(-1 - c - n_outer)
        deaths.setdefault(v.death - ws, []).append(c)
    events = [(_rel(side.ops[i].unpack_event, ws), _rel(side.ops[i].release_event, ws))
              for i in unit]
    releases: dict[int, int] = {}
    for k, codes in enumerate(saved):  # arguments and outputs saved: held by a proxy each
        for c in codes:
            if c < 0 or v0 + c in outs:
                releases[c] = max(releases.get(c, -1), events[k][1])
    if any(r < 0 for r in releases.values()):
        raise Ineligible("a saved argument never released")
    last = max(unit, key=lambda i: side.ops[i].unpack_event)
    return Window(ops, values, deaths, events, we - ws, last - op0,
                  [None if inc is None else inc[1] for inc in incoming], dying, hands, sums,
                  releases, bool(sums_in))


def _rel(e: int, ws: int) -> int:
    return -1 if e < 0 else e - ws
