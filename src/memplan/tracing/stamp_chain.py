"""Stamps a module called again and again on its own outputs with the same weights each time
(an unrolled LSTM's step: issue 14, item 3). Its first call that takes inputs requiring grad is
traced and read as the forward template; later calls with the same input specs whose inputs
requiring grad are the previous call's outputs, each once and in order, and inputs from outside
the chain (an embedding's output per step, say) run inside one autograd node each and emit that
template. Their backward comes from a side run (``chain_side``) of two chained calls:
the first call's backward templates a middle call's, the second's the last call's (its outputs
not read on get no gradient; an input read by two of its nodes, a GRU's state or a residual
stream, gets their sum). The weights' gradients add up across calls: stamped nodes hand
autograd none; the stamper writes the adds the template holds and the earliest stamped call,
last to run backward, hands autograd the running sums, which the traced calls before it add
onto as they would. A call's outputs may be read outside the chain before the next call (a
loss per step, the next layer of a stacked LSTM); an input that a later chained call of
another chain reads too (layer i's ``h[t]``, read by layer i's step t+1) finds that call's
gradient waiting, and autograd adds onto it in the middle of the call's backward: the side
run's template holds that add, and the stamp writes it (``chain_emit``). Whatever the
template did not foresee raises ``StampMismatch``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from memplan.tracing import chain_emit, chain_links, chain_side
from memplan.tracing.stamp_emit import emit_forward, vid
from memplan.tracing.stamp_template import (
    Forward,
    Ineligible,
    StampMismatch,
    no_oracle_ops,
    read_forward,
)
from memplan.tracing.tracer import StepTracer

if TYPE_CHECKING:
    from memplan.tracing.stamp import Stamper


@dataclass
class _Call:
    """One call of a chain module: where its records start and what it read and made."""

    op0: int
    f0: int
    outer: list[int]  # tensor arguments, parameters, buffers (value ids)
    outs: list[int]  # its outputs' value ids (flattened)
    end: int = 0  # ops after it
    edges: list[chain_links.Edge] = field(default_factory=list)  # where its inputs requiring
    # grad hand their gradients (``chain_links.edge``)


@dataclass
class Chain:
    """A module's chained calls so far."""

    module: torch.nn.Module
    key: Any = None
    forward: Forward | None = None
    first: _Call | None = None
    args: list[Any] = field(default_factory=list)  # the first call's flattened arguments
    params: list[torch.Tensor] = field(default_factory=list)  # as the first call saw them
    buffers: list[torch.Tensor] = field(default_factory=list)
    held: set[int] | None = None  # codes of the arguments and outputs its nodes save
    targets: list[str] = field(default_factory=list)  # the first call's ops
    spec: Any = None
    out_spec: Any = None
    template: chain_side.ChainTemplate | None = None
    links: list[int] | None = None  # per input requiring grad: the output it is, or -1
    stamps: list[_Call] = field(default_factory=list)
    made: set[int] = field(default_factory=set)  # chained calls' outputs (values)
    fed: set[tuple[int, int]] = field(default_factory=set)  # the autograd edges its calls'
    # inputs requiring grad hand gradients to (the forward's graph holds their nodes: an id
    # is not reused while it runs)
    last: _Call | None = None
    sums: list[int] = field(default_factory=list)  # running sum of each weight's gradient
    done: int = 0  # stamped backwards run
    emitted: int = 0  # backward ops emitted
    broken: bool = False
    known: chain_emit.Known | None = None  # torch's own cells: what a call makes
    nodes_at: int = 0  # the tracer's traced nodes when its first call ended


