"""A stamped chained call's backward (``stamp_chain``): the records of its template window
(``chain_window.Window``), and the gradients it hands autograd: the incoming one where the call
passes it on as it is (a running loss), real fake tensors of the template's specs where it made
them (a view of one where it hands a slice), and, from the earliest stamped call only, the
weights' running sums. Where a gradient waits in autograd's buffer for an input, autograd would
add onto it after the call, not where the template's add is: the call writes that add, hands
autograd nothing for the input, and the waiting tensor stands for the sum from then on."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memplan.core import graph as g
from memplan.tracing.chain_window import Window
from memplan.tracing.opcache import fake_tensor
from memplan.tracing.stamp_check import matched
from memplan.tracing.stamp_emit import rewatch, unwatch, vid
from memplan.tracing.stamp_template import NEW, StampMismatch, tensor_spec
from memplan.tracing.tracer import StepTracer, _OpRec, _ValueRec

_META = torch.device("meta")


# Modules whose forward is torch's own and a fixed function of what a chained call's key
# holds (its arguments' specs, grad mode, autocast) and of the module's plain attributes.
_KNOWN = (torch.nn.LSTMCell.forward, torch.nn.GRUCell.forward, torch.nn.RNNCell.forward)


class OutSpec(NamedTuple):
    """One output of a known module's call: a dense tensor of its own."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int


class Known(NamedTuple):
    """What a known module's calls make, and its plain attributes when its first call did."""

    attrs: tuple[tuple[str, Any], ...]
    outs: list[OutSpec]


def known_outputs(module: torch.nn.Module, outs: list[Any]) -> Known | None:
    """What a stamped call of ``module`` makes, without running it: its first call's outputs
    (each a fresh tensor, not a view), where ``module`` is one of torch's RNN cells."""
    if type(module).forward not in _KNOWN or any(
            type(t) is not FakeTensor or t._is_view() or t.storage_offset() for t in outs):
        return None
    return Known(_attrs(module), [OutSpec(tuple(t.shape), t.stride(), t.dtype, t.fake_device,
                                          int(t.untyped_storage().nbytes())) for t in outs])


def _attrs(module: torch.nn.Module) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in vars(module).items()
                 if k[:1] != "_" and isinstance(v, (bool, int, float, str)))


def make_outputs(tracer: StepTracer, module: torch.nn.Module, known: Known
                 ) -> list[torch.Tensor] | None:
    """Fresh fake tensors of the known outputs' specs, untracked (as the module would have
    made them); None where the module's attributes changed since its first call."""
    if _attrs(module) != known.attrs:
        return None
    made = []
    for o in known.outs:
        with torch._C._DisableTorchDispatch():
            elem = torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=_META)
        if elem.untyped_storage().nbytes() != o.nbytes:
            raise StampMismatch("a known module's output is not its first call's")
        made.append(fake_tensor(tracer.fake, elem, o.device))  # type: ignore[arg-type]
    return made


def hold(tracer: StepTracer, codes: set[int], tensors: list[torch.Tensor],
         outs: dict[int, torch.Tensor]) -> dict[int, Any]:
    """Hold the call's arguments and outputs its nodes save, by code, as their saves would:
    split from the value where ``pack`` would make a proxy (held by value id, released by
    ``_run_events`` at the template's event), else the tensor itself."""
    held: dict[int, Any] = {}
    for c in sorted(codes):
        t = tensors[-1 - c] if c < 0 else outs[c]
        v = tracer._lookup(t) if type(t) is FakeTensor else None
        if v is not None and tracer.proxiable(t, v):
            tracer.hold(v)
            held[c] = v
        else:
            held[c] = t
    return held


class _At(NamedTuple):
    """Where one call's window is stamped: its first forward op and forward value, the event
    before the window, its first new value, and the values its outer codes name."""

    op0: int
    f0: int
    ws: int
    n0: int
    codes: list[int]


