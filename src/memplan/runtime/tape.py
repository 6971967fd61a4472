"""One planned forward's tape: what a recompute scope records (aten ops, and units: whole
module calls), and the scopes (their handles: ``runtime.handles``).
Also how module-call arguments and aten op arguments are flattened, and which arguments an
op writes."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

from memplan.runtime.handles import HandleTable
from memplan.runtime.layout import Template

Pos = tuple[int, int]  # (tape entry, output index); a unit's saves are table rows (runtime.handles)
SavedMeta = tuple[tuple[torch.Size, ...], tuple[torch.dtype, ...]]  # a unit call's saves


class Ref:
    """A tape value read by an entry (a plain slotted class: one is made per tensor argument
    of a recorded op, and a frozen dataclass costs several times as much to make)."""

    __slots__ = ("pos",)

    def __init__(self, pos: Pos) -> None:
        self.pos = pos


READ, WRITE_ONLY, SNAPSHOT = 0, 1, 2


class Ext:
    """A tensor from outside the scope: read at ``version`` (READ); BatchNorm statistics the
    op only writes (WRITE_ONLY: replay writes a copy); or the copy of a tensor the op writes,
    taken before it did (SNAPSHOT: replay writes a copy of it)."""

    __slots__ = ("mode", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int, mode: int) -> None:
        self.tensor = tensor
        self.version = version
        self.mode = mode


class OpEntry:
    """An aten op recorded on the tape."""

    __slots__ = ("expensive", "func", "leaves", "refs", "spec", "writes")

    def __init__(self, func: Any, spec: Any, leaves: list[Any], refs: tuple[Pos, ...],
                 expensive: bool, writes: tuple[Pos, ...] = ()) -> None:
        self.func = func
        self.spec = spec
        self.leaves = leaves
        self.refs = refs
        self.expensive = expensive
        self.writes = writes  # the tape values it writes in place (of ``refs``)


@dataclass(eq=False)
class Slot:
    """A parameter or buffer of a unit's module tree: where it is bound, and its name."""

    holder: dict[str, Any]  # the module's _parameters or _buffers
    key: str
    name: str


@dataclass(eq=False)
class UnitInfo:
    """Per unit module: its parameters and buffers (no unit holds a BatchNorm: see
    ``probe._may_be_unit``)."""

    slots: list[Slot]


def unit_info(module: torch.nn.Module, path: str) -> UnitInfo:
    slots: list[Slot] = []
    seen: set[tuple[int, str]] = set()
    for prefix, m in module.named_modules(prefix=path, remove_duplicate=False):
        for holder in (m._parameters, m._buffers):
            for key in holder:
                if (id(holder), key) in seen:
                    continue
                seen.add((id(holder), key))
                slots.append(Slot(holder, key, f"{prefix}.{key}" if prefix else key))
    return UnitInfo(slots)


class UnitEntry:
    """A unit: a module call recorded whole, replayed by calling the module again."""

    __slots__ = ("autocast", "bound", "grad_enabled", "grads", "info", "leaves",
                 "module", "n_outputs", "n_saved", "path", "refs", "saved", "spec", "versions")

    def __init__(self, module: torch.nn.Module, path: str, info: UnitInfo) -> None:
        self.module = module
        self.path = path
        self.info = info
        self.spec: Any = None
        self.leaves: list[Any] = []
        self.refs: tuple[Pos, ...] = ()
        self.grads: list[bool] = []  # requires_grad of each tensor argument
        self.grad_enabled = True
        self.autocast: tuple[tuple[str, torch.dtype], ...] = ()
        self.bound: list[Any] = []  # the tensors bound to info.slots during the call
        self.versions: list[int] = []
        self.n_saved = 0
        self.n_outputs = 0
        # The shapes and dtypes of the tensors the call saved, in order: one tuple shared by
        # the calls that saved alike (few objects for Python's collector; ``record``).
        self.saved: SavedMeta = ((), ())

    @property
    def expensive(self) -> bool:
        return False


@dataclass(eq=False)
class Scope:
    """A template's instance in one forward: a slice of its top-level scope's tape."""

    template: Template
    parent: Scope | None
    tape: Tape
    first_entry: int
    rng_state: tuple[torch.Tensor, torch.Tensor | None]
    last_entry: int = -1
    inputs: dict[Pos, None] = field(default_factory=dict)  # tape values from before it
    stash: dict[Pos, torch.Tensor] | None = None  # their values, given by the parent's replay
    table: HandleTable = field(default_factory=HandleTable)  # its handles
    # Weak: a nested scope lives while autograd holds one of its handles (or a nested scope
    # of its own does); a strong link back would make a cycle that outlives the step.
    children: list[weakref.ref[Scope]] = field(default_factory=list)
    done: bool = False