class ChainStamper:
    def __init__(self, stamper: Stamper) -> None:
        self.stamper = stamper
        self.tracer: StepTracer = stamper.tracer
        self.chains: dict[int, Chain] = {}
        # Gradients stamped calls handed autograd for the edges a call made before them
        # waits on (``awaited``, from ``end_forward``): that call finds it in autograd's
        # buffer (``ChainUnit``).
        self.awaited: set[chain_links.Edge] = set()
        self.handed: dict[chain_links.Edge, weakref.ref[torch.Tensor]] = {}

    @contextmanager
    def inside(self) -> Iterator[None]:
        """Modules called inside this call are part of it, not stamped on their own."""
        self.stamper._inside += 1
        try:
            yield
        finally:
            self.stamper._inside -= 1

    @property
    def stamped(self) -> int:
        return sum(len(c.stamps) for c in self.chains.values())

    def call(self, module: torch.nn.Module, original: Any, slots: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        chain = self.chains.get(id(module))
        if chain is None:
            chain = self.chains[id(module)] = Chain(module)
        both = (args, kwargs)  # keyword arguments are arguments too (HF's ``**kwargs``)
        if chain.broken or not torch.is_grad_enabled():
            return self._traced(chain, original, both)
        flat, spec = tree_flatten(both)
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if not any(t.requires_grad for t in tensors):
            chain.last = None
            return original(*args, **kwargs)
        params = [sub._parameters[n] for sub, n in slots[0]]
        buffers = [sub._buffers[n] for sub, n in slots[1]]
        key = chain_links.call_key(flat, spec, params)
        if key is None or any(p.grad is not None for p in params):
            return self._traced(chain, original, both)
        tracer = self.tracer
        outer = [tracer._lookup(t) for t in (*tensors, *params, *buffers)]
        if any(v is None for v in outer):
            return self._traced(chain, original, both)
        ins = [v for v, t in zip(outer, tensors) if t.requires_grad]
        prev = chain.last
        grad_in = [t for t in tensors if t.requires_grad]
        links = None if prev is None else chain_links.links_of(
            ins, prev.outs, chain.made)  # type: ignore[arg-type]
        if not chain_links.fresh(chain.fed, grad_in, links):
            links = None
        if key != chain.key or chain.forward is None or links is None \
                or (chain.stamps and links != chain.links):
            if chain.stamps:
                return self._traced(chain, original, both)
            # Not yet stamped: this call is the template of those after it.
            chain.params, chain.buffers = params, buffers
            return self._learn(chain, module, original, both, key, outer)  # type: ignore[arg-type]
        if not chain.stamps and chain.first is not None and chain_links.read_after(
                tracer.hooked_nodes(chain.nodes_at), chain.first):
            return self._traced(chain, original, both)  # stamped, it would fall back
        chain.links = links
        return self._stamp(chain, module, original, flat, spec, outer, params)  # type: ignore[arg-type]

    def _traced(self, chain: Chain, original: Any,
                both: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        """A call the chain did not foresee: traced; no stamp from here on."""
        if chain.stamps:
            raise StampMismatch("a chained module called otherwise after a stamp")
        chain.broken = True
        return original(*both[0], **both[1])

    def _learn(self, chain: Chain, module: torch.nn.Module, original: Any,
               both: tuple[tuple[Any, ...], dict[str, Any]], key: Any, outer: list[int]) -> Any:
        tracer = self.tracer
        op0, v0, c0 = len(tracer.ops), len(tracer.values), len(tracer.module_calls)
        frees, deaths = tracer.frees, len(tracer.user_deaths)
        with self.inside():
            out = original(*both[0], **both[1])
        chain.key = key
        flat_out, out_spec = tree_flatten(out)
        if tracer.frees - frees != len(tracer.user_deaths) - deaths \
                or any(v < v0 for v in list(tracer.user_deaths)[deaths:]) \
                or not flat_out or any(type(t) is not FakeTensor for t in flat_out):
            chain.broken = True
            return out
        try:
            forward = read_forward(tracer, "", op0, v0, c0, outer, flat_out[0],
                                   more=tuple(flat_out[1:]), absolute=True)
            no_oracle_ops(tracer, forward)
        except Ineligible:
            chain.broken = True
            return out
        chain.forward = forward
        chain.targets = [op[0] for op in forward.ops]
        flat, spec = tree_flatten(both)
        # Specs only: holding the tensors would keep them alive.
        chain.args = [chain_side.ArgSpec(tuple(a.shape), a.stride(), a.dtype, a.device,
                                         a.requires_grad) if isinstance(a, torch.Tensor) else a
                      for a in flat]
        chain.spec, chain.out_spec = spec, out_spec
        outs = [v0 + forward.out, *(v0 + k for k in forward.more)]
        edges = [chain_links.edge(a) for a in flat
                 if isinstance(a, torch.Tensor) and a.requires_grad]
        chain.first = chain.last = _Call(op0, v0, outer, outs, len(tracer.ops), edges)
        chain.nodes_at = len(tracer._node_refs)
        chain.known = chain_emit.known_outputs(module, flat_out)
        chain.made.update(outs)
        return out

    def _stamp(self, chain: Chain, module: torch.nn.Module, original: Any, flat: list[Any],
               spec: Any, outer: list[int], params: list[torch.Tensor]) -> Any:
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        grad_in = [t for t in tensors if t.requires_grad]
        hand = params if not chain.stamps else []
        if chain.held is None:
            chain.held = self._first_saves(chain, len(tensors))
        outs = ChainUnit.apply(  # type: ignore[no-untyped-call]
            self, chain, original, flat, spec, outer, len(grad_in), *grad_in, *hand)
        return tree_unflatten(list(outs), chain.out_spec)

    def _first_saves(self, chain: Chain, n_tensors: int) -> set[int]:
        """What the first call's nodes save among its arguments and outputs (codes), read
        off its nodes now (``end_forward`` reads them again, to the same lists)."""
        tracer = self.tracer
        first, fwd = chain.first, chain.forward
        assert first is not None and fwd is not None
        n_values = len(tracer.values)
        end = first.op0 + len(fwd.ops)
        for node, index in tracer.hooked_nodes():
            if first.op0 <= index < end:
                tracer._collect_saved(node, index)
        if len(tracer.values) != n_values:
            raise StampMismatch("the first chained call saves a tensor no op made")
        code = {v: -1 - i for i, v in enumerate(first.outer[:n_tensors])}
        code.update({v: v - first.f0 for v in first.outs})
        return {code[v] for op in tracer.ops[first.op0:end] for v in op.saved if v in code}

    # --- after the forward, and after the step -------------------------------------------

    def end_forward(self) -> None:
        """Side runs of every chain stamped; the stamped ops get their template's saves."""
        tracer = self.tracer
        stamped = [c for c in self.chains.values() if c.stamps]
        calls_of = {id(c): _calls(c) for c in stamped}
        reads = chain_links.reads(tracer.ops, {v for calls in calls_of.values()
                                               for call in calls for v in call.outs})
        fed: dict[chain_links.Edge, list[int]] = {}
        for calls in calls_of.values():
            for call in calls:
                for e in call.edges:
                    fed.setdefault(e, []).append(call.op0)
        for chain in stamped:
            assert chain.forward is not None and chain.first is not None and chain.last
            after = tracer.ops[chain.last.end:]
            read_after = {v for op in after for v in op.inputs}
            used = [j for j, v in enumerate(chain.last.outs) if v in read_after]
            viewed = [j for j in used if chain_links.reshaped(after, chain.last.outs[j])]
            calls = calls_of[id(chain)]
            chain_links.outputs_private(calls, len(chain.forward.ops), reads)
            waiting = chain_links.waiting(calls, fed)
            self.awaited.update(call.edges[p] for call in calls[:-1] for p in waiting)
            try:
                assert chain.links is not None
                chain.template = chain_side.side_run(
                    tracer, chain.module, chain.forward, chain.args, chain.spec, chain.params,
                    chain.buffers, used, chain.links, viewed, waiting)
            except Ineligible as err:
                raise StampMismatch(f"chain side run: {err}") from None
            saved = chain.template.saved
            if set(chain.template.middle.releases) != chain.held \
                    or set(chain.template.last.releases) != chain.held:
                raise StampMismatch("the side run saves other arguments or outputs")
            first = chain.first
            for k, codes in enumerate(saved):
                if tracer.ops[first.op0 + k].saved != [vid(c, first.f0, first.outer, 0)
                                                       for c in codes]:
                    raise StampMismatch("the first chained call's saves are not its side run's")
            for call in chain.stamps:
                for k, codes in enumerate(saved):
                    tracer.ops[call.op0 + k].saved = [vid(c, call.f0, call.outer, 0)
                                                      for c in codes]

    def waiting(self, call: _Call, inputs: list[int]) -> list[torch.Tensor]:
        """The gradients waiting in autograd's buffers for the call's ``inputs`` (positions):
        each one a stamped call of a chain handed autograd for it (a traced reader's is not
        known here: the stamp falls back)."""
        out = []
        for p in inputs:
            ref = self.handed.pop(call.edges[p], None)
            t = None if ref is None else ref()
            if t is None:
                raise StampMismatch("a gradient waiting for a chained call's input came from "
                                    "no stamped call")
            out.append(t)
        return out

    def finish(self) -> None:
        self.handed.clear()
        self.awaited.clear()
        tracer = self.tracer
        for chain in self.chains.values():
            if not chain.stamps:
                continue
            if chain.done != len(chain.stamps):
                raise StampMismatch("a stamped chained call's backward never ran")
            n = len(chain.forward.ops)  # type: ignore[union-attr]
            stamped = {call.op0 + k for call in chain.stamps for k in range(n)}
            attributed = sum(1 for b in tracer.backward_ops if b.grad_of in stamped)
            if attributed != chain.emitted:
                raise StampMismatch("autograd added to a stamped chained call's gradients")
            first = chain.first
            assert first is not None and chain.template is not None
            if not chain_emit.foresaw(tracer, chain.template.middle, first.op0, first.f0,
                                      first.outer):
                raise StampMismatch("the first chained call's backward is not its side run's")


def _calls(chain: Chain) -> list[_Call]:
    """A stamped chain's calls: its first (traced), then its stamped ones."""
    assert chain.first is not None
    return [chain.first, *chain.stamps]


class ChainUnit(torch.autograd.Function):
    """One stamped chained call: ``apply(chains, chain, original, flat, spec, outer, n_in,
    *inputs requiring grad, *parameters (the first stamped call only))``."""

    @staticmethod
    def forward(ctx: Any, chains: ChainStamper, chain: Chain, original: Any, flat: list[Any],
                spec: Any, outer: list[int], n_in: int, *tensors: torch.Tensor) -> Any:
        tracer = chains.tracer
        if tracer._pending:
            tracer._hook_pending_nodes()
        frees = tracer.frees
        fwd = chain.forward
        assert fwd is not None
        codes = [fwd.out, *fwd.more]
        # torch's own cell: what it makes follows from the call's key (``known_outputs``).
        made = None if chain.known is None else chain_emit.make_outputs(tracer, chain.module,
                                                                         chain.known)
        if made is not None:
            flat_out, out_spec = made, chain.out_spec
        else:
            ran: list[str] = []
            tracer.paused_ops = ran
            try:
                pos, kw = tree_unflatten(flat, spec)
                with tracer.paused(), chains.inside():
                    out = original(*pos, **kw)
            finally:
                tracer.paused_ops = None
            flat_out, out_spec = tree_flatten(out)
            # The module's Python may take another path than its first call's (a counter,
            # say): the ops it ran must be the template's.
            if chain_links.no_clones(ran) != chain_links.no_clones(chain.targets):
                raise StampMismatch("a stamped chained call ran other ops than its first call")
        if tracer.frees != frees or out_spec != chain.out_spec or len(flat_out) != len(codes) \
                or any(type(t) is not FakeTensor or tracer._lookup(t) is not None
                       for t in flat_out):
            raise StampMismatch("a stamped chained call freed a tracked tensor or its outputs "
                                "are not its first call's")
        op0, f0 = len(tracer.ops), len(tracer.values)
        emit_forward(tracer, fwd, "", dict(zip(codes, flat_out)), outer)
        call = _Call(op0, f0, outer, [f0 + c for c in codes], len(tracer.ops),
                     [chain_links.edge(t) for t in tensors[:n_in]])
        chain.stamps.append(call)
        chain.last = call
        chain.made.update(call.outs)
        ctx.set_materialize_grads(False)
        assert chain.held is not None
        args = [a for a in flat if isinstance(a, torch.Tensor)]
        ctx.state = (chains, chain, call, n_in,
                     chain_emit.hold(tracer, chain.held, args, dict(zip(codes, flat_out))))
        ctx.specs = [(t.device, t.dtype) for t in tensors]
        return tuple(flat_out)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        chains, chain, call, n_in, held = ctx.state
        ctx.state = None
        tracer = chains.tracer
        template = chain.template
        if template is None:
            raise StampMismatch("no side run for a stamped chained call")
        pattern = [g is None for g in grads]
        last = chain.done == 0 and pattern == [s is None for s in template.last.incoming]
        if not last and pattern != [s is None for s in template.middle.incoming]:
            raise StampMismatch("a chained call's incoming gradients fit no template")
        window = template.last if last else template.middle
        hand_sums = len(ctx.specs) > n_in
        if hand_sums and (last or chain.done != len(chain.stamps) - 1):
            raise StampMismatch("the running sums would be handed on by the last call's variant")
        before = len(tracer.backward_ops)
        handed, sums = chain_emit.emit_window(tracer, window, call.op0, call.f0, call.outer,
                                              grads, chain.sums, held, hand_sums, ctx.specs,
                                              chains.waiting(call, window.waiting))
        for e, t in zip(call.edges, handed):
            if t is not None and e in chains.awaited:
                chains.handed[e] = weakref.ref(t)
        chain.emitted += len(tracer.backward_ops) - before
        chain.sums = sums
        chain.done += 1
        return (None,) * 7 + tuple(handed)
