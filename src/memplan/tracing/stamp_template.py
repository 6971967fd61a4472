"""A repeated unit's records, relative to the unit: what ``stamp`` emits for its later calls.

The forward part is read off the unit's first call, traced normally. The backward part comes
from a side run: the unit alone (fresh fake copies of its parameters, buffers and input) under
a tracer of its own, its output's gradient made by one op after it, so that the unit's backward
meets what it meets inside the model: an incoming gradient owned by autograd alone, an input
whose gradient flows on to another node (closing5: "a unit recorded alone reproduces its
backward minus the weight-buffer adds"; units with shared weights are never stamped).

Value references are codes: ``c >= NEW`` the unit's backward value ``c - NEW``; ``c >= 0`` its
forward value ``c``; ``c < 0`` the ``-1 - c``-th outer value: the input, the parameters and
buffers (in ``named_parameters``/``named_buffers`` order), then the incoming gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from memplan.core import graph as g
from memplan.errors import MemplanError
from memplan.tracing.tracer import StepTracer

NEW = 1 << 40
_PLAIN = (int, float, bool, str, type(None))


class StampMismatch(MemplanError):
    """Internal: a stamped call could not be made equal to its trace; capture runs unstamped.
    Never reaches the user (``capture.capture_target`` catches it)."""


class Ineligible(Exception):
    """This unit's records depend on more than the unit: its later calls are traced."""


@dataclass
class Forward:
    """The first call's forward records (op and event numbers relative to its first op)."""

    path: str
    ops: list[tuple[str, str, list[int], list[int], list[int], int]]  # target, module suffix,
    # inputs, outputs, mutated, fwd_flops
    values: list[tuple[int, tuple[int, ...], str, int, int, int | None, int | None]]  # nbytes,
    # shape, dtype, numel, birth, death, death of its own storage (forward)
    calls: list[tuple[str, int, int, int, bool]]  # path suffix, start, end, depth (relative), leaf
    out: int  # the output's forward value
    deaths: dict[int, list[int]] = field(default_factory=dict)  # event -> values (forward)
    more: list[int] = field(default_factory=list)  # further outputs' forward values

    @functools.cached_property
    def births(self) -> dict[int, list[int]]:
        """Op (relative) -> the values it makes, for every stamped call to replay."""
        out: dict[int, list[int]] = {}
        for k, v in enumerate(self.values):
            out.setdefault(v[4], []).append(k)
        return out


@dataclass
class Backward:
    """The unit's backward, events relative to the one before its first node ran."""

    ops: list[tuple[str, list[int], list[int], list[int], int, int]]  # target, inputs,
    # outputs (new values), mutated, flops, grad_of
    values: list[tuple[int, tuple[int, ...], str, int, int]]  # nbytes, shape, dtype, numel,
    # birth event
    real: dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]]  # new value -> (outer
    # index of what it is the gradient of, shape, stride): made as tensors, handed to autograd
    deaths: dict[int, list[int]]  # event -> codes that die then
    events: list[tuple[int, int]]  # per forward op: (unpack, release), -1: none
    proxies: list[tuple[int, int]]  # (code of input/output saved in the unit, release event)
    saved: list[list[int]]  # per forward op: codes of what it saved
    last_grad_of: int  # the forward op whose node ran last
    length: int  # events in the window
    incoming_read_only: bool  # no op of the window adds to or writes the incoming gradient
    incoming_spec: tuple[Any, ...] = ()  # its shape, strides, offset, dtype (``tensor_spec``)


@dataclass
class Template:
    forward: Forward
    backward: Backward
    # A side run of the unit for another incoming gradient's strides (a stamped call whose
    # output's consumers hand it, say, a transposed one): ``Stamper.backward_for``.
    rerun: Callable[[tuple[int, ...]], Backward]
    relaid: dict[tuple[Any, ...], Backward | None] = field(default_factory=dict)
    used: dict[tuple[Any, ...], Backward] = field(default_factory=dict)  # by stamped calls


