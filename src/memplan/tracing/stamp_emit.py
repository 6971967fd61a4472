"""A stamped call (``stamp``): one autograd node whose forward runs the unit's Python with the
tracer paused and emits its template's forward records, and whose backward emits the template's
backward records and hands autograd gradients of the template's specs.

Emitted records follow the tracer's own order at every event: the op, the values it makes, the
peak, then what dies after it. Values that stay inside the unit are records only; the unit's
output and the gradients it hands on are real fake tensors, tracked by the tracer as any other,
so their deaths outside the unit are seen as the slow path sees them. The unit's input and
output, where the unit saves them, are held by a save proxy (``StepTracer.pack``) until the
template's node that saved them is released, as autograd would hold them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memplan.core import graph as g
from memplan.tracing.opcache import fake_tensor
from memplan.tracing.stamp_template import (
    NEW,
    Backward,
    Forward,
    StampMismatch,
    Template,
    tensor_spec,
)
from memplan.tracing.tracer import StepTracer, _OpRec, _ValueRec

if TYPE_CHECKING:
    from memplan.tracing.stamp import Stamper

_META = torch.device("meta")


def vid(code: int, f0: int, outer: list[int], n0: int) -> int:
    """The value id a template code stands for in one call (see ``stamp_template``)."""
    if code >= NEW:
        return n0 + code - NEW
    if code >= 0:
        return f0 + code
    return outer[-1 - code]


class Unit(torch.autograd.Function):
    """One stamped call: ``apply(stamper, template, module, original, outer, x, *params)``."""

    @staticmethod
    def forward(ctx: Any, stamper: Stamper, template: Template, module: Any, original: Any,
                outer: list[int], x: torch.Tensor, *params: torch.Tensor) -> Any:
        tracer = stamper.tracer
        if tracer._pending:  # as the unit's first op would have
            tracer._hook_pending_nodes()
        frees = tracer.frees
        with tracer.paused():
            out = original(x)
        if tracer.frees != frees or type(out) is not FakeTensor \
                or tracer._lookup(out) is not None:
            raise StampMismatch("a stamped call freed a tracked tensor or returned one it read")
        op0, f0 = len(tracer.ops), len(tracer.values)
        emit_forward(tracer, template.forward, stamper.names[id(module)],
                     {template.forward.out: out}, outer)
        stamper.instances.append((template, op0, f0, outer))
        ctx.state = (stamper, template, op0, f0, outer, _proxies(tracer, template, x, out))
        ctx.specs = [(x.device, x.dtype)] + [(p.device, p.dtype) for p in params]
        ctx.needs = [t.requires_grad for t in (x, *params)]
        ctx.params = params
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        stamper, template, op0, f0, outer, proxies = ctx.state
        ctx.state = None
        bwd = stamper.backward_for(template, grads[0])
        made = emit_backward(stamper.tracer, bwd, op0, f0, outer, grads[0],
                             _by_release(bwd, proxies), ctx.specs, stamper.watch_view)
        stamper.backward_done += 1
        # Each parameter's grad must end as handed (nothing else adds to it): ``finish``.
        stamper.handed.extend((p, stamper.tracer._lookup(made[k + 1]))
                              for k, p in enumerate(ctx.params) if k + 1 in made)
        handed = [made.get(k) if need else None for k, need in enumerate(ctx.needs)]
        return (None, None, None, None, None, *handed)


def _proxies(tracer: StepTracer, template: Template, x: torch.Tensor, out: torch.Tensor
             ) -> list[torch.Tensor]:
    """Save proxies of the unit's input and output, in the order of the template's
    ``proxies`` (their release events: those of the backward that runs)."""
    return [tracer.pack(x if code == -1 else out) for code, _ in template.backward.proxies]


def _by_release(bwd: Backward, proxies: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """The save proxies by the event ``bwd`` releases them (the caller keeps no reference:
    each dies when ``emit_backward`` drops it)."""
    held: dict[int, list[torch.Tensor]] = {}
    for (_, release), proxy in zip(bwd.proxies, proxies):
        held.setdefault(release, []).append(proxy)
    proxies.clear()
    return held


def emit_forward(tracer: StepTracer, fwd: Forward, path: str, outs: dict[int, torch.Tensor],
                 outer: list[int]) -> None:
    """The forward records of ``fwd`` for one call starting now; ``outs``: its outputs (real
    tensors), by forward value."""
    op0, f0 = len(tracer.ops), len(tracer.values)
    values, ops = tracer.values, tracer.ops
    births = fwd.births
    for i, (target, module, inputs, outputs, mutated, flops) in enumerate(fwd.ops):
        tracer.event = op0 + i
        ops.append(_OpRec(op0 + i, target, path + module, [vid(c, f0, outer, 0) for c in inputs],
                          [f0 + c for c in outputs], [vid(c, f0, outer, 0) for c in mutated],
                          [], flops))
        for k in births.get(i, ()):
            nbytes, shape, dtype, numel, _, _, own = fwd.values[k]
            out = outs.get(k)
            if out is not None:
                storage = out.untyped_storage()
                if tracer._add(out, storage, g.ACTIVATION, op0 + i) != f0 + k \
                        or storage.nbytes() != nbytes:
                    raise StampMismatch("the output is not the template's")
                values[f0 + k].shape = shape  # its op's shape (the unit may return a view)
                continue
            values.append(_ValueRec(f0 + k, nbytes, g.ACTIVATION, op0 + i, op0 + i, None,
                                    shape, dtype, numel))
            tracer.live_bytes += nbytes
            if own is not None:
                tracer.user_deaths[f0 + k] = op0 + own
        tracer._note_peak()
        for k in fwd.deaths.get(i, ()):
            rec = values[f0 + k]
            rec.death = op0 + i
            tracer.live_bytes -= rec.nbytes
    base = len(tracer.module_stack)  # the call's own depth, as when its template was read
    for suffix, start, end, depth, leaf in fwd.calls:
        tracer.module_calls.append(g.ModuleCall(path + suffix, op0 + start, op0 + end,
                                                base + depth, leaf))


def emit_backward(tracer: StepTracer, bwd: Backward, op0: int, f0: int, outer: list[int],
                  grad: Any, proxies: dict[int, list[torch.Tensor]],
                  specs: list[tuple[torch.device, torch.dtype]],
                  watch_view: Callable[[torch.Tensor], None]) -> dict[int, torch.Tensor]:
    """A template's backward records for one call, starting after the current event;
    returns the gradients to hand on, by position among (input, *params). ``watch_view``:
    called with the incoming gradient where it is a view whose death the template claims."""
    gvid = tracer._lookup(grad) if isinstance(grad, torch.Tensor) else None
    # The incoming gradient: autograd alone holds it (then it dies after the unit's first op,
    # as templated), or also another node's input buffer (add's backward hands one tensor to
    # both branches: then it outlives the unit, tracked as any tensor; never accumulated into
    # inside the unit then: autograd accumulates in place only into a tensor nothing else
    # holds). Or a view (a linear layer's gradient on 3-d input, reshaped back): its storage
    # dies when autograd drops it if nothing else holds its base, as a fresh gradient would;
    # ``watch_view`` checks that when it dies. Its strides decide how autograd reshapes it:
    # the template's.
    shared = gvid is not None and grad._use_count() > 1
    holders = torch._C._storage_Use_Count(grad.untyped_storage()._cdata) - 1  # this call's
    view = grad._is_view()
    if gvid is None or tracer._proxies.get(gvid) or tensor_spec(grad) != bwd.incoming_spec \
            or (holders > grad._use_count() and not view) \
            or (shared and not bwd.incoming_read_only) or not (shared or unwatch(tracer, grad)):
        raise StampMismatch("the incoming gradient is not one the template foresaw")
    incoming = -1 - len(outer)
    outer = [*outer, gvid]
    ws, n0 = tracer.event, len(tracer.values)
    values, ops = tracer.values, tracer.ops
    births: dict[int, list[int]] = {}
    for k, v in enumerate(bwd.values):
        births.setdefault(v[4], []).append(k)
    for i, (unpack, release) in enumerate(bwd.events):
        ops[op0 + i].unpack_event = -1 if unpack < 0 else ws + unpack
        ops[op0 + i].release_event = -1 if release < 0 else ws + release
    made: dict[int, torch.Tensor] = {}
    ops_at = {ws + 1 + k: op for k, op in enumerate(bwd.ops)}
    backward_ops = tracer.backward_ops
    n_fwd = len(ops)
    for r in range(bwd.length + 1):
        e = ws + r
        tracer.event = e
        op = ops_at.get(e)
        if op is not None and e - n_fwd - len(backward_ops) != 0:
            raise StampMismatch("backward events out of step")
        if op is not None:
            target, inputs, outputs, mutated, flops, grad_of = op
            fwd_op = ops[op0 + grad_of]
            backward_ops.append(_OpRec(
                len(backward_ops), target, fwd_op.module, [vid(c, f0, outer, n0) for c in inputs],
                [n0 + c for c in outputs], [vid(c, f0, outer, n0) for c in mutated], [], flops, 0,
                op0 + grad_of))
            fwd_op.bwd_flops += flops
        for k in births.get(r, ()):
            _birth(tracer, bwd, k, n0, made, specs)
        if op is not None:
            tracer._note_peak()
        for c in bwd.deaths.get(r, ()):
            if shared and c == incoming:
                continue
            rec = values[vid(c, f0, outer, n0)]
            rec.death = e
            tracer.live_bytes -= rec.nbytes
        proxies.pop(r, None)  # the proxies' own callbacks record the deaths, at this event
    tracer._grad_of = op0 + bwd.last_grad_of
    if view and not shared:
        watch_view(grad)  # due when autograd drops it: after this event
    return made


def _birth(tracer: StepTracer, bwd: Any, k: int, n0: int, made: dict[int, torch.Tensor],
           specs: list[tuple[torch.device, torch.dtype]]) -> None:
    nbytes, shape, dtype, numel, _ = bwd.values[k]
    real = bwd.real.get(k)
    if real is None:
        tracer.values.append(_ValueRec(n0 + k, nbytes, g.BACKWARD, -1, tracer.event, None,
                                       shape, dtype, numel))
        tracer.live_bytes += nbytes
        return
    position, size, stride = real
    device, torch_dtype = specs[position]
    with torch._C._DisableTorchDispatch():  # a fake tensor made as the fake mode makes one
        elem = torch.empty_strided(size, stride, dtype=torch_dtype, device=_META)
    t = fake_tensor(tracer.fake, elem, device)  # type: ignore[arg-type]
    storage = t.untyped_storage()
    if tracer._add(t, storage, g.BACKWARD, -1) != n0 + k or storage.nbytes() != nbytes:
        raise StampMismatch("a handed-on gradient is not the template's")
    tracer.values[n0 + k].shape = shape  # the shape it was made with (a view of it is handed)
    made[position] = t


def unwatch(tracer: StepTracer, t: torch.Tensor) -> bool:
    """Stop tracking ``t``'s storage (the stamp records its death): False if not tracked."""
    storage = t.untyped_storage()
    entry = tracer._watched.pop(weakref.ref(storage), None)
    if entry is None:
        return False
    tracer._by_storage.pop(storage._cdata, None)
    return True


def rewatch(tracer: StepTracer, t: torch.Tensor, vid: int) -> bool:
    """Track ``t``'s storage as value ``vid`` from now on (its death is ``vid``'s): False if
    it is not tracked."""
    ref = weakref.ref(t.untyped_storage())
    entry = tracer._watched.get(ref)
    if entry is None:
        return False
    tracer._watched[ref] = (entry[0], vid)
    tracer._by_storage[entry[0]] = vid
    return True
