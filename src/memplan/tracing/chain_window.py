"""One chained call's backward window in ``chain_side``'s side run, read as a template
(``Window``): its ops, values, deaths and events relative to the event before its first node
ran, with the values it reads as codes (``chain_side``'s module docstring says which).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from memplan.core import graph as g
from memplan.tracing.stamp_template import NEW, Ineligible, backward_window, rel_event
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
    waiting: list[int] = field(default_factory=list)  # inputs (positions) whose gradient
    # waits in autograd's buffer: the call adds onto it and hands autograd the sum

    @functools.cached_property
    def schedule(self) -> list[tuple[Any, list[int], list[int], list[int]]]:
        """Per event of the window (relative): its op (None: no op), the new values born, the
        coded values that die, the saved arguments and outputs released (``chain_emit``
        replays it for every stamped call)."""
        out: list[tuple[Any, list[int], list[int], list[int]]] = [
            (None, [], self.deaths.get(r, []), []) for r in range(self.length + 1)]
        for k, op in enumerate(self.ops):
            out[1 + k] = (op, *out[1 + k][1:])
        for k, val in enumerate(self.values):
            out[val[4]][1].append(k)
        for c, r in self.releases.items():
            out[r][3].append(c)
        return out


class SideCall(NamedTuple):
    """One call of the side run: its forward ops and values, outer values, outputs."""

    op0: int
    op1: int
    v0: int
    v1: int
    outer: list[int]
    outs: list[torch.Tensor]


@dataclass
class _Codes:
    """How one call's backward names the values it reads: ``new0 <= v < new1`` its backward
    values, ``v0 <= v < v1`` its forward values, ``outer`` the rest it may read (arguments,
    weights and buffers, then the outputs' incoming gradients, the running sums, the gradients
    waiting for its inputs)."""

    new0: int
    new1: int
    v0: int
    v1: int
    outer: dict[int, int]
    n_outer: int  # the call's arguments, parameters and buffers
    n_out: int  # its outputs, one incoming gradient code each
    n_sums: int = 0  # running sums handed over

    def get(self, x: int) -> int | None:
        """``x``'s code, None where the call may not read it."""
        if self.new0 <= x < self.new1:
            return NEW + x - self.new0
        if self.v0 <= x < self.v1:
            return int(x - self.v0)
        return self.outer.get(x)

    def rel(self, x: int) -> int:
        c = self.get(x)
        if c is None:
            raise Ineligible(f"backward reads value {x} from outside the call")
        return c

    def take_sums(self, sums_in: list[int], sums_out: list[int]) -> None:
        """Code the running sums handed over (``sums_in``) after the incoming gradients."""
        # The running sums of the weights' gradients: made by the last call; a middle call
        # adds onto the next call's.
        if any(not self.new0 <= s < self.new1 for s in sums_out) \
                or any(s in self.outer or self.new0 <= s < self.new1 for s in sums_in):
            raise Ineligible("a running sum not where the chain puts it")
        for p, s_in in enumerate(sums_in):
            self.outer[s_in] = -1 - (self.n_outer + self.n_out + p)
        self.n_sums = len(sums_in)

    def take_waiting(self, waiting: list[int]) -> None:
        """Code the gradients waiting for the call's inputs after the running sums."""
        first = self.n_outer + self.n_out + self.n_sums
        for q, w in enumerate(waiting):
            if w in self.outer or self.new0 <= w < self.new1 or self.v0 <= w < self.v1:
                raise Ineligible("a waiting gradient not from a reader outside the call")
            self.outer[w] = -1 - (first + q)


def vids(side: StepTracer, ts: list[torch.Tensor]) -> list[int]:
    """The side run's values of tensors ``ts``, each tracked."""
    out = [side._lookup(t) for t in ts]
    if any(v is None for v in out):
        raise Ineligible("an untracked tensor")
    return out  # type: ignore[return-value]


