"""Trace once and stamp (issue 14, item 3): a module called again with what its first call had
(same structure, parameters' and input's specs, grad mode, autocast) runs its Python with the
tracer paused, inside one autograd node, and the records of its first call are emitted for it,
renumbered (``stamp_template``); its backward emits the template's backward records and hands
autograd gradients of the right specs. The Graph is the one the slow path records: tests/
tracing/test_stamp.py holds it to that, field by field.

Stamped: calls with one tensor input that requires grad and one tensor output made inside
(not a view written in place), of a module (not a leaf) repeated in the model with parameters
of its own (no weights registered twice), no hooks, called once, whose first call and side run
(``stamp_template``) read nothing from outside it. Anything else is traced as before.
Whatever a stamped call meets that its template did not foresee raises ``StampMismatch`` and
the capture runs again, unstamped: a tracked tensor dies while it runs; its incoming gradient
has other strides, is a view whose storage outlives the call (its base held elsewhere too), or
is shared and added to inside the unit; its backward never runs; a weight of it gets
gradients from elsewhere too; a first call's own backward is not its side run's
(``stamp_check``). ``benchmarks/capture_stamp_zoo.py`` compares every zoo entry.
A module called again and again on its own outputs, with the same weights each time (an
unrolled LSTM's step, one block applied repeatedly), is stamped by ``stamp_chain``.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memplan.tracing import chain_links, stamp_emit
from memplan.tracing.stamp_chain import ChainStamper
from memplan.tracing.stamp_check import foresaw
from memplan.tracing.stamp_template import (
    Backward,
    Ineligible,
    StampMismatch,
    Template,
    autocast_key,
    empty_like_strided,
    frozen_value,
    is_plain,
    no_oracle_ops,
    read_forward,
    side_run,
    tensor_spec,
)
from memplan.tracing.tracer import StepTracer

_VIEW_GRADS = frozenset(("aten.cat.default", "aten.stack.default"))  # backward: views of one
__all__ = ["StampMismatch", "Stamper"]


class Stamper:
    """Stamps repeated module calls under ``root`` into ``tracer``'s records."""

    def __init__(self, tracer: StepTracer, root: torch.nn.Module) -> None:
        self.tracer = tracer
        modules = list(root.named_modules())  # walked once: 4,000 modules in a ResNet-1000
        self.names = {id(m): name for name, m in modules}
        self.units = _units(root, modules)
        self.chain_units = _chain_units(modules, self.names, [m for m, _ in self.units])
        self.chains = ChainStamper(self)
        self.templates: dict[tuple[Any, ...], Template | None] = {}
        self.stamped = 0  # calls stamped
        self.backward_done = 0  # of which the backward ran
        self.handed: list[tuple[torch.Tensor, int | None]] = []  # (param, grad value handed)
        # (template, first op, first value, outer values) of each first call and stamped call
        self.firsts: list[tuple[Template, int, int, list[int]]] = []
        self.instances: list[tuple[Template, int, int, list[int]]] = []
        self._inside = 0  # unit calls under way
        # Keys whose first call's consumers are not read yet: (ops then, its output value)
        self._unread: dict[tuple[Any, ...], tuple[int, int]] = {}
        self._called: set[int] = set()  # units called so far (a second call shares weights)
        # Incoming gradients that are views: (their storage's death, [event due, event seen])
        self._views: list[tuple[weakref.ref[Any], list[int]]] = []

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Each unit's ``forward`` goes through the stamp while the block runs."""
        patched = []
        for module, key in self.units:
            original = module.forward
            module.forward = self._wrap(module, original, (key, _slots(module)))
            patched.append(module)
        for module in self.chain_units:
            original = module.forward
            module.forward = self._wrap_chain(module, original, _slots(module))
            patched.append(module)
        try:
            yield
        finally:
            for module in patched:
                del module.forward

    def _wrap(self, module: torch.nn.Module, original: Callable[..., Any], key: Any
              ) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            # Inside a unit being traced, stamped or side-run, a unit is part of it.
            if self._inside or kwargs or len(args) != 1:
                return original(*args, **kwargs)
            self._inside += 1
            try:
                return self._call(module, original, key, args[0])
            finally:
                self._inside -= 1
        return forward

    def _wrap_chain(self, module: torch.nn.Module, original: Callable[..., Any], slots: Any
                    ) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return original(*args, **kwargs)
            return self.chains.call(module, original, slots, args, kwargs)
        return forward

    def _call(self, module: torch.nn.Module, original: Callable[..., Any], key: Any,
              x: Any) -> Any:
        if type(x) is not FakeTensor or not x.requires_grad or not torch.is_grad_enabled():
            return original(x)
        key, (param_slots, buffer_slots) = key
        params = [sub._parameters[n] for sub, n in param_slots]
        if id(module) in self._called or any(p.grad is not None for p in params):
            return original(x)  # its grads would be added to: the shared-weight case
        self._called.add(id(module))
        full = (key, tuple(x.shape), x.stride(), x.dtype, x.device, x.storage_offset(), x._is_view(),
                autocast_key(), tuple((p.shape, p.dtype, p.requires_grad) for p in params))
        if full not in self.templates:
            return self._learn(full, module, original, x, params)
        template = self.templates[full]
        if template is not None and full in self._unread:
            template = self._read_consumers(full, template)
        if template is None:
            return original(x)
        buffers = [sub._buffers[n] for sub, n in buffer_slots]
        outer = [self.tracer._lookup(t) for t in (x, *params, *buffers)]
        if any(v is None for v in outer):
            return original(x)
        self.stamped += 1
        out = stamp_emit.Unit.apply(  # type: ignore[no-untyped-call]
            self, template, module, original, outer, x, *params)
        self.tracer.hook_accumulations(out.grad_fn)  # the parameters', as a traced call's
        return out

    def _learn(self, full: tuple[Any, ...], module: torch.nn.Module,
               original: Callable[..., Any], x: torch.Tensor, params: list[torch.Tensor]) -> Any:
        """The first call: traced as always, then read as the template of later calls."""
        tracer = self.tracer
        buffers = [b for _, b in module.named_buffers()]
        outer = [tracer._lookup(t) for t in (x, *params, *buffers)]
        if tracer._pending:
            tracer._hook_pending_nodes()
        op0, v0, c0 = len(tracer.ops), len(tracer.values), len(tracer.module_calls)
        frees, deaths = tracer.frees, len(tracer.user_deaths)
        out = original(x)
        self.templates[full] = None
        if any(v is None for v in outer) or type(out) is not FakeTensor \
                or tracer.event != len(tracer.ops) - 1:
            return out
        # Storages from outside the unit dying inside it: their events are not the unit's.
        if tracer.frees - frees != len(tracer.user_deaths) - deaths \
                or any(v < v0 for v in list(tracer.user_deaths)[deaths:]):
            return out
        path = self.names[id(module)]
        try:
            forward = read_forward(tracer, path, op0, v0, c0, outer, out)  # type: ignore[arg-type]
            no_oracle_ops(tracer, forward)
            names = ([n for n, _ in module.named_parameters()],
                     [n for n, _ in module.named_buffers()])
            backward = side_run(tracer, module, forward, names, x, params, buffers)
        except Ineligible:
            return out
        template = self.templates[full] = Template(
            forward, backward, self._rerun(module, forward, names, x, params, buffers))
        self.firsts.append((template, op0, v0, outer))  # type: ignore[arg-type]
        self._unread[full] = (len(tracer.ops), v0 + forward.out)
        return out

    def _rerun(self, module: torch.nn.Module, forward: Any, names: tuple[list[str], list[str]],
               x: torch.Tensor, params: list[torch.Tensor], buffers: list[torch.Tensor]
               ) -> Callable[[tuple[int, ...]], Backward]:
        """The unit's side run for another incoming gradient's strides, on stand-ins of its
        first call's tensors (holding those would keep them alive past their deaths)."""
        with self.tracer.paused():
            like = [empty_like_strided(t).requires_grad_(t.requires_grad)
                    for t in (x, *params, *buffers)]
        k = 1 + len(params)

        def rerun(incoming: tuple[int, ...]) -> Backward:
            self._inside += 1  # units inside it run plainly, as in the first side run
            try:
                with torch.enable_grad():  # called from a backward
                    return side_run(self.tracer, module, forward, names, like[0], like[1:k],
                                    like[k:], incoming)
            finally:
                self._inside -= 1
        return rerun

    def backward_for(self, template: Template, grad: Any) -> Backward:
        """The template's backward for this incoming gradient: its own, or where the gradient
        comes laid out otherwise (dense, not a view), a side run's for that layout (once per
        layout); a unit the side run cannot take falls back (``StampMismatch``)."""
        bwd = template.backward
        if not isinstance(grad, torch.Tensor) or tensor_spec(grad) == bwd.incoming_spec \
                or grad._is_view() or grad.storage_offset() \
                or not _dense(grad.shape, grad.stride()):
            template.used[bwd.incoming_spec] = bwd
            return bwd  # emit_backward's checks decide
        spec = tensor_spec(grad)
        if spec not in template.relaid:
            try:
                template.relaid[spec] = template.rerun(grad.stride())
            except Ineligible:
                template.relaid[spec] = None
        relaid = template.relaid[spec]
        if relaid is None or [c for c, _ in relaid.proxies] != [c for c, _ in bwd.proxies] \
                or relaid.saved != bwd.saved:
            raise StampMismatch("a side run for this incoming gradient's layout differs")
        template.used[spec] = relaid
        return relaid

    def _read_consumers(self, full: tuple[Any, ...], template: Template) -> Template | None:
        """Before the first stamp of a key: how the first call's output was consumed since.
        A concatenation (a U-Net's skip) hands the unit a slice of a larger gradient, and a
        view other than a reshape (a transpose) one laid out otherwise, which no template
        foresees: the capture would fall back, so the key is not stamped. A reshape (a linear
        layer's on 3-d input) hands a view of a gradient nothing else holds, which dies with
        it, as the template has it (``watch_view`` checks)."""
        start, out = self._unread.pop(full)
        if any(out in op.inputs and (op.target in _VIEW_GRADS or not (
                op.outputs or op.mutated or op.target in chain_links.RESHAPES))
               for op in self.tracer.ops[start:]):
            self.templates[full] = None
            return None
        return template

    def end_forward(self) -> None:
        """After the tracer read every node's saves: stamped ops get their template's, and the
        first calls' own saves must be the side runs' (else the stamp was wrong)."""
        self._inside += 1  # the chains' side runs call their modules
        try:
            self.chains.end_forward()
        finally:
            self._inside -= 1
        ops = self.tracer.ops
        for stamped, calls in ((False, self.firsts), (True, self.instances)):
            for template, op0, f0, outer in calls:
                for k, codes in enumerate(template.backward.saved):
                    saved = [stamp_emit.vid(c, f0, outer, 0) for c in codes]
                    if stamped:
                        ops[op0 + k].saved = saved
                    elif ops[op0 + k].saved != saved:
                        raise StampMismatch(f"op {op0 + k} saved {ops[op0 + k].saved}, "
                                            f"its side run {saved}")

    def watch_view(self, grad: torch.Tensor) -> None:
        """A stamped call's incoming gradient, a view, whose death its template put where a
        fresh gradient's would be: its storage must die when autograd drops it, at the end of
        the call's backward, with no event between (else its base was held elsewhere too)."""
        tracer = self.tracer
        seen = [tracer.event, -1]

        def died(_: Any) -> None:
            seen[1] = tracer.event
        self._views.append((weakref.ref(grad.untyped_storage(), died), seen))

    def finish(self) -> None:
        """Every stamped call's backward must have run (saves of a node that never ran die
        when the graph does: the template does not know when)."""
        if self.backward_done != self.stamped:
            raise StampMismatch(f"{self.stamped - self.backward_done} stamped backwards never ran")
        if any(due != seen for _, (due, seen) in self._views):
            raise StampMismatch("a stamped call's incoming gradient, a view, outlived the call")
        self._views.clear()
        self.chains.finish()
        # The first call's traced backward checks the one backward its stamped calls emitted
        # (its side run's, or one for another incoming layout: then the first call met it too).
        for template, op0, f0, outer in self.firsts:
            emitted = list(template.used.values())
            if emitted and (len(emitted) > 1 or not foresaw(self.tracer, emitted[0], op0, f0,
                                                            outer)):
                raise StampMismatch(f"{template.forward.path}'s backward is not its side run's")
        # A weight used outside its unit too: autograd added the grads, after the template.
        if any(p.grad is None or self.tracer._lookup(p.grad) != vid for p, vid in self.handed):
            raise StampMismatch("a stamped unit's parameter got gradients from elsewhere too")


