"""The one fake-tensor forward: a model run on fake copies of its parameters, buffers and
inputs (``FakeTensorMode``: shapes and dtypes, no memory), so that paper-scale steps are traced
on a laptop and plans are checked against a model without touching it.

Capture (``step.run_step``), ``memplan.apply``'s check of a plan (``runtime.probe``) and
``memplan.distributed``'s unit inputs all run their forward through here. Real tensors the
forward or the loss closes over (targets, class weights, masks) become fake copies as they are
met: constants of the step. Ops whose output depends on tensor data are sized from one real
forward (``datadep``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils.weak import WeakIdKeyDictionary, WeakIdRef

from memplan.errors import PlanMismatch
from memplan.tracing import kernels  # noqa: F401  (fake kernels torch lacks, registered)
from memplan.tracing.meta_constants import lifted_meta_constants, on_meta
from memplan.tracing.opcache import fake_tensor
from memplan.tracing.shims import eager_libraries

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool)}
_META = torch.device("meta")


def functional_state(model: nn.Module, by_name: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``by_name`` (keyed as ``named_parameters()``/``named_buffers()`` name them) spread over
    every distinct (module, attribute) that holds one of those tensors, once each. Tied
    weights (two modules, one parameter) get the same replacement; a submodule reached under
    two paths is swapped once (functional_call swapping it twice restores it wrongly)."""
    originals = dict(model.named_parameters()) | dict(model.named_buffers())
    by_id = {id(t): by_name[name] for name, t in originals.items() if name in by_name}
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, str]] = set()
    modules = list(model.named_modules(remove_duplicate=False))
    for slots in ("_parameters", "_buffers"):  # the order named_parameters/buffers give
        for path, module in modules:
            for attr, t in getattr(module, slots).items():
                key = (id(module), attr)
                if t is not None and key not in seen and id(t) in by_id:
                    seen.add(key)
                    out[f"{path}.{attr}" if path else attr] = by_id[id(t)]
    return out


@contextlib.contextmanager
def fake_mode(meta: bool = False) -> Iterator[FakeTensorMode]:
    """The fake mode of every memplan fake run. Real tensors met as inputs of an op (what a
    forward or a loss closes over) are converted to fake copies, once each. A failing op is
    reported once, as memplan's error: torch's logging of it is held back meanwhile. Libraries
    that take fake tensors for a trace are told these are not (``shims``). ``meta``: the
    model is on the meta device, whose constants are lifted as on others (``meta_constants``)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled = log.disabled
    log.disabled = True
    try:
        with (FakeTensorMode(allow_non_fake_inputs=True) as mode, eager_libraries(mode),
              lifted_meta_constants(meta)):
            yield mode
    finally:
        log.disabled = was_disabled


def fake_state(fake: FakeTensorMode, model: nn.Module, fast: bool = True
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Fake copies of the model's parameters (leaves that keep requires_grad, with no grad:
    a step starts from zeroed grads, as after ``optimizer.zero_grad()``) and buffers.
    ``fast``: plain tensors copied by ``fake_copy`` (``False``: all by ``from_tensor``)."""
    copy = _from_tensor
    if fast and _memo_reachable(fake):
        ids = _Ids.of(fake.fake_tensor_converter.meta_converter.describer)
        copy = functools.partial(fake_copy, ids=ids)
    params: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = copy(fake, p)
        t.grad = None
        params[name] = t
    buffers: dict[str, torch.Tensor] = {n: copy(fake, b) for n, b in model.named_buffers()}
    return params, buffers