def read_window(side: StepTracer, call: SideCall, incoming: list[tuple[int, Spec] | None],
                handed: list[tuple[int, Spec] | None], sums_in: list[int], sums_out: list[int],
                saved: list[list[int]], foreign: range | set[int],
                waits: tuple[list[int], list[int]] = ([], [])) -> Window:
    """One call's backward window: ``sums_in``/``sums_out`` the values holding each weight's
    running sum before (none: the last call) and after it; ``foreign``: values of the calls
    that must not die in this window unless coded; ``waits``: the inputs (positions) whose
    gradient waits for the call, and the values waiting."""
    unit = range(call.op0, call.op1)
    ws, we, window = backward_window(side, unit)
    outs = set(vids(side, call.outs))
    outer = _outer_codes(call.outer, incoming)
    born = _born(side, ws, we)
    codes = _Codes(born[0].id, born[-1].id + 1, call.v0, call.v1, outer, len(call.outer),
                   len(incoming))
    codes.take_sums(sums_in, sums_out)
    codes.take_waiting(waits[1])
    sums = [s - codes.new0 for s in sums_out]
    rel = codes.rel
    ops = [(b.target, [rel(v) for v in b.inputs], [rel(v) - NEW for v in b.outputs],
            [rel(v) for v in b.mutated], b.fwd_flops, b.grad_of - call.op0) for b in window]
    values = [(v.nbytes, v.shape, v.dtype, v.numel, v.birth - ws) for v in born]
    hands = _hands(side, handed, codes)
    if any(hands[p][0] != "new" for p in waits[0]):
        raise Ineligible("an input's waiting gradient is handed on as it came")
    # What the call hands on lives on after it; all else it makes dies inside it.
    kept = {h[1] for h in hands if h[0] == "new"} | set(sums)
    for v in born:
        if (v.death is None or v.death > we) != (v.id - codes.new0 in kept):
            raise Ineligible("a backward value outlives the call, or one handed on dies")
    deaths, dying = _deaths(side, (ws, we), codes, outs, foreign)
    events = [(rel_event(side.ops[i].unpack_event, ws), rel_event(side.ops[i].release_event, ws))
              for i in unit]
    releases = _releases(saved, events, call.v0, outs)
    last = max(unit, key=lambda i: side.ops[i].unpack_event)
    return Window(ops, values, deaths, events, we - ws, last - call.op0,
                  [None if inc is None else inc[1] for inc in incoming], dying, hands, sums,
                  releases, bool(sums_in), list(waits[0]))


def _outer_codes(outer: list[int], incoming: list[tuple[int, Spec] | None]) -> dict[int, int]:
    """Codes of the call's arguments, weights and buffers, then of each output's incoming
    gradient (by the value the side run caught it as)."""
    code: dict[int, int] = {v: -1 - k for k, v in enumerate(outer)}
    for j, inc in enumerate(incoming):
        if inc is not None:
            if inc[0] in code:
                raise Ineligible("one gradient for two outputs")
            code[inc[0]] = -1 - (len(outer) + j)
    return code


def _born(side: StepTracer, ws: int, we: int) -> list[Any]:
    """The values made in the window (the call's backward values): numbered contiguously,
    so that a stamped call can make them as one run of new values."""
    born = [v for v in side.values if v.kind in (g.BACKWARD, g.GRADIENT) and ws < v.birth <= we]
    if not born:
        raise Ineligible("no backward values")
    new0, new1 = born[0].id, born[-1].id + 1
    if [v.id for v in born] != list(range(new0, new1)):
        raise Ineligible("backward values not contiguous")
    return born


def _hands(side: StepTracer, handed: list[tuple[int, Spec] | None],
           codes: _Codes) -> list[tuple[Any, ...]]:
    """What the call hands each input requiring grad: an output's incoming gradient as it is
    (``("in", output)``), or a value it made (``("new", value, shape, stride, offset, is a
    view)``), so that a stamped call can hand autograd the same."""
    n_outer, n_out = codes.n_outer, codes.n_out
    hands: list[tuple[Any, ...]] = []
    for h in handed:
        if h is None:
            raise Ineligible("an input requiring grad gets none")
        hv, (tspec, view, nbytes) = h
        c = codes.outer.get(hv)
        if c is not None and c <= -1 - n_outer and -1 - c - n_outer < n_out:
            hands.append(("in", -1 - c - n_outer))
        elif codes.new0 <= hv < codes.new1 and nbytes == side.values[hv].nbytes:
            hands.append(("new", hv - codes.new0, tspec[0], tspec[1], tspec[2], view))
        else:
            raise Ineligible("a handed gradient neither incoming nor made in the call")
    return hands


def _deaths(side: StepTracer, window: tuple[int, int], codes: _Codes, outs: set[int],
            foreign: range | set[int]) -> tuple[dict[int, list[int]], set[int]]:
    """The coded values that die in the window, by event relative to it, and the outputs whose
    incoming gradient is among them. The call's outputs, arguments, weights and buffers are
    left out: real tensors, whose deaths the tracer records as any."""
    ws, we = window
    n_outer, n_out = codes.n_outer, codes.n_out
    deaths: dict[int, list[int]] = {}
    dying: set[int] = set()
    for v in side.values:
        if v.death is None or not ws < v.death <= we:
            continue
        c = codes.get(v.id)
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
    return deaths, dying


def _releases(saved: list[list[int]], events: list[tuple[int, int]], v0: int,
              outs: set[int]) -> dict[int, int]:
    """Per argument or output a node of the call saves (by code), the event its last saver
    releases it: a stamped call holds each by a save proxy until then."""
    releases: dict[int, int] = {}
    for k, codes in enumerate(saved):
        for c in codes:
            if c < 0 or v0 + c in outs:
                releases[c] = max(releases.get(c, -1), events[k][1])
    if any(r < 0 for r in releases.values()):
        raise Ineligible("a saved argument never released")
    return releases