def read_forward(tracer: StepTracer, path: str, op0: int, v0: int, c0: int,
                 outer: list[int], out: torch.Tensor, ends: tuple[int, int] | None = None,
                 modules: bool = True, more: tuple[torch.Tensor, ...] = (),
                 absolute: bool = False) -> Forward:
    """The forward records made since op ``op0``, value ``v0``, module call ``c0``, up to
    ``ends`` (op, value; default: all) (``modules=False``: ops' module paths not read, as a
    side run has none). ``more``: further outputs (``Forward.more``); ``absolute``: module
    paths kept whole (a module called again: its ops run in the same modules each time)."""
    code = {vid: -1 - k for k, vid in enumerate(outer)}
    op1, v1 = ends or (len(tracer.ops), len(tracer.values))
    n_ops = op1 - op0

    def rel(vid: int) -> int:
        if vid >= v0:
            return vid - v0
        if vid in code:
            return code[vid]
        raise Ineligible(f"reads value {vid}, made outside the unit")

    ops = []
    for op in tracer.ops[op0:op1]:
        if modules and not absolute and not (op.module == path
                                             or op.module.startswith(path + ".")):
            raise Ineligible(f"op in module {op.module}")
        module = op.module if absolute else op.module[len(path):] if modules else ""
        ops.append((op.target, module, [rel(v) for v in op.inputs],
                    [v - v0 for v in op.outputs], [rel(v) for v in op.mutated], op.fwd_flops))
    values = []
    out_vids = []
    for t in (out, *more):
        out_vid = tracer._lookup(t)
        if out_vid is None or not v0 <= out_vid < v1 or out_vid in out_vids:
            raise Ineligible("output not made in the unit")
        if t._is_view() and any(out_vid in op.mutated for op in tracer.ops[op0:op1]):
            # A view written in place: its gradient takes a path through autograd of its own
            # (CopySlices, a view op before the node), which one node for the unit does not.
            raise Ineligible("output a view written in place")
        out_vids.append(out_vid)
    out_vid = out_vids[0]
    fwd = Forward(path, ops, [], [], out_vid - v0, more=[v - v0 for v in out_vids[1:]])
    for v in tracer.values[v0:v1]:
        if v.kind != g.ACTIVATION:
            raise Ineligible(f"value of kind {v.kind}")
        own = tracer.user_deaths.get(v.id)
        if v.death is None and v.id not in out_vids and not tracer._proxies.get(v.id):
            raise Ineligible(f"a value outlives the unit, unsaved: {v}, "
                             f"{tracer.ops[v.producer].target}, {path}")
        values.append((v.nbytes, v.shape, v.dtype, v.numel, v.birth - op0,
                       None if v.death is None else v.death - op0,
                       None if own is None else own - op0))
        if v.death is not None:
            fwd.deaths.setdefault(v.death - op0, []).append(v.id - v0)
    fwd.values = values
    # Depths relative to the call's own (it is on the module stack now, as when a call is
    # stamped): one unit may be called at other depths (a first block, then others in a list).
    depth = len(tracer.module_stack)
    for c in tracer.module_calls[c0:]:
        if not absolute and not c.path.startswith(path + "."):
            raise Ineligible(f"module call {c.path}")
        fwd.calls.append((c.path if absolute else c.path[len(path):], c.start - op0,
                          c.end - op0, c.depth - depth, c.leaf))
    if any(b is not None and not 0 <= b < n_ops for _, _, _, _, b, _, _ in values):
        raise Ineligible("birth outside the unit")
    return fwd


def empty_like_strided(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor of ``t``'s shape, strides, dtype and device (contents unset)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def side_run(main: StepTracer, module: torch.nn.Module, fwd: Forward,
             names: tuple[list[str], list[str]], x: torch.Tensor,
             params: list[torch.Tensor], buffers: list[torch.Tensor],
             incoming: tuple[int, ...] | None = None) -> Backward:
    """The unit alone, forward and backward, on fresh fake copies under its own tracer.
    ``incoming``: the strides its output's gradient is to come with (default: the output's
    layout), made by the loss's op as autograd makes it (not a view, held by autograd alone)."""
    side = StepTracer(record=True, fake=main.fake)
    side._run = main._run  # the same fake-op cache
    with main.paused():
        x_leaf = empty_like_strided(x).requires_grad_()
        p2 = [empty_like_strided(p).requires_grad_(p.requires_grad) for p in params]
        b2 = [empty_like_strided(b) for b in buffers]
    outer = [side.register(x_leaf, g.INPUT)]
    outer += [side.register(p, g.PARAMETER) for p in p2]
    outer += [side.register(b, g.BUFFER) for b in b2]
    state = dict(zip(names[0], p2)) | dict(zip(names[1], b2))
    hooks = torch.autograd.graph.saved_tensors_hooks(side.pack, side.unpack)
    with main.paused(), side, hooks:
        xs = x_leaf.clone()
        outer[0] = side.register(xs, g.ACTIVATION)
        op0, v0 = len(side.ops), len(side.values)
        out = functional_call(module, state, (xs,))
        op1, v1 = len(side.ops), len(side.values)
        # How autograd reshapes the incoming gradient depends on its strides: recorded.
        incoming_spec: list[tuple[Any, ...]] = []
        out.register_hook(lambda grad: incoming_spec.append(tensor_spec(grad)))
        if incoming is None:
            loss = (out * 2.0).sum()
        else:  # mul's backward lays the gradient out as its other operand
            loss = (out * torch.empty_strided(out.shape, incoming, dtype=out.dtype,
                                              device=out.device)).sum()
    side.end_forward()
    _same_forward(side, fwd, (op0, op1), (v0, v1), outer, out)
    with main.paused(), side:
        loss.backward()
    grads = [x_leaf.grad] + [p.grad for p in p2]
    bwd = _read_backward(side, op0, op1, v0, v1, outer, grads, fwd.out)
    if len(incoming_spec) != 1:
        raise Ineligible("the output's gradient did not come once")
    if incoming is not None and incoming_spec[0][1] != incoming:
        raise Ineligible("the side run's incoming gradient is not laid out as asked")
    bwd.incoming_spec = incoming_spec[0]
    dead = {c for deaths in (bwd.deaths, fwd.deaths) for codes in deaths.values() for c in codes}
    if any(k not in dead and k != fwd.out for k in range(v1 - v0)) \
            or any(release < 0 for _, release in bwd.proxies):
        raise Ineligible("a value of the unit outlives its backward")
    return bwd