def emit_window(tracer: StepTracer, win: Window, op0: int, f0: int, outer: list[int],
                grads: tuple[Any, ...], sums_in: list[int], held: dict[int, Any],
                hand_sums: bool, specs: list[tuple[torch.device, torch.dtype]],
                waiting: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], list[int]]:
    """The window's records for one call, starting after the current event; returns what to
    hand autograd (per input requiring grad, then the sums if ``hand_sums``) and the values
    holding the running sums after it. ``waiting``: the gradients waiting for the inputs the
    window's ``waiting`` names."""
    gvids = _incoming(tracer, win, grads)
    if win.takes_sums and len(sums_in) != len(win.sums):
        raise StampMismatch("a middle chained call without running sums")
    wvids = _waiting(tracer, win, waiting)
    at = _At(op0, f0, tracer.event, len(tracer.values), [*outer, *gvids, *sums_in, *wvids])
    for i, (unpack, release) in enumerate(win.events):
        tracer.ops[op0 + i].unpack_event = -1 if unpack < 0 else at.ws + unpack
        tracer.ops[op0 + i].release_event = -1 if release < 0 else at.ws + release
    renamed = {win.handed[p][1]: t for p, t in zip(win.waiting, waiting)}
    made = _run_events(tracer, win, at, held, (hand_sums, renamed), specs)
    if held:
        raise StampMismatch("a saved argument of a chained call never released")
    tracer._grad_of = op0 + win.last_grad_of
    handed: list[torch.Tensor | None] = []
    for p, h in enumerate(win.handed):
        handed.append(None if p in win.waiting else grads[h[1]] if h[0] == "in" else made[h[1]])
    if hand_sums:
        handed.extend(made[NEW + k] for k in win.sums)
    return handed, [at.n0 + k for k in win.sums]


def _incoming(tracer: StepTracer, win: Window, grads: tuple[Any, ...]) -> list[int]:
    """The values of the call's incoming gradients (-1: none), each of the template's spec;
    one the window frees must be held by nothing else, or its death would be another's."""
    gvids = []
    for j, (grad, spec) in enumerate(zip(grads, win.incoming)):
        if (grad is None) != (spec is None):
            raise StampMismatch("a chained call's incoming gradients are not its template's")
        if grad is None:
            gvids.append(-1)
            continue
        v = tracer._lookup(grad) if type(grad) is FakeTensor else None
        if v is None or (tensor_spec(grad), grad._is_view(),
                         int(grad.untyped_storage().nbytes())) != spec:
            raise StampMismatch("a chained call's incoming gradient is not its template's")
        if j in win.dying and (tracer._proxies.get(v) or not unwatch(tracer, grad)):
            raise StampMismatch("a chained call's incoming gradient is held elsewhere")
        gvids.append(v)
    return gvids


def _waiting(tracer: StepTracer, win: Window, waiting: list[torch.Tensor]) -> list[int]:
    """The values of the gradients waiting for the call's inputs: alive, tracked, not saved
    by any node, of the spec of the sum the template hands on for them."""
    if len(waiting) != len(win.waiting):
        raise StampMismatch("a chained call's inputs find other gradients waiting than its "
                            "template's")
    wvids = []
    for p, t in zip(win.waiting, waiting):
        v = tracer._lookup(t)
        _, _, size, stride, offset, view = win.handed[p]
        if v is None or tracer.values[v].death is not None or tracer._proxies.get(v) \
                or (tuple(t.shape), t.stride(), t.storage_offset(), t._is_view()) \
                != (tuple(size), tuple(stride), offset, view):
            raise StampMismatch("a gradient waiting for a chained call's input is not the "
                                "template's")
        wvids.append(v)
    return wvids


def _run_events(tracer: StepTracer, win: Window, at: _At, held: dict[int, Any],
                hand: tuple[bool, dict[int, torch.Tensor]],
                specs: list[tuple[torch.device, torch.dtype]]) -> dict[int, torch.Tensor]:
    """The window event by event, in the order the traced backward records an event: its op,
    the values born, the peak, the deaths, the save proxies released. Returns the tensors made
    to hand on (by new value; ``NEW +`` it for a running sum). ``hand``: whether to hand on
    the running sums, and the waiting tensors that stand for new values from their birth."""
    hand_sums, renamed = hand
    real = {h[1]: h for h in win.handed if h[0] == "new"}
    sum_at = {k: p for p, k in enumerate(win.sums)} if hand_sums else {}
    made: dict[int, torch.Tensor] = {}
    if at.ws + 1 != len(tracer.ops) + len(tracer.backward_ops):
        raise StampMismatch("backward events out of step")
    values = tracer.values
    for r, (op, born, dead, released) in enumerate(win.schedule):
        e = at.ws + r
        tracer.event = e
        if op is not None:
            _emit_op(tracer, op, at)
        for k in born:
            if k in renamed:
                _rename(tracer, win, k, at.n0, renamed[k])
            else:
                _birth(tracer, win, k, at.n0, made, real, sum_at, specs)
        if op is not None:
            tracer._note_peak()
        for c in dead:
            rec = values[vid(c, at.f0, at.codes, at.n0)]
            rec.death = e
            tracer.live_bytes -= rec.nbytes
        for c in released:
            gone = held.pop(c, None)
            if isinstance(gone, int):
                tracer.release(gone)  # the value's death, if its tensor died before
            # a tensor held itself: its own callback records its death, at this event
    return made