def _dense(shape: Any, stride: Any) -> bool:
    """Whether a tensor of these sizes and strides fills its storage once (a permutation of
    a contiguous layout)."""
    expected = 1
    for size, step in sorted(zip(shape, stride), key=lambda d: d[1]):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _units(root: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]]
           ) -> list[tuple[torch.nn.Module, int]]:
    """Modules repeated under ``root`` (same structure, hyperparameters and parameter specs),
    with parameters of their own and no hooks: (module, structural key). A unit inside
    another is stamped only where the outer one is not (its call has two arguments, say).
    ``modules``: ``root.named_modules()``."""
    keys: dict[int, int] = {}
    _structure(root, keys, {})
    counts = Counter(keys.values())
    owners: Counter[int] = Counter(id(p) for _, p in root.named_parameters(remove_duplicate=False))
    calls: Counter[int] = Counter(id(m) for _, m in root.named_modules(remove_duplicate=False))
    units: list[tuple[torch.nn.Module, int]] = []
    for name, m in modules:
        if not name:
            continue
        # A leaf module is one op or two: not worth a template (and its output's gradient is
        # often handed to a sibling too, as add's backward does).
        if counts[keys[id(m)]] < 2 or not m._modules or calls[id(m)] > 1 or "forward" in vars(m):
            continue
        mine = Counter(id(p) for _, p in m.named_parameters(remove_duplicate=False))
        if not mine or any(owners[k] != n for k, n in mine.items()) or _hooked(m):
            continue
        units.append((m, keys[id(m)]))
    return units


