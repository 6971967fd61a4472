"""What ``memplan.apply`` learns from one forward of the model on fake tensors (no memory,
nothing of the model changed): its op sequence (checked against the plan's), where the calls
of the plan's stage-ending modules end, its module calls and which of them write tensors from
outside themselves, and the lifetime of every value it makes (from which the units are chosen,
``units``)."""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.core.graph import ForwardSpec
from memplan.errors import CaptureError
from memplan.runtime import units as U
from memplan.runtime.tape import WRITE_ONLY, tensor_leaves, tensors, written_tensors
from memplan.tracing.datadep import Oracle, run_with_oracle
from memplan.tracing.fake import (
    fake_forward,
    model_device,
    real_forward,
    spec_args,
    spec_kwargs,
)
from memplan.tracing.module_hooks import global_module_hooks
from memplan.tracing.opinfo import is_counted
from memplan.tracing.shims import trace_path
from memplan.tracing.step import no_cyclic_gc
from memplan.tracing.view_replays import ViewReplays


@dataclass
class FakeForward:
    """One training-mode forward of a model on fake tensors."""

    targets: list[str]  # its ops, counted as capture counts them
    call_ends: dict[str, list[int]]  # for watched modules: op count at the end of each call
    calls: list[U.Call]  # its module calls (units are chosen among them)
    values: U.Values  # lifetimes of the values it makes
    # Ops whose outputs a later op writes in place (``graph_arrays.held_expensive``).
    written: frozenset[int] = frozenset()


def probe(model: nn.Module, inputs: Sequence[Any] | None, kwargs: Mapping[str, Any] | None = None,
          forward: ForwardSpec | None = None, watch: Sequence[str] = ()) -> FakeForward:
    """Run the forward on fake tensors and watch it: from ``inputs`` and ``kwargs``, or when
    ``inputs`` is None from the plan's ``forward`` (its input specs, and what its example
    batch's data-dependent ops returned: ``datadep``), under the plan's autocast. Other
    data-dependent ops are sized from one real forward, as capture sizes them. Exceptions of
    the model's own code propagate."""
    autocast = forward.autocast if forward is not None else None
    specs = ((), {}) if forward is None else (forward.inputs, forward.kwargs)

    def real() -> None:
        if inputs is None:
            device = model_device(model)
            args, kw = spec_args(specs[0], device), spec_kwargs(specs[1], device)
        else:
            args, kw = tuple(inputs), dict(kwargs or {})
        real_forward(model, args, autocast=autocast, kwargs=kw)

    def attempt(oracle: Oracle) -> FakeForward:
        return _probe(model, (inputs, kwargs), specs, autocast, watch, oracle)

    with trace_path(forward is not None and forward.trace_path):  # the capture's path
        if inputs is None and forward is not None and forward.answers:
            try:  # along the example batch's path
                recorded = Oracle.from_answers(forward.answers, model_device(model))
                found: FakeForward = run_with_oracle(attempt, real, recorded)
                return found
            except CaptureError:
                pass  # the forward left the recorded path: see where zeros lead (the caller)
        result: FakeForward = run_with_oracle(attempt, real)
        return result


