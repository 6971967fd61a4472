"""Autograd's side of a traced step: what each forward op's autograd node saved, and which
forward op a backward event belongs to (its node's pre- and post-hooks).

A mixin of ``StepTracer``: saved-tensor hooks cannot tell which op a save belongs to, the
node can, so saves are read off nodes once autograd has attached them to the op's outputs.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import BackwardCFunction

from memplan.core import graph as g

# In-place ops whose backward reads none of their tensor arguments (derivatives.yaml).
_SAVE_NOTHING = frozenset(f"aten.{name}" for name in (
    "copy_.default", "fill_.Scalar", "fill_.Tensor", "zero_.default", "add_.Tensor",
    "add_.Scalar", "sub_.Tensor", "sub_.Scalar", "mul_.Scalar", "div_.Scalar"))


class AutogradNodes:
    """Maps forward ops to their autograd nodes; needs the tracer's values, ops and events."""

    ops: list[Any]
    values: list[Any]
    event: int
    _grad_of: int
    _pending: list[tuple[int, list[weakref.ref[torch.Tensor]], int]]
    _hooked_nodes: set[int]
    _node_refs: list[tuple[Any, int]]
    _saved_names: dict[type, tuple[str, ...]]

    if TYPE_CHECKING:  # StepTracer's own methods
        def _lookup(self, t: torch.Tensor) -> int | None: ...
        def register(self, t: torch.Tensor, kind: str, producer: int = -1,
                     counted: bool = True) -> int: ...
        def paused(self) -> AbstractContextManager[None]: ...

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
        op = self.ops[index]
        saved = op.saved
        if type(node).__name__ == "CopySlices" and op.target not in _SAVE_NOTHING:
            # An in-place op on a view: its own node is inside CopySlices, which shows none of
            # its saves (relu_ and leaky_relu_ save their result, masked_fill_ its mask): count
            # every tensor it reads as saved (at worst kept longer than needed, never shorter).
            saved.extend(v for v in op.inputs
                         if self.values[v].kind not in (g.PARAMETER, g.BUFFER) and v not in saved)
        if not names and isinstance(node, BackwardCFunction):
            # A custom autograd.Function (HF Bloom's GeLUFunction): its node shows no
            # ``_saved_*``; what ``ctx.save_for_backward`` took is ``saved_tensors``.
            names = ("saved_tensors",)
        for name in names:
            for t in self._saved_tensors(node, name):
                vid = self._lookup(t)
                if vid is None:
                    # A tensor no op made: a Python scalar autograd wrapped (x / 2.0). A
                    # host scalar, which neither the step's tracker (measure) nor the CUDA
                    # allocator sees: tracked, at 0 bytes.
                    vid = self.register(t, g.EXTERNAL, counted=False)
                if self.values[vid].kind in (g.PARAMETER, g.BUFFER):
                    continue
                if vid not in saved:
                    saved.append(vid)

    def _saved_tensors(self, node: Any, name: str) -> list[torch.Tensor]:
        """The tensors ``node`` saved under ``name``, as stored: what ``pack`` returned (which
        shares the saved tensor's storage), read off ``_raw`` + ``name`` without unpacking
        (an unpack makes a new tensor, through the mode). Saves packed by other hooks (the
        user's own) are unpacked, paused: their unpack hook may run ops."""
        raw = getattr(node, "_raw" + name, None)
        if raw is not None:
            stored = [r.data for r in raw] if isinstance(raw, (list, tuple)) else [raw.data]
            if all(d is None or isinstance(d, torch.Tensor) for d in stored):
                return [d for d in stored if d is not None]
        try:
            if raw is None and name != "saved_tensors":  # sizes, scalars: nothing to unpack
                val = getattr(node, name)
            else:
                with self.paused():
                    val = getattr(node, name)
        except RuntimeError:  # e.g. an optional tensor that was not saved
            return []
        return [t for t in (val if isinstance(val, (tuple, list)) else (val,))
                if isinstance(t, torch.Tensor)]

    def hooked_nodes(self, start: int = 0) -> list[tuple[Any, int]]:
        """(node, op index) of traced ops' autograd nodes, from the ``start``-th on (the
        pending ones hooked first)."""
        if self._pending:
            self._hook_pending_nodes()
        return self._node_refs[start:]

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
                self.hook_accumulations(node)
            if waiting:
                self._pending.append((index, waiting, tries + 1))

    def hook_accumulations(self, node: Any) -> None:
        """Hook the nodes accumulating into leaves' grads that ``node`` feeds: what they run
        is no forward op's backward (``<accumulate>``)."""
        for nxt, _ in node.next_functions:
            if nxt is not None and type(nxt).__name__ == "AccumulateGrad":
                self._hook(nxt, -1)

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