def _chain_units(modules: list[tuple[str, torch.nn.Module]], names: dict[int, str],
                 units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Modules that may be called again and again on their own outputs (``stamp_chain``):
    not leaves (but torch's RNN cells, many ops each) nor containers, with parameters, no
    hooks, and neither they nor an ancestor of theirs (below the root) a unit or a unit's
    ancestor: the two stamps never share a top-level subtree. ``modules``: the root's
    ``named_modules()``; ``names``: their names by id."""
    near: set[str] = set()  # the units' paths and their ancestors'
    for u in units:
        near.update(_paths(names[id(u)]))
    return [m for name, m in modules
            if name and (m._modules or isinstance(m, torch.nn.RNNCellBase))
            and near.isdisjoint(_paths(name))
            and "forward" not in vars(m) and any(True for _ in m.parameters())
            and not _hooked(m) and type(m) not in (torch.nn.ModuleList, torch.nn.ModuleDict)]


def _paths(name: str) -> list[str]:
    """A module's dotted path and its ancestors' below the root: "a.b" -> ["a", "a.b"]."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _slots(module: torch.nn.Module) -> tuple[list[tuple[torch.nn.Module, str]], ...]:
    """Where ``module.named_parameters()`` and ``named_buffers()`` read their tensors, in
    their order: read at each call, as ``functional_call`` swaps what they hold."""
    params: list[tuple[torch.nn.Module, str]] = []
    buffers: list[tuple[torch.nn.Module, str]] = []
    seen: set[int] = set()
    for _, sub in module.named_modules():
        for slots, found in ((params, sub._parameters), (buffers, sub._buffers)):
            for name, t in found.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    slots.append((sub, name))
    return params, buffers


def _hooked(m: torch.nn.Module) -> bool:
    return any(getattr(s, a) for s in m.modules() for a in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _structure(m: torch.nn.Module, keys: dict[int, int], ids: dict[Any, int]) -> int:
    """What a module's forward may depend on besides its input (class, plain attributes such
    as stride, eps and training, other attributes by identity, parameters' and buffers' specs,
    children), numbered: equal numbers, equal structures. Fills ``keys`` for every module."""
    attrs = tuple(sorted((k, _attr_key(v)) for k, v in vars(m).items()
                         if k[:1] != "_"))  # keys unique: by key
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                    for n, t in (*m._parameters.items(), *m._buffers.items()) if t is not None)
    children = tuple((n, _structure(c, keys, ids)) for n, c in m._modules.items()
                     if c is not None)
    key = (type(m).__qualname__, type(m).__module__, attrs, tensors, children)
    keys[id(m)] = number = ids.setdefault(key, len(ids))
    return number


_SCALARS = frozenset((int, float, bool, str, type(None)))  # is_plain's types, exactly


def _attr_key(v: Any) -> Any:
    """``frozen_value(v)`` of a plain value, else ``("id", id(v))``. Scalars and flat tuples
    of them (a conv's stride, padding) are frozen here directly, not walked twice by the
    general rule (4,000 modules of six such attributes in a ResNet-1000)."""
    kind = type(v)
    if kind in _SCALARS:
        return kind, v
    if kind is tuple and all(type(x) in _SCALARS for x in v):
        return tuple, tuple((type(x), x) for x in v)
    return frozen_value(v) if is_plain(v) else ("id", id(v))