@dataclass(eq=False)
class Tape:
    snaps: dict[tuple[Any, ...], torch.Tensor]  # (key, version) -> value before a write
    namer: Namer
    entries: list[OpEntry | UnitEntry] = field(default_factory=list)
    held: dict[Pos, torch.Tensor] = field(default_factory=dict)  # drop-cheap's kept outputs
    # The tensors entries made, by identity (ops and autograd hand the same tensor objects
    # on: views and in-place results included); weak, so they die when the user drops them.
    ids: dict[int, tuple[Pos, Any]] = field(default_factory=dict)
    # Outside tensors the tape read: a later write through a view of one (an in-place op on
    # ``y.view(...)``) changes it under the tape (see ``keep_before_write``). Indexed by
    # storage only when an op writes (rare; a storage lookup per read cost more than the op).
    outside: list[torch.Tensor] = field(default_factory=list)
    by_storage: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    indexed: int = 0  # outside[:indexed] are in by_storage

    def lookup(self, t: torch.Tensor) -> Pos | None:
        hit = self.ids.get(id(t))
        if hit is not None and hit[1]() is t:
            return hit[0]
        return None

    def register(self, t: torch.Tensor, pos: Pos) -> None:
        self.ids[id(t)] = (pos, weakref.ref(t))

    def clear_index(self) -> None:
        self.ids.clear()

    def note_outside(self, t: torch.Tensor) -> None:
        self.outside.append(t)

    def keep_before_write(self, written: list[torch.Tensor],
                          copies: dict[tuple[Any, ...], torch.Tensor]) -> None:
        """An op is about to write ``written``: keep a copy of each outside tensor the tape
        read that shares its storage, at the version read, for replay (``unit_replay.ext_value``).
        ``copies``: the forward's, one per (tensor, version), shared by the tapes that read it;
        each tape holds it as long as the tape lives, and no longer."""
        for t in self.outside[self.indexed:]:
            self.by_storage.setdefault(t.untyped_storage()._cdata, []).append(t)
        self.indexed = len(self.outside)
        for w in written:
            for t in self.by_storage.get(w.untyped_storage()._cdata, ()):
                key = (storage_key(t), t._version)
                if key not in self.snaps:
                    snap = copies.get(key)
                    if snap is None:
                        snap = copies[key] = t.detach().clone()
                    self.snaps[key] = snap


def storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class Namer:
    """Names a tensor for an error message: the model's input or its parameter/buffer name."""

    def __init__(self, model: torch.nn.Module | None, inputs: dict[int, str]) -> None:
        self.model = weakref.ref(model) if model is not None else None
        self.inputs = inputs

    def __call__(self, t: torch.Tensor) -> str:
        label = self.inputs.get(id(t))
        if label is not None:
            return label
        model = self.model() if self.model is not None else None
        if model is not None:
            for name, v in list(model.named_parameters()) + list(model.named_buffers()):
                if v is t:
                    return f"'{name}'"
        return f"a tensor of shape {list(t.shape)} ({str(t.dtype).removeprefix('torch.')})"


def rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    return torch.get_rng_state(), cuda


DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    return tuple((d, torch.get_autocast_dtype(d)) for d in DEVICES if torch.is_autocast_enabled(d))


def tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) or o is None
                                              for o in out):
        return [o for o in out if o is not None]
    flat, _ = tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def tensor_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    leaves: list[Any] = []
    _walk(out, leaves)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


# Module-call arguments and outputs: nested tuples, lists and dicts walked by hand (pytree's
# general walk costs more than a small op); other registered containers through pytree.


def _walk(obj: Any, leaves: list[Any]) -> Any:
    kind = type(obj)
    if kind is tuple or kind is list:
        return (kind, [_walk(o, leaves) for o in obj])
    if kind is dict:
        return (dict, [(k, _walk(v, leaves)) for k, v in obj.items()])
    if kind in SUPPORTED_NODES:
        flat, spec = tree_flatten(obj)
        leaves.extend(flat)
        return ("pytree", spec, len(flat))
    leaves.append(obj)
    return None