def _probe(model: nn.Module, given: tuple[Sequence[Any] | None, Mapping[str, Any] | None],
           specs: tuple[Sequence[dict[str, Any]], Mapping[str, dict[str, Any]]],
           autocast: dict[str, str] | None, watch: Sequence[str], oracle: Oracle
           ) -> FakeForward:
    names = {id(m): path for path, m in model.named_modules()}
    counter = _Count(oracle)
    call_ends: dict[str, list[int]] = {path: [] for path in watch}
    open_calls: list[tuple[str, int, int]] = []
    numbers: dict[str, int] = {}
    calls: list[tuple[str, int, int, int, tuple[int, ...]]] = []

    def pre(mod: nn.Module, args: Any) -> None:
        counter.hooked = True
        path = names.get(id(mod))
        if path is None:
            return
        numbers[path] = numbers.get(path, 0) + 1
        open_calls.append((path, numbers[path], len(counter.targets)))

    def post(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        counter.hooked = True
        path = names.get(id(mod))
        if path is None:
            return
        if path in call_ends:
            call_ends[path].append(len(counter.targets))
        while open_calls:
            p, n, start = open_calls.pop()
            if p == path:
                calls.append((p, n, start, len(counter.targets), counter.values_of(args, kwargs)))
                break

    # Values die by reference counting, in order; a forward failing on fake tensors is
    # reported by the caller, not logged by torch.
    with no_cyclic_gc(), _quiet_fake_tensor_log():
        out = fake_forward(model, given[0], specs[0], autocast,
                           within=[global_module_hooks(pre, post, post_kwargs=True), counter,
                                   counter.saving()], kwargs=given[1], kwarg_specs=specs[1])
        counter.kept = set(counter.live.values())  # saved for backward, or the output
        del out
    return FakeForward(counter.targets, call_ends, _calls(model, calls, counter),
                       counter.lifetimes(), frozenset(counter.written))




def _calls(model: nn.Module, calls: list[tuple[str, int, int, int, tuple[int, ...]]],
           count: _Count) -> list[U.Call]:
    """Module calls of the fake forward; safe when none of its ops writes a tensor made
    before the call (batch_norm's running statistics excepted). Calls of the root, of modules with
    their own instance forward, of leaf modules (one op or few: the tape costs no more) and
    of modules holding a BatchNorm are never units: a unit's replay binds copies of the
    running statistics for the whole call where the plan's model (``core.evaluate``) holds
    each for its op, and the step's peak must stay the plan's to the byte."""
    out = []
    for path, number, start, end, args in calls:
        if not path or not _may_be_unit(model.get_submodule(path)):
            continue
        safe = all(count.outside[i] >= start for i in range(start, end))
        out.append(U.Call(path, number, start, end, safe, args))
    return out


def _may_be_unit(mod: nn.Module) -> bool:
    if "forward" in mod.__dict__ or next(mod.children(), None) is None:
        return False
    return not any(isinstance(m, nn.modules.batchnorm._NormBase) for m in mod.modules())


class _Count(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the forward's ops as capture does. For each op, the earliest op that made a
    tensor it writes (parameters, buffers, inputs: -1; batch_norm's statistics ignored); for
    each storage an op makes, when it was made, read and freed (in op counts)."""

    def __init__(self, oracle: Oracle) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.oracle = oracle
        self.targets: list[str] = []
        self.outside: list[int] = []
        self.values: list[list[int]] = []  # [made, freed (-1: alive), bytes]
        self.reads: list[list[int]] = []  # per value, the ops that read it
        self.live: dict[int, int] = {}  # storage -> value
        self.kept: set[int] = set()  # values alive when the forward returned
        self.saves: list[tuple[int, int, bool]] = []  # per autograd save (units.Values)
        self.written: set[int] = set()  # ops whose outputs a later op writes in place
        self.hooked = False  # a module call began or ended since the last op
        self.replays = ViewReplays()  # autograd's replays of views written in place

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never compiled; and ``replays`` reads the op's caller: no wrapper frames

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not is_counted(func):
            return func(*args, **kwargs)
        replays = self.replays
        if replays.watch is not None and replays.is_replay(func, args, sys._getframe(1)):
            out = self.oracle.call(func, args, kwargs)  # autograd remaking a view's node
            replays.replayed(out)
            return out
        out = self.oracle.call(func, args, kwargs)
        index = len(self.targets)
        self.targets.append(str(func))
        self.hooked = False
        for t in tensors((args, kwargs)):
            vid = self.live.get(t.untyped_storage()._cdata)
            if vid is not None:
                reads = self.reads[vid]
                if not reads or reads[-1] != index:
                    reads.append(index)
        first = index
        written = written_tensors(func, args, kwargs)
        for t, mode in written:
            if mode == WRITE_ONLY:  # batch_norm's running statistics
                continue
            vid = self.live.get(t.untyped_storage()._cdata)
            if vid is not None:
                self.written.add(self.values[vid][0])
            first = min(first, -1 if vid is None else self.values[vid][0])
        self.outside.append(first)
        if written:
            replays.written([t for t, _ in written], tensors((args, kwargs)), sys._getframe(1))
        for o in tensors(out):
            storage = o.untyped_storage()
            key = storage._cdata
            if key not in self.live:
                self.live[key] = len(self.values)
                weakref.finalize(storage, self._died, key, len(self.values))
                self.values.append([index, -1, int(storage.nbytes())])
                self.reads.append([])
        return out

    def values_of(self, args: Any, kwargs: Any) -> tuple[int, ...]:
        """The values (made by this forward) of a module call's tensor arguments."""
        live = self.live
        vids = {live.get(t.untyped_storage()._cdata) for t in tensor_leaves((args, kwargs))}
        return tuple(sorted(v for v in vids if v is not None))

    def saving(self) -> contextlib.AbstractContextManager[Any]:
        """Notes what autograd saves, and when: an op's inputs before it runs, its outputs
        after (where a replay that stops early stops, ``units._replay_end``)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        vid = self.live.get(t.untyped_storage()._cdata)
        self.saves.append((len(self.targets), -1 if vid is None else vid, self.hooked))
        return t

    def _died(self, key: int, vid: int) -> None:
        self.values[vid][1] = len(self.targets)
        if self.live.get(key) == vid:
            del self.live[key]

    def lifetimes(self) -> U.Values:
        made, freed, nbytes = ([v[i] for v in self.values] for i in range(3))
        return U.Values(made, [-1 if i in self.kept else f for i, f in enumerate(freed)],
                        nbytes, self.reads, self.saves)


def _identity(t: Any) -> Any:
    return t


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