def _emit_op(tracer: StepTracer, op: tuple[str, list[int], list[int], list[int], int, int],
             at: _At) -> None:
    """One backward op of the window, recorded as the tracer records a node's op; its flops
    counted to the forward op it is the gradient of."""
    target, inputs, outputs, mutated, flops, grad_of = op
    fwd_op = tracer.ops[at.op0 + grad_of]
    tracer.backward_ops.append(_OpRec(
        len(tracer.backward_ops), target, fwd_op.module,
        [vid(c, at.f0, at.codes, at.n0) for c in inputs], [at.n0 + c for c in outputs],
        [vid(c, at.f0, at.codes, at.n0) for c in mutated], [], flops, 0, at.op0 + grad_of))
    fwd_op.bwd_flops += flops


def _birth(tracer: StepTracer, win: Window, k: int, n0: int, made: dict[int, torch.Tensor],
           real: dict[int, tuple[Any, ...]], sum_at: dict[int, int],
           specs: list[tuple[torch.device, torch.dtype]]) -> None:
    nbytes, shape, dtype, numel, _ = win.values[k]
    hand = real.get(k)
    if hand is None and k not in sum_at:
        tracer.values.append(_ValueRec(n0 + k, nbytes, g.BACKWARD, -1, tracer.event, None,
                                       shape, dtype, numel))
        tracer.live_bytes += nbytes
        return
    position = win.handed.index(hand) if hand is not None else len(win.handed) + sum_at[k]
    device, torch_dtype = specs[position]
    with torch._C._DisableTorchDispatch():  # a fake tensor made as the fake mode makes one
        elem = torch.empty_strided(shape, _contiguous(shape), dtype=torch_dtype,
                                   device=_META)
        if elem.untyped_storage().nbytes() != nbytes:
            elem = torch.empty((nbytes // elem.element_size(),), dtype=torch_dtype,
                               device=_META)
    t = fake_tensor(tracer.fake, elem, device)  # type: ignore[arg-type]
    storage = t.untyped_storage()
    if tracer._add(t, storage, g.BACKWARD, -1) != n0 + k or storage.nbytes() != nbytes:
        raise StampMismatch("a handed-on gradient is not the template's")
    tracer.values[n0 + k].shape = shape
    if hand is not None:
        _, _, size, stride, offset, view = hand
        if view or tuple(size) != tuple(t.shape) or tuple(stride) != t.stride() or offset:
            with tracer.paused():
                t = t.as_strided(size, stride, offset)
        made[k] = t
    if k in sum_at:
        made[NEW + k] = t


def _rename(tracer: StepTracer, win: Window, k: int, n0: int, t: torch.Tensor) -> None:
    """New value ``k`` (an input's gradient, summed onto the one waiting for it) born in the
    waiting tensor, which autograd's buffer keeps: its death is the new value's."""
    nbytes, shape, dtype, numel, _ = win.values[k]
    if t.untyped_storage().nbytes() != nbytes or not rewatch(tracer, t, n0 + k):
        raise StampMismatch("a gradient waiting for a chained call's input is not the "
                            "template's")
    tracer.values.append(_ValueRec(n0 + k, nbytes, g.BACKWARD, -1, tracer.event, None,
                                   shape, dtype, numel))
    tracer.live_bytes += nbytes


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def foresaw(tracer: StepTracer, win: Window, op0: int, f0: int, outer: list[int]) -> bool:
    """Whether the traced backward of a chained call (forward ops from ``op0``, values from
    ``f0``) is ``win``'s, op for op, event for event, death for death."""
    hit = matched(tracer, win.ops, win.events, op0, f0, outer)
    if hit is None:
        return False
    ws, names = hit
    for r, codes in win.deaths.items():
        for c in codes:
            v = names.get(c) if c >= NEW or c <= -1 - len(outer) else f0 + c
            if v is None or tracer.values[v].death != ws + r:
                return False
    return True