def _same_forward(side: StepTracer, fwd: Forward, ops: tuple[int, int],
                  values: tuple[int, int], outer: list[int], out: torch.Tensor) -> None:
    """The side run's forward must be the model's first call, renamed."""
    try:
        again = read_forward(side, fwd.path, ops[0], values[0], len(side.module_calls), outer,
                             out, (ops[1], values[1]), modules=False)
    except Ineligible as err:
        raise Ineligible(f"side run: {err}") from None
    if [(t, *rest) for t, _, *rest in again.ops] != [(t, *rest) for t, _, *rest in fwd.ops] \
            or [v[:4] for v in again.values] != [v[:4] for v in fwd.values] \
            or again.out != fwd.out:
        raise Ineligible("the side run's forward differs from the first call")


def _read_backward(side: StepTracer, op0: int, op1: int, v0: int, v1: int, outer: list[int],
                   grads: list[torch.Tensor | None], out: int) -> Backward:
    """The side run's backward window: from the event before the unit's first node ran to
    its last op or release, every event the unit's; codes as the module docstring says."""
    unit = range(op0, op1)
    ws, we, window = backward_window(side, unit)
    code = {vid: -1 - k for k, vid in enumerate(outer)}
    new0 = next((v.id for v in side.values if v.kind == g.BACKWARD and v.birth > ws), None)
    # The incoming gradient: made before the window, read and freed inside it. Other values
    # of the side run's own loss that die meanwhile (autograd frees a node's inputs late)
    # are the side run's, not the unit's.
    read = {v for b in window for v in b.inputs}
    before = {v.id for v in side.values[v1:] if v.kind == g.BACKWARD and v.birth <= ws}
    incoming = [v for v in sorted(before & read)
                if (d := side.values[v].death) is not None and ws < d <= we]
    if len(incoming) != 1:
        raise Ineligible("no single incoming gradient dies in the unit's backward")
    code[incoming[0]] = -1 - len(outer)

    def rel(vid: int) -> int:
        if new0 is not None and vid >= new0:
            return NEW + vid - new0
        if v0 <= vid < v1:
            return vid - v0
        if vid in code:
            return code[vid]
        raise Ineligible(f"backward reads value {vid} from outside the unit")

    ops = [(b.target, [rel(v) for v in b.inputs], [rel(v) - NEW for v in b.outputs],
            [rel(v) for v in b.mutated], b.fwd_flops, b.grad_of - op0) for b in window]
    first = len(side.values) if new0 is None else new0
    real = _handed(side, grads, first)
    values: list[tuple[int, tuple[int, ...], str, int, int]] = []
    deaths: dict[int, list[int]] = {}
    for v in side.values[first:]:
        if v.kind not in (g.BACKWARD, g.GRADIENT) or not ws < v.birth <= we:
            raise Ineligible("a value made after the unit's backward")
        values.append((v.nbytes, v.shape, v.dtype, v.numel, v.birth - ws))
        if (v.death is None or v.death > we) != (v.id - first in real):
            raise Ineligible("a backward value outlives the unit")
    for v in side.values:
        if v.death is not None and ws < v.death <= we and (v.id not in before
                                                            or v.id == incoming[0]):
            c = rel(v.id)
            if (c >= 0 and c != out) or c == -1 - len(outer):
                deaths.setdefault(v.death - ws, []).append(c)
    events = [(rel_event(side.ops[i].unpack_event, ws), rel_event(side.ops[i].release_event, ws))
              for i in unit]
    saved = [[rel(v) for v in side.ops[i].saved] for i in unit]
    # The unit's input and output live on outside it: kept by a save proxy each while a node
    # of the unit that saved them is alive, as autograd's saves keep them.
    proxies = [(c, max(events[i][1] for i, s in enumerate(saved) if c in s))
               for c in (-1, out) if any(c in s for s in saved)]
    last = max(unit, key=lambda i: side.ops[i].unpack_event)
    g_code = -1 - len(outer)
    read_only = not any(g_code in mutated or (g_code in inputs and target.startswith("aten.add"))
                        for target, inputs, _, mutated, _, _ in ops)
    return Backward(ops, values, real, deaths, events, proxies, saved, last - op0, we - ws,
                    read_only)