def flatten_tree(obj: Any) -> tuple[list[Any], Any]:
    leaves: list[Any] = []
    return leaves, _walk(obj, leaves)


def _build(spec: Any, vals: Iterator[Any]) -> Any:
    if spec is None:
        return next(vals)
    if spec[0] == "pytree":
        return tree_unflatten([next(vals) for _ in range(spec[2])], spec[1])
    if spec[0] is dict:
        return {k: _build(s, vals) for k, s in spec[1]}
    return spec[0](_build(s, vals) for s in spec[1])


def unflatten_tree(vals: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = _build(spec, iter(vals))
    return tuple(args), dict(kwargs)


# Aten op arguments nest at most one level (Tensor[], Tensor?[], int[]): flatten them by hand,
# pytree's general walk was most of the runtime's own cost.
_FLAT = "flat"


def flatten_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    leaves: list[Any] = []
    shape: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            if any(isinstance(b, (list, tuple, dict)) for b in a):
                return _pytree_flatten(args, kwargs)
            shape.append((type(a), len(a)))
            leaves.extend(a)
        elif isinstance(a, dict):
            return _pytree_flatten(args, kwargs)
        else:
            shape.append(None)
            leaves.append(a)
    if kwargs:
        if any(isinstance(v, (list, tuple, dict)) for v in kwargs.values()):
            return _pytree_flatten(args, kwargs)
        leaves.extend(kwargs.values())
    return leaves, (_FLAT, tuple(shape), tuple(kwargs))


def _pytree_flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    return tree_flatten((args, kwargs))


def unflatten_args(vals: list[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(spec, tuple) and spec and spec[0] == _FLAT:
        _, shape, keys = spec
        args: list[Any] = []
        i = 0
        for item in shape:
            if item is None:
                args.append(vals[i])
                i += 1
            else:
                kind, n = item
                args.append(kind(vals[i : i + n]))
                i += n
        return tuple(args), dict(zip(keys, vals[i:]))
    a, k = tree_unflatten(vals, spec)
    return tuple(a), dict(k)


_VIEWS: dict[Any, bool] = {}


def is_view(func: Any) -> bool:
    """Whether every output of the op aliases its first argument, which it does not write,
    and it takes no other tensor (a view: it makes no storage)."""
    view = _VIEWS.get(func)
    if view is None:
        schema = func._schema
        args, returns = schema.arguments, schema.returns
        first = args[0].alias_info if args else None
        view = _VIEWS[func] = bool(
            returns and first is not None and not first.is_write
            and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
            and not any("Tensor" in str(a.type) for a in args[1:]))
    return view


# Per op: (argument index, name, write-only BatchNorm statistic) of the arguments it writes,
# and the index of its ``training`` flag (BatchNorm ops). Keyed by the op's id: OpOverload
# hashes in Python, and this is looked up for every op a scope records.
_WRITES: dict[int, tuple[tuple[tuple[int, str, bool], ...], int]] = {}
_OPS: list[Any] = []  # the ops keyed in _WRITES, kept alive so that their ids stay theirs


def write_spots(func: Any) -> tuple[tuple[tuple[int, str, bool], ...], int]:
    spots = _WRITES.get(id(func))
    if spots is None:
        # native_batch_norm and the cudnn/miopen variants write the running statistics
        # without saying so in their schemas, and only when training.
        schema = func._schema
        bn = "batch_norm" in schema.name
        names = [a.name for a in schema.arguments]
        training = names.index("training") if bn and "training" in names else -1
        spots = (tuple(
            (i, a.name, bn and a.name in ("running_mean", "running_var"))
            for i, a in enumerate(schema.arguments)
            if (a.alias_info is not None and a.alias_info.is_write)
            or (bn and a.name in ("running_mean", "running_var"))), training)
        _OPS.append(func)
        _WRITES[id(func)] = spots
    return spots


def written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> list[tuple[torch.Tensor, int]]:
    """The tensor arguments the op writes, with WRITE_ONLY for BatchNorm running statistics
    in training (their value reaches no output) and SNAPSHOT for the others."""
    spots, training = write_spots(func)
    if not spots:
        return []
    trains = True
    if training >= 0:
        flag = args[training] if training < len(args) else kwargs.get("training")
        trains = bool(flag)
    out: list[tuple[torch.Tensor, int]] = []
    for i, name, stat in spots:
        val = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(val, torch.Tensor) and (trains or not stat):
            out.append((val, WRITE_ONLY if stat else SNAPSHOT))
    return out
