"""Data-dependent ops under fake tensors: sizes and values taken from one real forward.

A fake tensor has no data, so ops whose output shape or value depends on it (``nonzero``,
boolean-mask indexing, ``masked_select``, ``unique``, ``.item()``, ``.tolist()``, ``if
t.any():``) raise inside ``FakeTensorMode``. When a step meets one, the step runs once more
for real, under ``no_grad`` on the example inputs (``fake.real_forward``: the model and the
RNG are left as they were), and an :class:`Oracle` records what each such op returned. The
fake step is then run again and each such op gets the recorded shape (a fresh fake tensor) or
value (a Python scalar), in order, per op. The Graph is exact for that batch; another batch
replays exactly (the runtime re-runs the recorded ops) but may need other memory, which the
plan says in a note. The records go into the plan as plain data (``Oracle.answers``), so that
``memplan.apply`` checks a model on its plan's input shapes along the path the example batch
took (a mixture of experts' routing, an all-ones mask's skipped ops), not that of zeros.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from memplan.core.plan_schema import ANSWER_TREES, MAX_ANSWER_LEAVES
from memplan.errors import CaptureError
from memplan.tracing.fake import DTYPES

DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)
_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


@dataclass(frozen=True)
class _Meta:
    """A real output tensor, as a fake one is rebuilt from it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class _Record:
    in_shapes: tuple[tuple[int, ...], ...]
    leaves: tuple[Any, ...]  # _Meta for tensors, the value itself otherwise
    spec: Any


def _in_shapes(args: Any, kwargs: Any) -> tuple[tuple[int, ...], ...]:
    flat, _ = tree_flatten((args, kwargs))
    return tuple(tuple(a.shape) for a in flat if isinstance(a, torch.Tensor))


def _key(name: str, args: Any, kwargs: Any) -> str:
    """An op's records, one queue per op and input dtypes: a real forward may take items the
    fake one skips (HF checks ``mask.all()`` only on real tensors), and those bools must not
    shift the integers of a later ``tolist`` (HF JetMoe's expert sizes)."""
    flat, _ = tree_flatten((args, kwargs))
    return name + str([a.dtype for a in flat if isinstance(a, torch.Tensor)])