def _from_tensor(fake: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    return fake.from_tensor(t)


def fake_copy(fake: FakeTensorMode, t: torch.Tensor, ids: _Ids) -> torch.Tensor:
    """``fake.from_tensor(t)`` for a plain tensor (dense, its storage's own, not a view),
    made directly: torch describes and rebuilds each tensor in Python, over a second of a
    user's ResNet-1000 capture (3,000 parameters and buffers). Remembered where ``from_tensor``
    looks, tensor and storage, so a forward that meets ``t`` or a view of it outside the
    model's parameters (a plain attribute, a list) gets this copy, as it would have.
    ``ids``: ``_Ids.of`` the fake mode's describer."""
    meta: Any = fake.fake_tensor_converter.meta_converter  # torch internals, typed loosely
    tensor_ref = ids.tensor_ref(t)
    known = ids.tensor_id(tensor_ref)
    memo = None if known is None else meta.tensor_memo.get(known)
    if memo is not None:
        return cast(torch.Tensor, memo)
    if not _plain(t):
        return fake.from_tensor(t)
    storage = t.untyped_storage()
    storage_id = ids.storage_id(storage)
    if storage_id in meta.storage_memo:
        return fake.from_tensor(t)  # a storage another tensor holds: torch's way shares it
    with torch._C._DisableTorchDispatch():  # a meta tensor, not the fake mode's
        elem = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
    if elem.untyped_storage().nbytes() != storage.nbytes():
        return fake.from_tensor(t)  # a storage larger than the tensor: torch's way keeps it
    out = fake_tensor(fake, elem, t.device, requires_grad=t.requires_grad)
    if type(t) is nn.Parameter:
        out._is_param = True  # as torch marks it: isinstance(out, Parameter) holds
    meta.tensor_memo[ids.new_tensor_id(tensor_ref, known)] = out
    meta.storage_memo[storage_id] = out.untyped_storage()
    return out


class _Ids:
    """The ids ``from_tensor``'s describer gives tensors and storages, which key its memos
    (``get_tensor_id``/``get_storage_id``), assigned as it assigns them. Its accessors make a
    weak reference per lookup, and a hit compares two more: seven per tensor copied, the
    largest share of a ResNet-1000's ``fake_state`` (6,026 tensors). ``_DirectIds`` reads
    and writes its tables with one reference per tensor and storage."""

    @staticmethod
    def of(describer: Any) -> _Ids:
        return _DirectIds(describer) if _direct_tables(describer) else _Ids(describer)

    def __init__(self, describer: Any) -> None:
        self.describer = describer

    def tensor_ref(self, t: torch.Tensor) -> Any:
        return t

    def tensor_id(self, ref: Any) -> int | None:
        """The id of the tensor ``ref`` stands for, if it has one."""
        return cast(int | None, self.describer.lookup_tensor.get(ref))

    def new_tensor_id(self, ref: Any, known: int | None) -> int:
        """The tensor's id, given one if it has none (``known``: ``tensor_id``'s answer)."""
        return cast(int, self.describer.get_tensor_id(ref))

    def storage_id(self, storage: Any) -> int:
        """The storage's id, given one if it has none."""
        return cast(int, self.describer.get_storage_id(storage))


class _DirectIds(_Ids):
    """``_Ids`` through the tables' own dicts, keyed by the weak references torch's
    ``WeakIdKeyDictionary`` keys them by (``_direct_tables`` checks they are)."""

    def tensor_ref(self, t: torch.Tensor) -> Any:
        return WeakIdRef(t, self.describer.lookup_tensor._remove)

    def tensor_id(self, ref: Any) -> int | None:
        return cast(int | None, self.describer.lookup_tensor.data.get(ref))

    def new_tensor_id(self, ref: Any, known: int | None) -> int:
        if known is not None:
            return known
        d = self.describer
        known = d.lookup_tensor.data[ref] = d.next_tensor_id
        d.next_tensor_id = type(known)(known + 1)
        return known

    def storage_id(self, storage: Any) -> int:
        d = self.describer
        table = d.lookup_storage
        ref = WeakIdRef(storage, table._remove)
        found = table.data.get(ref)
        if found is None:
            found = table.data[ref] = d.next_storage_id
            d.next_storage_id = type(found)(found + 1)
        return cast(int, found)


def _direct_tables(describer: Any) -> bool:
    """Whether the describer's id tables are torch's ``WeakIdKeyDictionary`` as ``_DirectIds``
    reads them (a dict of ``WeakIdRef`` keys and a removal callback) beside int counters; else
    ``_Ids`` keeps to its public accessors."""
    tables = (getattr(describer, "lookup_tensor", None), getattr(describer, "lookup_storage", None))
    return all(type(table) is WeakIdKeyDictionary and table.ref_type is WeakIdRef
               and type(getattr(table, "data", None)) is dict and callable(
                   getattr(table, "_remove", None)) for table in tables) \
        and all(type(getattr(describer, n, None)) is int
                for n in ("next_tensor_id", "next_storage_id"))


def _plain(t: torch.Tensor) -> bool:
    """No Python attributes (torch forwards some), no view, no special layout or flags."""
    return (type(t) in (torch.Tensor, nn.Parameter) and not t.__dict__ and t._base is None
            and t.is_leaf and t.layout == torch.strided and t.storage_offset() == 0
            and not t.is_meta
            and not (t.is_quantized or t.is_nested or t.is_conj() or t.is_neg()
                     or t.is_inference() or torch._C._functorch.is_functorch_wrapped_tensor(t)))


def _memo_reachable(fake: FakeTensorMode) -> bool:
    """Whether this torch keeps ``from_tensor``'s memos where ``fake_copy`` puts them."""
    converter = getattr(fake, "fake_tensor_converter", None)
    meta = getattr(converter, "meta_converter", None)
    describer = getattr(meta, "describer", None)
    return (hasattr(meta, "tensor_memo")
            and hasattr(meta, "storage_memo") and hasattr(describer, "lookup_tensor")
            and hasattr(describer, "get_tensor_id") and hasattr(describer, "get_storage_id"))


def make_fake_in_place(fake: FakeTensorMode, model: nn.Module, device: torch.device
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Turn ``model``, built on the meta device (a Workload: no values, its init kernels in
    C++ rather than through the fake mode), into a fake model on ``device``, in place: every
    parameter and buffer slot holds a fake tensor (tied ones the same). Returns them as
    ``named_parameters()`` / ``named_buffers()`` name them."""
    fakes: dict[int, torch.Tensor] = {}

    def swap(slots: dict[str, Any]) -> None:
        for key, t in slots.items():
            if t is not None:
                if id(t) not in fakes:
                    with torch._C._DisableTorchDispatch():  # a meta tensor: not the fake mode's
                        elem = t.detach()
                    fakes[id(t)] = fake_tensor(fake, elem, device, requires_grad=t.requires_grad)
                slots[key] = fakes[id(t)]

    named = dict(model.named_parameters()), dict(model.named_buffers())
    for module in model.modules():
        swap(module._parameters)
        swap(module._buffers)
    params, buffers = ({name: fakes[id(t)] for name, t in group.items()} for group in named)
    return params, buffers


def fake_call(model: nn.Module, params: dict[str, torch.Tensor],
              buffers: dict[str, torch.Tensor]) -> Callable[..., Any]:
    """``model``'s forward with ``params`` and ``buffers`` in place of its own tensors."""
    state = functional_state(model, {**params, **buffers})
    return lambda *args, **kwargs: functional_call(model, state, args, kwargs, tie_weights=False)


def fake_args(fake: FakeTensorMode, inputs: Sequence[Any]) -> tuple[Any, ...]:
    """Real tensors among ``inputs`` as fake ones; other values as they are."""
    return tuple(fake.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)


def fake_kwargs(fake: FakeTensorMode, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``fake_args`` of keyword inputs."""
    return dict(zip(kwargs, fake_args(fake, tuple(kwargs.values()))))


def spec_args(specs: Sequence[dict[str, Any]], device: torch.device) -> tuple[Any, ...]:
    """Inputs rebuilt from a plan's input specs (zeros of the recorded shape and dtype; under
    a FakeTensorMode, fake ones)."""
    return tuple(_from_spec(spec, device, f"example input {i}") for i, spec in enumerate(specs))


def spec_kwargs(specs: Mapping[str, dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """``spec_args`` of keyword inputs."""
    return {name: _from_spec(spec, device, f"keyword input {name!r}")
            for name, spec in specs.items()}


def _from_spec(spec: dict[str, Any], device: torch.device, what: str) -> Any:
    if "shape" in spec:
        dtype = DTYPES.get(str(spec.get("dtype")))
        if dtype is None:
            raise PlanMismatch(
                f"apply: the plan's {what} has dtype {spec.get('dtype')!r}, not one of "
                f"{sorted(DTYPES)}; pass inputs=(...) to memplan.apply.")
        t = torch.zeros(spec["shape"], dtype=dtype, device=device)
        return t.requires_grad_(bool(spec.get("requires_grad")))
    if "value" in spec:
        return spec["value"]
    if "dict" in spec:
        return {k: _from_spec(v, device, f"{what}[{k!r}]") for k, v in spec["dict"].items()}
    for kind, container in (("list", list), ("tuple", tuple)):
        if kind in spec:
            return container(_from_spec(v, device, f"{what}[{i}]")
                             for i, v in enumerate(spec[kind]))
    raise PlanMismatch(
        f"apply: the plan's {what} is a {spec.get('type')}, which cannot be rebuilt to check "
        "the plan; pass inputs=(...) to memplan.apply.")


@contextlib.contextmanager
def kept_python_state(model: nn.Module) -> Iterator[None]:
    """Restore the attributes of ``model``'s modules that a forward rebinds (call counters,
    cached shapes, a fake tensor kept as an attribute, training flags): forwards on fake
    tensors (capture, plan, apply's check) leave the model as they found it. Changes inside
    mutable attributes (a list a forward appends to) are not undone."""
    saved = [(m, dict(m.__dict__)) for m in model.modules()]
    try:
        yield
    finally:
        for m, before in saved:
            now = m.__dict__
            for key in [k for k in now if k not in before]:
                del now[key]
            for key, value in before.items():
                if now.get(key, _MISSING) is not value:
                    now[key] = value


_MISSING = object()


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Training mode for the forward (submodules the user set to eval stay so when the model
    trains); the model's attributes and the RNG state restored after it."""
    rng = torch.get_rng_state()
    with kept_python_state(model):
        if not model.training:
            model.train()
        try:
            yield
        finally:
            torch.set_rng_state(rng)


@contextlib.contextmanager
def autocast_as(autocast: dict[str, str] | None) -> Iterator[None]:
    """Autocast on for each device of ``autocast`` (device -> dtype), as at capture."""
    with contextlib.ExitStack() as stack:
        for kind, dtype in (autocast or {}).items():
            stack.enter_context(torch.autocast(kind, dtype=DTYPES[dtype]))
        yield


def real_forward(model: nn.Module, args: Sequence[Any], loss_fn: Callable[[Any], Any] | None = None,
                 autocast: dict[str, str] | None = None,
                 kwargs: Mapping[str, Any] | None = None) -> None:
    """One real training-mode forward (and loss) under ``no_grad``: what sizes data-dependent
    ops (``datadep``). Buffers are updated on copies; the model's parameters, buffers,
    training mode and the RNG are left as they were."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with untouched(model), torch.no_grad(), autocast_as(autocast):
        out = functional_call(model, functional_state(model, buffers), tuple(args),
                              dict(kwargs or {}), tie_weights=False)
        if loss_fn is not None:
            loss_fn(out)


def model_device(model: nn.Module) -> torch.device:
    return next(iter(model.parameters()), torch.empty(0)).device


def fake_forward(model: nn.Module, inputs: Sequence[Any] | None,
                 specs: Sequence[dict[str, Any]] = (), autocast: dict[str, str] | None = None,
                 within: Sequence[contextlib.AbstractContextManager[Any]] = (),
                 kwargs: Mapping[str, Any] | None = None,
                 kwarg_specs: Mapping[str, dict[str, Any]] | None = None) -> Any:
    """One training-mode forward of ``model`` on fake tensors, from real example ``inputs``
    and ``kwargs`` (or, when ``inputs`` is None, from the input ``specs`` and
    ``kwarg_specs``), under ``autocast`` and the context managers ``within``; returns its
    (fake) output. The model's parameters, buffers, attributes, training mode and the RNG
    are left as they were."""
    device = model_device(model)
    with untouched(model), fake_mode(on_meta(model)) as fake:
        params, buffers = fake_state(fake, model)
        if inputs is None:
            args, kw = spec_args(specs, device), spec_kwargs(kwarg_specs or {}, device)
        else:
            args, kw = fake_args(fake, inputs), fake_kwargs(fake, kwargs or {})
        with autocast_as(autocast), contextlib.ExitStack() as stack:
            for cm in within:
                stack.enter_context(cm)
            stack.enter_context(torch.enable_grad())
            return fake_call(model, params, buffers)(*args, **kw)