def backward_window(side: StepTracer, unit: range) -> tuple[int, int, list[Any]]:
    """The event before the unit's first node ran, its last event, and its backward ops:
    none of another node among them."""
    n_fwd = len(side.ops)
    starts = [side.ops[i].unpack_event for i in unit if side.ops[i].unpack_event >= 0]
    if not starts:
        raise Ineligible("no backward")
    ws = min(starts)
    window = [b for b in side.backward_ops if n_fwd + b.index > ws]
    inside = [b for b in window if b.grad_of in unit]
    we = max([n_fwd + b.index for b in inside] + [side.ops[i].release_event for i in unit])
    window = [b for b in window if n_fwd + b.index <= we]
    if len(inside) != len(window):
        raise Ineligible("backward interleaved with other nodes")
    return ws, we, window


def _handed(side: StepTracer, grads: list[torch.Tensor | None], first: int
            ) -> dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The gradients the unit hands on (its input's, its parameters'), by backward value:
    (position among input and parameters, shape, stride). Each must be a value of its own."""
    real = {}
    for k, t in enumerate(grads):
        if t is None:
            continue
        vid = side._lookup(t)
        if vid is None or vid < first or t.storage_offset() \
                or t.untyped_storage().nbytes() != side.values[vid].nbytes:
            raise Ineligible("a gradient the unit hands on is not a fresh value")
        real[vid - first] = (k, tuple(t.shape), tuple(t.stride()))
    return real


def tensor_spec(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


def rel_event(e: int, ws: int) -> int:
    """An event relative to a window starting at ws; -1 stays 'none'."""
    return -1 if e < 0 else e - ws


def autocast_key() -> tuple[Any, ...]:
    """The autocast state per device, part of a stamp's key: a call under another is traced."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in ("cpu", "cuda"))


def frozen_value(v: Any) -> Any:
    """A plain value, hashable and typed: 1, 1.0 and True are equal in Python but not to
    torch (``torch.full((), v)`` is an int64, a float32 or a bool), so each value is keyed
    with its type, and a list apart from a tuple. A partial: its function by identity."""
    if isinstance(v, (list, tuple)):
        return type(v), tuple(frozen_value(x) for x in v)
    if type(v) is functools.partial:
        return (functools.partial, id(v.func), frozen_value(v.args),
                frozen_value(tuple(sorted(v.keywords.items()))))
    return type(v), v


def is_plain(v: Any) -> bool:
    """Whether ``v`` is a plain value (or a list or tuple of them), compared by value; or a
    function's partial of plain arguments (an activation with its own, made per module:
    Hugging Face's ``GELUTanh``), whose function compares by identity."""
    if isinstance(v, _PLAIN):
        return True
    if type(v) is functools.partial:
        return is_plain(v.args) and is_plain(tuple(v.keywords.values()))
    return isinstance(v, (tuple, list)) and all(is_plain(x) for x in v)


def no_oracle_ops(tracer: StepTracer, forward: Any) -> None:
    """A data-dependent op takes the next answer of the real forward: not stampable."""
    oracle = tracer.oracle
    if oracle is None:
        return
    watched = {info.target for func, info in tracer._info.values() if oracle.watched(func)}
    if any(op[0] in watched for op in forward.ops):
        raise Ineligible("a data-dependent op")
