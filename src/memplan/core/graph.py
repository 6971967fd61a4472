"""The captured computation graph of one training step: plain data, no torch.

Values are storages (one per allocation, shared by all its views): the unit memory is counted
in. Ops are the aten calls of the step in execution order, forward (model + loss) first, then
backward. Event numbers index that order: forward op i is event i, backward op j is event
``len(ops) + j``. This is the paper's computation graph (Sec. 3) plus the observed lifetimes of
the plain eager run, which the planners and the simulator start from.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from memplan.errors import PlanInvalid

# 2: peak_bytes, forward_peak_bytes and forward as typed fields (1: meta); 3: Value.death_unsaved,
# Op.unpack_event / release_event, CutPoint.kind (versions 1 and 2 load with conservative defaults)
SCHEMA_VERSION = 3

# Value kinds.
PARAMETER = "parameter"
BUFFER = "buffer"
INPUT = "input"
ACTIVATION = "activation"  # made by a forward op
BACKWARD = "backward"  # made by a backward op: incoming gradients and temporaries
GRADIENT = "gradient"  # a parameter's .grad at the end of the step
EXTERNAL = "external"  # existed before the step but was not registered up front
KINDS = (PARAMETER, BUFFER, INPUT, ACTIVATION, BACKWARD, GRADIENT, EXTERNAL)


@dataclass(frozen=True)
class Value:
    """One storage. ``birth``/``death`` are event numbers; death None = alive after the step."""

    id: int
    nbytes: int
    kind: str
    producer: int  # forward op index, or -1 (pre-existing or made in backward)
    birth: int
    death: int | None
    shape: tuple[int, ...]
    dtype: str
    # Its death had autograd saved nothing: when the user's code dropped its last reference
    # (a recompute region's values die then). Graphs before schema 3: ``death``.
    death_unsaved: int | None = None


@dataclass(frozen=True)
class Op:
    """One aten call. ``inputs``/``outputs``/``saved`` are value ids (deduplicated, ordered)."""

    index: int
    target: str  # e.g. "aten.convolution.default"
    module: str  # innermost module path, "" for the root, "<loss>" outside the model
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]  # values this op created
    mutated: tuple[int, ...]  # existing values written in place
    saved: tuple[int, ...]  # values autograd saved for this op's backward (no parameters)
    fwd_flops: int
    bwd_flops: int  # FLOPs of the backward ops autograd ran for this op (0 for backward ops)
    grad_of: int = -1  # backward ops: the forward op whose gradient they compute; -1 otherwise
    # Forward ops: the events after which autograd ran this op's backward node (it unpacks
    # what the op saved) and after which it released what the op saved; -1: no node ran.
    unpack_event: int = -1
    release_event: int = -1


@dataclass(frozen=True)
class CutPoint:
    """A candidate stage boundary, after forward op ``after``.

    ``live`` are the activation values made at or before ``after`` and read after it in the
    forward pass: what must be kept to restart the forward from here (parameters and inputs
    excluded: they are always live).
    """

    after: int
    live: tuple[int, ...]
    live_bytes: int
    module: str
    depth: int
    # How it was found, and how the runtime finds it: "call" / "leaf", the end of a call of
    # ``module`` with / without submodules (a forward hook on it); "op", after op ``after``
    # of functional code (the runtime counts ops from the previous boundary).
    kind: str = "call"


CALL, LEAF, OP = "call", "leaf", "op"  # CutPoint kinds


@dataclass(frozen=True)
class ModuleCall:
    """One module call, spanning forward ops ``start`` .. ``end`` - 1; ``leaf``: a module
    without submodules (a Linear, a GELU)."""

    path: str
    start: int
    end: int
    depth: int
    leaf: bool = False


@dataclass(frozen=True)
class ForwardSpec:
    """The model forward a Graph was captured from, and its plans were made for: what
    ``memplan.apply`` checks a model against before changing anything."""

    ops: int  # aten ops of the model's forward (graph.ops after these are the loss)
    fingerprint: str  # forward_fingerprint() of their targets
    inputs: tuple[dict[str, Any], ...]  # example inputs: {shape, dtype, requires_grad}, {value}
    autocast: dict[str, str]  # device -> dtype where autocast was on: it changes the ops
    # What the capture assumed (e.g. data-dependent sizes of the example batch); plans say it.
    assumptions: tuple[str, ...] = ()
    # Example inputs passed by keyword (``kwargs=``), by name, specs as ``inputs``'.
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # What data-dependent ops returned on the example batch (``tracing.datadep``), by op.
    answers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Captured on libraries' trace path (``tracing.shims``): apply checks along it too.
    trace_path: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ops": self.ops, "fingerprint": self.fingerprint,
                               "inputs": [dict(s) for s in self.inputs],
                               "autocast": dict(self.autocast)}
        # Each absent when empty: older readers and stored graphs unchanged.
        if self.assumptions:
            out["assumptions"] = list(self.assumptions)
        if self.kwargs:
            out["kwargs"] = {name: dict(s) for name, s in self.kwargs.items()}
        if self.answers:
            out["answers"] = {op: [dict(r) for r in rs] for op, rs in self.answers.items()}
        if self.trace_path:
            out["trace_path"] = True
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ForwardSpec:
        return cls(int(data["ops"]), str(data["fingerprint"]),
                   tuple(dict(s) for s in data.get("inputs", [])),
                   dict(data.get("autocast") or {}),
                   tuple(str(a) for a in data.get("assumptions", ())),
                   {str(k): dict(s) for k, s in (data.get("kwargs") or {}).items()},
                   {str(k): [dict(r) for r in rs] for k, rs in (data.get("answers") or {}).items()},
                   bool(data.get("trace_path", False)))


@dataclass(frozen=True)
class Graph:
    name: str
    values: tuple[Value, ...]
    ops: tuple[Op, ...]
    backward_ops: tuple[Op, ...]
    cut_points: tuple[CutPoint, ...]
    module_calls: tuple[ModuleCall, ...]
    outputs: tuple[int, ...]  # values the forward returns (the loss last)
    peak_bytes: int = 0  # the traced plain step's peak (all live storages; 0: not traced)
    forward_peak_bytes: int = 0  # its peak during the forward
    forward: ForwardSpec | None = None  # None: not captured from a model (hand-built graphs)

    # --- sizes -------------------------------------------------------------------------------

    def bytes_of(self, kind: str) -> int:
        """Total bytes of all values of one kind."""
        return sum(v.nbytes for v in self.values if v.kind == kind)

    @property
    def param_bytes(self) -> int:
        return self.bytes_of(PARAMETER)

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd saves for backward, each storage once, parameters excluded."""
        ids = {vid for op in self.ops for vid in op.saved}
        return sum(self.values[i].nbytes for i in sorted(ids))

    @property
    def fwd_flops(self) -> int:
        return sum(op.fwd_flops for op in self.ops)

    @property
    def bwd_flops(self) -> int:
        return sum(op.fwd_flops for op in self.backward_ops)

    @property
    def step_flops(self) -> int:
        """FLOPs of the plain forward + backward step."""
        return self.fwd_flops + self.bwd_flops

    def live_bytes_timeline(self) -> list[int]:
        """Bytes live at each event of the plain run, all kinds: after the event's outputs
        exist and before what it freed is released (the tracker's peak moment)."""
        n_events = len(self.ops) + len(self.backward_ops)
        born = [0] * n_events
        died = [0] * n_events
        live = 0
        for v in self.values:
            if v.birth < 0:
                live += v.nbytes
            else:
                born[v.birth] += v.nbytes
            if v.death is not None:
                died[v.death] += v.nbytes
        out = []
        for e in range(n_events):
            live += born[e]
            out.append(live)
            live -= died[e]
        return out

    # --- identity ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["forward"] = None if self.forward is None else self.forward.to_dict()
        return {"schema_version": SCHEMA_VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @functools.cached_property
    def fingerprint(self) -> str:  # cached: the graph is frozen, and hashing it takes 0.3 s at T=2048
        """sha256 of the structure (ops, sizes, cut points): plans are bound to it."""
        structure = {
            "ops": [(o.target, o.module, o.inputs, o.outputs, o.saved) for o in self.ops],
            "values": [(v.nbytes, v.kind, v.producer) for v in self.values],
            "cuts": [(c.after, c.live) for c in self.cut_points],
        }
        blob = json.dumps(structure, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Graph:
        version = data.get("schema_version")
        if version not in (1, 2, SCHEMA_VERSION):
            raise PlanInvalid(
                f"graph schema_version {version!r} is not supported (this memplan reads "
                f"versions 1 to {SCHEMA_VERSION}); capture the model again."
            )
        typed = data.get("meta", {}) if version == 1 else data
        forward = typed.get("forward")
        return cls(
            name=data["name"],
            values=tuple(_value(v) for v in data["values"]),
            ops=tuple(_op(o) for o in data["ops"]),
            backward_ops=tuple(_op(o) for o in data["backward_ops"]),
            cut_points=tuple(CutPoint(**{**c, "live": tuple(c["live"])}) for c in data["cut_points"]),
            module_calls=tuple(ModuleCall(**m) for m in data["module_calls"]),
            outputs=tuple(data["outputs"]),
            peak_bytes=int(typed["peak_bytes"]),
            forward_peak_bytes=int(typed["forward_peak_bytes"]),
            forward=None if forward is None else ForwardSpec.from_dict(forward),
        )

    def summary(self) -> str:
        return (
            f"Graph {self.name}: {len(self.ops)} forward ops, {len(self.backward_ops)} backward "
            f"ops, {len(self.cut_points)} cut points, params {self.param_bytes:,} B, saved "
            f"{self.saved_bytes:,} B, step {self.step_flops:,} FLOPs"
        )


# Makers for capture, which builds hundreds of thousands of these (LSTM T=1024: 218,000 ops,
# 134,000 values): a frozen dataclass's ``__init__`` sets each field through
# ``object.__setattr__``, three times the cost of filling the instance's dict. Equal to the
# class's own constructor, every field given (tests/core/test_graph.py holds them to it).
_new = object.__new__


def make_value(id: int, nbytes: int, kind: str, producer: int, birth: int, death: int | None,
               shape: tuple[int, ...], dtype: str, death_unsaved: int | None) -> Value:
    v = _new(Value)
    d = v.__dict__
    d["id"] = id
    d["nbytes"] = nbytes
    d["kind"] = kind
    d["producer"] = producer
    d["birth"] = birth
    d["death"] = death
    d["shape"] = shape
    d["dtype"] = dtype
    d["death_unsaved"] = death_unsaved
    return v


def make_op(index: int, target: str, module: str, inputs: tuple[int, ...],
            outputs: tuple[int, ...], mutated: tuple[int, ...], saved: tuple[int, ...],
            fwd_flops: int, bwd_flops: int, grad_of: int, unpack_event: int,
            release_event: int) -> Op:
    op = _new(Op)
    d = op.__dict__
    d["index"] = index
    d["target"] = target
    d["module"] = module
    d["inputs"] = inputs
    d["outputs"] = outputs
    d["mutated"] = mutated
    d["saved"] = saved
    d["fwd_flops"] = fwd_flops
    d["bwd_flops"] = bwd_flops
    d["grad_of"] = grad_of
    d["unpack_event"] = unpack_event
    d["release_event"] = release_event
    return op


def _value(v: dict[str, Any]) -> Value:
    return Value(**{"death_unsaved": v["death"], **v, "shape": tuple(v["shape"])})


def _op(o: dict[str, Any]) -> Op:
    return Op(**{**o, **{k: tuple(o[k]) for k in ("inputs", "outputs", "mutated", "saved")}})


def forward_fingerprint(targets: list[str]) -> str:
    """sha256 of the model's forward op sequence: what the runtime checks a plan against."""
    blob = "\n".join(targets)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