class Oracle:
    """What data-dependent ops returned in a real forward, handed to the fake one.

    Learning (nothing recorded yet): an op that raises a data-dependent error is remembered in
    ``missed`` and the error goes on, so that the step can record and run again. Answering:
    every op tagged data-dependent (or missed before) takes the next record of its kind, so
    that the fake and the real forward stay aligned even where the fake one needs no answer
    (integer indexing is tagged too). ``records``: answering from the start (``from_answers``).
    """

    def __init__(self, records: dict[str, list[_Record]] | None = None) -> None:
        self.records = records
        self.missed: set[str] = {key.partition("[")[0] for key in records or {}}
        self.answered: Counter[str] = Counter()
        self._taken: Counter[str] = Counter()
        self._watch: dict[Any, bool] = {}
        self.in_forward = True

    @property
    def learning(self) -> bool:
        return self.records is None

    def watched(self, func: Any) -> bool:
        hit = self._watch.get(func)
        if hit is None:
            hit = self._watch[func] = str(func) in self.missed or any(
                t in func.tags for t in _TAGS)
        return hit

    def record(self, run: Callable[[], None]) -> None:
        """Run ``run`` (a real forward) and record the results of the watched ops."""
        self._watch.clear()
        recorder = _Recorder(self)
        with _ToList(recorder), recorder:
            run()
        self.records = recorder.records
        self._taken.clear()
        self.answered.clear()
        self.in_forward = True

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             run: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None) -> Any:
        """``func(*args, **kwargs)`` on fake tensors (through ``run`` when given), answered
        from the records where the output depends on data."""
        run = run or _plain
        if self.records is not None and self.in_forward and self.watched(func):
            rec = self._next(func, args, kwargs)
            try:
                return run(func, args, kwargs)
            except DATA_DEPENDENT:
                self.answered[str(func)] += 1
                leaves = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device)
                          if isinstance(m, _Meta) else m for m in rec.leaves]
                return tree_unflatten(leaves, rec.spec)
        try:
            return run(func, args, kwargs)
        except DATA_DEPENDENT:
            if self.records is not None and not self.in_forward:
                raise CaptureError(
                    f"capture: the backward runs {func}, whose output depends on the data of "
                    "a tensor; memplan sizes such ops from one real forward, and cannot in "
                    "backward. Compute it in the forward (or outside the step)."
                ) from None
            self.missed.add(str(func))  # learn it (or, answering, an op no tag announced)
            raise

    def _next(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Record:
        key = _key(str(func), args, kwargs)
        assert self.records is not None
        queue = self.records.get(key, [])
        n = self._taken[key]
        self._taken[key] = n + 1
        shapes = _in_shapes(args, kwargs)
        if n < len(queue) and queue[n].in_shapes == shapes:
            return queue[n]
        real = f"ran it {len(queue)} times" if n >= len(queue) else (
            f"gave call {n + 1} inputs of shapes {list(queue[n].in_shapes)}")
        raise CaptureError(
            f"capture: call {n + 1} of {key} (inputs of shapes {list(shapes)}) depends on the "
            f"data of a tensor, and the real forward memplan ran on the example inputs to size "
            f"it {real}: the forward takes another path on fake tensors or with gradients on "
            "(e.g. control flow on torch.is_grad_enabled()). Make that path independent of "
            "grad mode, or move the data-dependent op out of the step."
        )

    def notes(self) -> tuple[str, ...]:
        """What a plan of this step should say about it."""
        if not self.answered:
            return ()
        ops = ", ".join(f"{k} x{n}" for k, n in sorted(self.answered.items()))
        note = (f"data-dependent sizes of the example batch: {sum(self.answered.values())} ops "
                f"whose output depends on tensor values ({ops}) took their sizes and values "
                "from one real forward on the example inputs. The plan fits that batch; another "
                "batch (other routing, mask counts) trains exactly but may use other memory.")
        return (note,)


    def answers(self) -> dict[str, list[dict[str, Any]]] | None:
        """The records as plain data (JSON), or None: none, or too many or too odd to keep
        (a tensor's values read in Python one by one, a nested or non-finite output)."""
        if self.records is None or not self.answered:
            return None
        out: dict[str, list[dict[str, Any]]] = {}
        for key, queue in self.records.items():
            encoded = [_encode(r) for r in queue]
            if any(e is None for e in encoded):
                return None
            out[key] = [e for e in encoded if e is not None]
        leaves = sum(len(e["out"]) for queue in out.values() for e in queue)
        return out if leaves <= MAX_ANSWER_LEAVES else None

    @classmethod
    def from_answers(cls, answers: dict[str, list[dict[str, Any]]], device: torch.device
                     ) -> Oracle:
        """An oracle answering from a plan's records; tensors recorded off the CPU are made on
        ``device`` (the model's)."""
        return cls({key: [_decode(r, device) for r in queue] for key, queue in answers.items()})


def _tree(kind: str, n: int) -> Any:
    return tree_flatten({"one": 0, "tuple": (0,) * n, "list": [0] * n}[kind])[1]


def _encode(rec: _Record) -> dict[str, Any] | None:
    """A record as a plan keeps it (``plan_schema``); None where it cannot."""
    kind = next((k for k in ANSWER_TREES if rec.spec == _tree(k, len(rec.leaves))), None)
    if kind is None:
        return None
    out: list[dict[str, Any]] = []
    for leaf in rec.leaves:
        dtype = str(leaf.dtype).removeprefix("torch.") if isinstance(leaf, _Meta) else ""
        if isinstance(leaf, _Meta) and dtype in DTYPES:
            out.append({"shape": list(leaf.shape), "stride": list(leaf.stride), "dtype": dtype,
                        "device": leaf.device.type})
        elif isinstance(leaf, (bool, int)) or (isinstance(leaf, float) and math.isfinite(leaf)):
            out.append({"value": leaf})
        else:
            return None
    return {"in": [list(s) for s in rec.in_shapes], "tree": kind, "out": out}


def _decode(data: dict[str, Any], device: torch.device) -> _Record:
    leaves = tuple(
        _Meta(tuple(d["shape"]), tuple(d["stride"]), DTYPES[d["dtype"]],
              torch.device("cpu") if d["device"] == "cpu" else device)
        if "shape" in d else d["value"] for d in data["out"])
    return _Record(tuple(tuple(s) for s in data["in"]), leaves, _tree(data["tree"], len(leaves)))


def _plain(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return func(*args, **kwargs)


class Answering(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every op of a fake forward through ``oracle`` (a forward with no tracer of its own)."""

    def __init__(self, oracle: Oracle) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.oracle = oracle

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return self.oracle.call(func, args, kwargs or {})


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the outputs of the oracle's watched ops during a real forward."""

    def __init__(self, oracle: Oracle) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.oracle = oracle
        self.records: dict[str, list[_Record]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.oracle.watched(func):
            self.add(_key(str(func), args, kwargs), _in_shapes(args, kwargs), out)
        return out

    def add(self, key: str, in_shapes: tuple[tuple[int, ...], ...], out: Any) -> None:
        flat, spec = tree_flatten(out)
        leaves = tuple(_Meta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
                       if isinstance(t, torch.Tensor) else t for t in flat)
        self.records.setdefault(key, []).append(_Record(in_shapes, leaves, spec))


_SCALAR = str(torch.ops.aten._local_scalar_dense.default)


class _ToList(TorchFunctionMode):
    """``t.tolist()`` reads a real tensor's memory without an aten op, while a fake tensor's
    ``tolist`` takes ``.item()`` of each element in order: record those items."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.tolist:
            flat, _ = tree_flatten(out)
            key = _key(_SCALAR, args[0], {})  # as each element's .item() on fake tensors
            for item in flat:
                self.recorder.add(key, ((),), item)
        return out


class NoRealForward(CaptureError):
    """The real forward that sizes data-dependent ops could not run (a model on the meta
    device, inputs elsewhere than the model)."""


def run_with_oracle(attempt: Callable[[Oracle], Any], real_forward: Callable[[], None],
                    oracle: Oracle | None = None) -> Any:
    """``attempt(oracle)`` (a fake forward or step); when it meets data-dependent ops, record
    them in ``real_forward`` (a real one on the same inputs) and attempt again. Each round
    learns at least one new kind of op, so this ends. ``oracle``: one to start from (and to
    read the records off afterwards)."""
    oracle = oracle or Oracle()
    while True:
        known = len(oracle.missed)
        try:
            return attempt(oracle)
        except Exception as err:
            if len(oracle.missed) == known:  # not an op the oracle can learn
                if isinstance(err, DATA_DEPENDENT):
                    raise CaptureError(
                        f"capture: {err.func} depends on the data of a tensor and memplan "
                        "could not size it from a real forward on the example inputs. Move it "
                        "out of the training step, or file an issue with the model."
                    ) from None
                raise
        try:
            oracle.record(real_forward)
        except Exception as err:
            raise NoRealForward(
                f"capture: the step uses ops whose output depends on tensor data "
                f"({', '.join(sorted(oracle.missed))}); memplan sizes them from one real "
                f"forward on the example inputs, which raised {type(err).__name__}: {err}. "
                "Pass real example inputs on the model's device."
            ) from err
