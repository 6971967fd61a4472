"""The backward of a chained module's calls (``stamp_chain``), from a side run of two chained
calls (fresh fake copies of the weights, fresh inputs that require grad, under a tracer of its
own): the first call's backward is a middle call's, the second's the last call's (only the
outputs the model reads after its last call get a gradient). Inputs requiring grad from outside
the chain (``links``: -1) are fresh for each call and get their gradient as the others do.
Checked on the paper's LSTM (``benchmarks/stamp_facts.py``): op for op, event for event, death
for death.

Inputs of a middle call that a reader after it reads too (``waiting``: the next layer's step
reads a stacked LSTM's ``h[t]``) are read again after the second call, so that their gradient
waits in autograd's buffer when the first call's backward runs, which adds onto it as the
model's does.

Codes as in ``stamp_template``, with three more kinds of outer value after the call's tensor
arguments, parameters and buffers: the incoming gradient of each output, the running sum of
each weight's gradient handed over by the call after it, then each waiting gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten

from memplan.core import graph as g
from memplan.tracing.chain_window import SideCall, Spec, Window, read_window, vids
from memplan.tracing.stamp_template import (
    Forward,
    Ineligible,
    backward_window,
    empty_like_strided,
    read_forward,
    tensor_spec,
)
from memplan.tracing.tracer import StepTracer


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


@dataclass
class _Copies:
    """The side run's own tensors, registered on its tracer: the first call's arguments that
    require grad, the second's from outside the chain, per call the arguments that do not, the
    weights and the buffers."""

    leaves: list[torch.Tensor]
    outside: list[torch.Tensor]
    others: list[list[torch.Tensor]]
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]


def side_run(main: StepTracer, module: torch.nn.Module, fwd: Forward, flat: list[Any],
             spec: Any, params: list[torch.Tensor], buffers: list[torch.Tensor],
             used: list[int], links: list[int], viewed: list[int], waiting: list[int]
             ) -> ChainTemplate:
    """Two chained calls of ``module`` alone, forward and backward, read as templates;
    ``links``: per input requiring grad, the previous call's output it is, or -1;
    ``viewed``: outputs of the last call the model reshapes (their gradient a view);
    ``waiting``: inputs requiring grad of a middle call whose gradient waits for it."""
    if not used:
        raise Ineligible("no output of the last call is read")
    side = StepTracer(record=True, fake=main.fake)
    side._run = main._run
    copies = _copies(main, side, flat, params, buffers, links)
    calls, ins, loss, readers = _forward(main, side, module, (flat, spec), copies,
                                         (used, viewed, waiting), links)
    for call in calls:
        _same_forward(side, fwd, call)
    # What each call hands its inputs, and what the loss hands the second call's outputs:
    # caught at the nodes (``_edges``; a tensor hook would see the sum over all its uses).
    given = [_edges(side, (c.op0, c.op1), ins[n], set(waiting) if n == 0 else set())
             for n, c in enumerate(calls)]
    to_last = _edges(side, (calls[1].op1, len(side.ops)), calls[1].outs)
    waited = [_caught(side, r) for r in readers]
    with main.paused(), side:
        loss.backward()  # type: ignore[union-attr]
    grads, firsts = _weight_grads(side, copies.params)
    # The first call's outputs get what the second hands the inputs they are.
    to_first = [given[1][links.index(j)] for j in range(len(calls[0].outs))]
    return _templates(side, calls, (given[0], to_first, given[1]), to_last, (grads, firsts),
                      (waiting, waited))


def _copies(main: StepTracer, side: StepTracer, flat: list[Any], params: list[torch.Tensor],
            buffers: list[torch.Tensor], links: list[int]) -> _Copies:
    """Fresh fake copies of the call's tensor arguments (the others: two sets, one per call),
    weights and buffers, made with the model's tracer paused: they are not the model's."""
    tensors = [a for a in flat if isinstance(a, ArgSpec)]
    with main.paused():
        grad_in = [t for t in tensors if t.requires_grad]
        leaves = [t.make().requires_grad_() for t in grad_in]
        outside = [grad_in[p].make().requires_grad_() for p, j in enumerate(links) if j < 0]
        p2 = [empty_like_strided(p).requires_grad_(p.requires_grad) for p in params]
        b2 = [empty_like_strided(b) for b in buffers]
        others = [[t.make() for t in tensors if not t.requires_grad] for _ in range(2)]
    for t in (*leaves, *outside, *others[0], *others[1]):
        side.register(t, g.INPUT)
    for p in p2:
        side.register(p, g.PARAMETER)
    for b in b2:
        side.register(b, g.BUFFER)
    return _Copies(leaves, outside, others, p2, b2)


def _forward(main: StepTracer, side: StepTracer, module: torch.nn.Module,
             args_tree: tuple[list[Any], Any], copies: _Copies,
             read: tuple[list[int], list[int], list[int]], links: list[int]
             ) -> tuple[list[SideCall], list[list[torch.Tensor]], torch.Tensor | int,
                        list[torch.Tensor]]:
    """The two calls' forward on the side tracer, the second taking the first's outputs as its
    arguments that require grad (``links``, the others fresh); returns the calls, each call's
    such arguments, a loss of the outputs ``read[0]`` of the second (those in ``read[1]``
    reshaped first, as the model does: their gradient a view, as the model's), and readers,
    made after both calls, of the first call's inputs ``read[2]``."""
    flat, spec = args_tree
    names = ([n for n, _ in module.named_parameters()], [n for n, _ in module.named_buffers()])
    state = dict(zip(names[0], copies.params)) | dict(zip(names[1], copies.buffers))
    hooks = torch.autograd.graph.saved_tensors_hooks(side.pack, side.unpack)
    calls: list[SideCall] = []
    with main.paused(), side, hooks:
        # Clones: the gradient each call hands its inputs is caught at their nodes (``_edges``).
        ins = [[t.clone() for t in copies.leaves]]
        fresh = [t.clone() for t in copies.outside]
        for n in range(2):
            it, other = iter(ins[n]), iter(copies.others[n])
            args = [(next(it) if a.requires_grad else next(other))
                    if isinstance(a, ArgSpec) else a for a in flat]
            arg_tensors = [a for a in args if isinstance(a, torch.Tensor)]
            outer = vids(side, [*arg_tensors, *copies.params, *copies.buffers])
            op0, v0 = len(side.ops), len(side.values)
            pos, kw = tree_unflatten(args, spec)  # (positional, keyword): ``stamp_chain.call``
            out = functional_call(module, state, tuple(pos), kw)
            outs = tree_flatten(out)[0]
            if len(outs) != len(links) - links.count(-1) \
                    or any(not isinstance(t, torch.Tensor) for t in outs):
                raise Ineligible("the outputs are not the next call's inputs")
            calls.append(SideCall(op0, len(side.ops), v0, len(side.values), outer, outs))
            if n == 0:
                outside = iter(fresh)
                ins.append([outs[j] if j >= 0 else next(outside) for j in links])
        used, viewed, waiting = read
        last = calls[1].outs
        loss: torch.Tensor | int = sum(
            ((last[j].view(-1) if j in viewed else last[j]) * 2.0).sum() for j in used)
        readers = [ins[0][p] * 2.0 for p in waiting]
        loss = loss + sum(r.sum() for r in readers)
    side.end_forward()
    return calls, ins, loss, readers


def _same_forward(side: StepTracer, fwd: Forward, call: SideCall) -> None:
    """A call of the side run must make the model's first call's forward, renamed."""
    op0, op1, v0, v1, outer, outs = call
    try:
        again = read_forward(side, "", op0, v0, len(side.module_calls), outer, outs[0],
                             (op1, v1), modules=False, more=tuple(outs[1:]))
    except Ineligible as err:
        raise Ineligible(f"side run: {err}") from None
    if [(t, *r) for t, _, *r in again.ops] != [(t, *r) for t, _, *r in fwd.ops] \
            or [v[:4] for v in again.values] != [v[:4] for v in fwd.values] \
            or (again.out, again.more) != (fwd.out, fwd.more):
        raise Ineligible("the side run's forward differs from the first call")


def _weight_grads(side: StepTracer, params: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """After the backward: each weight's gradient, and the first call's part of it (the
    running sum a middle call adds onto)."""
    if any(p.grad is None for p in params):
        raise Ineligible("a weight gets no gradient")
    grads = vids(side, [p.grad for p in params])  # type: ignore[misc]
    # Each weight's gradient: the last call's, plus the first call's, by one add.
    by_out = {o: b for b in side.backward_ops for o in b.outputs}
    firsts = []
    for f in grads:
        add = by_out.get(f)
        if add is None or add.target != "aten.add.Tensor" or len(add.inputs) != 2:
            raise Ineligible("a weight's gradient not one add of the two calls'")
        firsts.append(add.inputs[0])
    return grads, firsts


def _templates(side: StepTracer, calls: list[SideCall], given: tuple[list[list[Any]], ...],
               to_last: list[list[Any]], sums: tuple[list[int], list[int]],
               waits: tuple[list[int], list[list[Any]]]) -> ChainTemplate:
    """The second call's window as the last call's (no running sums handed over), the first's
    as a middle call's (adding onto the sums the call after it hands over, and onto the
    gradients waiting for its inputs ``waits``). ``given``: what the first call hands its
    inputs, what its outputs get, what the second hands its inputs; ``sums``: each weight's
    gradient, and the first call's part of it."""
    grads, firsts = sums
    caught = [_spec(side, cell) for cell in waits[1]]
    waiting = [w[0] for w in caught if w is not None]
    if len(waiting) != len(caught):
        raise Ineligible("a reader of a call's input handed it no gradient")
    saved = [_saved(side, calls[n]) for n in range(2)]
    if saved[0] != saved[1]:
        raise Ineligible("the two calls save differently")
    calls_values = range(calls[0].v0, calls[1].v1)
    last = read_window(side, calls[1], [_spec(side, t) for t in to_last],
                       [_spec(side, t) for t in given[2]], [], firsts, saved[1], calls_values)
    # Values of the side run's own loss may die anywhere (autograd frees a node's inputs
    # late); the calls' forward values and the last call's backward values may not.
    ws, we, _ = backward_window(side, range(calls[1].op0, calls[1].op1))
    born = [v.id for v in side.values if v.kind in (g.BACKWARD, g.GRADIENT)
            and ws < v.birth <= we]
    foreign = set(calls_values) | set(born)
    middle = read_window(side, calls[0], [_spec(side, t) for t in given[1]],
                         [_spec(side, t) for t in given[0]], firsts, grads, saved[0], foreign,
                         (waits[0], waiting))
    return ChainTemplate(saved[0], middle, last)


def _edges(side: StepTracer, ops: tuple[int, int], targets: list[torch.Tensor],
           summed: set[int] | None = None) -> list[list[torch.Tensor | None]]:
    """Per target tensor, a cell filled by backward with the gradient the nodes of forward
    ops ``ops`` hand it: one node's, caught as it hands it; several nodes' (a GRU's state
    read by its gates and its blend) or a target in ``summed`` (a gradient waits for it),
    their sum as autograd hands it on to the target's node (each target is read by these
    nodes only, or by a reader that ran before them: ``stamp_chain``)."""
    where = {}
    for k, t in enumerate(targets):
        if t.grad_fn is not None:
            where[(id(t.grad_fn), t.output_nr)] = k
    readers: dict[int, list[tuple[Any, int]]] = {}  # per target: (node, its edge index)
    seen: set[int] = set()
    for node, index in side._node_refs:
        if not ops[0] <= index < ops[1] or id(node) in seen:
            continue
        seen.add(id(node))
        for i, (nxt, nr) in enumerate(node.next_functions):
            if nxt is not None and (id(nxt), nr) in where:
                readers.setdefault(where[(id(nxt), nr)], []).append((node, i))
    cells: list[list[torch.Tensor | None]] = [[] for _ in targets]
    for k, nodes in sorted(readers.items()):
        cells[k].append(None)
        if len(nodes) == 1 and k not in (summed or ()):
            node, i = nodes[0]
            node.register_hook(_catch(side, [cells[k]], [(i, 0)]))
        else:
            t = targets[k]
            assert t.grad_fn is not None  # ``where`` holds targets with a node only
            t.grad_fn.register_prehook(_catch(side, [cells[k]], [(t.output_nr, 0)], pre=True))
    return cells


def _caught(side: StepTracer, reader: torch.Tensor) -> list[Any]:
    """A cell filled by backward with the gradient ``reader`` (one op of one input) hands on."""
    cell: list[Any] = [None]
    assert reader.grad_fn is not None
    reader.grad_fn.register_hook(_catch(side, [cell], [(0, 0)]))
    return cell


def _catch(side: StepTracer, cells: list[list[Any]], mine: list[tuple[int, int]],
           pre: bool = False) -> Any:
    """A node hook filling ``cells[k]`` with the spec of gradient ``i`` it hands on, per
    (i, k) in ``mine``; ``pre``: a pre-hook, of the gradient ``i`` it is handed."""
    def catch(grads: Any) -> None:
        for i, k in mine:  # the spec only: holding the tensor would keep it alive
            t = grads[i]
            cells[k][0] = None if t is None else (side._lookup(t), (
                tensor_spec(t), t._is_view(), int(t.untyped_storage().nbytes())))

    if pre:
        return catch
    return lambda grad_inputs, grad_outputs: catch(grad_inputs)


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
