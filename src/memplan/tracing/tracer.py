"""Watches one training step op by op: every storage born and freed, and (when recording) the
ops, their inputs/outputs, what autograd saves for each, their FLOPs and module paths.

One ``TorchDispatchMode`` serves both capture (fake tensors) and measurement (fake or real):
storages are identified by their ``StorageImpl`` and a ``weakref.finalize`` on the storage
object tells us when it dies, so the live-byte count is O(1) per op (torch's ``MemTracker``
rescans every weak reference on every op instead: ~245 s on ResNet-1000 here).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from memplan.core import graph as g


@dataclass
class _ValueRec:
    id: int
    nbytes: int
    kind: str
    producer: int
    birth: int
    death: int | None
    shape: tuple[int, ...]
    dtype: str


@dataclass
class _OpRec:
    index: int
    target: str
    module: str
    inputs: list[int]
    outputs: list[int]
    mutated: list[int]
    saved: list[int] = field(default_factory=list)
    fwd_flops: int = 0
    bwd_flops: int = 0
    grad_of: int = -1
    unpack_event: int = -1
    release_event: int = -1


_DETACH = torch.ops.aten.detach.default


def is_counted(func: Any) -> bool:
    """Whether an op gets an index in the captured forward (the runtime counts the same way)."""
    return func.namespace != "prim" and func is not _DETACH


def _mutated_arg_positions(func: Any) -> tuple[int, ...]:
    return tuple(
        i
        for i, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


class StepTracer(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts live storage bytes through a step; with ``record=True`` also builds a Graph."""

    def __init__(self, record: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.record = record
        self.phase = "forward"
        self.event = -1
        self.values: list[_ValueRec] = []
        self._by_storage: dict[int, int] = {}
        self._finalizers: list[weakref.finalize[Any, Any]] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_event = -1
        self.forward_peak_bytes = 0
        self.ops: list[_OpRec] = []
        self.backward_ops: list[_OpRec] = []
        self.module_stack: list[tuple[str, int, int]] = []  # (path, start op, child calls)
        self.module_calls: list[g.ModuleCall] = []
        self.in_model = False
        self.model_ops = 0  # forward ops inside the model call (the rest is the loss)
        self._paused = 0
        self._grad_of = -1
        self._pending: list[tuple[int, list[weakref.ref[torch.Tensor]], int]] = []
        self._hooked_nodes: set[int] = set()
        self._node_refs: list[tuple[Any, int]] = []
        self._mutates: dict[Any, tuple[int, ...]] = {}
        self._saved_names: dict[type, tuple[str, ...]] = {}
        self.made: list[list[int]] = []  # per forward op: the storages it made (value ids)

    # --- storages ----------------------------------------------------------------------------

    def _lookup(self, t: torch.Tensor) -> int | None:
        return self._by_storage.get(t.untyped_storage()._cdata)

    def register(self, t: torch.Tensor, kind: str, producer: int = -1) -> int:
        """Start tracking ``t``'s storage (no-op if tracked); returns its value id."""
        storage = t.untyped_storage()
        key = storage._cdata
        vid = self._by_storage.get(key)
        if vid is not None:
            return vid
        vid = len(self.values)
        nbytes = int(storage.nbytes())
        birth = -1 if kind in (g.PARAMETER, g.BUFFER, g.INPUT, g.EXTERNAL) else self.event
        self.values.append(
            _ValueRec(vid, nbytes, kind, producer, birth, None, tuple(t.shape), str(t.dtype))
        )
        self._by_storage[key] = vid
        self._finalizers.append(weakref.finalize(storage, self._on_free, key, vid))
        self.live_bytes += nbytes
        return vid

    def _on_free(self, key: int, vid: int) -> None:
        rec = self.values[vid]
        rec.death = self.event
        self.live_bytes -= rec.nbytes
        if self._by_storage.get(key) == vid:
            del self._by_storage[key]

    def _note_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_event = self.event
        if self.phase == "forward" and self.live_bytes > self.forward_peak_bytes:
            self.forward_peak_bytes = self.live_bytes

    # --- the mode ----------------------------------------------------------------------------

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._paused or not is_counted(func):
            # prim.device & co. are metadata queries of tensor subclasses, not computation;
            # autograd dispatches detach for saved outputs only when no saved-tensor hooks are
            # set (the runtime sets them), and detach allocates nothing.
            return func(*args, **kwargs)
        if self.record and self._pending:
            self._hook_pending_nodes()
        flat_in, _ = tree_flatten((args, kwargs))
        in_tensors = [a for a in flat_in if isinstance(a, torch.Tensor)]
        self.event += 1
        # Inputs we never saw existed before the step: count them, as "external".
        inputs = [self._lookup(t) for t in in_tensors]
        for i, t in enumerate(in_tensors):
            if inputs[i] is None:
                inputs[i] = self.register(t, g.EXTERNAL)
        out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        forward = self.phase == "forward"
        kind = g.ACTIVATION if forward else g.BACKWARD
        index = len(self.ops) if forward else len(self.backward_ops)
        made: list[int] = []
        for t in flat_out:
            if isinstance(t, torch.Tensor) and self._lookup(t) is None:
                made.append(self.register(t, kind, index if forward else -1))
        if forward:
            self.made.append(made)
        self._note_peak()
        if self.record:
            self._record(func, args, inputs, made, flat_out, out)
        return out

    def _record(
        self, func: Any, args: tuple[Any, ...], inputs: list[int | None], made: list[int],
        flat_out: list[Any], out: Any,
    ) -> None:
        target = str(func)
        positions = self._mutates.get(func)
        if positions is None:
            positions = self._mutates[func] = _mutated_arg_positions(func)
        mutated = []
        for pos in positions:
            if pos < len(args) and isinstance(args[pos], torch.Tensor):
                vid = self._lookup(args[pos])
                if vid is not None and vid not in mutated:
                    mutated.append(vid)
        flops = _flops(func, args, out, made, self.values)
        forward = self.phase == "forward"
        module = self.module_stack[-1][0] if self.module_stack else ("" if self.in_model else "<loss>")
        uniq_inputs = list(dict.fromkeys(v for v in inputs if v is not None))
        if forward:
            rec = _OpRec(len(self.ops), target, module, uniq_inputs, made, mutated,
                         fwd_flops=flops)
            self.ops.append(rec)
            tensors = [weakref.ref(t) for t in flat_out if isinstance(t, torch.Tensor)]
            self._pending.append((rec.index, tensors, 0))
        else:
            grad_of = self._grad_of
            module = self.ops[grad_of].module if grad_of >= 0 else "<accumulate>"
            rec = _OpRec(
                len(self.backward_ops), target, module, uniq_inputs, made, mutated,
                fwd_flops=flops, grad_of=grad_of,
            )
            self.backward_ops.append(rec)
            if grad_of >= 0:
                self.ops[grad_of].bwd_flops += flops

    # --- autograd: saved tensors and backward attribution -----------------------------------

    def _collect_saved(self, node: Any, index: int) -> None:
        """Record what ``node`` (the autograd node of forward op ``index``) saved.

        Read off the node's ``_saved_*`` attributes once it is built: saved-tensor hooks cannot
        tell which op a save belongs to (inputs are saved before the kernel runs, outputs
        after), and the node can.
        """
        names = self._saved_names.get(type(node))
        if names is None:
            names = self._saved_names[type(node)] = tuple(
                a for a in dir(node) if a.startswith("_saved_")
            )
        saved = self.ops[index].saved
        with self.paused():
            for name in names:
                try:
                    val = getattr(node, name)
                except RuntimeError:  # e.g. an optional tensor that was not saved
                    continue
                for t in val if isinstance(val, (tuple, list)) else (val,):
                    if not isinstance(t, torch.Tensor):
                        continue
                    vid = self._lookup(t)
                    if vid is None:
                        # A tensor no op made: a Python scalar autograd wrapped (x / 2.0).
                        vid = self.register(t, g.EXTERNAL)
                    if self.values[vid].kind in (g.PARAMETER, g.BUFFER):
                        continue
                    if vid not in saved:
                        saved.append(vid)

    def _hook_pending_nodes(self) -> None:
        """Map recent forward ops to their autograd nodes. An op's node is attached to its
        outputs only after autograd's own bookkeeping (which may dispatch ops, e.g. detach for
        a saved output), so an op without a node yet is retried for a few more ops."""
        pending, self._pending = self._pending, []
        for index, refs, tries in pending:
            waiting = []
            for ref in refs:
                t = ref()
                if t is None:
                    continue
                node = t.grad_fn
                if node is None:
                    if tries < 4:
                        waiting.append(ref)
                    continue
                if id(node) in self._hooked_nodes:
                    continue
                self._hook(node, index)
                for nxt, _ in node.next_functions:
                    if nxt is not None and type(nxt).__name__ == "AccumulateGrad":
                        self._hook(nxt, -1)
            if waiting:
                self._pending.append((index, waiting, tries + 1))

    def _hook(self, node: Any, index: int) -> None:
        if id(node) in self._hooked_nodes:
            return
        self._hooked_nodes.add(id(node))
        self._node_refs.append((node, index))

        def prehook(grad_outputs: Any) -> None:
            self._grad_of = index
            if index >= 0:
                self.ops[index].unpack_event = self.event

        def posthook(grad_inputs: Any, grad_outputs: Any) -> None:
            # The engine releases what the node saved right after its post hooks, before it
            # adds the node's outputs into other nodes' input buffers.
            self.ops[index].release_event = self.event

        node.register_prehook(prehook)
        if index >= 0:
            node.register_hook(posthook)

    # --- module structure --------------------------------------------------------------------

    def module_pre(self, path: str) -> None:
        if self.module_stack:
            parent = self.module_stack[-1]
            self.module_stack[-1] = (parent[0], parent[1], parent[2] + 1)
        self.module_stack.append((path, len(self.ops), 0))

    def module_post(self) -> None:
        path, start, children = self.module_stack.pop()
        depth = len(self.module_stack)
        if len(self.ops) > start:
            self.module_calls.append(g.ModuleCall(path, start, len(self.ops), depth, not children))

    # --- phases ------------------------------------------------------------------------------

    def end_forward(self) -> None:
        if self.record:
            if self._pending:
                self._hook_pending_nodes()
            # Only now is every node complete: autograd saves an op's outputs after attaching
            # its node to them.
            for node, index in self._node_refs:
                if index >= 0:
                    self._collect_saved(node, index)
        self.phase = "backward"

    def close(self) -> None:
        """Stop watching: detach all death callbacks (values still alive keep death=None)."""
        for fin in self._finalizers:
            fin.detach()
        self._finalizers.clear()
        self._node_refs.clear()
        self._pending.clear()


def _flops(func: Any, args: tuple[Any, ...], out: Any, made: list[int], values: list[_ValueRec]) -> int:
    """FLOPs of one op: torch's FlopCounterMode formulas for matmul/conv/attention; one FLOP
    per output element for other ops that write memory (pointwise, norms, reductions)."""
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        return int(formula(*args, out_val=out))
    return sum(_numel(values[v].shape) for v in made)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@contextmanager
def module_hooks(tracer: StepTracer, root: torch.nn.Module) -> Iterator[None]:
    """Report module calls under ``root`` to the tracer, by their path."""
    names = {id(m): name for name, m in root.named_modules()}
    pre: Callable[..., None] = lambda mod, inp: _pre(tracer, names, mod)
    post: Callable[..., None] = lambda mod, inp, out: _post(tracer, names, mod)
    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def _pre(tracer: StepTracer, names: dict[int, str], mod: torch.nn.Module) -> None:
    name = names.get(id(mod))
    if name is not None:
        tracer.module_pre(name)


def _post(tracer: StepTracer, names: dict[int, str], mod: torch.nn.Module) -> None:
    if names.get(id(mod)) is not None:
        tracer.module_post()
