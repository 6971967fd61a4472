"""How the calls of a chained module (``stamp_chain``) relate: the key two calls must share,
which inputs of a call are the previous call's outputs (links) and which come from outside the
chain, whether those hand their gradients to edges no earlier call fed, who else reads the
calls' outputs and inputs, and what sets a stamped call's ops apart from its template's only
by grad mode."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memplan.tracing.stamp_template import StampMismatch, autocast_key, frozen_value, is_plain

RESHAPES = frozenset(("aten.view.default", "aten._unsafe_view.default"))


def reshaped(ops: list[Any], out: int) -> bool:
    """Whether the first of ``ops`` (those after the chain) to read the last call's output
    ``out`` reshapes it: autograd then hands the call a gradient that is a view (a head's
    matmul, reshaped back)."""
    return next((op.target for op in ops if out in op.inputs), None) in RESHAPES


def no_clones(targets: list[str]) -> list[str]:
    """Ops but a clone right before an in-place op: a stamped call runs without grad mode,
    where autograd does not clone what an in-place op overwrites and its backward needs (a GRU
    cell's ``mul_``); a module's own clone before one goes from both sides alike."""
    def in_place(target: str) -> bool:  # "aten.mul_.Tensor"
        parts = target.split(".")
        return len(parts) > 1 and parts[1].endswith("_")

    return [t for t, nxt in zip(targets, [*targets[1:], ""])
            if not (t == "aten.clone.default" and in_place(nxt))]


def links_of(ins: list[int], outs: list[int], made: set[int]) -> list[int] | None:
    """Per input requiring grad of a call, the previous call's output it is (its index) or -1
    (from outside the chain: no chained call's output); None unless it takes each output
    once, in order."""
    index = {v: j for j, v in enumerate(outs)}
    links = [index.get(v, -1) for v in ins]
    if [j for j in links if j >= 0] != list(range(len(outs))):
        return None
    if any(j < 0 and v in made for v, j in zip(ins, links)):
        return None  # a gradient onto an earlier call's, which the template does not foresee
    return links


def fresh(fed: set[tuple[int, int]], grad_in: list[torch.Tensor],
          links: list[int] | None) -> bool:
    """Whether each input from outside the chain (``links``) hands its gradient to an autograd
    edge no call of the chain fed before (``x[t]`` each step: yes; one tensor every step: no,
    its gradient a sum over the calls, which the template does not foresee; a leaf: no, the
    same). Every input's edge is noted in ``fed``, the edges the chain's calls fed so far."""
    edges = [(id(t.grad_fn), t.output_nr) for t in grad_in]
    outside = [e for e, j in zip(edges, links or ()) if j < 0]
    new = links is not None and len(set(outside)) == len(outside) and all(
        e[0] != id(None) and e not in fed for e in outside)
    fed.update(edges)
    return new


def call_key(flat: list[Any], spec: Any, params: list[torch.Tensor]) -> Any:
    """A call's arguments' structure and specs (no offsets: a slice of the input, requiring
    grad or not, has a new offset each step; the previous call's outputs have the template's),
    their aliasing, and grad mode/autocast."""
    storages: dict[int, int] = {}
    leaves: list[Any] = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            if type(a) is not FakeTensor:
                return None
            shared = storages.setdefault(a.untyped_storage()._cdata, len(storages))
            leaves.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad,
                           a._is_view(), shared))
        elif is_plain(a):
            leaves.append(("value", frozen_value(a)))
        else:
            return None
    return (spec, tuple(leaves), autocast_key(),
            tuple((p.shape, p.dtype, p.requires_grad) for p in params))


class Call(Protocol):
    """What these checks read of a chained call (``stamp_chain._Call``)."""

    op0: int
    outs: list[int]
    edges: list[tuple[int, int]]
    end: int


Edge = tuple[int, int]  # an autograd node's id and an output of it: where a gradient goes


def edge(t: torch.Tensor) -> Edge:
    return (id(t.grad_fn), t.output_nr)


def read_after(nodes: Sequence[tuple[Any, int]], call: Call) -> bool:
    """Whether a traced op after ``call`` (``nodes``: its node, its index) takes one of the
    call's inputs' edges (a residual add reading a stacked cell's input). Made after the call,
    its node's backward runs first: its gradient waits in autograd's buffer for the call's,
    and no stamped call handed it (``ChainStamper.waiting``)."""
    wanted = set(call.edges)
    return any((id(f), nr) in wanted for node, index in nodes if index >= call.end
               for f, nr in node.next_functions if f is not None)


def reads(ops: list[Any], values: set[int]) -> dict[int, list[int]]:
    """The forward ops reading each of ``values``, in order."""
    out: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        for v in op.inputs:
            if v in values:
                out.setdefault(v, []).append(i)
    return out


def outputs_private(calls: Sequence[Call], n_ops: int, read: dict[int, list[int]]) -> None:
    """Each call's outputs but the last's are read outside the chain only before the next
    call: autograd then adds such a reader's gradient after the next call's, outside the
    chain's backward. A reader after it (outputs gathered after the loop) runs backward first,
    and the next call's backward would add onto its gradient: no template foresees that."""
    for call, nxt in itertools.pairwise(calls):
        for v in call.outs:
            if any(i >= nxt.op0 and not i < nxt.op0 + n_ops for i in read.get(v, ())):
                raise StampMismatch("a chained call's output read outside the chain after the "
                                    "next call")


def waiting(calls: Sequence[Call], fed: dict[Edge, list[int]]) -> list[int]:
    """The inputs requiring grad (positions) whose gradient from a chained call made after the
    call (layer i's next step reading layer i's ``h[t]``, which layer i+1's step reads: ``fed``,
    per edge the first ops of the chained calls reading it) is already in autograd's buffer
    when the call's backward runs: the same for every call but the last, which has none (nor
    has its side run's second call)."""
    def after(call: Call) -> tuple[int, ...]:
        return tuple(p for p, e in enumerate(call.edges)
                     if any(op0 > call.op0 for op0 in fed.get(e, ())))

    middle = {after(c) for c in calls[:-1]}
    if len(middle) != 1 or after(calls[-1]):
        raise StampMismatch("a chained call's inputs read by later chained calls unlike its "
                            "other calls'")
    return list(middle.pop())
